"""AccumBatchNormalization against Keras' BatchNormalization on the big batch.

The reference for the moving statistics is always
``keras.layers.BatchNormalization`` trained on the concatenated big batches.
Micro-batches are drawn with very different means and variances, so that the
0.5.x approach (averaging micro-batch variances) would be far off; every such
test also checks that it would be. (Under MirroredStrategy, in either
Keras: tests/both/test_batch_norm.py.)
"""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator import (
    AccumBatchNormalization,
    GradientAccumulateModel,
    GradientAccumulateOptimizer,
    replace_batchnorm_layers,
)
from tests.processes import (
    assert_quiet,
    describe,
    run_like_a_user,
    verdict,
)
from tests.utils import (
    assert_same_weights,
    assert_trained,
    heterogeneous,
    seeded,
    weights,
)

STAT_TOL = 1e-5
MOMENTUM = 0.5  # small, so that the last cycles dominate and errors show


def moving_stats(layer) -> list[np.ndarray]:
    return [np.asarray(layer.moving_mean), np.asarray(layer.moving_variance)]


def assert_stats_close(ours, reference, tol: float = STAT_TOL) -> float:
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(ours, reference))
    assert diff <= tol, f"max |moving_acc - moving_keras| = {diff:.3g} > {tol:g}"
    return diff


def naive_variance_error(x, micro, axis, momentum, cycles, accum_steps) -> float:
    """How far 0.5.x's mean-of-micro-batch-variances would land from Keras:
    the data must make this large for the tests to mean anything."""
    axes = tuple(i for i in range(x.ndim) if i != axis % x.ndim)
    moving_naive = 1.0
    moving_exact = 1.0
    big = micro * accum_steps
    for c in range(cycles):
        chunk = x[c * big : (c + 1) * big]
        micro_vars = [
            chunk[k * micro : (k + 1) * micro].var(axis=axes)
            for k in range(accum_steps)
        ]
        moving_naive = moving_naive * momentum + np.mean(micro_vars, 0) * (1 - momentum)
        moving_exact = moving_exact * momentum + chunk.var(axis=axes) * (1 - momentum)
    return float(np.max(np.abs(moving_naive - moving_exact)))


def run_layer_cycles(layer, x, micro, masks=None):
    """Calls ``layer`` in training mode on consecutive micro-batches."""
    for start in range(0, len(x), micro):
        mask = None if masks is None else masks[start : start + micro]
        layer(x[start : start + micro], training=True, mask=mask)


def run_keras_big_batches(layer, x, big, masks=None):
    for start in range(0, len(x), big):
        mask = None if masks is None else masks[start : start + big]
        layer(x[start : start + big], training=True, mask=mask)


# ------------------------------------------------------- moving statistics


@pytest.mark.parametrize(
    "shape, axis",
    [
        ((5,), -1),  # Dense
        ((6, 3), -1),  # Conv1D / sequences
        ((3, 6), 1),  # channels-first rank 3
        ((4, 4, 3), -1),  # Conv2D
        ((3, 4, 4), 1),  # Conv2D channels_first
        ((2, 3, 3, 2), -1),  # Conv3D
        ((2, 3, 3, 2), 1),  # rank 5, non-last axis
    ],
)
def test_moving_statistics_equal_keras_on_big_batch(shape, axis):
    accum_steps, micro, cycles = 3, 4, 2
    x = heterogeneous(accum_steps * cycles, micro, shape)
    if axis != -1:
        # Put the heterogeneous (last) axis where the channels are.
        x = np.moveaxis(x, -1, axis)
    ours = AccumBatchNormalization(accum_steps=accum_steps, axis=axis, momentum=0.5)
    keras_bn = keras.layers.BatchNormalization(axis=axis, momentum=0.5)
    run_layer_cycles(ours, x, micro)
    run_keras_big_batches(keras_bn, x, micro * accum_steps)
    assert_stats_close(moving_stats(ours), moving_stats(keras_bn))
    assert naive_variance_error(x, micro, axis, 0.5, cycles, accum_steps) > 0.1


def test_mid_cycle_leaves_moving_statistics_alone():
    x = heterogeneous(5, 4, (3,))
    ours = AccumBatchNormalization(accum_steps=3, momentum=0.5)
    keras_bn = keras.layers.BatchNormalization(momentum=0.5)
    run_layer_cycles(ours, x, 4)  # one full cycle and two of the next
    run_keras_big_batches(keras_bn, x[:12], 12)
    assert_stats_close(moving_stats(ours), moving_stats(keras_bn))
    assert int(ours._accumulator.micro_step.numpy()) == 2


