"""``split_gradients.split_gradients``, the one function every model
host takes a micro-batch's gradients from, on exact small numbers: which
gradients and which weight the engine is handed on each path (weight in
the loss, weight on the gradients, several denominators, a float16
overflow recomputed at a smaller seed)."""

import numpy as np
import tensorflow as tf

from gradient_accumulator.core.split_gradients import split_gradients
from gradient_accumulator.core.weighting import Denominator


def _group(terms, weight, count=1.0):
    return Denominator(terms, tf.constant(weight), tf.constant(count))


def _two_terms():
    """Term 0 reads ``w * x``, term 1 reads ``w * w``; the loss also holds
    ``0.5 * sum(w)``, which no term owns (regularisation)."""
    w = tf.Variable([2.0, -1.0])
    x = tf.constant([1.0, 3.0])
    with tf.GradientTape(persistent=True) as tape:
        outputs = [w * x, w * w]
        objective = (
            tf.reduce_sum(outputs[0])
            + tf.reduce_sum(outputs[1])
            + 0.5 * tf.reduce_sum(w)
        )
    return tape, objective, outputs, w


def test_one_group_with_its_weight_in_the_loss():
    tape, objective, _, w = _two_terms()
    found = split_gradients(tape, objective, [w], [_group([0, 1], 4.0)])
    # d/dw = x + 2w + 0.5
    np.testing.assert_array_equal(found.grads[0].numpy(), [5.5, 1.5])
    assert found.weight is None
    assert found.parts == []
    assert found.overflowed is None


def test_one_group_with_its_weight_on_the_gradients():
    tape, objective, _, w = _two_terms()
    found = split_gradients(tape, objective, [w], [_group([0, 1], 4.0)], unscale=0.25)
    np.testing.assert_array_equal(found.grads[0].numpy(), [5.5, 1.5])
    assert float(found.weight) == 1.0
    assert found.parts == []


def test_several_denominators_split_the_gradient_by_group():
    tape, objective, outputs, w = _two_terms()
    groups = [_group([0], 2.0, 1.0), _group([1], 3.0, 5.0)]
    found = split_gradients(tape, objective, [w], groups, outputs=outputs, unscale=0.5)
    # The first group keeps its term and what no term owns: x + 0.5.
    np.testing.assert_array_equal(found.grads[0].numpy(), [1.5, 3.5])
    assert float(found.weight) == 1.0
    [(own, weight, count)] = found.parts
    np.testing.assert_array_equal(own[0].numpy(), [4.0, -2.0])  # 2w
    assert (float(weight), float(count)) == (1.5, 5.0)
    assert found.overflowed is None


def test_an_overflow_is_redone_at_a_smaller_seed_and_unscaled_by_it():
    w = tf.Variable([[3.0], [-3.0]])
    x = tf.constant([[1.0, 0.5]])
    scale = tf.constant(2.0**16)

    @tf.function
    def run(scale):
        with tf.GradientTape(persistent=True) as tape:
            # float16 backward pass: d/dw = x^T * scale, 65536 overflows.
            out = tf.matmul(tf.cast(x, tf.float16), tf.cast(w, tf.float16))
            objective = tf.cast(tf.reduce_sum(out), tf.float32) * scale
        found = split_gradients(
            tape,
            objective,
            [w],
            [_group([0], 4.0)],
            unscale=1.0 / scale,
            retry_scale=scale,
        )
        return found.grads[0], found.weight, found.overflowed

    grad, weight, overflowed = run(scale)
    assert bool(overflowed)
    # Seed 1/2: the gradient is half the scaled one, its weight twice 4/scale.
    np.testing.assert_array_equal(grad.numpy(), [[2.0**15], [2.0**14]])
    assert float(weight) == 8.0 / 2.0**16
    grad, weight, overflowed = run(tf.constant(2.0**10))
    assert not bool(overflowed)
    np.testing.assert_array_equal(grad.numpy(), [[2.0**10], [2.0**9]])
    assert float(weight) == 4.0 / 2.0**10
