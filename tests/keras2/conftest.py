"""Fixtures of the tf-keras tests (``tests/conftest.py`` sets up the session:
two logical CPUs, deterministic ops, a clean tf-keras state per test)."""

import pytest
import tensorflow as tf

if not tf.keras.__name__.startswith("tf_keras"):
    raise pytest.UsageError(
        "tests/keras2 needs tf.keras to be tf-keras: install tf-keras and set "
        "TF_USE_LEGACY_KERAS=1"
    )


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