@pytest.mark.parametrize("axis", [-1, 1])
def test_masks_are_honoured_as_keras_does(axis):
    # axis=1: Keras broadcasts the mask over the last axis, so the channels
    # have different numbers of unmasked elements.
    accum_steps, micro, cycles = 2, 3, 2
    x = heterogeneous(accum_steps * cycles, micro, (5, 2))
    rng = np.random.default_rng(1)
    masks = rng.random((len(x), 5)) > 0.4
    masks[:, 0] = True  # no micro-batch entirely masked
    # Masked entries hold huge values: counting any of them would show.
    x = np.where(masks[..., None], x, 1e4).astype("float32")
    ours = AccumBatchNormalization(accum_steps=accum_steps, axis=axis, momentum=0.5)
    keras_bn = keras.layers.BatchNormalization(axis=axis, momentum=0.5)
    run_layer_cycles(ours, x, micro, masks)
    run_keras_big_batches(keras_bn, x, micro * accum_steps, masks)
    assert_stats_close(moving_stats(ours), moving_stats(keras_bn))


def test_large_offset_keeps_the_variance():
    # |mean| / std ~ 1e5: E[x^2] - E[x]^2 in float32 loses the variance
    # entirely; merging micro-batch moments keeps it.
    x = heterogeneous(8, 8, (3,)) * 0.01 + 3000.0
    ours = AccumBatchNormalization(accum_steps=2, momentum=0.0)
    keras_bn = keras.layers.BatchNormalization(momentum=0.0)
    run_layer_cycles(ours, x, 8)
    run_keras_big_batches(keras_bn, x, 16)
    mean_ours, var_ours = moving_stats(ours)
    np.testing.assert_allclose(mean_ours, moving_stats(keras_bn)[0], rtol=1e-6)
    last = x[-16:]
    exact = last.astype("float64").var(axis=0)
    naive = np.mean(last * last, 0) - np.mean(last, 0) ** 2  # float32
    assert np.max(np.abs(naive - exact) / exact) > 1.0
    # The micro-batch means themselves are rounded to float32's 2.4e-4 at
    # 3000, which bounds what any float32 pooling can do here.
    np.testing.assert_allclose(var_ours, exact, rtol=1e-2)


# ------------------------------------------------- inside training wrappers


class GhostBatchNorm(keras.layers.Layer):
    """Reference for training on the big batch with micro-batch normalisation.

    Keras' BatchNormalization normalises each of ``chunks`` slices of the big
    batch (as accumulation does); a second Keras BatchNormalization sees the
    whole big batch and keeps the moving statistics Keras would.
    """

    def __init__(self, chunks, momentum, **kwargs):
        super().__init__(**kwargs)
        self.chunks = chunks
        self.norm = keras.layers.BatchNormalization(momentum=momentum)
        self.stats = keras.layers.BatchNormalization(
            momentum=momentum, center=False, scale=False
        )

    def build(self, input_shape):
        self.norm.build(input_shape)
        self.stats.build(input_shape)

    def call(self, x, training=None):
        if training:
            self.stats(x, training=True)
            parts = tf.split(x, self.chunks, axis=0)
            return tf.concat([self.norm(p, training=True) for p in parts], 0)
        return self.norm(x, training=False)


