"""Gradient caching: the exact gradient of a loss that couples a batch's
samples (in-batch negatives, contrastive and triplet losses) with one
slice's activations in memory at a time. Plain TensorFlow, no Keras.

Gao et al. 2021 ("Scaling Deep Contrastive Learning Batch Size under Memory
Limited Setup"): a first pass runs the model on every slice without a tape
and keeps only the outputs (:func:`forward_slices`); the loss is computed
once, on the whole batch's outputs, under a tape that watches them; a second
pass runs each slice forward again under a tape and back-propagates its rows
of the loss's output gradients into the weights (:func:`backward_slices`).
By the chain rule the sum over slices is the whole batch's weight gradient;
the price is one more forward pass. :class:`CachedTape` puts the two
together behind ``tf.GradientTape.gradient``, so the code that weighs,
splits and unscales a batch's gradients runs unchanged on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf

from gradient_accumulator.core._tf_compat import keras_mask, with_keras_mask
from gradient_accumulator.core.arithmetic import plus

# forward(x_slice) -> the model's outputs for those rows (a structure).
Forward = Callable[[object], object]


def forward_slices(forward: Forward, x, size: int):
    """``forward`` of the whole ``x``, run on its consecutive slices of
    ``size`` rows, one at a time: the outputs concatenated, Keras masks
    included. Run it outside any tape: only the outputs are kept.

    Every slice has ``size`` rows (a static shape, as XLA compiles a loop
    body): the last repeats the batch's last row as padding, and the padded
    rows' outputs are dropped (BatchNormalization, whose outputs would see
    them, is refused by the hosts)."""
    n = _rows(x)
    count = (n + size - 1) // size
    first = forward(_rows_of(x, _indices(0, size, n)))
    flat = tf.nest.flatten(first)
    masks = [keras_mask(t) for t in flat]
    kept = flat + [m for m in masks if m is not None]

    def body(i, arrays):
        out = tf.nest.flatten(forward(_rows_of(x, _indices(i * size, size, n))))
        out += [keras_mask(t) for t, m in zip(out, masks) if m is not None]
        return i + 1, [a.write(i, t) for a, t in zip(arrays, out)]

    arrays = [
        tf.TensorArray(t.dtype, size=count, element_shape=t.shape).write(0, t)
        for t in kept
    ]
    _, arrays = tf.while_loop(
        lambda i, _: i < count,
        body,
        (_after(kept, n), arrays),
        parallel_iterations=1,
    )
    whole = [a.concat()[:n] for a in arrays]
    outputs, rest = whole[: len(flat)], iter(whole[len(flat) :])
    outputs = [
        t if m is None else with_keras_mask(t, next(rest))
        for t, m in zip(outputs, masks)
    ]
    return tf.nest.pack_sequence_as(first, outputs)


def backward_slices(
    forward: Forward, x, seeds: Sequence, size: int, variables: Sequence
) -> list:
    """The gradient with respect to ``variables`` of ``sum(outputs * seeds)``
    over the flat outputs of ``forward(x)``, run on the slices of
    :func:`forward_slices`, each slice forward again under its own tape:
    ``seeds`` are the loss's gradients with respect to the whole batch's
    outputs (None: the loss does not read that output); padded rows get a
    zero seed. Dense sums; None for a variable no output reaches.
    :func:`add_slices` hands each slice's gradients on instead."""
    n = _rows(x)
    count = (n + size - 1) // size
    seeds = list(seeds)

    # The first slice outside the loop: which variables get a gradient is
    # structural, and the loop carries only theirs.
    zero = tf.constant(0, n.dtype)
    first = _slice_gradients(forward, x, seeds, size, variables, zero)
    present = [i for i, g in enumerate(first) if g is not None]
    zeros = [tf.zeros(variables[i].shape, first[i].dtype) for i in present]
    sums = [plus(z, first[i], None) for z, i in zip(zeros, present)]

    def body(i, sums):
        found = _slice_gradients(forward, x, seeds, size, variables, i)
        return i + 1, [plus(s, found[j], None) for s, j in zip(sums, present)]

    _, sums = tf.while_loop(
        lambda i, _: i < count,
        body,
        (_after(sums, n), sums),
        parallel_iterations=1,
    )
    whole = [None] * len(variables)
    for i, total in zip(present, sums):
        whole[i] = total
    return whole


