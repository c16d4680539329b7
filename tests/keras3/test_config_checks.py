"""Configurations that would train silently wrong fail at construction (or
``compile``), with a message naming the arguments: conflicting clipping,
accumulation on top of Keras' own ``gradient_accumulation_steps``, and an
``accum_steps`` too large for the step counters."""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest

from gradient_accumulator import (
    AccumBatchNormalization,
    AccumulationScheduler,
    GradientAccumulateModel,
    GradientAccumulateOptimizer,
)
from gradient_accumulator.core.validation import MAX_ACCUM_STEPS
from tests import utils

KERAS_CLIP_MESSAGE = "Only one of `clipnorm`, `clipvalue` and `global_clipnorm`"


def _model(**kwargs) -> GradientAccumulateModel:
    """The accumulating MLP built with seed 0: reproducible weights, the same
    as those of the seeded plain MLP."""
    return utils.seeded(lambda: utils.accumulating_model(**kwargs))


# ---------------------------------------------------------------- clipping
@pytest.mark.parametrize(
    ("inner_kwargs", "wrapper_kwargs", "named"),
    [
        pytest.param(
            {},
            {"clipnorm": 1.0, "clipvalue": 0.5},
            ["clipnorm=1.0", "clipvalue=0.5"],
            id="two_on_wrapper",
        ),
        pytest.param(
            {"clipnorm": 1.0},
            {"global_clipnorm": 2.0},
            ["global_clipnorm=2.0", "clipnorm=1.0 (on SGD"],
            id="inner_clipnorm_wrapper_global",
        ),
        pytest.param(
            {"clipvalue": 0.5},
            {"clipnorm": 1.0},
            ["clipnorm=1.0", "clipvalue=0.5 (on SGD"],
            id="inner_clipvalue_wrapper_clipnorm",
        ),
        pytest.param(
            {"clipnorm": 1.0},
            {"clipnorm": 3.0},
            ["clipnorm=3.0", "clipnorm=1.0 (on SGD"],
            id="same_argument_two_values",
        ),
    ],
)
def test_conflicting_clipping_is_rejected(inner_kwargs, wrapper_kwargs, named):
    inner = keras.optimizers.SGD(0.1, **inner_kwargs)
    with pytest.raises(ValueError, match=re.escape(KERAS_CLIP_MESSAGE)) as error:
        GradientAccumulateOptimizer(inner, 2, **wrapper_kwargs)
    message = str(error.value)
    for text in named:
        assert text in message, message


def test_clipping_inside_a_loss_scale_optimizer_counts():
    inner = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(clipvalue=0.5))
    with pytest.raises(ValueError, match=re.escape("clipvalue=0.5")):
        GradientAccumulateOptimizer(inner, 2, clipnorm=1.0)


@pytest.mark.parametrize(
    ("inner_kwargs", "wrapper_kwargs", "expected"),
    [
        pytest.param({}, {"clipnorm": 1.0}, ("clipnorm", 1.0), id="wrapper"),
        pytest.param({"clipvalue": 0.5}, {}, ("clipvalue", 0.5), id="inner"),
        pytest.param(
            {"global_clipnorm": 2.0},
            {"global_clipnorm": 2.0, "clipnorm": None},
            ("global_clipnorm", 2.0),
            id="same_on_both",
        ),
    ],
)
def test_single_clipping_is_accepted_and_round_trips(
    inner_kwargs, wrapper_kwargs, expected
):
    """Guard: one clipping argument (given once, or equal on both) still works
    and survives get_config/from_config, which re-runs the check."""
    opt = GradientAccumulateOptimizer(
        keras.optimizers.SGD(0.1, **inner_kwargs), 2, **wrapper_kwargs
    )
    key, value = expected
    assert getattr(opt.inner_optimizer, key) == value
    clone = GradientAccumulateOptimizer.from_config(opt.get_config())
    assert getattr(clone.inner_optimizer, key) == value
    others = [k for k in ("clipnorm", "clipvalue", "global_clipnorm") if k != key]
    assert all(getattr(clone.inner_optimizer, k) is None for k in others)


# ----------------------------------------------------- double accumulation
def _keras_accumulating(steps: int = 2):
    return keras.optimizers.Adam(1e-3, gradient_accumulation_steps=steps)


@pytest.mark.parametrize(
    "inner",
    [
        pytest.param(_keras_accumulating, id="plain"),
        pytest.param(
            lambda: keras.optimizers.LossScaleOptimizer(_keras_accumulating()),
            id="in_loss_scale_optimizer",
        ),
    ],
)
def test_optimizer_wrapper_rejects_keras_accumulation(inner):
    with pytest.raises(ValueError, match="`gradient_accumulation_steps`") as error:
        GradientAccumulateOptimizer(inner(), accum_steps=4)
    assert "gradient_accumulation_steps=2" in str(error.value)
    assert "accumulated twice" in str(error.value)


