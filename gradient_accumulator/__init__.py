"""Exact gradient accumulation for TensorFlow / Keras 3.

``import gradient_accumulator`` imports every public name (and TensorFlow),
which also registers the package's classes with Keras so that
``keras.models.load_model`` finds them. Only in the project's own programs,
the ``gradient-accumulator`` command and the checkout's ``examples/``, are
they loaded later, on first use (PEP 562 module ``__getattr__``) or by the
programs' quiet start-up (``_quiet.quiet_tensorflow``): they answer ``--help``
without loading TensorFlow, and load it quietly before anything else does.
"""

# Modules and helpers under private names: dir(gradient_accumulator) and
# tab completion show the public names only.
import importlib as _importlib
import itertools as _itertools
import os as _os
import sys as _sys
import types as _types

from gradient_accumulator._requirements import (
    check_installed as _check_installed,
)
from gradient_accumulator._requirements import (
    legacy_keras_requested as _legacy_keras_requested,
)
from gradient_accumulator._version import __version__ as __version__

# Public name -> the submodule that defines it.
_EXPORTS = {
    "AccumBatchNormalization": "batch_norm",
    "AccumulationScheduler": "callbacks",
    "Accumulator": "tracked_engine",
    "FlushPartialCycle": "callbacks",
    "GradientAccumulateModel": "model",
    "GradientAccumulateOptimizer": "optimizer",
    "Accumulating": "accumulate",
    "LayerCheck": "verify",
    "VariableCheck": "verify",
    "VerifyReport": "verify",
    "accumulate": "accumulate",
    "adaptive_clip_grad": "agc",
    "compute_norm": "agc",
    "replace_batchnorm_layers": "convert",
    "stop_accumulating": "accumulate",
    "unitwise_norm": "agc",
    "verify": "verify",
}

# Where tf.keras is tf-keras (TF_USE_LEGACY_KERAS=1), the public names are
# the tf-keras hosts' (gradient_accumulator.keras2), so far these:
_KERAS2_EXPORTS = {
    "AccumBatchNormalization": "keras2.batch_norm",
    "AccumulationScheduler": "keras2.callbacks",
    "Accumulating": "keras2.accumulate",
    "FlushPartialCycle": "keras2.callbacks",
    "GradientAccumulateModel": "keras2.model",
    "GradientAccumulateOptimizer": "keras2.optimizer",
    "LayerCheck": "keras2.verify",
    "PruningStepPerUpdate": "keras2.callbacks",
    "VariableCheck": "keras2.verify",
    "VerifyReport": "keras2.verify",
    "accumulate": "keras2.accumulate",
    "adaptive_clip_grad": "agc",
    "compute_norm": "agc",
    "replace_batchnorm_layers": "keras2.convert",
    "stop_accumulating": "keras2.accumulate",
    "unitwise_norm": "agc",
    "verify": "keras2.verify",
}


def _tf_keras_in_use() -> bool:
    """Whether ``tf.keras`` is tf-keras: TensorFlow's own rule, told from
    the environment (``_backend`` has then checked tf-keras is installed).
    Not from ``tf.keras`` itself: after ``from tensorflow.keras import ...``
    that name is the ``tensorflow.keras`` module whichever Keras it is."""
    return _legacy_keras_requested()


# The public names of the Keras in use: its export table without the loader
# that saved files name (`Accumulating`, found by Keras, not by users).
__all__ = sorted(
    [*(_KERAS2_EXPORTS if _tf_keras_in_use() else _EXPORTS), "__version__"]
)
__all__.remove("Accumulating")


def _load() -> None:
    """Imports every public name into this module (once), from the hosts of
    the Keras that ``tf.keras`` is."""
    _importlib.import_module(f"{__name__}._backend")  # fails on other backends
    exports = _KERAS2_EXPORTS if _tf_keras_in_use() else _EXPORTS
    modules = {
        m: _importlib.import_module(f"{__name__}.{m}") for m in set(exports.values())
    }
    namespace = globals()
    for name, module in exports.items():
        namespace[name] = getattr(modules[module], name)
    namespace["_loaded"] = exports


def __getattr__(name: str):
    if (name in _EXPORTS or name in _KERAS2_EXPORTS) and "_loaded" not in globals():
        _load()
    if name in globals():
        return globals()[name]
    if name in _KERAS2_EXPORTS and name not in _EXPORTS:
        # ImportError, as for the names not yet ported to tf-keras: `from
        # gradient_accumulator import ...` shows it as it is.
        raise ImportError(
            f"gradient_accumulator.{name} is for tf-keras "
            "(TF_USE_LEGACY_KERAS=1), as TensorFlow Model Optimization is: "
            "tf.keras is Keras 3 here."
        )
    if name in _EXPORTS:
        raise ImportError(
            f"gradient_accumulator.{name} is not available for tf-keras yet "
            "(tf.keras is tf-keras here: TF_USE_LEGACY_KERAS is set). "
            f"Available: {', '.join(sorted(_KERAS2_EXPORTS))}."
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(__all__)  # what tab completion and dir() offer: the public names


class _Package(_types.ModuleType):
    """Keeps each public name bound to its function or class: importing the
    submodule ``gradient_accumulator.verify`` makes the import system bind
    the name ``verify`` on the package to that submodule, which would hide
    the function ``verify`` (the eager ``from ... import verify`` used to
    overwrite it)."""

    def __setattr__(self, name: str, value) -> None:
        if name in _EXPORTS and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package


# Fail at import, in one line, without a TensorFlow in the supported range
# (told from package metadata, without loading TensorFlow), or when another
# backend is known already: Keras is loaded (an exact check, and cheap then)
# or KERAS_BACKEND names another one. Otherwise the backend is checked when
# the first public name is used.
_check_installed()
if (
    "keras" in _sys.modules
    or _os.environ.get("KERAS_BACKEND", "tensorflow") != "tensorflow"
):
    _importlib.import_module(f"{__name__}._backend")


def _is_own_program() -> bool:
    """Whether this process is one of the project's own programs: the
    ``gradient-accumulator`` command (its console script, or ``python -m
    gradient_accumulator.cli``) or a script in the ``examples/`` directory
    beside this package (``python examples/digits_demo.py``). Their first
    import of the package (``from gradient_accumulator._quiet import ...``)
    must not load TensorFlow before their quiet start-up does."""
    script = _sys.argv[0] if _sys.argv else ""
    program = _os.path.basename(script)
    if program.split(".")[0].removesuffix("-script") == "gradient-accumulator":
        return True
    pairs = _itertools.pairwise(getattr(_sys, "orig_argv", ()))
    if any(a == "-m" and b == f"{__name__}.cli" for a, b in pairs):
        return True
    if not (script.endswith(".py") and _os.path.isfile(script)):
        return False  # python -c, the interactive prompt
    path = _os.path
    checkout = path.dirname(path.dirname(path.realpath(__file__)))
    folder = path.dirname(path.realpath(script))
    return folder == path.join(checkout, "examples")


if not _is_own_program():
    _load()
