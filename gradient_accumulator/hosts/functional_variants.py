"""A model wrapper built from ``inputs`` and ``outputs`` without Keras
rebasing the wrapper's classes, written once for Keras 3 and tf-keras.

Both Kerases make a ``Model`` subclass functional by rewriting the class's
``__bases__`` to ``Functional`` for the whole process, after which
subclassing it without ``inputs``/``outputs`` fails. :func:`construct` builds
as Keras does, puts the classes back, and gives the instance a private class
that derives from both the user's class and ``Functional``.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from gradient_accumulator._which_keras import other_keras


def construct(
    model,
    init: Callable,
    args,
    kwargs,
    host: type,
    functional: type,
    variants: dict,
    namespace: Callable[[type], dict],
    register: Callable[[type, type], None],
    keras: str,
) -> None:
    """Runs ``init(*args, **kwargs)`` (Keras' functional construction) for
    ``model``, an instance of ``host`` (a model wrapper) or a subclass, then
    restores the rebased classes and makes ``model``'s class the variant of
    its public class (cached in ``variants``; ``namespace(cls)``: extra class
    attributes; ``register(variant, cls)``: makes saved files name ``cls``;
    ``keras``: the host's Keras, which ``inputs`` must be of)."""
    inputs = kwargs.get("inputs", args[0] if args else None)
    message = other_keras(tf.nest.flatten(inputs), keras, "`inputs`")
    if message:
        # Keras itself fails later with "'KerasTensor' object has no
        # attribute 'node'", naming neither Keras.
        raise TypeError(f"{host.__name__}: {message}")
    cls = getattr(type(model), "_public_class", type(model))
    bases = {c: c.__bases__ for c in cls.__mro__ if issubclass(c, host)}
    try:
        init(*args, **kwargs)
    finally:
        for klass, original in bases.items():
            if klass.__bases__ != original:
                klass.__bases__ = original
    if cls not in variants:
        variant = type(
            cls.__name__,
            (cls, functional),
            {
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "_public_class": cls,
                **namespace(cls),
            },
        )
        register(variant, cls)
        variants[cls] = variant
    model.__class__ = variants[cls]
