"""Arithmetic on gradient sums, for the engine: weighting and adding a
micro-batch's gradients (dense, sparse, or the cycle maximum of float8
state), the mean, and the sum of squares that doubles as the finite check.
Plain TensorFlow; no state of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from gradient_accumulator.core._tf_compat import (
    distributed_container,
    on_device_or_primary,
)


def squared_norm(tensors: Sequence[tf.Tensor | None]) -> tf.Tensor:
    """The sum of squares of all ``tensors``' entries (a float32 scalar).

    One read pass per tensor (``l2_loss`` is a single fused kernel). It is
    non-finite exactly when some entry is NaN or Inf, or so large (> 1e19) that
    no optimizer update with it would stay finite, so it doubles as the
    finite check of an update.
    """
    parts = [tf.nn.l2_loss(tf.cast(t, tf.float32)) for t in tensors if t is not None]
    if not parts:
        return tf.constant(0.0)
    return 2.0 * tf.add_n(parts)


def raw(variable) -> tf.Variable:
    """The TensorFlow variable behind ``variable`` (a Keras variable keeps
    it in ``.value``; under a strategy, a distributed variable)."""
    return variable if isinstance(variable, tf.Variable) else variable.value


def now(variable) -> int:
    """An integer variable's value now (eager, also while a step is traced)."""
    with tf.init_scope():
        return int(raw(variable).numpy())


def var_key(variable) -> int:
    return id(distributed_container(raw(variable)))


def overwritten(variable) -> bool:
    """Whether ``variable`` is overwritten with its "gradient" rather than
    trained (``overwrite_with_gradient=True``: the scales and amax histories
    of ``model.quantize("float8")``).

    Such a gradient is a new value computed in the backward pass, not a
    derivative of the loss: it does not scale with the loss, its weight or a
    loss scale. Its buffer keeps the maximum over the cycle, which is also
    what is applied (Keras' own ``gradient_accumulation_steps`` does the
    same); weights are ignored and nothing is divided. This function and the
    ``maximum`` branches below are the only places that know of them.
    """
    return bool(getattr(variable, "overwrite_with_gradient", False))


def _weighted(grad, weight):
    """``weight * grad`` in float32, an ``IndexedSlices`` kept sparse
    (``weight=None``: the gradient as it is)."""
    if isinstance(grad, tf.IndexedSlices):
        values = tf.cast(grad.values, tf.float32)
        values = values if weight is None else values * weight
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    grad = tf.cast(tf.convert_to_tensor(grad), tf.float32)
    return grad if weight is None else grad * weight


def add_into(buffer, grad, weight, first: bool = False, maximum: bool = False) -> None:
    """Adds ``weight * grad`` to the variable ``buffer``; ``first``: the
    buffer holds only leftovers of an earlier cycle, so the sum starts here.
    ``maximum``: keep the element-wise maximum of ``grad`` instead (see
    :func:`overwritten`). :func:`plus` is the same rule for tensors."""
    target = raw(buffer)
    if maximum:
        grad = _weighted(grad, None)
        target.assign(grad) if first else target.assign(tf.maximum(target, grad))
        return
    grad = _weighted(grad, weight)
    if isinstance(grad, tf.IndexedSlices):
        # Embedding gradients: scatter the touched rows instead of densifying
        # a whole table every micro-step.
        if isinstance(target, tf.distribute.DistributedValues):
            # A replica-local (SyncOnRead) buffer refuses scatter ops as a
            # whole; in replica context the replica's own component is what
            # assign_add would update, so scatter into that.
            target = on_device_or_primary(target)
        if first:
            target.assign(tf.zeros(target.shape, target.dtype))
        target.scatter_add(grad)
    else:
        # Overwriting leftovers instead of zeroing the buffers at every update
        # and adding to zeros spares two passes over every gradient per cycle.
        target.assign(grad) if first else target.assign_add(grad)


def dense(tensors) -> list[tf.Tensor]:
    """The tensors among ``tensors`` (IndexedSlices as their values)."""
    found = []
    for t in tensors:
        if isinstance(t, tf.IndexedSlices):
            found.append(t.values)
        elif isinstance(t, tf.Tensor | tf.Variable):
            found.append(t)
    return found


def divide(sums, variables, inverse) -> list:
    """The mean gradient: ``sums * inverse``, except for the cycle maxima of
    overwritten variables (see :func:`overwritten`)."""
    return [
        g if g is None or overwritten(v) else g * inverse
        for g, v in zip(sums, variables)
    ]


def sparse(grad) -> bool:
    return isinstance(grad, tf.IndexedSlices)


def plus(total: tf.Tensor | None, grad, weight, maximum: bool = False) -> tf.Tensor:
    """``total + weight * grad`` as a dense tensor (``total=None``: zeros;
    a sparse ``grad`` needs a ``total``); ``maximum``: their element-wise
    maximum (``grad`` alone if ``total`` is None). :func:`add_into` for tensors."""
    if maximum:
        grad = _weighted(grad, None)
        return grad if total is None else tf.maximum(total, grad)
    grad = _weighted(grad, weight)
    if sparse(grad):
        indices = tf.expand_dims(grad.indices, -1)
        return tf.tensor_scatter_nd_add(total, indices, grad.values)
    return grad if total is None else total + grad


def minus(total, grad):
    """``total - grad`` for gradients of one variable (None: nothing), an
    ``IndexedSlices`` kept sparse (rows of ``grad`` added negated)."""
    if grad is None:
        return total
    if total is None:
        return _weighted(grad, -1.0)
    if sparse(total) or sparse(grad):
        a, b = (_as_slices(t) for t in (total, grad))
        return tf.IndexedSlices(
            tf.concat([a.values, -b.values], 0),
            tf.concat([tf.cast(t.indices, tf.int64) for t in (a, b)], 0),
            a.dense_shape,
        )
    return total - grad


def _as_slices(grad) -> tf.IndexedSlices:
    if sparse(grad):
        return tf.IndexedSlices(
            tf.cast(grad.values, tf.float32), grad.indices, grad.dense_shape
        )
    grad = tf.cast(grad, tf.float32)
    rows = tf.shape(grad, out_type=tf.int64)[0]
    return tf.IndexedSlices(grad, tf.range(rows), tf.shape(grad, out_type=tf.int64))
