"""Under ``mixed_float16`` the model wrapper skips no cycle Keras' big batch
applies, though a micro-batch's own sums overflow where the big batch's
cancel (issue 24, item 2).

Dividing each micro-batch's loss by its share of the cycle gives its
backward pass the big batch's per-sample magnitudes, but a weight gradient is
a sum over samples: over the micro-batch's own, which need not cancel as the
big batch's do. Such a micro-batch's backward pass is recomputed at a
smaller seed (``gradient_accumulator.core.overflow``) instead of its cycle being
skipped. References and tolerances are those of ``test_mixed_precision``.
"""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import utils
from tests.keras3.test_mixed_precision import (
    CYCLE,
    F16_ATOL,
    LSO,
    MARGIN,
    B,
    K,
    _inner,
    _overflows,
)

CYCLES = 3
LAYERS = functools.partial(utils.mlp_layers, classes=2)


def _cancelling_data():
    """``CYCLES`` cycles of one small input repeated, whose micro-batches hold one
    label each, alternating (0, 1, 0, 1): each micro-batch's gradient sums
    ``B`` equal per-sample gradients, while the big batch's two labels
    nearly cancel (the model predicts about 1/2 for both near zero)."""
    x1, _ = utils.classification_data(1, seed=4)
    x = np.repeat(x1 * 0.01, CYCLES * CYCLE, axis=0)
    y = (np.arange(CYCLES * CYCLE) // B) % 2
    return x, y


class _CycleEnds(keras.callbacks.Callback):
    """``optimizer.iterations`` after each cycle's last ``fit`` step."""

    def __init__(self, steps_per_cycle: int):
        super().__init__()
        self.steps_per_cycle = steps_per_cycle
        self.iterations: list[int] = []

    def on_train_batch_end(self, batch, logs=None):
        if (batch + 1) % self.steps_per_cycle == 0:
            self.iterations.append(int(self.model.optimizer.iterations))


def _skipped(log: _CycleEnds) -> set[int]:
    done = [0, *log.iterations]
    return {c for c in range(len(log.iterations)) if done[c + 1] == done[c]}


def _scaled(scale: float) -> LSO:
    return LSO(_inner(), initial_scale=scale, dynamic_growth_steps=1000)


def _largest_finite_scale(x, y) -> float:
    """The largest power of two at which the big batch's float16 backward
    pass of the first cycle is finite; a micro-batch overflows there (the
    precondition that lets the test fail)."""
    probe = utils.seeded(lambda: utils.plain_model(LAYERS))
    scale = 2.0
    while not _overflows(probe, x[:CYCLE], y[:CYCLE], 2 * scale):
        scale *= 2
        assert scale < 2.0**40, "the big batch never overflows"
    # The micro-batch's loss divided by its share, as the wrapper does.
    assert _overflows(probe, x[:B], y[:B], scale / K), scale
    return scale


@pytest.mark.parametrize("mode", ["streaming", "in-step", "xla", "gradient-cache"])
def test_skips_only_cycles_the_big_batch_skips(mode):
    """At the big batch's largest finite scale, a micro-batch whose own sums
    overflow is recomputed, not skipped: the wrapper applies at least the big
    batch's updates, skips a subset of its cycles, halves its scale after a
    rescued cycle, and is as close to float32 as Keras' mixed big batch
    (streaming, in-step, XLA, and gradient_cache, whose second pass sums
    each slice's samples apart from the rest of the batch's)."""
    x, y = _cancelling_data()
    keras.mixed_precision.set_global_policy("float32")
    reference = utils.seeded(lambda: utils.plain_model(LAYERS))
    reference.compile(optimizer=_inner(), loss=utils.sparse_ce())
    utils.fit(reference, x, y, CYCLE)

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        scale = _largest_finite_scale(x, y)
        big = utils.seeded(lambda: utils.plain_model(LAYERS))
        big.compile(optimizer=_scaled(scale), loss=utils.sparse_ce())
        big_log = _CycleEnds(1)
        utils.fit(big, x, y, CYCLE, callbacks=[big_log])

        settings = {
            "in-step": {"micro_batch_size": B},
            "gradient-cache": {"micro_batch_size": B, "gradient_cache": True},
        }.get(mode, {"accum_steps": K})
        ours = utils.seeded(lambda: utils.accumulating_model(LAYERS, **settings))
        ours.compile(
            optimizer=_scaled(scale),
            loss=utils.sparse_ce(),
            jit_compile=mode == "xla",
        )
        sliced = "micro_batch_size" in settings
        batch = CYCLE if sliced else B
        log = _CycleEnds(1 if sliced else K)
        utils.fit(ours, x, y, batch, callbacks=[log])
    finally:
        keras.mixed_precision.set_global_policy("float32")

    assert len(log.iterations) == len(big_log.iterations) == CYCLES
    assert int(ours.optimizer.iterations) >= int(big.optimizer.iterations)
    assert _skipped(log) <= _skipped(big_log), (log.iterations, big_log.iterations)
    assert int(ours.optimizer.iterations) == CYCLES
    # A cycle that needed a smaller seed halves the scale, as an overflow
    # does (once per cycle at most), so it settles where micro-batches fit.
    big_scale = float(big.optimizer.dynamic_scale)
    assert big_scale == scale
    assert big_scale / 2**CYCLES <= float(ours.optimizer.dynamic_scale) < big_scale
    low_precision_error = utils.max_abs_diff(
        utils.weights(big), utils.weights(reference)
    )
    assert 0 < low_precision_error < 1e-3
    utils.assert_same_weights(
        utils.weights(ours), utils.weights(reference), MARGIN * low_precision_error
    )
    utils.report(
        utils.assert_same_weights(utils.weights(ours), utils.weights(big), F16_ATOL)
    )


def test_nan_micro_batch_still_skips_the_cycle():
    """A micro-batch whose gradient is not finite at any seed (a NaN input)
    is not rescued: its whole cycle is skipped and the scale halved, as
    Keras skips the big batch holding it."""
    clean = utils.classification_data(CYCLE, seed=1)
    poisoned = utils.classification_data(CYCLE, seed=2)
    poisoned[0][2 * B + 3, 0] = np.nan

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        big = utils.seeded(utils.plain_model)
        big.compile(optimizer=_scaled(2.0**15), loss=utils.sparse_ce())
        ours = utils.seeded(lambda: utils.accumulating_model(accum_steps=K))
        ours.compile(optimizer=_scaled(2.0**15), loss=utils.sparse_ce())
        for model, batch in ((big, CYCLE), (ours, B)):
            utils.fit(model, *clean, batch)
        before = utils.weights(ours)
        for model, batch in ((big, CYCLE), (ours, B)):
            utils.fit(model, *poisoned, batch)
    finally:
        keras.mixed_precision.set_global_policy("float32")

    assert int(big.optimizer.iterations) == 1  # Keras skipped it too
    assert int(ours.optimizer.iterations) == 1
    for old, new in zip(before, utils.weights(ours)):
        np.testing.assert_array_equal(new, old)
    assert float(ours.optimizer.dynamic_scale) == float(big.optimizer.dynamic_scale)
    assert float(ours.optimizer.dynamic_scale) == 2.0**14
    state = utils.accumulator(ours)
    assert int(state.micro_step) == 0
    for buffer in [state.weight_sum, *state.grad_sums]:
        assert not np.any(np.asarray(buffer)), buffer.path


def test_retry_unscales_by_the_seed_it_used():
    """``finite_gradients`` returns the gradients of ``factor * target`` for
    the largest power-of-two ``factor`` at which they are finite, computed
    in float16 from one forward pass; None stays None."""
    from gradient_accumulator.core.overflow import finite_gradients

    w = tf.Variable([[3.0], [-3.0]])
    unused = tf.Variable(1.0)
    x = tf.constant([[1.0, 0.5]])

    @tf.function
    def run(scale, retries=2):
        with tf.GradientTape(persistent=True) as tape:
            # float16 backward pass: d/dw = x^T * scale, overflowing above 65504.
            out = tf.matmul(tf.cast(x, tf.float16), tf.cast(w, tf.float16))
            target = tf.cast(tf.reduce_sum(out), tf.float32) * scale
        return finite_gradients(tape, target, [w, unused], scale, retries)

    (grad, none), factor = run(tf.constant(2.0**16))
    assert none is None
    assert float(factor) == 0.5
    np.testing.assert_array_equal(grad.numpy() / float(factor), [[2.0**16], [2.0**15]])
    (grad, _), factor = run(tf.constant(2.0**10))
    assert float(factor) == 1.0
    np.testing.assert_array_equal(grad.numpy(), [[2.0**10], [2.0**9]])
    # At most ``retries`` halvings: 2**18 needs three (65536 still overflows).
    (grad, _), factor = run(tf.constant(2.0**18))
    assert float(factor) == 0.25
    assert not np.all(np.isfinite(grad.numpy()))
    (grad, _), factor = run(tf.constant(2.0**18), retries=3)
    assert float(factor) == 0.125
    np.testing.assert_array_equal(grad.numpy() / 0.125, [[2.0**18], [2.0**17]])


def test_a_rescued_cycle_halves_the_scale_and_restarts_growth():
    """``on_apply(overflowed=True)`` halves the scale and restarts the count
    toward growth, as a skipped cycle does, but the update stands; without
    an overflow the scale grows after ``growth_steps`` updates."""
    from gradient_accumulator.core.dynamic_scale import cycle_hooks

    scale, counter = tf.Variable(1024.0), tf.Variable(0, dtype=tf.int64)
    on_apply, _ = cycle_hooks(scale, counter, growth_steps=2)
    on_apply(tf.constant(False))
    assert (float(scale), int(counter)) == (1024.0, 1)
    on_apply(tf.constant(True))
    assert (float(scale), int(counter)) == (512.0, 0)
    on_apply()
    on_apply()
    assert (float(scale), int(counter)) == (1024.0, 0)
