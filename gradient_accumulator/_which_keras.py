"""Which Keras an object belongs to, told without importing either."""

from __future__ import annotations

KERAS3 = "keras"
TF_KERAS = "tf_keras"


def keras_of(value) -> str | None:
    """:data:`KERAS3` or :data:`TF_KERAS` for an instance of a class from
    that Keras (or derived from one), else None."""
    return keras_of_class(type(value))


def keras_of_class(cls: type) -> str | None:
    """:data:`KERAS3` or :data:`TF_KERAS` for a class from that Keras (or
    derived from one), else None."""
    for klass in cls.__mro__:
        package = klass.__module__.split(".")[0]
        if package in (KERAS3, TF_KERAS):
            return package
    return None


_NAMES = {KERAS3: "Keras 3 (keras)", TF_KERAS: "tf-keras (tf_keras, legacy Keras 2)"}


def other_keras(values, expected: str, what: str) -> str:
    """A sentence saying that ``values`` (an object, or a list or dict of
    them) belong to the other Keras than ``expected``, the Keras of the
    class receiving them, and how to choose; "" if none does."""
    leaves = values.values() if isinstance(values, dict) else values
    if not isinstance(leaves, list | tuple):
        leaves = [leaves]
    found = {keras_of(v) for v in leaves} - {None, expected}
    if not found:
        return ""
    (other,) = found
    why = (
        "TF_USE_LEGACY_KERAS=1 makes gradient_accumulator export its tf-keras "
        "classes (tf.keras is tf-keras then)"
        if expected == TF_KERAS
        else "TF_USE_LEGACY_KERAS is not set, so gradient_accumulator exports "
        "its Keras 3 classes"
    )
    fix = (
        "build the model with tf_keras (or tf.keras), or unset "
        "TF_USE_LEGACY_KERAS to train Keras 3 models"
        if expected == TF_KERAS
        else "build the model with keras, or set TF_USE_LEGACY_KERAS=1 before "
        "TensorFlow is imported to train tf-keras models"
    )
    return (
        f"{what} is {_NAMES[other]}, but gradient_accumulator's classes here "
        f"are the {_NAMES[expected]} ones: {why}. To fix it, {fix}."
    )
