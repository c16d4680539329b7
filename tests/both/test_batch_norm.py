"""``AccumBatchNormalization`` and ``replace_batchnorm_layers``, in each
Keras: what their arguments and the layer's model refuse, and how they say
so; under MirroredStrategy, the layer's moving statistics pool every
replica's micro-batches. (The layer's statistics on one device per Keras:
tests/keras3/test_batch_norm.py, tests/keras2/test_batch_norm.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator import (
    AccumBatchNormalization,
    GradientAccumulateModel,
    GradientAccumulateOptimizer,
    replace_batchnorm_layers,
)
from tests import dist_utils
from tests.flavour import LEGACY_KERAS, keras, utils
from tests.utils import heterogeneous  # NumPy only


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"accum_steps": 0}, ValueError, "accum_steps"),
        ({"accum_steps": 2.5}, TypeError, "accum_steps"),
        ({"accum_steps": True}, TypeError, "accum_steps"),
        ({"axis": "last"}, TypeError, "axis"),
        ({"axis": 1.5}, TypeError, "axis"),
        ({"momentum": 1.5}, ValueError, "momentum"),
        ({"momentum": 2.0}, ValueError, "momentum"),
        ({"momentum": "high"}, TypeError, "momentum"),
        ({"epsilon": -1.0}, ValueError, "epsilon"),
        ({"epsilon": "small"}, TypeError, "epsilon"),
        ({"center": "yes"}, TypeError, "center"),
        ({"scale": 1}, TypeError, "scale"),
        ({"renorm": True}, ValueError, "renorm"),
        # tf-keras' layer has no synchronized mode, so refuses it; Keras 3's
        # takes a bool, so refuses anything else.
        ({"synchronized": True}, ValueError, "synchronized")
        if LEGACY_KERAS
        else ({"synchronized": None}, TypeError, "synchronized"),
    ],
)
def test_argument_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        AccumBatchNormalization(**kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"accum_steps": 0}, ValueError, "accum_steps"),
        ({"accum_steps": 2.0}, TypeError, "accum_steps"),
        ({"position": "after"}, ValueError, "position"),
    ],
)
def test_replace_validation(kwargs, error, match):
    model = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization()])
    with pytest.raises(error, match=match):
        replace_batchnorm_layers(model, **kwargs)


def test_explicit_accum_steps_must_match_the_model():
    inputs = keras.Input((3,))
    outputs = AccumBatchNormalization(accum_steps=3)(inputs)
    model = GradientAccumulateModel(accum_steps=2, inputs=inputs, outputs=outputs)
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"accum_steps=3.*accum_steps=2"):
        model.fit(
            np.ones((4, 3)), np.ones((4, 3)), batch_size=2, shuffle=False, verbose=0
        )


# --------------------------------------------------------- MirroredStrategy
ACCUM, GLOBAL_MICRO, CYCLES, EPOCHS, MOMENTUM = 4, 8, 2, 2, 0.5
STAT_TOL = 1e-5


def _moving_stats(layer) -> list[np.ndarray]:
    return [np.asarray(v) for v in (layer.moving_mean, layer.moving_variance)]


def _build(cls, synchronized=False, layer_steps=None, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    options = {"synchronized": True} if synchronized else {}
    norm = AccumBatchNormalization(
        accum_steps=layer_steps, momentum=MOMENTUM, **options
    )
    outputs = keras.layers.Dense(2)(norm(inputs))
    return cls(inputs=inputs, outputs=outputs, **kwargs)


def mirrored_batch_norm() -> dict:
    """``AccumBatchNormalization`` under MirroredStrategy over two logical
    CPUs (configured before TensorFlow starts): global micro-batches of 8
    (4 a replica), 4 a cycle, 2 cycles an epoch, 2 epochs, each micro-batch
    with its own per-channel mean and spread. Max differences of its moving
    statistics from Keras' ``BatchNormalization`` on the big batches (all
    micro-batches of all replicas), in the model wrapper and with the
    optimizer wrapper (the layer given ``accum_steps``); in Keras 3, also
    with ``synchronized=True``, and the weights of both model wrappers
    against one device that sees each global micro-batch whole (tf-keras'
    layer has no synchronized mode)."""
    x = heterogeneous(ACCUM * CYCLES, GLOBAL_MICRO, (4,))
    y = np.random.default_rng(1).normal(size=(len(x), 2)).astype("float32")
    reference = keras.layers.BatchNormalization(momentum=MOMENTUM)
    big = ACCUM * GLOBAL_MICRO
    for _ in range(EPOCHS):
        for start in range(0, len(x), big):
            reference(x[start : start + big], training=True)
    expected = _moving_stats(reference)

    strategy = tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    result = {"replicas": strategy.num_replicas_in_sync}

    def fit(model, optimizer):
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(
            x, y, batch_size=GLOBAL_MICRO, epochs=EPOCHS, shuffle=False, verbose=0
        )
        return model

    def stats_gap(model):
        return utils.max_abs_diff(_moving_stats(model.layers[1]), expected)

    trained = {}
    for name, synchronized in [("model", False)] + (
        [] if LEGACY_KERAS else [("model_synchronized", True)]
    ):
        with strategy.scope():
            model = _build(GradientAccumulateModel, synchronized, accum_steps=ACCUM)
            fit(model, keras.optimizers.SGD(0.1))
        trained[name] = model
        result[f"{name}_stats"] = stats_gap(model)

    with strategy.scope():
        model = _build(keras.Model, layer_steps=ACCUM)
        inner = keras.optimizers.SGD(0.1)
        fit(model, GradientAccumulateOptimizer(inner, accum_steps=ACCUM))
    result["optimizer_stats"] = stats_gap(model)

    if not LEGACY_KERAS:
        # One device, whole global micro-batches: what synchronized=True
        # computes.
        single = fit(
            _build(GradientAccumulateModel, accum_steps=ACCUM),
            keras.optimizers.SGD(0.1),
        )

        def weights_gap(model):
            return utils.max_abs_diff(utils.weights(model), utils.weights(single))

        result["model_synchronized_weights"] = weights_gap(
            trained["model_synchronized"]
        )
        result["model_local_vs_global_weights"] = weights_gap(trained["model"])
    return result


def test_mirrored_strategy_pools_every_replica():
    result = dist_utils.on_two_cpus(mirrored_batch_norm)
    assert result["replicas"] == 2
    names = ["model", "optimizer"] + ([] if LEGACY_KERAS else ["model_synchronized"])
    for name in names:
        utils.report(result[f"{name}_stats"], f"{name}: max |moving - big batch|")
        assert result[f"{name}_stats"] <= STAT_TOL, result
    if not LEGACY_KERAS:
        # synchronized=True normalises each step over both replicas' halves:
        # the weights are those of one device seeing the whole global
        # micro-batch; without it, each replica normalises its own half.
        for name in ("model_synchronized_weights", "model_local_vs_global_weights"):
            utils.report(result[name], name)
        assert result["model_synchronized_weights"] <= utils.ATOL, result
        assert result["model_local_vs_global_weights"] > 10 * utils.ATOL, result
