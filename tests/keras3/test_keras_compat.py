"""The Keras / TensorFlow behaviour behind every private name the package uses.

``gradient_accumulator.keras3._compat`` holds every private Keras or
TensorFlow name the package relies on. Each name exported there has one test
here, ``test_<name>``, checking the behaviour the package relies on, so that
a Keras or TensorFlow release that changes it fails here, naming it, rather
than somewhere inside a train step. ``test_every_name_has_a_test`` keeps the
list complete.

Distributed checks use a one-device ``MirroredStrategy``: two logical CPUs
would have to be configured before TensorFlow initialises its devices, which
other test files in the same pytest worker may already have done.
"""

from __future__ import annotations

import inspect
import sys
import types
import zipfile

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator.keras3 import _compat as compat
from gradient_accumulator.keras3.flavour import FLAVOUR

# Public names of the module that are not Keras / TensorFlow names.
OWN_NAMES = {"KERAS_SPEC"}


def _says(name: str, what: str) -> str:
    return (
        f"keras3/_compat.{name}: {what} (Keras {keras.__version__}, "
        f"TensorFlow {tf.__version__}; tested with keras{compat.KERAS_SPEC})"
    )


def _one_device_strategy():
    return tf.distribute.MirroredStrategy(["/cpu:0"])


def _tiny_functional(name="tiny"):
    inputs = keras.Input((3,), name="x")
    hidden = keras.layers.Dense(4, activation="tanh", name="hidden")(inputs)
    outputs = keras.layers.Dense(2, name="out")(hidden)
    return keras.Model(inputs, outputs, name=name)


# ------------------------------------------------------------ completeness
def test_all_lists_every_public_name_of_the_module():
    defined = {
        name
        for name, value in vars(compat).items()
        if not name.startswith("_")
        and not inspect.ismodule(value)
        and not isinstance(value, type(annotations))  # __future__ features
    }
    assert set(compat.__all__) == defined - OWN_NAMES, (
        "keras3/_compat.__all__ must list exactly the module's Keras / "
        "TensorFlow names (each needs a test here)"
    )
    assert len(compat.__all__) == len(set(compat.__all__))


@pytest.mark.parametrize("name", compat.__all__)
def test_every_name_has_a_test(name):
    test = getattr(sys.modules[__name__], f"test_{name}", None)
    assert callable(test), f"keras3/_compat.{name} has no test_{name} in {__file__}"


def test_keras_version_is_in_the_tested_range():
    from packaging.specifiers import SpecifierSet

    assert keras.__version__ in SpecifierSet(compat.KERAS_SPEC), _says(
        "KERAS_SPEC", "the installed Keras is outside the tested range"
    )


# ------------------------------------------------------------ one per name
def test_GLOBAL_CUSTOM_NAMES():
    """model.py registers a private functional variant of a class under the
    public class's name: ``get_registered_name`` and serialisation must
    report that name."""

    class Variant(keras.layers.Layer):
        pass

    assert isinstance(compat.GLOBAL_CUSTOM_NAMES, dict), _says(
        "GLOBAL_CUSTOM_NAMES", "no longer a dict"
    )
    compat.GLOBAL_CUSTOM_NAMES[Variant] = "my_package>Public"
    try:
        assert keras.saving.get_registered_name(Variant) == "my_package>Public", _says(
            "GLOBAL_CUSTOM_NAMES", "get_registered_name ignores it"
        )
        config = keras.saving.serialize_keras_object(Variant(name="v"))
        assert config["registered_name"] == "my_package>Public", _says(
            "GLOBAL_CUSTOM_NAMES", "serialize_keras_object ignores it"
        )
    finally:
        del compat.GLOBAL_CUSTOM_NAMES[Variant]
    assert keras.saving.get_registered_name(Variant) == "Variant"


def test_Functional():
    """convert.py tells functional models by ``isinstance(.., Functional)``;
    model.py builds classes with ``(cls, Functional)`` as bases."""
    functional = _tiny_functional()

    class Subclassed(keras.Model):
        def call(self, x):
            return x

    assert isinstance(functional, compat.Functional), _says(
        "Functional", "keras.Model(inputs, outputs) is not an instance"
    )
    assert not isinstance(Subclassed(), compat.Functional), _says(
        "Functional", "a subclassed model is an instance"
    )
    assert issubclass(compat.Functional, keras.Model)

    class Mine(keras.Model):
        pass

    variant = type("Variant", (Mine, compat.Functional), {})
    model = variant(functional.input, functional.output)
    np.testing.assert_allclose(
        model(np.ones((1, 3), "float32")),
        functional(np.ones((1, 3), "float32")),
        err_msg=_says("Functional", "a class deriving from it runs differently"),
    )


