"""The model wrapper, written once for Keras 3 and tf-keras: :class:`ModelHost`,
the mixin under each Keras' public ``GradientAccumulateModel``.

It imports no Keras: the public class has its Keras' ``_flavour`` (a
``hosts.flavour.Flavour``, set in the public class). One
micro-batch's forward and backward pass is
in ``hosts/micro_batch.py``, the in-step slices (Keras 3) in
``hosts/in_step.py``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import tensorflow as tf

from gradient_accumulator.core.links import Binding
from gradient_accumulator.core.saved_state import weight_names
from gradient_accumulator.core.settings import SAVED, Settings, warn_05_model_arguments
from gradient_accumulator.core.validation import (
    check_single_accumulation,
    take_05_keywords,
)
from gradient_accumulator.hosts import loss_scale
from gradient_accumulator.hosts.batch_norm import AccumBatchNorm
from gradient_accumulator.hosts.flavour import Flavour
from gradient_accumulator.hosts.functional_variants import functional_variant
from gradient_accumulator.hosts.in_step import in_step_train_step
from gradient_accumulator.hosts.micro_batch import (
    MicroBatchPass,
    computes_own_loss,
    end_micro_step,
    micro_batch_pass,
)
from gradient_accumulator.hosts.partial_cycles import (
    PartialCycles,
    fit_with_partial_cycles,
)

_NAME = "GradientAccumulateModel"
_PARTIAL_CYCLES: dict = {}  # each Keras' fit callback (_partial_cycles)


class ModelHost:
    """What ``GradientAccumulateModel`` adds to a Keras ``Model``; see the
    public class of each Keras for its use."""

    # The flavour of its Keras: each Keras' public class sets it.
    _flavour: Flavour

    def __init__(
        self,
        accum_steps: int = Settings.accum_steps,
        mixed_precision: bool = False,
        use_agc: bool = Settings.use_agc,
        clip_factor: float = Settings.clip_factor,
        eps: float = Settings.eps,
        experimental_distributed_support: bool = False,
        micro_batch_size: int | None = Settings.micro_batch_size,
        gradient_cache: bool | str = Settings.gradient_cache,
        partial_cycle: str = Settings.partial_cycle,
        flush_at_end: bool = Settings.flush_at_end,
        skip_update_fn: Callable[[list, list], tf.Tensor] | None = None,
        progress_logs: bool = Settings.progress_logs,
        loss_denominator: str | Callable | None = Settings.loss_denominator,
        *args,
        **kwargs,
    ):
        if self._is_tensor_structure(accum_steps):
            # Keras' functional code may pass (inputs, outputs) positionally.
            args = (accum_steps, mixed_precision, *args)
            accum_steps, mixed_precision = 1, False
        check_in_step(self._flavour, _NAME, micro_batch_size, gradient_cache)
        settings = Settings(
            accum_steps=accum_steps,
            use_agc=take_05_keywords(kwargs, use_agc),
            clip_factor=clip_factor,
            eps=eps,
            micro_batch_size=micro_batch_size,
            gradient_cache=gradient_cache,
            partial_cycle=partial_cycle,
            flush_at_end=flush_at_end,
            progress_logs=progress_logs,
            skip_update_fn=skip_update_fn,
            loss_denominator=loss_denominator,
        )
        warn_05_model_arguments(mixed_precision, experimental_distributed_support)
        if self._flavour.functional_arguments(args, kwargs):
            # Before Keras sees them (see hosts/functional_variants.py).
            self.__class__ = functional_variant(
                type(self),
                self._flavour,
                kwargs.get("inputs", args[0] if args else None),
                namespace=self._variant_namespace,
            )
        super().__init__(*args, **kwargs)
        self._start_accumulating(settings)

    @classmethod
    def _variant_namespace(cls, public: type) -> dict:
        """Extra class attributes of the functional variant of ``public``."""
        return {}

    @classmethod
    def _is_tensor_structure(cls, value) -> bool:
        """Whether ``value`` is a symbolic tensor or a structure of them."""
        if isinstance(value, int | float | bool | type(None)):
            return False
        symbolic = cls._flavour.keras_tensor
        return any(isinstance(t, symbolic) for t in tf.nest.flatten(value))

    def _start_accumulating(self, settings: Settings) -> None:
        """Gives this model its accumulation settings and (empty) state; also
        for a model made accumulating after construction (``accumulate``).
        :meth:`_stop_accumulating` undoes it."""
        self._flavour.untracked(self, lambda: self._hold_state(settings))

    def _hold_state(self, settings: Settings) -> None:
        self._accumulation_settings = settings
        self._accumulator = accumulator = self._flavour.engine(
            settings, name="accumulator"
        )
        self._flavour.own_state(self, "_accumulator", accumulator)
        # Whether the traced step is Keras' own (see _plan_step); None until
        # a train function is made for this compile().
        self._runs_keras_step: bool | None = None
        accumulator.bind(
            Binding(
                variables=lambda: self.trainable_variables,
                apply_fn=lambda: self._apply_fn(self.trainable_variables),
                hooks=lambda: loss_scale.scale_hooks(self._flavour, self.optimizer),
                strategy=lambda: self.distribute_strategy,
                names=self._weight_names,
            )
        )

    def _weight_names(self, variables) -> list[str]:
        """Each variable's place in ``self.weights``: Keras' own order, the
        one ``get_weights`` and weight files use, so the same in another
        instance of the model (paths of auto-named layers are not)."""
        return weight_names(self.weights, variables)

    def _stop_accumulating(self) -> None:
        """Removes what :meth:`_start_accumulating` gave this model, its
        checkpoint dependency on the state included."""
        self._link_batch_norm(follow=False)
        self._flavour.untracked(self, self._release_state)

    def _release_state(self) -> None:
        self._flavour.disown_state(self, "_accumulator")
        names = (
            "_accumulation_settings",
            "_accumulator",
            "_runs_keras_step",
            "_end_of_fit",
            "_warned_own_loss",
        )
        for name in names:
            if name in vars(self):
                delattr(self, name)

    # ----------------------------------------------------------------- config
    @property
    def accum_steps(self) -> int:
        """Micro-batches per update (the latest value set)."""
        return self._accumulator.accum_steps

    @property
    def _partial_cycle(self) -> str:
        return self._accumulation_settings.partial_cycle

    @property
    def _flush_at_end(self) -> bool:
        return self._accumulation_settings.flush_at_end

    def set_accum_steps(self, accum_steps: int) -> None:
        """Changes ``accum_steps`` from the next cycle boundary on.

        The cycle in progress completes with the length it started with, so
        partial sums never mix two cycle lengths. See
        :class:`~gradient_accumulator.AccumulationScheduler`.
        """
        if self._accumulator.set_accum_steps(accum_steps) and self._runs_keras_step:
            # The traced step is Keras' own, which knows nothing of cycles.
            self.make_train_function(force=True)

    def flush(self) -> None:
        """Applies the micro-batches of the current, incomplete cycle now, with
        the gradient a big batch of just those micro-batches would give."""
        if self._accumulator.pending:
            # Also on a model just loaded, which has traced no step yet.
            self._link_batch_norm(follow=True)
        self._accumulator.flush(self.distribute_strategy)

    def drop_partial_cycle(self) -> None:
        """Discards the micro-batches of the current, incomplete cycle."""
        if self._accumulator.pending:
            self._link_batch_norm(follow=True)
        self._accumulator.drop(self.distribute_strategy)

    def fit(self, *args, **kwargs):
        """Trains as Keras' ``Model.fit`` does, one micro-batch per step.

        ``batch_size`` is the micro-batch: with ``accum_steps=K`` each
        update uses the gradient of ``K * batch_size`` samples (with
        ``micro_batch_size`` set, each ``batch_size`` batch is cut into
        slices instead). The model's ``partial_cycle`` policy runs at every
        epoch end; see ``GradientAccumulateModel``.
        """
        return fit_with_partial_cycles(
            super().fit,
            self,
            _partial_cycles(self._flavour.keras),
            self._flavour.keras.callbacks.CallbackList,
            args,
            kwargs,
        )

    def compile(self, *args, **kwargs):
        """Keras' ``compile``. Refuses an optimizer with Keras' own
        ``gradient_accumulation_steps`` (it would accumulate twice), and
        rebuilds the accumulation state if the trainable variables changed
        (a pending partial cycle is then dropped, with a warning)."""
        # The defaults are the model class's own (keras-hub tasks have theirs).
        optimizer = args[0] if args else kwargs.get("optimizer")
        if isinstance(optimizer, dict):  # a config, as compile() accepts
            try:
                optimizer = self._flavour.keras.optimizers.get(optimizer)
            except (TypeError, ValueError):
                optimizer = None  # compile() reports a bad config itself
        check_single_accumulation(optimizer, _NAME, self.accum_steps)
        super().compile(*args, **kwargs)
        # Nothing traced for the last compile (flush functions, the plan)
        # survives it; the state follows the trainable variables of now.
        self._accumulator.unwire()
        self._runs_keras_step = None
        self._sync_state()

    def compile_from_config(self, config):
        # Keras skips compile() on loading a model whose class overrides it;
        # ours only adds to Keras' compile, so loading compiles as usual.
        self.compile(**self._flavour.keras.saving.deserialize_keras_object(config))
        if getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        self._sync_state()
        _build_optimizer(self)
        self._plan_step()
        return super().make_train_function(force=force)

    def _sync_state(self) -> None:
        """Builds the accumulation state for the current trainable variables
        (eager; nothing happens when it already fits them)."""
        if not self.built or not self.weights:
            # A subclassed model creates its variables in its first call:
            # built at its first train step. (``build(shape)`` may mark one
            # built before any of its layers has a variable.)
            return
        accumulator = self._accumulator
        pending = accumulator.pending
        with self.distribute_strategy.scope():
            rebuilt = accumulator.build(self.trainable_variables)
        if rebuilt and pending:
            warnings.warn(
                f"{_NAME}: the trainable variables changed, so "
                f"the {pending} micro-batch(es) of an incomplete cycle were "
                "dropped (their gradients are of another set of variables). "
                "fit() flushes a partial cycle at its end unless "
                "flush_at_end=False.",
                stacklevel=3,
            )

    def _plan_step(self) -> None:
        """Decides, from the state as it is now, whether the step to trace is
        Keras' own (``accum_steps`` 1, nothing to do per cycle), and links
        the BatchNormalization layers to the cycle if it is not."""
        self._runs_keras_step = (
            self._accumulation_settings.micro_batch_size is None
            and self._accumulator.plain()
        )
        self._link_batch_norm(follow=not self._runs_keras_step)
        if not self._runs_keras_step:
            self._warn_undeclared_loss()

    def _warn_undeclared_loss(self) -> None:
        """Warns once when the model computes its loss itself (no compiled
        loss) without saying what that loss divides a batch by."""
        if (
            self._accumulation_settings.loss_denominator is not None
            or getattr(self, "loss", None)
            or not computes_own_loss(self)
            or getattr(self, "_warned_own_loss", False)
        ):
            return
        self._warned_own_loss = True
        warnings.warn(
            f"{_NAME}: {type(self).__name__} computes its own loss "
            "(compute_loss, no compiled loss), which is taken to be a mean "
            "over samples: each micro-batch is weighed by its number of "
            "samples. If it is not, the update is not the big batch's: say "
            'what it divides by with loss_denominator="sum" (not divided) '
            "or loss_denominator=f(x, y, sample_weight) (e.g. the number of "
            'unmasked tokens); loss_denominator="samples" confirms the mean '
            "and silences this warning.",
            stacklevel=3,
        )

    def _link_batch_norm(self, follow: bool) -> None:
        """Makes every AccumBatchNormalization (nested models included)
        update its moving statistics on this model's cycle: one counter, and
        their sums ride in the gradients' single all-reduce. Off the engine
        path (``follow=False``) the layers act alone; both check their
        ``accum_steps`` against the model's."""
        steps = self._accumulator.accum_steps
        for layer in self._flavour.sublayers(self)[1:]:
            if isinstance(layer, AccumBatchNorm):
                layer.follow_model(self._accumulator, steps, link=follow)

    def _settings(self, saved: bool = True, serialize=None) -> dict:
        """The constructor arguments that reproduce this model's accumulation
        (``saved``: those a config holds, without ``skip_update_fn``;
        ``serialize``: see ``Settings.saved``)."""
        setup = self._accumulation_settings
        settings = setup.saved(serialize) if saved else dataclasses.asdict(setup)
        # A schedule may have changed accum_steps since construction.
        return {**settings, "accum_steps": self._accumulator.accum_steps}

    def get_config(self):
        # tf-keras saves a Functional subclass with its own __init__ by its
        # constructor arguments only, without the network.
        config = self._flavour.network_config(self) or super().get_config()
        # A loss_denominator function is saved as Keras saves a loss function.
        serialize = self._flavour.keras.saving.serialize_keras_object
        config.update(self._settings(serialize=serialize))
        return config

    # ``.keras`` files of a Keras that does not save the engine as its own
    # object (``model_state_key``): the state rides in the model's own entry,
    # under keys no layer weight has (a functional model has no weights of
    # its own).
    def save_own_variables(self, store) -> None:
        super().save_own_variables(store)
        prefix = self._flavour.model_state_key
        if prefix is not None:
            for key, variable in self._accumulator.state_items():
                store[prefix + key] = variable.numpy()

    def load_own_variables(self, store) -> None:
        prefix = self._flavour.model_state_key
        if prefix is None:
            super().load_own_variables(store)
            return
        keys = list(store.keys())
        state = {k[len(prefix) :]: store[k] for k in keys if k.startswith(prefix)}
        super().load_own_variables(
            {k: store[k] for k in keys if not k.startswith(prefix)}
        )
        self._accumulator.load_state(state)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Builds the model as Keras does, from its config without the
        accumulation settings, then gives it those (a subclass may set some
        itself in its ``__init__``: the saved ones win)."""
        config = dict(config)
        settings = {k: config.pop(k) for k in SAVED if k in config}
        model = cls._flavour.model_from_config(
            cls, config, custom_objects, super().from_config
        )
        model._take_settings(restored(cls._flavour, settings))
        return model

    def _take_settings(self, settings: dict) -> None:
        """Replaces the settings this model was built with by ``settings``
        (those of a saved or cloned model; the others stay), before it has
        traced a step: a fresh state for them, as construction gives."""
        taken = dataclasses.replace(self._accumulation_settings, **settings)
        if taken != self._accumulation_settings:
            # Not _stop_accumulating: no layer follows this state yet.
            self._flavour.untracked(self, self._release_state)
            self._start_accumulating(taken)

    # ---------------------------------------------------------------- training
    def train_step(self, data):
        if self._runs_keras_step is None:
            # Called outside fit (a custom loop): plan as fit would.
            self._plan_step()
        setup = self._accumulation_settings
        if setup.micro_batch_size is not None and not setup.gradient_cache:
            return self._in_step_train_step(data)
        if self._runs_keras_step:
            return super().train_step(data)
        unpack = self._flavour.keras.utils.unpack_x_y_sample_weight
        x, y, sample_weight = unpack(data)
        micro = self._micro_batch_pass(x, y, sample_weight)
        tracker = self._flavour.loss_tracker(self)
        if tracker is not None:
            tracker.update_state(micro.loss, sample_weight=micro.samples)
        self._add_parts(micro)
        end_micro_step(self, micro)
        logs = self.compute_metrics(x, y, micro.y_pred, sample_weight=sample_weight)
        return self._with_progress(logs)

    def _in_step_train_step(self, data):
        """One ``fit`` step cut into ``micro_batch_size`` slices (see
        ``hosts.in_step.in_step_train_step``)."""
        return in_step_train_step(self, data)

    def _micro_batch_pass(
        self, x, y, sample_weight, opens_step=None, step_samples=None
    ) -> MicroBatchPass:
        """Forward pass, loss, weight and gradients of one micro-batch (see
        ``hosts.micro_batch.micro_batch_pass``)."""
        return micro_batch_pass(self, x, y, sample_weight, opens_step, step_samples)

    def _add_parts(self, micro: MicroBatchPass) -> None:
        for index, (grads, weight, count) in enumerate(micro.parts, start=1):
            self._accumulator.add_part(index, grads, micro.variables, weight, count)

    def _with_progress(self, logs: dict) -> dict:
        if not self._accumulation_settings.progress_logs:
            return logs
        return {**logs, **self._accumulator.logs()}

    def _apply_fn(self, variables):
        flavour, apply = self._flavour, loss_scale.apply_gradients
        return lambda grads: apply(flavour, self.optimizer, grads, variables)


def check_in_step(
    flavour: Flavour, who: str, micro_batch_size, gradient_cache=False
) -> None:
    """Refuses ``micro_batch_size`` without ``gradient_cache`` where
    ``flavour``'s Keras has no in-step micro-batching (tf-keras), naming
    what to use instead."""
    if micro_batch_size is not None and not flavour.in_step and not gradient_cache:
        raise TypeError(
            f"{who} for {flavour.name} got micro_batch_size="
            f"{micro_batch_size!r}: `micro_batch_size` (in-step "
            f"micro-batching) is not available with {flavour.name} except "
            "with gradient_cache=True (for a loss that couples the batch); "
            "use accum_steps with fit(batch_size=...) instead."
        )


def restored(flavour: Flavour, settings: dict) -> dict:
    """``settings`` as read from a config: a ``loss_denominator`` function
    saved as its Keras config (a dict) is the function again, loaded as
    Keras loads a custom loss function (registered, or in custom_objects)."""
    value = settings.get("loss_denominator")
    if not isinstance(value, dict):
        return settings
    function = flavour.keras.saving.deserialize_keras_object(value)
    return {**settings, "loss_denominator": function}


def _build_optimizer(model: ModelHost) -> None:
    """Builds the optimizer before the step is traced: without a strategy
    Keras builds it in the first trace, and tf.function then traces again.
    (At fit, not compile: a user may still change it in between. A legacy
    tf-keras optimizer still makes its slots at its first apply.)"""
    flavour = model._flavour
    if model.built and model.weights and not flavour.optimizer_built(model.optimizer):
        with model.distribute_strategy.scope():
            flavour.build_optimizer(model.optimizer, model.trainable_variables)


def _partial_cycles(keras) -> type:
    """``hosts.partial_cycles.PartialCycles`` over ``keras``' ``Callback``."""
    if keras not in _PARTIAL_CYCLES:
        bases = (PartialCycles, keras.callbacks.Callback)
        _PARTIAL_CYCLES[keras] = type("_PartialCycles", bases, {})
    return _PARTIAL_CYCLES[keras]
