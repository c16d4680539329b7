"""Each private tf-keras name the tf-keras hosts rely on
(``gradient_accumulator/keras2/_compat.py``) behaves as they need, and the
package's public names are the tf-keras hosts where ``tf.keras`` is tf-keras."""

import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import gradient_accumulator as ga
from gradient_accumulator.keras2 import _compat as compat
from tests.processes import TIMEOUT, describe, run_script


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


def test_the_keras_3_only_name_says_so():
    with pytest.raises(ImportError, match="not available for tf-keras"):
        from gradient_accumulator import Accumulator  # noqa: F401


def test_draws_random_tells_the_layers_that_draw_random_numbers():
    for layer in (
        tf_keras.layers.Dropout(0.5),
        tf_keras.layers.GaussianNoise(0.1),
        tf_keras.layers.RandomFlip(),
    ):
        assert compat.draws_random(layer), layer
    for layer in (
        tf_keras.layers.Dense(2),
        tf_keras.layers.BatchNormalization(),
        tf_keras.layers.LayerNormalization(),
    ):
        assert not compat.draws_random(layer), layer


def test_call_losses_are_a_layers_call_time_losses_only():
    """A layer's call-time losses (activity regulariser), one per call, not
    its weights' penalties: what gradient_cache refuses."""
    active = tf_keras.layers.Dense(
        2, activity_regularizer=tf_keras.regularizers.L2(0.1)
    )
    penalised = tf_keras.layers.Dense(
        2, kernel_regularizer=tf_keras.regularizers.L2(0.1)
    )
    inputs = tf_keras.Input((3,))
    model = tf_keras.Model(inputs, penalised(active(inputs)))
    x = np.ones((4, 3), "float32")
    for call in (model, tf.function(model)):
        call(x, training=True)
        call(x, training=True)
        assert len(compat.call_losses(active)) == 1
        assert compat.call_losses(penalised) == []


def test_is_compiled_tells_a_compiled_model():
    model = tf_keras.Sequential([tf_keras.Input((2,)), tf_keras.layers.Dense(1)])
    assert not compat.is_compiled(model)
    model.compile(optimizer="sgd", loss="mse")
    assert compat.is_compiled(model)


def test_global_custom_names_name_a_class_in_saved_files():
    class Private(tf_keras.Model):
        pass

    compat.GLOBAL_CUSTOM_NAMES[Private] = "tests>Private"
    try:
        assert tf_keras.saving.get_registered_name(Private) == "tests>Private"
    finally:
        del compat.GLOBAL_CUSTOM_NAMES[Private]


def test_config_as_gives_the_config_of_the_base_class():
    class Variant(type(_functional())):
        def __init__(self, setting=1, **kwargs):
            super().__init__(**kwargs)

    model = _functional()
    want = model.get_config()
    model.__class__ = type("Variant", (Variant,), {})
    assert compat.config_as(model, Variant.__mro__[1]) == want
    # tf-keras itself gives the network config only to functional constructors.
    assert "layers" not in model.get_config()


def test_track_state_checkpoints_it_outside_the_weights(tmp_path):
    model = _functional()
    state = tf.Module()
    state.counter = tf.Variable(3)
    compat.track_state(model, "_state", state)
    assert len(model.weights) == 6  # three Dense layers: kernels and biases
    assert all(w is not state.counter for w in model.weights)
    path = tf.train.Checkpoint(model=model).save(tmp_path / "ckpt")
    names = [name for name, _ in tf.train.list_variables(path)]
    assert any(name.startswith("model/_state/counter") for name in names), names
    compat.untrack_state(model, "_state")
    path = tf.train.Checkpoint(model=model).save(tmp_path / "ckpt2")
    assert not any("_state" in n for n, _ in tf.train.list_variables(path))


def test_loss_scale_variable_is_the_scale():
    scaler = tf_keras.mixed_precision.LossScaleOptimizer(
        tf_keras.optimizers.SGD(), initial_scale=8.0
    )
    variable = compat.loss_scale_variable(scaler)
    variable.assign(4.0)
    assert float(scaler.loss_scale) == 4.0