def test_KerasSaveable(tmp_path):
    """The engine is a KerasSaveable with ``_obj_type`` "Layer" held as a
    model attribute: ``.keras`` files and ``save_weights`` must visit it
    (save_own_variables / load_own_variables) under the attribute's name."""

    class State(compat.KerasSaveable):
        def __init__(self, value):
            self.value = np.asarray(value, "float32")

        def _obj_type(self):
            return "Layer"

        def save_own_variables(self, store):
            store["value"] = self.value

        def load_own_variables(self, store):
            self.value = np.array(store["value"])

    model = _tiny_functional()
    model._extra_state = State([1.5, -2.5])
    model.save(tmp_path / "m.keras")
    model.save_weights(tmp_path / "m.weights.h5")
    with zipfile.ZipFile(tmp_path / "m.keras") as archive:
        archive.extract("model.weights.h5", tmp_path / "unzipped")
    for path in (tmp_path / "unzipped" / "model.weights.h5", tmp_path / "m.weights.h5"):
        with h5py.File(path) as file:
            assert "_extra_state/vars/value" in file, _says(
                "KerasSaveable", f"the saveable attribute is not in {path.name}"
            )
            np.testing.assert_array_equal(
                file["_extra_state/vars/value"][()], [1.5, -2.5]
            )

    other = _tiny_functional()
    other._extra_state = State([0.0, 0.0])
    other.load_weights(tmp_path / "m.weights.h5")
    np.testing.assert_array_equal(
        other._extra_state.value,
        [1.5, -2.5],
        err_msg=_says("KerasSaveable", "load_weights does not load it"),
    )
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert not hasattr(loaded, "_extra_state")  # a plain model ignores it


def test_all_layers():
    inner = _tiny_functional("inner")
    inputs = keras.Input((3,))
    outer = keras.Model(inputs, keras.layers.Dense(1, name="top")(inner(inputs)))
    layers = compat.all_layers(outer)
    names = [layer.name for layer in layers]
    assert layers[0] is outer, _says("all_layers", "does not start with the layer")
    for name in ("inner", "hidden", "out", "top"):
        assert name in names, _says("all_layers", f"misses the nested layer {name}")
    assert len(layers) == len({id(layer) for layer in layers})
    dense = keras.layers.Dense(1)
    assert compat.all_layers(dense) == [dense]


def test_apply_mask():
    """model.py weights a masked micro-batch by its masked sample weights
    (``mean_with_sample_weight``)."""
    mask = tf.constant([True, True, False, False])
    weights = tf.constant([1.0, 2.0, 3.0, 4.0])
    masked = compat.apply_mask(
        weights, mask, dtype="float32", reduction="mean_with_sample_weight"
    )
    np.testing.assert_array_equal(
        masked,
        [1.0, 2.0, 0.0, 0.0],
        err_msg=_says("apply_mask", "does not zero masked sample weights"),
    )
    # Mean reductions rescale valid entries by total / valid.
    rescaled = compat.apply_mask(
        None, mask, dtype="float32", reduction="sum_over_batch_size"
    )
    np.testing.assert_array_equal(rescaled, [2.0, 2.0, 0.0, 0.0])
    unmasked = compat.apply_mask(
        weights, None, dtype="float32", reduction="mean_with_sample_weight"
    )
    np.testing.assert_array_equal(unmasked, weights)


def test_call_has_training_arg():
    class WithTraining(keras.Model):
        def call(self, x, training=None):
            return x

    class WithoutTraining(keras.Model):
        def call(self, x):
            return x

    assert compat.call_has_training_arg(WithTraining()) is True, _says(
        "call_has_training_arg", "False for call(x, training=None)"
    )
    assert compat.call_has_training_arg(WithoutTraining()) is False, _says(
        "call_has_training_arg", "True for call(x)"
    )


