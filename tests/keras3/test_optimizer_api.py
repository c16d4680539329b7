"""The optimizer wrapper's Keras optimizer API: raw ``tf.Variable``s in a
custom loop, ``apply_gradients``' return value, ``get_weights``/``set_weights``
covering the wrapped optimizer's state. References are plain Keras optimizers.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator import GradientAccumulateOptimizer
from tests import utils

K = 2


def _cycles(seed: int = 0, cycles: int = 2):
    rng = np.random.default_rng(seed)
    return [
        [
            (
                rng.normal(size=(3, 2)).astype("float32"),
                rng.normal(size=4).astype("float32"),
            )
            for _ in range(K)
        ]
        for _ in range(cycles)
    ]


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_raw_tf_variables_mixed_with_keras_variables(mode):
    """A custom loop over a keras.Variable and a raw tf.Variable: the wrapper
    accepts both (as Keras' optimizers do) and applies SGD to the mean gradient
    of every cycle."""
    init_k = np.arange(6, dtype="float32").reshape(3, 2)
    init_t = np.linspace(-1, 1, 4).astype("float32")
    kv, tv = keras.Variable(init_k), tf.Variable(init_t)
    ref_k, ref_t = keras.Variable(init_k), tf.Variable(init_t)
    opt = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), K)
    sgd = keras.optimizers.SGD(0.1)

    def step(gk, gt):
        return opt.apply_gradients([(gk, kv), (gt, tv)])

    if mode == "function":
        step = tf.function(step)
    for n, cycle in enumerate(_cycles()):
        for gk, gt in cycle:
            result = step(tf.constant(gk), tf.constant(gt))
        # What plain Keras' apply_gradients returns: the update count.
        assert int(result) == n + 1
        mean_k = np.mean([g for g, _ in cycle], axis=0)
        mean_t = np.mean([g for _, g in cycle], axis=0)
        sgd.apply_gradients([(mean_k, ref_k), (mean_t, ref_t)])
    assert int(opt.iterations) == 2
    utils.assert_trained([init_k, init_t], [np.asarray(kv), tv.numpy()])
    utils.assert_same_weights(
        [np.asarray(kv), tv.numpy()], [np.asarray(ref_k), ref_t.numpy()], 1e-6
    )


def test_apply_gradients_returns_update_count_like_keras():
    """``apply_gradients`` returns the iterations variable's value: updates,
    not calls (Keras returns its ``iterations``); ``apply`` returns what
    Keras' ``apply`` does (None)."""
    v = keras.Variable(np.ones(3, "float32"))
    plain = keras.optimizers.SGD(0.1)
    keras_result = plain.apply_gradients([(tf.ones(3), keras.Variable(np.ones(3)))])
    assert int(keras_result) == 1
    opt = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), K)
    counts = [int(opt.apply_gradients([(tf.ones(3), v)])) for _ in range(4)]
    assert counts == [0, 1, 1, 2]
    assert opt.apply([tf.ones(3)], [v]) is None


def _trained_wrapper(seed):
    var = keras.Variable(np.ones((3, 2), "float32"))
    opt = GradientAccumulateOptimizer(keras.optimizers.Adam(0.1), K)
    # One full cycle and a pending micro-batch: every kind of state is set.
    for gk, _ in [*_cycles(seed, 1)[0], _cycles(seed + 1, 1)[0][0]]:
        opt.apply([gk], [var])
    return opt, var


def test_get_and_set_weights_cover_the_wrapped_optimizer():
    """``get_weights`` lists ``variables`` (wrapper and wrapped optimizer);
    ``set_weights`` sets all of them, so the two wrappers then continue
    identically."""
    source, var_a = _trained_wrapper(0)
    target, var_b = _trained_wrapper(7)
    weights = source.get_weights()
    assert len(weights) == len(source.variables)
    assert len(source.inner_optimizer.variables) > 2  # Adam's moments
    inner = [np.asarray(v) for v in source.inner_optimizer.variables]
    assert (
        utils.max_abs_diff(
            inner, [np.asarray(v) for v in target.inner_optimizer.variables]
        )
        > 1e-3
    )
    target.set_weights(weights)
    utils.assert_same_weights(
        [np.asarray(v) for v in target.inner_optimizer.variables], inner, 0.0
    )
    as_float = lambda ws: [np.asarray(w, "float64") for w in ws]  # noqa: E731
    utils.assert_same_weights(as_float(target.get_weights()), as_float(weights), 0.0)
    # Same state, same gradients: the same next update.
    var_b.assign(var_a)
    for gk, _ in _cycles(3, 1)[0]:
        source.apply([gk], [var_a])
        target.apply([gk], [var_b])
    utils.assert_same_weights([np.asarray(var_b)], [np.asarray(var_a)], 0.0)


def test_set_weights_refuses_a_partial_list():
    opt, _ = _trained_wrapper(0)
    weights = opt.get_weights()
    with pytest.raises(ValueError, match="wrapped optimizer"):
        opt.set_weights(weights[: len(opt._variables)])
    with pytest.raises(ValueError, match="shape"):
        opt.set_weights([np.zeros((5, 5))] * len(weights))
