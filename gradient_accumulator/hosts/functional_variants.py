"""The functional variant of a model wrapper class, written once for Keras 3
and tf-keras.

A model wrapper built from ``inputs`` and ``outputs`` must be a
``Functional`` model, as ``keras.Model(inputs, outputs)`` is. Keras makes a
``Model`` subclass functional by rewriting the class's ``__bases__`` for the
whole process, after which the same class can no longer be subclassed the
other way (with a ``call``). The model wrapper does not let it: before Keras
sees ``inputs`` and ``outputs``, it gives the instance the functional
variant of its class, a class derived from both it and ``Functional`` (made
once per class), whose MRO takes Keras straight to ``Functional.__init__``.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from gradient_accumulator._which_keras import other_keras
from gradient_accumulator.hosts.flavour import Flavour

# The functional variant of each class, by class.
_VARIANTS: dict[type, type] = {}


def functional_variant(
    cls: type, flavour: Flavour, inputs, namespace: Callable[[type], dict]
) -> type:
    """The class a model wrapper of class ``cls`` takes when it is built
    from ``inputs`` (of ``flavour``'s Keras, else a TypeError): the subclass
    of ``cls`` and its Keras' ``Functional``, or ``cls`` itself if it is
    one. ``namespace(cls)``: the variant's extra class attributes. Saved
    files name ``cls``, which rebuilds the variant."""
    message = other_keras(tf.nest.flatten(inputs), flavour.name, "`inputs`")
    if message:
        # Keras itself fails later with "'KerasTensor' object has no
        # attribute 'node'", naming neither Keras.
        raise TypeError(f"GradientAccumulateModel: {message}")
    if issubclass(cls, flavour.functional):
        return cls
    if cls not in _VARIANTS:
        variant = type(
            cls.__name__,
            (cls, flavour.functional),
            {
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                **namespace(cls),
            },
        )
        registered = flavour.keras.saving.get_registered_name(cls)
        flavour.custom_names[variant] = registered
        _VARIANTS[cls] = variant
    return _VARIANTS[cls]