def test_clone_initializer():
    """batch_norm.py clones the moving mean's initializer for a weight of
    its own (a new object, same configuration)."""
    initializer = keras.initializers.RandomNormal(mean=0.5, seed=3)
    clone = compat.clone_initializer(initializer)
    assert clone is not initializer, _says("clone_initializer", "returned the same")
    assert type(clone) is type(initializer)
    assert clone.get_config() == initializer.get_config(), _says(
        "clone_initializer", "changed the configuration"
    )
    assert compat.clone_initializer("zeros") == "zeros"


def test_distributed_container():
    """The engine keys a variable's buffer by its tf.distribute container, so
    a per-replica component must map to the variable it belongs to."""
    strategy = _one_device_strategy()
    with strategy.scope():
        variable = keras.Variable(np.zeros(2, "float32"))
    mirrored = variable.value
    assert isinstance(mirrored, tf.distribute.DistributedValues)
    component = mirrored.values[0]
    assert compat.distributed_container(mirrored) is mirrored, _says(
        "distributed_container", "does not return a distributed variable as is"
    )
    plain = tf.Variable(1.0)
    assert compat.distributed_container(plain) is plain
    assert compat.distributed_container(component) is mirrored, _says(
        "distributed_container",
        "does not map a replica's component to its MirroredVariable",
    )


def test_GraphRunHook():
    """clone_model runs the source model's graph, through the hook, before it
    builds the clone (the model wrapper leaves its settings for the clone
    there)."""
    runs = []

    class Hooked(compat.GraphRunHook, compat.Functional):
        def _before_graph_run(self):
            runs.append(self.name)

    inputs = keras.Input((3,))
    model = Hooked(inputs, keras.layers.Dense(2)(inputs), name="hooked")
    runs.clear()
    keras.models.clone_model(model)
    assert runs and runs[0] == "hooked", _says(
        "GraphRunHook", "clone_model did not run the graph through the hook"
    )


def test_compute_loss():
    """The model wrapper differentiates what Keras' train step does: the
    compiled loss plus the layers' regularisation losses."""
    inputs = keras.Input((2,))
    dense = keras.layers.Dense(1, kernel_regularizer=keras.regularizers.L2(0.5))
    model = keras.Model(inputs, dense(inputs))
    model.compile(loss="mse")
    x, y = np.ones((4, 2), "float32"), np.zeros((4, 1), "float32")
    y_pred = model(x)
    loss = compat.compute_loss(
        model, x=x, y=y, y_pred=y_pred, sample_weight=None, training=True
    )
    expected = np.mean(np.square(np.asarray(y_pred))) + 0.5 * np.sum(
        np.square(np.asarray(dense.kernel))
    )
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)


def test_batch_norm_moments():
    """AccumBatchNormalization pools the very moments Keras' layer uses."""
    layer = keras.layers.BatchNormalization()
    x = np.random.default_rng(0).normal(size=(6, 3)).astype("float32")
    layer.build(x.shape)
    mean, variance = compat.batch_norm_moments(layer, tf.constant(x), None)
    np.testing.assert_allclose(np.asarray(mean), x.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(variance), x.var(0), rtol=1e-5)


def test_batch_norm_reduction_axes():
    layer = keras.layers.BatchNormalization(axis=-1)
    layer.build((2, 5, 5, 4))
    assert list(compat.batch_norm_reduction_axes(layer)) == [0, 1, 2], _says(
        "batch_norm_reduction_axes", "does not list every axis but the channels"
    )


def test_optimizer_variable_tracker():
    """A variable tracked through it is the optimizer's own and is saved."""
    optimizer = keras.optimizers.SGD()
    optimizer.build([keras.Variable(np.zeros(2, "float32"))])
    extra = keras.Variable(np.ones(1, "float32"), trainable=False)
    compat.optimizer_variable_tracker(optimizer)(extra)
    assert any(v is extra for v in optimizer.variables)
    assert any(v is extra for v in compat.optimizer_own_variables(optimizer))


def test_optimizer_own_variables():
    optimizer = keras.optimizers.Adam()
    optimizer.build([keras.Variable(np.zeros(2, "float32"))])
    own = compat.optimizer_own_variables(optimizer)
    assert [v.path for v in own] == [v.path for v in optimizer.variables]


