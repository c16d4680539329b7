"""``AccumBatchNormalization`` and ``replace_batchnorm_layers``, in each
Keras: what their arguments and the layer's model refuse, and how they say
so. (The layer's statistics per Keras: tests/keras3/test_batch_norm.py,
tests/keras2/test_batch_norm.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from gradient_accumulator import (
    AccumBatchNormalization,
    GradientAccumulateModel,
    replace_batchnorm_layers,
)
from tests.flavour import LEGACY_KERAS, keras


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"accum_steps": 0}, ValueError, "accum_steps"),
        ({"accum_steps": 2.5}, TypeError, "accum_steps"),
        ({"accum_steps": True}, TypeError, "accum_steps"),
        ({"axis": "last"}, TypeError, "axis"),
        ({"axis": 1.5}, TypeError, "axis"),
        ({"momentum": 1.5}, ValueError, "momentum"),
        ({"momentum": 2.0}, ValueError, "momentum"),
        ({"momentum": "high"}, TypeError, "momentum"),
        ({"epsilon": -1.0}, ValueError, "epsilon"),
        ({"epsilon": "small"}, TypeError, "epsilon"),
        ({"center": "yes"}, TypeError, "center"),
        ({"scale": 1}, TypeError, "scale"),
        ({"renorm": True}, ValueError, "renorm"),
        # tf-keras' layer has no synchronized mode, so refuses it; Keras 3's
        # takes a bool, so refuses anything else.
        ({"synchronized": True}, ValueError, "synchronized")
        if LEGACY_KERAS
        else ({"synchronized": None}, TypeError, "synchronized"),
    ],
)
def test_argument_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        AccumBatchNormalization(**kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"accum_steps": 0}, ValueError, "accum_steps"),
        ({"accum_steps": 2.0}, TypeError, "accum_steps"),
        ({"position": "after"}, ValueError, "position"),
    ],
)
def test_replace_validation(kwargs, error, match):
    model = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization()])
    with pytest.raises(error, match=match):
        replace_batchnorm_layers(model, **kwargs)


def test_explicit_accum_steps_must_match_the_model():
    inputs = keras.Input((3,))
    outputs = AccumBatchNormalization(accum_steps=3)(inputs)
    model = GradientAccumulateModel(accum_steps=2, inputs=inputs, outputs=outputs)
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"accum_steps=3.*accum_steps=2"):
        model.fit(
            np.ones((4, 3)), np.ones((4, 3)), batch_size=2, shuffle=False, verbose=0
        )
