"""Compile/fit modes of GradientAccumulateModel, against plain Keras.

``steps_per_execution`` (cycles crossing execution boundaries),
``accum_steps=1`` (must be plain Keras, bit for bit) and the loss / metrics
that ``fit`` logs (the real training loss, not a loss scaled by
``1 / accum_steps``). XLA (``jit_compile=True``): tests/both/test_xla.py.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from tests import utils

B = 8  # micro-batch size
K = 4  # accumulation steps
EPOCHS = 2


def _assert_big_batch(initial, reference, accumulated, n: int) -> None:
    """The reference trained; the accumulated model ends on its weights after
    one update per cycle, ``n`` samples an epoch."""
    utils.assert_trained(initial, utils.weights(reference))
    diff = utils.assert_same_weights(
        utils.weights(accumulated), utils.weights(reference)
    )
    utils.report(diff, "max |w_accum - w_reference|")
    assert int(accumulated.optimizer.iterations) == EPOCHS * n // (B * K)


# -------------------------------------------------------- steps_per_execution
def test_steps_per_execution_crosses_cycles():
    """steps_per_execution=3 with accum_steps=4 (cycles straddle executions)
    gives the big batch's weights and one update per cycle."""
    n = 96  # 12 micro-batches per epoch: 4 executions of 3, 3 cycles of 4
    x, y = utils.classification_data(n)
    reference = utils.seeded(utils.plain_model)
    initial = utils.weights(reference)
    reference.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=utils.sparse_ce()
    )
    utils.fit(reference, x, y, B * K, EPOCHS)

    accumulated = utils.seeded(lambda: utils.accumulating_model(accum_steps=K))
    accumulated.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        loss=utils.sparse_ce(),
        steps_per_execution=3,
    )
    utils.fit(accumulated, x, y, B, EPOCHS)

    assert int(reference.optimizer.iterations) == EPOCHS * n // (B * K)
    _assert_big_batch(initial, reference, accumulated, n)


# --------------------------------------------------------- accum_steps = 1
def test_accum_steps_one_is_plain_keras_bit_for_bit():
    """accum_steps=1 trains exactly like plain Keras at the same batch size:
    identical weights, iterations and logged losses."""
    n = 64
    x, y = utils.classification_data(n)
    reference = utils.seeded(utils.plain_model)
    initial = utils.weights(reference)
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss=utils.sparse_ce())
    expected = utils.fit(reference, x, y, B, EPOCHS)

    model = utils.seeded(lambda: utils.accumulating_model(accum_steps=1))
    assert model.accum_steps == 1
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=utils.sparse_ce())
    history = utils.fit(model, x, y, B, EPOCHS)

    utils.assert_trained(initial, utils.weights(reference))
    got, want = utils.weights(model), utils.weights(reference)
    diff = utils.report(utils.max_abs_diff(got, want), "max |w_accum - w_reference|")
    assert all(np.array_equal(a, b) for a, b in zip(got, want)), f"max diff {diff}"
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations)
    assert int(model.optimizer.iterations) == EPOCHS * n // B
    assert history.history["loss"] == expected.history["loss"]


# ---------------------------------------------------------- logged metrics
@pytest.mark.parametrize("n", [64, 28], ids=["full_cycles", "short_last"])
def test_logged_loss_and_metrics_are_unscaled(n):
    """With learning rate 0 (weights frozen) the loss and accuracy fit logs
    equal plain Keras at the micro-batch size: the logged loss is the real
    loss, not the loss divided by accum_steps."""
    x, y = utils.classification_data(n)
    frozen = keras.optimizers.SGD
    reference = utils.compiled(utils.plain_model, frozen(0.0), metrics=["accuracy"])
    initial = utils.weights(reference)
    expected = utils.fit(reference, x, y, B, EPOCHS)

    model = utils.compiled(
        lambda: utils.accumulating_model(accum_steps=K),
        frozen(0.0),
        metrics=["accuracy"],
    )
    history = utils.fit(model, x, y, B, EPOCHS)

    # The weights really are frozen, so both runs see the same model.
    assert utils.max_abs_diff(initial, utils.weights(model)) == 0.0
    loss, want_loss = history.history["loss"], expected.history["loss"]
    assert len(loss) == EPOCHS
    assert min(loss) > 0.1, loss  # a real cross-entropy, not ~0
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    np.testing.assert_allclose(
        history.history["accuracy"], expected.history["accuracy"], rtol=1e-6
    )
