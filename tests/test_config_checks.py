"""Configurations that would train silently wrong fail at construction, with
a message naming the arguments: an ``accum_steps`` too large for the step
counters."""

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
from gradient_accumulator.validation import MAX_ACCUM_STEPS
from tests import utils


def _model(**kwargs) -> GradientAccumulateModel:
    keras.utils.set_random_seed(0)
    inputs, outputs = utils.mlp_layers()
    return GradientAccumulateModel(inputs=inputs, outputs=outputs, **kwargs)


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
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if wrapper == "model":
        # flush_at_end=False: fit would otherwise apply the partial cycle.
        model = _model(accum_steps=MAX_ACCUM_STEPS, flush_at_end=False)
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
    else:
        model = utils.seeded(lambda: keras.Model(*utils.mlp_layers()))
        opt = GradientAccumulateOptimizer(keras.optimizers.SGD(0.5), MAX_ACCUM_STEPS)
        model.compile(optimizer=opt, loss=loss)
    before = utils.weights(model)
    model.fit(x, y, batch_size=4, verbose=0)
    assert int(model.optimizer.iterations) == 0
    assert utils.max_abs_diff(before, utils.weights(model)) == 0.0
    owner = model if wrapper == "model" else model.optimizer
    assert owner.accum_steps == MAX_ACCUM_STEPS
