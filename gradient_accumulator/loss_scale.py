"""Loss scaling across an accumulation cycle.

Keras' ``LossScaleOptimizer`` checks every gradient it is given for NaN/Inf
and grows its scale after ``dynamic_growth_steps`` finite calls. Accumulation
must instead unscale each micro-batch's gradient before adding it (so that the
float32 sums are in one unit whatever the scale), check the *accumulated*
gradient once per update (the engine does), and count updates, not
micro-batches, towards growth. This module does that with the optimizer's own
scale variables, so the state stays the optimizer's and is saved with it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import keras
import tensorflow as tf

from gradient_accumulator.distributed import already_reduced

LossScaleOptimizer = keras.optimizers.LossScaleOptimizer


def loss_scale(optimizer) -> tf.Tensor | None:
    """The dynamic loss scale of ``optimizer``, or None if it has none."""
    if isinstance(optimizer, LossScaleOptimizer):
        return tf.convert_to_tensor(optimizer.dynamic_scale)
    return None


def apply_gradients(optimizer, grads: Sequence, variables: Sequence) -> None:
    """Applies unscaled, accumulated, replica-summed ``grads`` (replica context)."""
    if isinstance(optimizer, LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    with already_reduced(optimizer):
        optimizer.apply(list(grads), list(variables))


def scale_hooks(
    optimizer,
) -> tuple[Callable[[], None] | None, Callable[[], None] | None]:
    """``(on_apply, on_skip)`` engine hooks that keep a dynamic loss scale:
    grow after ``dynamic_growth_steps`` finite updates, halve on overflow."""
    if not isinstance(optimizer, LossScaleOptimizer):
        return None, None

    def on_apply() -> None:
        grow = tf.equal(optimizer.step_counter, optimizer.dynamic_growth_steps - 1)
        tf.cond(grow, lambda: _rescale(optimizer, 2.0), lambda: _count(optimizer))

    return on_apply, lambda: _rescale(optimizer, 0.5)


def _rescale(optimizer, factor: float) -> None:
    optimizer.step_counter.assign(0)
    optimizer.dynamic_scale.assign(optimizer.dynamic_scale * factor)


def _count(optimizer) -> None:
    optimizer.step_counter.assign_add(1)
