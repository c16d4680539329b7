"""What the tf-keras hosts need of tf-keras optimizers: which kind one is,
its state, and how to apply gradients the engine already summed over
replicas."""

from __future__ import annotations

import tf_keras

from gradient_accumulator.keras2.loss_scale import apply_gradients

Optimizer = tf_keras.optimizers.Optimizer
LegacyOptimizer = tf_keras.optimizers.legacy.Optimizer
KINDS = (Optimizer, LegacyOptimizer)


def is_optimizer(value) -> bool:
    """Whether ``value`` is a tf-keras optimizer (current or legacy)."""
    return isinstance(value, KINDS)


def state(optimizer) -> list:
    """The optimizer's variables (``variables`` is a method of the legacy
    optimizers and a property of the current ones)."""
    if isinstance(optimizer, LegacyOptimizer):
        return list(optimizer.variables())
    return list(optimizer.variables)


# The model wrapper's name for it.
apply_reduced = apply_gradients
