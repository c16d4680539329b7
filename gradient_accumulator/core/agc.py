"""Adaptive gradient clipping (Brock et al., 2021, "High-Performance Large-Scale
Image Recognition Without Normalization"), as in gradient-accumulator 0.5.x.

Each unit's gradient norm is limited to ``clip_factor`` times the unit's
parameter norm (at least ``eps``). A unit is an output unit of a layer: the
last axis of a kernel, the whole tensor for scalars and vectors.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

# Below this gradient norm a unit is never scaled (avoids dividing by ~0).
_MIN_GRAD_NORM = 1e-6


def compute_norm(x: tf.Tensor, axis=None, keepdims: bool = False) -> tf.Tensor:
    """Euclidean (L2) norm of ``x`` over ``axis`` (all axes when ``None``),
    keeping the reduced axes as size 1 when ``keepdims``; the helper
    gradient-accumulator 0.5.x exported from ``gradient_accumulator.core.agc``.

    >>> import tensorflow as tf
    >>> x = tf.constant([[3.0, 0.0], [4.0, 1.0]])
    >>> [float(v) for v in compute_norm(x, axis=0, keepdims=False)]
    [5.0, 1.0]
    """
    x = tf.convert_to_tensor(x)
    return tf.sqrt(tf.reduce_sum(tf.square(x), axis=axis, keepdims=keepdims))


def unitwise_norm(x: tf.Tensor) -> tf.Tensor:
    """L2 norm per unit, as in the NFNets reference code: the whole tensor for
    scalars and vectors, axis 0 for dense (and multi-head dense) kernels, all
    axes but the last for convolution kernels; kept dims broadcast against x."""
    x = tf.convert_to_tensor(x)
    rank = x.shape.rank
    if rank is None:
        raise ValueError("unitwise_norm needs a tensor of known rank.")
    if rank <= 1:
        return compute_norm(x)
    axis = [0] if rank in (2, 3) else list(range(rank - 1))
    return compute_norm(x, axis=axis, keepdims=True)


# The clipping's defaults, also the accumulation settings' (core/settings.py).
CLIP_FACTOR = 0.01
EPS = 1e-3


def adaptive_clip_grad(
    parameters: Sequence,
    gradients: Sequence,
    clip_factor: float = CLIP_FACTOR,
    eps: float = EPS,
) -> list:
    """Returns ``gradients`` clipped unit-wise relative to ``parameters``.

    ``None`` gradients stay ``None``. Example:

    >>> import tensorflow as tf
    >>> w = tf.ones((2, 3))
    >>> g = adaptive_clip_grad([w], [tf.fill((2, 3), 10.0)], clip_factor=0.1)
    >>> [round(float(v), 4) for v in tf.norm(g[0], axis=0)]
    [0.1414, 0.1414, 0.1414]
    """
    clipped = []
    for param, grad in zip(parameters, gradients):
        if grad is None:
            clipped.append(None)
            continue
        if isinstance(grad, tf.IndexedSlices):
            grad = tf.convert_to_tensor(grad)
        param = tf.cast(tf.convert_to_tensor(param), grad.dtype)
        max_norm = tf.maximum(unitwise_norm(param), eps) * clip_factor
        grad_norm = unitwise_norm(grad)
        scaled = grad * (max_norm / tf.maximum(grad_norm, _MIN_GRAD_NORM))
        clipped.append(tf.where(grad_norm > max_norm, scaled, grad))
    return clipped
