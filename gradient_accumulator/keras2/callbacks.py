"""The cycle-control callbacks for tf-keras: ``tf.keras.callbacks.Callback``
subclasses (where ``tf.keras`` is tf-keras) with the Keras 3 ones' arguments
and behaviour (the logic is ``gradient_accumulator.hosts.training_control``)."""

from __future__ import annotations

import tf_keras

from gradient_accumulator.hosts import pruning, training_control
from gradient_accumulator.keras2.flavour import FLAVOUR


class AccumulationScheduler(
    training_control.SchedulerLogic, tf_keras.callbacks.Callback
):
    """Changes ``accum_steps`` during ``fit`` of a tf-keras
    ``GradientAccumulateModel``, or of a model compiled with a tf-keras
    ``GradientAccumulateOptimizer``.

    ``schedule``: a mapping ``{epoch: accum_steps}`` (from that epoch on) or
    a callable ``fn(updates) -> accum_steps`` of the updates applied so far.
    A change takes effect at the next cycle boundary. As the Keras 3
    ``AccumulationScheduler``.

    Example:

    >>> import numpy as np, tf_keras
    >>> from gradient_accumulator.keras2 import (
    ...     AccumulationScheduler, GradientAccumulateModel,
    ... )
    >>> inputs = tf_keras.Input((4,))
    >>> outputs = tf_keras.layers.Dense(1)(inputs)
    >>> model = GradientAccumulateModel(inputs=inputs, outputs=outputs)
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> history = model.fit(
    ...     np.ones((32, 4)), np.ones((32, 1)), batch_size=8, epochs=2,
    ...     callbacks=[AccumulationScheduler({0: 1, 1: 4})], verbose=0,
    ... )
    >>> int(model.optimizer.iterations)  # 4 updates, then 1
    5
    """

    _flavour = FLAVOUR


class FlushPartialCycle(training_control.FlushLogic, tf_keras.callbacks.Callback):
    """Flushes (``mode="flush"``) or drops (``mode="drop"``) an incomplete
    cycle at every epoch end (``every_epoch=True``) or only when ``fit``
    ends, before tf-keras swaps EMA weights in. For models compiled with a
    tf-keras ``GradientAccumulateOptimizer`` (the model wrapper has its
    ``partial_cycle`` argument). As the Keras 3 ``FlushPartialCycle``.
    """

    _flavour = FLAVOUR


class PruningStepPerUpdate(pruning.PruningStepLogic, tf_keras.callbacks.Callback):
    """TensorFlow Model Optimization's ``UpdatePruningStep`` for gradient
    accumulation: use it in its place (``model.fit(..., callbacks=[
    PruningStepPerUpdate()])``).

    A pruning wrapper (``tfmot.sparsity.keras.prune_low_magnitude``) adds
    one to its ``pruning_step`` per training call, so with ``accum_steps``
    micro-batches per update its pruning schedule would run ``accum_steps``
    times too fast. This callback does what ``UpdatePruningStep`` does (it
    runs TF-MOT's) and, before every batch, sets each wrapper's step to the
    optimizer updates applied so far (``model.optimizer.iterations``): the
    masks and weights are then the big batch's, for the model wrapper,
    ``accumulate()`` and the optimizer wrapper alike. Without accumulation
    it trains as ``UpdatePruningStep`` with a fresh optimizer does, so one
    callback list serves both. Needs ``tensorflow-model-optimization``
    (imported when the callback is made). See docs/recipes-tf-keras.md.
    """

    _flavour = FLAVOUR
