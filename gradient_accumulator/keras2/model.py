"""``GradientAccumulateModel`` for tf-keras: a ``tf.keras.Model`` (where
``tf.keras`` is tf-keras) whose ``fit`` accumulates."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import tensorflow as tf
import tf_keras

from gradient_accumulator._which_keras import TF_KERAS
from gradient_accumulator.core._tf_compat import keras_mask, with_keras_mask
from gradient_accumulator.core.links import Binding
from gradient_accumulator.core.saved_state import weight_names
from gradient_accumulator.core.settings import Settings, model_settings
from gradient_accumulator.core.split_gradients import micro_batch_gradients
from gradient_accumulator.core.validation import (
    check_single_accumulation,
)
from gradient_accumulator.core.weighting import backward_share, denominators
from gradient_accumulator.hosts.functional_variants import construct
from gradient_accumulator.hosts.partial_cycles import (
    PartialCycles,
    fit_with_partial_cycles,
)
from gradient_accumulator.keras2._compat import (
    GLOBAL_CUSTOM_NAMES,
    Functional,
    functional_config,
    loss_terms,
    reconstruct_from_config,
    track_state,
    untrack_state,
)
from gradient_accumulator.keras2.batch_norm import AccumBatchNormalization
from gradient_accumulator.keras2.inner_optimizers import apply_reduced
from gradient_accumulator.keras2.loss_scale import scale_hooks, scaler_of


@tf_keras.saving.register_keras_serializable(package="gradient_accumulator")
class GradientAccumulateModel(tf_keras.Model):
    """A tf-keras model that applies one optimizer update per
    ``accum_steps`` micro-batches, with the gradient of the concatenated big
    batch.

    Build it like a functional model (or subclass it) and train with
    ``fit``: ``fit(x, y, batch_size=8)`` with ``accum_steps=4`` trains like
    ``batch_size=32`` while holding 8 samples in memory. Each micro-batch is
    weighted by the denominator tf-keras' loss reduction used for it (its
    samples, or its unmasked entries under a Keras mask), so masks, sample
    weights and a short last micro-batch give exactly the big batch's
    gradient. ``optimizer.iterations``, schedules, clipping, weight decay and
    EMA advance once per update.

    Args: as the Keras 3 ``GradientAccumulateModel``, without
    ``micro_batch_size``.

    Example:

    >>> import numpy as np, tf_keras
    >>> from gradient_accumulator.keras2 import GradientAccumulateModel
    >>> inputs = tf_keras.Input((4,))
    >>> outputs = tf_keras.layers.Dense(1)(inputs)
    >>> model = GradientAccumulateModel(accum_steps=4, inputs=inputs, outputs=outputs)
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> history = model.fit(np.ones((32, 4)), np.ones((32, 1)), batch_size=8, verbose=0)
    >>> int(model.optimizer.iterations)  # 4 micro-batches of 8 -> one update
    1
    """

    def __init__(
        self,
        accum_steps: int = 1,
        mixed_precision: bool = False,
        use_agc: bool = False,
        clip_factor: float = 0.01,
        eps: float = 1e-3,
        experimental_distributed_support: bool = False,
        partial_cycle: str = "carry",
        flush_at_end: bool = True,
        skip_update_fn: Callable[[list, list], tf.Tensor] | None = None,
        progress_logs: bool = False,
        *args,
        **kwargs,
    ):
        if _is_tensor_structure(accum_steps):
            # (inputs, outputs) given positionally, as tf-keras' own code may.
            args = (accum_steps, mixed_precision, *args)
            accum_steps, mixed_precision = 1, False
        settings = model_settings(
            kwargs,
            mixed_precision,
            experimental_distributed_support,
            accum_steps=accum_steps,
            use_agc=use_agc,
            clip_factor=clip_factor,
            eps=eps,
            partial_cycle=partial_cycle,
            flush_at_end=flush_at_end,
            skip_update_fn=skip_update_fn,
            progress_logs=progress_logs,
        )
        if _functional_arguments(args, kwargs):
            construct(
                self,
                super().__init__,
                args,
                kwargs,
                host=GradientAccumulateModel,
                functional=Functional,
                variants=_functional_variants,
                namespace=lambda cls: {},
                register=_register_variant,
                keras=TF_KERAS,
            )
        else:
            super().__init__(*args, **kwargs)
        self._start_accumulating(settings)

    @tf.__internal__.tracking.no_automatic_dependency_tracking
    def _start_accumulating(self, settings: Settings) -> None:
        self._setup = settings
        # Not tracked as a layer's attribute (its variables would join the
        # model's weights); a checkpoint dependency of its own instead.
        self._accumulator = accumulator = settings.accumulator()
        track_state(self, "_accumulator", accumulator)
        self._plain: bool | None = None
        accumulator.bind(
            Binding(
                variables=lambda: self.trainable_variables,
                apply_fn=lambda: self._apply_fn(self.trainable_variables),
                hooks=lambda: scale_hooks(self.optimizer),
                strategy=lambda: self.distribute_strategy,
                names=self._weight_names,
            )
        )

    def _weight_names(self, variables) -> list[str]:
        """Each variable's place in ``self.weights`` (the order weight files
        use), so the same in another instance of the model."""
        return weight_names(self.weights, variables)

    # ``.keras`` files: the state rides in the model's own entry, under keys
    # no layer weight has (a functional model has no weights of its own).
    def save_own_variables(self, store) -> None:
        super().save_own_variables(store)
        for key, variable in self._accumulator.state_items():
            store[_STATE_KEY + key] = variable.numpy()

    def load_own_variables(self, store) -> None:
        keys = list(store.keys())
        state = {
            k[len(_STATE_KEY) :]: store[k] for k in keys if k.startswith(_STATE_KEY)
        }
        super().load_own_variables(
            {k: store[k] for k in keys if not k.startswith(_STATE_KEY)}
        )
        self._accumulator.load_state(state)

    @tf.__internal__.tracking.no_automatic_dependency_tracking
    def _stop_accumulating(self) -> None:
        """Removes what :meth:`_start_accumulating` gave this model, its
        checkpoint dependency on the state included (``stop_accumulating``)."""
        self._link_batch_norm(follow=False)
        untrack_state(self, "_accumulator")
        for name in ("_setup", "_accumulator", "_plain", "_end_of_fit"):
            if name in vars(self):
                delattr(self, name)

    # ----------------------------------------------------------------- config
    @property
    def accum_steps(self) -> int:
        """Micro-batches per update (the latest value set)."""
        return self._accumulator.accum_steps

    @property
    def _partial_cycle(self) -> str:
        return self._setup.partial_cycle

    @property
    def _flush_at_end(self) -> bool:
        return self._setup.flush_at_end

    def set_accum_steps(self, accum_steps: int) -> None:
        """Changes ``accum_steps`` from the next cycle boundary on."""
        if self._accumulator.set_accum_steps(accum_steps) and self._plain:
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
        """Trains as ``tf.keras.Model.fit`` does, one micro-batch per step;
        the model's ``partial_cycle`` policy runs at every epoch end."""
        return fit_with_partial_cycles(
            super().fit,
            self,
            _PartialCycles,
            tf_keras.callbacks.CallbackList,
            args,
            kwargs,
        )

    def compile(self, *args, **kwargs):
        """tf-keras' ``compile``; rebuilds the accumulation state if the
        trainable variables changed (a pending partial cycle is then
        dropped, with a warning)."""
        optimizer = args[0] if args else kwargs.get("optimizer")
        check_single_accumulation(
            optimizer, "GradientAccumulateModel", self.accum_steps
        )
        super().compile(*args, **kwargs)
        self._accumulator.unwire()
        self._plain = None
        self._sync_state()

    def compile_from_config(self, config):
        # tf-keras skips compile() on loading a model whose class overrides
        # it; ours only adds to it, so loading compiles as usual.
        self.compile(**tf_keras.saving.deserialize_keras_object(config))
        if getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        self._sync_state()
        self._plan_step()
        return super().make_train_function(force=force)

    def _plan_step(self) -> None:
        """Decides, from the state now, whether the step to trace is
        tf-keras' own, and links the AccumBatchNormalization layers to the
        cycle if it is not."""
        self._plain = self._accumulator.plain()
        self._link_batch_norm(follow=not self._plain)

    def _link_batch_norm(self, follow: bool) -> None:
        """Makes every AccumBatchNormalization (nested models included)
        update its moving statistics on this model's cycle: one counter, and
        their sums ride in the gradients' single all-reduce."""
        steps = self._accumulator.accum_steps
        for layer in self.submodules:
            if isinstance(layer, AccumBatchNormalization):
                layer.follow_model(self._accumulator, steps, link=follow)

    def _sync_state(self) -> None:
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
                f"GradientAccumulateModel: the trainable variables changed, so "
                f"the {pending} micro-batch(es) of an incomplete cycle were "
                "dropped.",
                stacklevel=3,
            )

    def get_config(self):
        # tf-keras saves a Functional subclass with its own __init__ by its
        # constructor arguments only, without the network.
        config = functional_config(self) or super().get_config()
        settings = self._setup.saved()
        settings.pop("micro_batch_size")
        config.update(settings, accum_steps=self._accumulator.accum_steps)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        names = [f.name for f in dataclasses.fields(Settings)]
        settings = {k: config.pop(k) for k in names if k in config}
        if all(k in config for k in ("layers", "input_layers", "output_layers")):
            inputs, outputs, _ = reconstruct_from_config(config, custom_objects)
            return cls(
                inputs=inputs, outputs=outputs, name=config.get("name"), **settings
            )
        return cls(**config, **settings)

    # ---------------------------------------------------------------- training
    def train_step(self, data):
        if self._plain is None:
            self._plan_step()  # called outside fit (a custom loop)
        if self._plain:
            return super().train_step(data)
        x, y, sample_weight = tf_keras.utils.unpack_x_y_sample_weight(data)
        accumulator = self._accumulator
        # Several denominators take more than one backward pass of the tape
        # (the loss terms are known once the first compute_loss built them),
        # and so may an overflow under a loss scale (below).
        scaler = scaler_of(self.optimizer)
        persistent = scaler is not None or len(loss_terms(self)) != 1
        with tf.GradientTape(persistent=persistent) as tape:
            y_pred = self(x, training=True)
            if not accumulator.built:
                # A subclassed model creates its variables in the forward pass.
                with tf.init_scope(), self.distribute_strategy.scope():
                    accumulator.build(self.trainable_variables)
            loss = self.compute_loss(x, y, _dividable(y_pred), sample_weight)
            groups = self._denominators(x, y_pred)
            if self.losses and groups[0].sums:
                # The big batch adds the regularisation losses once: only the
                # micro-batch that opens the cycle (count > 0) keeps them.
                penalty = tf.add_n([tf.cast(p, loss.dtype) for p in self.losses])
                keep = tf.cast(groups[0].count > 0, loss.dtype)
                loss = loss - (1.0 - keep) * penalty / self._replicas()
            loss_weight, unscale = self._weights(groups)
            objective = loss * tf.cast(loss_weight, loss.dtype)
            if scaler is not None:
                objective = scaler.get_scaled_loss(objective)
        variables = self.trainable_variables
        outputs = tf.nest.flatten(y_pred)
        found = micro_batch_gradients(
            tape,
            objective,
            variables,
            groups,
            outputs=[outputs[t.path[0]] for t in loss_terms(self)]
            if len(groups) > 1
            else (),
            unscale=unscale,
            # As in the Keras 3 model wrapper: an overflow of this
            # micro-batch's own sums is redone at a smaller seed, not skipped.
            retry_scale=None if scaler is None else scaler.loss_scale,
        )
        for index, (own, weight, count) in enumerate(found.parts, start=1):
            accumulator.add_part(index, own, variables, weight, count)
        on_apply, on_skip = scale_hooks(self.optimizer)
        accumulator.step(
            found.grads,
            variables,
            apply_fn=self._apply_fn(variables),
            weight=found.weight,
            count=groups[0].count,
            samples=_batch_size(x),
            on_apply=on_apply,
            on_skip=on_skip,
            overflowed=found.overflowed,
        )
        logs = self.compute_metrics(x, y, y_pred, sample_weight)
        if self._setup.progress_logs:
            logs = {**logs, **accumulator.logs()}
        return logs

    def _replicas(self) -> int:
        return self.distribute_strategy.num_replicas_in_sync

    def _denominators(self, x, y_pred):
        """The micro-batch's loss terms by denominator, each with its weight
        and count (see ``weighting.denominators``).

        tf-keras divides a mean-reduced loss (and the regularisation losses)
        by the replica count and lets the optimizer sum the replicas; a
        ``"sum"``-reduced term it does not divide. The engine takes a
        weighted mean over replicas, so a mean group is weighted by the
        replica count too, and a summed one counts ``1 / replicas`` per
        replica.
        """
        replicas = self._replicas()
        groups = denominators(
            loss_terms(self),
            tf.nest.flatten(y_pred),
            None,
            _batch_size(x),
            self._accumulator.opens_cycle,
        )
        for group in groups:
            if group.sums:
                group.count = group.count / replicas
            else:
                group.weight = tf.stop_gradient(group.weight) * replicas
        return groups

    def _weights(self, groups):
        """``(loss_weight, unscale)``: what the micro-batch's loss is
        multiplied by before the backward pass, and what its gradients are
        multiplied by besides their group's weight (None: the weight is in
        the loss). Under a loss scale the weight goes on the gradients with
        the unscaling, and the loss is divided by its share of the cycle
        first (``weighting.backward_share``), so that float16 sees the big
        batch's magnitudes.
        """
        scaler = scaler_of(self.optimizer)
        if scaler is None:
            if len(groups) > 1:
                return 1.0, 1.0
            return groups[0].weight, None
        sums = len(groups) == 1 and groups[0].sums
        share = tf.stop_gradient(backward_share(sums, self._accumulator.cycle_length()))
        return share, 1.0 / (scaler.loss_scale * share)

    def _apply_fn(self, variables):
        return lambda grads: apply_reduced(self.optimizer, grads, variables)


