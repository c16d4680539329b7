"""float8 training (``model.quantize("float8")``) under both wrappers.

The scale and amax-history variables float8 layers create are overwritten
with their "gradient" (``overwrite_with_gradient=True``): a new value from the
backward pass, not a derivative. Keras' own ``gradient_accumulation_steps``
keeps their maximum over the cycle; both wrappers must give the same values,
and the trained weights must be Keras' accumulation's too.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from gradient_accumulator import GradientAccumulateModel, GradientAccumulateOptimizer
from tests import utils

B, K = 8, 4
CYCLES = 3


def _layers():
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    return inputs, keras.layers.Dense(2)(hidden)


def _data():
    rng = np.random.default_rng(0)
    # Micro-batches with very different input ranges: their amaxes differ, so
    # a mean over the cycle is far from the maximum.
    scales = np.repeat([0.5, 4.0, 1.0, 2.0] * CYCLES, B)[:, None]
    x = (rng.normal(size=(B * K * CYCLES, 8)) * scales).astype("float32")
    y = rng.normal(size=(B * K * CYCLES, 2)).astype("float32")
    return x, y


def _train(kind: str):
    def build():
        inputs, outputs = _layers()
        if kind == "model":
            return GradientAccumulateModel(K, inputs=inputs, outputs=outputs)
        return keras.Model(inputs, outputs)

    model = utils.seeded(build)
    model.quantize("float8")
    optimizer = {
        "keras": lambda: keras.optimizers.SGD(0.1, gradient_accumulation_steps=K),
        "model": lambda: keras.optimizers.SGD(0.1),
        "optimizer": lambda: GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), K),
        "big": lambda: keras.optimizers.SGD(0.1),
    }[kind]()
    model.compile(optimizer=optimizer, loss="mse")
    x, y = _data()
    batch = B * K if kind == "big" else B
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == CYCLES
    return model


def _split(model):
    """(trained weights, overwritten weights) as arrays."""
    trained, overwritten = [], []
    for v in model.trainable_weights:
        (overwritten if v.overwrite_with_gradient else trained).append(np.asarray(v))
    return trained, overwritten


@pytest.mark.parametrize("kind", ["model", "optimizer"])
def test_float8_matches_keras_gradient_accumulation(kind):
    reference = _train("keras")
    accumulated = _train(kind)
    ref_trained, ref_over = _split(reference)
    acc_trained, acc_over = _split(accumulated)
    assert len(acc_over) == 12  # 2 layers x (3 scales + 3 amax histories)
    # The amax histories saw every micro-batch: their cycle maximum is kept.
    histories = [w for w in ref_over if w.shape != ()]
    assert max(float(np.max(h)) for h in histories) > 4.0
    utils.report(utils.max_abs_diff(acc_over, ref_over), "float8 state")
    utils.assert_same_weights(acc_over, ref_over, 1e-6)
    initial = _split(utils.seeded(lambda: keras.Model(*_layers())))[0]
    utils.assert_trained(initial, acc_trained)
    utils.assert_same_weights(acc_trained, ref_trained)


def test_float8_input_and_kernel_state_equal_the_big_batch():
    """What the forward pass records (input and kernel amaxes and scales) is
    the big batch's: the maximum over a cycle is the maximum over its big
    batch. (The output-gradient amax records the backward pass's magnitudes,
    which are a micro-batch's in Keras' own accumulation too.)"""
    big = _train("big")
    accumulated = _train("model")
    for a, b in zip(big.trainable_weights, accumulated.trainable_weights):
        if a.overwrite_with_gradient and not a.path.split("/")[-1].startswith(
            ("outputs_grad",)
        ):
            # Kernels differ by float8 rounding (~1e-5), so their amaxes too.
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4)