def test_optimizer_built_variables():
    weights = [keras.Variable(np.zeros(2, "float32"))]
    optimizer = keras.optimizers.SGD()
    optimizer.build(weights)
    assert list(compat.optimizer_built_variables(optimizer)) == weights


def test_keras_mask():
    """The loss weighting reads the mask Keras attaches to an output (an
    Embedding with ``mask_zero``), the one Keras' losses apply."""
    inputs = keras.Input((3,), dtype="int32")
    hidden = keras.layers.Embedding(5, 2, mask_zero=True)(inputs)
    outputs = keras.layers.Dense(1)(hidden)
    model = keras.Model(inputs, outputs)
    y_pred = model(np.array([[1, 0, 2]]))
    mask = compat.keras_mask(y_pred)
    assert mask is not None, _says("keras_mask", "found no mask on a masked output")
    np.testing.assert_array_equal(np.asarray(mask), [[True, False, True]])
    assert compat.keras_mask(tf.constant([1.0])) is None


def test_with_keras_mask():
    """The tf-keras model wrapper hands Keras' losses an output under another
    mask (``with_keras_mask``): the loss reads that mask, and gradients flow
    through to the output."""
    from gradient_accumulator.core._tf_compat import with_keras_mask

    y_pred = tf.Variable([[1.0], [3.0]])
    mask = tf.constant([True, False])
    loss = keras.losses.MeanSquaredError()
    with tf.GradientTape() as tape:
        masked = with_keras_mask(tf.convert_to_tensor(y_pred), mask)
        value = loss(tf.zeros((2, 1)), masked)
    assert compat.keras_mask(masked) is mask
    assert float(value) == 1.0, _says("with_keras_mask", "the loss ignored the mask")
    np.testing.assert_allclose(tape.gradient(value, y_pred), [[2.0], [0.0]])


def test_flat_losses():
    """model.py reads the compiled loss terms: ``.loss`` (with its
    ``reduction``) and ``.path``, the output a term applies to."""
    inputs = keras.Input((2,))
    outputs = {
        "a": keras.layers.Dense(1, name="a")(inputs),
        "b": keras.layers.Dense(3, name="b")(inputs),
    }
    model = keras.Model(inputs, outputs)
    assert compat.flat_losses(model) == []
    model.compile(
        optimizer="sgd",
        loss={
            "a": "mse",
            "b": keras.losses.SparseCategoricalCrossentropy(reduction="sum"),
        },
    )
    x = np.ones((4, 2), "float32")
    y = {"a": np.zeros((4, 1), "float32"), "b": np.zeros((4,), "int32")}
    model.train_on_batch(x, y)
    terms = compat.flat_losses(model)
    assert len(terms) == 2, _says("flat_losses", "not one term per loss")
    by_path = {tuple(term.path): term for term in terms}
    assert set(by_path) == {("a",), ("b",)}, _says(
        "flat_losses", "paths do not name the outputs"
    )
    assert by_path[("b",)].loss.reduction == "sum"
    assert by_path[("a",)].loss.reduction == "sum_over_batch_size"
    predictions = model(x)
    for path in by_path:
        structure = predictions
        for key in path:
            structure = structure[key]
        assert structure.shape[0] == 4
    assert compat.flat_losses(keras.layers.Dense(1)) == []


def test_functional_from_config():
    source = _tiny_functional()
    rebuilt = compat.functional_from_config(keras.Model, source.get_config())
    assert isinstance(rebuilt, compat.Functional), _says(
        "functional_from_config", "did not build a functional model"
    )
    assert [layer.name for layer in rebuilt.layers] == [
        layer.name for layer in source.layers
    ]
    rebuilt.set_weights(source.get_weights())
    x = np.arange(6, dtype="float32").reshape(2, 3)
    np.testing.assert_allclose(
        rebuilt(x),
        source(x),
        err_msg=_says("functional_from_config", "the rebuilt model differs"),
    )


def test_functional_init_arguments():
    inputs = keras.Input((1,))
    outputs = keras.layers.Dense(1)(inputs)
    yes = [
        ((inputs, outputs), {}),
        ((inputs,), {"outputs": outputs}),
        ((), {"inputs": inputs, "outputs": outputs, "name": "m"}),
    ]
    no = [((), {}), ((), {"name": "m"}), ((inputs,), {})]
    for args, kwargs in yes:
        assert compat.functional_init_arguments(args, kwargs), _says(
            "functional_init_arguments", f"not functional: {len(args)} args"
        )
    for args, kwargs in no:
        assert not compat.functional_init_arguments(args, kwargs), _says(
            "functional_init_arguments", f"functional: {args}, {sorted(kwargs)}"
        )