# ``.h5`` files name a model by its bare class name (``.keras`` files by the
# registered one): loading them needs no custom_objects either.
tf_keras.utils.get_custom_objects()[GradientAccumulateModel.__name__] = (
    GradientAccumulateModel
)


_functional_variants: dict[type, type] = {}
_STATE_KEY = "accumulator:"


def _register_variant(variant: type, cls: type) -> None:
    # Saved files must name the public class, which rebuilds the variant.
    GLOBAL_CUSTOM_NAMES[variant] = tf_keras.saving.get_registered_name(cls)


def _functional_arguments(args, kwargs) -> bool:
    """Whether a model is built from ``inputs`` and ``outputs`` (tf-keras'
    rule: both positional, the first positional, or both keywords)."""
    return (
        len(args) == 2
        or (len(args) == 1 and "outputs" in kwargs)
        or ("inputs" in kwargs and "outputs" in kwargs)
    )


def _is_tensor_structure(value) -> bool:
    """Whether ``value`` is a symbolic tensor or a structure of them."""
    if isinstance(value, int | float | bool | type(None)):
        return False
    return any(
        isinstance(t, tf_keras.__internal__.KerasTensor) for t in tf.nest.flatten(value)
    )


class _PartialCycles(PartialCycles, tf_keras.callbacks.Callback):
    """``hosts.partial_cycles.PartialCycles`` for tf-keras."""


def _dividable(y_pred):
    """``y_pred`` with every mask that holds no unmasked entry replaced by
    ones.

    tf-keras' masked mean divides by the number of unmasked entries without
    guarding 0 (Keras 3 guards it), so a micro-batch of padding alone has a
    NaN loss, and weight 0 times NaN is NaN: the finite check would then
    drop its whole cycle. Its weight and count (``_denominators``) come from
    the real mask, 0, so the finite mean taken instead adds nothing, as the
    padding adds nothing to the big batch's mean.
    """

    def dividable(output):
        mask = keras_mask(output)
        if mask is None:
            return output
        some = tf.reduce_any(tf.cast(mask, tf.bool))
        return with_keras_mask(output, tf.where(some, mask, tf.ones_like(mask)))

    return tf.nest.map_structure(dividable, y_pred)


def _batch_size(x):
    first = next(t for t in tf.nest.flatten(x) if t is not None)
    return tf.shape(first)[0]
