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


def _mlp_data(n: int = N):
    return utils.classification_data(n)


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
