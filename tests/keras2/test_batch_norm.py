"""tf-keras AccumBatchNormalization: after each cycle its moving statistics
are those of tf-keras' BatchNormalization trained on the concatenated big
batch; mid-cycle they do not move; it saves like any tf-keras layer; and one
channels-last instance may be reused on inputs of different ranks, as 0.5.x
allowed. (Under MirroredStrategy, in either Keras: tests/both/test_batch_norm.py.)"""

import numpy as np
import pytest
import tf_keras

from gradient_accumulator import AccumBatchNormalization, GradientAccumulateModel

B, K = 8, 4
ATOL = 1e-5


def _data(shape, n=64, seed=0):
    rng = np.random.default_rng(seed)
    # An offset and scale far from the initial statistics, per channel.
    x = rng.normal(3.0, 2.0, size=(n, *shape)).astype("float32")
    return x, rng.normal(size=(n, 1)).astype("float32")


def _net(norm, shape):
    inputs = tf_keras.Input(shape)
    h = norm(tf_keras.layers.Dense(4)(inputs) if len(shape) == 1 else inputs)
    h = tf_keras.layers.Flatten()(h) if len(shape) > 1 else h
    return inputs, tf_keras.layers.Dense(1)(h)


def _statistics(model):
    (layer,) = [
        x for x in model.layers if isinstance(x, tf_keras.layers.BatchNormalization)
    ]
    return layer.moving_mean.numpy(), layer.moving_variance.numpy()


def _big_batch(shape, x, y, epochs=1):
    tf_keras.utils.set_random_seed(1)
    inputs, outputs = _net(tf_keras.layers.BatchNormalization(momentum=0.5), shape)
    model = tf_keras.Model(inputs, outputs)
    # A zero learning rate: the features the statistics see stay the same.
    model.compile(tf_keras.optimizers.SGD(0.0), "mse")
    model.fit(x, y, batch_size=B * K, epochs=epochs, shuffle=False, verbose=0)
    return _statistics(model)


def _accumulated(shape, **settings):
    tf_keras.utils.set_random_seed(1)
    inputs, outputs = _net(AccumBatchNormalization(momentum=0.5), shape)
    model = GradientAccumulateModel(
        accum_steps=K, inputs=inputs, outputs=outputs, **settings
    )
    model.compile(tf_keras.optimizers.SGD(0.0), "mse")
    return model


@pytest.mark.parametrize("shape", [(6,), (5, 5, 3)], ids=["dense", "conv"])
def test_moving_statistics_equal_tf_keras_on_the_big_batch(shape):
    x, y = _data(shape)
    model = _accumulated(shape)
    model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    want = _big_batch(shape, x, y, epochs=2)
    for got, expected in zip(_statistics(model), want):
        np.testing.assert_allclose(got, expected, atol=ATOL, rtol=1e-5)
    # The statistics moved far from their initial values (0 and 1).
    assert np.abs(want[0]).min() > 1.0


def test_fit_stopped_mid_cycle_leaves_moving_statistics_alone():
    x, y = _data((6,))
    model = _accumulated((6,), flush_at_end=False)
    before = _statistics(model)
    model.fit(x[: B * 3], y[: B * 3], batch_size=B, shuffle=False, verbose=0)
    for got, want in zip(_statistics(model), before):
        np.testing.assert_array_equal(got, want)
    model.fit(x[B * 3 : B * 4], y[B * 3 : B * 4], batch_size=B, verbose=0)
    want = _big_batch((6,), x[: B * K], y[: B * K])
    for got, expected in zip(_statistics(model), want):
        np.testing.assert_allclose(got, expected, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("path", ["m.keras", "m.h5"])
def test_saves_and_loads_without_custom_objects(path, tmp_path):
    x, y = _data((6,))
    model = _accumulated((6,))
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    model.save(tmp_path / path)
    loaded = tf_keras.models.load_model(tmp_path / path)
    layer = [x for x in loaded.layers if isinstance(x, AccumBatchNormalization)]
    assert len(layer) == 1 and layer[0].momentum == 0.5
    np.testing.assert_array_equal(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0)
    )


def test_inference_is_tf_keras_batch_normalization():
    x, _ = _data((5, 5, 3))
    ours = AccumBatchNormalization(momentum=0.5)
    theirs = tf_keras.layers.BatchNormalization(momentum=0.5)
    ours.build(x.shape)
    theirs.build(x.shape)
    rng = np.random.default_rng(3)
    for name in ("gamma", "beta", "moving_mean", "moving_variance"):
        value = rng.uniform(0.5, 2.0, size=(3,)).astype("float32")
        getattr(ours, name).assign(value)
        getattr(theirs, name).assign(value)
    np.testing.assert_allclose(
        ours(x, training=False), theirs(x, training=False), atol=1e-6
    )


def test_one_layer_after_a_conv2d_and_after_a_dense_as_0_5_allowed():
    """0.5.x's layer was reused on a Conv2D's and a Dense's outputs with the
    same number of channels; it trains, and its statistics pool both."""
    norm = AccumBatchNormalization()
    inputs = tf_keras.Input((6, 6, 1))
    conv = norm(tf_keras.layers.Conv2D(4, 3)(inputs))
    dense = norm(tf_keras.layers.Dense(4)(tf_keras.layers.Flatten()(conv)))
    model = GradientAccumulateModel(
        accum_steps=2, inputs=inputs, outputs=tf_keras.layers.Dense(1)(dense)
    )
    model.compile("sgd", "mse")
    x = np.random.default_rng(0).normal(size=(16, 6, 6, 1)).astype("float32")
    model.fit(x, np.ones((16, 1), "float32"), batch_size=4, verbose=0)
    assert int(model.optimizer.iterations) == 2
    mean, variance = norm.moving_mean.numpy(), norm.moving_variance.numpy()
    assert np.all(np.isfinite(mean)) and np.any(mean != 0)
    assert np.all(variance > 0)
