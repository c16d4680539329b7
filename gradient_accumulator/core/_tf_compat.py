"""The private TensorFlow names the engine relies on (it imports no Keras).

``keras3/_compat.py`` re-exports them, so each has its test, by name, in
``tests/keras3/test_keras_compat.py`` with the Keras names.
"""

from __future__ import annotations

import tensorflow as tf

__all__ = [
    "distributed_container",
    "keras_mask",
    "on_device_or_primary",
    "with_keras_mask",
]


def distributed_container(variable):
    """The ``tf.distribute`` variable a per-replica component belongs to
    (``variable`` itself when it is not such a component)."""
    if isinstance(variable, tf.distribute.DistributedValues):
        return variable
    # The link back is on the component, or (TensorFlow >= 2.20, where a
    # resource variable is a composite tensor) on its handle.
    ref = getattr(variable, "_distributed_container", None)
    if ref is None:
        ref = getattr(getattr(variable, "handle", None), "_distributed_container", None)
    container = None if ref is None else ref()
    return variable if container is None else container


def on_device_or_primary(variable):
    """This replica's component of a distributed variable (scatter ops on a
    replica-local variable need it)."""
    return variable._get_on_device_or_primary()


def keras_mask(tensor):
    """The mask a Keras layer attached to its output (``None`` if none): the
    same private attribute in Keras 3 and in tf-keras."""
    return getattr(tensor, "_keras_mask", None)


def with_keras_mask(tensor, mask):
    """A tensor equal to ``tensor`` (gradients flow through it) that Keras'
    losses read as masked by ``mask``."""
    masked = tf.identity(tensor)
    masked._keras_mask = mask
    return masked