def test_loss_tracker():
    """model.py updates the Mean behind fit's ``loss`` log itself."""
    model = _tiny_functional()
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    x = np.ones((4, 3), "float32")
    y = np.full((4, 2), 2.0, "float32")
    logs = model.train_on_batch(x, y, return_dict=True)
    tracker = compat.loss_tracker(model)
    assert isinstance(tracker, keras.metrics.Mean), _says(
        "loss_tracker", "not a keras.metrics.Mean"
    )
    assert tracker in model.metrics
    np.testing.assert_allclose(float(tracker.result()), logs["loss"], rtol=1e-6)
    tracker.reset_state()
    tracker.update_state(3.0, sample_weight=1.0)
    tracker.update_state(6.0, sample_weight=2.0)
    assert float(model.get_metrics_result()["loss"]) == pytest.approx(5.0), _says(
        "loss_tracker", "its result is not the logged loss"
    )


def test_on_device_or_primary():
    """A replica-local (SyncOnRead) variable refuses scatter ops; its
    replica's component, which on_device_or_primary returns, takes them."""
    strategy = _one_device_strategy()
    with strategy.scope():
        variable = keras.Variable(
            np.zeros(3, "float32"),
            trainable=False,
            synchronization="on_read",
            aggregation="sum",
        )
    local = variable.value
    rows = tf.IndexedSlices(
        tf.constant([2.0]), tf.constant([1]), tf.constant([3], tf.int64)
    )
    with pytest.raises(NotImplementedError):
        local.scatter_add(rows)

    @tf.function
    def scatter():
        def replica():
            component = compat.on_device_or_primary(local)
            assert not isinstance(component, tf.distribute.DistributedValues), _says(
                "on_device_or_primary", "returned a distributed value"
            )
            component.scatter_add(rows)

        strategy.run(replica)

    scatter()
    np.testing.assert_array_equal(
        variable.numpy(),
        [0.0, 2.0, 0.0],
        err_msg=_says("on_device_or_primary", "the scatter did not land"),
    )
    assert compat.on_device_or_primary(local) is local.values[0]


def test_seed_generators():
    """Keras' random layers hold the seed generators they draw from; the
    others hold none."""
    for layer in (
        keras.layers.Dropout(0.5),
        keras.layers.GaussianNoise(0.1),
        keras.layers.RandomFlip(),
    ):
        assert compat.seed_generators(layer), _says("seed_generators", str(layer))
    for layer in (keras.layers.Dense(2), keras.layers.BatchNormalization()):
        assert compat.seed_generators(layer) == [], _says("seed_generators", str(layer))


def test_call_losses():
    """A layer's call-time losses (activity regulariser), one per call, not
    its weights' penalties: what gradient_cache refuses."""
    active = keras.layers.Dense(2, activity_regularizer=keras.regularizers.L2(0.1))
    penalised = keras.layers.Dense(2, kernel_regularizer=keras.regularizers.L2(0.1))
    inputs = keras.Input((3,))
    model = keras.Model(inputs, penalised(active(inputs)))
    x = np.ones((4, 3), "float32")
    for call in (model, tf.function(model)):
        call(x, training=True)
        call(x, training=True)
        assert len(compat.call_losses(active)) == 1, _says("call_losses", "activity")
        assert compat.call_losses(penalised) == [], _says("call_losses", "penalty")
    assert len(model.losses) == 2  # what call_losses leaves out is still there


