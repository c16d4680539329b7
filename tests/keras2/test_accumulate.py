"""tf-keras ``accumulate(model)``, from the user's side: a functional model,
a ``Sequential``, a subclass with its own ``call`` and one with its own
``compute_loss`` are made accumulating in place and train as plain tf-keras
on the big batch; they keep their class and weights lists, save as the plain
model does (``.keras`` and SavedModel load back accumulating, ``.h5`` as the
model's own class). ``stop_accumulating``: tests/both/test_accumulate.py."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from gradient_accumulator import (
    GradientAccumulateModel,
    accumulate,
)
from tests.keras2 import utils

B, K = 4, 4
N = 56  # 14 micro-batches: 3 full cycles and a partial one per epoch


@tf_keras.saving.register_keras_serializable(package="tests_keras2_accumulate")
class Net(tf_keras.Model):
    """A subclassed model with its own ``call`` (and tf-keras' train_step)."""

    def __init__(self, classes: int = 3, **kwargs):
        super().__init__(**kwargs)
        self.classes = classes
        self.hidden = tf_keras.layers.Dense(16, activation="tanh")
        self.head = tf_keras.layers.Dense(classes)

    def call(self, x):
        return self.head(self.hidden(x))

    def get_config(self):
        return {"classes": self.classes, "name": self.name}


class Penalized(tf_keras.Model):
    """A functional model with its own ``compute_loss``: a mean cross-entropy
    plus an L2 penalty on its kernels; compiled without a loss."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
        ce = tf_keras.losses.sparse_categorical_crossentropy(
            y, y_pred, from_logits=True
        )
        kernels = [w for w in self.trainable_weights if "kernel" in w.name]
        return tf.reduce_mean(ce) + 1e-2 * tf.add_n(
            [tf.reduce_sum(tf.square(w)) for w in kernels]
        )


def _subclassed():
    net = Net()
    net(np.zeros((1, 8), "float32"))  # built here, so that seeds fix its weights
    return net


KINDS = {
    "functional": utils.plain_model,
    "sequential": utils.sequential_mlp,
    "subclassed": _subclassed,
    "compute_loss": lambda: Penalized(*utils.mlp_layers()),
}


def _compile(model, kind, optimizer=None):
    schedule = tf_keras.optimizers.schedules.ExponentialDecay(0.02, 2, 0.5)
    loss = None if kind == "compute_loss" else utils.sparse_ce()
    model.compile(optimizer or tf_keras.optimizers.Adam(schedule), loss)


def _pair(kind, **settings):
    """A plain model and one made accumulating, with the same weights."""
    plain = utils.seeded(KINDS[kind])
    model = accumulate(utils.seeded(KINDS[kind]), **settings)
    utils.assert_same_weights(utils.weights(model), utils.weights(plain), 0.0)
    return plain, model


def _name(variable) -> str:
    """A variable's name without its layer's (automatic layer names differ
    between the two models)."""
    return variable.name.split("/")[-1]


def _same(model, plain) -> float:
    diff = utils.assert_same_weights(utils.weights(model), utils.weights(plain))
    return utils.report(diff)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_equals_plain_tf_keras_on_the_big_batch(kind):
    """Adam with a schedule, two epochs of 14 micro-batches, each epoch's
    partial cycle flushed as plain tf-keras' short last batch."""
    x, y = utils.classification_data(N)
    plain, model = _pair(kind, accum_steps=K, partial_cycle="flush")
    own = type(plain)
    assert isinstance(model, own) and isinstance(model, GradientAccumulateModel)
    assert type(model).__name__ == own.__name__
    initial = utils.weights(plain)
    for m in (plain, model):
        _compile(m, kind)
    logs = utils.fit(plain, x, y, B * K, epochs=2).history
    history = utils.fit(model, x, y, B, epochs=2).history
    utils.assert_trained(initial, utils.weights(plain))
    assert sorted(history) == sorted(logs)  # the plain model's logs
    assert all(np.isfinite(v).all() for v in history.values())
    assert int(model.optimizer.iterations) == int(plain.optimizer.iterations) == 8
    _same(model, plain)
    assert model._accumulator.pending == 0
    # The same weights lists: no accumulation state among them.
    names = [[(_name(w), tuple(w.shape)) for w in m.weights] for m in (plain, model)]
    assert names[0] == names[1]
    assert len(model.get_weights()) == len(plain.get_weights())
    assert model.count_params() == plain.count_params()


def test_under_mirrored_strategy_it_trains_as_the_big_batch(mirrored):
    strategy = mirrored
    x, y = utils.classification_data(64)
    with strategy.scope():
        model = accumulate(utils.seeded(utils.plain_model), accum_steps=K)
        plain = utils.seeded(utils.plain_model)
        for m in (model, plain):
            _compile(m, "functional", tf_keras.optimizers.Adam(0.01))
    utils.fit(model, x, y, 2 * B)
    utils.fit(plain, x, y, 2 * B * K)
    updates = [m.optimizer.iterations.numpy() for m in (model, plain)]
    assert updates == [2, 2]
    _same(model, plain)


# -------------------------------------------------------------------- saving
@pytest.mark.parametrize("path", ["m.keras", "saved_model_dir", "m.h5"])
@pytest.mark.parametrize("kind", ["functional", "sequential"])
def test_saved_files_load_and_train_on_as_the_plain_model(kind, path, tmp_path):
    """Saved after whole cycles; ``.keras`` and SavedModel load back
    accumulating (its own class, the settings), ``.h5`` as its own plain
    class (it names a model by its bare class name); each then trains on as
    the plain model saved and loaded the same way."""
    x, y = utils.classification_data(64)
    plain, model = _pair(kind, accum_steps=K, progress_logs=True)
    own = type(plain)
    for m in (plain, model):
        _compile(m, kind, tf_keras.optimizers.Adam(0.01))
    utils.fit(model, x[:32], y[:32], B)
    utils.fit(plain, x[:32], y[:32], B * K)
    loaded = []
    for name, m in (("acc", model), ("plain", plain)):
        (tmp_path / name).mkdir()
        m.save(tmp_path / name / path)
        loaded.append(tf_keras.models.load_model(tmp_path / name / path))
    again, reference = loaded
    assert isinstance(again, own)
    if path == "m.h5":
        assert type(again) is own
        accumulate(again, accum_steps=K)
    else:
        assert isinstance(again, GradientAccumulateModel)
        assert again.accum_steps == K
        assert again.get_config()["progress_logs"] is True
    assert int(again.optimizer.iterations) == int(reference.optimizer.iterations)
    utils.assert_same_weights(again.get_weights(), model.get_weights(), 0.0)
    utils.fit(again, x[32:], y[32:], B)
    utils.fit(reference, x[32:], y[32:], B * K)
    _same(again, reference)


def test_subclassed_model_round_trips_a_keras_file(tmp_path):
    _, model = _pair("subclassed", accum_steps=K)
    _compile(model, "subclassed")
    x, y = utils.classification_data(32)
    utils.fit(model, x, y, B)
    model.save(tmp_path / "net.keras")
    loaded = tf_keras.models.load_model(tmp_path / "net.keras")
    assert isinstance(loaded, Net) and isinstance(loaded, GradientAccumulateModel)
    assert loaded.classes == 3 and loaded.accum_steps == K
    utils.assert_same_weights(loaded.get_weights(), model.get_weights(), 0.0)


def test_weights_file_is_the_plain_models(tmp_path):
    plain, model = _pair("functional", accum_steps=K)
    _compile(model, "functional")
    x, y = utils.classification_data(24)
    utils.fit(model, x, y, B)  # an update and 2 pending micro-batches
    model.save_weights(tmp_path / "w.h5")
    plain.load_weights(tmp_path / "w.h5")
    utils.assert_same_weights(plain.get_weights(), model.get_weights(), 0.0)
