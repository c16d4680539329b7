"""Deprecated 0.5.x import path: use ``from gradient_accumulator import
AccumBatchNormalization`` (the Keras 3 or the tf-keras layer, as the package's
public name is)."""

from gradient_accumulator import AccumBatchNormalization
from gradient_accumulator._moved_paths import warn_moved

warn_moved(__name__, "gradient_accumulator (gradient_accumulator.keras3.batch_norm)")

__all__ = ["AccumBatchNormalization"]
