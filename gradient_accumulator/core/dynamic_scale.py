"""A dynamic loss scale kept per cycle, in plain TensorFlow: the engine's
``on_apply`` / ``on_skip`` hooks for the scale and counter variables of
either Keras' ``LossScaleOptimizer``."""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf


def cycle_hooks(
    scale: tf.Variable, counter: tf.Variable, growth_steps, floor: float | None = None
) -> tuple[Callable[[], None], Callable[[], None]]:
    """``(on_apply, on_skip)``: double ``scale`` after ``growth_steps``
    finite updates in a row, halve it (not below ``floor``, if given) on a
    skipped cycle; ``counter`` counts the finite updates since the last
    change. ``on_apply(overflowed)`` halves it too when a micro-batch of the
    applied cycle overflowed at it (and was redone at a smaller seed): the
    scale then stays where micro-batches fit, as dynamic scaling keeps it
    where steps fit, and overflows (each a second backward pass) stay rare."""

    def rescale(factor: float) -> None:
        counter.assign(0)
        new = scale * factor
        if floor is not None:
            new = tf.maximum(new, floor)
        scale.assign(new)

    def on_apply(overflowed=False) -> None:
        grow = tf.equal(counter, tf.cast(growth_steps, counter.dtype) - 1)

        def keep_or_grow() -> None:
            tf.cond(grow, lambda: rescale(2.0), lambda: _count(counter))

        tf.cond(tf.convert_to_tensor(overflowed), lambda: rescale(0.5), keep_or_grow)

    return on_apply, lambda: rescale(0.5)


def _count(counter: tf.Variable) -> None:
    counter.assign_add(1)
