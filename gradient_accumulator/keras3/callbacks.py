"""Callbacks that control accumulation cycles during ``fit``."""

from __future__ import annotations

import keras

from gradient_accumulator.hosts import training_control
from gradient_accumulator.keras3.flavour import FLAVOUR


class AccumulationScheduler(training_control.SchedulerLogic, keras.callbacks.Callback):
    """Changes ``accum_steps`` during training (batch-size warm-up).

    ``schedule`` is either a mapping ``{epoch: accum_steps}`` (from that epoch
    on, as PyTorch Lightning's ``GradientAccumulationScheduler``) or a callable
    ``fn(updates) -> accum_steps`` of the number of updates applied so far (as
    optax's ``every_k_schedule``). A change takes effect at the next cycle
    boundary, never mixing partial sums of two cycle lengths, and is saved
    with the model's state.

    Example:

    >>> import keras, numpy as np
    >>> from gradient_accumulator import AccumulationScheduler, GradientAccumulateModel
    >>> inputs = keras.Input((4,))
    >>> model = GradientAccumulateModel(
    ...     inputs=inputs, outputs=keras.layers.Dense(1)(inputs)
    ... )
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> warm_up = AccumulationScheduler({0: 1, 1: 4})
    >>> _ = model.fit(
    ...     np.ones((32, 4)), np.ones((32, 1)), batch_size=8, epochs=2,
    ...     callbacks=[warm_up], verbose=0,
    ... )
    >>> int(model.optimizer.iterations)  # 4 updates, then 1
    5
    """

    _flavour = FLAVOUR


class FlushPartialCycle(training_control.FlushLogic, keras.callbacks.Callback):
    """Flushes (or drops) an incomplete accumulation cycle at every epoch end
    and at the end of training.

    For ``GradientAccumulateModel`` the ``partial_cycle`` argument does the
    same; this callback serves models compiled with a
    ``GradientAccumulateOptimizer``.

    Args:
        mode: ``"flush"`` applies the micro-batches accumulated so far as one
            (smaller) big batch; ``"drop"`` discards them.
        every_epoch: act at every epoch end (default) or only when training
            ends.
    """

    _flavour = FLAVOUR
