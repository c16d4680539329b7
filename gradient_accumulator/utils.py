"""Deprecated 0.5.x import path: use ``from gradient_accumulator import
replace_batchnorm_layers`` (defined in ``gradient_accumulator.convert``).

0.5.x's ``utils`` also held ``AccumBatchNormalization`` (imported there), so
``from gradient_accumulator.utils import AccumBatchNormalization`` works too.
"""

from gradient_accumulator._compat import warn_moved
from gradient_accumulator.batch_norm import AccumBatchNormalization
from gradient_accumulator.convert import replace_batchnorm_layers

warn_moved(
    __name__, "gradient_accumulator (gradient_accumulator.batch_norm and .convert)"
)

__all__ = ["AccumBatchNormalization", "replace_batchnorm_layers"]
