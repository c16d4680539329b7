"""Loss scaling across an accumulation cycle.

Keras' ``LossScaleOptimizer`` checks every gradient it is given for NaN/Inf
and grows its scale after ``dynamic_growth_steps`` finite calls. Accumulation
must instead unscale each micro-batch's gradient before adding it (so that the
float32 sums are in one unit whatever the scale), check the *accumulated*
gradient once per update (the engine does), skip the whole cycle when it is
not finite, and count updates, not micro-batches, towards growth. This module
does that with the ``LossScaleOptimizer``'s own scale variables, so the state
stays that optimizer's and is saved with it.

The accumulating object holds the scaler (``GradientAccumulateModel``
compiled with one, ``GradientAccumulateOptimizer(LossScaleOptimizer(...))``)
and sees it directly (``hosts.loss_scale.scaler_of``); a scaler around the
optimizer wrapper is refused (``hosts.loss_scale.wrapping_refused``).

The rules both Kerases share are ``gradient_accumulator.hosts.loss_scale``'s;
this module holds Keras 3's own, which its flavour's fields name.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras

from gradient_accumulator.core.dynamic_scale import cycle_hooks
from gradient_accumulator.keras3.inner_optimizers import already_reduced

LossScaleOptimizer = keras.optimizers.LossScaleOptimizer


def apply_reduced(optimizer, grads: Sequence, variables: Sequence) -> None:
    """Applies unscaled, accumulated, replica-summed ``grads`` (replica context)."""
    with already_reduced(optimizer):
        optimizer.apply(list(grads), list(variables))


def scale_hooks(scaler) -> tuple:
    """``(on_apply, on_skip)`` engine hooks that keep a (dynamic) loss
    scale: grow after ``dynamic_growth_steps`` finite updates, halve on
    overflow."""
    return cycle_hooks(
        scaler.dynamic_scale,
        scaler.step_counter,
        scaler.dynamic_growth_steps,
    )
