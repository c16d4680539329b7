"""Deprecated 0.5.x import path: use ``from gradient_accumulator import
AccumBatchNormalization`` (defined in ``gradient_accumulator.batch_norm``)."""

from gradient_accumulator._compat import warn_moved
from gradient_accumulator.batch_norm import AccumBatchNormalization

warn_moved(__name__, "gradient_accumulator (gradient_accumulator.batch_norm)")

__all__ = ["AccumBatchNormalization"]
