"""Loss scaling across an accumulation cycle.

Keras' ``LossScaleOptimizer`` checks every gradient it is given for NaN/Inf
and grows its scale after ``dynamic_growth_steps`` finite calls. Accumulation
must instead unscale each micro-batch's gradient before adding it (so that the
float32 sums are in one unit whatever the scale), check the *accumulated*
gradient once per update (the engine does), skip the whole cycle when it is
not finite, and count updates, not micro-batches, towards growth. This module
does that with the ``LossScaleOptimizer``'s own scale variables, so the state
stays that optimizer's and is saved with it.

Two layouts reach here:

* ``GradientAccumulateModel`` or ``GradientAccumulateOptimizer`` holding a
  ``LossScaleOptimizer``: the accumulating object sees the scaler directly
  (``hosts.loss_scale.scaler_of``).
* ``LossScaleOptimizer(GradientAccumulateOptimizer(...))``, which
  ``compile`` builds under the ``"mixed_float16"`` policy: the scaler sits
  *outside* the accumulating optimizer. See :class:`CycleLossScaleOptimizer`
  for how the accumulating optimizer takes over the scaler's per-call role.

The rules both Kerases share are ``gradient_accumulator.hosts.loss_scale``'s;
this module holds Keras 3's own, which its flavour's fields name.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import tensorflow as tf

from gradient_accumulator.core.dynamic_scale import cycle_hooks
from gradient_accumulator.hosts import loss_scale as host
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


# ------------------------------------------- LossScaleOptimizer(accumulating)
# Under "mixed_float16", ``compile`` wraps whatever optimizer it is given in a
# LossScaleOptimizer after the user built it, so an accumulating optimizer
# ends up *inside* one. Keras' LossScaleOptimizer.apply checks, skips and
# counts growth per call, i.e. per micro-batch: an overflowing micro-batch is
# silently dropped from its cycle (instead of the cycle being skipped, as the
# big batch holding that sample would be), the scale changes mid-cycle, and it
# grows ``accum_steps`` times too fast.
#
# The accumulating optimizer therefore takes over the wrapper's role. That
# one wrapper instance (and no other LossScaleOptimizer in the process) is
# given the class below, which hands ``apply`` (and, when the accumulating
# optimizer keeps a scale of its own, ``scale_loss``) to the optimizer it
# wraps. ``hosts.loss_scale.adopt`` is called when a LossScaleOptimizer
# wraps an accumulating one (see GradientAccumulateOptimizer.loss_scale_factor),
# which covers every way the wrapper comes to exist: ``compile``, explicit
# construction,
# ``load_model``, ``clone_model``. The class saves as Keras' own, so files
# load without custom_objects.
#
# Hooks (see GradientAccumulateOptimizer):
#   inner._apply_with_loss_scaler(wrapper, grads, trainable_variables)
#   inner._has_own_loss_scaler: True when the user built the inner optimizer
#       around its own LossScaleOptimizer; the wrapper ``compile`` added on
#       top then only passes calls through, so one scale is ever in use.
#   inner._backward_share(): what the scaled loss is also multiplied by (a
#       micro-batch's share of its cycle), which the cycle's sums undo.
class CycleLossScaleOptimizer(LossScaleOptimizer):
    """Keras' LossScaleOptimizer around an accumulating optimizer: the scale
    is checked, skipped and grown per cycle, by the optimizer it wraps."""

    def apply(self, grads, trainable_variables=None):
        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context.")
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        return self.inner_optimizer._apply_with_loss_scaler(
            self, grads, trainable_variables
        )

    def scale_loss(self, loss):
        if self.inner_optimizer._has_own_loss_scaler:
            return self.inner_optimizer.scale_loss(loss)
        return super().scale_loss(loss) * self.inner_optimizer._backward_share()


# Saved files name Keras' class, which adopt() turns into this one on load.
host.saves_as(CycleLossScaleOptimizer, LossScaleOptimizer)


def keras_apply(scaler, grads, trainable_variables=None):
    """Keras' own per-call ``LossScaleOptimizer.apply``."""
    return LossScaleOptimizer.apply(scaler, grads, trainable_variables)
