"""Test-session set-up: CPU only, deterministic ops, quiet TensorFlow."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import pytest
import tensorflow as tf

tf.config.experimental.enable_op_determinism()


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    """Every test starts from a clean Keras session and float32 policy."""
    keras.backend.clear_session()
    keras.mixed_precision.set_global_policy("float32")
    yield
    keras.mixed_precision.set_global_policy("float32")
