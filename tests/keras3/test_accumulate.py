"""``accumulate(model)``: a model you already have trains as the model wrapper.

Four kinds of model a user may hold (``KINDS``): functional, ``Sequential``,
a subclass with its own ``call`` and a model with its own ``compute_loss``.
Each is made accumulating in place and compared with plain Keras on the big
batch (same initial weights, ``utils.ATOL``), in the streaming mode
(``accum_steps``) and the in-step mode (``micro_batch_size``); the drop-in
guarantees of ``GradientAccumulateModel`` (weights lists, ``.keras`` files
with a pending cycle, recompiling, unknown-length data, distribution, mixed
precision) are checked for it too. keras-hub task models are in
tests/keras3/test_keras_hub.py.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator import (
    GradientAccumulateModel,
    accumulate,
    stop_accumulating,
)
from tests import utils

B = 4  # micro-batch
K = 4  # micro-batches per update
N = 56  # 14 micro-batches: 3 full cycles and a partial one (a short last batch)
F16_ATOL = 1e-4  # tests/keras3/test_mixed_precision.py's tolerance under mixed_float16


@keras.saving.register_keras_serializable(package="tests_accumulate")
class Net(keras.Model):
    """A subclassed model with its own ``call`` (and Keras' ``train_step``)."""

    def __init__(self, classes: int = 3, **kwargs):
        super().__init__(**kwargs)
        self.classes = classes
        self.hidden = keras.layers.Dense(16, activation="tanh")
        self.head = keras.layers.Dense(classes)

    def call(self, x):
        return self.head(self.hidden(x))

    def get_config(self):
        return {**super().get_config(), "classes": self.classes}


@keras.saving.register_keras_serializable(package="tests_accumulate")
class Penalized(keras.Model):
    """A functional model whose ``compute_loss`` is its own: cross-entropy
    (a mean over the batch) plus an L2 penalty on its kernels; compiled
    without a loss."""

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        ce = keras.losses.sparse_categorical_crossentropy(y, y_pred, from_logits=True)
        penalty = sum(
            keras.ops.sum(keras.ops.square(w))
            for w in self.trainable_weights
            if w.path.endswith("kernel")
        )
        return keras.ops.mean(ce) + 1e-2 * penalty


def _subclassed():
    net = Net()
    net(np.zeros((1, 8), "float32"))  # built here, so that seeds fix its weights
    return net


def _compute_loss():
    return Penalized(*utils.mlp_layers())


# Each kind's builder (called seeded: the same initial weights every time).
KINDS = {
    "functional": utils.plain_model,
    "sequential": utils.sequential_mlp,
    "subclassed": _subclassed,
    "compute_loss": _compute_loss,
}


def _loss(kind: str):
    if kind == "compute_loss":
        return None  # its compute_loss ignores the compiled loss
    return utils.sparse_ce()


def _adam():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.02, 2, 0.5)
    return keras.optimizers.Adam(schedule)


def _compile(model, kind: str, optimizer=None):
    model.compile(optimizer=optimizer or _adam(), loss=_loss(kind))


def _pair(kind: str, **settings):
    """A plain model and one made accumulating, with the same initial weights."""
    build = KINDS[kind]
    plain = utils.seeded(build)
    model = accumulate(utils.seeded(build), **settings)
    utils.assert_same_weights(utils.weights(model), utils.weights(plain), 0.0)
    return plain, model


