"""``replace_batchnorm_layers`` for tf-keras: a copy of a tf-keras model whose
BatchNormalization layers accumulate (``gradient_accumulator.hosts.replace_layers``
does it for both Kerases)."""

from __future__ import annotations

import tf_keras

from gradient_accumulator.hosts import replace_layers
from gradient_accumulator.keras2.flavour import FLAVOUR


def replace_batchnorm_layers(
    model: tf_keras.Model, accum_steps: int | None = None, position: str = "replace"
) -> tf_keras.Model:
    """Returns a copy of the tf-keras ``model`` with every
    ``tf_keras.layers.BatchNormalization`` (in nested functional and
    ``Sequential`` models too) replaced by the tf-keras
    :class:`AccumBatchNormalization` with the same configuration, gamma,
    beta and moving statistics; every other layer is copied with its
    weights. In inference the copy predicts what ``model`` predicts;
    ``model`` is left untouched.

    Arguments, result and errors: as the Keras 3
    ``replace_batchnorm_layers``. BatchNormalization layers with
    ``renorm``, ``virtual_batch_size``, ``adjustment`` or ``synchronized``
    are refused (``ValueError``): AccumBatchNormalization has none of them.

    Example:

    >>> import tf_keras
    >>> from gradient_accumulator.keras2 import replace_batchnorm_layers
    >>> model = tf_keras.Sequential(
    ...     [tf_keras.Input((4,)), tf_keras.layers.BatchNormalization()]
    ... )
    >>> type(replace_batchnorm_layers(model).layers[0]).__name__
    'AccumBatchNormalization'
    """
    return replace_layers.replace(FLAVOUR, model, accum_steps, position)
