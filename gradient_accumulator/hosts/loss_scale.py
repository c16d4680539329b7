"""A Keras' ``LossScaleOptimizer`` across an accumulation cycle, written once.

The hosts call these with their flavour, whose loss-scale fields (see
``hosts/flavour.py``, ``# --- optimizer host``) name the Keras' scaler
class, the class that takes over a scaler wrapping an accumulating
optimizer (each Keras' ``loss_scale.py``) and the few rules that differ;
the rules that do not depend on the Keras are here:

* :func:`scaler_of`: the scaler an accumulating object sees directly;
* :func:`scale_hooks`: the engine's hooks that keep a dynamic scale per
  cycle;
* :func:`apply_gradients`: a cycle's gradients reach the optimizer inside a
  scaler, whose checks are the engine's;
* :func:`saves_as`: the taking-over class saves as the Keras' own, so files
  load without custom objects;
* :func:`adopt`: that one scaler instance (and no other in the process)
  becomes the taking-over class, which hands whole cycles to the optimizer
  it wraps.
"""

from __future__ import annotations

from collections.abc import Sequence

from gradient_accumulator.hosts.flavour import Flavour


def scaler_of(flavour: Flavour, optimizer):
    """``optimizer`` if it is the Keras' LossScaleOptimizer, else None."""
    return optimizer if isinstance(optimizer, flavour.loss_scaler) else None


def loss_scale(flavour: Flavour, optimizer):
    """The loss scale of ``optimizer`` (a tensor), or None if it has none."""
    scaler = scaler_of(flavour, optimizer)
    return None if scaler is None else flavour.current_scale(scaler)


def scale_hooks(flavour: Flavour, optimizer) -> tuple:
    """The engine's ``(on_apply, on_skip)`` for ``optimizer``'s dynamic loss
    scale, which grows after its growth steps of finite updates and halves
    per skipped cycle; else ``(None, None)``."""
    scaler = scaler_of(flavour, optimizer)
    if scaler is None or not flavour.dynamic_scale(scaler):
        return None, None
    return flavour.cycle_scale_hooks(scaler)


def apply_gradients(flavour: Flavour, optimizer, grads: Sequence, variables: Sequence):
    """Applies unscaled gradients already summed over replicas (replica
    context): a scaler's checks are the engine's, so the optimizer it wraps
    applies them."""
    scaler = scaler_of(flavour, optimizer)
    inner = optimizer if scaler is None else scaler.inner_optimizer
    return flavour.apply_reduced(inner, grads, variables)


def saves_as(cycle_class: type, keras_class: type) -> type:
    """Gives ``cycle_class`` the names of ``keras_class``: saved files name
    the Keras' class, which :func:`adopt` turns into ``cycle_class`` on
    load."""
    cycle_class.__name__ = keras_class.__name__
    cycle_class.__qualname__ = keras_class.__qualname__
    cycle_class.__module__ = keras_class.__module__
    return cycle_class


def adopt(flavour: Flavour, scaler) -> None:
    """Makes ``scaler``, a LossScaleOptimizer that wraps an accumulating
    optimizer, hand whole cycles to it (this instance only); refuses a
    subclass. The taking-over class derives from the class it takes over."""
    cycle_class = flavour.cycle_loss_scaler
    (keras_class,) = cycle_class.__bases__
    if type(scaler) is keras_class:
        scaler.__class__ = cycle_class
    elif not isinstance(scaler, cycle_class):
        wrapper, keras = flavour.loss_scaler_names
        raise TypeError(
            f"{wrapper} can be wrapped in {keras}' LossScaleOptimizer, not in "
            f"a subclass of it: {type(scaler).__name__}."
        )
