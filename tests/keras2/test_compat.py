"""Each private tf-keras name the tf-keras hosts rely on
(``gradient_accumulator/keras2/_compat.py``) behaves as they need, and the
package's public names are the tf-keras hosts where ``tf.keras`` is tf-keras."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import gradient_accumulator as ga
from gradient_accumulator.keras2 import _compat as compat


def _functional():
    inputs = tf_keras.Input((3,))
    hidden = tf_keras.layers.Dense(4, name="hidden")(inputs)
    return tf_keras.Model(
        inputs,
        [
            tf_keras.layers.Dense(1, name="a")(hidden),
            tf_keras.layers.Dense(2, name="b")(hidden),
        ],
    )


def test_functional_config_rebuilds_the_network():
    model = _functional()
    config = compat.functional_config(model)
    assert {"layers", "input_layers", "output_layers"} <= set(config)
    inputs, outputs, _ = compat.reconstruct_from_config(config)
    clone = tf_keras.Model(inputs, outputs)
    clone.set_weights(model.get_weights())
    x = np.ones((2, 3), "float32")
    for got, want in zip(clone(x), model(x)):
        np.testing.assert_array_equal(got, want)


def test_functional_config_is_none_for_a_subclassed_model():
    class Sub(tf_keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = tf_keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

    assert compat.functional_config(Sub()) is None


def test_loss_terms_follow_the_flattened_outputs():
    model = _functional()
    # By output name: aligned with the outputs once the compiled loss ran.
    model.compile("sgd", loss={"b": tf_keras.losses.MeanSquaredError(reduction="sum")})
    x = np.ones((2, 3), "float32")
    y = [tf.ones((2, 1)), tf.ones((2, 2))]
    model.compiled_loss(y, model(x))
    terms = compat.loss_terms(model)
    assert [t.path for t in terms] == [(1,)]
    assert terms[0].loss.reduction == "sum"


def test_public_names_are_the_tf_keras_hosts():
    assert issubclass(ga.GradientAccumulateModel, tf_keras.Model)
    assert issubclass(ga.GradientAccumulateOptimizer, tf_keras.optimizers.Optimizer)
    assert tf.keras.Model is tf_keras.Model


def test_names_not_yet_ported_say_so():
    with pytest.raises(ImportError, match="not available for tf-keras yet"):
        from gradient_accumulator import AccumBatchNormalization  # noqa: F401