@pytest.mark.parametrize(
    "optimizer",
    [
        pytest.param(_keras_accumulating, id="instance"),
        pytest.param(
            lambda: keras.optimizers.serialize(_keras_accumulating(3)), id="config"
        ),
    ],
)
def test_model_compile_rejects_keras_accumulation(optimizer):
    model = _model(accum_steps=4)
    with pytest.raises(ValueError, match="`gradient_accumulation_steps`") as error:
        model.compile(optimizer=optimizer(), loss="mse")
    assert "GradientAccumulateModel" in str(error.value)
    # Positional form too.
    with pytest.raises(ValueError, match="`gradient_accumulation_steps`"):
        _model(accum_steps=4).compile(optimizer(), "mse")


def test_model_compile_still_accepts_plain_optimizers():
    """Guard: names, instances, configs and our optimizer wrapper compile and
    train (one update per 4 micro-batches, so Keras does not accumulate too)."""
    x, y = utils.classification_data(n=32)
    for optimizer in (
        "adam",
        keras.optimizers.SGD(0.1),
        keras.optimizers.serialize(keras.optimizers.Adam(1e-3)),
    ):
        model = _model(accum_steps=4)
        model.compile(
            optimizer=optimizer,
            loss=utils.sparse_ce(),
        )
        model.fit(x, y, batch_size=8, verbose=0)
        assert int(model.optimizer.iterations) == 1


# ------------------------------------------------------ accum_steps bound
TOO_LARGE = [MAX_ACCUM_STEPS + 1, 2**62, 2**63, 2**64 + 5]


def _too_large_message(name: str) -> str:
    return rf"`{re.escape(name)}` must be at most {MAX_ACCUM_STEPS}.*accepted range"


@pytest.mark.parametrize("steps", TOO_LARGE)
@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda k: _model(accum_steps=k), id="model"),
        pytest.param(
            lambda k: GradientAccumulateOptimizer(keras.optimizers.SGD(), k),
            id="optimizer",
        ),
        pytest.param(lambda k: AccumBatchNormalization(accum_steps=k), id="bn"),
        pytest.param(lambda k: _model().set_accum_steps(k), id="set_accum_steps"),
    ],
)
def test_too_large_accum_steps_is_rejected(build, steps):
    with pytest.raises(ValueError, match=_too_large_message("accum_steps")):
        build(steps)


def test_scheduler_rejects_too_large_accum_steps():
    with pytest.raises(ValueError, match=_too_large_message("schedule[0]")):
        AccumulationScheduler({0: 2**31})
    with pytest.raises(ValueError, match=_too_large_message("schedule[3]")):
        AccumulationScheduler({0: 2, 3: 2**63})


def test_scheduler_function_too_large_fails_at_train_begin():
    model = _model(accum_steps=2)
    model.compile(optimizer="sgd", loss="mse")
    x = np.zeros((8, 8), "float32")
    y = np.zeros((8, 3), "float32")
    scheduler = AccumulationScheduler(lambda updates: 2**63)
    with pytest.raises(ValueError, match=_too_large_message("accum_steps")):
        model.fit(x, y, batch_size=4, callbacks=[scheduler], verbose=0)


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_largest_accum_steps_trains(wrapper):
    """The documented maximum fits the counters: training with it runs, and no
    update happens within the (very long) first cycle."""
    x, y = utils.classification_data(n=16)
    loss = utils.sparse_ce()
    if wrapper == "model":
        # flush_at_end=False: fit would otherwise apply the partial cycle.
        model = _model(accum_steps=MAX_ACCUM_STEPS, flush_at_end=False)
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
    else:
        model = utils.seeded(utils.plain_model)
        opt = GradientAccumulateOptimizer(keras.optimizers.SGD(0.5), MAX_ACCUM_STEPS)
        model.compile(optimizer=opt, loss=loss)
    before = utils.weights(model)
    model.fit(x, y, batch_size=4, verbose=0)
    assert int(model.optimizer.iterations) == 0
    assert utils.max_abs_diff(before, utils.weights(model)) == 0.0
    owner = model if wrapper == "model" else model.optimizer
    assert owner.accum_steps == MAX_ACCUM_STEPS


# ------------------------------------------------------ the other Keras
class _TfKerasTensor:
    """Stands for a tf-keras ``KerasTensor`` (its class's module is what
    tells a Keras), without tf-keras installed."""

    __module__ = "tf_keras.src.engine.keras_tensor"


class _TfKerasModel:
    __module__ = "tf_keras.src.engine.functional"


def test_a_tf_keras_model_given_to_the_keras_3_classes_is_named():
    """tf-keras objects (TF_USE_LEGACY_KERAS not set) fail at once with a
    message naming both Kerases and the switch, not deep inside Keras."""
    from gradient_accumulator import accumulate, replace_batchnorm_layers, verify

    outputs = keras.layers.Dense(1)(keras.Input((4,)))
    for call in (
        lambda: GradientAccumulateModel(
            accum_steps=2, inputs=_TfKerasTensor(), outputs=outputs
        ),
        lambda: accumulate(_TfKerasModel(), accum_steps=2),
        lambda: replace_batchnorm_layers(_TfKerasModel()),
        lambda: verify(_TfKerasModel, np.ones((96, 4)), np.ones((96, 1)), loss="mse"),
    ):
        with pytest.raises(TypeError, match="is tf-keras") as error:
            call()
        assert "the Keras 3 (keras) ones" in str(error.value)
        assert "TF_USE_LEGACY_KERAS=1" in str(error.value)
