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
    change."""

    def rescale(factor: float) -> None:
        counter.assign(0)
        new = scale * factor
        if floor is not None:
            new = tf.maximum(new, floor)
        scale.assign(new)

    def on_apply() -> None:
        grow = tf.equal(counter, tf.cast(growth_steps, counter.dtype) - 1)
        tf.cond(grow, lambda: rescale(2.0), lambda: _count(counter))

    return on_apply, lambda: rescale(0.5)


def _count(counter: tf.Variable) -> None:
    counter.assign_add(1)
