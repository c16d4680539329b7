"""A Keras' ``LossScaleOptimizer`` across an accumulation cycle, written once.

Each Keras' loss-scale module (``gradient_accumulator/loss_scale.py``,
``gradient_accumulator/keras2/loss_scale.py``) names its scaler class and
the class that takes over a scaler wrapping an accumulating optimizer; the
rules that do not depend on the Keras are here:

* :func:`scaler_of`: the scaler an accumulating object sees directly;
* :func:`saves_as`: the taking-over class saves as the Keras' own, so files
  load without custom objects;
* :func:`adopt`: that one scaler instance (and no other in the process)
  becomes the taking-over class, which hands whole cycles to the optimizer
  it wraps.
"""

from __future__ import annotations


def scaler_of(kind: type, optimizer):
    """``optimizer`` if it is a ``kind`` (a Keras' LossScaleOptimizer), else
    None."""
    return optimizer if isinstance(optimizer, kind) else None


def applying(kind: type, optimizer):
    """The optimizer that applies updates: the one a ``kind`` scaler wraps
    (its checks are the engine's), else ``optimizer``."""
    return optimizer.inner_optimizer if isinstance(optimizer, kind) else optimizer


def saves_as(cycle_class: type, keras_class: type) -> type:
    """Gives ``cycle_class`` the names of ``keras_class``: saved files name
    the Keras' class, which :func:`adopt` turns into ``cycle_class`` on
    load."""
    cycle_class.__name__ = keras_class.__name__
    cycle_class.__qualname__ = keras_class.__qualname__
    cycle_class.__module__ = keras_class.__module__
    return cycle_class


def adopt(keras_class: type, cycle_class: type, names: tuple, scaler) -> None:
    """Makes ``scaler``, a ``keras_class`` that wraps an accumulating
    optimizer, hand whole cycles to it (this instance only); refuses a
    subclass. ``names``: the wrapper's and the Keras', for the message."""
    if type(scaler) is keras_class:
        scaler.__class__ = cycle_class
    elif not isinstance(scaler, cycle_class):
        wrapper, keras = names
        raise TypeError(
            f"{wrapper} can be wrapped in {keras}' LossScaleOptimizer, not in "
            f"a subclass of it: {type(scaler).__name__}."
        )
