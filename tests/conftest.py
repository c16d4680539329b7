"""Test-session set-up: CPU only, deterministic ops, quiet TensorFlow, the
imported heap frozen for the garbage collector, no tf.data autotuning (Keras
3), a clean session and float32 policy for every test, in whichever Keras the
session runs (``tests/flavour.py``).

``pytest tests`` runs, under Keras 3, the Keras 3 suite (``tests/keras3``),
the Keras-neutral tests (``tests/core``) and the shared tests
(``tests/both``); where TensorFlow routes ``tf.keras`` to tf-keras
(``TF_USE_LEGACY_KERAS``), the tf-keras suite (``tests/keras2``) and the
shared tests: there, two logical CPUs for ``MirroredStrategy``. The
Keras-neutral tests import no Keras, so their outcome is the same in either:
they run once, in the Keras 3 session (a path given on the command line is
collected in either). See ``tests/README.md``.
"""

import gc
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import pytest
import tensorflow as tf

from tests.flavour import HERE, LEGACY_KERAS

LEGACY_TESTS = "keras2"  # the tf-keras tests' directory, beside this file
SHARED_TESTS = "both"  # the tests of both Kerases, beside this file
# Keras 3 sessions collect every other directory: tests/keras3, tests/core.

# pytest's documented hook: paths (relative to this directory) not collected.
if LEGACY_KERAS:
    collect_ignore = sorted(
        p.name for p in HERE.iterdir() if p.name not in (LEGACY_TESTS, SHARED_TESTS)
    )
    _cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        _cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
else:
    collect_ignore = [LEGACY_TESTS]

tf.config.experimental.enable_op_determinism()
if not LEGACY_KERAS:
    # No tf.data autotuning in a Keras 3 session (as in the distributed
    # workers, tests/death_worker.py): deleting an autotuned iterator waits
    # for its tuning thread, which can sleep out its period (doubling up to
    # 60 s) unwoken; a deleted pipeline stalled a worker for 35-44 s about
    # once a run of the suite (gdb: in RootDataset's iterator destructor).
    # Debug mode also runs pipeline functions eagerly, in order; the package
    # touches no tf.data, and the examples and benchmarks, run in child
    # processes as users run them, keep TensorFlow's default pipelines. Not
    # in tf-keras sessions: the 0.5.x suite's per-sample maps took 92 s
    # instead of 63 s eagerly.
    tf.data.experimental.enable_debug_mode()


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    """Every test starts from a clean Keras session and float32 policy."""
    from tests.flavour import keras

    if LEGACY_KERAS:
        keras.backend.clear_session()
    else:
        # Keras 3's default also runs gc.collect(), whose time grows with a
        # long-lived worker's heap: 1.6 s a test at the median, 46 % of the
        # suite's time (measured). Python's own collector still runs.
        keras.backend.clear_session(free_memory=False)
    keras.mixed_precision.set_global_policy("float32")
    yield
    keras.mixed_precision.set_global_policy("float32")


def pytest_collection_finish(session):
    """Moves what the imports and the collected test modules made (TensorFlow,
    Keras, the package: most of a worker's heap) out of the garbage
    collector's reach: its full collections, which Keras' tracing triggers
    often, then scan only what the tests make. Measured on 5 in-process test
    files, 2 workers, runs alternated: 78.5, 79.9 and 78.9 s against 81.4
    and 80.1 s without it."""
    gc.collect()
    gc.freeze()


# Tests sharing a module-, class- or package-scoped fixture stay on one
# worker (tests/xdist_groups.py).
from tests.xdist_groups import pytest_collection_modifyitems  # noqa: E402, F401
