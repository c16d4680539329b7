"""tf-keras' ``LossScaleOptimizer`` (``mixed_float16``) across a cycle: each
micro-batch's gradients are unscaled before they are added, the cycle is
checked once, and the scale grows per finite update and halves per skipped
cycle (``dynamic_scale.cycle_hooks``), in the scaler's own variables; a
skipped cycle counts one iteration, as a skipped step does in tf-keras. The
rules both Kerases share are ``gradient_accumulator.hosts.loss_scale``'s;
this module holds tf-keras' own, which its flavour's fields name."""

from __future__ import annotations

from collections.abc import Sequence

import tf_keras

from gradient_accumulator.core.dynamic_scale import cycle_hooks
from gradient_accumulator.keras2._compat import loss_scale_variable

LossScaleOptimizer = tf_keras.mixed_precision.LossScaleOptimizer


def scaled_loss(optimizer, loss):
    """``loss`` multiplied by ``optimizer``'s loss scale, if it has one."""
    has_scale = isinstance(optimizer, LossScaleOptimizer)
    return optimizer.get_scaled_loss(loss) if has_scale else loss


def apply_gradients(optimizer, grads: Sequence, variables: Sequence):
    """Applies unscaled gradients already summed over replicas (replica
    context) with ``optimizer``, current or legacy."""
    pairs = list(zip(grads, variables))
    if isinstance(optimizer, tf_keras.optimizers.legacy.Optimizer):
        return optimizer.apply_gradients(pairs, experimental_aggregate_gradients=False)
    return optimizer.apply_gradients(pairs, skip_gradients_aggregation=True)


def cycle_scale_hooks(scaler):
    """The engine's ``(on_apply, on_skip)`` for ``scaler``'s dynamic scale."""
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
