"""tf-keras ``replace_batchnorm_layers``: the copy of a pretrained tf-keras
model predicts what the model predicts in inference, keeps every weight,
leaves the model alone, and in a ``GradientAccumulateModel`` its moving
statistics are those of tf-keras' BatchNormalization on the big batch."""

import numpy as np
import pytest
import tf_keras

from gradient_accumulator import (
    AccumBatchNormalization,
    GradientAccumulateModel,
    replace_batchnorm_layers,
)

B, K = 4, 2
STAT_TOL = 1e-5  # as tests/keras2/test_batch_norm.py
layers = tf_keras.layers


def resnet_like(fused=None):
    """A small ResNet-style network: stem, two residual blocks (one as a
    nested functional model), a nested Sequential head without an Input."""

    def block(x, filters, name):
        h = layers.Conv2D(filters, 3, padding="same", name=f"{name}_c1")(x)
        h = layers.BatchNormalization(name=f"{name}_bn1", fused=fused)(h)
        h = layers.ReLU()(h)
        h = layers.Conv2D(filters, 3, padding="same", name=f"{name}_c2")(h)
        h = layers.BatchNormalization(momentum=0.9, epsilon=1e-4, fused=fused)(h)
        return layers.ReLU()(layers.Add()([x, h]))

    block_in = tf_keras.Input((8, 8, 4))
    nested_block = tf_keras.Model(block_in, block(block_in, 4, "inner"), name="block")
    head = tf_keras.Sequential(
        [
            layers.GlobalAveragePooling2D(),
            layers.Dense(6),
            layers.BatchNormalization(center=False, momentum=0.5),
            layers.Dense(3),
        ],
        name="head",
    )
    inputs = tf_keras.Input((8, 8, 3))
    h = layers.Conv2D(4, 3, padding="same")(inputs)
    h = layers.BatchNormalization(scale=False, momentum=0.5, fused=fused)(h)
    h = layers.ReLU()(h)
    h = block(h, 4, "outer")
    h = nested_block(h)
    return tf_keras.Model(inputs, head(h), name="resnet_like")


def branches(fused=None):
    """BatchNormalization layers in parallel, each after a layer the input
    feeds (a zero learning rate keeps those the same in both trainings): a
    conv branch, a nested functional model and a nested Sequential."""
    inputs = tf_keras.Input((8, 8, 3))
    conv = layers.Conv2D(4, 3, padding="same")(inputs)
    conv = layers.BatchNormalization(momentum=0.5, fused=fused)(conv)
    block_in = tf_keras.Input((8, 8, 3))
    h = layers.Conv2D(2, 1)(block_in)
    h = layers.BatchNormalization(momentum=0.9, epsilon=1e-4, fused=fused)(h)
    block = tf_keras.Model(block_in, layers.GlobalAveragePooling2D()(h), name="block")
    head = tf_keras.Sequential(
        [
            layers.Flatten(),
            layers.Dense(5),
            layers.BatchNormalization(center=False, momentum=0.5),
        ],
        name="head",
    )
    h = [layers.GlobalAveragePooling2D()(conv), block(inputs), head(inputs)]
    return tf_keras.Model(inputs, layers.Dense(3)(layers.Concatenate()(h)))


def pretrained(seed, build=resnet_like, **kwargs):
    """``build(**kwargs)`` with random BatchNormalization state, as if
    trained."""
    tf_keras.utils.set_random_seed(seed)
    model = build(**kwargs)
    rng = np.random.default_rng(seed)
    for layer in batch_norms(model, layers.BatchNormalization):
        for variable in layer.weights:
            variable.assign(rng.uniform(0.5, 1.5, size=variable.shape))
    return model


def batch_norms(model, cls):
    """The layers of exactly class ``cls`` in ``model``, nested ones too."""
    found = [m for m in model.submodules if type(m) is cls]
    # submodules lists them in no particular order: by name, the same in
    # the model and its copy.
    return sorted(found, key=lambda layer: layer.name)


def with_weights(model):
    """The Conv2D and Dense layers of ``model``, nested ones too."""
    found = [m for m in model.submodules if type(m) in (layers.Conv2D, layers.Dense)]
    return sorted(found, key=lambda layer: layer.name)


def images(n, seed):
    rng = np.random.default_rng(seed)
    # Far from the initial statistics, per channel.
    return rng.normal(2.0, 3.0, size=(n, 8, 8, 3)).astype("float32")


