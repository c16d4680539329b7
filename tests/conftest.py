"""Test-session set-up: CPU only, deterministic ops, quiet TensorFlow.

``pytest tests`` runs the Keras 3 suite, or, where TensorFlow routes
``tf.keras`` to tf-keras (``TF_USE_LEGACY_KERAS``, told as
``gradient_accumulator._requirements.legacy_keras_requested`` tells it), only
``tests/keras2``, which sets up its own session: this file then imports
neither Keras 3 nor TensorFlow, and its Keras 3 fixture does not exist.
"""

import importlib.util
import os
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import pytest

HERE = Path(__file__).resolve().parent
LEGACY_TESTS = "keras2"  # the tf-keras tests' directory, beside this file


def _versions_module():
    """``gradient_accumulator/_requirements.py`` (standard library only), loaded
    from its file: importing it as ``gradient_accumulator._requirements`` would
    run the package's ``__init__``, which imports TensorFlow and the hosts."""
    path = HERE.parent / "gradient_accumulator" / "_requirements.py"
    spec = importlib.util.spec_from_file_location("_ga_versions_conftest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LEGACY_KERAS = _versions_module().legacy_keras_requested()

# pytest's documented hook: paths (relative to this directory) not collected.
if LEGACY_KERAS:
    collect_ignore = sorted(p.name for p in HERE.iterdir() if p.name != LEGACY_TESTS)
else:
    collect_ignore = [LEGACY_TESTS]

if not LEGACY_KERAS:
    import keras
    import tensorflow as tf

    tf.config.experimental.enable_op_determinism()

    @pytest.fixture(autouse=True)
    def _fresh_keras_state():
        """Every test starts from a clean Keras session and float32 policy."""
        keras.backend.clear_session()
        keras.mixed_precision.set_global_policy("float32")
        yield
        keras.mixed_precision.set_global_policy("float32")


# Module-, class- and package-scoped fixtures are built once per worker
# process: ``.ci/run``'s ``--dist loadgroup`` spreads single tests over the
# workers, so the tests using one stay together on one worker (one group per
# file), and every other test goes wherever a worker is free.
_SHARED_SCOPES = {"class", "module", "package"}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items):
    for item in items:
        info = getattr(item, "_fixtureinfo", None)  # pytest's, for every test
        closure = info.name2fixturedefs.values() if info else ()
        if any(d.scope in _SHARED_SCOPES for defs in closure for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
