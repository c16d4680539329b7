"""Loss scaling across an accumulation cycle.

Keras' ``LossScaleOptimizer`` checks every gradient it is given for NaN/Inf
and grows its scale after ``dynamic_growth_steps`` finite calls. Accumulation
must instead unscale each micro-batch's gradient before adding it (so that the
float32 sums are in one unit whatever the scale), check the *accumulated*
gradient once per update (the engine does), skip the whole cycle when it is
not finite, and count updates, not micro-batches, towards growth. This module
does that with the ``LossScaleOptimizer``'s own scale variables, so the state
stays that optimizer's and is saved with it.

Two layouts reach here:

* ``GradientAccumulateModel`` or ``GradientAccumulateOptimizer`` holding a
  ``LossScaleOptimizer``: the accumulating object sees the scaler directly
  (:func:`scaler_of`).
* ``LossScaleOptimizer(GradientAccumulateOptimizer(...))``, which
  ``compile`` builds under the ``"mixed_float16"`` policy: the scaler sits
  *outside* the accumulating optimizer. See :func:`_apply` for how the
  accumulating optimizer takes over the scaler's per-call role.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import keras
import tensorflow as tf

from gradient_accumulator.distributed import already_reduced

LossScaleOptimizer = keras.optimizers.LossScaleOptimizer


def scaler_of(optimizer) -> LossScaleOptimizer | None:
    """``optimizer`` if it keeps a dynamic loss scale, else None."""
    return optimizer if isinstance(optimizer, LossScaleOptimizer) else None


def loss_scale(optimizer) -> tf.Tensor | None:
    """The dynamic loss scale of ``optimizer``, or None if it has none."""
    if isinstance(optimizer, LossScaleOptimizer):
        return tf.convert_to_tensor(optimizer.dynamic_scale)
    return None


def apply_gradients(optimizer, grads: Sequence, variables: Sequence) -> None:
    """Applies unscaled, accumulated, replica-summed ``grads`` (replica context)."""
    if isinstance(optimizer, LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    with already_reduced(optimizer):
        optimizer.apply(list(grads), list(variables))


def scale_hooks(
    optimizer,
) -> tuple[Callable[[], None] | None, Callable[[], None] | None]:
    """``(on_apply, on_skip)`` engine hooks that keep a dynamic loss scale:
    grow after ``dynamic_growth_steps`` finite updates, halve on overflow."""
    if not isinstance(optimizer, LossScaleOptimizer):
        return None, None

    def on_apply() -> None:
        grow = tf.equal(optimizer.step_counter, optimizer.dynamic_growth_steps - 1)
        tf.cond(grow, lambda: _rescale(optimizer, 2.0), lambda: _count(optimizer))

    return on_apply, lambda: _rescale(optimizer, 0.5)


def _rescale(optimizer, factor: float) -> None:
    optimizer.step_counter.assign(0)
    optimizer.dynamic_scale.assign(optimizer.dynamic_scale * factor)


def _count(optimizer) -> None:
    optimizer.step_counter.assign_add(1)


# ------------------------------------------- LossScaleOptimizer(accumulating)
# Under "mixed_float16", ``compile`` wraps whatever optimizer it is given in a
# LossScaleOptimizer after the user built it, so an accumulating optimizer
# ends up *inside* one. Keras' LossScaleOptimizer.apply then checks, skips and
# counts growth per call, i.e. per micro-batch: an overflowing micro-batch is
# silently dropped from its cycle (instead of the cycle being skipped, as the
# big batch holding that sample would be), the scale changes mid-cycle, and it
# grows ``accum_steps`` times too fast.
#
# The accumulating optimizer must therefore take over the wrapper's role, but
# it never receives a reference to the LossScaleOptimizer that wraps it:
# ``compile`` creates the wrapper afterwards and only ever calls the inner
# optimizer's ``build`` and ``apply``. So the seam is the wrapper's own public
# methods: for an inner optimizer that declares the hooks below, ``apply``
# (and, when that inner optimizer keeps a scale of its own, ``scale_loss``)
# are handed to it; every other LossScaleOptimizer runs Keras' code
# unchanged. Dispatching in the class, rather than patching instances, covers
# every way the wrapper comes to exist - ``compile``, explicit construction,
# ``load_model``, ``clone_model`` - with no state and nothing to undo, and the
# saved configuration stays Keras' own, so files load without custom_objects.
#
# Hooks (see GradientAccumulateOptimizer):
#   inner._apply_with_loss_scaler(wrapper, grads, trainable_variables)
#   inner._has_own_loss_scaler: True when the user built the inner optimizer
#       around its own LossScaleOptimizer; the wrapper ``compile`` added on
#       top then only passes calls through, so one scale is ever in use.
keras_apply = getattr(
    LossScaleOptimizer.apply, "_keras_original", LossScaleOptimizer.apply
)
keras_scale_loss = getattr(
    LossScaleOptimizer.scale_loss, "_keras_original", LossScaleOptimizer.scale_loss
)


def _apply(self, grads, trainable_variables=None):
    takeover = getattr(self.inner_optimizer, "_apply_with_loss_scaler", None)
    if takeover is None:
        return keras_apply(self, grads, trainable_variables)
    if tf.distribute.in_cross_replica_context():
        raise ValueError("apply() must be called in a replica context.")
    if not self.built:
        with keras.name_scope(self.name, caller=self):
            self.build(trainable_variables)
        self.built = True
    return takeover(self, grads, trainable_variables)


def _scale_loss(self, loss):
    if getattr(self.inner_optimizer, "_has_own_loss_scaler", False):
        return self.inner_optimizer.scale_loss(loss)
    return keras_scale_loss(self, loss)


def install() -> None:
    """Hands ``LossScaleOptimizer.apply``/``scale_loss`` of accumulating inner
    optimizers to them (idempotent; Keras' code runs for every other one)."""
    for method, original in ((_apply, keras_apply), (_scale_loss, keras_scale_loss)):
        method.__doc__ = original.__doc__
        method._keras_original = original  # survives a reload of this module
        setattr(LossScaleOptimizer, original.__name__, method)