def test_keeps_predictions_weights_and_config():
    original = pretrained(5)
    x = images(4, 5)
    before = original.predict(x, verbose=0)

    converted = replace_batchnorm_layers(original, accum_steps=2)

    old = batch_norms(original, layers.BatchNormalization)
    new = batch_norms(converted, AccumBatchNormalization)
    assert len(old) == len(new) == 6
    assert not batch_norms(converted, layers.BatchNormalization)
    assert batch_norms(original, layers.BatchNormalization) == old  # untouched
    for a, b in zip(old, new):
        config = b.get_config()
        assert config.pop("accum_steps") == 2
        expected = a.get_config()
        # tf-keras gives a built layer's axis as a list of positive axes.
        channels_last = a.input_spec.ndim - 1
        assert expected.pop("axis") == [channels_last] and config.pop("axis") == -1
        assert config == expected
        for w_old in a.weights:
            (w_new,) = [w for w in b.weights if w.name.endswith(w_old.name[-18:])]
            np.testing.assert_array_equal(w_old, w_new)
            assert w_old is not w_new
        # The shift of the pooled sums starts at the moving mean.
        np.testing.assert_array_equal(b.accumulation_shift, a.moving_mean)
    np.testing.assert_allclose(converted.predict(x, verbose=0), before, atol=1e-5)
    np.testing.assert_array_equal(original.predict(x, verbose=0), before)
    # Every other weight is copied, none shared.
    plain_old = [w for x in with_weights(original) for w in x.weights]
    plain_new = [w for x in with_weights(converted) for w in x.weights]
    assert len(plain_old) == len(plain_new) == 14  # 5 Conv2D, 2 Dense
    for w_old, w_new in zip(plain_old, plain_new):
        assert w_old.name == w_new.name
        np.testing.assert_array_equal(w_old, w_new)
        assert w_old is not w_new
    assert type(converted.get_layer("block")) is type(original.get_layer("block"))
    assert isinstance(converted.get_layer("head"), tf_keras.Sequential)


@pytest.mark.parametrize("fused", [None, False], ids=["fused", "not-fused"])
def test_predictions_are_those_of_the_model_in_inference(fused):
    """Exactly the model's numbers; up to the round-off of tf-keras' fused
    kernel where the model's conv layers run it (the copy's do not):
    1.9e-6 on outputs up to 10."""
    original = pretrained(8, fused=fused)
    converted = replace_batchnorm_layers(original)
    x = images(16, 8)
    want = original.predict(x, verbose=0)
    got = converted.predict(x, verbose=0)
    assert np.abs(want).max() > 1.0
    tol = 1e-5 if fused is None else 0.0
    np.testing.assert_allclose(got, want, atol=tol, rtol=0)
    eager = original(x, training=False)  # eager round-off is not predict's
    np.testing.assert_allclose(converted(x, training=False), eager, atol=tol, rtol=0)


def test_a_sequential_model():
    model = tf_keras.Sequential(
        [tf_keras.Input((3,)), layers.Dense(4), layers.BatchNormalization()]
    )
    model.layers[1].moving_mean.assign([1.0, 2.0, 3.0, 4.0])
    converted = replace_batchnorm_layers(model)
    assert isinstance(converted, tf_keras.Sequential)
    (norm,) = [x for x in converted.layers if isinstance(x, AccumBatchNormalization)]
    assert norm.accum_steps is None
    np.testing.assert_array_equal(norm.moving_mean, [1.0, 2.0, 3.0, 4.0])
    x = np.ones((2, 3), "float32")
    np.testing.assert_array_equal(converted(x), model(x))