def test_functional_is_the_class_of_functional_models():
    assert isinstance(_functional(), compat.Functional)
    assert not isinstance(tf_keras.Sequential(), compat.Functional) or (
        compat.Functional in type(tf_keras.Sequential()).__mro__
    )


@pytest.mark.parametrize(
    "make", [tf_keras.optimizers.SGD, tf_keras.optimizers.legacy.SGD]
)
def test_marks_wrapped_optimizer_is_what_a_loss_scaler_sets(make):
    """tf-keras' LossScaleOptimizer (current and legacy) marks the optimizer
    it wraps with the flag ``marks_wrapped_optimizer`` recognises, once."""
    seen = []

    class Inner(make):
        def __setattr__(self, name, value):
            if compat.marks_wrapped_optimizer(name, value):
                seen.append(name)
            super().__setattr__(name, value)

    inner = Inner()
    assert not seen
    tf_keras.mixed_precision.LossScaleOptimizer(inner)
    assert len(seen) == 1


# ------------------------------------------- TensorFlow Model Optimization
def _pruned_model():
    from tensorflow_model_optimization.sparsity import keras as sparsity

    inputs = tf_keras.Input((3,))
    hidden = tf_keras.layers.Dense(4)(inputs)
    outputs = sparsity.prune_low_magnitude(tf_keras.layers.Dense(2))(hidden)
    return tf_keras.Model(inputs, outputs)


def test_update_pruning_step_is_tfmots_callback():
    from tensorflow_model_optimization.sparsity import keras as sparsity

    assert type(compat.update_pruning_step()) is sparsity.UpdatePruningStep


def test_update_pruning_step_without_tfmot_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_model_optimization.sparsity", None)
    with pytest.raises(ImportError, match="pip install tensorflow-model-optimization"):
        compat.update_pruning_step()


def test_prunable_layers_are_the_wrappers_the_callback_collected():
    model = _pruned_model()
    callback = compat.update_pruning_step()
    callback.set_model(model)
    assert compat.prunable_layers(callback) == []
    callback.on_train_begin()
    assert compat.prunable_layers(callback) == [model.layers[-1]]


def test_pruning_step_is_the_step_a_training_call_advances():
    model = _pruned_model()
    step = compat.pruning_step(model.layers[-1])
    assert step.dtype == tf.int64 and int(step) == -1
    step.assign(4)
    model(np.ones((2, 3), "float32"), training=True)
    assert int(step) == 5
    model(np.ones((2, 3), "float32"), training=False)
    assert int(step) == 5


def test_model_optimization_tells_tfmots_layers():
    import tensorflow_model_optimization as tfmot

    pruned = _pruned_model()
    kind, step = compat.model_optimization(pruned.layers[-1])
    assert kind == "pruning" and step is compat.pruning_step(pruned.layers[-1])
    assert compat.model_optimization(pruned.layers[1]) is None
    quantized = tfmot.quantization.keras.quantize_model(
        tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(2)])
    )
    names = {
        type(layer).__name__: compat.model_optimization(layer)
        for layer in quantized.layers
    }
    assert names == {
        "QuantizeLayer": ("quantization", None),
        "QuantizeWrapperV2": ("quantization", None),
    }


def test_tfmot_is_imported_by_the_callback_not_the_package():
    script = (
        "import sys, gradient_accumulator as ga\n"
        "cls = ga.PruningStepPerUpdate\n"
        "assert 'tensorflow_model_optimization' not in sys.modules\n"
        "cls()\n"
        "assert 'tensorflow_model_optimization' in sys.modules\n"
        "print('imported on use')\n"
    )
    result = run_script("-c", script, timeout=TIMEOUT)
    assert result.returncode == 0, describe(result)
    assert "imported on use" in result.stdout, describe(result)
