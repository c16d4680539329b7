"""A big batch's moments from its micro-batches', in plain TensorFlow: the
pooling both Keras' ``AccumBatchNormalization`` layers hand to the engine.

Chan's parallel merge, in float32: with ``n`` the per-channel element count,
``m``, ``v`` a micro-batch's mean and biased variance and ``s`` a shift, the
engine sums ``n (m - s)``, ``n (v + (m - s)^2)`` and ``n`` over the cycle
(every replica included). Those are the sums of ``x - s`` and ``(x - s)^2``,
so the pooled moments are the big batch's; the only cancellation left is of
``(mean - s)^2``, small when ``s`` is the last big batch's mean.
"""

from __future__ import annotations

import tensorflow as tf


def micro_batch_sums(mean, variance, count, shift) -> list[tf.Tensor]:
    """A micro-batch's three per-channel sums (float32, no gradient)."""
    offset = mean - shift
    sums = [count * offset, count * (variance + tf.square(offset)), count]
    return [tf.stop_gradient(t) for t in sums]


def counts(inputs, axes, channels: int, mask=None) -> tf.Tensor:
    """Elements per channel a micro-batch's moments were taken over
    (``mask``: Keras' masked moments, the mask on a new last axis)."""
    if mask is None:
        shape = tf.shape(inputs, out_type=tf.int64)
        size = tf.reduce_prod(tf.gather(shape, axes))
        return tf.fill([channels], tf.cast(size, tf.float32))
    weights = tf.cast(tf.expand_dims(mask, -1), tf.float32)
    weights = tf.broadcast_to(weights, tf.shape(inputs))
    return tf.reshape(tf.reduce_sum(weights, axis=axes), [channels])


def big_batch_moments(means, shift) -> tuple[tf.Tensor, tf.Tensor]:
    """``(mean, biased variance)`` of the cycle from the engine's means of
    :func:`micro_batch_sums` (each divided by the same number)."""
    centred_sum, square_sum, count = means
    centred_mean = tf.math.divide_no_nan(centred_sum, count)
    centred_square = tf.math.divide_no_nan(square_sum, count)
    mean = shift + centred_mean
    # Rounding can make a constant channel's variance a hair negative.
    variance = tf.maximum(centred_square - tf.square(centred_mean), 0.0)
    return mean, variance
