"""Glue between the engine and ``tf.distribute``."""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

from gradient_accumulator.keras3._compat import set_all_reduce

# MirroredStrategy traces each replica in its own thread.
_lock = threading.Lock()
_depth: dict[int, int] = {}


def _pass_through(grads_and_vars):
    return list(grads_and_vars)


@contextlib.contextmanager
def already_reduced(optimizer):
    """Within this block ``optimizer.apply`` does not all-reduce gradients.

    Keras' TensorFlow optimizer sums gradients over replicas inside ``apply``
    (after clipping each replica's part). The engine hands it gradients that
    are already summed, and clipped or checked as a whole, so a second
    all-reduce would double them and cost a second round of communication.
    The override lives on the instance only while an update is traced.
    """
    if tf.distribute.get_strategy().num_replicas_in_sync == 1:
        yield
        return
    key = id(optimizer)
    with _lock:
        if _depth.get(key, 0) == 0:
            set_all_reduce(optimizer, _pass_through)
        _depth[key] = _depth.get(key, 0) + 1
    try:
        yield
    finally:
        with _lock:
            _depth[key] -= 1
            if _depth[key] == 0:
                del _depth[key]
                set_all_reduce(optimizer, None)