def bn_model(norm, cls=keras.Model, **kwargs):
    inputs = keras.Input((6,))
    h = keras.layers.Dense(5)(inputs)
    h = norm(h)
    h = keras.layers.Activation("tanh")(h)
    outputs = keras.layers.Dense(2)(h)
    return cls(inputs=inputs, outputs=outputs, **kwargs)


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_training_equals_big_batch_with_micro_batch_normalisation(wrapper):
    accum_steps, micro, cycles = 3, 4, 3
    x = heterogeneous(accum_steps * cycles, micro, (6,))
    y = np.random.default_rng(2).normal(size=(len(x), 2)).astype("float32")

    if wrapper == "model":
        ours = seeded(
            lambda: bn_model(
                AccumBatchNormalization(momentum=MOMENTUM),
                GradientAccumulateModel,
                accum_steps=accum_steps,
            )
        )
        ours.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    else:
        ours = seeded(
            lambda: bn_model(
                AccumBatchNormalization(accum_steps=accum_steps, momentum=MOMENTUM)
            )
        )
        optimizer = GradientAccumulateOptimizer(
            keras.optimizers.SGD(0.1), accum_steps=accum_steps
        )
        ours.compile(optimizer=optimizer, loss="mse")
    reference = seeded(lambda: bn_model(GhostBatchNorm(accum_steps, MOMENTUM)))
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    before = weights(reference)

    ours.fit(x, y, batch_size=micro, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=micro * accum_steps, shuffle=False, verbose=0)

    assert_trained(before, weights(reference))
    assert_same_weights(weights(ours), weights(reference))
    ghost = reference.layers[2]
    assert_stats_close(moving_stats(ours.layers[2]), moving_stats(ghost.stats))
    if wrapper == "model":
        # One counter: the layer's own never moves, the model's decides.
        layer = ours.layers[2]
        assert layer._accumulator.leader is ours._accumulator
        assert int(layer._accumulator.micro_step.numpy()) == 0


def test_nested_model_layers_follow_the_model():
    accum_steps, micro = 2, 4
    x = heterogeneous(2 * accum_steps, micro, (6,))
    y = np.zeros((len(x), 2), "float32")

    def build():
        inner_in = keras.Input((6,))
        inner = keras.Model(inner_in, AccumBatchNormalization(momentum=0.5)(inner_in))
        inputs = keras.Input((6,))
        outputs = keras.layers.Dense(2)(inner(inputs))
        return GradientAccumulateModel(accum_steps, inputs=inputs, outputs=outputs)

    model = seeded(build)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=micro, shuffle=False, verbose=0)
    keras_bn = keras.layers.BatchNormalization(momentum=0.5)
    run_keras_big_batches(keras_bn, x, micro * accum_steps)
    nested = model.layers[1].layers[1]
    assert nested._accumulator.leader is model._accumulator
    assert_stats_close(moving_stats(nested), moving_stats(keras_bn))


def test_omitted_accum_steps_standalone_is_keras():
    x = heterogeneous(4, 4, (3,))
    ours = AccumBatchNormalization(momentum=0.5)
    keras_bn = keras.layers.BatchNormalization(momentum=0.5)
    run_layer_cycles(ours, x, 4)
    run_keras_big_batches(keras_bn, x, 4)
    assert_stats_close(moving_stats(ours), moving_stats(keras_bn))


# --------------------------------------------------------------- inference


@pytest.mark.parametrize("shape, axis", [((5,), -1), ((4, 4, 3), -1), ((3, 4, 4), 1)])
def test_inference_is_keras_batch_normalization(shape, axis):
    rng = np.random.default_rng(3)
    x = rng.normal(2, 3, size=(6, *shape)).astype("float32")
    ours = AccumBatchNormalization(accum_steps=2, axis=axis, epsilon=1e-2)
    keras_bn = keras.layers.BatchNormalization(axis=axis, epsilon=1e-2)
    ours.build(x.shape)
    keras_bn.build(x.shape)
    channels = x.shape[axis]
    for name in ("gamma", "beta", "moving_mean", "moving_variance"):
        value = rng.uniform(0.5, 2, size=channels).astype("float32")
        getattr(ours, name).assign(value)
        getattr(keras_bn, name).assign(value)
    np.testing.assert_array_equal(ours(x, training=False), keras_bn(x, training=False))
    # Frozen (trainable=False) means inference mode, as for Keras' layer.
    ours.trainable = False
    keras_bn.trainable = False
    np.testing.assert_array_equal(ours(x, training=True), keras_bn(x, training=True))


def test_training_forward_is_keras_on_the_micro_batch():
    x = heterogeneous(1, 8, (4, 3))
    ours = AccumBatchNormalization(accum_steps=4)
    keras_bn = keras.layers.BatchNormalization()
    np.testing.assert_array_equal(ours(x, training=True), keras_bn(x, training=True))


