"""``gradient_cache=True``, in each Keras: losses that couple a batch's
samples (an in-batch softmax over a two-tower model, a CLIP-style symmetric
loss with a learned temperature, a batch-hard triplet loss) train exactly as
plain Keras on the whole batch, with the batch run in slices of
``micro_batch_size``; the cases that cannot be exact are refused with the
reason. Without the cache, slicing is measurably not the big batch (the
in-step mode sums the slices' own in-batch losses)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel, accumulate, verify
from tests import dist_utils
from tests.flavour import keras
from tests.utils import max_abs_diff

N = 32  # a fit batch: the negatives of each sample
SLICE = 8  # samples per slice (micro_batch_size)
UPDATES = 12
D = 6  # input features per tower
E = 4  # embedding size
TOL = 2e-5


def batches(seed: int = 0):
    rng = np.random.default_rng(seed)
    rows = N * UPDATES
    query = rng.normal(size=(rows, D)).astype("float32")
    mix = rng.normal(size=(D, D)).astype("float32")
    candidate = (query @ mix + 0.3 * rng.normal(size=(rows, D))).astype("float32")
    weights = rng.uniform(0.5, 1.5, size=(rows,)).astype("float32")
    labels = rng.integers(0, 4, size=(rows, 1)).astype("float32")
    return query, candidate, weights, labels


def _towers(temperature: bool = False):
    """Inputs and the concatenated embeddings of two small towers (final
    projections without bias: the in-batch softmax is invariant to a shift
    of every candidate, so such a bias has no gradient but round-off)."""
    query, candidate = keras.Input((D,)), keras.Input((D,))
    a = keras.layers.Dense(8, activation="tanh")(query)
    a = keras.layers.Dense(E, use_bias=False)(a)
    b = keras.layers.Dense(8, activation="tanh")(candidate)
    b = keras.layers.Dense(E, use_bias=False)(b)
    if temperature:
        a = LearnedScale()(keras.layers.UnitNormalization()(a))
        b = keras.layers.UnitNormalization()(b)
    return [query, candidate], keras.layers.Concatenate()([a, b])


class LearnedScale(keras.layers.Layer):
    """Multiplies by exp(log_scale), a trainable scalar: CLIP's learned
    inverse temperature, which reaches the loss through the outputs."""

    def build(self, input_shape):
        self.log_scale = self.add_weight(
            name="log_scale", shape=(), initializer=keras.initializers.Constant(1.0)
        )

    def call(self, inputs):
        return inputs * tf.exp(self.log_scale)


def in_batch_softmax(y_true, y_pred):
    """Each query's candidate among the batch's candidates."""
    a, b = y_pred[:, :E], y_pred[:, E:]
    logits = tf.matmul(a, b, transpose_b=True)
    labels = tf.range(tf.shape(a)[0])
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)


def clip_symmetric(y_true, y_pred):
    """CLIP: the softmax over candidates and over queries, averaged."""
    a, b = y_pred[:, :E], y_pred[:, E:]
    logits = tf.matmul(a, b, transpose_b=True)
    labels = tf.range(tf.shape(a)[0])
    rows = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
    columns = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels, tf.transpose(logits)
    )
    return (rows + columns) / 2.0


def batch_hard_triplet(y_true, y_pred, margin: float = 0.5):
    """Each anchor's farthest positive against its nearest negative in the
    batch (labels in ``y_true``)."""
    emb = y_pred[:, :E]
    square = tf.reduce_sum(emb * emb, 1)
    dist = square[:, None] - 2.0 * tf.matmul(emb, emb, transpose_b=True) + square
    dist = tf.sqrt(tf.maximum(dist, 1e-12))
    labels = tf.reshape(y_true, [-1])
    same = tf.equal(labels[:, None], labels[None, :])
    hardest_positive = tf.reduce_max(tf.where(same, dist, 0.0), 1)
    nearest_negative = tf.reduce_min(tf.where(same, 1e9, dist), 1)
    return tf.nn.relu(hardest_positive - nearest_negative + margin)


LOSSES = {
    "in_batch_softmax": (in_batch_softmax, False),
    "clip_learned_temperature": (clip_symmetric, True),
    "batch_hard_triplet": (batch_hard_triplet, False),
}


def two_towers(wrapper=None, temperature=False, **settings):
    keras.utils.set_random_seed(1)
    inputs, outputs = _towers(temperature)
    if wrapper is None:
        return keras.Model(inputs, outputs)
    return wrapper(inputs=inputs, outputs=outputs, **settings)


def _optimizer(name: str):
    return keras.optimizers.SGD(0.1) if name == "sgd" else keras.optimizers.Adam(1e-2)


def fit_on_batches(model, loss, optimizer, batch_size=N, epochs=1):
    query, candidate, weights, labels = batches()
    with model.distribute_strategy.scope():
        model.compile(optimizer=_optimizer(optimizer), loss=loss)
    history = model.fit(
        [query, candidate],
        labels,
        sample_weight=weights,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=False,
        verbose=0,
    )
    return model, history.history


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("case", sorted(LOSSES))
def test_a_coupled_loss_trains_as_the_whole_batch(case, optimizer):
    """12 updates of batches of 32 in slices of 8, sample weights, against
    plain Keras with batch_size=32: weights, iterations and logged loss."""
    loss, temperature = LOSSES[case]
    plain, plain_logs = fit_on_batches(
        two_towers(temperature=temperature), loss, optimizer
    )
    cached, cached_logs = fit_on_batches(
        two_towers(
            GradientAccumulateModel,
            temperature,
            micro_batch_size=SLICE,
            gradient_cache=True,
        ),
        loss,
        optimizer,
    )
    assert int(cached.optimizer.iterations) == int(plain.optimizer.iterations)
    assert int(plain.optimizer.iterations) == UPDATES
    assert max_abs_diff(plain.get_weights(), cached.get_weights()) <= TOL
    np.testing.assert_allclose(cached_logs["loss"], plain_logs["loss"], rtol=1e-5)
    # The weights moved: the comparison is not of two initial states.
    assert (
        max_abs_diff(
            plain.get_weights(), two_towers(temperature=temperature).get_weights()
        )
        > 1e-3
    )


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_a_weight_penalty_and_eager_steps_train_as_the_whole_batch(run_eagerly):
    """A kernel penalty reaches the weights directly, beside the slices'
    backward pass; run eagerly, the slice loops run as Python loops."""

    def model(wrapper=None, **settings):
        keras.utils.set_random_seed(1)
        penalty = keras.regularizers.L2(0.05)
        query, candidate = keras.Input((D,)), keras.Input((D,))
        a = keras.layers.Dense(E, kernel_regularizer=penalty)(query)
        b = keras.layers.Dense(E, use_bias=False)(candidate)
        outputs = keras.layers.Concatenate()([a, b])
        if wrapper is None:
            return keras.Model([query, candidate], outputs)
        return wrapper(inputs=[query, candidate], outputs=outputs, **settings)

    def fit(model):
        query, candidate, weights, _ = batches()
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=in_batch_softmax,
            run_eagerly=run_eagerly,
        )
        model.fit(
            [query, candidate],
            np.zeros((len(query), 1), "float32"),
            sample_weight=weights,
            batch_size=N,
            shuffle=False,
            verbose=0,
        )
        return model.get_weights()

    plain = fit(model())
    cached = fit(
        model(GradientAccumulateModel, micro_batch_size=SLICE, gradient_cache=True)
    )
    assert max_abs_diff(plain, cached) <= TOL
    assert max_abs_diff(plain, model().get_weights()) > 1e-3


def in_batch_softmax_per_half(y_true, y_pred):
    """The in-batch softmax within each half of a batch of 2N: the big batch
    of two coupled batches of N, accumulated."""
    halves = tf.split(y_pred, 2)
    return tf.concat([in_batch_softmax(None, half) for half in halves], 0)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_accum_steps_accumulates_whole_coupled_batches(optimizer):
    """accum_steps=2: each fit batch of 32 is one coupled batch (its own
    negatives, as plain Keras with batch_size=32) and two make an update:
    plain Keras on batches of 64 whose loss couples each half."""
    plain, _ = fit_on_batches(
        two_towers(), in_batch_softmax_per_half, optimizer, batch_size=2 * N
    )
    cached, _ = fit_on_batches(
        two_towers(
            GradientAccumulateModel,
            accum_steps=2,
            micro_batch_size=SLICE,
            gradient_cache=True,
        ),
        in_batch_softmax,
        optimizer,
    )
    assert int(cached.optimizer.iterations) == UPDATES // 2
    assert max_abs_diff(plain.get_weights(), cached.get_weights()) <= TOL


def test_accumulate_in_place_takes_the_setting_and_saves_it(tmp_path):
    """accumulate() trains as the wrapper does; the setting is saved and
    loaded with the model."""
    plain, _ = fit_on_batches(two_towers(), in_batch_softmax, "adam")
    model = accumulate(two_towers(), micro_batch_size=SLICE, gradient_cache=True)
    model, _ = fit_on_batches(model, in_batch_softmax, "adam")
    assert max_abs_diff(plain.get_weights(), model.get_weights()) <= TOL
    path = str(tmp_path / "cached.keras")
    model.save(path)
    loaded = keras.models.load_model(path, compile=False)
    assert loaded.get_config()["gradient_cache"] is True
    assert loaded.get_config()["micro_batch_size"] == SLICE


def test_construction_checks_the_setting():
    with pytest.raises(ValueError, match="micro_batch_size"):
        two_towers(GradientAccumulateModel, gradient_cache=True)
    with pytest.raises(TypeError, match="gradient_cache"):
        two_towers(GradientAccumulateModel, micro_batch_size=SLICE, gradient_cache=1)
    with pytest.raises(ValueError, match="micro_batch_size"):
        accumulate(two_towers(), gradient_cache=True)
    with pytest.raises(ValueError, match='"global"'):
        two_towers(
            GradientAccumulateModel, micro_batch_size=SLICE, gradient_cache="all"
        )


def refused(layer, match):
    """A two-tower model with ``layer`` in the query tower is refused at its
    first step, with the reason."""
    keras.utils.set_random_seed(1)
    query, candidate = keras.Input((D,)), keras.Input((D,))
    a = layer(keras.layers.Dense(E)(query))
    b = keras.layers.Dense(E)(candidate)
    model = GradientAccumulateModel(
        inputs=[query, candidate],
        outputs=keras.layers.Concatenate()([a, b]),
        micro_batch_size=SLICE,
        gradient_cache=True,
    )
    with pytest.raises(ValueError, match=match):
        fit_on_batches(model, in_batch_softmax, "sgd")


def test_batch_normalization_in_training_is_refused():
    refused(keras.layers.BatchNormalization(), "BatchNormalization")


def test_a_frozen_batch_normalization_is_accepted():
    """Frozen, it normalises by its moving statistics: per sample."""
    layer = keras.layers.BatchNormalization()
    layer.trainable = False
    keras.utils.set_random_seed(1)
    query, candidate = keras.Input((D,)), keras.Input((D,))
    outputs = keras.layers.Concatenate()(
        [layer(keras.layers.Dense(E)(query)), keras.layers.Dense(E)(candidate)]
    )
    plain = keras.Model([query, candidate], outputs)
    weights = plain.get_weights()
    cached = GradientAccumulateModel(
        inputs=[query, candidate],
        outputs=outputs,
        micro_batch_size=SLICE,
        gradient_cache=True,
    )
    # Both models share the layers: train the wrapper from the same start.
    cached, _ = fit_on_batches(cached, in_batch_softmax, "sgd")
    after = cached.get_weights()
    plain.set_weights(weights)
    plain, _ = fit_on_batches(plain, in_batch_softmax, "sgd")
    assert max_abs_diff(plain.get_weights(), after) <= TOL


def test_a_loss_added_in_the_call_is_refused():
    refused(
        keras.layers.Dense(E, activity_regularizer=keras.regularizers.L2(0.1)),
        "activity_regularizer",
    )


def test_verify_names_the_setting_and_checks_it():
    """verify on an in-batch softmax: with accum_steps alone it fails and
    its reason names gradient_cache; with gradient_cache=True it passes."""
    query, candidate, _, labels = batches()

    def build():
        keras.utils.set_random_seed(1)
        return keras.Model(*_towers())

    common = {
        "micro_batch_size": SLICE,
        "accum_steps": N // SLICE,
        "steps": 3,
        "optimizer": "sgd",
        "loss": in_batch_softmax,
    }
    plain = verify(build, [query, candidate], labels, **common)
    assert not plain.ok
    reasons = " ".join(layer.reason or "" for layer in plain.layers)
    assert "gradient_cache=True" in reasons, reasons
    cached = verify(build, [query, candidate], labels, gradient_cache=True, **common)
    assert cached.ok, str(cached)
    assert cached.max_abs_diff <= TOL


def mirrored_gaps() -> dict:
    """Under MirroredStrategy over two logical CPUs (configured before
    TensorFlow starts): with ``gradient_cache=True`` each replica's half of
    a batch is its own coupled batch, as plain Keras computes it under the
    strategy; with ``"global"`` every replica's outputs are gathered before
    the loss, so the negatives are the whole batch's, as on one device."""
    strategy = tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    assert strategy.num_replicas_in_sync == 2
    gaps = {}
    for optimizer in ("sgd", "adam"):
        with strategy.scope():
            plain = two_towers()
            per_replica = two_towers(
                GradientAccumulateModel, micro_batch_size=SLICE, gradient_cache=True
            )
            gathered = two_towers(
                GradientAccumulateModel, micro_batch_size=SLICE, gradient_cache="global"
            )
        for model in (plain, per_replica, gathered):
            fit_on_batches(model, in_batch_softmax, optimizer)
        # One device: the whole batch's negatives.
        single, _ = fit_on_batches(two_towers(), in_batch_softmax, optimizer)
        gaps[optimizer] = {
            "per_replica": max_abs_diff(plain.get_weights(), per_replica.get_weights()),
            "global": max_abs_diff(single.get_weights(), gathered.get_weights()),
            "iterations": [
                int(m.optimizer.iterations.numpy()) for m in (per_replica, gathered)
            ],
            "replicas_from_one_device": max_abs_diff(
                single.get_weights(), per_replica.get_weights()
            ),
        }
    return gaps


