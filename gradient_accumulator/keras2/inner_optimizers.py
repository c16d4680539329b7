"""What the tf-keras flavour needs of tf-keras optimizers: their kinds
(current and legacy) and their state; and, under the model wrapper's name,
how to apply gradients the engine already summed over replicas."""

from __future__ import annotations

import tf_keras

from gradient_accumulator.keras2.loss_scale import apply_gradients

Optimizer = tf_keras.optimizers.Optimizer
LegacyOptimizer = tf_keras.optimizers.legacy.Optimizer
KINDS = (Optimizer, LegacyOptimizer)


def state(optimizer) -> list:
    """The optimizer's variables (``variables`` is a method of the legacy
    optimizers and a property of the current ones)."""
    if isinstance(optimizer, LegacyOptimizer):
        return list(optimizer.variables())
    return list(optimizer.variables)


# The model wrapper's name for ``loss_scale.apply_gradients``.
apply_reduced = apply_gradients
