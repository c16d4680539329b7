"""Exact weighting of unequal micro-batches, against plain Keras.

Keras divides a micro-batch's loss by its number of samples, or by its number
of unmasked entries under a mask; the big batch divides by the total. The
accumulating model must therefore weight micro-batches by those denominators,
not equally. Each test trains plain ``keras.Model`` on the big batch and
``GradientAccumulateModel`` on micro-batches from the same seed and data, and
the masked / short-batch tests also check that equal weighting of the
micro-batches (the naive mean) would have given measurably different weights.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel
from tests import utils

B = 8  # micro-batch size
K = 4  # accumulation steps
EPOCHS = 2

VOCAB = 12
T = 10  # sequence length


def _sparse_ce():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _train_pair(
    layers,
    make_optimizer,
    x,
    y,
    *,
    reference_batch: int,
    epochs: int = EPOCHS,
    sample_weight=None,
    make_loss=_sparse_ce,
    **compile_kwargs,
):
    """Trains plain Keras with ``batch_size=reference_batch`` and the
    accumulating model with ``batch_size=B``, ``accum_steps=K``.

    Returns (initial weights, reference, accumulated)."""
    reference = utils.seeded(lambda: keras.Model(*layers()))
    initial = utils.weights(reference)
    reference.compile(optimizer=make_optimizer(), loss=make_loss(), **compile_kwargs)
    reference.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=reference_batch,
        epochs=epochs,
        shuffle=False,
        verbose=0,
    )

    def build_accumulating():
        inputs, outputs = layers()
        return GradientAccumulateModel(accum_steps=K, inputs=inputs, outputs=outputs)

    accumulated = utils.seeded(build_accumulating)
    assert utils.max_abs_diff(initial, utils.weights(accumulated)) == 0.0
    accumulated.compile(optimizer=make_optimizer(), loss=make_loss(), **compile_kwargs)
    accumulated.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=B,
        epochs=epochs,
        shuffle=False,
        verbose=0,
    )
    return initial, reference, accumulated


def _assert_equivalent(initial, reference, accumulated, updates: int) -> float:
    utils.assert_trained(initial, utils.weights(reference))
    utils.assert_trained(initial, utils.weights(accumulated))
    diff = utils.assert_same_weights(
        utils.weights(accumulated), utils.weights(reference)
    )
    assert int(reference.optimizer.iterations) == updates
    assert int(accumulated.optimizer.iterations) == updates
    return utils.report(diff)


def _naive_sgd_step(layers, x, y, lr: float, make_loss=_sparse_ce, sample_weight=None):
    """Weights after one SGD step with the *equal-weight* mean of the
    micro-batch gradients (what naive accumulation would apply), computed with
    plain Keras/TensorFlow from the seeded initial weights."""
    model = utils.seeded(lambda: keras.Model(*layers()))
    loss_fn = make_loss()
    grads = None
    starts = range(0, len(x), B)
    for start in starts:
        part = slice(start, start + B)
        weight = None if sample_weight is None else sample_weight[part]
        with tf.GradientTape() as tape:
            loss = loss_fn(y[part], model(x[part], training=True), weight)
        grads_k = tape.gradient(loss, model.trainable_weights)
        micro = [np.asarray(tf.convert_to_tensor(g)) for g in grads_k]
        grads = micro if grads is None else [a + b for a, b in zip(grads, micro)]
    return [
        w - lr * g / len(starts)
        for w, g in zip(utils.weights(model), grads, strict=True)
    ]


# ----------------------------------------------------------- sample weights
def test_sample_weight_matches_big_batch():
    """Random positive sample weights passed to fit give the big batch's
    weights (and the weights do matter for the outcome)."""
    n = 64
    x, y = utils.classification_data(n)
    sample_weight = np.random.default_rng(3).uniform(0.1, 3.0, n).astype("float32")
    # SGD with momentum is linear in the gradient, so the weight difference
    # measures the weighting itself; Adam (covered in test_model_equivalence)
    # divides by |g| and amplifies float32 rounding of near-zero gradient
    # entries (4e-6 on one kernel entry here, still within ATOL).
    momentum = lambda: keras.optimizers.SGD(0.1, momentum=0.9)  # noqa: E731
    initial, reference, accumulated = _train_pair(
        utils.mlp_layers,
        momentum,
        x,
        y,
        reference_batch=B * K,
        sample_weight=sample_weight,
    )
    _assert_equivalent(initial, reference, accumulated, EPOCHS * n // (B * K))

    # Non-vacuity: without the sample weights the big batch trains otherwise.
    unweighted = utils.seeded(lambda: keras.Model(*utils.mlp_layers()))
    unweighted.compile(optimizer=momentum(), loss=_sparse_ce())
    unweighted.fit(x, y, batch_size=B * K, epochs=EPOCHS, shuffle=False, verbose=0)
    change = utils.max_abs_diff(utils.weights(unweighted), utils.weights(reference))
    assert change > 1e-3


# --------------------------------------------------------- masked sequences
def _sequence_layers(kind: str):
    def layers():
        inputs = keras.Input((T,), dtype="int32")
        h = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(inputs)
        if kind == "gru":
            h = keras.layers.GRU(8, return_sequences=True)(h)
        elif kind == "lstm":
            h = keras.layers.LSTM(8, return_sequences=True)(h)
        else:
            h = keras.layers.TimeDistributed(keras.layers.Dense(8, activation="tanh"))(
                h
            )
        outputs = keras.layers.Dense(VOCAB)(h)
        return inputs, outputs

    return layers


def _padded_sequences(lengths, seed: int = 0):
    """Token ids in 1..VOCAB-1 for the first ``length`` steps, 0 (padding)
    after; per-token targets everywhere (the padded ones must be masked)."""
    rng = np.random.default_rng(seed)
    x = np.zeros((len(lengths), T), dtype="int32")
    for i, length in enumerate(lengths):
        x[i, :length] = rng.integers(1, VOCAB, size=length)
    y = rng.integers(0, VOCAB, size=(len(lengths), T))
    return x, y


# One cycle of 4 micro-batches of 8: mostly padding first, nearly full last
# (about 10, 30, 55 and 78 real tokens), then a cycle in the reverse order.
_CYCLE = [
    [1, 1, 2, 1, 1, 2, 1, 1],
    [3, 4, 3, 5, 4, 3, 4, 4],
    [6, 7, 7, 6, 8, 7, 7, 7],
    [10, 9, 10, 10, 9, 10, 10, 10],
]
LENGTHS = [n for micro in _CYCLE for n in micro] + [
    n for micro in reversed(_CYCLE) for n in micro
]


@pytest.mark.parametrize(
    ("kind", "weighted"),
    [
        ("gru", False),
        ("lstm", False),
        ("timedistributed", False),
        ("gru", True),
    ],
    ids=["gru", "lstm", "timedistributed", "gru-sample_weight"],
)
def test_masked_sequences_match_big_batch(kind, weighted):
    """Padded sequences with very different numbers of real tokens per
    micro-batch (Embedding mask_zero=True, per-token loss) give the big
    batch's weights: micro-batches are weighted by their unmasked tokens."""
    layers = _sequence_layers(kind)
    x, y = _padded_sequences(LENGTHS)
    model = utils.seeded(lambda: keras.Model(*layers()))
    assert getattr(model(x[:2]), "_keras_mask", None) is not None, "mask lost"
    # Per-token weights: Keras 3.15 cannot broadcast per-sample weights of
    # shape (n,) against a (n, T) mask, even for plain big-batch training.
    sample_weight = (
        np.random.default_rng(4).uniform(0.2, 2.0, x.shape).astype("float32")
        if weighted
        else None
    )
    momentum = lambda: keras.optimizers.SGD(0.5, momentum=0.9)  # noqa: E731
    initial, reference, accumulated = _train_pair(
        layers, momentum, x, y, reference_batch=B * K, sample_weight=sample_weight
    )
    _assert_equivalent(initial, reference, accumulated, EPOCHS * len(x) // (B * K))


def test_masked_weighting_differs_from_naive_mean():
    """On the masked data one accumulated SGD step equals the big batch's and
    is far from the step an equal-weight mean of micro-batch gradients would
    take, so the masked tests can tell exact from naive accumulation."""
    layers = _sequence_layers("gru")
    x, y = _padded_sequences(LENGTHS[: B * K])  # one cycle: 10 ... 78 tokens
    lr = 1.0
    sgd = lambda: keras.optimizers.SGD(lr)  # noqa: E731
    initial, reference, accumulated = _train_pair(
        layers, sgd, x, y, reference_batch=B * K, epochs=1
    )
    _assert_equivalent(initial, reference, accumulated, 1)

    naive = _naive_sgd_step(layers, x, y, lr)
    gap = utils.max_abs_diff(naive, utils.weights(reference))
    assert gap > 100 * utils.ATOL, f"naive mean is only {gap:.3g} off"
    assert utils.max_abs_diff(naive, utils.weights(accumulated)) > 100 * utils.ATOL

    # The brief's simple sanity check: the big batch is not the same as
    # plain Keras on the micro-batches (the data is not trivially symmetric).
    small = utils.seeded(lambda: keras.Model(*layers()))
    small.compile(optimizer=sgd(), loss=_sparse_ce())
    small.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert utils.max_abs_diff(utils.weights(small), utils.weights(reference)) > 1e-3


# -------------------------------------------------- short last micro-batch
SHORT_N = 28  # micro-batches of 8, 8, 8 and 4: one cycle = one batch of 28


def _short_case(case: str):
    if case == "masked_gru":
        lengths = [n for micro in _CYCLE for n in micro][:SHORT_N]
        x, y = _padded_sequences(lengths, seed=5)
        return _sequence_layers("gru"), x, y, None
    x, y = utils.classification_data(SHORT_N)
    sample_weight = None
    if case == "mlp_sample_weight":
        rng = np.random.default_rng(6)
        sample_weight = rng.uniform(0.1, 3.0, SHORT_N).astype("float32")
    return utils.mlp_layers, x, y, sample_weight


@pytest.mark.parametrize("case", ["mlp", "mlp_sample_weight", "masked_gru"])
def test_short_last_micro_batch(case):
    """A cycle of micro-batches 8, 8, 8, 4 equals one big batch of 28: the
    short micro-batch counts 4/28, not 1/4, of the update."""
    layers, x, y, sample_weight = _short_case(case)
    epochs = 3
    lr = 0.5
    sgd = lambda: keras.optimizers.SGD(lr)  # noqa: E731
    initial, reference, accumulated = _train_pair(
        layers,
        sgd,
        x,
        y,
        reference_batch=SHORT_N,
        epochs=epochs,
        sample_weight=sample_weight,
    )
    _assert_equivalent(initial, reference, accumulated, epochs)

    # Non-vacuity: equal weighting of the four micro-batches is off.
    naive = _naive_sgd_step(layers, x, y, lr, sample_weight=sample_weight)
    once = utils.seeded(lambda: keras.Model(*layers()))
    once.compile(optimizer=sgd(), loss=_sparse_ce())
    once.fit(x, y, sample_weight=sample_weight, batch_size=SHORT_N, verbose=0)
    gap = utils.max_abs_diff(naive, utils.weights(once))
    assert gap > 100 * utils.ATOL, f"naive mean is only {gap:.3g} off"


# ------------------------------------------- several inputs, outputs, losses
def _multi_io_layers():
    a = keras.Input((8,), name="a")
    b = keras.Input((4,), name="b")
    h = keras.layers.Concatenate()([a, b])
    h = keras.layers.Dense(16, activation="tanh")(h)
    cls = keras.layers.Dense(3, name="cls")(h)
    reg = keras.layers.Dense(1, name="reg")(h)
    return {"a": a, "b": b}, {"cls": cls, "reg": reg}


def _multi_io_data(n: int):
    rng = np.random.default_rng(7)
    x = {
        "a": rng.normal(size=(n, 8)).astype("float32"),
        "b": rng.normal(size=(n, 4)).astype("float32"),
    }
    y = {
        "cls": rng.integers(0, 3, size=n),
        "reg": rng.normal(size=(n, 1)).astype("float32"),
    }
    return x, y


def _multi_io_losses():
    return {"cls": _sparse_ce(), "reg": keras.losses.MeanSquaredError()}


@pytest.mark.parametrize(
    ("n", "reference_batch"), [(64, B * K), (SHORT_N, SHORT_N)], ids=["full", "short"]
)
def test_multi_input_multi_output_loss_weights(n, reference_batch):
    """A functional model with two inputs, two outputs, a dict of losses and
    loss_weights matches the big batch, also with a short last micro-batch."""
    x, y = _multi_io_data(n)
    adam = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
    initial, reference, accumulated = _train_pair(
        _multi_io_layers,
        adam,
        x,
        y,
        reference_batch=reference_batch,
        make_loss=_multi_io_losses,
        loss_weights={"cls": 1.0, "reg": 0.3},
    )
    updates = EPOCHS * -(-n // reference_batch)
    _assert_equivalent(initial, reference, accumulated, updates)