def test_mirrored_strategy_negatives_per_replica_or_gathered():
    """Per-replica negatives (True) equal plain Keras under the strategy;
    gathered ones ("global") equal the single-device whole batch, which
    plain Keras under a strategy does not offer; the two differ
    measurably (so neither comparison is vacuous)."""
    gaps = dist_utils.on_two_cpus(mirrored_gaps)
    for gap in gaps.values():
        assert gap["iterations"] == [UPDATES, UPDATES], gaps
        assert gap["per_replica"] <= TOL, gaps
        assert gap["global"] <= TOL, gaps
        assert gap["replicas_from_one_device"] > 100 * TOL, gaps


def test_a_second_output_with_another_denominator():
    """Two outputs: the coupled pair (a mean) and an auxiliary regression
    summed over the batch (another denominator: split_gradients' second
    backward pass goes through the cached outputs too)."""

    def build(wrapper=None, **settings):
        keras.utils.set_random_seed(1)
        inputs, pair = _towers()
        aux = keras.layers.Dense(1, name="aux")(pair)
        outputs = {"pair": pair, "aux": aux}
        if wrapper is None:
            return keras.Model(inputs, outputs)
        return wrapper(inputs=inputs, outputs=outputs, **settings)

    query, candidate, _, labels = batches()
    trained = []
    for model in (
        build(),
        build(GradientAccumulateModel, micro_batch_size=SLICE, gradient_cache=True),
    ):
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss={
                "pair": in_batch_softmax,
                "aux": keras.losses.MeanSquaredError(reduction="sum"),
            },
        )
        model.fit(
            [query, candidate],
            {"pair": labels, "aux": labels},
            batch_size=N,
            shuffle=False,
            verbose=0,
        )
        trained.append(model.get_weights())
    assert max_abs_diff(*trained) <= TOL


def test_global_negatives_under_a_loss_scale_are_refused():
    """ "global" gathers the replicas' outputs; under mixed_float16 a slice's
    overflow retry would run the gather's collective backward pass in a
    loop: refused at the first step, with the reason."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = two_towers(
            GradientAccumulateModel, micro_batch_size=SLICE, gradient_cache="global"
        )
        with pytest.raises(ValueError, match="mixed_float16"):
            fit_on_batches(model, in_batch_softmax, "sgd")
    finally:
        keras.mixed_precision.set_global_policy("float32")
