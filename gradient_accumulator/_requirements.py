"""The supported TensorFlow / Keras / tf-keras / Python ranges, which Keras a
process uses, and a check of what is installed that imports neither
TensorFlow nor Keras.

The ranges are defined here and only here: ``setup.cfg`` repeats them for
pip, and ``tests/keras3/test_supported_versions.py`` checks that it says the same.
The package depends on no particular TensorFlow distribution (``tensorflow``,
``tensorflow-cpu``, ``tensorflow[and-cuda]``, a nightly...), so pip cannot
enforce the TensorFlow range: ``import gradient_accumulator`` does, with
:func:`check_installed` (metadata only, so the command line answers
``--help`` without loading TensorFlow), and ``_backend`` again, from the
modules TensorFlow itself reports, when the first public name is used.

With legacy Keras 2 (:func:`legacy_keras_requested`: ``TF_USE_LEGACY_KERAS``
as TensorFlow reads it) the checks require TensorFlow and tf-keras instead of
Keras 3, which TensorFlow may pull in but such a process never uses.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
import re
import sys

# (major, minor) bounds; a ``None`` upper bound means none. Lower bounds are
# the oldest pair CI tests on every submission (.ci/run's lowest-pair step).
PYTHON_MIN = (3, 11)  # Keras >= 3.13 requires Python >= 3.11
TENSORFLOW_MIN = (2, 16)  # the first TensorFlow whose default Keras is Keras 3
TENSORFLOW_BELOW: tuple[int, ...] | None = None
KERAS_MIN = (3, 15)  # the first Keras whose private names and saving we fit
KERAS_BELOW: tuple[int, ...] | None = (4,)
# tf-keras 2.X requires the `tensorflow` distribution 2.X, so its bounds follow
# TensorFlow's; used instead of Keras 3 under legacy_keras_requested().
TF_KERAS_MIN = (2, 16)
TF_KERAS_BELOW: tuple[int, ...] | None = None

INSTALL_HINT = (
    "Install with: pip install 'gradient-accumulator[tensorflow]' "
    "(or [cpu], [and-cuda])"
)


def _spec(low: tuple[int, ...], below: tuple[int, ...] | None) -> str:
    spec = ">=" + ".".join(map(str, low))
    if below is not None:
        spec += ",<" + ".".join(map(str, below))
    return spec


TENSORFLOW_SPEC = _spec(TENSORFLOW_MIN, TENSORFLOW_BELOW)  # ">=2.16"
KERAS_SPEC = _spec(KERAS_MIN, KERAS_BELOW)  # ">=3.15,<4"
TF_KERAS_SPEC = _spec(TF_KERAS_MIN, TF_KERAS_BELOW)  # ">=2.16"
REQUIRED = (
    f"tensorflow{TENSORFLOW_SPEC} (any distribution: tensorflow, tensorflow-cpu, "
    f"...) and keras{KERAS_SPEC}"
)
REQUIRED_LEGACY = (
    f"tensorflow{TENSORFLOW_SPEC} and tf-keras{TF_KERAS_SPEC} "
    "(tf-keras 2.X for tensorflow 2.X)"
)

# TensorFlow's own test, in tensorflow/__init__.py (which then imports tf_keras
# instead of keras) and KerasLazyLoader._initialize in
# tensorflow/python/util/lazy_loader.py (which then routes tf.keras to tf_keras
# if it is installed): os.environ.get("TF_USE_LEGACY_KERAS", None) in
# ("true", "True", "1"). Exact strings: "TRUE", "yes" or " 1" mean Keras 3.
LEGACY_KERAS_VARIABLE = "TF_USE_LEGACY_KERAS"
LEGACY_KERAS_VALUES = ("true", "True", "1")


def legacy_keras_requested() -> bool:
    """Whether TensorFlow routes ``tf.keras`` to tf-keras (legacy Keras 2) in
    this process, told from the environment exactly as TensorFlow tells it,
    without importing TensorFlow."""
    return os.environ.get(LEGACY_KERAS_VARIABLE, None) in LEGACY_KERAS_VALUES


def _release(version: str) -> tuple[int, ...] | None:
    """``"2.16.0rc0"`` -> ``(2, 16, 0)``; None if it starts with no number.

    Only the leading numbers count, so pre-releases and nightlies of a
    supported minor version (``2.17.0-dev20240101``) are accepted.
    """
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(p) for p in match.group(1).split(".")) if match else None


def _within(version: str, low: tuple[int, ...], below: tuple[int, ...] | None) -> bool:
    release = _release(version)
    if release is None:
        return False
    return release >= low and (below is None or release < below)


def _out_of_range(
    tf_version: str | None,
    name: str,
    version: str | None,
    low: tuple[int, ...],
    below: tuple[int, ...] | None,
) -> str | None:
    """What was found (``"tensorflow 2.15.0, keras 3.15.0"``), when TensorFlow
    or the Keras ``name`` (``version`` in ``[low, below)``) is missing or out
    of range; None if both fit."""
    tf_ok = tf_version is not None and _within(
        tf_version, TENSORFLOW_MIN, TENSORFLOW_BELOW
    )
    if tf_ok and version is not None and _within(version, low, below):
        return None
    return ", ".join(
        f"{package} {found}" if found is not None else f"no {package}"
        for package, found in (("tensorflow", tf_version), (name, version))
    )


def check_versions(tf_version: str | None, keras_version: str | None) -> str | None:
    """The one-line error for these installed versions, or None if they fit.

    ``None`` for a version means that package is not installed.
    """
    found = _out_of_range(tf_version, "keras", keras_version, KERAS_MIN, KERAS_BELOW)
    if found is None:
        return None
    return f"gradient_accumulator needs {REQUIRED}; found {found}. {INSTALL_HINT}"


def _tf_keras_install_hint(tf_version: str | None) -> str:
    """How to install tf-keras: pip picks the newest tf-keras, which requires
    the newest TensorFlow, so beside a TensorFlow in range pin its minor."""
    release = _release(tf_version) if tf_version is not None else None
    if (
        release is not None
        and len(release) >= 2
        and _within(tf_version, TENSORFLOW_MIN, TENSORFLOW_BELOW)
    ):
        minor = f"{release[0]}.{release[1]}"
        return (
            f"Install with: pip install 'gradient-accumulator[tf-keras]' "
            f"'tf-keras=={minor}.*' (the tf-keras of your TensorFlow {minor})"
        )
    return "Install with: pip install 'gradient-accumulator[tf-keras]'"


def check_legacy_versions(
    tf_version: str | None, tf_keras_version: str | None
) -> str | None:
    """:func:`check_versions` for legacy Keras 2 (``TF_USE_LEGACY_KERAS``):
    TensorFlow and tf-keras in range; Keras 3 is not looked at."""
    found = _out_of_range(
        tf_version, "tf-keras", tf_keras_version, TF_KERAS_MIN, TF_KERAS_BELOW
    )
    if found is None:
        return None
    return (
        f"gradient_accumulator with {LEGACY_KERAS_VARIABLE} set (legacy Keras 2) "
        f"needs {REQUIRED_LEGACY}; found {found}. {_tf_keras_install_hint(tf_version)}"
    )


def _distribution_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


# Distributions that install the ``tensorflow`` module.
TENSORFLOW_DISTRIBUTIONS = (
    "tensorflow",
    "tensorflow-cpu",
    "tensorflow-gpu",
    "tensorflow-intel",
    "tensorflow-macos",
    "tf-nightly",
    "tf-nightly-cpu",
)
# Distributions that install the ``tf_keras`` module.
TF_KERAS_DISTRIBUTIONS = ("tf-keras", "tf-keras-nightly")
UNKNOWN = ""  # installed, version not known without importing it


def _present_version(module: str, distributions: tuple[str, ...]) -> str | None:
    """The version of ``module`` as far as can be told without importing it:
    a loaded module's ``__version__``, else its distribution's metadata;
    ``None`` if it is not installed, :data:`UNKNOWN` if that cannot be told."""
    if module in sys.modules:
        loaded = sys.modules[module]
        return None if loaded is None else str(getattr(loaded, "__version__", ""))
    if importlib.util.find_spec(module) is None:
        return None
    version = _distribution_version(*distributions)
    return UNKNOWN if version is None else version


def check_installed() -> None:
    """Raises the one-line ImportError of :func:`check_versions` (or, under
    :func:`legacy_keras_requested`, :func:`check_legacy_versions`) for what is
    installed, importing neither TensorFlow nor Keras."""
    tf_version = _present_version("tensorflow", TENSORFLOW_DISTRIBUTIONS)
    if legacy_keras_requested():
        tf_keras_version = _present_version("tf_keras", TF_KERAS_DISTRIBUTIONS)
        if UNKNOWN in (tf_version, tf_keras_version):
            return  # checked from the modules themselves on first use
        message = check_legacy_versions(tf_version, tf_keras_version)
        if message is not None:
            raise ImportError(message)
        return
    keras_version = _present_version("keras", ("keras", "keras-nightly"))
    if UNKNOWN in (tf_version, keras_version):
        return  # checked from the modules themselves on first use
    message = check_versions(tf_version, keras_version)
    if message is not None:
        raise ImportError(message)


@contextlib.contextmanager
def private_names(names: str, installed: str, supported: str = ""):
    """Turns the ImportError of a private name imported in its block (each
    Keras' ``_compat`` module imports its own there) into one that names
    whose names they are (``names``), the ``installed`` release and what
    is ``supported``."""
    try:
        yield
    except ImportError as error:  # pragma: no cover - depends on the release
        raise ImportError(
            f"gradient_accumulator needs private {names} names that "
            f"{installed} does not have ({error}){supported}."
        ) from error
