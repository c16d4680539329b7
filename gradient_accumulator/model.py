"""``GradientAccumulateModel``: a ``keras.Model`` whose ``fit`` accumulates."""

from __future__ import annotations

import dataclasses
import functools
import re
import threading
import warnings
from collections.abc import Callable
from typing import NamedTuple

import keras
import tensorflow as tf

from gradient_accumulator._keras_compat import (
    GLOBAL_CUSTOM_NAMES,
    Functional,
    GraphRunHook,
    all_layers,
    apply_mask,
    call_has_training_arg,
    compute_loss,
    flat_losses,
    functional_from_config,
    functional_init_arguments,
    loss_tracker,
    unscale_loss_for_distribution,
)
from gradient_accumulator._which_keras import KERAS3
from gradient_accumulator.batch_norm import AccumBatchNormalization
from gradient_accumulator.core.arithmetic import overwritten
from gradient_accumulator.core.links import Binding
from gradient_accumulator.core.saved_state import weight_names
from gradient_accumulator.core.settings import Settings, model_settings
from gradient_accumulator.core.split_gradients import micro_batch_gradients
from gradient_accumulator.core.validation import (
    check_single_accumulation,
)
from gradient_accumulator.core.weighting import (
    at,
    backward_share,
    denominators,
    loss_share,
    sums_losses,
)
from gradient_accumulator.hosts.functional_variants import construct
from gradient_accumulator.hosts.partial_cycles import (
    PartialCycles,
    fit_with_partial_cycles,
)
from gradient_accumulator.loss_scale import (
    apply_gradients,
    loss_scale,
    scale_hooks,
    scaler_of,
)
from gradient_accumulator.tracked_engine import Accumulator

_DUPLICATE = re.compile(r"multiple values for keyword argument '(\w+)'")


