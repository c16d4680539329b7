"""How a ``GradientAccumulateModel`` class becomes functional, in each Keras:
built from ``inputs``/``outputs`` it leaves every class as it was (Keras
would rewrite a subclass's bases for the whole process), the same class can
still be subclassed with a ``call``, and a file saved by a subclass that
sets ``accum_steps`` itself loads with the saved value."""

from __future__ import annotations

import numpy as np

from gradient_accumulator import GradientAccumulateModel
from tests.flavour import keras

B = 4


def _graph():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    return inputs, keras.layers.Dense(2)(inputs)


class FixedSteps(GradientAccumulateModel):
    """Sets a setting itself, as docs/model-wrapper.md shows."""

    def __init__(self, **kwargs):
        super().__init__(accum_steps=4, **kwargs)


class Called(GradientAccumulateModel):
    """The other way to subclass: layers and a ``call``."""

    def __init__(self, **kwargs):
        super().__init__(accum_steps=2, **kwargs)
        self.dense = keras.layers.Dense(2)

    def call(self, inputs):
        return self.dense(inputs)


def test_functional_construction_leaves_every_class_as_it_was():
    bases = {cls: cls.__bases__ for cls in (GradientAccumulateModel, FixedSteps)}
    inputs, outputs = _graph()
    model = GradientAccumulateModel(accum_steps=2, inputs=inputs, outputs=outputs)
    fixed = FixedSteps(inputs=inputs, outputs=outputs)
    assert {cls: cls.__bases__ for cls in bases} == bases
    for built, cls in ((model, GradientAccumulateModel), (fixed, FixedSteps)):
        assert isinstance(built, cls) and type(built).__name__ == cls.__name__
        assert len(built.layers) == 2, built.layers  # the functional graph
    assert (model.accum_steps, fixed.accum_steps) == (2, 4)
    # The same base class still subclasses with a call, in the same process.
    keras.utils.set_random_seed(0)
    called = Called()
    called.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 2), "float32")
    called.fit(x, y, batch_size=B, verbose=0)
    assert int(called.optimizer.iterations) == 1
    assert type(called) is Called


def test_a_file_saved_after_a_schedule_loads_with_the_saved_accum_steps(tmp_path):
    name = FixedSteps.__name__  # as saved files name a custom class
    custom = keras.utils.get_custom_objects()
    custom[name] = FixedSteps
    try:
        inputs, outputs = _graph()
        model = FixedSteps(inputs=inputs, outputs=outputs)
        model.compile(optimizer="sgd", loss="mse")
        model.set_accum_steps(2)  # as AccumulationScheduler does between cycles
        path = tmp_path / "fixed.keras"
        model.save(path)
        loaded = keras.models.load_model(path)
    finally:
        custom.pop(name)
    assert isinstance(loaded, FixedSteps)
    assert loaded.accum_steps == 2
    assert loaded.get_config()["accum_steps"] == 2


def test_a_clone_of_a_subclass_takes_the_sources_accum_steps():
    """``clone_model`` of a subclass that sets ``accum_steps`` itself, after a
    schedule changed it: the clone accumulates as the source does now (as
    a plain model's clone is built like its source)."""
    inputs, outputs = _graph()
    model = FixedSteps(inputs=inputs, outputs=outputs)
    model.set_accum_steps(2)
    clone = keras.models.clone_model(model)
    assert type(clone).__name__ == "FixedSteps"
    assert clone.accum_steps == 2
