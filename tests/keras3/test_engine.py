"""Unit tests of the accumulation engine (:class:`Accumulator`) alone, and
of its state record (:class:`EngineState`) and the functions that take it.

No model, no training loop: the engine is driven with hand-made gradients
(``1, 2, 3, 4`` and the like, exact in float32) and an ``apply_fn`` that
stores what it receives in a variable, so every assertion is an exact
equality (as in optax's ``MultiSteps`` tests). Most tests run twice: eagerly
and inside a ``tf.function`` (one trace, several calls), which is how a
host's train step runs the engine.
"""

from __future__ import annotations

import functools
import types
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator.core import engine_state, saved_state
from gradient_accumulator.core.arithmetic import squared_norm
from gradient_accumulator.core.engine_state import EngineState
from gradient_accumulator.core.links import Binding
from gradient_accumulator.keras3._compat import track_variable
from gradient_accumulator.keras3.tracked_engine import Accumulator

MODES = ["eager", "function"]
NAN = float("nan")
INF = float("inf")


class Recorder:
    """An ``apply_fn`` and ``on_apply``/``on_skip`` hooks that write what
    they see into variables (so they also record from a traced function)."""

    def __init__(self, variables):
        # Written once per update, also from a replica under a strategy.
        new = functools.partial(
            keras.Variable, trainable=False, aggregation="only_first_replica"
        )
        self.received = [new(np.zeros(v.shape, "float32")) for v in variables]
        self.calls = new(0, dtype="int64")
        self.applied = new(0, dtype="int64")
        self.skipped = new(0, dtype="int64")

    def apply_fn(self, grads) -> None:
        for target, grad in zip(self.received, grads):
            if grad is not None:
                target.assign(grad)
        self.calls.assign_add(1)

    def on_apply(self) -> None:
        self.applied.assign_add(1)

    def on_skip(self) -> None:
        self.skipped.assign_add(1)

    def counts(self) -> tuple[int, int, int]:
        """(apply_fn calls, on_apply calls, on_skip calls)."""
        return (
            int(self.calls.numpy()),
            int(self.applied.numpy()),
            int(self.skipped.numpy()),
        )

    def got(self, index: int = 0) -> np.ndarray:
        return self.received[index].numpy()


def _variables(*shapes):
    return [
        keras.Variable(np.zeros(shape, "float32"), name=f"v{i}")
        for i, shape in enumerate(shapes)
    ]


def _driver(acc: Accumulator, variables, recorder: Recorder, mode: str):
    """``feed(grads, weight=None, count=None, samples=None)``: one
    ``acc.step`` with the recorder's hooks, eagerly or in a tf.function;
    returns the step's "cycle ended" flag as a Python bool."""

    def step(grads, weight=None, count=None, samples=None):
        return acc.step(
            grads,
            variables,
            recorder.apply_fn,
            weight=weight,
            count=count,
            samples=samples,
            on_apply=recorder.on_apply,
            on_skip=recorder.on_skip,
        )

    run = step if mode == "eager" else tf.function(step)

    def feed(grads, weight=None, count=None, samples=None):
        grads = [
            g if g is None or isinstance(g, tf.IndexedSlices) else tf.constant(g)
            for g in grads
        ]
        as_tensor = functools.partial(tf.constant, dtype=tf.float32)
        weight, count, samples = (
            None if x is None else as_tensor(x) for x in (weight, count, samples)
        )
        return bool(run(grads, weight, count, samples))

    feed.run = run
    return feed


def _state(acc: Accumulator) -> dict:
    return {
        "micro_step": int(acc.state.micro_step.numpy()),
        "accum_steps": int(acc.state.accum_steps_variable.numpy()),
        "next_accum_steps": int(acc.state.next_accum_steps.numpy()),
        "weight_sum": float(acc.state.weight_sum.numpy()),
        "sample_sum": float(acc.state.sample_sum.numpy()),
        "empty": bool(acc.state.empty.numpy()),
    }


def _buffers_are_zero(acc: Accumulator) -> bool:
    return all(not np.any(b.numpy()) for b in acc.state.grad_sums)


# ------------------------------------------------------------ the mean of K
@pytest.mark.parametrize("mode", MODES)
def test_mean_of_four_micro_batches_is_applied_once(mode):
    """Gradients 1, 2, 3, 4 (times a fixed direction) with K=4: apply_fn is
    called once, on the 4th micro-batch, with exactly their mean 2.5; the
    counter goes 1, 2, 3, 0 and the weight sum resets."""
    v, w = _variables((2,), (2, 2))
    acc = Accumulator(4)
    acc.build([v, w])
    rec = Recorder([v, w])
    feed = _driver(acc, [v, w], rec, mode)
    direction = np.array([1.0, -2.0], "float32")
    matrix = np.array([[1.0, 0.5], [-1.0, 4.0]], "float32")

    ended, micro_steps, weight_sums, calls = [], [], [], []
    for k in (1.0, 2.0, 3.0, 4.0):
        ended.append(feed([k * direction, k * matrix], samples=8))
        micro_steps.append(int(acc.state.micro_step.numpy()))
        weight_sums.append(float(acc.state.weight_sum.numpy()))
        calls.append(rec.counts()[0])

    assert ended == [False, False, False, True]
    assert micro_steps == [1, 2, 3, 0]
    assert weight_sums == [1.0, 2.0, 3.0, 0.0]
    assert calls == [0, 0, 0, 1]
    assert rec.counts() == (1, 1, 0)
    np.testing.assert_array_equal(rec.got(0), 2.5 * direction)
    np.testing.assert_array_equal(rec.got(1), 2.5 * matrix)
    assert _state(acc) == {
        "micro_step": 0,
        "accum_steps": 4,
        "next_accum_steps": 4,
        "weight_sum": 0.0,
        "sample_sum": 0.0,
        "empty": True,
    }
    expected_norm = np.sqrt(
        np.sum((2.5 * direction) ** 2) + np.sum((2.5 * matrix) ** 2)
    )
    np.testing.assert_allclose(
        float(acc.state.last_grad_norm.numpy()), expected_norm, rtol=1e-6
    )
    assert float(acc.state.last_batch.numpy()) == 32.0
    if mode == "function":
        assert feed.run.experimental_get_tracing_count() == 1


