"""``AccumBatchNormalization`` for tf-keras: batch normalisation whose moving
statistics are those of the big batch (``gradient_accumulator.hosts.batch_norm``
does it for both Kerases)."""

from __future__ import annotations

import tf_keras

from gradient_accumulator.hosts.batch_norm import AccumBatchNorm
from gradient_accumulator.keras2.flavour import FLAVOUR


@tf_keras.saving.register_keras_serializable(package="gradient_accumulator")
class AccumBatchNormalization(AccumBatchNorm, tf_keras.layers.BatchNormalization):
    """``tf.keras.layers.BatchNormalization`` (tf-keras) for gradient
    accumulation.

    Each micro-batch is normalised with its own moments; the moving mean and
    variance are updated once per cycle of ``accum_steps`` micro-batches with
    the exact moments of the whole effective batch (every replica included),
    so that after a cycle they equal those of tf-keras' layer trained on the
    concatenated big batch. Inside a ``GradientAccumulateModel`` the layer
    follows the model's cycle and ``accum_steps`` may be omitted; elsewhere
    it counts its own training calls (``None`` then means 1: tf-keras'
    layer). As in 0.5.x, one channels-last layer (``axis=-1``) may be called
    on inputs of different ranks (after a ``Conv2D`` and after a ``Dense``).

    Args: as the Keras 3 ``AccumBatchNormalization``; ``synchronized=True``
    is refused.

    Example:

    >>> import tf_keras
    >>> from gradient_accumulator.keras2 import AccumBatchNormalization
    >>> layer = AccumBatchNormalization(accum_steps=4)
    >>> layer(tf_keras.Input((8,))).shape.as_list()
    [None, 8]
    """

    _flavour = FLAVOUR
