"""A Keras' ``LossScaleOptimizer`` across an accumulation cycle, written once.

The hosts call these with their flavour, whose loss-scale fields (see
``hosts/flavour.py``, ``# --- optimizer host``) name the Keras' scaler
class and the few rules that differ; the rules that do not depend on the
Keras are here:

* :func:`scaler_of`: the scaler an accumulating object sees directly;
* :func:`scale_hooks`: the engine's hooks that keep a dynamic scale per
  cycle;
* :func:`apply_gradients`: a cycle's gradients reach the optimizer inside a
  scaler, whose checks are the engine's;
* :func:`wrapping_refused`: the error for a scaler around the optimizer
  wrapper.
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


def wrapping_refused(flavour: Flavour) -> TypeError:
    """The error for a LossScaleOptimizer built around the optimizer wrapper
    (``compile`` builds one under ``"mixed_float16"``)."""
    # Such a scaler checks, skips and grows its scale per call, i.e. per
    # micro-batch, and hands the wrapper nothing that names it, so the
    # wrapper cannot take the checks over: the layouts that work name the
    # scaler in the open.
    return TypeError(
        "A LossScaleOptimizer cannot wrap a GradientAccumulateOptimizer: it "
        "would check, skip and grow its loss scale once per micro-batch, so "
        "a micro-batch that overflows would be dropped from its cycle instead "
        "of the cycle being skipped. Under the 'mixed_float16' policy, "
        "accumulate in the model instead (GradientAccumulateModel, or "
        "accumulate(model)), whose compile wraps the plain optimizer; or put "
        "the scaler inside the wrapper, GradientAccumulateOptimizer("
        f"LossScaleOptimizer(optimizer), accum_steps=...){flavour.inner_scaler_hint}."
    )