@pytest.mark.parametrize("mode", MODES)
def test_second_cycle_starts_from_nothing(mode):
    """The buffers keep the last cycle's leftovers (``empty`` says so): the
    next cycle's mean must not include them."""
    (v,) = _variables((3,))
    acc = Accumulator(4)
    acc.build([v])
    rec = Recorder([v])
    feed = _driver(acc, [v], rec, mode)
    ones = np.ones(3, "float32")
    for k in (1.0, 2.0, 3.0, 4.0):
        feed([k * ones])
    assert bool(acc.state.empty.numpy())
    for k in (5.0, 6.0, 7.0):
        feed([k * ones])
        assert not bool(acc.state.empty.numpy())
    np.testing.assert_array_equal(acc.state.grad_sums[0].numpy(), 18.0 * ones)
    assert feed([8.0 * ones])
    np.testing.assert_array_equal(rec.got(), 6.5 * ones)
    assert rec.counts() == (2, 2, 0)


@pytest.mark.parametrize("mode", MODES)
def test_variable_without_gradient_early_in_a_cycle(mode):
    """A variable with no gradient (None) in a cycle's first micro-batch but
    one later: its sum starts from zero, not from the last cycle's
    leftovers, and its mean divides by the whole cycle's weight."""
    v, w = _variables((1,), (1,))
    acc = Accumulator(3)
    acc.build([v, w])
    rec = Recorder([v, w])
    feed = _driver(acc, [v, w], rec, mode)
    for _ in range(3):
        feed([np.array([1.0], "float32"), np.array([100.0], "float32")])
    np.testing.assert_array_equal(rec.got(1), [100.0])
    feed([np.array([1.0], "float32"), None])
    feed([np.array([2.0], "float32"), np.array([3.0], "float32")])
    feed([np.array([3.0], "float32"), np.array([6.0], "float32")])
    np.testing.assert_array_equal(rec.got(0), [2.0])
    np.testing.assert_array_equal(rec.got(1), [3.0])
    assert rec.counts() == (2, 2, 0)


@pytest.mark.parametrize("mode", MODES)
def test_add_then_end_micro_step_path(mode):
    """The path under a strategy: ``add`` writes every micro-batch into the
    buffers, ``end_micro_step`` decides; the applied mean is the same."""
    (v,) = _variables((2,))
    acc = Accumulator(4)
    acc.build([v])
    rec = Recorder([v])

    def step(grad):
        present = acc.add([grad], [v])
        return acc.end_micro_step([v], present, rec.apply_fn, rec.on_apply)

    run = step if mode == "eager" else tf.function(step)
    ended = []
    for k in (1.0, 2.0, 3.0, 4.0):
        ended.append(bool(run(tf.constant([k, -k]))))
        if k < 4:
            np.testing.assert_array_equal(
                acc.state.grad_sums[0].numpy(), [k * (k + 1) / 2, -k * (k + 1) / 2]
            )
    assert ended == [False, False, False, True]
    np.testing.assert_array_equal(rec.got(), [2.5, -2.5])
    assert rec.counts() == (1, 1, 0)
    assert int(acc.state.micro_step.numpy()) == 0
    assert float(acc.state.weight_sum.numpy()) == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_open_sums_then_adds_without_the_empty_check(mode):
    """The in-step path: ``open_sums`` once per micro-step, then several
    ``add(..., empty=False)`` (the slices). An empty cycle's leftovers are
    cleared first, a running cycle's sums are kept, and a cycle maximum
    (``overwrite_with_gradient``) starts below negative values."""
    v, m = _variables((2,), (2,))
    m.overwrite_with_gradient = True
    acc = Accumulator(2)
    acc.build([v, m])
    rec = Recorder([v, m])
    for buffer in acc.state.grad_sums:  # leftovers of an earlier cycle
        buffer.assign([100.0, 100.0])

    def step(slices):
        acc.open_sums([v, m])
        present = None
        for grad, peak in slices:
            present = acc.add([grad, peak], [v, m], empty=False)
        return acc.end_micro_step([v, m], present, rec.apply_fn, rec.on_apply)

    run = step if mode == "eager" else tf.function(step)
    first = [(tf.constant([1.0, -1.0]), tf.constant([-5.0, -7.0]))] * 2
    assert not bool(run(first))
    np.testing.assert_array_equal(acc.state.grad_sums[0].numpy(), [2.0, -2.0])
    np.testing.assert_array_equal(acc.state.grad_sums[1].numpy(), [-5.0, -7.0])
    assert float(acc.state.weight_sum.numpy()) == 2.0
    second = [
        (tf.constant([3.0, -3.0]), tf.constant([-6.0, -2.0])),
        (tf.constant([4.0, -4.0]), tf.constant([-9.0, -9.0])),
    ]
    assert bool(run(second))
    # (1 + 1 + 3 + 4) / 4 slices; the maximum over all four.
    np.testing.assert_array_equal(rec.got(0), [2.25, -2.25])
    np.testing.assert_array_equal(rec.got(1), [-5.0, -2.0])
    assert rec.counts() == (1, 1, 0)
    assert _state(acc)["empty"] and _state(acc)["weight_sum"] == 0.0