# ---------------------------------------------------------- mixed precision


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_statistics_in_float32(policy):
    keras.mixed_precision.set_global_policy(policy)
    # Per-channel sums of squares of a micro-batch reach ~2e6, far beyond
    # float16's 65504: only float32 sums give finite, exact statistics.
    # (momentum=0: the check is on the last cycle, whose shift is the
    # previous big batch's mean; the first cycle's is 0, see the docs.)
    x = heterogeneous(6, 16, (8, 8, 2)) + 30.0
    ours = AccumBatchNormalization(accum_steps=2, momentum=0.0)
    keras_bn = keras.layers.BatchNormalization(momentum=0.0)
    out = ours(x[:16], training=True)
    assert keras.backend.standardize_dtype(out.dtype) == policy.split("_")[1]
    run_layer_cycles(ours, x[16:], 16)
    run_keras_big_batches(keras_bn, x, 32)
    assert ours.moving_mean.dtype == "float32"
    assert all(v.dtype == "float32" for v in ours._accumulator.grad_sums)
    for a, b in zip(moving_stats(ours), moving_stats(keras_bn)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=STAT_TOL)


# ----------------------------------------------------------------- saving


def test_keras_file_round_trip_mid_cycle(tmp_path):
    accum_steps, micro = 3, 4
    x = heterogeneous(9, micro, (6,))
    y = np.random.default_rng(4).normal(size=(len(x), 2)).astype("float32")
    model = seeded(
        lambda: bn_model(
            AccumBatchNormalization(momentum=MOMENTUM, epsilon=2e-3),
            GradientAccumulateModel,
            accum_steps=accum_steps,
            flush_at_end=False,  # saved mid-cycle on purpose
        )
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x[:20], y[:20], batch_size=micro, shuffle=False, verbose=0)  # 5 steps
    path = tmp_path / "bn.keras"
    model.save(path)
    loaded = keras.models.load_model(path)  # no custom_objects
    layer = loaded.layers[2]
    assert isinstance(layer, AccumBatchNormalization)
    assert layer.epsilon == 2e-3 and layer.accum_steps is None
    assert float(layer._accumulator.weight_sum.numpy()) == 2  # mid-cycle
    for m in (model, loaded):
        m.fit(x[20:], y[20:], batch_size=micro, shuffle=False, verbose=0)
    assert_same_weights(weights(loaded), weights(model), atol=0.0)
    assert_stats_close(moving_stats(loaded.layers[2]), moving_stats(model.layers[2]), 0)


def test_standalone_layer_round_trip_mid_cycle(tmp_path):
    x = heterogeneous(6, 4, (3,))
    model = keras.Sequential(
        [keras.Input((3,)), AccumBatchNormalization(accum_steps=3, momentum=0.5)]
    )
    run_layer_cycles(model.layers[0], x[:16], 4)  # 4 calls: mid-cycle
    model.save(tmp_path / "layer.keras")
    loaded = keras.models.load_model(tmp_path / "layer.keras")
    assert loaded.layers[0].accum_steps == 3
    run_layer_cycles(loaded.layers[0], x[16:], 4)
    keras_bn = keras.layers.BatchNormalization(momentum=0.5)
    run_keras_big_batches(keras_bn, x, 12)
    assert_stats_close(moving_stats(loaded.layers[0]), moving_stats(keras_bn))


# -------------------------------------------------------------- validation


def test_legacy_call_form_and_keras_config():
    layer = AccumBatchNormalization(accum_steps=4)
    assert layer.accum_steps == 4
    config = keras.layers.BatchNormalization(momentum=0.9).get_config()
    # A Keras BatchNormalization config (renorm=False keys included) loads.
    restored = AccumBatchNormalization.from_config(config)
    assert restored.momentum == 0.9 and restored.accum_steps is None


def test_replace_rejects_non_models_and_subclassed_models():
    with pytest.raises(TypeError, match=r"keras\.Model"):
        replace_batchnorm_layers(keras.layers.BatchNormalization(), 2)

    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.norm = keras.layers.BatchNormalization()

        def call(self, x):
            return self.norm(x)

    with pytest.raises(TypeError, match="subclassed"):
        replace_batchnorm_layers(Sub(), 2)


# ------------------------------------------------- replace_batchnorm_layers


def resnet_like():
    """A small ResNet-style network: stem, two residual blocks (one as a
    nested functional model), a nested Sequential head."""

    def block(x, filters, name):
        h = keras.layers.Conv2D(filters, 3, padding="same", name=f"{name}_c1")(x)
        h = keras.layers.BatchNormalization(name=f"{name}_bn1")(h)
        h = keras.layers.ReLU()(h)
        h = keras.layers.Conv2D(filters, 3, padding="same", name=f"{name}_c2")(h)
        h = keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-4)(h)
        return keras.layers.ReLU()(keras.layers.Add()([x, h]))

    block_in = keras.Input((8, 8, 4))
    nested_block = keras.Model(block_in, block(block_in, 4, "inner"), name="block")
    head = keras.Sequential(
        [
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(6),
            keras.layers.BatchNormalization(center=False),
            keras.layers.Dense(3),
        ],
        name="head",
    )
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    h = keras.layers.BatchNormalization(scale=False)(h)
    h = keras.layers.ReLU()(h)
    h = block(h, 4, "outer")
    h = nested_block(h)
    return keras.Model(inputs, head(h), name="resnet_like")