def test_set_all_reduce():
    """inner_optimizers.py replaces, per instance, the hook through which Keras'
    TensorFlow optimizer sums gradients in ``apply``, and restores it."""
    name = "_all_reduce_sum_gradients"
    optimizer = keras.optimizers.SGD(1.0)
    assert callable(getattr(type(optimizer), name, None)), _says(
        "set_all_reduce", f"Keras' TF optimizer has no {name}"
    )
    variable = keras.Variable(np.zeros(2, "float32"))
    optimizer.build([variable])
    grad = tf.constant([1.0, 2.0])

    seen = []

    def times_ten(grads_and_vars):
        seen.append(len(grads_and_vars))
        return [(g * 10.0, v) for g, v in grads_and_vars]

    compat.set_all_reduce(optimizer, times_ten)
    assert name in vars(optimizer)
    optimizer.apply([grad], [variable])
    assert seen == [1], _says("set_all_reduce", "apply does not call the hook")
    np.testing.assert_array_equal(variable.numpy(), [-10.0, -20.0])
    compat.set_all_reduce(optimizer, None)
    assert name not in vars(optimizer), _says("set_all_reduce", "not restored")
    optimizer.apply([grad], [variable])
    np.testing.assert_array_equal(variable.numpy(), [-11.0, -22.0])

    # Under a strategy, apply in replica context goes through the hook too.
    strategy = _one_device_strategy()
    with strategy.scope():
        distributed = keras.Variable(np.zeros(2, "float32"))
        mirrored_optimizer = keras.optimizers.SGD(1.0)
        mirrored_optimizer.build([distributed])
    compat.set_all_reduce(mirrored_optimizer, times_ten)

    @tf.function
    def apply():
        strategy.run(lambda: mirrored_optimizer.apply([grad], [distributed]))

    apply()
    assert seen == [1, 1], _says("set_all_reduce", "not called under a strategy")
    np.testing.assert_array_equal(distributed.numpy(), [-10.0, -20.0])
    compat.set_all_reduce(mirrored_optimizer, None)
    assert name not in vars(mirrored_optimizer)


def test_track_variable():
    """batch_norm.py adds the engine's variables to a layer that Keras
    already built (and whose tracker it locked)."""
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    assert layer._tracker.locked, _says(
        "track_variable", "a built layer's tracker is not locked any more"
    )
    variable = keras.Variable(np.zeros(2, "float32"), trainable=False)
    compat.track_variable(layer, variable)
    assert any(w is variable for w in layer.non_trainable_weights), _says(
        "track_variable", "the variable is not among the layer's weights"
    )
    assert len(layer.weights) == 3
    assert layer._tracker.locked, _says("track_variable", "left the tracker open")


def test_unscale_loss_for_distribution(monkeypatch):
    """model.py undoes, with it, the division by the replica count that
    Keras' loss computation applies under a strategy; without a strategy (or
    with one replica) the loss is unchanged."""
    from keras.src.losses.loss import scale_loss_for_distribution

    loss = tf.constant(1.25)
    assert float(compat.unscale_loss_for_distribution(loss)) == 1.25, _says(
        "unscale_loss_for_distribution", "changed the loss without a strategy"
    )
    with _one_device_strategy().scope():
        assert float(compat.unscale_loss_for_distribution(loss)) == 1.25

    # Two replicas, as Keras sees them (a real second device cannot be set up
    # here once TensorFlow has initialised its devices).
    monkeypatch.setattr(
        tf.distribute,
        "get_strategy",
        lambda: types.SimpleNamespace(num_replicas_in_sync=2),
    )
    assert float(compat.unscale_loss_for_distribution(loss)) == 2.5, _says(
        "unscale_loss_for_distribution", "does not multiply by the replica count"
    )
    assert float(scale_loss_for_distribution(loss)) == 0.625
    roundtrip = compat.unscale_loss_for_distribution(scale_loss_for_distribution(loss))
    assert float(roundtrip) == 1.25, _says(
        "unscale_loss_for_distribution", "does not undo Keras' loss scaling"
    )


def test_loss_scaler_marks_the_optimizer_it_wraps():
    """Keras' LossScaleOptimizer sets ``loss_scale_factor = None`` on the
    optimizer it wraps, once, when it is made: the sign the optimizer wrapper
    refuses it by (``FLAVOUR.marks_wrapped_optimizer``)."""
    seen = []

    class Probe(keras.optimizers.SGD):
        def __setattr__(self, name, value):
            if FLAVOUR.marks_wrapped_optimizer(name, value):
                seen.append(name)
            super().__setattr__(name, value)

    probe = Probe(0.1)
    seen.clear()  # Keras' own constructor sets the factor it was given
    keras.optimizers.LossScaleOptimizer(probe)
    assert seen == ["loss_scale_factor"], _says(
        "LossScaleOptimizer",
        "no longer turns off its inner optimizer's loss_scale_factor",
    )
