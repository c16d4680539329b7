"""GradientAccumulateModel against plain Keras on the big batch.

The reference is always a plain ``keras.Model`` built from the same seed and
trained with ``fit(batch_size=B * K, shuffle=False)``; the accumulating run is
``GradientAccumulateModel(accum_steps=K)`` with the same layers, optimizer and
data, trained with ``fit(batch_size=B, shuffle=False)``. Every test also checks
that training moved the weights, so none can pass by comparing two untouched
models.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from gradient_accumulator import GradientAccumulateModel
from tests import utils

B = 8  # micro-batch size
K = 4  # accumulation steps
N = 64  # samples: a multiple of B * K, so cycles and big batches line up
EPOCHS = 2
UPDATES = EPOCHS * N // (B * K)
# How utils.train_pair trains the two models in every test here.
PAIR = {"batch_size": B, "accum_steps": K, "epochs": EPOCHS}


def _equivalent(layers, make_optimizer, x, y):
    """``utils.train_pair`` (``PAIR``), asserted equivalent; returns the
    reference and the accumulated model."""
    initial, reference, accumulated = utils.train_pair(
        layers, make_optimizer, x, y, **PAIR
    )
    utils.assert_equivalent(initial, reference, accumulated, UPDATES)
    return reference, accumulated


def _plain_big_batch(optimizer, x, y):
    """The weights plain Keras reaches on the big batch with ``optimizer``."""
    plain = utils.seeded(utils.plain_model)
    plain.compile(optimizer=optimizer, loss=utils.sparse_ce())
    plain.fit(x, y, batch_size=B * K, epochs=EPOCHS, shuffle=False, verbose=0)
    return utils.weights(plain)


def _mlp_data(n: int = N):
    return utils.classification_data(n)


def _cnn_data(n: int = N):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 3, size=n)
    return x, y


ARCHITECTURES = {
    "mlp": (utils.mlp_layers, _mlp_data),
    "cnn": (utils.cnn_layers, _cnn_data),
}


# ------------------------------------------------------------- optimizers
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_optimizer_matches_big_batch(architecture, optimizer):
    """K micro-batches of B give the big batch's weights and one update per
    cycle, for SGD, momentum, Adam and AdamW on an MLP and a CNN."""
    layers, data = ARCHITECTURES[architecture]
    x, y = data()
    _equivalent(layers, OPTIMIZERS[optimizer], x, y)


# ---------------------------------------------------- learning-rate schedules
SCHEDULES = {
    # Halves every update: advancing per micro-batch would shrink it 16-fold.
    "exponential": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.5)
    ),
    "piecewise": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.PiecewiseConstantDecay([1, 2], [0.2, 0.05, 0.01])
    ),
    "cosine": lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.CosineDecay(0.02, decay_steps=UPDATES)
    ),
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_learning_rate_schedule_advances_once_per_update(schedule):
    """A learning-rate schedule is evaluated at the update count, not the
    micro-batch count: weights and the final learning rate match."""
    x, y = _mlp_data()
    reference, accumulated = _equivalent(utils.mlp_layers, SCHEDULES[schedule], x, y)
    np.testing.assert_allclose(
        float(accumulated.optimizer.learning_rate),
        float(reference.optimizer.learning_rate),
        rtol=1e-6,
    )


def test_ema_weights_match_big_batch():
    """With use_ema=True the moving average advances once per update, and
    fit's final EMA swap gives the big batch's weights."""
    x, y = _mlp_data()

    def ema():
        return keras.optimizers.Adam(0.02, use_ema=True, ema_momentum=0.5)

    reference, _ = _equivalent(utils.mlp_layers, ema, x, y)

    # Non-vacuity: EMA changed the outcome compared with no EMA.
    plain = _plain_big_batch(keras.optimizers.Adam(0.02), x, y)
    assert utils.max_abs_diff(plain, utils.weights(reference)) > 1e-3


# --------------------------------------------------------------- clipping
CLIPPING = {
    "clipnorm": {"clipnorm": 0.05},
    "clipvalue": {"clipvalue": 0.005},
    "global_clipnorm": {"global_clipnorm": 0.05},
}


@pytest.mark.parametrize("clip", sorted(CLIPPING))
def test_clipping_acts_on_accumulated_gradient(clip):
    """clipnorm / clipvalue / global_clipnorm clip the accumulated gradient
    once per update (clipping each micro-batch would give other weights)."""
    x, y = _mlp_data()

    def clipped():
        return keras.optimizers.SGD(0.5, **CLIPPING[clip])

    reference, _ = _equivalent(utils.mlp_layers, clipped, x, y)

    # Non-vacuity: the clip value is small enough that clipping triggered.
    unclipped = _plain_big_batch(keras.optimizers.SGD(0.5), x, y)
    change = utils.max_abs_diff(unclipped, utils.weights(reference))
    assert change > 1e-3, f"clipping did not trigger (diff {change:.3g})"


# ---------------------------------------------- embedding (IndexedSlices)
VOCAB = 40


def _embedding_layers():
    inputs = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 8)(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    outputs = keras.layers.Dense(3)(h)
    return inputs, outputs


def test_embedding_sparse_gradients_with_momentum():
    """Embedding gradients (IndexedSlices, rows touched by some micro-batches
    only) accumulate exactly; SGD with momentum matches the big batch."""
    rng = np.random.default_rng(2)
    x = rng.integers(0, VOCAB, size=(N, 6)).astype("int32")
    y = rng.integers(0, 3, size=N)
    _equivalent(
        _embedding_layers, lambda: keras.optimizers.SGD(0.5, momentum=0.9), x, y
    )


# ----------------------------------------------------------- subclassing
class PlainNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="tanh")
        self.head = keras.layers.Dense(3)

    def call(self, inputs):
        return self.head(self.hidden(inputs))


class AccumulatingNet(GradientAccumulateModel):
    def __init__(self, **kwargs):
        super().__init__(accum_steps=K, **kwargs)
        self.hidden = keras.layers.Dense(16, activation="tanh")
        self.head = keras.layers.Dense(3)

    def call(self, inputs):
        return self.head(self.hidden(inputs))


def test_subclassing_works_after_functional_use():
    """Subclassing GradientAccumulateModel still works in a process that has
    already built a functional GradientAccumulateModel (Keras must not have
    re-based the class onto Functional)."""
    inputs, outputs = utils.mlp_layers()
    GradientAccumulateModel(accum_steps=K, inputs=inputs, outputs=outputs)
    model = AccumulatingNet()
    assert model.accum_steps == K
    assert model(np.zeros((1, 8), "float32")).shape == (1, 3)


def test_subclassed_model_matches_plain_subclass():
    """A GradientAccumulateModel subclass (layers in __init__, call method)
    trains like the identical plain keras.Model subclass on the big batch."""
    x, y = _mlp_data()

    def built(cls):
        model = cls()
        model(x[:1])  # build inside the seeded scope: identical initial weights
        return model

    reference = utils.seeded(lambda: built(PlainNet))
    initial = utils.weights(reference)
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss=utils.sparse_ce())
    reference.fit(x, y, batch_size=B * K, epochs=EPOCHS, shuffle=False, verbose=0)

    accumulated = utils.seeded(lambda: built(AccumulatingNet))
    assert accumulated.accum_steps == K
    assert utils.max_abs_diff(initial, utils.weights(accumulated)) == 0.0
    accumulated.compile(optimizer=keras.optimizers.Adam(0.01), loss=utils.sparse_ce())
    accumulated.fit(x, y, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0)
    utils.assert_equivalent(initial, reference, accumulated, UPDATES)
