"""Every public import path and name of gradient-accumulator 0.5.2 still works.

The lists below are taken from 0.5.2's source (its ``__init__``,
``accumulators``, ``agc``, ``layers`` and ``utils`` modules): the names each
module defined or imported at top level that 0.5.x users imported, leaving out
the modules and typing helpers it imported for itself (``tf``, ``Optional``,
``Layer``, ``initializers``, ``agc``) and the private-in-all-but-name alias
``accumulators.opt`` (the legacy ``tf.keras`` optimizer base class).
"""

from __future__ import annotations

import importlib
import json
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import gradient_accumulator
from gradient_accumulator import GradientAccumulateModel, GradientAccumulateOptimizer
from tests.processes import describe, run_script

# 0.5.2 module -> names it exported.
OLD_NAMES = {
    "gradient_accumulator": (
        "GradientAccumulateModel",
        "GradientAccumulateOptimizer",
        "adaptive_clip_grad",
        "compute_norm",
        "unitwise_norm",
        "AccumBatchNormalization",
    ),
    "gradient_accumulator.accumulators": (
        "GradientAccumulateModel",
        "GradientAccumulateOptimizer",
        "get_gradients",
    ),
    "gradient_accumulator.core.agc": (
        "compute_norm",
        "unitwise_norm",
        "adaptive_clip_grad",
    ),
    "gradient_accumulator.layers": ("AccumBatchNormalization",),
    "gradient_accumulator.utils": (
        "replace_batchnorm_layers",
        # utils imported it from layers, so it could be imported from there.
        "AccumBatchNormalization",
    ),
}

# Old paths that only re-export, and where their names live now.
DEPRECATED = {
    "gradient_accumulator.accumulators": "gradient_accumulator.keras3",
    "gradient_accumulator.layers": "gradient_accumulator.keras3.batch_norm",
    "gradient_accumulator.utils": "gradient_accumulator.keras3.batch_norm",
}

# 0.5.2 names with no counterpart in the package's namespace (tested by
# behaviour below).
ONLY_OLD = {("gradient_accumulator.accumulators", "get_gradients")}


def _import_fresh(module: str, monkeypatch):
    """Imports ``module`` anew (so its import-time warning fires again); the
    cached module is restored afterwards."""
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.delattr(gradient_accumulator, module.rsplit(".", 1)[1], raising=False)
    # ``__import__`` runs as an ``import`` statement would, with no frame of
    # its own between this function and the import machinery.
    __import__(module)
    return sys.modules[module]