@keras.saving.register_keras_serializable(package="gradient_accumulator")
class GradientAccumulateModel(GraphRunHook, keras.Model):
    """A Keras model that applies one optimizer update per ``accum_steps``
    micro-batches, with the gradient of the concatenated big batch.

    Build it like a functional model (or subclass it) and train with ``fit``:
    ``fit(x, y, batch_size=8)`` with ``accum_steps=4`` trains like
    ``batch_size=32`` while holding 8 samples in memory.

    Each micro-batch is weighted by the denominator Keras' loss reduction uses
    for it (its number of samples, or of unmasked loss entries under a mask),
    so padded sequences, sample weights and a short last micro-batch all give
    exactly the big batch's gradient, whatever the reduction. Several loss
    terms must share one denominator (all sums, or all divided by the number
    of samples, by one mask's unmasked entries or by the same sample
    weights); other combinations cannot be exact with one divisor per cycle
    and are refused at the first step, naming the outputs.
    ``optimizer.iterations``, learning-rate schedules, clipping,
    weight decay and EMA all advance once per update.

    Args:
        accum_steps: micro-batches per optimizer update, an ``int >= 1``.
            ``1`` is plain Keras training.
        mixed_precision: accepted for gradient-accumulator 0.5.x
            compatibility and ignored: loss scaling is handled automatically.
        use_agc: apply adaptive gradient clipping to the accumulated gradient.
        clip_factor: adaptive gradient clipping factor (``> 0``).
        eps: adaptive gradient clipping epsilon (``> 0``).
        experimental_distributed_support: accepted for 0.5.x compatibility and
            ignored.
        partial_cycle: what happens at the end of each epoch to micro-batches
            that do not fill a cycle: ``"carry"`` (default) them into the next
            epoch, ``"flush"`` them (apply them as one smaller big batch) or
            ``"drop"`` them.
        flush_at_end: flush a carried partial cycle when ``fit`` ends, so no
            data is silently left unapplied (default ``True``).
        skip_update_fn: optional ``fn(grads, variables) -> bool tensor``,
            called with the accumulated mean gradient at the end of each
            cycle; True skips the cycle (non-finite cycles are always
            skipped). Not saved in ``.keras`` files.
        progress_logs: add ``update`` (1.0 on the steps that applied an
            update or skipped a cycle), ``grad_norm`` (global norm of the last
            applied mean gradient, before clipping) and ``effective_batch``
            (samples in the last applied cycle, over all replicas) to every
            step's logs (default ``False``: Keras' train function costs
            about 30 µs per log entry per step in Python, which a step-bound
            model feels).
        micro_batch_size: ``None`` (default) or an ``int >= 1``: in-step
            micro-batching. Each batch ``fit`` gives ``train_step`` is cut into
            slices of this many samples (per replica), run one after another
            inside the step with their gradients accumulated, so one ``fit``
            step is one micro-step of the cycle (one update with the default
            ``accum_steps=1``) while memory holds one slice's activations.
            Exact like the streaming mode: the gradient is the whole batch's.
        *args: passed to ``keras.Model``.
        **kwargs: passed to ``keras.Model`` (``inputs``, ``outputs``,
            ``name``, ...).

    Example:

    >>> import keras, numpy as np
    >>> from gradient_accumulator import GradientAccumulateModel
    >>> inputs = keras.Input((4,))
    >>> outputs = keras.layers.Dense(1)(inputs)
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
        micro_batch_size: int | None = None,
        partial_cycle: str = "carry",
        flush_at_end: bool = True,
        skip_update_fn: Callable[[list, list], tf.Tensor] | None = None,
        progress_logs: bool = False,
        *args,
        **kwargs,
    ):
        if _is_tensor_structure(accum_steps):
            # Keras' functional code may pass (inputs, outputs) positionally.
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
            micro_batch_size=micro_batch_size,
            partial_cycle=partial_cycle,
            flush_at_end=flush_at_end,
            skip_update_fn=skip_update_fn,
            progress_logs=progress_logs,
        )
        if functional_init_arguments(args, kwargs):
            _init_functional(self, super().__init__, args, kwargs)
        else:
            super().__init__(*args, **kwargs)
        self._start_accumulating(settings)

    def _start_accumulating(self, settings: Settings) -> None:
        """Gives this model its accumulation settings and (empty) state; also
        for a model made accumulating after construction (``accumulate``).
        :meth:`_stop_accumulating` undoes it."""
        self._setup = settings
        self._accumulator = accumulator = settings.accumulator(Accumulator)
        # Whether the traced step is Keras' own (see _plan_step); None until
        # a train function is made for this compile().
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
        """Each variable's place in ``self.weights``: Keras' own order, the
        one ``get_weights`` and weight files use, so the same in another
        instance of the model (paths of auto-named layers are not)."""
        return weight_names(self.weights, variables)

    def _stop_accumulating(self) -> None:
        """Removes what :meth:`_start_accumulating` gave this model."""
        self._link_batch_norm(follow=False)
        for name in ("_setup", "_accumulator", "_plain"):
            delattr(self, name)

    # ----------------------------------------------------------------- config
    @property
    def accum_steps(self) -> int:
        """Micro-batches per update (the latest value set)."""
        return self._accumulator.accum_steps

    @property
    def micro_batch_size(self) -> int | None:
        """Samples per in-step slice, or None (each batch is one micro-batch)."""
        return self._setup.micro_batch_size

    @property
    def _partial_cycle(self) -> str:
        return self._setup.partial_cycle

    @property
    def _flush_at_end(self) -> bool:
        return self._setup.flush_at_end

    def set_accum_steps(self, accum_steps: int) -> None:
        """Changes ``accum_steps`` from the next cycle boundary on.

        The cycle in progress completes with the length it started with, so
        partial sums never mix two cycle lengths. See
        :class:`~gradient_accumulator.AccumulationScheduler`.
        """
        if self._accumulator.set_accum_steps(accum_steps) and self._plain:
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
        """Trains as ``keras.Model.fit`` does, one micro-batch per step.

        ``batch_size`` is the micro-batch: with ``accum_steps=K`` each
        update uses the gradient of ``K * batch_size`` samples (with
        ``micro_batch_size`` set, each ``batch_size`` batch is cut into
        slices instead). The model's ``partial_cycle`` policy runs at every
        epoch end; see :class:`GradientAccumulateModel`.
        """
        return fit_with_partial_cycles(
            super().fit,
            self,
            _PartialCycles,
            keras.callbacks.CallbackList,
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
                optimizer = keras.optimizers.get(optimizer)
            except (TypeError, ValueError):
                optimizer = None  # compile() reports a bad config itself
        check_single_accumulation(
            optimizer, "GradientAccumulateModel", self.accum_steps
        )
        super().compile(*args, **kwargs)
        # Nothing traced for the last compile (flush functions, the plan)
        # survives it; the state follows the trainable variables of now.
        self._accumulator.unwire()
        self._plain = None
        self._sync_state()

    def _before_graph_run(self) -> None:
        # keras.models.clone_model runs the source's graph on new inputs and
        # then builds the clone from (inputs, outputs) alone: leave the
        # settings for that construction (a thread's latest run wins, and
        # only a positional construction reads them).
        if getattr(self, "_accumulator", None) is not None:  # not mid-__init__
            _clone_source.settings = self._settings(saved=False)

    def compile_from_config(self, config):
        # Keras skips compile() on loading a model whose class overrides it;
        # ours only adds to Keras' compile, so loading compiles as usual.
        self.compile(**keras.saving.deserialize_keras_object(config))
        if getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        self._sync_state()
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
                f"GradientAccumulateModel: the trainable variables changed, so "
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
        self._plain = self.micro_batch_size is None and self._accumulator.plain()
        self._link_batch_norm(follow=not self._plain)

    def _settings(self, saved: bool = True) -> dict:
        """The constructor arguments that reproduce this model's accumulation
        (``saved``: those a config holds, without ``skip_update_fn``)."""
        settings = self._setup.saved() if saved else dataclasses.asdict(self._setup)
        # A schedule may have changed accum_steps since construction.
        return {**settings, "accum_steps": self._accumulator.accum_steps}

    def get_config(self):
        config = super().get_config()
        config.update(self._settings())
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        functional = all(k in config for k in ("layers", "input_layers", "name"))
        while True:
            try:
                if functional:
                    return functional_from_config(
                        cls, dict(config), custom_objects=custom_objects
                    )
                return super().from_config(config, custom_objects=custom_objects)
            except TypeError as error:
                if not _drop_duplicate(error, config):
                    raise

    # ---------------------------------------------------------------- training
    def train_step(self, data):
        if self._plain is None:
            # Called outside fit (a custom loop): plan as fit would.
            self._plan_step()
        if self.micro_batch_size is not None:
            return self._in_step_train_step(data)
        accumulator = self._accumulator
        if self._plain:
            return super().train_step(data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        micro = self._micro_batch_gradients(x, y, sample_weight)
        loss_tracker(self).update_state(micro.loss, sample_weight=micro.samples)
        self._add_parts(micro)
        on_apply, on_skip = scale_hooks(self.optimizer)
        accumulator.step(
            micro.grads,
            micro.variables,
            apply_fn=self._apply_fn(micro.variables),
            weight=micro.grad_weight,
            count=micro.count,
            samples=micro.samples,
            on_apply=on_apply,
            on_skip=on_skip,
            overflowed=micro.overflowed,
        )
        logs = self.compute_metrics(x, y, micro.y_pred, sample_weight=sample_weight)
        return self._with_progress(logs)

    def _add_parts(self, micro: _Micro) -> None:
        for index, (grads, weight, count) in enumerate(micro.parts, start=1):
            self._accumulator.add_part(index, grads, micro.variables, weight, count)

    def _with_progress(self, logs: dict) -> dict:
        if not self._setup.progress_logs:
            return logs
        return {**logs, **self._accumulator.logs()}

    def _apply_fn(self, variables):
        return lambda grads: apply_gradients(self.optimizer, grads, variables)

    def _micro_batch_gradients(
        self, x, y, sample_weight, opens_step=None, step_samples=None
    ) -> _Micro:
        """Forward pass, loss, weight and gradients of one micro-batch.

        Shared by the streaming ``train_step`` (one micro-batch per step) and
        the in-step loop (one per slice). ``opens_step``: for a slice, whether
        it is its step's first (see :meth:`_denominators`);
        ``step_samples``: for a slice, the samples of its whole step.
        """
        accumulator = self._accumulator
        # Several denominators take more than one backward pass of the tape
        # (the loss terms are known once the first compute_loss built them),
        # and so may an overflow under a loss scale (below).
        persistent = (
            scaler_of(self.optimizer) is not None or len(flat_losses(self)) != 1
        )
        with tf.GradientTape(persistent=persistent) as tape:
            y_pred = self(x, training=True) if call_has_training_arg(self) else self(x)
            if not accumulator.built:
                # A subclassed model creates its variables in the forward pass.
                with tf.init_scope():
                    accumulator.build(self.trainable_weights)
            if not self.optimizer.built:
                # Without a strategy Keras builds the optimizer at its first
                # apply, but the loss scale is read (below) before that.
                with tf.init_scope():
                    self.optimizer.build(self.trainable_weights)
            loss = compute_loss(
                self,
                x=x,
                y=y,
                y_pred=y_pred,
                sample_weight=sample_weight,
                training=True,
            )
            # Keras divides each replica's loss by the replica count so that a
            # sum of replica gradients is a mean. The engine divides by the
            # summed micro-batch weights itself, so differentiate the per-replica
            # loss as it is.
            loss = unscale_loss_for_distribution(loss)
            terms = flat_losses(self)
            groups = self._denominators(x, y_pred, sample_weight, opens_step)
            weight, count = groups[0].weight, groups[0].count
            if self.losses and groups[0].sums and loss.shape.rank == 0:
                # A summed loss adds regularisation once per big batch:
                # only the micro-batch that opens the cycle (count 1) keeps
                # it (the weights, hence the penalty, are the same all cycle).
                penalty = tf.add_n([tf.cast(p, loss.dtype) for p in self.losses])
                penalty = unscale_loss_for_distribution(penalty)
                loss = loss - (1.0 - tf.cast(count, loss.dtype)) * penalty
            scale = loss_scale(self.optimizer)
            float8 = len(groups) == 1 and _has_overwritten(self)
            if scale is not None and not float8:
                # A micro-batch's mean loss gives each of its samples about
                # accum_steps times the part of the backward pass it has in
                # the big batch, so float16 would overflow (and skip the
                # cycle) where the big batch does not: the loss is divided
                # by that factor first. The gradients are unscaled by it and
                # by the loss scale, so the sums stay in one unit and exactly
                # weighted whatever the factor. A summed loss needs none.
                loss_weight = self._share_of_cycle(x, step_samples)
                unscale = 1.0 / (scale * loss_weight)
            elif len(groups) > 1 or float8:
                # Each denominator's weight goes on its own gradients. float8
                # layers record the backward pass's magnitudes (their
                # output-gradient amax) as Keras' own accumulation does: from
                # the micro-batch's own loss, so the weight goes on the
                # gradients; unscaling there keeps every sum in one unit.
                loss_weight = 1.0
                unscale = 1.0 if scale is None else 1.0 / scale
            else:
                # Weighting the scalar loss rather than the gradients spares
                # a multiply over every gradient element on every micro-step.
                loss_weight, unscale = tf.stop_gradient(weight), None
            objective = self.optimizer.scale_loss(loss * loss_weight)

        variables = self.trainable_weights
        found = micro_batch_gradients(
            tape,
            objective,
            variables,
            groups,
            outputs=[at(y_pred, t.path) for t in terms] if len(groups) > 1 else (),
            unscale=unscale,
            # A micro-batch's gradients sum its own samples, which need not
            # cancel as the big batch's do: an overflow the big batch need
            # not have is recomputed at a smaller seed instead of skipping
            # the cycle. float8 layers record their backward pass and are
            # not differentiated twice.
            retry_scale=None if float8 else scale,
        )
        return _Micro(
            grads=found.grads,
            variables=variables,
            y_pred=y_pred,
            loss=loss,
            weight=weight,
            count=count,
            samples=_batch_size(x),
            grad_weight=found.weight,
            parts=found.parts,
            overflowed=found.overflowed,
        )

    def _share_of_cycle(self, x, step_samples=None) -> tf.Tensor:
        """``weighting.backward_share`` of this micro-batch or slice."""
        part = None
        if step_samples is not None:
            samples = tf.cast(_batch_size(x), tf.float32)
            part = samples / tf.cast(step_samples, tf.float32)
        share = backward_share(
            sums_losses(flat_losses(self)), self._accumulator.cycle_length(), part
        )
        return tf.stop_gradient(share)

    def _in_step_train_step(self, data):
        """One ``fit`` step = the batch cut into ``micro_batch_size`` slices,
        accumulated one after another, then one micro-step of the cycle.

        The full slices run in a ``tf.while_loop`` with
        ``parallel_iterations=1``, so only one slice's activations and
        gradients are alive at a time; a short remainder slice (a batch not
        divisible by the slice size) runs after the loop, in a ``tf.cond``.
        Slices are added to the replica-local sums only (``Accumulator.add``:
        no communication, no ``merge_call``, hence legal in a loop body under
        a strategy), which ``open_sums`` readies once before the loop; the one
        ``end_micro_step`` after them decides, all-reduces and applies. Full
        slices have the static size ``micro_batch_size`` and the remainder's
        size derives from the batch's shape only, which keeps every slice
        shape a compile-time constant under XLA.
        """
        accumulator = self._accumulator
        size = self.micro_batch_size
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        batch = _batch_size(x)
        full = batch // size
        # A subclassed model called outside fit may build its variables (and
        # so the sums) only in its first slice: its adds clear the sums.
        opened = accumulator.built
        if opened:
            accumulator.open_sums(self.trainable_weights)
        # Which variables get gradients is structural: the same in every
        # slice, recorded when the slice is traced (run, when eager).
        present: list[list[bool]] = []

        def run_slice(start, length):
            pick = functools.partial(_slice, start=start, length=length)
            xs, ys, ws = (tf.nest.map_structure(pick, t) for t in (x, y, sample_weight))
            opens_step = tf.equal(start, 0)
            micro = self._micro_batch_gradients(
                xs, ys, ws, opens_step=opens_step, step_samples=batch
            )
            self._add_parts(micro)
            present.append(
                accumulator.add(
                    micro.grads,
                    micro.variables,
                    weight=micro.grad_weight,
                    count=micro.count,
                    samples=micro.samples,
                    empty=False if opened else None,
                    overflowed=micro.overflowed,
                )
            )
            # Keras' stateful metrics keep additive totals (sums and counts,
            # confusion counts), so updating them slice by slice equals one
            # update with the whole batch.
            self.compute_metrics(xs, ys, micro.y_pred, sample_weight=ws)
            loss = tf.cast(micro.loss, tf.float32)
            # This slice's share of the batch's loss: loss * weight summed
            # over slices, divided by the batch's denominator, is the batch's
            # loss (for a "sum" reduction the denominator is 1 per batch).
            share = loss_share(flat_losses(self), micro.count, opens_step)
            # reduce_sum: scalars of a known shape (loop variables must keep
            # theirs), also from a traced but never run empty remainder.
            return (
                tf.reduce_sum(loss * tf.cast(micro.weight, tf.float32)),
                tf.reduce_sum(share),
            )

        def body(i, loss_sum, denominator):
            loss, share = run_slice(i * size, size)
            return i + 1, loss_sum + loss, denominator + share

        zero = tf.constant(0.0)
        _, loss_sum, denominator = tf.while_loop(
            lambda i, *_: i < full,
            body,
            (tf.constant(0, batch.dtype), zero, zero),
            parallel_iterations=1,
        )

        def remainder():
            # Sizes from the batch's shape inside the branch (not captured
            # tensors), so that XLA sees them as constants.
            n = _batch_size(x)
            start = n // size * size
            return run_slice(start, n - start)

        # A batch whose known size the slices divide has no remainder to
        # trace: traced with a static size of 0, its loss would be of shape
        # (0,), which Keras leaves unreduced, and adding a regularisation
        # penalty to it fails.
        static = _first(x).shape[0]
        if static is not None and static % size == 0:
            loss, share = zero, zero
        else:
            loss, share = tf.cond(batch > full * size, remainder, lambda: (zero, zero))
        loss_sum, denominator = loss_sum + loss, denominator + share
        loss_tracker(self).update_state(
            tf.math.divide_no_nan(loss_sum, denominator), sample_weight=batch
        )
        on_apply, on_skip = scale_hooks(self.optimizer)
        variables = self.trainable_weights
        accumulator.end_micro_step(
            variables,
            present[0],
            apply_fn=self._apply_fn(variables),
            on_apply=on_apply,
            on_skip=on_skip,
            after=[loss_sum, denominator],
        )
        return self._with_progress(self.get_metrics_result())

    def _link_batch_norm(self, follow: bool) -> None:
        """Makes every AccumBatchNormalization (nested models included)
        update its moving statistics on this model's cycle: one counter, and
        their sums ride in the gradients' single all-reduce. Off the engine
        path (``follow=False``) the layers act alone; both check their
        ``accum_steps`` against the model's."""
        steps = self._accumulator.accum_steps
        for layer in all_layers(self)[1:]:
            if isinstance(layer, AccumBatchNormalization):
                layer.follow_model(self._accumulator, steps, link=follow)

    def _denominators(self, x, y_pred, sample_weight, opens_step=None):
        """The micro-batch's loss terms by denominator, with its weight and
        count in each (see ``weighting.denominators``). A micro-batch opens
        its cycle if the cycle is still empty and, for an in-step slice, if
        it is its step's first (``opens_step``, a bool tensor): later slices
        of the step do not advance the counter."""

        def opens():
            opens = self._accumulator.opens_cycle()
            if opens_step is not None:
                opens = tf.logical_and(opens, opens_step)
            return opens

        return denominators(
            flat_losses(self),
            y_pred,
            sample_weight,
            _batch_size(x),
            opens,
            merge_mask=_weights_under_mask,
        )


