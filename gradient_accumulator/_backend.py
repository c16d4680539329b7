"""Fails at import, in one line, unless TensorFlow, Keras and the backend fit
(the ranges are in ``_requirements``); imported by the modules that use Keras.

Under ``TF_USE_LEGACY_KERAS`` (``_versions.legacy_keras_requested``) it checks
TensorFlow and tf-keras instead, and imports no Keras 3: TensorFlow itself
then imports tf_keras, not keras (2.16.2 and 2.21: ``tensorflow/__init__.py``
eagerly imports ``tf_keras.src.optimizers`` instead of ``keras.src.optimizers``).
"""

from __future__ import annotations

import importlib

from gradient_accumulator._requirements import (  # noqa: F401  (the ranges, here too)
    INSTALL_HINT,
    KERAS_BELOW,
    KERAS_MIN,
    KERAS_SPEC,
    PYTHON_MIN,
    REQUIRED,
    TENSORFLOW_BELOW,
    TENSORFLOW_MIN,
    TENSORFLOW_SPEC,
    TF_KERAS_BELOW,
    TF_KERAS_DISTRIBUTIONS,
    TF_KERAS_MIN,
    TF_KERAS_SPEC,
    _distribution_version,
    _within,
    check_legacy_versions,
    check_versions,
    legacy_keras_requested,
)


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


def _check_legacy() -> None:
    """TensorFlow and tf-keras in range, from the modules (tf-keras' import
    after TensorFlow's, as for Keras below); Keras 3 is neither imported nor
    required, and KERAS_BACKEND does not apply to tf-keras."""
    tf_version = _installed_tensorflow()
    if tf_version is not None and _within(tf_version, TENSORFLOW_MIN, TENSORFLOW_BELOW):
        try:
            tf_keras = importlib.import_module("tf_keras")
        except ModuleNotFoundError as error:
            if error.name != "tf_keras":
                raise
            tf_keras_version = None
        else:
            tf_keras_version = str(getattr(tf_keras, "__version__", "unknown"))
    else:
        tf_keras_version = _distribution_version(*TF_KERAS_DISTRIBUTIONS)
    message = check_legacy_versions(tf_version, tf_keras_version)
    if message is not None:
        raise ImportError(message)


def _check() -> None:
    if legacy_keras_requested():
        _check_legacy()
        return
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


_check()