@pytest.mark.parametrize("fused", [None, False], ids=["fused", "not-fused"])
def test_trains_with_the_big_batch_moving_statistics(fused):
    """In a GradientAccumulateModel of ``K`` micro-batches, the copy's moving
    statistics are those of the tf-keras model on the big batch, with the
    unbiased variance tf-keras' fused kernel gives the conv layers (the
    biased one with ``fused=False``)."""
    original = pretrained(6, branches, fused=fused)
    converted = replace_batchnorm_layers(
        GradientAccumulateModel(
            accum_steps=K, inputs=original.inputs, outputs=original.outputs
        )
    )
    assert isinstance(converted, GradientAccumulateModel)
    assert converted.accum_steps == K
    x, y = images(32, 7), np.zeros((32, 3), "float32")
    # A zero learning rate: the features each layer normalises stay the same.
    for model in (converted, original):
        model.compile(tf_keras.optimizers.SGD(0.0), "mse")
    converted.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    original.fit(x, y, batch_size=B * K, epochs=2, shuffle=False, verbose=0)
    assert int(converted.optimizer.iterations) == int(original.optimizer.iterations)

    old = batch_norms(original, layers.BatchNormalization)
    new = batch_norms(converted, AccumBatchNormalization)
    assert len(old) == len(new) == 3
    assert all(layer._accumulator.leader is converted._accumulator for layer in new)
    worst = 0.0
    for a, b in zip(old, new):
        for name in ("moving_mean", "moving_variance"):
            want, got = getattr(a, name).numpy(), getattr(b, name).numpy()
            np.testing.assert_allclose(got, want, atol=STAT_TOL, rtol=STAT_TOL)
            worst = max(worst, float(np.abs(got - want).max()))
    print(f"max |moving_accum - moving_big_batch| = {worst:.2e}")
    # Training moved the statistics far from the pretrained ones (0.5..1.5).
    assert max(np.abs(a.moving_variance.numpy() - 1).max() for a in old) > 1.0


def test_a_gradient_accumulate_model_keeps_its_settings_and_compile():
    inputs = tf_keras.Input((3,))
    h = layers.BatchNormalization()(layers.Dense(4)(inputs))
    model = GradientAccumulateModel(
        accum_steps=3,
        partial_cycle="drop",
        flush_at_end=False,
        inputs=inputs,
        outputs=layers.Dense(1)(h),
        name="wrapped",
    )
    model.compile(tf_keras.optimizers.Adam(0.01), "mse")
    converted = replace_batchnorm_layers(model)
    assert isinstance(converted, GradientAccumulateModel)
    assert converted.name == "wrapped"
    config = converted.get_config()
    assert (config["accum_steps"], config["partial_cycle"]) == (3, "drop")
    assert config["flush_at_end"] is False
    assert isinstance(converted.optimizer, tf_keras.optimizers.Adam)
    assert converted.optimizer.learning_rate.numpy() == pytest.approx(0.01)
    converted.fit(np.ones((6, 3)), np.ones((6, 1)), batch_size=2, verbose=0)
    assert int(converted.optimizer.iterations) == 1
    # Not compiled stays not compiled.
    plain = GradientAccumulateModel(accum_steps=2, inputs=inputs, outputs=h)
    assert replace_batchnorm_layers(plain).optimizer is None


def test_rejects_non_models_and_subclassed_models():
    with pytest.raises(TypeError, match=r"tf_keras\.Model"):
        replace_batchnorm_layers(layers.BatchNormalization(), 2)

    class Sub(tf_keras.Model):
        def __init__(self):
            super().__init__()
            self.norm = layers.BatchNormalization()

        def call(self, x):
            return self.norm(x)

    with pytest.raises(TypeError, match="subclassed"):
        replace_batchnorm_layers(Sub(), 2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"renorm": True}, "renorm=True"),
        ({"virtual_batch_size": 2}, "virtual_batch_size=2"),
        ({"synchronized": True}, "synchronized=True"),
        ({"adjustment": lambda shape: (1.0, 0.0)}, "adjustment="),
        ({"axis": [1, 2]}, "several axes"),
    ],
)
def test_options_accum_batch_normalization_lacks_are_refused(kwargs, match):
    model = tf_keras.Sequential(
        [tf_keras.Input((4, 3)), layers.BatchNormalization(name="norm", **kwargs)]
    )
    with pytest.raises(ValueError, match=f"'norm' .*{match}"):
        replace_batchnorm_layers(model)


def test_subclasses_of_batch_normalization_are_copied_unchanged():
    class Own(layers.BatchNormalization):
        pass

    inputs = tf_keras.Input((3,))
    model = tf_keras.Model(inputs, Own(name="own")(inputs))
    model.get_layer("own").moving_mean.assign([1.0, 2.0, 3.0])
    converted = replace_batchnorm_layers(model)
    copy = converted.get_layer("own")
    assert type(copy) is Own and copy is not model.get_layer("own")
    np.testing.assert_array_equal(copy.moving_mean, [1.0, 2.0, 3.0])
