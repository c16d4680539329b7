"""The model wrapper's ``fit`` traces its train step once, in each Keras.

Without a strategy, Keras builds the optimizer at its first apply, inside the
first trace; a ``tf.function`` that created variables is traced a second
time, so plain Keras traces its step twice with a stateful optimizer. The
wrapper builds the optimizer's state before its first trace: half the
tracing, which dominates the first step of a large model."""

from __future__ import annotations

import pytest

from gradient_accumulator import GradientAccumulateModel
from tests.flavour import keras, utils

B = 4  # micro-batch
K = 4  # micro-batches per update

OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.02),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
}


def _counting(base, traces: list):
    class Counting(base):
        def train_step(self, data):
            traces.append(1)  # runs once per trace in graph mode
            return super().train_step(data)

    return Counting


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_first_fit_traces_the_step_once_and_matches_the_big_batch(optimizer):
    x, y = utils.classification_data(2 * K * B)
    plain_traces, traces = [], []

    def functional(cls, **kwargs):
        def build():
            inputs = keras.Input((x.shape[1],))
            hidden = keras.layers.Dense(8, activation="relu")(inputs)
            outputs = keras.layers.Dense(3)(hidden)
            return cls(inputs=inputs, outputs=outputs, **kwargs)

        model = utils.seeded(build)
        model.compile(optimizer=OPTIMIZERS[optimizer](), loss=utils.sparse_ce())
        return model

    plain = functional(_counting(keras.Model, plain_traces))
    ours = functional(_counting(GradientAccumulateModel, traces), accum_steps=K)
    initial = utils.weights(plain)
    assert utils.max_abs_diff(initial, utils.weights(ours)) == 0.0
    utils.fit(plain, x, y, batch_size=K * B, epochs=2)
    utils.fit(ours, x, y, batch_size=B, epochs=2)

    # What the wrapper saves: Keras' own trace count for the same fit.
    assert len(plain_traces) == 2, plain_traces
    assert len(traces) == 1, (traces, plain_traces)
    assert int(ours.optimizer.iterations) == int(plain.optimizer.iterations) == 4
    utils.assert_trained(initial, utils.weights(plain))
    utils.assert_same_weights(utils.weights(ours), utils.weights(plain))
