"""What the tf-keras hosts need of tf-keras optimizers: which kind one is,
its state, and how to apply gradients the engine already summed over
replicas."""

from __future__ import annotations

from collections.abc import Sequence

import tf_keras

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


def apply_reduced(optimizer, grads: Sequence, variables: Sequence):
    """Applies unscaled gradients already summed over replicas (replica
    context): a ``LossScaleOptimizer``'s checks are the engine's, so its
    inner optimizer applies them."""
    if isinstance(optimizer, tf_keras.mixed_precision.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    pairs = list(zip(grads, variables))
    if isinstance(optimizer, LegacyOptimizer):
        return optimizer.apply_gradients(pairs, experimental_aggregate_gradients=False)
    return optimizer.apply_gradients(pairs, skip_gradients_aggregation=True)
