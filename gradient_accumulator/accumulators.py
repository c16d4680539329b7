"""Deprecated 0.5.x import path: use ``from gradient_accumulator import
GradientAccumulateModel, GradientAccumulateOptimizer`` (the Keras 3 or the
tf-keras classes, as the package's public names are)."""

from __future__ import annotations

from collections.abc import Iterable

import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel, GradientAccumulateOptimizer
from gradient_accumulator._moved_paths import warn_moved

warn_moved(
    __name__,
    "gradient_accumulator (gradient_accumulator.keras3, gradient_accumulator.keras2)",
)

__all__ = ["GradientAccumulateModel", "GradientAccumulateOptimizer", "get_gradients"]


def get_gradients(gradients: Iterable[tf.Variable]) -> list[tf.Tensor]:
    """The current values of the non-empty variables in ``gradients`` (0.5.x's
    helper for reading accumulation buffers), in order; variables with no
    elements are left out."""
    return [g.read_value() for g in gradients if g.shape.num_elements() != 0]
