"""``accumulate(model)`` and ``stop_accumulating``, in each Keras: a model
compiled before it accumulates at its next ``fit``; what it refuses, and how
it says so. (Exactness, saving and undo per Keras: tests/test_accumulate.py,
tests/keras2/test_accumulate.py.)"""

from __future__ import annotations

import pytest

from gradient_accumulator import (
    GradientAccumulateModel,
    accumulate,
    stop_accumulating,
)
from tests.flavour import LEGACY_KERAS, keras, utils

B = 4  # micro-batch
K = 4  # micro-batches per update


class OwnStep(keras.Model):
    """A model whose class overrides ``train_step``: refused."""

    def train_step(self, data):
        return super().train_step(data)


def _compile(model):
    schedule = keras.optimizers.schedules.ExponentialDecay(0.02, 2, 0.5)
    model.compile(optimizer=keras.optimizers.Adam(schedule), loss=utils.sparse_ce())


def test_compile_before_accumulate_then_fit_accumulates():
    """accumulate() after compile: the next fit accumulates (no stale step)."""
    plain, model = utils.seeded(utils.plain_model), utils.seeded(utils.plain_model)
    for m in (plain, model):
        _compile(m)
    x, y = utils.classification_data(32)
    utils.fit(model, x[:8], y[:8], B * K)  # a plain step, traced
    utils.fit(plain, x[:8], y[:8], B * K)
    accumulate(model, accum_steps=K)
    utils.fit(model, x, y, B)
    utils.fit(plain, x, y, B * K)
    assert int(model.optimizer.iterations) == int(plain.optimizer.iterations) == 3
    utils.report(utils.assert_same_weights(utils.weights(model), utils.weights(plain)))


# ------------------------------------------------------------- refusals
def test_a_class_that_overrides_train_step_is_refused():
    model = OwnStep(*utils.mlp_layers())
    with pytest.raises(ValueError, match="train_step"):
        accumulate(model, accum_steps=K)
    assert type(model) is OwnStep


def test_an_accumulating_model_is_refused():
    model = accumulate(utils.plain_model(), accum_steps=2)
    with pytest.raises(ValueError, match="stop_accumulating"):
        accumulate(model, accum_steps=K)
    inputs, outputs = utils.mlp_layers()
    wrapper = GradientAccumulateModel(2, inputs=inputs, outputs=outputs)
    with pytest.raises(ValueError, match="accumulates already"):
        accumulate(wrapper)


BAD_ARGUMENTS = [
    ({"accum_steps": 0}, ValueError, "`accum_steps`"),
    ({"accum_steps": 2.5}, TypeError, "`accum_steps`"),
    ({"partial_cycle": "sometimes"}, ValueError, "`partial_cycle`"),
    ({"flush_at_end": "yes"}, TypeError, "`flush_at_end`"),
    ({"use_agc": True, "clip_factor": -1.0}, ValueError, "`clip_factor`"),
]
if LEGACY_KERAS:  # tf-keras has no in-step mode
    BAD_ARGUMENTS += [
        ({"micro_batch_size": 2}, TypeError, "micro_batch_size"),
        ({"accum_step": 2}, TypeError, "accum_step"),
    ]
else:
    BAD_ARGUMENTS += [({"micro_batch_size": 0}, ValueError, "`micro_batch_size`")]


def test_bad_arguments_name_the_argument_and_leave_the_model_alone():
    model = utils.sequential_mlp()
    for settings, error, name in BAD_ARGUMENTS:
        with pytest.raises(error, match=name):
            accumulate(model, **settings)
        assert type(model) is keras.Sequential
        assert not hasattr(model, "_accumulator")
    for thing in (None, "model", keras.layers.Dense(2)):
        with pytest.raises(TypeError, match="`model`"):
            accumulate(thing, accum_steps=K)


def test_stop_accumulating_a_plain_model_is_a_value_error():
    with pytest.raises(ValueError, match="accumulate"):
        stop_accumulating(utils.plain_model())
