"""Bad arguments fail at construction with errors that name the argument."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import keras
import pytest

from gradient_accumulator import GradientAccumulateOptimizer
from tests import processes, utils

BAD_ACCUM_STEPS = [
    pytest.param(0, ValueError, id="zero"),
    pytest.param(-1, ValueError, id="negative"),
    pytest.param(2.5, TypeError, id="float"),
    pytest.param(4.0, TypeError, id="integral_float"),
    pytest.param("4", TypeError, id="string"),
    pytest.param(True, TypeError, id="bool"),
    pytest.param(None, TypeError, id="none"),
]


# ------------------------------------------------------------ accum_steps
@pytest.mark.parametrize(("accum_steps", "error"), BAD_ACCUM_STEPS)
def test_model_rejects_bad_accum_steps(accum_steps, error):
    """GradientAccumulateModel rejects a non-int or < 1 accum_steps by name."""
    with pytest.raises(error, match="accum_steps"):
        utils.accumulating_model(accum_steps=accum_steps)


@pytest.mark.parametrize(("accum_steps", "error"), BAD_ACCUM_STEPS)
def test_optimizer_rejects_bad_accum_steps(accum_steps, error):
    """GradientAccumulateOptimizer rejects a non-int or < 1 accum_steps by name."""
    with pytest.raises(error, match="accum_steps"):
        GradientAccumulateOptimizer(keras.optimizers.SGD(), accum_steps=accum_steps)


@pytest.mark.parametrize(("accum_steps", "error"), BAD_ACCUM_STEPS)
def test_optimizer_rejects_bad_positional_accum_steps(accum_steps, error):
    """The positional form GradientAccumulateOptimizer(opt, k) is checked too."""
    with pytest.raises(error, match="accum_steps"):
        GradientAccumulateOptimizer(keras.optimizers.SGD(), accum_steps)


def test_valid_accum_steps_are_accepted():
    """Guard: good values (incl. numpy ints) construct, so the checks aren't
    rejecting everything."""
    import numpy as np

    assert utils.accumulating_model(accum_steps=1).accum_steps == 1
    assert utils.accumulating_model(accum_steps=np.int64(3)).accum_steps == 3
    assert GradientAccumulateOptimizer("sgd", accum_steps=np.int32(5)).accum_steps == 5


# -------------------------------------------------------------- optimizer
@pytest.mark.parametrize(
    ("optimizer", "error"),
    [
        pytest.param(42, TypeError, id="int"),
        pytest.param(object(), TypeError, id="object"),
        pytest.param(None, TypeError, id="none"),
        pytest.param("nonsense_opt", ValueError, id="unknown_name"),
        pytest.param(keras.losses.MeanSquaredError(), TypeError, id="loss"),
    ],
)
def test_optimizer_rejects_non_optimizer(optimizer, error):
    """Neither a Keras optimizer nor a known name: a clear error naming
    `optimizer`."""
    with pytest.raises(error, match="optimizer"):
        GradientAccumulateOptimizer(optimizer=optimizer, accum_steps=2)


def test_optimizer_rejects_double_wrapping():
    """Wrapping a GradientAccumulateOptimizer again is refused."""
    once = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=2)
    with pytest.raises(ValueError, match="optimizer"):
        GradientAccumulateOptimizer(once, accum_steps=2)


# -------------------------------------------------- the other arguments
@pytest.mark.parametrize("reduction", ["median", "", 1, None])
def test_optimizer_rejects_bad_reduction(reduction):
    """reduction must be "MEAN" or "SUM"."""
    with pytest.raises(ValueError, match="reduction"):
        GradientAccumulateOptimizer("sgd", accum_steps=2, reduction=reduction)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        pytest.param({"clip_factor": 0}, ValueError, "clip_factor", id="clip0"),
        pytest.param({"clip_factor": -1}, ValueError, "clip_factor", id="clip-1"),
        pytest.param({"clip_factor": "x"}, TypeError, "clip_factor", id="clip_s"),
        pytest.param({"eps": "x"}, TypeError, "eps", id="eps_str"),
        pytest.param({"eps": 0.0}, ValueError, "eps", id="eps0"),
        pytest.param({"eps": float("nan")}, ValueError, "eps", id="eps_nan"),
        pytest.param({"use_agc": "yes"}, TypeError, "use_agc", id="agc_str"),
        pytest.param({"use_agc": 1}, TypeError, "use_agc", id="agc_int"),
    ],
)
@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_rejects_bad_agc_arguments(wrapper, kwargs, error, name):
    """Adaptive-clipping arguments are validated at construction, by name."""
    with pytest.raises(error, match=name):
        if wrapper == "model":
            utils.accumulating_model(accum_steps=2, **kwargs)
        else:
            GradientAccumulateOptimizer("sgd", accum_steps=2, **kwargs)


def test_optimizer_rejects_unexpected_keyword():
    """An unknown keyword to the optimizer wrapper is a TypeError naming it."""
    with pytest.raises(TypeError, match="foo"):
        GradientAccumulateOptimizer("sgd", accum_steps=2, foo=1)


def test_optimizer_rejects_learning_rate_keyword():
    """learning_rate belongs on the wrapped optimizer, not on the wrapper."""
    with pytest.raises(TypeError, match="learning_rate"):
        GradientAccumulateOptimizer("sgd", accum_steps=2, learning_rate=0.1)


# ---------------------------------------------------- 0.5.x keywords
def test_model_accepts_deprecated_keywords_with_warning():
    """mixed_precision=True / experimental_distributed_support=True are accepted
    by the model wrapper with a DeprecationWarning."""
    with pytest.warns(DeprecationWarning, match="mixed_precision"):
        model = utils.accumulating_model(accum_steps=2, mixed_precision=True)
    assert model.accum_steps == 2
    with pytest.warns(DeprecationWarning, match="experimental_distributed_support"):
        model = utils.accumulating_model(
            accum_steps=2, experimental_distributed_support=True
        )
    assert model.accum_steps == 2


def test_optimizer_accepts_mixed_precision_with_warning():
    """mixed_precision=True is accepted by the optimizer wrapper with a
    DeprecationWarning."""
    with pytest.warns(DeprecationWarning, match="mixed_precision"):
        opt = GradientAccumulateOptimizer("sgd", accum_steps=2, mixed_precision=True)
    assert opt.accum_steps == 2


def test_optimizer_rejects_experimental_distributed_support_by_name():
    """experimental_distributed_support was a 0.5.x keyword of the model wrapper
    only (0.5.x's optimizer wrapper rejected it too): the optimizer wrapper
    raises a TypeError naming it rather than silently ignoring it."""
    with pytest.raises(TypeError, match="experimental_distributed_support"):
        GradientAccumulateOptimizer(
            "sgd", accum_steps=2, experimental_distributed_support=True
        )


# ------------------------------------------------------------- backend
def _run(code: str, backend: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    return processes.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, timeout=120
    )


def test_import_fails_clearly_on_other_backend_simulated():
    """The backend check raises ImportError mentioning TensorFlow when Keras
    reports another backend (simulated in a fresh interpreter, since no other
    backend is importable here)."""
    result = _run(
        """
        import keras
        assert keras.config.backend() == "tensorflow"
        keras.config.backend = lambda: "jax"  # what Keras reports under JAX
        try:
            import gradient_accumulator
        except ImportError as error:
            print("IMPORT_ERROR:", error)
        else:
            print("IMPORTED")
        """,
        "tensorflow",
    )
    assert "IMPORT_ERROR:" in result.stdout, result.stdout + result.stderr
    assert "TensorFlow" in result.stdout
    assert "'jax'" in result.stdout
