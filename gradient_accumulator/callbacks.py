"""Callbacks that control accumulation cycles during ``fit``."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping

import keras

from gradient_accumulator.validation import check_accum_steps


def accumulating(model: keras.Model):
    """The object that owns ``model``'s accumulation: the model itself if it is
    a ``GradientAccumulateModel``, else its ``GradientAccumulateOptimizer``
    (also inside the ``LossScaleOptimizer`` that mixed precision adds)."""
    from gradient_accumulator.model import GradientAccumulateModel
    from gradient_accumulator.optimizer import GradientAccumulateOptimizer

    if isinstance(model, GradientAccumulateModel):
        return model
    optimizer = getattr(model, "optimizer", None)
    while optimizer is not None:
        if isinstance(optimizer, GradientAccumulateOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
    raise ValueError(
        "This callback needs a GradientAccumulateModel, or a model compiled "
        "with a GradientAccumulateOptimizer. Received a model of type "
        f"{type(model).__name__} with optimizer "
        f"{type(getattr(model, 'optimizer', None)).__name__}."
    )


class AccumulationScheduler(keras.callbacks.Callback):
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

    def __init__(
        self,
        schedule: Mapping[int, int] | Callable[[int], int],
        verbose: int = 0,
    ):
        super().__init__()
        if isinstance(schedule, Mapping):
            if not schedule:
                raise ValueError("`schedule` must not be empty.")
            for epoch, steps in schedule.items():
                if (
                    isinstance(epoch, bool)
                    or not isinstance(epoch, numbers.Integral)
                    or epoch < 0
                ):
                    raise ValueError(
                        "`schedule` keys must be epochs (integers >= 0). "
                        f"Received key {epoch!r}."
                    )
                check_accum_steps(steps, name=f"schedule[{epoch}]")
            self._epochs = sorted((int(e), int(k)) for e, k in schedule.items())
            self._fn = None
        elif callable(schedule):
            self._epochs = None
            self._fn = schedule
        else:
            raise TypeError(
                "`schedule` must be a dict {epoch: accum_steps} or a callable "
                f"fn(updates) -> accum_steps. Received: {schedule!r}."
            )
        self.verbose = verbose

    def _set(self, accum_steps) -> None:
        target = accumulating(self.model)
        accum_steps = check_accum_steps(accum_steps)
        if accum_steps == target.accum_steps:
            return
        if target.set_accum_steps(accum_steps):
            # An optimizer wrapper cannot re-trace the step it runs in.
            self.model.make_train_function(force=True)
        if self.verbose:
            print(f"AccumulationScheduler: accum_steps -> {accum_steps}")

    def on_train_begin(self, logs=None):
        accumulating(self.model)  # fail early with a clear message
        if self._fn is not None:
            self._set(self._fn(int(self.model.optimizer.iterations)))

    def on_epoch_begin(self, epoch, logs=None):
        if self._epochs is None:
            return
        current = [k for e, k in self._epochs if e <= epoch]
        if current:
            self._set(current[-1])

    def on_train_batch_end(self, batch, logs=None):
        if self._fn is not None:
            self._set(self._fn(int(self.model.optimizer.iterations)))


class FlushPartialCycle(keras.callbacks.Callback):
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

    def __init__(self, mode: str = "flush", every_epoch: bool = True):
        super().__init__()
        if mode not in ("flush", "drop"):
            raise ValueError(
                f"`mode` must be 'flush' or 'drop'. Received: mode={mode!r}."
            )
        if not isinstance(every_epoch, bool):
            raise TypeError(
                f"`every_epoch` must be True or False. Received: {every_epoch!r}."
            )
        self.mode = mode
        self.every_epoch = every_epoch

    def _end(self) -> None:
        target = accumulating(self.model)
        if self.mode == "flush":
            target.flush()
        else:
            target.drop_partial_cycle()

    def on_train_begin(self, logs=None):
        # Keras swaps EMA weights in (finalize_variable_values) after the
        # last epoch and before on_train_end: the fit's last partial cycle
        # must end before that, also when a callback later in the list stops
        # training, so the host runs this at its own end-of-fit moment.
        accumulating(self.model)._end_of_fit = self._end

    def on_epoch_end(self, epoch, logs=None):
        if self.every_epoch:
            self._end()

    def on_train_end(self, logs=None):
        target = accumulating(self.model)
        if getattr(target, "_end_of_fit", None) == self._end:
            target._end_of_fit = None
        self._end()  # nothing is pending unless fit ended outside an epoch