def _weights_under_mask(weights, mask):
    return apply_mask(
        weights, mask, dtype="float32", reduction="mean_with_sample_weight"
    )


class _PartialCycles(PartialCycles, keras.callbacks.Callback):
    """``hosts.partial_cycles.PartialCycles`` for Keras 3."""


_functional_variants: dict[type, type] = {}
_clone_source = threading.local()


def _init_functional(model, init, args, kwargs) -> None:
    """Keras' functional construction, without rebasing our classes (see
    ``functional_variants``)."""

    def namespace(cls) -> dict:
        def __init__(self, *args, **kwargs):
            # Keras builds a functional model's clone as
            # ``type(model)(inputs, outputs, name=...)``, right after running
            # the source's graph (see _run_through_graph, which left the
            # source's settings here). Keyword arguments serve a subclass
            # whose own __init__ takes only those.
            if args and _is_tensor_structure(args[0]):
                kwargs.update(zip(("inputs", "outputs"), args))
                args = args[2:]
                kwargs = {**_clone_source.__dict__.pop("settings", {}), **kwargs}
            _construct(functools.partial(cls.__init__, self, *args), kwargs)

        return {"__init__": __init__}

    def register(variant, cls) -> None:
        # Saved files must name the public class, which rebuilds the variant.
        GLOBAL_CUSTOM_NAMES[variant] = keras.saving.get_registered_name(cls)

    construct(
        model,
        init,
        args,
        kwargs,
        host=GradientAccumulateModel,
        functional=Functional,
        variants=_functional_variants,
        namespace=namespace,
        register=register,
        keras=KERAS3,
    )