def batch_norms(model, cls):
    return [
        layer
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if type(layer) is cls
    ]


def randomise_batch_norm_state(model, rng):
    for layer in batch_norms(model, keras.layers.BatchNormalization):
        for variable in layer.weights:
            variable.assign(rng.uniform(0.5, 1.5, size=variable.shape))


def test_replace_batchnorm_layers_keeps_predictions_weights_and_config():
    rng = np.random.default_rng(5)
    original = seeded(resnet_like)
    randomise_batch_norm_state(original, rng)  # as if pretrained
    x = rng.normal(size=(4, 8, 8, 3)).astype("float32")

    converted = replace_batchnorm_layers(original, accum_steps=2)

    old = batch_norms(original, keras.layers.BatchNormalization)
    new = batch_norms(converted, AccumBatchNormalization)
    assert len(old) == len(new) == 6
    assert not batch_norms(converted, keras.layers.BatchNormalization)
    assert batch_norms(original, keras.layers.BatchNormalization) == old  # untouched
    for a, b in zip(old, new):
        config = b.get_config()
        assert config.pop("accum_steps") == 2
        expected = {k: v for k, v in a.get_config().items() if "renorm" not in k}
        assert config == expected
        for w_old, w_new in zip(a.weights, b.weights):
            np.testing.assert_array_equal(w_old, w_new)
            assert w_old is not w_new
    np.testing.assert_array_equal(
        converted.predict(x, verbose=0), original.predict(x, verbose=0)
    )
    assert (
        converted.get_layer("block").__class__ is original.get_layer("block").__class__
    )


def test_replaced_model_trains_in_gradient_accumulate_model():
    original = seeded(resnet_like)
    randomise_batch_norm_state(original, np.random.default_rng(6))
    converted = replace_batchnorm_layers(
        GradientAccumulateModel(
            accum_steps=2, inputs=original.inputs, outputs=original.outputs
        )
    )
    assert isinstance(converted, GradientAccumulateModel)
    assert converted.accum_steps == 2
    x = np.random.default_rng(7).normal(size=(8, 8, 8, 3)).astype("float32")
    np.testing.assert_allclose(
        converted.predict(x, verbose=0), original.predict(x, verbose=0), atol=0
    )
    converted.compile(optimizer="sgd", loss="mse")
    layers = batch_norms(converted, AccumBatchNormalization)
    before = [moving_stats(layer) for layer in layers]
    converted.fit(x, np.zeros((8, 3)), batch_size=2, verbose=0)
    assert all(layer._accumulator.leader is converted._accumulator for layer in layers)
    after = [moving_stats(layer) for layer in layers]
    assert all(np.abs(a[0] - b[0]).max() > 0 for a, b in zip(before, after))


# ---------------------------------------------------------------- example


@pytest.mark.script
def test_batch_norm_example_quick_matches_big_batch_statistics():
    result = run_like_a_user("examples/batch_norm.py", "--quick")
    assert result.returncode == 0, describe(result)
    assert verdict(result).startswith("OK: "), describe(result)
    assert_quiet(result)
    match = re.search(r"max \|moving_accum - moving_bigbatch\| = (\S+)", result.stdout)
    assert match, describe(result)
    assert float(match.group(1)) <= 1e-5, describe(result)
    assert "| keras-bn |" in result.stdout, describe(result)
    swap = re.search(r"max \|prediction after swap - before\| = (\S+)", result.stdout)
    assert swap, describe(result)
    assert float(swap.group(1)) <= 1e-5, describe(result)
    # Exactly the two BatchNormalization layers, named, and nothing else.
    assert (
        "swapped layers: input_norm (BatchNormalization -> AccumBatchNormalization), "
        "conv_norm (BatchNormalization -> AccumBatchNormalization)\n"
    ) in result.stdout, describe(result)
    assert verdict(result).startswith("OK: AccumBatchNormalization's"), describe(result)