@pytest.mark.parametrize(
    ("module", "name"),
    [(m, n) for m, names in OLD_NAMES.items() for n in names],
)
def test_every_052_name_imports_as_the_current_object(module, name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = getattr(importlib.import_module(module), name)
    if (module, name) in ONLY_OLD:
        assert callable(old)
    else:
        assert old is getattr(gradient_accumulator, name)
        assert name in gradient_accumulator.__all__


@pytest.mark.parametrize("module", sorted(DEPRECATED))
def test_old_module_warns_with_the_new_path(module, monkeypatch):
    with pytest.warns(DeprecationWarning) as record:
        _import_fresh(module, monkeypatch)
    (warning,) = [w for w in record if w.category is DeprecationWarning]
    text = str(warning.message)
    assert module in text and "from gradient_accumulator" in text, text
    assert DEPRECATED[module] in text, text
    # Attributed to the line that imported it, not to the package.
    assert warning.filename == __file__, warning.filename


PROBE = """
import json, sys, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import gradient_accumulator, gradient_accumulator.core.agc
    quiet = [str(w.message) for w in caught if "0.5.x" in str(w.message)]
    loaded = sorted(m for m in %r if m in sys.modules)
    import gradient_accumulator.layers
    after = [str(w.message) for w in caught if "0.5.x" in str(w.message)]
print(json.dumps({"quiet": quiet, "loaded": loaded, "after": after}))
"""


def test_current_paths_do_not_warn():
    """Importing the package (or ``gradient_accumulator.core.agc``, a current
    module) neither warns nor loads the old modules; in the same process the
    old path then does warn (so the probe can see a warning)."""
    result = run_script("-c", PROBE % sorted(DEPRECATED))
    assert result.returncode == 0, describe(result)
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    assert probe["quiet"] == [] and probe["loaded"] == [], probe
    assert len(probe["after"]) == 1, probe


def test_compute_norm_matches_numpy():
    """0.5.x's ``compute_norm(x, axis, keepdims)``: the L2 norm over ``axis``."""
    from gradient_accumulator.core.agc import compute_norm

    x = np.random.default_rng(0).normal(size=(3, 4, 5)).astype("float32")
    for axis, keepdims in [(None, False), (0, True), ([0, 1], True), (2, False)]:
        got = compute_norm(tf.constant(x), axis, keepdims).numpy()
        want = np.sqrt(
            (x**2).sum(
                axis=None if axis is None else tuple(np.atleast_1d(axis)),
                keepdims=keepdims,
            )
        )
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_get_gradients_reads_non_empty_variables():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from gradient_accumulator.accumulators import get_gradients

    a = tf.Variable([1.0, 2.0])
    empty = tf.Variable(tf.zeros((0, 3)))
    b = tf.Variable([[3.0]])
    values = get_gradients([a, empty, b])
    assert [v.numpy().tolist() for v in values] == [[1.0, 2.0], [[3.0]]]
    a.assign([5.0, 6.0])  # values, not the variables themselves
    assert values[0].numpy().tolist() == [1.0, 2.0]


def test_052_batchnorm_swap_call_form_runs():
    """0.5.x's ``replace_batchnorm_layers(model, accum_steps, position)`` from
    its only path, ``gradient_accumulator.utils``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from gradient_accumulator.layers import AccumBatchNormalization
        from gradient_accumulator.utils import replace_batchnorm_layers

    inputs = keras.Input((4,))
    h = keras.layers.BatchNormalization()(keras.layers.Dense(6)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    new = replace_batchnorm_layers(model, 2, "replace")
    swapped = [
        layer for layer in new.layers if isinstance(layer, AccumBatchNormalization)
    ]
    assert len(swapped) == 1 and swapped[0].accum_steps == 2
    x = np.random.default_rng(1).normal(size=(5, 4)).astype("float32")
    np.testing.assert_allclose(new.predict(x, verbose=0), model.predict(x, verbose=0))


# ------------------------------------------------------ 0.5.x call forms
def _mlp():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    return inputs, keras.layers.Dense(2)(keras.layers.Dense(3)(inputs))


def test_agc_keyword_of_052_turns_agc_on_with_a_warning():
    """0.5.x's optimizer wrapper took ``agc=True`` (and its README shows it for
    the model); Keras would ignore it silently on the model."""
    inputs, outputs = _mlp()
    with pytest.warns(DeprecationWarning, match="use_agc"):
        model = GradientAccumulateModel(
            accum_steps=4, agc=True, inputs=inputs, outputs=outputs
        )
    assert model.get_config()["use_agc"] is True
    with pytest.warns(DeprecationWarning, match="use_agc"):
        opt = GradientAccumulateOptimizer(keras.optimizers.SGD(), 4, agc=True)
    assert opt.get_config()["use_agc"] is True
    # Guard: without it AGC stays off, and contradicting values are refused.
    assert GradientAccumulateOptimizer("sgd", 4).get_config()["use_agc"] is False
    with pytest.raises(ValueError, match="use_agc"):
        GradientAccumulateOptimizer("sgd", 4, use_agc=True, agc=False)


def test_dtype_keyword_of_052_optimizer_is_accepted_with_a_warning():
    with pytest.warns(DeprecationWarning, match="dtype"):
        opt = GradientAccumulateOptimizer(
            optimizer="SGD", accum_steps=2, reduction="MEAN", dtype=tf.float32
        )
    assert opt.accum_steps == 2


@pytest.mark.parametrize(
    "layer",
    [keras.layers.BatchNormalization, gradient_accumulator.AccumBatchNormalization],
)
def test_one_batchnorm_instance_serves_one_input_rank(layer):
    """As docs/migration.md says: like Keras' layer, an instance called on a
    rank-4 input refuses a rank-2 one (0.5.x's conv tests reused one), but
    takes other spatial sizes of the same rank."""
    bn = layer()
    bn(np.ones((2, 5, 5, 4), "float32"))
    assert bn(np.ones((2, 7, 7, 4), "float32")).shape == (2, 7, 7, 4)
    with pytest.raises(ValueError, match="expected ndim=4, found ndim=2"):
        bn(np.ones((2, 4), "float32"))
