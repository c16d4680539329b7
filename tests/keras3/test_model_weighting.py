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

from tests import utils

B = 8  # micro-batch size
K = 4  # accumulation steps
EPOCHS = 2

# How utils.train_pair trains the two models in every test here.
PAIR = {"batch_size": B, "accum_steps": K}


# -------------------------------------------------- short last micro-batch
# (Sample weights and masked sequences of equal-length batches, in both
# Kerases: tests/both/test_weighting.py.)
_CYCLE = utils.PADDED_CYCLE
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