def test_under_a_one_replica_mirrored_strategy():
    """Under a strategy every micro-batch goes through the (replica-local)
    buffers, a sparse one through the replica's own component; the mean is
    the same."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        v, w = _variables((2,), (4, 2))
        acc = Accumulator(4)
        acc.build([v, w])
        rec = Recorder([v, w])

    @tf.function
    def run(dense, rows):
        def step():
            sparse = tf.IndexedSlices(
                tf.ones([2, 2]) * dense[0], rows, tf.constant([4, 2], tf.int64)
            )
            return acc.step([dense, sparse], [v, w], rec.apply_fn, weight=2.0)

        return strategy.run(step)

    for k in (1.0, 2.0, 3.0, 4.0):
        run(tf.constant([k, -k]), tf.constant([0, 3], tf.int64))
    assert rec.counts() == (1, 0, 0)
    np.testing.assert_array_equal(rec.got(0), [2.5, -2.5])
    np.testing.assert_array_equal(rec.got(1), [[2.5] * 2, [0] * 2, [0] * 2, [2.5] * 2])
    assert int(acc.state.micro_step.numpy()) == 0
    assert float(acc.state.weight_sum.numpy()) == 0.0
    assert run.experimental_get_tracing_count() == 1


# ---------------------------------------------------------------- weighting
@pytest.mark.parametrize("mode", MODES)
def test_weighted_micro_batches(mode):
    """Weights 1 and 3: the applied gradient is sum(w * g) / sum(w)."""
    (v,) = _variables((2,))
    acc = Accumulator(2)
    acc.build([v])
    rec = Recorder([v])
    feed = _driver(acc, [v], rec, mode)
    assert not feed([np.array([2.0, 4.0], "float32")], weight=1.0)
    assert float(acc.state.weight_sum.numpy()) == 1.0
    assert feed([np.array([6.0, -4.0], "float32")], weight=3.0)
    # (1 * [2, 4] + 3 * [6, -4]) / 4
    np.testing.assert_array_equal(rec.got(), [5.0, -2.0])
    assert float(acc.state.weight_sum.numpy()) == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_count_is_the_denominator(mode):
    """``count`` separate from ``weight``: sum(w * g) / sum(count)."""
    (v,) = _variables((1,))
    acc = Accumulator(2)
    acc.build([v])
    rec = Recorder([v])
    feed = _driver(acc, [v], rec, mode)
    feed([np.array([2.0], "float32")], weight=1.0, count=1.0, samples=3)
    feed([np.array([6.0], "float32")], weight=3.0, count=1.0, samples=5)
    np.testing.assert_array_equal(rec.got(), [10.0])
    assert float(acc.state.last_batch.numpy()) == 8.0


# --------------------------------------------------------------- skipping
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad_at", [0, 2])
@pytest.mark.parametrize("bad", [NAN, INF])
def test_non_finite_micro_batch_skips_the_cycle(mode, bad_at, bad):
    """A NaN or Inf in any micro-batch (one that went through the buffers,
    or the cycle's last, which does not) skips the whole cycle: apply_fn is
    not called, on_skip is, the buffers are zeroed, the next cycle is
    clean."""
    v, w = _variables((2,), (1,))
    acc = Accumulator(3)
    acc.build([v, w])
    rec = Recorder([v, w])
    feed = _driver(acc, [v, w], rec, mode)
    for k in range(3):
        first = np.array([k + 1.0, 1.0], "float32")
        if k == bad_at:
            first[1] = bad
        feed([first, np.array([1.0], "float32")])
    assert rec.counts() == (0, 0, 1)
    assert _buffers_are_zero(acc)
    assert int(acc.state.micro_step.numpy()) == 0
    assert float(acc.state.weight_sum.numpy()) == 0.0
    assert bool(acc.state.empty.numpy())
    for k in (3.0, 5.0, 7.0):
        feed([np.array([k, k], "float32"), np.array([k], "float32")])
    assert rec.counts() == (1, 1, 1)
    np.testing.assert_array_equal(rec.got(0), [5.0, 5.0])
    np.testing.assert_array_equal(rec.got(1), [5.0])


@pytest.mark.parametrize("mode", MODES)
def test_skip_update_fn(mode):
    """skip_update_fn sees the cycle's mean gradient and the variables; a
    True result skips the cycle as a non-finite one would."""
    (v,) = _variables((1,))
    seen = keras.Variable(np.zeros(1, "float32"), trainable=False)
    seen_variables = []

    def skip_big(grads, variables):
        seen.assign(grads[0])
        seen_variables.append(list(variables))
        return grads[0][0] > 10.0

    acc = Accumulator(2, skip_update_fn=skip_big)
    acc.build([v])
    rec = Recorder([v])
    feed = _driver(acc, [v], rec, mode)
    feed([np.array([1.0], "float32")])
    feed([np.array([3.0], "float32")])
    assert rec.counts() == (1, 1, 0)
    np.testing.assert_array_equal(seen.numpy(), [2.0])
    assert seen_variables and seen_variables[0] == [v]
    feed([np.array([20.0], "float32")])
    feed([np.array([30.0], "float32")])
    np.testing.assert_array_equal(seen.numpy(), [25.0])
    assert rec.counts() == (1, 1, 1)
    np.testing.assert_array_equal(rec.got(), [2.0])
    assert _buffers_are_zero(acc)
    assert int(acc.state.micro_step.numpy()) == 0


@pytest.mark.parametrize("mode", MODES)
def test_skip_update_fn_always_true_never_applies(mode):
    (v,) = _variables((1,))
    acc = Accumulator(2, skip_update_fn=lambda grads, variables: tf.constant(True))
    acc.build([v])
    rec = Recorder([v])
    feed = _driver(acc, [v], rec, mode)
    for k in range(4):
        feed([np.array([k + 1.0], "float32")])
    assert rec.counts() == (0, 0, 2)
    assert _buffers_are_zero(acc)


# ----------------------------------------------------------- cycle length
@pytest.mark.parametrize("mode", MODES)
def test_set_accum_steps_mid_cycle_waits_for_the_boundary(mode):
    """K=2 -> 3 asked after one micro-batch: the cycle in progress still
    ends after 2 micro-batches; the next one holds 3."""
    (v,) = _variables((1,))
    acc = Accumulator(2)
    acc.build([v])
    rec = Recorder([v])
    feed = _driver(acc, [v], rec, mode)
    assert not feed([np.array([1.0], "float32")])
    acc.set_accum_steps(3)
    assert acc.accum_steps == 3
    assert int(acc.state.accum_steps_variable.numpy()) == 2
    assert int(acc.state.next_accum_steps.numpy()) == 3
    assert feed([np.array([3.0], "float32")])
    np.testing.assert_array_equal(rec.got(), [2.0])
    assert int(acc.state.accum_steps_variable.numpy()) == 3
    ended = [feed([np.array([k], "float32")]) for k in (4.0, 5.0, 9.0)]
    assert ended == [False, False, True]
    np.testing.assert_array_equal(rec.got(), [6.0])
    assert rec.counts() == (2, 2, 0)


def test_cycle_length_is_read_when_the_step_runs():
    (v,) = _variables((1,))
    acc = Accumulator(4)
    acc.build([v])
    length = tf.function(acc.cycle_length)
    assert float(length()) == 4.0
    acc.set_accum_steps(2)  # between cycles: from now on
    assert float(length()) == 2.0


def test_set_accum_steps_between_cycles_is_immediate():
    (v,) = _variables((1,))
    acc = Accumulator(4)
    acc.set_accum_steps(3)  # before build: the configured length
    assert acc.accum_steps == 3
    acc.build([v])
    assert int(acc.state.accum_steps_variable.numpy()) == 3
    acc.set_accum_steps(2)  # built, nothing pending: now
    assert int(acc.state.accum_steps_variable.numpy()) == 2
    assert int(acc.state.next_accum_steps.numpy()) == 2
    assert acc.initial_accum_steps == 3  # what it was built with
    rec = Recorder([v])
    feed = _driver(acc, [v], rec, "eager")
    assert [feed([np.array([k], "float32")]) for k in (1.0, 2.0)] == [False, True]


@pytest.mark.parametrize("mode", MODES)
def test_cycle_of_one(mode):
    """K=1: every micro-batch is applied as it is, the counter stays 0."""
    v, w = _variables((2,), (1,))
    acc = Accumulator(1)
    acc.build([v, w])
    rec = Recorder([v, w])
    feed = _driver(acc, [v, w], rec, mode)
    for k in (1.0, 2.0, -7.0):
        assert feed([np.array([k, 2 * k], "float32"), np.array([k], "float32")])
        assert int(acc.state.micro_step.numpy()) == 0
        np.testing.assert_array_equal(rec.got(0), [k, 2 * k])
        np.testing.assert_array_equal(rec.got(1), [k])
    assert feed([np.array([4.0, 4.0], "float32"), None], weight=4.0)
    np.testing.assert_array_equal(rec.got(0), [4.0, 4.0])
    assert rec.counts() == (4, 4, 0)
    assert float(acc.state.weight_sum.numpy()) == 0.0


# ------------------------------------------------------ partial cycles
def _bound(acc, variables, rec):
    acc.bind(
        Binding(
            variables=lambda: variables,
            apply_fn=lambda: rec.apply_fn,
            hooks=lambda: (rec.on_apply, rec.on_skip),
        )
    )


@pytest.mark.parametrize("mode", MODES)
def test_flush_applies_the_mean_of_a_partial_cycle(mode):
    v, w = _variables((2,), (1,))
    acc = Accumulator(4)
    acc.build([v, w])
    rec = Recorder([v, w])
    _bound(acc, [v, w], rec)
    feed = _driver(acc, [v, w], rec, mode)
    feed([np.array([1.0, 2.0], "float32"), np.array([4.0], "float32")], weight=1.0)
    feed([np.array([4.0, 2.0], "float32"), np.array([8.0], "float32")], weight=3.0)
    assert acc.pending == 2
    acc.flush()
    assert rec.counts() == (1, 1, 0)
    np.testing.assert_array_equal(rec.got(0), [3.25, 2.0])  # (1*g1 + 3*g2) / 4
    np.testing.assert_array_equal(rec.got(1), [7.0])
    assert acc.pending == 0
    assert float(acc.state.weight_sum.numpy()) == 0.0
    acc.flush()  # nothing pending: nothing happens
    assert rec.counts() == (1, 1, 0)
    # A full cycle afterwards is exact: nothing of the flushed one is left.
    for k in (1.0, 2.0, 3.0, 6.0):
        feed([np.array([k, k], "float32"), np.array([k], "float32")])
    np.testing.assert_array_equal(rec.got(0), [3.0, 3.0])
    assert rec.counts() == (2, 2, 0)


def test_flush_of_a_non_finite_partial_cycle_skips():
    (v,) = _variables((1,))
    acc = Accumulator(4)
    acc.build([v])
    rec = Recorder([v])
    _bound(acc, [v], rec)
    feed = _driver(acc, [v], rec, "eager")
    feed([np.array([NAN], "float32")])
    acc.flush()
    assert rec.counts() == (0, 0, 1)
    assert _buffers_are_zero(acc)
    assert acc.pending == 0


@pytest.mark.parametrize("mode", MODES)
def test_drop_discards_a_partial_cycle(mode):
    (v,) = _variables((2,))
    acc = Accumulator(3)
    acc.build([v])
    rec = Recorder([v])
    _bound(acc, [v], rec)
    feed = _driver(acc, [v], rec, mode)
    feed([np.array([100.0, 100.0], "float32")])
    feed([np.array([200.0, 200.0], "float32")])
    acc.drop()
    assert rec.counts() == (0, 0, 0)
    assert acc.pending == 0
    assert float(acc.state.weight_sum.numpy()) == 0.0
    assert _buffers_are_zero(acc)
    for k in (1.0, 2.0, 6.0):
        feed([np.array([k, -k], "float32")])
    np.testing.assert_array_equal(rec.got(), [3.0, -3.0])
    assert rec.counts() == (1, 1, 0)


# --------------------------------------------------------------- sparse
def _slices(values, indices, rows=4):
    return tf.IndexedSlices(
        tf.constant(values, tf.float32),
        tf.constant(indices, tf.int64),
        tf.constant([rows, 2], tf.int64),
    )


SPARSE_MICRO_BATCHES = [
    ([[1.0, 2.0], [3.0, 4.0]], [0, 2]),
    ([[5.0, 6.0], [7.0, 8.0], [1.0, 1.0]], [2, 3, 2]),  # a repeated row
    ([[-1.0, 0.5]], [1]),
]


def _dense(values, indices, rows=4):
    dense = np.zeros((rows, 2), "float32")
    for row, value in zip(indices, values):
        dense[row] += value
    return dense


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("accum_steps", [1, 2, 3])
@pytest.mark.parametrize("kinds", ["sparse", "mixed"])
def test_sparse_gradients_accumulate_like_dense(mode, accum_steps, kinds):
    """tf.IndexedSlices (embedding gradients, repeated rows summed) give
    exactly what their dense equivalents give, whichever micro-batch of the
    cycle they are (first: overwrite; middle: add; last: not buffered)."""
    results = {}
    for form in (kinds, "dense"):
        (v,) = _variables((4, 2))
        acc = Accumulator(accum_steps)
        acc.build([v])
        rec = Recorder([v])
        feed = _driver(acc, [v], rec, mode)
        received = []
        for cycle in range(2):
            for k, (values, indices) in enumerate(SPARSE_MICRO_BATCHES):
                if form == "dense" or (form == "mixed" and (k + cycle) % 2):
                    grad = _dense(values, indices)
                else:
                    grad = _slices(values, indices)
                if feed([grad], weight=float(k + 1)):
                    received.append(rec.got().copy())
        results[form] = received
    assert len(results["dense"]) == len(results[kinds]) == 6 // accum_steps
    for got, want in zip(results[kinds], results["dense"]):
        np.testing.assert_array_equal(got, want)


def test_sparse_mean_by_hand():
    (v,) = _variables((4, 2))
    acc = Accumulator(2)
    acc.build([v])
    rec = Recorder([v])
    feed = _driver(acc, [v], rec, "eager")
    feed([_slices([[2.0, 2.0]], [0])])
    feed([_slices([[4.0, 6.0], [1.0, 1.0]], [0, 3])])
    np.testing.assert_array_equal(
        rec.got(), [[3.0, 4.0], [0.0, 0.0], [0.0, 0.0], [0.5, 0.5]]
    )


# ------------------------------------------------------------ squared_norm
def test_squared_norm_of_known_tensors():
    tensors = [
        tf.constant([3.0, 4.0]),
        None,
        tf.constant([[1.0, 2.0], [2.0, 0.0]], tf.float16),
        keras.Variable([0.5]).value,
    ]
    assert float(squared_norm(tensors)) == 25.0 + 9.0 + 0.25
    assert squared_norm(tensors).dtype == tf.float32
    assert float(squared_norm([])) == 0.0
    assert float(squared_norm([None])) == 0.0


@pytest.mark.parametrize(
    ("value", "finite"),
    [(1e18, True), (1e20, False), (INF, False), (-INF, False), (NAN, False)],
)
def test_squared_norm_doubles_as_the_finite_check(value, finite):
    tensors = [tf.constant([1.0, value]), tf.constant([2.0])]
    assert bool(tf.math.is_finite(squared_norm(tensors))) is finite


# ---------------------------------------------------- where the state lives
def _dense_host():
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    return layer


def test_state_is_not_among_a_hosts_weights_by_default():
    layer = _dense_host()
    before = [id(w) for w in layer.weights]
    acc = Accumulator(2)
    layer.accumulator = acc
    acc.build(layer.trainable_variables)
    assert [id(w) for w in layer.weights] == before
    assert len(acc.variables) == 9 + 2  # counters and flags, two sums
    inputs = keras.Input((3,))
    model = keras.Model(inputs, layer(inputs))
    model.accumulator = Accumulator(2)
    model.accumulator.build(model.trainable_variables)
    assert model.count_params() == 3 * 2 + 2
    assert len(model.weights) == 2


def test_track_makes_the_state_a_hosts_weights():
    layer = _dense_host()
    acc = Accumulator(2, track=functools.partial(track_variable, layer))
    acc.build(layer.trainable_variables)
    tracked = {id(w) for w in layer.non_trainable_weights}
    assert {id(v) for v in acc.variables} <= tracked
    assert len(layer.trainable_weights) == 2
    assert len(layer.weights) == 2 + 11


# ------------------------------------------------------ saving the state
class _Store(dict):
    """A dict-like store that keeps arrays, as Keras' H5 stores do."""

    def __setitem__(self, key, value):
        super().__setitem__(key, keras.ops.convert_to_numpy(value))


def test_save_and_load_own_variables_round_trip():
    """A mid-cycle state saved into a store and loaded into a fresh
    accumulator continues the cycle exactly."""
    v, w = _variables((2,), (1,))
    acc = Accumulator(4)
    acc.build([v, w])
    rec = Recorder([v, w])
    feed = _driver(acc, [v, w], rec, "eager")
    feed([np.array([1.0, 2.0], "float32"), np.array([1.0], "float32")], samples=2)
    feed([np.array([2.0, 4.0], "float32"), np.array([2.0], "float32")], samples=2)
    acc.set_accum_steps(5)
    store = _Store()
    acc.save_own_variables(store)
    assert sorted(store) == sorted(
        [
            "micro_step",
            "accum_steps",
            "next_accum_steps",
            "weight_sum",
            "sample_sum",
            "overflows",
            "empty",
            "last_grad_norm",
            "last_batch",
            "grad_sum:v0",
            "grad_sum:v1",
        ]
    )
    np.testing.assert_array_equal(store["grad_sum:v0"], [3.0, 6.0])

    fresh = Accumulator(4)
    fresh.build([v, w])
    fresh.load_own_variables(store)
    assert _state(fresh) == _state(acc)
    assert _state(fresh)["micro_step"] == 2
    assert _state(fresh)["next_accum_steps"] == 5
    for a, b in zip(fresh.state.grad_sums, acc.state.grad_sums):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    rec2 = Recorder([v, w])
    feed2 = _driver(fresh, [v, w], rec2, "eager")
    feed2([np.array([3.0, 6.0], "float32"), np.array([3.0], "float32")], samples=2)
    assert feed2(
        [np.array([4.0, 8.0], "float32"), np.array([4.0], "float32")], samples=2
    )
    np.testing.assert_array_equal(rec2.got(0), [2.5, 5.0])
    np.testing.assert_array_equal(rec2.got(1), [2.5])
    assert float(fresh.state.last_batch.numpy()) == 8.0
    assert int(fresh.state.accum_steps_variable.numpy()) == 5


def test_load_of_an_empty_store_leaves_the_state():
    (v,) = _variables((1,))
    acc = Accumulator(4)
    acc.build([v])
    acc.state.micro_step.assign(3)
    acc.load_own_variables(_Store())
    assert int(acc.state.micro_step.numpy()) == 3


def _mid_cycle_store(variables, accum_steps=4, next_accum_steps=None):
    """A store saved after two of ``accum_steps`` micro-batches of ones."""
    acc = Accumulator(accum_steps)
    acc.build(variables)
    feed = _driver(acc, variables, Recorder(variables), "eager")
    for _ in range(2):
        feed([np.ones(v.shape, "float32") for v in variables], samples=2)
    if next_accum_steps is not None:
        acc.set_accum_steps(next_accum_steps)
    store = _Store()
    acc.save_own_variables(store)
    return store


def test_sums_are_matched_to_variables_by_path_not_position():
    """The same variables in another order: each sum finds its variable."""
    v, w = _variables((2,), (1,))
    store = _mid_cycle_store([v, w])
    store["grad_sum:v0"] = np.array([3.0, 6.0], "float32")
    acc = Accumulator(4)
    acc.build([w, v])
    acc.load_own_variables(store)
    assert _state(acc)["micro_step"] == 2
    np.testing.assert_array_equal(acc.state.grad_sums[0].numpy(), [2.0])
    np.testing.assert_array_equal(acc.state.grad_sums[1].numpy(), [3.0, 6.0])


def test_a_store_for_other_variables_loads_and_drops_its_pending_cycle():
    """Sums of other variables (a layer frozen, LoRA enabled) cannot join
    this cycle: they are dropped with one warning; the schedule is kept."""
    v, w = _variables((1,), (1,))
    store = _mid_cycle_store([v, w], next_accum_steps=6)
    other = Accumulator(4)
    other.build([v])
    other.state.micro_step.assign(1)
    with pytest.warns(UserWarning, match="2 micro-batch.*dropped"):
        other.load_own_variables(store)
    state = _state(other)
    assert state["micro_step"] == 0 and state["empty"]
    assert state["next_accum_steps"] == 6 and state["accum_steps"] == 6
    assert state["weight_sum"] == 0.0


def test_a_store_for_other_variables_without_a_pending_cycle_loads_quietly():
    v, w = _variables((1,), (1,))
    store = _mid_cycle_store([v, w])
    store["micro_step"] = np.array(0, "int64")
    other = Accumulator(4)
    other.build([v])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        other.load_own_variables(store)
    assert _state(other)["micro_step"] == 0


def test_a_store_with_the_same_path_and_another_shape_does_not_fit():
    (v,) = _variables((2,))
    store = _mid_cycle_store([v])
    (narrow,) = _variables((3,))
    acc = Accumulator(4)
    acc.build([narrow])
    with pytest.warns(UserWarning, match="dropped"):
        acc.load_own_variables(store)
    assert _state(acc)["micro_step"] == 0


def test_a_store_written_before_sums_had_paths_loads_by_position():
    """Files of earlier releases keyed the sums ``grad_sum_<i>``."""
    v, w = _variables((2,), (1,))
    store = _mid_cycle_store([v, w])
    for i, key in enumerate(("grad_sum:v0", "grad_sum:v1")):
        store[f"grad_sum_{i}"] = store.pop(key)
    acc = Accumulator(4)
    acc.build([v, w])
    acc.load_own_variables(store)
    assert _state(acc)["micro_step"] == 2
    np.testing.assert_array_equal(acc.state.grad_sums[0].numpy(), [2.0, 2.0])
    with pytest.warns(UserWarning, match="dropped"):
        fewer = Accumulator(4)
        fewer.build([v])
        fewer.load_own_variables(store)


def test_loading_into_an_unbuilt_accumulator_without_a_host_is_refused():
    (v,) = _variables((1,))
    store = _mid_cycle_store([v])
    with pytest.raises(ValueError, match="before loading"):
        Accumulator(4).load_own_variables(store)


def test_repeated_paths_get_numbered_keys():
    a = keras.Variable(np.zeros(1, "float32"), name="same")
    b = keras.Variable(np.zeros(1, "float32"), name="same")
    acc = Accumulator(2)
    acc.build([a, b])
    store = _Store()
    acc.save_own_variables(store)
    assert {"grad_sum:same", "grad_sum:same#2"} <= set(store)


def test_a_tracked_state_is_saved_by_its_host_not_by_the_engine():
    layer = _dense_host()
    acc = Accumulator(2, track=functools.partial(track_variable, layer))
    acc.build(layer.trainable_variables)
    store = _Store()
    acc.save_own_variables(store)
    assert dict(store) == {}


# ------------------------------------------------------- the state record
SCALARS = [
    "micro_step",
    "accum_steps_variable",
    "next_accum_steps",
    "weight_sum",
    "sample_sum",
    "overflows",
    "empty",
    "last_grad_norm",
    "last_batch",
]


class _Made:
    """A ``new_variable`` for :class:`EngineState`: plain ``tf.Variable``
    objects, their names recorded in the order they are made."""

    def __init__(self):
        self.names: list[str] = []

    def __call__(self, name, shape, dtype, initializer="zeros", **kwargs):
        self.names.append(name)
        return engine_state.tf_variable(name, shape, dtype, initializer, **kwargs)


def _record(variables, accum_steps=3) -> EngineState:
    return EngineState.create(_Made(), variables, accum_steps, saved_state.paths)


def _values(state: EngineState) -> dict:
    return {name: getattr(state, name).numpy().item() for name in SCALARS}


def test_a_new_record_is_an_empty_cycle_of_accum_steps():
    v, w = _variables((2,), (1,))
    made = _Made()
    state = EngineState.create(made, [v, w], 3, saved_state.paths)
    assert made.names == [
        *("micro_step", "accum_steps", "next_accum_steps", "weight_sum"),
        *("sample_sum", "overflows", "empty", "last_grad_norm", "last_batch"),
        *("v0_grad_sum", "v1_grad_sum"),
    ]
    assert _values(state) == {
        **dict.fromkeys(SCALARS, 0),
        "accum_steps_variable": 3,
        "next_accum_steps": 3,
        "empty": True,
    }
    assert [tuple(b.shape) for b in state.grad_sums] == [(2,), (1,)]
    assert state.sum_keys == ("grad_sum:v0", "grad_sum:v1")
    assert state.is_for([v, w]) and not state.is_for([w, v])
    assert not state.is_for([v])


def test_a_record_for_other_variables_keeps_the_scalars():
    v, w = _variables((2,), (1,))
    state = _record([v])
    state.micro_step.assign(2)
    made = _Made()
    other = state.with_sums_for(made, [w, v], saved_state.paths)
    assert made.names == ["v1_grad_sum", "v0_grad_sum"]
    assert all(getattr(other, n) is getattr(state, n) for n in SCALARS)
    assert int(other.micro_step.numpy()) == 2
    assert other.sum_keys == ("grad_sum:v1", "grad_sum:v0")
    assert [id(b) for b in engine_state.sums_for(other, [v])] == [
        id(other.grad_sums[1])
    ]
    with pytest.raises(ValueError, match="other trainable variables"):
        engine_state.sums_for(state, [w])


@pytest.mark.parametrize("mode", MODES)
def test_add_weights_a_micro_batch_into_the_record(mode):
    """The cycle's first add overwrites the leftovers (and zeroes the sum
    of a variable without a gradient); the next adds to it."""
    v, w = _variables((2,), (1,))
    state = _record([v, w])
    for buffer in state.grad_sums:
        buffer.assign(tf.fill(buffer.shape, 9.0))

    def add(grads, weight, count=None, samples=None):
        engine_state.add(state, grads, [v, w], weight, count, samples)

    add = add if mode == "eager" else tf.function(add)
    add([tf.constant([1.0, 2.0]), None], tf.constant(2.0), samples=tf.constant(4.0))
    np.testing.assert_array_equal(state.grad_sums[0].numpy(), [2.0, 4.0])
    np.testing.assert_array_equal(state.grad_sums[1].numpy(), [0.0])
    add([tf.constant([3.0, 1.0]), tf.constant([5.0])], None, tf.constant(3.0))
    np.testing.assert_array_equal(state.grad_sums[0].numpy(), [5.0, 5.0])
    np.testing.assert_array_equal(state.grad_sums[1].numpy(), [5.0])
    assert _values(state) == {
        **dict.fromkeys(SCALARS, 0),
        "accum_steps_variable": 3,
        "next_accum_steps": 3,
        "weight_sum": 5.0,
        "sample_sum": 4.0,
        "empty": False,
    }


def test_open_sums_clears_the_leftovers_once():
    (v,) = _variables((2,))
    state = _record([v])
    state.grad_sums[0].assign([9.0, 9.0])
    engine_state.open_sums(state, [v])
    assert not bool(state.empty.numpy())
    np.testing.assert_array_equal(state.grad_sums[0].numpy(), [0.0, 0.0])
    engine_state.add(state, [tf.constant([1.0, 2.0])], [v], empty=False)
    engine_state.add(state, [tf.constant([1.0, 2.0])], [v], empty=False)
    np.testing.assert_array_equal(state.grad_sums[0].numpy(), [2.0, 4.0])
    assert float(state.weight_sum.numpy()) == 2.0


def test_restart_eagerly_empties_the_cycle_at_the_next_length():
    (v,) = _variables((1,))
    state = _record([v])
    for name, value in [("micro_step", 2), ("next_accum_steps", 5)]:
        getattr(state, name).assign(value)
    for name in ("weight_sum", "sample_sum", "overflows"):
        getattr(state, name).assign(1.5)
    state.empty.assign(False)
    state.last_batch.assign(8.0)
    state.grad_sums[0].assign([7.0])
    engine_state.restart_eagerly(state)
    assert _values(state) == {
        **dict.fromkeys(SCALARS, 0),
        "accum_steps_variable": 5,
        "next_accum_steps": 5,
        "empty": True,
        "last_batch": 8.0,
    }
    # The next cycle's first micro-batch overwrites what the sums hold.
    np.testing.assert_array_equal(state.grad_sums[0].numpy(), [7.0])


def test_items_list_the_record_then_each_part():
    v, w = _variables((2,), (1,))
    state, part = _record([v, w]), _record([w])
    parts = [types.SimpleNamespace(state_items=lambda: engine_state.items(part, []))]
    items = engine_state.items(state, parts)
    assert [key for key, _ in items] == [
        *(key for key, _ in saved_state.COUNTERS),
        "grad_sum:v0",
        "grad_sum:v1",
        *(f"part1:{key}" for key, _ in saved_state.COUNTERS),
        "part1:grad_sum:v1",
    ]
    assert items[0][1] is state.micro_step and items[-1][1] is part.grad_sums[0]


def test_load_assigns_a_fitting_store_and_refuses_another():
    v, w = _variables((2,), (1,))
    store = _mid_cycle_store([v, w], next_accum_steps=6)
    state = _record([v, w])
    assert engine_state.load(state, store, None, 0, None)
    assert (int(state.micro_step.numpy()), float(state.weight_sum.numpy())) == (2, 2)
    assert int(state.next_accum_steps.numpy()) == 6
    np.testing.assert_array_equal(state.grad_sums[0].numpy(), [2.0, 2.0])
    other = _record([w])
    with pytest.warns(UserWarning, match="2 micro-batch.*dropped"):
        assert not engine_state.load(other, store, None, 0, None)
    # The schedule is loaded; the caller restarts the cycle.
    assert int(other.next_accum_steps.numpy()) == 6
    assert int(other.micro_step.numpy()) == 0


def test_the_records_variables_read_as_the_engines_attributes():
    (v,) = _variables((1,))
    acc = Accumulator(2)
    assert acc.state is None and not acc.built
    with pytest.raises(AttributeError):
        acc.micro_step  # noqa: B018
    acc.build([v])
    assert all(getattr(acc, n) is getattr(acc.state, n) for n in SCALARS)
    assert acc.grad_sums is acc.state.grad_sums
    with pytest.raises(AttributeError):
        acc.sum_keys  # noqa: B018  (only the variables)


# --------------------------------------------------- checkpoint names
def _checkpoint_keys(path: str) -> list[str]:
    return [
        name
        for name, _ in tf.train.list_variables(path)
        if name != "_CHECKPOINTABLE_OBJECT_GRAPH"
    ]


def test_a_checkpoint_names_the_state_as_before_the_record(tmp_path):
    """``tf.train.Checkpoint`` keys of the state are those of files written
    when each variable was an attribute of the engine, so those load; the
    sums of a rebuilt state replace the old ones under the same names."""
    v, w = _variables((2,), (1,))
    acc = Accumulator(4)
    acc.build([v, w])
    path = tf.train.Checkpoint(acc=acc).write(str(tmp_path / "ckpt"))
    names = [*SCALARS, "grad_sums/0", "grad_sums/1"]
    suffix = "/.ATTRIBUTES/VARIABLE_VALUE"
    assert _checkpoint_keys(path) == sorted(f"acc/{n}{suffix}" for n in names)
    acc.build([w])
    path = tf.train.Checkpoint(acc=acc).write(str(tmp_path / "rebuilt"))
    names = [*SCALARS, "grad_sums/0"]
    assert _checkpoint_keys(path) == sorted(f"acc/{n}{suffix}" for n in names)
    reader = tf.train.load_checkpoint(path)
    assert reader.get_variable_to_shape_map()[f"acc/grad_sums/0{suffix}"] == [1]


def test_a_checkpoint_read_before_build_restores_the_state_at_build(tmp_path):
    """A checkpoint read into an unbuilt engine (a model restored before its
    first step) restores the state when the engine is built."""
    v, w = _variables((2,), (1,))
    acc = Accumulator(4)
    acc.build([v, w])
    feed = _driver(acc, [v, w], Recorder([v, w]), "eager")
    feed([np.array([1.0, 2.0], "float32"), np.array([3.0], "float32")], weight=2.0)
    path = tf.train.Checkpoint(acc=acc).write(str(tmp_path / "ckpt"))
    fresh = Accumulator(4)
    tf.train.Checkpoint(acc=fresh).read(path).assert_existing_objects_matched()
    fresh.build([v, w])
    assert _state(fresh) == _state(acc)
    assert (_state(fresh)["micro_step"], _state(fresh)["weight_sum"]) == (1, 2.0)
    np.testing.assert_array_equal(fresh.state.grad_sums[0].numpy(), [2.0, 4.0])
    np.testing.assert_array_equal(fresh.state.grad_sums[1].numpy(), [6.0])
