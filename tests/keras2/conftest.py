"""Test-session set-up for the tf-keras hosts: run with TF_USE_LEGACY_KERAS=1
(``tests/conftest.py`` collects only this directory then). CPU only, two
logical CPUs for ``MirroredStrategy``, deterministic ops."""

import os

import pytest
import tensorflow as tf

if not tf.keras.__name__.startswith("tf_keras"):
    raise pytest.UsageError(
        "tests/keras2 needs tf.keras to be tf-keras: install tf-keras and set "
        "TF_USE_LEGACY_KERAS=1"
    )

import tf_keras

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)
tf.config.experimental.enable_op_determinism()


@pytest.fixture(autouse=True)
def _fresh_tf_keras_state():
    """Every test starts from a clean tf-keras session and float32 policy."""
    tf_keras.backend.clear_session()
    tf_keras.mixed_precision.set_global_policy("float32")
    yield
    tf_keras.mixed_precision.set_global_policy("float32")


@pytest.fixture(scope="session")
def mirrored():
    """One MirroredStrategy over the two logical CPUs for the whole session,
    reducing without collective ops: collective strategies number their
    all-reduces from the same start, so one made here would collide with any
    other in the process (the ported 0.5.x tests make their own)."""
    strategy = tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    assert strategy.num_replicas_in_sync == 2
    return strategy
