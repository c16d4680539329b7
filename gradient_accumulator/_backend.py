"""Fails at import, in one line, unless TensorFlow, Keras and the backend fit.

The supported ranges are defined here and only here: ``setup.cfg`` repeats
them for pip, and ``tests/test_supported_versions.py`` checks that it says the
same. The package depends on no particular TensorFlow distribution
(``tensorflow``, ``tensorflow-cpu``, ``tensorflow[and-cuda]``, a nightly...),
so pip cannot enforce the TensorFlow range: this module does, at import,
before Keras or any private Keras name is imported.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from typing import Any

# (major, minor) bounds; a ``None`` upper bound means none. Lower bounds are
# the oldest pair CI tests on every submission (.ci/run's lowest-pair step).
PYTHON_MIN = (3, 11)  # Keras >= 3.13 requires Python >= 3.11
TENSORFLOW_MIN = (2, 16)  # the first TensorFlow whose default Keras is Keras 3
TENSORFLOW_BELOW: tuple[int, ...] | None = None
KERAS_MIN = (3, 15)  # the first Keras whose private names and saving we fit
KERAS_BELOW: tuple[int, ...] | None = (4,)

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
REQUIRED = (
    f"tensorflow{TENSORFLOW_SPEC} (any distribution: tensorflow, tensorflow-cpu, "
    f"...) and keras{KERAS_SPEC}"
)


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


def check_versions(tf_version: str | None, keras_version: str | None) -> str | None:
    """The one-line error for these installed versions, or None if they fit.

    ``None`` for a version means that package is not installed.
    """
    tf_ok = tf_version is not None and _within(
        tf_version, TENSORFLOW_MIN, TENSORFLOW_BELOW
    )
    keras_ok = keras_version is not None and _within(
        keras_version, KERAS_MIN, KERAS_BELOW
    )
    if tf_ok and keras_ok:
        return None
    found = ", ".join(
        f"{name} {version}" if version is not None else f"no {name}"
        for name, version in (("tensorflow", tf_version), ("keras", keras_version))
    )
    return f"gradient_accumulator needs {REQUIRED}; found {found}. {INSTALL_HINT}"


def _distribution_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _installed_tensorflow() -> str | None:
    """TensorFlow's version, importing it (Keras would anyway); None if absent.

    Only a missing ``tensorflow`` module counts as absent: a TensorFlow that is
    installed but fails to import raises its own error, which says why.
    """
    try:
        tf = importlib.import_module("tensorflow")
    except ModuleNotFoundError as error:
        if error.name != "tensorflow":
            raise
        return None
    return str(getattr(tf, "__version__", "unknown"))


def _check() -> None:
    tf_version = _installed_tensorflow()
    if tf_version is not None and _within(tf_version, TENSORFLOW_MIN, TENSORFLOW_BELOW):
        try:
            import keras  # the module that will be used decides, not metadata
        except ModuleNotFoundError as error:
            if error.name != "keras":
                raise
            keras_version = None
        else:
            keras_version = str(keras.__version__)
    else:
        # Not importing Keras: with no or an old TensorFlow its import fails
        # inside keras.src. Its distribution's metadata says which is there.
        keras_version = _distribution_version("keras", "keras-nightly")
    message = check_versions(tf_version, keras_version)
    if message is not None:
        raise ImportError(message)

    import keras

    if keras.config.backend() != "tensorflow":
        raise ImportError(
            "gradient_accumulator supports only the TensorFlow backend of Keras 3, "
            f"but KERAS_BACKEND is {keras.config.backend()!r}. Set "
            "KERAS_BACKEND=tensorflow (or remove the setting) before importing it."
        )


def keras_private(module: str, name: str) -> Any:
    """``from <module> import <name>`` for a private Keras name.

    A Keras release that moved or removed it gets, instead of an ImportError
    from inside ``keras.src``, one line naming the Keras version and the
    supported range. For the engine's private imports (one place for them).
    """
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        import keras

        raise ImportError(
            f"gradient_accumulator needs the private Keras name {module}.{name}, "
            f"which keras {keras.__version__} does not have (moved or removed in "
            f"this release); supported: keras{KERAS_SPEC} where it exists, "
            f"tested from keras {KERAS_MIN[0]}.{KERAS_MIN[1]} to the newest "
            "release CI saw. Install an older Keras 3 release, or report it."
        ) from None


_check()
