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

import functools

import keras
import numpy as np
import pytest

from tests import utils

B = 8  # micro-batch size
K = 4  # accumulation steps
EPOCHS = 2

# How utils.train_pair trains the two models in every test here.
PAIR = {"batch_size": B, "accum_steps": K}


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
    initial, reference, accumulated = utils.train_pair(
        utils.mlp_layers,
        momentum,
        x,
        y,
        **PAIR,
        epochs=EPOCHS,
        sample_weight=sample_weight,
    )
    utils.assert_equivalent(initial, reference, accumulated, EPOCHS * n // (B * K))

    # Non-vacuity: without the sample weights the big batch trains otherwise.
    unweighted = utils.seeded(utils.plain_model)
    unweighted.compile(optimizer=momentum(), loss=utils.sparse_ce())
    utils.fit(unweighted, x, y, B * K, epochs=EPOCHS)
    change = utils.max_abs_diff(utils.weights(unweighted), utils.weights(reference))
    assert change > 1e-3


# --------------------------------------------------------- masked sequences
_CYCLE, LENGTHS = utils.PADDED_CYCLE, utils.PADDED_LENGTHS


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
    layers = functools.partial(utils.sequence_layers, kind)
    x, y = utils.padded_sequences(LENGTHS)
    model = utils.seeded(lambda: utils.plain_model(layers))
    assert getattr(model(x[:2]), "_keras_mask", None) is not None, "mask lost"
    # Per-token weights: Keras 3.15 cannot broadcast per-sample weights of
    # shape (n,) against a (n, T) mask, even for plain big-batch training.
    sample_weight = (
        np.random.default_rng(4).uniform(0.2, 2.0, x.shape).astype("float32")
        if weighted
        else None
    )
    momentum = lambda: keras.optimizers.SGD(0.5, momentum=0.9)  # noqa: E731
    initial, reference, accumulated = utils.train_pair(
        layers, momentum, x, y, **PAIR, epochs=EPOCHS, sample_weight=sample_weight
    )
    utils.assert_equivalent(initial, reference, accumulated, EPOCHS * len(x) // (B * K))


def test_masked_weighting_differs_from_naive_mean():
    """On the masked data one accumulated SGD step equals the big batch's and
    is far from the step an equal-weight mean of micro-batch gradients would
    take, so the masked tests can tell exact from naive accumulation."""
    layers = utils.sequence_layers
    x, y = utils.padded_sequences(LENGTHS[: B * K])  # one cycle: 10 ... 78 tokens
    lr = 1.0
    sgd = lambda: keras.optimizers.SGD(lr)  # noqa: E731
    initial, reference, accumulated = utils.train_pair(
        layers, sgd, x, y, **PAIR, epochs=1
    )
    utils.assert_equivalent(initial, reference, accumulated, 1)

    naive = utils.naive_sgd_step(layers, x, y, lr, B)
    gap = utils.max_abs_diff(naive, utils.weights(reference))
    assert gap > 100 * utils.ATOL, f"naive mean is only {gap:.3g} off"
    assert utils.max_abs_diff(naive, utils.weights(accumulated)) > 100 * utils.ATOL

    # The brief's simple sanity check: the big batch is not the same as
    # plain Keras on the micro-batches (the data is not trivially symmetric).
    small = utils.seeded(lambda: utils.plain_model(layers))
    small.compile(optimizer=sgd(), loss=utils.sparse_ce())
    utils.fit(small, x, y, B)
    assert utils.max_abs_diff(utils.weights(small), utils.weights(reference)) > 1e-3


# -------------------------------------------------- short last micro-batch
SHORT_N = 28  # micro-batches of 8, 8, 8 and 4: one cycle = one batch of 28


def _short_case(case: str):
    if case == "masked_gru":
        lengths = [n for micro in _CYCLE for n in micro][:SHORT_N]
        x, y = utils.padded_sequences(lengths, seed=5)
        return utils.sequence_layers, x, y, None
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
    initial, reference, accumulated = utils.train_pair(
        layers,
        sgd,
        x,
        y,
        **PAIR,
        reference_batch=SHORT_N,
        epochs=epochs,
        sample_weight=sample_weight,
    )
    utils.assert_equivalent(initial, reference, accumulated, epochs)

    # Non-vacuity: equal weighting of the four micro-batches is off.
    naive = utils.naive_sgd_step(layers, x, y, lr, B, sample_weight=sample_weight)
    once = utils.seeded(lambda: utils.plain_model(layers))
    once.compile(optimizer=sgd(), loss=utils.sparse_ce())
    # Not utils.fit: this fit keeps Keras' default shuffle (of its one batch).
    once.fit(x, y, sample_weight=sample_weight, batch_size=SHORT_N, verbose=0)
    gap = utils.max_abs_diff(naive, utils.weights(once))
    assert gap > 100 * utils.ATOL, f"naive mean is only {gap:.3g} off"


# ------------------------------------------- several inputs, outputs, losses
@pytest.mark.parametrize(
    ("n", "reference_batch"), [(64, B * K), (SHORT_N, SHORT_N)], ids=["full", "short"]
)
def test_multi_input_multi_output_loss_weights(n, reference_batch):
    """A functional model with two inputs, two outputs, a dict of losses and
    loss_weights matches the big batch, also with a short last micro-batch."""
    x, y = utils.multi_io_data(n)
    adam = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
    initial, reference, accumulated = utils.train_pair(
        utils.multi_io_layers,
        adam,
        x,
        y,
        **PAIR,
        epochs=EPOCHS,
        reference_batch=reference_batch,
        make_loss=utils.multi_io_losses,
        compile_kwargs={"loss_weights": {"cls": 1.0, "reg": 0.3}},
    )
    updates = EPOCHS * -(-n // reference_batch)
    utils.assert_equivalent(initial, reference, accumulated, updates)
