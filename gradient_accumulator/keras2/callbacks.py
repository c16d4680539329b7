"""The cycle-control callbacks for tf-keras: ``tf.keras.callbacks.Callback``
subclasses (where ``tf.keras`` is tf-keras) with the Keras 3 ones' arguments
and behaviour (the logic is ``gradient_accumulator.hosts.training_control``)."""

from __future__ import annotations

import tf_keras

from gradient_accumulator.hosts import training_control


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


class FlushPartialCycle(training_control.FlushLogic, tf_keras.callbacks.Callback):
    """Flushes (``mode="flush"``) or drops (``mode="drop"``) an incomplete
    cycle at every epoch end (``every_epoch=True``) or only when ``fit``
    ends, before tf-keras swaps EMA weights in. For models compiled with a
    tf-keras ``GradientAccumulateOptimizer`` (the model wrapper has its
    ``partial_cycle`` argument). As the Keras 3 ``FlushPartialCycle``.
    """