def _drop_duplicate(error: TypeError, kwargs: dict) -> bool:
    """A subclass that sets a setting itself, e.g.
    ``super().__init__(accum_steps=4, **kwargs)``, receives a saved or cloned
    one a second time: drops that from ``kwargs`` (its own value wins).
    Returns whether it did."""
    match = _DUPLICATE.search(str(error))
    if match is None or match.group(1) not in kwargs:
        return False
    kwargs.pop(match.group(1))
    return True


def _construct(init: Callable, kwargs: dict):
    kwargs = dict(kwargs)
    while True:
        try:
            return init(**kwargs)
        except TypeError as error:
            if not _drop_duplicate(error, kwargs):
                raise


class _Micro(NamedTuple):
    """What one micro-batch's forward and backward pass produced."""

    grads: list
    variables: list
    y_pred: object
    loss: tf.Tensor
    weight: tf.Tensor  # folded into the differentiated loss
    count: tf.Tensor  # its share of the denominator
    samples: tf.Tensor
    grad_weight: tf.Tensor | None  # what the engine weighs grads by, or None
    # Each extra denominator's (grads, weight, count), see Engine.part.
    parts: list
    # A bool tensor: the backward pass overflowed and was redone (or None).
    overflowed: tf.Tensor | None


def _slice(tensor, start, length):
    """Rows ``start:start + length`` of ``tensor`` (None stays None)."""
    if tensor is None:
        return None
    if isinstance(length, int):
        # The loop's full slices: a gather has the static size ``length``
        # even where XLA compiles the loop body for a batch shorter than
        # that (the body then never runs, but a slice would not compile).
        return tf.gather(tensor, start + tf.range(length, dtype=start.dtype))
    rank = tensor.shape.rank
    return tf.slice(tensor, [start] + [0] * (rank - 1), [length] + [-1] * (rank - 1))


def _is_tensor_structure(value) -> bool:
    """Whether ``value`` is a symbolic tensor or a structure of them."""
    if isinstance(value, int | float | bool | type(None)):
        return False
    return any(isinstance(t, keras.KerasTensor) for t in keras.tree.flatten(value))


def _first(x):
    return next(t for t in tf.nest.flatten(x) if t is not None)


def _batch_size(x):
    return tf.shape(_first(x))[0]


def _has_overwritten(model) -> bool:
    """Whether ``model`` trains variables overwritten with their gradient
    (float8 layers; see ``arithmetic.overwritten``)."""
    return any(overwritten(v) for v in model.trainable_weights)
