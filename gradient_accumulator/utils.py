"""Deprecated 0.5.x import path: use ``from gradient_accumulator import
replace_batchnorm_layers`` (the Keras 3 or the tf-keras one, as the
package's public names are).

0.5.x's ``utils`` also held ``AccumBatchNormalization`` (imported there), so
``from gradient_accumulator.utils import AccumBatchNormalization`` works too.
"""

from gradient_accumulator import AccumBatchNormalization, replace_batchnorm_layers
from gradient_accumulator._moved_paths import warn_moved

warn_moved(
    __name__,
    "gradient_accumulator (gradient_accumulator.keras3.batch_norm and .convert)",
)

__all__ = ["AccumBatchNormalization", "replace_batchnorm_layers"]