# ------------------------------------------------------------ exactness
@pytest.mark.parametrize("mode", ["streaming", "in_step"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_equals_plain_keras_on_the_big_batch(kind, mode):
    """Adam with a learning-rate schedule, two epochs of 14 micro-batches: a
    partial cycle at each epoch end, flushed as plain Keras' short last batch
    (in-step: each fit batch is sliced and is one update). The model keeps
    its class, and its weights lists are the plain model's."""
    x, y = utils.classification_data(N)
    if mode == "streaming":
        plain, model = _pair(kind, accum_steps=K, partial_cycle="flush")
        batch = B
    else:
        plain, model = _pair(kind, micro_batch_size=B)
        batch = B * K
    own = type(plain)
    assert isinstance(model, own) and isinstance(model, GradientAccumulateModel)
    assert type(model).__name__ == own.__name__
    assert type(model)._accumulated_class is own
    initial = utils.weights(plain)
    for m in (plain, model):
        _compile(m, kind)
    utils.fit(plain, x, y, B * K, epochs=2)
    history = utils.fit(model, x, y, batch, epochs=2)
    utils.assert_trained(initial, utils.weights(plain))
    assert np.isfinite(history.history["loss"]).all()
    assert int(model.optimizer.iterations) == int(plain.optimizer.iterations)
    utils.report(utils.assert_same_weights(utils.weights(model), utils.weights(plain)))
    assert model._accumulator.pending == 0
    # The same variables (up to automatic layer names): no state among them.
    names = [[(w.name, tuple(w.shape)) for w in m.weights] for m in (plain, model)]
    assert names[0] == names[1]
    assert len(model.non_trainable_weights) == len(plain.non_trainable_weights)
    assert len(model.get_weights()) == len(plain.get_weights())
    assert model.count_params() == plain.count_params()


def test_unbuilt_subclassed_model_set_weights_then_trains_exactly():
    """A subclassed model made accumulating before it has weights: built and
    given the plain model's weights with set_weights, it trains exactly."""
    plain = utils.seeded(_subclassed)
    model = accumulate(Net(), accum_steps=K)
    assert not model.built
    model(np.zeros((1, 8), "float32"))
    model.set_weights(plain.get_weights())
    x, y = utils.classification_data(N)
    for m in (plain, model):
        _compile(m, "subclassed")
    utils.fit(plain, x, y, B * K)
    utils.fit(model, x, y, B)
    utils.report(utils.assert_same_weights(utils.weights(model), utils.weights(plain)))


class SeededNet(keras.Model):
    """``Net`` with seeded initializers: two instances start equal whenever
    their variables are made."""

    def __init__(self):
        super().__init__()
        glorot = keras.initializers.GlorotUniform
        self.hidden = keras.layers.Dense(16, "tanh", kernel_initializer=glorot(1))
        self.head = keras.layers.Dense(3, kernel_initializer=glorot(2))

    def call(self, x):
        return self.head(self.hidden(x))


def test_subclass_marked_built_before_its_variables_exist_trains_exactly():
    """``build(shape)`` marks a subclass without a ``build`` method built
    before any layer has a variable (Keras warns, then trains it): the
    state is built at the first step, when the variables exist; before, it
    was built for none and the first step failed."""
    x, y = utils.classification_data(N)
    models = []
    for wrap in (lambda m: m, lambda m: accumulate(m, accum_steps=K)):
        model = SeededNet()
        with pytest.warns(UserWarning, match="build"):
            model.build((None, 8))
        assert model.built and not model.trainable_variables
        model = wrap(model)
        _compile(model, "subclassed")
        models.append(model)
    plain, accumulating = models
    utils.fit(plain, x, y, B * K)
    utils.fit(accumulating, x, y, B)
    assert int(accumulating.optimizer.iterations) == int(plain.optimizer.iterations)
    fresh = SeededNet()
    fresh(x[:1])
    utils.assert_trained(utils.weights(fresh), utils.weights(plain))
    utils.report(
        utils.assert_same_weights(utils.weights(accumulating), utils.weights(plain))
    )


# --------------------------------------------------------- .keras files
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_keras_file_saved_mid_cycle_round_trips_and_resumes_exactly(kind, tmp_path):
    """Saved after 6 micro-batches (1 update, 2 pending), loaded without
    custom_objects, trained on: the same 3 updates as plain Keras on the big
    batch, and the same weights as the model that was never saved."""
    plain, model = _pair(kind, accum_steps=K, partial_cycle="carry", flush_at_end=False)
    own = type(plain)
    x, y = utils.classification_data(48)
    for m in (plain, model):
        _compile(m, kind)
    utils.fit(model, x[:24], y[:24], B)
    assert model._accumulator.pending == 2
    path = tmp_path / f"{kind}.keras"
    model.save(path)

    loaded = keras.models.load_model(path)
    assert type(loaded).__name__ == own.__name__
    assert isinstance(loaded, own) and isinstance(loaded, GradientAccumulateModel)
    assert loaded.accum_steps == K
    assert loaded.get_config()["flush_at_end"] is False
    assert loaded.get_config()["partial_cycle"] == "carry"
    assert loaded._accumulator.pending == 2
    assert int(loaded.optimizer.iterations) == 1
    utils.assert_same_weights(utils.weights(loaded), utils.weights(model), 0.0)

    for m in (loaded, model):
        utils.fit(m, x[24:], y[24:], B)  # 2 pending + 6 = two more updates
        assert m._accumulator.pending == 0
    utils.fit(plain, x, y, B * K)
    assert int(loaded.optimizer.iterations) == int(plain.optimizer.iterations) == 3
    utils.assert_same_weights(utils.weights(loaded), utils.weights(model), 1e-6)
    utils.report(utils.assert_same_weights(utils.weights(loaded), utils.weights(plain)))


# ------------------------------------------------------------ workflows
def _base_and_head():
    base = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu")], name="base"
    )
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(3)(base(inputs, training=False))
    return base, keras.Model(inputs, outputs)


def test_freeze_train_unfreeze_recompile_train_equals_big_batch():
    x, y = utils.classification_data(48)
    ref_base, plain = utils.seeded(_base_and_head)
    base, model = utils.seeded(_base_and_head)
    accumulate(model, accum_steps=K)
    initial = utils.weights(plain)
    runs = ((plain, ref_base, B * K), (model, base, B))
    utils.freeze_train_unfreeze(runs, x, y, _adam)
    utils.assert_trained(initial, utils.weights(plain))
    assert len(model._accumulator.grad_sums) == len(model.trainable_weights) == 4
    assert int(model.optimizer.iterations) == int(plain.optimizer.iterations)
    utils.report(utils.assert_same_weights(utils.weights(model), utils.weights(plain)))


def test_unknown_length_dataset_over_several_epochs_equals_big_batch():
    """from_generator: no cardinality; 6 micro-batches per epoch, so each
    epoch ends with a short cycle of 2, applied as plain Keras' short batch."""
    epochs, n = 3, 24
    x, y = utils.classification_data(n)

    def gen():
        yield from zip(x, y)

    ds = tf.data.Dataset.from_generator(
        gen,
        output_signature=(
            tf.TensorSpec((8,), tf.float32),
            tf.TensorSpec((), tf.int64),
        ),
    ).batch(B)
    assert int(ds.cardinality()) == int(tf.data.UNKNOWN_CARDINALITY)
    plain, model = _pair("sequential", accum_steps=K)
    for m in (plain, model):
        _compile(m, "sequential")
    model.fit(ds, epochs=epochs, verbose=0)
    utils.fit(plain, x, y, B * K, epochs=epochs)
    assert int(model.optimizer.iterations) == int(plain.optimizer.iterations) == 6
    utils.report(utils.assert_same_weights(utils.weights(model), utils.weights(plain)))


# ---------------------------------------------------------------- undo
def test_stop_accumulating_without_flush_drops_the_partial_cycle():
    plain, model = _pair("sequential", accum_steps=K, flush_at_end=False)
    x, y = utils.classification_data(24)
    for m in (plain, model):
        _compile(m, "sequential")
    utils.fit(model, x, y, B)  # one update, 2 pending
    stop_accumulating(model, flush=False)
    assert type(model) is keras.Sequential
    utils.fit(plain, x[:16], y[:16], B * K)  # the one full cycle only
    utils.assert_same_weights(utils.weights(model), utils.weights(plain))


# ----------------------------------------------- strategy, mixed precision
def test_under_mirrored_strategy_it_trains_as_the_model_wrapper():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    x, y = utils.classification_data(N)
    with strategy.scope():
        model = accumulate(utils.seeded(utils.plain_model), accum_steps=K)
        wrapper = utils.seeded(lambda: utils.accumulating_model(accum_steps=K))
        plain = utils.seeded(utils.plain_model)
        for m in (model, wrapper, plain):
            _compile(m, "functional")
    assert model.distribute_strategy is strategy
    utils.fit(model, x, y, B)
    utils.fit(wrapper, x, y, B)
    utils.fit(plain, x, y, B * K)
    updates = [int(m.optimizer.iterations.numpy()) for m in (model, wrapper, plain)]
    assert updates == [4, 4, 4]
    utils.assert_same_weights(utils.weights(model), utils.weights(wrapper))
    utils.report(utils.assert_same_weights(utils.weights(model), utils.weights(plain)))


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.usefixtures("mixed_float16")
def test_under_mixed_float16_it_trains_as_the_model_wrapper():
    x, y = utils.classification_data(N)
    model = accumulate(utils.seeded(utils.plain_model), accum_steps=K)
    wrapper = utils.seeded(lambda: utils.accumulating_model(accum_steps=K))
    assert model.layers[-1].compute_dtype == "float16"
    initial = utils.weights(model)
    for m in (model, wrapper):
        _compile(m, "functional", keras.optimizers.SGD(0.1, momentum=0.5))
        assert isinstance(m.optimizer, keras.optimizers.LossScaleOptimizer)
        utils.fit(m, x, y, B, epochs=2)
    utils.assert_trained(initial, utils.weights(model))
    # 14 micro-batches an epoch: 3 cycles and a short one, 2 epochs.
    assert int(model.optimizer.iterations) == int(wrapper.optimizer.iterations) == 8
    utils.report(
        utils.assert_same_weights(
            utils.weights(model), utils.weights(wrapper), F16_ATOL
        )
    )
