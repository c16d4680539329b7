"""The logic of the public cycle-control callbacks, ``AccumulationScheduler``
and ``FlushPartialCycle``, written once for Keras 3 and tf-keras: each host
Keras has thin subclasses that mix these into its ``Callback``; their
flavour (``_flavour``, set in the public class) gives its
accumulating classes."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping

from gradient_accumulator.core.validation import check_accum_steps
from gradient_accumulator.hosts.flavour import Flavour
from gradient_accumulator.hosts.model import ModelHost
from gradient_accumulator.hosts.optimizer import OptimizerHost


def accumulating(model, flavour: Flavour):
    """The object that owns ``model``'s accumulation: the model itself if it is
    a model wrapper of ``flavour``'s Keras, else its optimizer wrapper (also
    inside the ``LossScaleOptimizer`` that mixed precision adds)."""
    if isinstance(model, ModelHost):
        return model
    optimizer = getattr(model, "optimizer", None)
    while optimizer is not None:
        if isinstance(optimizer, OptimizerHost):
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
    raise ValueError(
        "This callback needs a GradientAccumulateModel, or a model compiled "
        "with a GradientAccumulateOptimizer. Received a model of type "
        f"{type(model).__name__} with optimizer "
        f"{type(getattr(model, 'optimizer', None)).__name__}."
    )


class _Hosted:
    """A callback that acts on the accumulation of ``self.model``."""

    # The flavour of its Keras: each Keras' public class sets it.
    _flavour: Flavour

    def _target(self):
        return accumulating(self.model, self._flavour)


class SchedulerLogic(_Hosted):
    """``AccumulationScheduler``: see the host classes for the docs."""

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
        # A schedule function's value is checked where it is set (the
        # engine's set_accum_steps); a mapping's were checked above.
        target = self._target()
        if accum_steps == target.accum_steps:
            return
        if target.set_accum_steps(accum_steps):
            # An optimizer wrapper cannot re-trace the step it runs in.
            self.model.make_train_function(force=True)
        if self.verbose:
            print(f"AccumulationScheduler: accum_steps -> {accum_steps}")

    def on_train_begin(self, logs=None):
        self._target()  # fail early with a clear message
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


class FlushLogic(_Hosted):
    """``FlushPartialCycle``: see the host classes for the docs."""

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
        target = self._target()
        if self.mode == "flush":
            target.flush()
        else:
            target.drop_partial_cycle()

    def on_train_begin(self, logs=None):
        # Keras swaps EMA weights in (finalize_variable_values) after the
        # last epoch and before on_train_end: the fit's last partial cycle
        # must end before that, also when a callback later in the list stops
        # training, so the host runs this at its own end-of-fit moment.
        self._target()._end_of_fit = self._end

    def on_epoch_end(self, epoch, logs=None):
        if self.every_epoch:
            self._end()

    def on_train_end(self, logs=None):
        target = self._target()
        if getattr(target, "_end_of_fit", None) == self._end:
            target._end_of_fit = None
        self._end()  # nothing is pending unless fit ended outside an epoch
