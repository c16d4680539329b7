"""``GradientAccumulateModel``: a ``keras.Model`` whose ``fit`` accumulates."""

from __future__ import annotations

import threading

import keras

from gradient_accumulator.hosts.model import ModelHost
from gradient_accumulator.keras3._compat import GraphRunHook
from gradient_accumulator.keras3.flavour import FLAVOUR


@keras.saving.register_keras_serializable(package="gradient_accumulator")
class GradientAccumulateModel(ModelHost, GraphRunHook, keras.Model):
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
            that do not fill a cycle: ``"auto"`` (default) trains like the
            big batch, epoch by epoch: an epoch that is a pass over the data
            applies them as its last, shorter update (as plain Keras' last
            batch is short), and epochs cut from a stream by
            ``steps_per_epoch`` carry them on; ``"carry"`` them into the next
            epoch always (the default before 1.0), ``"flush"`` them (apply
            them as one smaller big batch) always, or ``"drop"`` them.
        flush_at_end: flush a partial cycle left when ``fit`` ends, so no
            data is silently left unapplied (default ``True``); ``False``
            keeps it pending for the next ``fit`` (with ``"auto"`` or
            ``"carry"``; it is saved in checkpoints).
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
        gradient_cache: ``False`` (default), ``True`` or ``"global"`` (with
            ``micro_batch_size``): for a loss that couples the batch's samples
            (in-batch negatives, contrastive, triplet), run every slice
            forward, compute the loss once on the whole batch's outputs, then
            run each slice forward again to back-propagate it (gradient
            caching): the gradient is the whole batch's, for one more forward
            pass. Random layers draw the same numbers in both passes;
            ``BatchNormalization`` in training and losses added in the call
            are refused. Under a ``tf.distribute`` strategy, ``True`` makes
            each replica's batch one coupled batch (its negatives are its
            own, as plain Keras computes it); ``"global"`` gathers every
            replica's outputs before the loss, so the negatives are the
            whole global batch's, as on one device. See
            ``docs/gradient-cache.md``.
        loss_denominator: what the model's own ``compute_loss`` (a model
            compiled without a loss) divides a batch's loss by, which the
            package cannot read: ``"samples"`` (a mean over samples),
            ``"sum"`` (not divided), or a function ``f(x, y, sample_weight)``
            returning it as a scalar tensor (e.g. the number of unmasked
            tokens). Each micro-batch is then weighed by its own count and
            the cycle divided by the cycle's total, as for a compiled loss.
            ``None`` (default): not declared, taken as ``"samples"``, with
            one warning when the model overrides ``compute_loss``. A
            compiled loss's reduction says it instead (setting both is an
            error). Saved in ``.keras`` files (a function as Keras saves a
            custom loss function: register it, or pass it in
            ``custom_objects``).
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

    _flavour = FLAVOUR

    @property
    def micro_batch_size(self) -> int | None:
        """Samples per in-step slice, or None (each batch is one micro-batch)."""
        return self._accumulation_settings.micro_batch_size

    def _before_graph_run(self) -> None:
        # keras.models.clone_model runs the source's graph on new inputs and
        # then builds the clone from (inputs, outputs) alone: leave the
        # settings for that construction (a thread's latest run wins, and
        # only a positional construction reads them).
        if getattr(self, "_accumulator", None) is not None:  # not mid-__init__
            _clone_source.settings = self._settings(saved=False)

    @classmethod
    def _variant_namespace(cls, public: type) -> dict:
        def __init__(self, *args, **kwargs):
            # Keras builds a functional model's clone as
            # ``type(model)(inputs, outputs, name=...)``, right after running
            # the source's graph (see _before_graph_run, which left the
            # source's settings here). Keyword arguments serve a subclass
            # whose own __init__ takes only those.
            settings = None
            if args and cls._is_tensor_structure(args[0]):
                kwargs.update(zip(("inputs", "outputs"), args))
                args = args[2:]
                settings = _clone_source.__dict__.pop("settings", None)
            public.__init__(self, *args, **kwargs)
            if settings is not None:
                self._take_settings(settings)

        return {"__init__": __init__}


_clone_source = threading.local()
