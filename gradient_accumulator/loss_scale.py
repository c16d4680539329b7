"""Loss scaling across an accumulation cycle.

Keras' ``LossScaleOptimizer`` checks every gradient it is given for NaN/Inf
and grows its scale after ``dynamic_growth_steps`` finite calls. Accumulation
must instead unscale each micro-batch's gradient before adding it (so that the
float32 sums are in one unit whatever the scale), check the *accumulated*
gradient once per update, and count updates, not micro-batches, towards growth.
This module does that with the optimizer's own scale variables, so the state
stays the optimizer's and is saved with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import tensorflow as tf

from gradient_accumulator.accumulator import all_finite

LossScaleOptimizer = keras.optimizers.LossScaleOptimizer


def loss_scale(optimizer) -> tf.Tensor | None:
    """The dynamic loss scale of ``optimizer``, or None if it has none."""
    if isinstance(optimizer, LossScaleOptimizer):
        return tf.convert_to_tensor(optimizer.dynamic_scale)
    return None


def apply_gradients(optimizer, grads: Sequence, variables: Sequence) -> None:
    """Applies already-unscaled, accumulated ``grads`` with ``optimizer``.

    Called once per update, in cross-replica context. For a
    ``LossScaleOptimizer`` a non-finite gradient skips the update and halves
    the scale; a finite one updates through the inner optimizer and counts
    towards the scale's growth.
    """
    if not isinstance(optimizer, LossScaleOptimizer):
        optimizer.apply(list(grads), list(variables))
        return

    def finite() -> None:
        optimizer.inner_optimizer.apply(list(grads), list(variables))
        grow = tf.equal(optimizer.step_counter, optimizer.dynamic_growth_steps - 1)
        tf.cond(grow, lambda: _rescale(optimizer, 2.0), lambda: _count(optimizer))

    tf.cond(all_finite(grads), finite, lambda: _rescale(optimizer, 0.5))


def _rescale(optimizer, factor: float) -> None:
    optimizer.step_counter.assign(0)
    optimizer.dynamic_scale.assign(optimizer.dynamic_scale * factor)


def _count(optimizer) -> None:
    optimizer.step_counter.assign_add(1)
