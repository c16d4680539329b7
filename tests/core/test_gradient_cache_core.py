"""``core/gradient_cache.py`` on exact small numbers: slices run forward
and concatenated are the whole batch's outputs (with their Keras masks);
the output gradients back-propagated slice by slice are the whole batch's
weight gradient, summed in the loop or handed on slice by slice;
:class:`CachedTape` gives what one tape over the whole batch gives, for a
loss that couples the rows and a penalty that reads the weights directly."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from gradient_accumulator.core._tf_compat import keras_mask, with_keras_mask
from gradient_accumulator.core.gradient_cache import (
    CachedTape,
    add_slices,
    backward_slices,
    forward_slices,
)

X = np.arange(14, dtype="float32").reshape(7, 2) - 6.0  # 7 rows: slices 3, 3, 1
W = tf.Variable([[1.0, -2.0], [0.5, 3.0]])
V = tf.Variable([2.0, -1.0])  # reached by no output: no gradient
SEEDS = np.arange(14, dtype="float32").reshape(7, 2) % 5 - 2.0  # of "y"


def forward(rows):
    return {"y": tf.matmul(rows, W), "x": rows}


def coupled_loss(y):
    """Every pair of rows meets: sum of the squared Gram matrix."""
    gram = tf.matmul(y, y, transpose_b=True)
    return tf.reduce_sum(gram * gram) / 100.0


def test_forward_slices_are_the_whole_batch_in_order():
    for size in (1, 3, 7, 10):
        out = forward_slices(forward, tf.constant(X), size)
        np.testing.assert_array_equal(out["y"].numpy(), X @ W.numpy())
        np.testing.assert_array_equal(out["x"].numpy(), X)


def test_forward_slices_carry_keras_masks():
    def masked(rows):
        return with_keras_mask(rows * 2.0, rows[:, 0] > 0)

    out = forward_slices(masked, tf.constant(X), 3)
    np.testing.assert_array_equal(out.numpy(), X * 2.0)
    np.testing.assert_array_equal(keras_mask(out).numpy(), X[:, 0] > 0)


def test_backward_slices_sum_to_the_whole_batch_gradient():
    """d sum(y * S) / dW = X^T S, exactly, in slices of 3, 3 and 1."""
    grads = backward_slices(
        forward, tf.constant(X), [None, tf.constant(SEEDS)], 3, [W, V]
    )
    np.testing.assert_array_equal(grads[0].numpy(), X.T @ SEEDS)
    assert grads[1] is None


def test_add_slices_hands_on_each_slice_once():
    """Eager, each slice's own X_s^T S_s (the padded row of the last
    slice adds nothing); traced, the same sum in the variable."""
    handed = []
    present = add_slices(
        forward, tf.constant(X), [None, tf.constant(SEEDS)], 3, [W, V], handed.append
    )
    assert present == [True, False]
    assert [g[1] for g in handed] == [None, None, None]
    for grads, rows in zip(handed, (slice(0, 3), slice(3, 6), slice(6, 7))):
        np.testing.assert_array_equal(grads[0].numpy(), X[rows].T @ SEEDS[rows])

    total = tf.Variable(tf.zeros([2, 2]))

    @tf.function
    def traced():
        add_slices(
            forward,
            tf.constant(X),
            [None, tf.constant(SEEDS)],
            3,
            [W, V],
            lambda grads: total.assign_add(grads[0]),
        )
        return total.read_value()

    np.testing.assert_array_equal(traced().numpy(), X.T @ SEEDS)


def test_cached_tape_gives_the_one_tape_gradient():
    """A coupled loss on the outputs plus a penalty on W itself."""
    x = tf.constant(X)
    with tf.GradientTape() as whole:
        loss = coupled_loss(forward(x)["y"]) + tf.reduce_sum(W * W)
    expected = whole.gradient(loss, [W, V])

    outputs = forward_slices(forward, x, 3)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(tf.nest.flatten(outputs))
        loss = coupled_loss(outputs["y"]) + tf.reduce_sum(W * W)
    flat = tf.nest.flatten(outputs)

    def backward(seeds):
        return backward_slices(forward, x, seeds, 3, [W, V])

    cached = CachedTape(tape, flat, [W, V], backward)
    found = cached.gradient(loss, [W, V])
    np.testing.assert_allclose(found[0].numpy(), expected[0].numpy(), rtol=1e-6)
    assert found[1] is None and expected[1] is None
    # A seed, as a loss-scale retry passes one: the gradient scales with it.
    half = cached.gradient(loss, [W, V], output_gradients=tf.constant(0.5))
    np.testing.assert_allclose(half[0].numpy(), expected[0].numpy() / 2, rtol=1e-6)
    # With respect to an output: the loss's own gradient, no second pass.
    (seed,) = cached.gradient(loss, [outputs["y"]])
    y = X @ W.numpy()
    np.testing.assert_allclose(seed.numpy(), 4 * (y @ y.T) @ y / 100.0, rtol=1e-6)


def test_a_traced_cached_gradient_equals_the_eager_one():
    x = tf.constant(X)

    @tf.function
    def traced():
        outputs = forward_slices(forward, x, 3)
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(tf.nest.flatten(outputs))
            loss = coupled_loss(outputs["y"])

        def backward(seeds):
            return backward_slices(forward, x, seeds, 3, [W])

        return CachedTape(tape, tf.nest.flatten(outputs), [W], backward).gradient(
            loss, [W]
        )[0]

    with tf.GradientTape() as whole:
        loss = coupled_loss(forward(x)["y"])
    np.testing.assert_allclose(
        traced().numpy(), whole.gradient(loss, W).numpy(), rtol=1e-6
    )
