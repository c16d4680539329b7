"""tf-keras' ``LossScaleOptimizer`` (``mixed_float16``) across a cycle: each
micro-batch's gradients are unscaled before they are added, the cycle is
checked once, and the scale grows per finite update and halves per skipped
cycle (``dynamic_scale.cycle_hooks``), in the scaler's own variables; a
skipped cycle counts one iteration, as a skipped step does in tf-keras."""

from __future__ import annotations

import tf_keras

from gradient_accumulator.dynamic_scale import cycle_hooks
from gradient_accumulator.keras2._compat import loss_scale_variable

LossScaleOptimizer = tf_keras.mixed_precision.LossScaleOptimizer


def scaler_of(optimizer):
    """``optimizer`` if it is a ``LossScaleOptimizer``, else None."""
    return optimizer if isinstance(optimizer, LossScaleOptimizer) else None


def unscaled(optimizer):
    """The optimizer that applies updates: the one a scaler wraps."""
    scaler = scaler_of(optimizer)
    return optimizer if scaler is None else scaler.inner_optimizer


def scale_hooks(optimizer):
    """The engine's ``(on_apply, on_skip)`` for a dynamic scale, else
    ``(None, None)``."""
    scaler = scaler_of(optimizer)
    if scaler is None or not scaler.dynamic:
        return None, None
    # tf-keras never lowers its scale below 1.
    on_apply, halve = cycle_hooks(
        loss_scale_variable(scaler),
        scaler.dynamic_counter,
        scaler.dynamic_growth_steps,
        floor=1.0,
    )
    iterations = scaler.inner_optimizer.iterations

    def on_skip() -> None:
        halve()
        # As tf-keras' scaler does for a skipped step: schedules then see a
        # skipped cycle as the big batch's skipped step.
        iterations.assign_add(1)

    return on_apply, on_skip
