"""``accumulate(model)`` and ``stop_accumulating``, in each Keras: a model
compiled before it accumulates at its next ``fit``; the model wrapper over
the optimizer wrapper warns and updates every product; ``stop_accumulating``
returns a model to plain training; what they refuse, and how they say so.
(Exactness and saving per Keras: tests/keras3/test_accumulate.py,
tests/keras2/test_accumulate.py.)"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from gradient_accumulator import (
    GradientAccumulateModel,
    GradientAccumulateOptimizer,
    accumulate,
    stop_accumulating,
)
from gradient_accumulator.core.settings import Settings
from tests.flavour import LEGACY_KERAS, keras, utils

# accum_steps first, then accumulate()'s keyword order.
_ORDER = (
    "accum_steps",
    "micro_batch_size",
    "gradient_cache",
    "partial_cycle",
    "flush_at_end",
    "skip_update_fn",
    "progress_logs",
    "use_agc",
    "clip_factor",
    "eps",
    "loss_denominator",
)
SETTINGS_FIELDS = sorted(
    dataclasses.fields(Settings), key=lambda field: _ORDER.index(field.name)
)
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


# ------------------------------------------- model wrapper + optimizer wrapper
def test_model_wrapper_with_optimizer_wrapper_warns_and_updates_every_product():
    """Both wrappers accumulate: exact for a big batch of 2 x 2 micro-batches
    (the plain model on batches of 4 micro-batches), but not what one who
    wrapped both meant, so ``compile`` (and ``accumulate`` of a compiled
    model) warn, naming the product."""
    micro = 8 if LEGACY_KERAS else 4  # each Keras' suite had its own
    x, y = utils.classification_data(64)
    plain = utils.seeded(utils.plain_model)
    initial = utils.weights(plain)
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss=utils.sparse_ce())
    utils.fit(plain, x, y, 4 * micro)
    model = utils.seeded(lambda: utils.accumulating_model(accum_steps=2))
    inner = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=2)
    with pytest.warns(UserWarning, match="every 4 micro-batches") as warned:
        model.compile(optimizer=inner, loss=utils.sparse_ce())
    assert warned[0].filename == __file__  # names the user's compile line
    utils.fit(model, x, y, micro)
    assert int(model.optimizer.iterations) == 64 // (4 * micro)
    utils.assert_trained(initial, utils.weights(model))
    utils.assert_same_weights(utils.weights(model), utils.weights(plain))

    compiled = utils.seeded(utils.plain_model)
    compiled.compile(
        optimizer=GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), 2),
        loss=utils.sparse_ce(),
    )
    with pytest.warns(UserWarning, match="every 6 micro-batches") as warned:
        accumulate(compiled, accum_steps=3)
    assert warned[0].filename == __file__


# ----------------------------------------------------------------- undo
@pytest.mark.parametrize("flush", [True, False], ids=["flush", "drop"])
@pytest.mark.parametrize("kind", ["functional", "sequential"])
def test_stop_accumulating_returns_it_to_plain_training(kind, flush, tmp_path):
    """The pending cycle is applied (or, with ``flush=False``, dropped), the
    class is the model's own again, no accumulation state is left in it,
    and it trains (one update per batch), saves and accumulates again as a
    plain model."""
    build = {"functional": utils.plain_model, "sequential": utils.sequential_mlp}
    plain = utils.seeded(build[kind])
    own = type(plain)
    model = accumulate(utils.seeded(build[kind]), accum_steps=K, flush_at_end=False)
    utils.assert_same_weights(utils.weights(model), utils.weights(plain), 0.0)
    assert type(model)._accumulated_class is own
    for m in (plain, model):
        _compile(m)
    x, y = utils.classification_data(48)
    utils.fit(model, x[:24], y[:24], B)
    assert model._accumulator.pending == 2
    assert stop_accumulating(model, flush=flush) is model
    assert type(model) is own
    assert not isinstance(model, GradientAccumulateModel)
    assert not hasattr(model, "_accumulator")
    assert "_accumulator" not in model._trackable_children()
    assert "accum_steps" not in model.get_config()
    # Batches of 16 and 8: the same updates (without the 8 when dropped).
    n = 24 if flush else 16
    utils.fit(plain, x[:n], y[:n], B * K)
    utils.assert_same_weights(utils.weights(model), utils.weights(plain))

    for m in (plain, model):
        _compile(m)
    utils.fit(model, x[24:], y[24:], B)
    utils.fit(plain, x[24:], y[24:], B)
    assert int(model.optimizer.iterations) == int(plain.optimizer.iterations) == 6
    utils.report(utils.assert_same_weights(utils.weights(model), utils.weights(plain)))

    path = tmp_path / "plain.keras"
    model.save(path)
    assert type(keras.models.load_model(path)) is own
    # And it can accumulate again.
    assert isinstance(accumulate(model, accum_steps=2), GradientAccumulateModel)


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


def test_signature_is_the_settings_with_their_defaults_in_either_keras():
    """One signature in both Kerases: the model, then every setting of the
    model wrapper by name, each defaulting to ``Settings``' value (tf-keras
    took ``**settings`` before, and refused ``micro_batch_size`` by a list)."""
    parameters = inspect.signature(accumulate).parameters
    assert list(parameters) == ["model", *(f.name for f in SETTINGS_FIELDS)]
    for field in SETTINGS_FIELDS:
        assert parameters[field.name].default == field.default, field.name
    assert parameters["accum_steps"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    keyword_only = [n for n, p in parameters.items() if p.kind is p.KEYWORD_ONLY]
    assert keyword_only == [f.name for f in SETTINGS_FIELDS[1:]]


def test_stop_accumulating_a_plain_model_is_a_value_error():
    with pytest.raises(ValueError, match="accumulate"):
        stop_accumulating(utils.plain_model())
