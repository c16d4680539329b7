"""gradient-accumulator 0.5.2's own test suite, run on legacy Keras 2.

Ported from https://github.com/andreped/GradientAccumulator, tag ``v0.5.2``
(commit d3fce336879cedb52e4fefaf32850c0aec714aac; its ``tests/`` directory is
unchanged up to that repository's last commit, 033aeda8). That code is
Copyright (c) 2021 André Pedersen, under the MIT License:

    Permission is hereby granted, free of charge, to any person obtaining a
    copy of this software and associated documentation files (the
    "Software"), to deal in the Software without restriction, including
    without limitation the rights to use, copy, modify, merge, publish,
    distribute, sublicense, and/or sell copies of the Software, and to permit
    persons to whom the Software is furnished to do so, subject to the
    following conditions: The above copyright notice and this permission
    notice shall be included in all copies or substantial portions of the
    Software. THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND,
    EXPRESS OR IMPLIED.

0.5.x code must run unchanged on TensorFlow 2.16+ with tf-keras
(``TF_USE_LEGACY_KERAS=1``, so ``tf.keras`` is Keras 2): these are its tests,
written against ``tf.keras`` and the 0.5.x import paths, with their bodies
kept as they were. What changed, and only that:

* Data: ``tfds.load`` is ``tests/keras2/data05.py``'s local stand-in (the
  8x8 digits of scikit-learn for MNIST, generated letters for IMDb); shapes
  written ``(28, 28)`` are ``(8, 8)``, MobileNetV2 gets ``weights=None``
  instead of downloading ImageNet weights, and test_swap_layer trains a
  small stand-in (MobileNetV2Small) instead of it; test_multitask takes 512
  images instead of 1,024. Nothing downloads.
* Runner glue: the 15 modules are one file, so each module's
  ``run_experiment`` carries the module's name and two clashing test names
  are renamed (each test's docstring names its original); the 0.5.2 suite
  ran each module in its own pytest process, so ``reset`` tolerates the
  thread settings it can no longer make once TensorFlow has started; models
  are saved in a temporary directory (each test runs in one); a fixture
  restores the float32 policy that the mixed-precision tests set, which the
  0.5.2 suite isolated with ``multiprocessing`` instead.
* Assertions: where a 0.5.2 test asserted nothing, it now asserts what its
  name promises (marked "Added:"); the 0.5.2 assertions are unchanged.
* Coverage added: test_bn_conv2d/3d (one AccumBatchNormalization reused
  after a convolution and a Dense layer) also run inside the model wrapper
  (accum_steps=4, besides 0.5.2's 1); test_swap_layer_mobilenet_v2 swaps the
  real MobileNetV2; test_mp_batch_norm_mixed_precision passes on the
  ``mixed_precision`` flag that 0.5.2's wrapper dropped (see there).
"""

# 0.5.2's bodies as they were: its long comments, unused imports and names.
# ruff: noqa: E501, F401, RUF059

from __future__ import annotations

import os
import random as python_random
import warnings

import numpy as np
import pytest
import tensorflow as tf
from tf_keras.src import backend as tf_keras_backend

# (Not tf.keras.__name__: once ``tensorflow.keras`` is imported, it is that.)
if not tf.keras.Model.__module__.startswith("tf_keras"):
    pytest.skip("needs TF_USE_LEGACY_KERAS=1 (tf-keras)", allow_module_level=True)

from tensorflow.keras import mixed_precision
from tensorflow.keras.layers import (
    Activation,
    Conv2D,
    Dense,
    Embedding,
    Flatten,
    Input,
    MaxPooling2D,
    UpSampling2D,
)
from tensorflow.keras.models import Model, Sequential, load_model
from tensorflow.keras.preprocessing.sequence import pad_sequences
from tensorflow.keras.preprocessing.text import one_hot

from gradient_accumulator import (
    GradientAccumulateModel,
    GradientAccumulateOptimizer,
    unitwise_norm,
)

with warnings.catch_warnings():
    # The 0.5.x paths are deprecated (they still work: that is the point).
    warnings.simplefilter("ignore", DeprecationWarning)
    from gradient_accumulator.layers import AccumBatchNormalization
    from gradient_accumulator.utils import replace_batchnorm_layers

from tests.keras2 import data05 as tfds  # local data, in place of downloads

