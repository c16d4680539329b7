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
import itertools as _itertools
import os as _os
import sys as _sys

from gradient_accumulator._requirements import (
    check_installed as _check_installed,
)
from gradient_accumulator._requirements import (
    legacy_keras_requested as _legacy_keras_requested,
)
from gradient_accumulator._version import __version__ as __version__

# The public names: each Keras package's (``keras3``, ``keras2``: the same
# modules and names), less the one each alone has, and the 0.5.x clipping
# functions (Keras-free, from ``agc``). Written out, not read from the
# packages' ``__all__``: the project's own programs list them without loading
# Keras. Every name must resolve (tests/keras3/test_quiet_start.py), and the
# lists must equal each package's ``__all__`` (tests/both/test_namespace.py).
_SHARED = (
    "AccumBatchNormalization",
    "AccumulationScheduler",
    "Accumulating",
    "FlushPartialCycle",
    "GradientAccumulateModel",
    "GradientAccumulateOptimizer",
    "LayerCheck",
    "VariableCheck",
    "VerifyReport",
    "accumulate",
    "replace_batchnorm_layers",
    "stop_accumulating",
    "verify",
)
_KERAS3_ONLY = ("Accumulator",)
# TensorFlow Model Optimization, whose pruning callback it wraps, builds on
# tf-keras only.
_TF_KERAS_ONLY = ("PruningStepPerUpdate",)
_CLIPPING = ("adaptive_clip_grad", "compute_norm", "unitwise_norm")


def _tf_keras_in_use() -> bool:
    """Whether ``tf.keras`` is tf-keras: TensorFlow's own rule, told from
    the environment (``_backend`` has then checked tf-keras is installed).
    Not from ``tf.keras`` itself: after ``from tensorflow.keras import ...``
    that name is the ``tensorflow.keras`` module whichever Keras it is."""
    return _legacy_keras_requested()


def _exports() -> tuple[str, ...]:
    """The public names of the Keras in use (``Accumulating`` among them)."""
    own = _TF_KERAS_ONLY if _tf_keras_in_use() else _KERAS3_ONLY
    return (*_SHARED, *own, *_CLIPPING)


# The public names of the Keras in use, without the loader that saved files
# name (`Accumulating`, found by Keras, not by users).
__all__ = sorted(n for n in (*_exports(), "__version__") if n != "Accumulating")


def _load() -> None:
    """Imports every public name into this module (once), from the package
    of the Keras that ``tf.keras`` is."""
    from gradient_accumulator import (
        _backend,  # noqa: F401 (other backends fail)
        agc,
    )

    if _tf_keras_in_use():
        from gradient_accumulator import keras2 as package
    else:
        from gradient_accumulator import keras3 as package
    namespace = globals()
    for name in _exports():
        namespace[name] = getattr(agc if name in _CLIPPING else package, name)
    namespace["_loaded"] = True


def __getattr__(name: str):
    known = (*_SHARED, *_KERAS3_ONLY, *_TF_KERAS_ONLY, *_CLIPPING)
    if name in known and "_loaded" not in globals():
        _load()
    if name in globals():
        return globals()[name]
    if name in _TF_KERAS_ONLY:
        # ImportError, as for the names of the other Keras: `from
        # gradient_accumulator import ...` shows it as it is.
        raise ImportError(
            f"gradient_accumulator.{name} is for tf-keras "
            "(TF_USE_LEGACY_KERAS=1), as TensorFlow Model Optimization is: "
            "tf.keras is Keras 3 here."
        )
    if name in _KERAS3_ONLY:
        raise ImportError(
            f"gradient_accumulator.{name} is not available for tf-keras "
            "(tf.keras is tf-keras here: TF_USE_LEGACY_KERAS is set). "
            f"Available: {', '.join(sorted(_exports()))}."
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(__all__)  # what tab completion and dir() offer: the public names


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
    from gradient_accumulator import _backend  # noqa: F401


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
