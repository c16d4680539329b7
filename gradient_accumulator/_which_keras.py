"""Which Keras an object belongs to, told without importing either."""

from __future__ import annotations

KERAS3 = "keras"
TF_KERAS = "tf_keras"


def keras_of(value) -> str | None:
    """:data:`KERAS3` or :data:`TF_KERAS` for an instance of a class from
    that Keras (or derived from one), else None."""
    for klass in type(value).__mro__:
        package = klass.__module__.split(".")[0]
        if package in (KERAS3, TF_KERAS):
            return package
    return None