def add_slices(
    forward: Forward,
    x,
    seeds: Sequence,
    size: int,
    variables: Sequence,
    add: Callable[[list], None],
) -> list[bool]:
    """The gradient of :func:`backward_slices`, slice by slice: ``add`` is
    called with each slice's gradients (None where a variable gets none) and
    adds them where the sum is kept (an accumulator's variables, in place).
    Only one slice's gradients are alive at a time, not also a running sum
    as large as the weights. Returns which variables got a gradient."""
    n = _rows(x)
    count = (n + size - 1) // size
    seeds = list(seeds)
    # Structural, the same in every slice: recorded when the body is traced.
    present: list[list[bool]] = []

    def body(i):
        grads = _slice_gradients(forward, x, seeds, size, variables, i)
        present.append([g is not None for g in grads])
        add(grads)
        return (i + 1,)

    tf.while_loop(
        lambda i: i < count, body, (tf.constant(0, n.dtype),), parallel_iterations=1
    )
    return present[0]


def _slice_gradients(forward: Forward, x, seeds: list, size: int, variables, i):
    """Slice ``i``'s gradients with respect to ``variables`` of its rows of
    ``sum(outputs * seeds)`` (see :func:`backward_slices`)."""
    n = _rows(x)
    rows = _indices(i * size, size, n)
    real = tf.range(size, dtype=n.dtype) + i * size < n
    with tf.GradientTape() as tape:
        out = tf.nest.flatten(forward(_rows_of(x, rows)))
    # The seeds once the forward pass has run: the backward ops that read a
    # seed alone (a pooling's or a broadcast's gradient) would otherwise run
    # first and hold their results through the forward pass, which plain
    # training, whose seeds come from its loss, never does (measured with
    # benchmarks/gradient_cache.py: 1.22-1.24x the peak of plain training on
    # a slice plus the outputs, 1.04-1.07x with this).
    with tf.control_dependencies(out):
        read = [(o, _seed(s, rows, real)) for o, s in zip(out, seeds) if s is not None]
    return tape.gradient(
        [o for o, _ in read],
        list(variables),
        output_gradients=[tf.cast(s, o.dtype) for o, s in read],
    )


class CachedTape:
    """A ``tf.GradientTape`` for a batch whose outputs came from
    :func:`forward_slices`: ``gradient`` as the tape of one forward pass over
    the whole batch would give it.

    ``tape``: a persistent tape on which the loss was computed from the
    watched ``outputs`` (flat); ``variables``: what ``backward(seeds)``
    differentiates (see :func:`backward_slices`). A gradient with respect to
    a variable is the tape's own (a regularisation penalty reads the weights
    directly) plus the backward pass of the output gradients; with respect to
    an output, the tape's. Each call runs the second pass once.
    """

    def __init__(
        self,
        tape: tf.GradientTape,
        outputs: Sequence[tf.Tensor],
        variables: Sequence,
        backward: Callable[[list], list],
    ):
        self._tape = tape
        self._outputs = list(outputs)
        self._variables = list(variables)
        self._backward = backward

    def gradient(self, target, sources, output_gradients=None) -> list:
        sources = list(sources)
        k = len(self._outputs)
        found = self._tape.gradient(
            target, [*self._outputs, *sources], output_gradients=output_gradients
        )
        seeds, direct = found[:k], found[k:]
        if all(s is None for s in seeds):
            return direct
        # By identity: Keras 3's variables are not hashable tensors.
        through = dict(zip(map(id, self._variables), self._backward(seeds)))
        return [_add(d, through.get(id(s))) for s, d in zip(sources, direct)]


def _add(direct, through):
    if through is None:
        return direct
    return through if direct is None else plus(through, direct, None)


def _rows(x) -> tf.Tensor:
    first = next(t for t in tf.nest.flatten(x) if t is not None)
    return tf.shape(first)[0]


def _after(tensors, n) -> tf.Tensor:
    """The loop's first index, 1, computed once ``tensors`` (the first
    slice's results) are: otherwise TensorFlow may start the loop's first
    slice while the first is still running, holding two slices' activations
    (measured: 1.9x the memory of one slice plus the outputs, 1.2x with
    this)."""
    with tf.control_dependencies(tensors):
        return tf.identity(tf.constant(1, n.dtype))


def _indices(start, size: int, n):
    """Rows ``start .. start + size - 1``, the ones past the batch's end
    repeating its last row (``size`` static)."""
    return tf.minimum(start + tf.range(size, dtype=n.dtype), n - 1)


def _rows_of(x, indices):
    """Those rows of every tensor of the structure ``x``."""
    return tf.nest.map_structure(
        lambda t: None if t is None else tf.gather(t, indices), x
    )


def _seed(seed, indices, real):
    """The output gradient of a slice's rows: 0 on padding rows."""
    rows = tf.gather(seed, indices)
    shape = tf.concat([tf.shape(real), tf.ones([tf.rank(rows) - 1], tf.int32)], 0)
    return rows * tf.cast(tf.reshape(real, shape), rows.dtype)