# get current tf minor version
tf_version = int(tf.version.VERSION.split(".")[1])


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Runs each test in its own directory (the 0.5.2 bodies save to
    ``./trained_model``), seeded, and restores the float32 policy afterwards."""
    monkeypatch.chdir(tmp_path)
    mixed_precision.set_global_policy("float32")
    # 0.5.2 ran each test module in a fresh process, where tf-keras' seed
    # generator is unset and reset()'s tf.random.set_seed decides initial
    # weights; an earlier test's tf_keras.utils.set_random_seed leaves it set,
    # advancing with every initializer, so two runs after reset() would
    # start apart. Back to the fresh process's state:
    monkeypatch.setattr(
        tf_keras_backend._SEED_GENERATOR, "generator", None, raising=False
    )
    # The tests that do not call reset() ran without a seed in 0.5.2; with
    # op determinism on (tests/keras2/conftest.py) a random op needs one.
    tf.random.set_seed(0)
    yield
    mixed_precision.set_global_policy("float32")
    tf.keras.backend.clear_session()


def _finite(values) -> bool:
    """Added: every number in ``values`` (a list of arrays or numbers) is finite."""
    return all(np.isfinite(np.asarray(v)).all() for v in values)


def _changed(before, after) -> bool:
    """Added: training moved at least one weight."""
    return any(not np.array_equal(b, a) for b, a in zip(before, after, strict=True))


# ===================================================== 0.5.2 tests/utils.py
def reset(seed=123):
    # set tf log level
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"

    # disable GPU
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"

    # clear keras session
    tf.keras.backend.clear_session()

    os.environ["PYTHONHASHSEED"] = str(seed)

    # The below is necessary for starting Numpy generated random numbers
    # in a well-defined initial state.
    np.random.seed(seed)

    # The below is necessary for starting core Python generated random numbers
    # in a well-defined state.
    python_random.seed(seed)

    # The below set_seed() will make random number generation
    # in the TensorFlow backend have a well-defined initial state.
    # For further details, see:
    # https://www.tensorflow.org/api_docs/python/tf/random/set_seed
    # @TODO: Should this seed be different than for python and numpy?
    tf.random.set_seed(seed)

    # https://stackoverflow.com/a/71311207
    try:
        tf.config.experimental.enable_op_determinism()  # Exist only for TF > 2.7
    except AttributeError as e:
        print(e)

    # force cpu threading determinism
    # https://stackoverflow.com/questions/36288235/how-to-get-stable-results-with-tensorflow-setting-random-seed
    # Port: 0.5.2 ran each test module in a fresh process; in one process
    # TensorFlow refuses these once it has started (determinism comes from
    # enable_op_determinism above).
    try:
        tf.config.threading.set_inter_op_parallelism_threads(1)
        tf.config.threading.set_intra_op_parallelism_threads(1)
    except RuntimeError:
        pass


def get_opt(opt_name, tf_version=None):
    if tf_version is None:
        tf_version = int(tf.version.VERSION.split(".")[1])
    if opt_name == "adam":
        if tf_version > 10:
            curr_opt = tf.keras.optimizers.legacy.Adam(learning_rate=1e-3)
        else:
            curr_opt = tf.keras.optimizers.Adam(learning_rate=1e-3)
    elif opt_name == "adadelta":
        if tf_version > 10:
            curr_opt = tf.keras.optimizers.legacy.Adadelta(learning_rate=1e-2)
        else:
            curr_opt = tf.keras.optimizers.Adadelta(learning_rate=1e-2)
    elif opt_name == "RMSprop":
        if tf_version > 10:
            curr_opt = tf.keras.optimizers.legacy.RMSprop(learning_rate=1e-3)
        else:
            curr_opt = tf.keras.optimizers.RMSprop(learning_rate=1e-3)
    elif opt_name == "SGD":
        if tf_version > 10:
            curr_opt = tf.keras.optimizers.legacy.SGD(learning_rate=1e-2)
        else:
            curr_opt = tf.keras.optimizers.SGD(learning_rate=1e-2)
    else:
        raise ValueError("Unknown optimizer chosen.")

    return curr_opt


def normalize_img(image, label):
    """Normalizes images: `uint8` -> `float32`."""
    return tf.cast(image, tf.float32) / 255.0, label


def gray2rgb(image, label):
    """Converts images from gray to RGB."""
    return tf.concat([image, image, image], axis=-1), label


def resizeImage(image, label, output_shape=(32, 32)):
    """Resizes images."""
    return tf.image.resize(image, output_shape, method="nearest"), label


def run_experiment(bs=50, accum_steps=2, epochs=1, modeloropt="opt"):
    # load dataset
    (ds_train, ds_test), ds_info = tfds.load(
        "mnist",
        split=["train", "test"],
        shuffle_files=True,
        as_supervised=True,
        with_info=True,
    )

    # build train pipeline
    ds_train = ds_train.map(normalize_img)
    ds_train = ds_train.batch(bs)
    ds_train = ds_train.prefetch(1)

    # build test pipeline
    ds_test = ds_test.map(normalize_img)
    ds_test = ds_test.batch(bs)
    ds_test = ds_test.prefetch(1)

    # create model
    input = tf.keras.layers.Input(shape=(8, 8))
    x = tf.keras.layers.Flatten(input_shape=(8, 8))(input)
    x = tf.keras.layers.Dense(128, activation="relu")(x)
    output = tf.keras.layers.Dense(10)(x)

    opt = get_opt(opt_name="SGD", tf_version=tf_version)

    if accum_steps == 1:
        model = tf.keras.Model(inputs=input, outputs=output)
    else:
        if modeloropt == "model":
            # wrap model to use gradient accumulation
            model = GradientAccumulateModel(
                accum_steps=accum_steps, inputs=input, outputs=output
            )
        else:
            # wrap optimizer to use gradient accumulation
            opt = GradientAccumulateOptimizer(opt, accum_steps=accum_steps)

            # compile model
            model = tf.keras.Model(inputs=input, outputs=output)

    # compile model
    model.compile(
        optimizer=opt,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[tf.keras.metrics.SparseCategoricalAccuracy()],
    )

    # train model
    model.fit(
        ds_train,
        epochs=epochs,
        validation_data=ds_test,
    )

    model.save("./trained_model")

    # load trained model and test
    del model
    trained_model = load_model("./trained_model", compile=True)

    result = trained_model.evaluate(ds_test, verbose=1)
    print(result)

    return result[1]


# ===================================== 0.5.2 tests/test_adaptive_gradient_clipping.py
def test_unitwise_norm():
    """0.5.2 tests/test_adaptive_gradient_clipping.py::test_unitwise_norm."""
    for i in range(7):
        x = tf.zeros(
            [
                1,
            ]
            * i
        )
        try:
            unitwise_norm(x)
        except ValueError as e:
            # i=6 should yield ValueError. If it happens otherwise, raise error
            if i != 6:
                raise e


def test_train_mnist():
    """0.5.2 tests/test_adaptive_gradient_clipping.py::test_train_mnist (AGC
    in the model wrapper)."""
    # load dataset
    (ds_train, ds_test), ds_info = tfds.load(
        "mnist",
        split=["train", "test"],
        shuffle_files=True,
        as_supervised=True,
        with_info=True,
    )

    # NOTE: On GPUs, ensure most tensor dimensions are a multiple
    # of 8 to maximize performance

    # build train pipeline
    ds_train = ds_train.map(normalize_img)
    ds_train = ds_train.cache()
    ds_train = ds_train.shuffle(ds_info.splits["train"].num_examples)
    ds_train = ds_train.batch(100)  # multiplum of 8
    ds_train = ds_train.prefetch(1)

    # build test pipeline
    ds_test = ds_test.map(normalize_img)
    ds_test = ds_test.batch(100)
    ds_test = ds_test.cache()
    ds_test = ds_test.prefetch(1)

    # create model
    model = tf.keras.models.Sequential(
        [
            tf.keras.layers.Flatten(input_shape=(8, 8)),
            tf.keras.layers.Dense(32, activation="relu"),  # 32 multiplum of 8
            tf.keras.layers.Dense(
                10, dtype="float32"
            ),  # output not numerically stable with float16
        ]
    )

    # wrap model to use gradient accumulation
    model = GradientAccumulateModel(
        accum_steps=4,
        mixed_precision=False,
        use_agc=True,
        inputs=model.input,
        outputs=model.output,
    )

    # need to scale optimizer for mixed precision
    opt = tf.keras.optimizers.SGD(1e-2)

    # compile model
    model.compile(
        optimizer=opt,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[tf.keras.metrics.SparseCategoricalAccuracy()],
    )

    before = model.get_weights()  # Added

    # train model
    model.fit(
        ds_train,
        epochs=1,
        validation_data=ds_test,
    )

    model.save("./trained_model")

    # load trained model and test
    del model
    trained_model = load_model("./trained_model", compile=True)

    result = trained_model.evaluate(ds_test, verbose=1)
    print(result)

    # Added: it trained, to finite weights and metrics.
    after = trained_model.get_weights()
    assert _finite(result) and _finite(after), result
    assert _changed(before, after)


# ====================================================== 0.5.2 tests/test_batch_norm.py
def run_experiment_batch_norm(
    custom_bn: bool = True, bs: int = 100, accum_steps: int = 1, epochs: int = 3
):
    # load dataset
    (ds_train, ds_test), ds_info = tfds.load(
        "mnist",
        split=["train", "test"],
        shuffle_files=True,
        as_supervised=True,
        with_info=True,
    )

    # build train pipeline
    ds_train = ds_train.map(normalize_img)
    ds_train = ds_train.shuffle(ds_info.splits["train"].num_examples)
    ds_train = ds_train.batch(bs)
    ds_train = ds_train.prefetch(1)

    # build test pipeline
    ds_test = ds_test.map(normalize_img)
    ds_test = ds_test.batch(bs)
    ds_test = ds_test.prefetch(1)

    # define which normalization layer to use in network
    if custom_bn:
        normalization_layer = AccumBatchNormalization(accum_steps=accum_steps)
    elif not custom_bn:
        normalization_layer = tf.keras.layers.BatchNormalization()
    else:
        normalization_layer = tf.keras.layers.Activation("linear")

    # create model
    model = tf.keras.models.Sequential(
        [
            tf.keras.layers.Flatten(input_shape=(8, 8)),
            tf.keras.layers.Dense(32),
            normalization_layer,  # @TODO: BN before or after ReLU? Leads to different performance
            tf.keras.layers.Activation("relu"),
            tf.keras.layers.Dense(10),
        ]
    )

    # wrap model to use gradient accumulation
    if accum_steps > 1:
        model = GradientAccumulateModel(
            accum_steps=accum_steps, inputs=model.input, outputs=model.output
        )

    # compile model
    model.compile(
        optimizer=tf.keras.optimizers.SGD(1e-2),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[tf.keras.metrics.SparseCategoricalAccuracy()],
    )

    # train model
    model.fit(
        ds_train,
        epochs=epochs,
        validation_data=ds_test,
    )

    model.save("./trained_model")

    # load trained model and test
    del model
    trained_model = load_model("./trained_model", compile=True)

    result = trained_model.evaluate(ds_test, verbose=1)
    print(result)
    return result


def test_compare_bn_layers():
    """0.5.2 tests/test_batch_norm.py::test_compare_bn_layers."""
    # set seed
    reset()

    # custom BN without accum
    result1 = run_experiment_batch_norm(custom_bn=True, accum_steps=1, epochs=3)[1]

    # reset before second run to get "identical" results
    reset()

    # keras BN without accum
    result2 = run_experiment_batch_norm(custom_bn=False, accum_steps=1, epochs=3)[1]

    print(result1, result2)

    # results should be *identical* for accum_steps=1
    assert result1 == result2


def test_compare_accum_bn_expected_result():
    """0.5.2 tests/test_batch_norm.py::test_compare_accum_bn_expected_result."""
    # set seed
    reset()

    # custom BN without accum
    result1 = run_experiment_batch_norm(custom_bn=True, accum_steps=4, bs=25)[1]

    # reset before second run to get "identical" results
    reset()

    # keras BN without accum
    result2 = run_experiment_batch_norm(custom_bn=True, accum_steps=1, bs=100)[1]

    print(result1, result2)

    np.testing.assert_almost_equal(result1, result2, decimal=2)
    # assert result1 == result2


# ======================================================= 0.5.2 tests/test_bn_convnd.py
# The two 0.5.2 tests, whose keyword defaults (accum_steps=1) pytest used,
# are run_* functions here; the tests call them with those defaults and also
# with accum_steps=4 (the model wrapper), and check what they return.
def run_bn_conv2d(custom_bn: bool = True, accum_steps: int = 1, epochs: int = 1):
    # make toy dataset
    data = np.random.randint(2, size=(16, 8, 8, 1))
    gt = np.expand_dims(np.random.randint(2, size=16), axis=-1)

    # define which normalization layer to use in network
    if custom_bn:
        normalization_layer = AccumBatchNormalization(accum_steps=accum_steps)
    elif not custom_bn:
        normalization_layer = tf.keras.layers.BatchNormalization()
    else:
        normalization_layer = tf.keras.layers.Activation("linear")

    # create model
    model = tf.keras.models.Sequential(
        [
            tf.keras.layers.Conv2D(4, 3, input_shape=(8, 8, 1)),
            normalization_layer,
            tf.keras.layers.Activation("relu"),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(4),
            normalization_layer,  # @TODO: BN before or after ReLU? Leads to different performance
            tf.keras.layers.Activation("relu"),
            tf.keras.layers.Dense(1, activation="sigmoid"),
        ]
    )

    # wrap model to use gradient accumulation
    if accum_steps > 1:
        model = GradientAccumulateModel(
            accum_steps=accum_steps, inputs=model.input, outputs=model.output
        )

    # compile model
    model.compile(
        optimizer=tf.keras.optimizers.SGD(1e-2),
        loss=tf.keras.losses.BinaryCrossentropy(),
        metrics=["acc"],
    )

    # train model
    model.fit(
        data,
        gt,
        batch_size=1,
        epochs=epochs,
    )

    model.save("./trained_model")

    # load trained model and test
    del model
    trained_model = load_model("./trained_model", compile=True)

    result = trained_model.evaluate(data, gt, batch_size=1, verbose=1)
    print(result)
    return result, trained_model  # Port: the model too, for the added checks


def run_bn_conv3d(custom_bn: bool = True, accum_steps: int = 1, epochs: int = 1):
    # make toy dataset
    data = np.random.randint(2, size=(16, 8, 8, 8, 1))
    gt = np.expand_dims(np.random.randint(2, size=16), axis=-1)

    # define which normalization layer to use in network
    if custom_bn:
        normalization_layer = AccumBatchNormalization(accum_steps=accum_steps)
    elif not custom_bn:
        normalization_layer = tf.keras.layers.BatchNormalization()
    else:
        normalization_layer = tf.keras.layers.Activation("linear")

    # create model
    model = tf.keras.models.Sequential(
        [
            tf.keras.layers.Conv3D(4, 3, input_shape=(8, 8, 8, 1)),
            normalization_layer,
            tf.keras.layers.Activation("relu"),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(4),
            normalization_layer,  # @TODO: BN before or after ReLU? Leads to different performance
            tf.keras.layers.Activation("relu"),
            tf.keras.layers.Dense(1, activation="sigmoid"),
        ]
    )

    # wrap model to use gradient accumulation
    if accum_steps > 1:
        model = GradientAccumulateModel(
            accum_steps=accum_steps, inputs=model.input, outputs=model.output
        )

    # compile model
    model.compile(
        optimizer=tf.keras.optimizers.SGD(1e-2),
        loss=tf.keras.losses.BinaryCrossentropy(),
        metrics=["acc"],
    )

    # train model
    model.fit(
        data,
        gt,
        batch_size=1,
        epochs=epochs,
    )

    model.save("./trained_model")

    # load trained model and test
    del model
    trained_model = load_model("./trained_model", compile=True)

    result = trained_model.evaluate(data, gt, batch_size=1, verbose=1)
    print(result)
    return result, trained_model  # Port: the model too, for the added checks


def _check_shared_bn(result, trained_model):
    """Added: one AccumBatchNormalization instance serves both call sites
    (after the convolution and after the Dense layer), and the model trained
    to finite statistics, weights and metrics."""
    layers = [
        layer for layer in trained_model.layers if "batch_normalization" in layer.name
    ]
    assert len(layers) == 1, [layer.name for layer in trained_model.layers]
    assert _finite(result) and _finite(trained_model.get_weights()), result


@pytest.mark.parametrize("accum_steps", [1, 4])
def test_bn_conv2d(accum_steps):
    """0.5.2 tests/test_bn_convnd.py::test_bn_conv2d (0.5.2 ran accum_steps=1
    only): one AccumBatchNormalization reused after Conv2D and Dense."""
    _check_shared_bn(*run_bn_conv2d(accum_steps=accum_steps))


@pytest.mark.parametrize("accum_steps", [1, 4])
def test_bn_conv3d(accum_steps):
    """0.5.2 tests/test_bn_convnd.py::test_bn_conv3d (0.5.2 ran accum_steps=1
    only): one AccumBatchNormalization reused after Conv3D and Dense."""
    _check_shared_bn(*run_bn_conv3d(accum_steps=accum_steps))


# ============================================== 0.5.2 tests/test_bn_pretrained_swap.py
def MobileNetV2Small(input_shape=(32, 32, 3), include_top=False):
    """Port: a small stand-in for ``tf.keras.applications.MobileNetV2(
    input_shape=(32, 32, 3), weights="imagenet", include_top=False)``, whose
    training, SavedModel export and reload took about a minute on two cores:
    MobileNetV2's blocks (convolution, BatchNormalization, ReLU6; inverted
    residuals with depthwise convolutions, with and without the residual
    ``Add``) down to the same 1x1 feature map, with 11 BatchNormalization
    layers instead of 52. (The real network's swap is checked by
    test_swap_layer_mobilenet_v2 below.)"""
    layers = tf.keras.layers
    assert not include_top

    def conv_bn(x, filters, kernel=1, strides=1, relu=True):
        x = layers.Conv2D(filters, kernel, strides, padding="same", use_bias=False)(x)
        x = layers.BatchNormalization(momentum=0.999)(x)
        return layers.ReLU(6.0)(x) if relu else x

    def inverted_residual(x, expansion, filters, strides):
        h = conv_bn(x, expansion * x.shape[-1])
        h = layers.DepthwiseConv2D(3, strides, padding="same", use_bias=False)(h)
        h = layers.ReLU(6.0)(layers.BatchNormalization(momentum=0.999)(h))
        h = conv_bn(h, filters, relu=False)
        if strides == 1 and x.shape[-1] == filters:
            h = layers.Add()([x, h])
        return h

    inputs = layers.Input(shape=input_shape)
    x = conv_bn(inputs, 8, kernel=3, strides=2)  # 16x16
    x = inverted_residual(x, 1, 8, 1)  # with the residual Add
    x = inverted_residual(x, 2, 8, 4)  # 4x4
    x = inverted_residual(x, 2, 8, 1)  # with the residual Add
    x = conv_bn(x, 16, kernel=3, strides=4)  # 1x1, as MobileNetV2 at 32x32
    return tf.keras.Model(inputs, x, name="mobilenetv2_small")


def _check_swap(original, swapped, probe):
    """Added: every BatchNormalization of ``original`` became an
    AccumBatchNormalization in ``swapped``, none is left, and the rebuilt
    graph computes what the original did."""

    def count(model, cls):
        return sum(isinstance(layer, cls) for layer in model.layers)

    n_bn = count(original, tf.keras.layers.BatchNormalization)
    assert n_bn > 0
    assert count(swapped, AccumBatchNormalization) == n_bn
    assert not any(
        isinstance(layer, tf.keras.layers.BatchNormalization)
        and not isinstance(layer, AccumBatchNormalization)
        for layer in swapped.layers
    )
    np.testing.assert_allclose(
        swapped(probe, training=False),
        original(probe, training=False),
        rtol=1e-5,
        atol=1e-5,
    )


def test_swap_layer(
    custom_bn: bool = True, bs: int = 100, accum_steps: int = 1, epochs: int = 1
):
    """0.5.2 tests/test_bn_pretrained_swap.py::test_swap_layer."""
    # load dataset
    (ds_train, ds_test), ds_info = tfds.load(
        "mnist",
        split=["train", "test"],
        shuffle_files=True,
        as_supervised=True,
        with_info=True,
    )

    # build train pipeline
    ds_train = ds_train.map(normalize_img)
    ds_train = ds_train.map(gray2rgb)
    ds_train = ds_train.map(resizeImage)
    ds_train = ds_train.shuffle(ds_info.splits["train"].num_examples)
    ds_train = ds_train.batch(bs)
    ds_train = ds_train.prefetch(1)

    # build test pipeline
    ds_test = ds_test.map(normalize_img)
    ds_test = ds_test.map(gray2rgb)
    ds_test = ds_test.map(resizeImage)
    ds_test = ds_test.batch(bs)
    ds_test = ds_test.prefetch(1)

    # create model
    base_model = MobileNetV2Small(input_shape=(32, 32, 3), include_top=False)
    original = base_model  # Added
    base_model = replace_batchnorm_layers(base_model, accum_steps=accum_steps)
    _check_swap(original, base_model, next(iter(ds_test))[0][:8])  # Added

    input_ = tf.keras.layers.Input(shape=(32, 32, 3))
    x = base_model(input_)
    x = tf.keras.layers.Dense(10, activation="softmax")(x)
    model = tf.keras.Model(inputs=input_, outputs=x)

    # wrap model to use gradient accumulation
    if accum_steps > 1:
        model = GradientAccumulateModel(
            accum_steps=accum_steps, inputs=model.input, outputs=model.output
        )

    # compile model
    model.compile(
        optimizer=tf.keras.optimizers.SGD(1e-2),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[tf.keras.metrics.SparseCategoricalAccuracy()],
    )

    # train model
    model.fit(
        ds_train,
        epochs=epochs,
        validation_data=ds_test,
        steps_per_epoch=4,
        validation_steps=4,
    )

    model.save("./trained_model")

    # load trained model and test
    del model
    trained_model = load_model("./trained_model", compile=True)

    result = trained_model.evaluate(ds_test, verbose=1)
    print(result)
    # Added (0.5.2 returned the result, which pytest ignored):
    assert _finite(result) and _finite(trained_model.get_weights()), result


def test_swap_layer_mobilenet_v2():
    """Added beside test_swap_layer: the swap of the real MobileNetV2 (no
    weights downloaded, no training: see MobileNetV2Small)."""
    base_model = tf.keras.applications.MobileNetV2(
        input_shape=(32, 32, 3), weights=None, include_top=False
    )
    swapped = replace_batchnorm_layers(base_model, accum_steps=4)
    probe = np.random.default_rng(0).uniform(size=(4, 32, 32, 3)).astype("float32")
    _check_swap(base_model, swapped, probe)


# ================================================= 0.5.2 tests/test_expected_result.py
def run_experiment_expected_result(bs=50, accum_steps=2, epochs=1, modeloropt="opt"):
    # load dataset
    (ds_train, ds_test), ds_info = tfds.load(
        "mnist",
        split=["train", "test"],
        shuffle_files=True,
        as_supervised=True,
        with_info=True,
    )

    # build train pipeline
    ds_train = ds_train.map(normalize_img)
    ds_train = ds_train.batch(bs)
    ds_train = ds_train.prefetch(1)

    # build test pipeline
    ds_test = ds_test.map(normalize_img)
    ds_test = ds_test.batch(bs)
    ds_test = ds_test.prefetch(1)

    # create model
    input = tf.keras.layers.Input(shape=(8, 8))
    x = tf.keras.layers.Flatten(input_shape=(8, 8))(input)
    x = tf.keras.layers.Dense(128, activation="relu")(x)
    output = tf.keras.layers.Dense(10)(x)

    opt = get_opt(opt_name="SGD", tf_version=tf_version)

    if accum_steps == 1:
        model = tf.keras.Model(inputs=input, outputs=output)
    else:
        if modeloropt == "model":
            # wrap model to use gradient accumulation
            model = GradientAccumulateModel(
                accum_steps=accum_steps, inputs=input, outputs=output
            )
        else:
            # wrap optimizer to use gradient accumulation
            opt = GradientAccumulateOptimizer(opt, accum_steps=accum_steps)

            # compile model
            model = tf.keras.Model(inputs=input, outputs=output)

    # compile model
    model.compile(
        optimizer=opt,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[tf.keras.metrics.SparseCategoricalAccuracy()],
    )

    # train model
    model.fit(
        ds_train,
        epochs=epochs,
        validation_data=ds_test,
    )

    model.save("./trained_model")

    # load trained model and test
    del model
    trained_model = load_model("./trained_model", compile=True)

    result = trained_model.evaluate(ds_test, verbose=1)
    print(result)

    return result[1]


def test_expected_result():
    """0.5.2 tests/test_expected_result.py::test_expected_result."""
    # set seed
    reset()

    # run once
    result1 = run_experiment_expected_result(
        bs=100, accum_steps=1, epochs=2, modeloropt="opt"
    )

    # reset before second run to get identical results
    reset()

    # run again with different batch size and number of accumulations
    result2 = run_experiment_expected_result(
        bs=50, accum_steps=2, epochs=2, modeloropt="opt"
    )

    # reset again
    reset()

    # test with model wrapper instead
    result3 = run_experiment_expected_result(
        bs=50, accum_steps=2, epochs=2, modeloropt="model"
    )

    # results should be identical (theoretically, even in practice on CPU)
    if tf_version <= 6:
        # approximation poorer as enable_op_determinism() not available for tf < 2.7
        np.testing.assert_almost_equal(result1, result2, decimal=4)
        np.testing.assert_almost_equal(result2, result3, decimal=4)
    elif tf_version > 10:
        # approximation worse for tf >= 2.11
        np.testing.assert_almost_equal(result1, result2, decimal=2)
        np.testing.assert_almost_equal(result2, result3, decimal=2)
    else:
        assert result1 == result2
        assert result2 == result3


# ================================================= 0.5.2 tests/test_mixed_precision.py
def run_experiment_mixed_precision():
    # Port: 0.5.2 ran this in a spawned process (ignoring its exit code);
    # here it runs in the test's process and the _isolated fixture restores
    # the float32 policy. It returns the result and model for the added checks.

    # disable GPU
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"

    # set mixed global precision policy
    mixed_precision.set_global_policy("mixed_float16")

    # load dataset
    (ds_train, ds_test), ds_info = tfds.load(
        "mnist",
        split=["train", "test"],
        shuffle_files=True,
        as_supervised=True,
        with_info=True,
    )

    # build train pipeline
    ds_train = ds_train.map(normalize_img)
    ds_train = ds_train.cache()
    ds_train = ds_train.shuffle(ds_info.splits["train"].num_examples)
    ds_train = ds_train.batch(32)  # multiplum of 8 on GPU to maximize performance
    ds_train = ds_train.prefetch(1)

    # build test pipeline
    ds_test = ds_test.map(normalize_img)
    ds_test = ds_test.batch(32)
    ds_test = ds_test.cache()
    ds_test = ds_test.prefetch(1)

    # create model
    model = tf.keras.models.Sequential(
        [
            tf.keras.layers.Flatten(input_shape=(8, 8)),
            tf.keras.layers.Dense(32, activation="relu"),  # 32 multiplum of 8
            tf.keras.layers.Dense(
                10, dtype="float32"
            ),  # output not numerically stable with float16
        ]
    )

    # wrap model to use gradient accumulation
    model = GradientAccumulateModel(
        accum_steps=4,
        mixed_precision=True,
        inputs=model.input,
        outputs=model.output,
    )

    # need to scale optimizer for mixed precision
    opt = tf.keras.optimizers.Adam(1e-3)
    opt = mixed_precision.LossScaleOptimizer(opt)

    # compile model
    model.compile(
        optimizer=opt,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[tf.keras.metrics.SparseCategoricalAccuracy()],
    )

    before = model.get_weights()  # Added

    # train model
    model.fit(
        ds_train,
        epochs=1,
        validation_data=ds_test,
    )

    # save model on disk
    model.save("./trained_model")

    # load trained model and test
    del model
    trained_model = tf.keras.models.load_model("./trained_model", compile=True)

    result = trained_model.evaluate(ds_test, verbose=1)
    print(result)
    return result, before, trained_model


def test_mixed_precision():
    """0.5.2 tests/test_mixed_precision.py::test_mixed_precision."""
    result, before, trained_model = run_experiment_mixed_precision()
    # Added: it trained in float16 compute, to finite weights and metrics.
    hidden = next(layer for layer in trained_model.layers if layer.weights)
    assert hidden.compute_dtype == "float16", hidden.compute_dtype
    after = trained_model.get_weights()
    assert _finite(result) and _finite(after), result
    assert _changed(before, after)


# ================================================ 0.5.2 tests/test_model_distribute.py
def test_model_distribute():
    """0.5.2 tests/test_model_distribute.py::test_model_distribute."""
    strategy = tf.distribute.MirroredStrategy()

    # load dataset
    (ds_train, ds_test), ds_info = tfds.load(
        "mnist",
        split=["train", "test"],
        shuffle_files=True,
        as_supervised=True,
        with_info=True,
    )

    # build train pipeline
    ds_train = ds_train.shuffle(ds_info.splits["train"].num_examples)
    ds_train = ds_train.batch(100)
    ds_train = ds_train.prefetch(1)

    # build test pipeline
    ds_test = ds_test.batch(100)
    ds_test = ds_test.prefetch(1)

    with strategy.scope():
        # create model
        model = tf.keras.models.Sequential(
            [
                tf.keras.layers.Flatten(input_shape=(8, 8)),
                tf.keras.layers.Dense(16, activation="relu"),
                tf.keras.layers.Dense(10),
            ]
        )
        model = GradientAccumulateModel(
            accum_steps=4,
            inputs=model.input,
            outputs=model.output,
            experimental_distributed_support=True,
        )

        # define optimizer - currently only SGD compatible with GAOptimizerWrapper
        opt = get_opt("SGD")

        # compile model
        model.compile(
            optimizer=opt,
            loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[tf.keras.metrics.SparseCategoricalAccuracy()],
        )

    before = model.get_weights()  # Added

    # train model
    model.fit(ds_train, epochs=3, validation_data=ds_test, verbose=1)

    model.save("./trained_model")

    # load trained model and test
    del model
    trained_model = load_model("./trained_model", compile=True)

    result = trained_model.evaluate(ds_test, verbose=1)
    print(result)

    # Added: it trained, to finite weights and metrics.
    after = trained_model.get_weights()
    assert _finite(result) and _finite(after), result
    assert _changed(before, after)


# ========================================== 0.5.2 tests/test_model_expected_result.py
def test_model_expected_result():
    """0.5.2 tests/test_model_expected_result.py::test_model_expected_result
    (with tests/utils.py's run_experiment)."""
    # set seed
    reset()

    # run once
    result1 = run_experiment(bs=100, accum_steps=1, epochs=2, modeloropt="model")

    # reset before second run to get identical results
    reset()

    # test with model wrapper instead
    result2 = run_experiment(bs=50, accum_steps=2, epochs=2, modeloropt="model")

    # results should be identical (theoretically, even in practice on CPU)
    if tf_version <= 6:
        # approximation poorer as enable_op_determinism() not available for tf < 2.7
        np.testing.assert_almost_equal(result1, result2, decimal=4)
    elif tf_version > 10:
        # approximation worse for tf >= 2.11
        np.testing.assert_almost_equal(result1, result2, decimal=2)
    else:
        assert result1 == result2


# =================================================== 0.5.2 tests/test_mp_batch_norm.py
def run_experiment_mp_batch_norm(
    custom_bn: bool = True,
    bs: int = 100,
    accum_steps: int = 1,
    epochs: int = 3,
    queue=None,
    mixed_precision_flag=True,
):
    ## reset session and seed stuff before running experiment
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"

    # disable GPU
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"

    # The below is necessary for starting Numpy generated random numbers
    # in a well-defined initial state.
    np.random.seed(123)

    # The below is necessary for starting core Python generated random numbers
    # in a well-defined state.
    python_random.seed(123)

    # The below set_seed() will make random number generation
    # in the TensorFlow backend have a well-defined initial state.
    # For further details, see:
    # https://www.tensorflow.org/api_docs/python/tf/random/set_seed
    tf.random.set_seed(1234)

    # https://stackoverflow.com/a/71311207
    tf.config.experimental.enable_op_determinism()

    # set mixed global precision policy
    if mixed_precision_flag:
        mixed_precision.set_global_policy("mixed_float16")

    # load dataset
    (ds_train, ds_test), ds_info = tfds.load(
        "mnist",
        split=["train", "test"],
        shuffle_files=True,
        as_supervised=True,
        with_info=True,
    )

    # build train pipeline
    ds_train = ds_train.map(normalize_img)
    ds_train = ds_train.shuffle(ds_info.splits["train"].num_examples)
    ds_train = ds_train.batch(bs)
    ds_train = ds_train.prefetch(1)

    # build test pipeline
    ds_test = ds_test.map(normalize_img)
    ds_test = ds_test.batch(bs)
    ds_test = ds_test.prefetch(1)

    # define which normalization layer to use in network
    if custom_bn:
        normalization_layer = AccumBatchNormalization(accum_steps=accum_steps)
    elif not custom_bn:
        normalization_layer = tf.keras.layers.BatchNormalization()
    else:
        normalization_layer = tf.keras.layers.Activation("linear")

    # create model
    model = tf.keras.models.Sequential(
        [
            tf.keras.layers.Flatten(input_shape=(8, 8)),
            tf.keras.layers.Dense(10),
            normalization_layer,  # @TODO: BN before or after ReLU? Leads to different performance
            tf.keras.layers.Activation("relu"),
            tf.keras.layers.Dense(10, dtype=tf.float32),
        ]
    )

    # wrap model to use gradient accumulation
    if accum_steps > 1:
        model = GradientAccumulateModel(
            accum_steps=accum_steps,
            mixed_precision=mixed_precision_flag,
            inputs=model.input,
            outputs=model.output,
        )

    # need to scale optimizer for mixed precision
    opt = get_opt("SGD")
    if mixed_precision_flag:
        opt = mixed_precision.LossScaleOptimizer(opt)

    # compile model
    model.compile(
        optimizer=opt,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[tf.keras.metrics.SparseCategoricalAccuracy()],
    )

    # train model
    model.fit(
        ds_train,
        epochs=epochs,
        validation_data=ds_test,
    )

    model.save("./trained_model")

    # load trained model and test
    del model
    trained_model = load_model("./trained_model", compile=True)

    result = trained_model.evaluate(ds_test, verbose=1)
    print(result)

    # add result to queue to fetch it later on
    queue.put(result)


class _Queue(list):
    """Port: stands in for the multiprocessing.Queue the result went through."""

    put = list.append

    def get(self):
        return self.pop(0)


def run_experiment_wrapper(
    custom_bn=True, bs=100, accum_steps=1, epochs=3, mixed_precision=True
):
    # Port: 0.5.2 meant to run the experiment in a spawned process, but
    # called it in the test's process (``target=run_experiment(...)``) and
    # dropped ``mixed_precision``, so all four runs were mixed_float16. Here
    # it runs in the test's process (the _isolated fixture restores the
    # float32 policy afterwards) and the flag is passed on, so the first
    # pair runs in float32 as its comments say and the second pair, as
    # 0.5.2's four runs did, in mixed_float16.
    queue = _Queue()
    if not mixed_precision:
        tf.keras.mixed_precision.set_global_policy("float32")
    run_experiment_mp_batch_norm(
        custom_bn=custom_bn,
        bs=bs,
        accum_steps=accum_steps,
        epochs=epochs,
        queue=queue,
        mixed_precision_flag=mixed_precision,
    )
    return queue.get()


def test_mp_batch_norm_mixed_precision():
    """0.5.2 tests/test_mp_batch_norm.py::test_mixed_precision."""
    # custom BN without accum
    result1 = run_experiment_wrapper(
        custom_bn=True, accum_steps=4, bs=25, mixed_precision=False
    )[1]

    # keras BN without accum
    result2 = run_experiment_wrapper(
        custom_bn=True, accum_steps=1, bs=100, mixed_precision=False
    )[1]

    # assert result1 == result2
    np.testing.assert_almost_equal(result1, result2, decimal=2)

    # custom BN with accum with mixed precision
    result3 = run_experiment_wrapper(
        custom_bn=True, accum_steps=4, bs=25, mixed_precision=True
    )[1]

    # keras BN without accum
    result4 = run_experiment_wrapper(
        custom_bn=True, accum_steps=1, bs=100, mixed_precision=True
    )[1]

    np.testing.assert_almost_equal(result3, result4, decimal=2)


# ======================================================= 0.5.2 tests/test_multitask.py
def create_multi_input_output(image, label):
    return (image, image), (image, label)


def run_experiment_multitask(bs=16, accum_steps=4, epochs=1):
    # load dataset
    (ds_train, ds_test), ds_info = tfds.load(
        "mnist",
        split=["train", "test"],
        shuffle_files=True,
        as_supervised=True,
        with_info=True,
    )

    # get a smaller amount of samples for running the experiment
    # Port: 512 (0.5.2: 1024), a multiple of both batch sizes within the
    # 1,000 training images.
    ds_train = ds_train.take(512)
    ds_test = ds_test.take(512)

    # build train pipeline
    ds_train = ds_train.map(normalize_img)
    ds_train = ds_train.map(create_multi_input_output)
    ds_train = ds_train.batch(bs)
    ds_train = ds_train.prefetch(1)

    # build test pipeline
    ds_test = ds_test.map(normalize_img)
    ds_test = ds_test.map(create_multi_input_output)
    ds_test = ds_test.batch(bs)
    ds_test = ds_test.prefetch(1)

    # create multi-input multi-output model
    input1 = Input(shape=(8, 8, 1))
    input2 = Input(shape=(8, 8))

    x1 = Conv2D(8, (5, 5), activation="relu", padding="same")(input1)
    x1 = MaxPooling2D((2, 2))(x1)
    x1 = Conv2D(8, (5, 5), activation="relu", padding="same")(x1)
    x1 = UpSampling2D((2, 2))(x1)
    x1 = Conv2D(8, (5, 5), padding="same", name="reconstructor")(x1)

    x2 = Flatten()(input2)
    x2 = Dense(32, activation="relu")(x2)
    x2 = Dense(10, name="classifier")(x2)

    model = Model(inputs=[input1, input2], outputs=[x1, x2])

    # wrap model to use gradient accumulation
    if accum_steps > 1:
        model = GradientAccumulateModel(
            accum_steps=accum_steps, inputs=model.input, outputs=model.output
        )

    # compile model
    model.compile(
        optimizer=tf.keras.optimizers.SGD(1e-3),
        loss={
            "classifier": tf.keras.losses.SparseCategoricalCrossentropy(
                from_logits=True
            ),
            "reconstructor": "mse",
        },
        metrics={"classifier": tf.keras.metrics.SparseCategoricalAccuracy()},
    )

    # train model
    model.fit(
        ds_train,
        epochs=epochs,
        validation_data=ds_test,
    )

    model.save("./trained_model")

    # load trained model and test
    del model
    trained_model = load_model("./trained_model", compile=True)

    result = trained_model.evaluate(ds_test, verbose=1)
    print(result)

    return np.array(result)


def test_multitask():
    """0.5.2 tests/test_multitask.py::test_multitask."""
    # set seed
    reset()

    # run once
    result1 = run_experiment_multitask(bs=32, accum_steps=1, epochs=1)

    # reset before second run to get reproducible results
    reset()

    # run again with different batch size and number of accumulations
    result2 = run_experiment_multitask(bs=16, accum_steps=2, epochs=1)

    # results should be "identical" (on CPU, can be different on GPU)
    np.testing.assert_almost_equal(result1, result2, decimal=3)


# ============================================ 0.5.2 tests/test_optimizer_distribute.py
def run_experiment_optimizer_distribute(
    opt_name="adam", bs=100, accum_steps=1, epochs=1, strategy_name="multi"
):
    # setup single/multi-GPU strategy
    if strategy_name == "single":
        strategy = tf.distribute.get_strategy()  # get default strategy
    elif strategy_name == "multi":
        strategy = tf.distribute.MirroredStrategy()
    else:
        raise ValueError("Unknown distributed strategy chosen:", strategy_name)

    # load dataset
    (ds_train, ds_test), ds_info = tfds.load(
        "mnist",
        split=["train", "test"],
        shuffle_files=True,
        as_supervised=True,
        with_info=True,
    )

    # build train pipeline
    ds_train = ds_train.map(normalize_img)
    ds_train = ds_train.batch(bs)
    ds_train = ds_train.prefetch(1)

    # build test pipeline
    ds_test = ds_test.map(normalize_img)
    ds_test = ds_test.batch(bs)
    ds_test = ds_test.prefetch(1)

    with strategy.scope():
        # create model
        model = tf.keras.models.Sequential(
            [
                tf.keras.layers.Flatten(input_shape=(8, 8)),
                tf.keras.layers.Dense(128, activation="relu"),
                tf.keras.layers.Dense(10),
            ]
        )

        # define optimizer - currently only SGD compatible with GAOptimizerWrapper
        opt = get_opt(opt_name=opt_name, tf_version=tf_version)

        # wrap optimizer to add gradient accumulation support
        opt = GradientAccumulateOptimizer(optimizer=opt, accum_steps=accum_steps)

        # compile model
        model.compile(
            optimizer=opt,
            loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[tf.keras.metrics.SparseCategoricalAccuracy()],
        )

    # train model
    model.fit(
        ds_train,
        batch_size=bs,
        epochs=epochs,
        validation_data=ds_test,
        verbose=1,
    )

    model.save("./trained_model")

    # load trained model and test
    del model
    trained_model = load_model("./trained_model", compile=True)

    del strategy

    result = trained_model.evaluate(ds_test, verbose=1)
    print(result)
    return result[1]


def test_distributed_optimizer_invariance():
    """0.5.2 tests/test_optimizer_distribute.py::test_distributed_optimizer_invariance."""
    # run experiment for different optimizers, to see if GA is consistent
    # within an optimizer. Note that it is expected for the results to
    # differ BETWEEN optimizers, as they behave differently.
    for strategy_name in ["single", "multi"]:
        for opt_name in ["SGD", "adam"]:
            print("Current optimizer:" + opt_name)
            # set seed
            reset()

            # run once
            result1 = run_experiment_optimizer_distribute(
                opt_name=opt_name,
                bs=100,
                accum_steps=1,
                epochs=2,
                strategy_name=strategy_name,
            )

            # reset before second run to get identical results
            reset()

            # run again with different batch size and number of accumulations
            result2 = run_experiment_optimizer_distribute(
                opt_name=opt_name,
                bs=50,
                accum_steps=2,
                epochs=2,
                strategy_name=strategy_name,
            )

            # results should be "identical" (on CPU, can be different on GPU)
            np.testing.assert_almost_equal(result1, result2, decimal=2)


# ============================================ 0.5.2 tests/test_optimizer_invariance.py
def run_experiment_optimizer_invariance(
    bs=100, accum_steps=1, epochs=1, opt_name="SGD", wrapper="model"
):
    # load dataset
    (ds_train, ds_test), ds_info = tfds.load(
        "mnist",
        split=["train", "test"],
        shuffle_files=True,
        as_supervised=True,
        with_info=True,
    )

    # build train pipeline
    ds_train = ds_train.map(normalize_img)
    ds_train = ds_train.batch(bs)
    ds_train = ds_train.prefetch(tf.data.AUTOTUNE)

    # build test pipeline
    ds_test = ds_test.map(normalize_img)
    ds_test = ds_test.batch(bs)
    ds_test = ds_test.prefetch(tf.data.AUTOTUNE)

    # create model
    input = tf.keras.layers.Input(shape=(8, 8))
    x = tf.keras.layers.Flatten(input_shape=(8, 8))(input)
    x = tf.keras.layers.Dense(128, activation="relu")(x)
    output = tf.keras.layers.Dense(10)(x)
    model = tf.keras.models.Model(inputs=input, outputs=output)

    # define optimizer
    opt = get_opt(opt_name)

    # wrap model to use gradient accumulation
    if accum_steps > 1:
        if wrapper == "model":
            model = GradientAccumulateModel(
                accum_steps=accum_steps, inputs=input, outputs=output
            )
        elif wrapper == "optimizer":
            opt = GradientAccumulateOptimizer(optimizer=opt, accum_steps=accum_steps)
        else:
            raise ValueError("Unknown wrapper was chosen:", wrapper)

    # compile model
    model.compile(
        optimizer=opt,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[tf.keras.metrics.SparseCategoricalAccuracy()],
    )

    # train model
    model.fit(
        ds_train,
        epochs=epochs,
        validation_data=ds_test,
    )

    model.save("./trained_model")

    # load trained model and test
    del model
    trained_model = load_model("./trained_model", compile=True)

    result = trained_model.evaluate(ds_test, verbose=1)
    print(result)

    return result[1]


def test_optimizer_invariance():
    """0.5.2 tests/test_optimizer_invariance.py::test_optimizer_invariance."""
    # run experiment for different optimizers, to see if GA is consistent
    # within an optimizer. Note that it is expected for the results to
    # differ BETWEEN optimizers, as they behave differently.
    for wrapper in ["model", "optimizer"]:
        for opt_name in ["SGD", "adam", "RMSprop"]:
            print("Current experiment:", wrapper, opt_name)
            # set seed
            reset()

            # run once
            result1 = run_experiment_optimizer_invariance(
                bs=100,
                accum_steps=1,
                epochs=2,
                opt_name=opt_name,
                wrapper=wrapper,
            )

            # reset before second run to get identical results
            reset()

            # run again with different batch size and number of accumulations
            result2 = run_experiment_optimizer_invariance(
                bs=50,
                accum_steps=2,
                epochs=2,
                opt_name=opt_name,
                wrapper=wrapper,
            )

            # results should be "identical" (on CPU, can be different on GPU)
            np.testing.assert_almost_equal(
                result1, result2, decimal=2
            )  # decimals=3 OK for model wrapper but not optimizer


# =============================================== 0.5.2 tests/test_optimizer_wrapper.py
def run_experiment_optimizer_wrapper(bs=16, accum_steps=4, epochs=1):
    # load dataset
    (ds_train, ds_test), ds_info = tfds.load(
        "mnist",
        split=["train", "test"],
        shuffle_files=True,
        as_supervised=True,
        with_info=True,
    )

    # build train pipeline
    ds_train = ds_train.map(normalize_img)
    ds_train = ds_train.batch(bs)
    ds_train = ds_train.prefetch(1)

    # build test pipeline
    ds_test = ds_test.map(normalize_img)
    ds_test = ds_test.batch(bs)
    ds_test = ds_test.prefetch(1)

    # create model
    model = tf.keras.models.Sequential(
        [
            tf.keras.layers.Flatten(input_shape=(8, 8)),
            tf.keras.layers.Dense(32, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )

    # wrap optimizer to add gradient accumulation support
    opt = get_opt("SGD")
    opt = GradientAccumulateOptimizer(
        optimizer=opt, accum_steps=accum_steps, reduction="MEAN"
    )  # MEAN REDUCTION IMPORTANT!!!

    # compile model
    model.compile(
        optimizer=opt,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[tf.keras.metrics.SparseCategoricalAccuracy()],
    )

    # train model
    model.fit(
        ds_train,
        epochs=epochs,
        validation_data=ds_test,
        verbose=0,
    )

    model.save("./trained_model")

    # load trained model and test
    del model
    trained_model = load_model("./trained_model", compile=True)

    result = trained_model.evaluate(ds_test, verbose=1)
    print(result)

    return result[1]


def test_optimizer_wrapper_expected_result():
    """0.5.2 tests/test_optimizer_wrapper.py::test_expected_result."""
    # set seed
    reset()

    # run once
    result1 = run_experiment_optimizer_wrapper(
        bs=500, accum_steps=1, epochs=3
    )  # NOTE: AS TO BE DIVISIBLE BY TRAIN SET SIZE = 50000 (!)

    # reset before second run to get identical results
    reset()

    # run again with different batch size and number of accumulations
    result2 = run_experiment_optimizer_wrapper(bs=250, accum_steps=2, epochs=3)

    # reset before second run to get identical results
    reset()

    # run again with different batch size and number of accumulations
    result3 = run_experiment_optimizer_wrapper(bs=125, accum_steps=4, epochs=3)

    # reset before second run to get identical results
    # reset()

    # run again with different batch size and number of accumulations
    # result4 = run_experiment(bs=1, accum_steps=500, epochs=2)

    # results should be identical (theoretically, even in practice on CPU)
    # assert result1 == result2
    # assert result1 == result3

    # reduced constraint for temporarily
    np.testing.assert_almost_equal(result1, result2, decimal=2)
    np.testing.assert_almost_equal(result1, result3, decimal=2)


# ===================================================== 0.5.2 tests/test_param_count.py
def create_model():
    input = tf.keras.layers.Input(shape=(10,))
    x = Dense(32, input_shape=(10,), activation="relu")(input)
    x = Dense(16, activation="relu")(x)
    output = Dense(1, activation="sigmoid")(x)

    return input, output


def count_params(model):
    return model.count_params()


def test_param_count_with_wrapper():
    """0.5.2 tests/test_param_count.py::test_param_count_with_wrapper."""
    # Create a model
    input, output = create_model()
    original_model = tf.keras.Model(inputs=input, outputs=output)

    # Count the parameters of the original model
    original_param_count = count_params(original_model)

    # Wrap the model with GradientAccumulateModel
    wrapped_model = GradientAccumulateModel(accum_steps=2, inputs=input, outputs=output)

    # Count the parameters of the wrapped model
    wrapped_param_count = count_params(wrapped_model)

    # Compile both models
    original_model.compile(
        optimizer=tf.keras.optimizers.Adam(), loss="binary_crossentropy"
    )
    wrapped_model.compile(
        optimizer=tf.keras.optimizers.Adam(), loss="binary_crossentropy"
    )

    # Check if the number of parameters in both models is the same
    assert original_param_count == wrapped_param_count, (
        f"Parameter count mismatch: Original model has {original_param_count} parameters, "
        f"wrapped model has {wrapped_param_count} parameters."
    )


# ================================================= 0.5.2 tests/test_sparse_optimizer.py
def preprocess_data(ds, vocab_size, max_length):
    def encode(x, y):
        x = tf.strings.substr(x, 0, max_length)
        x = tf.strings.reduce_join(
            tf.strings.unicode_split(x, input_encoding="UTF-8"), separator=" "
        )
        x = tf.strings.split(x)
        x_hashed = tf.strings.to_hash_bucket_fast(x, vocab_size)
        x_padded = tf.pad(
            x_hashed,
            paddings=[[0, max_length - tf.shape(x_hashed)[-1]]],
            constant_values=0,
        )
        return x_padded, y

    ds = ds.map(encode)
    return ds


def run_experiment_sparse_optimizer(bs=100, accum_steps=1, epochs=2):
    # Load the IMDb dataset
    (ds_train, ds_test), ds_info = tfds.load(
        "imdb_reviews",
        split=["train", "test"],
        shuffle_files=True,
        as_supervised=True,
        with_info=True,
    )

    # Preprocess the dataset
    vocab_size = 10000
    max_length = 100
    ds_train = preprocess_data(ds_train, vocab_size, max_length)
    ds_test = preprocess_data(ds_test, vocab_size, max_length)

    # Batch the dataset
    ds_train = ds_train.batch(bs)
    ds_test = ds_test.batch(bs)

    # define model
    model = Sequential()
    model.add(Embedding(input_dim=vocab_size, output_dim=8, input_length=max_length))
    model.add(Flatten())
    model.add(Dense(1, activation="sigmoid"))

    # wrap optimizer to add gradient accumulation support
    # need to dynamically handle which Optimizer class to use dependent on tf version
    if tf_version > 10:
        opt = tf.keras.optimizers.legacy.SGD(learning_rate=1e-2)
    else:
        opt = tf.keras.optimizers.SGD(
            learning_rate=1e-2
        )  # IDENTICAL RESULTS WITH SGD!!!

    if accum_steps > 1:
        opt = GradientAccumulateOptimizer(
            optimizer=opt, accum_steps=accum_steps, reduction="MEAN"
        )

    model.compile(optimizer=opt, loss="binary_crossentropy", metrics=["acc"])

    model.fit(
        ds_train,
        batch_size=bs,
        epochs=epochs,
        verbose=1,
    )

    model.save("./trained_model")

    # load trained model and test
    del model
    trained_model = load_model("./trained_model", compile=True)

    result = trained_model.evaluate(ds_test, verbose=1)
    print(result)

    return result[1], trained_model.get_weights()  # Port: weights too


def test_sparse_expected_results():
    """0.5.2 tests/test_sparse_optimizer.py::test_sparse_expected_results,
    whose comparison with the big batch was commented out; it is restored."""
    # set seed
    reset()

    # run once
    result1, weights1 = run_experiment_sparse_optimizer(bs=100, accum_steps=1, epochs=2)

    # reset before second run to get identical results
    reset()

    # run again with different batch size and number of accumulations
    result2, weights2 = run_experiment_sparse_optimizer(bs=50, accum_steps=2, epochs=2)

    # results should be identical (theoretically, even in practice on CPU)
    # assert result1 == result2
    # Added: the 0.5.2 suite's accuracy tolerance, and the weights (the
    # embedding's sparse gradients accumulated) as the big batch's.
    np.testing.assert_almost_equal(result1, result2, decimal=2)
    for w1, w2 in zip(weights1, weights2, strict=True):
        np.testing.assert_allclose(w2, w1, rtol=0, atol=2e-5)
