"""The Keras this test session runs: Keras 3, or tf-keras where TensorFlow
routes ``tf.keras`` to it (``TF_USE_LEGACY_KERAS``, told as
``gradient_accumulator._requirements.legacy_keras_requested`` tells it).

Each environment tests one Keras. The tests written once for both
(``tests/both``) take that Keras from here: ``keras`` is ``keras`` or
``tf_keras``, ``utils`` the helpers of that Keras' suite (``tests.utils`` or
``tests.keras2.utils``: each keeps its own reference computations), and the
package's root namespace exports that Keras' classes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _requirements_module():
    """``gradient_accumulator/_requirements.py`` (standard library only), loaded
    from its file: importing it as ``gradient_accumulator._requirements`` would
    run the package's ``__init__``, which imports TensorFlow and the hosts."""
    path = HERE.parent / "gradient_accumulator" / "_requirements.py"
    spec = importlib.util.spec_from_file_location("_ga_versions_tests", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LEGACY_KERAS: bool = _requirements_module().legacy_keras_requested()
# The test id part that says which Keras ran a shared test.
NAME = "tf_keras" if LEGACY_KERAS else "keras3"


def __getattr__(name: str):
    # Imported on first use, so that tests/conftest.py can read LEGACY_KERAS
    # and configure devices before any Keras loads.
    if name == "keras":
        return importlib.import_module("tf_keras" if LEGACY_KERAS else "keras")
    if name == "utils":
        return importlib.import_module(
            "tests.keras2.utils" if LEGACY_KERAS else "tests.utils"
        )
    raise AttributeError(name)
