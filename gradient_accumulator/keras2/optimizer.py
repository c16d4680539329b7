"""``GradientAccumulateOptimizer`` for tf-keras: accumulation as a wrapper of
a tf-keras optimizer (current or ``tf.keras.optimizers.legacy``)."""

from __future__ import annotations

import tf_keras

from gradient_accumulator.hosts.loss_scale import scaler_of
from gradient_accumulator.hosts.optimizer import OptimizerHost
from gradient_accumulator.keras2.flavour import FLAVOUR


@tf_keras.saving.register_keras_serializable(package="gradient_accumulator")
class GradientAccumulateOptimizer(OptimizerHost, tf_keras.optimizers.Optimizer):
    """Wraps a tf-keras optimizer so that it updates once per ``accum_steps``
    calls of ``apply_gradients`` (or ``minimize``).

    The wrapped optimizer sees one call per update, with the mean (or, with
    ``reduction="SUM"``, the sum) of the gradients of its ``accum_steps``
    calls: its state, ``iterations``, learning-rate schedule, clipping,
    weight decay and EMA advance once per update. Under a ``tf.distribute``
    strategy the cycle's sums are all-reduced once per update. A cycle whose
    accumulated gradient is not finite is skipped whole. For loss scaling,
    put the ``LossScaleOptimizer`` inside it (in a custom training loop); one
    around it, which tf-keras' ``compile`` adds under ``"mixed_float16"``, is
    refused with a ``TypeError`` (use ``GradientAccumulateModel`` there).

    Args: as the Keras 3 ``GradientAccumulateOptimizer``; ``optimizer`` is a
    tf-keras optimizer (``tf.keras.optimizers.*`` or
    ``tf.keras.optimizers.legacy.*`` where ``tf.keras`` is tf-keras) or the
    name of one.

    Example:

    >>> import numpy as np, tf_keras
    >>> from gradient_accumulator.keras2 import GradientAccumulateOptimizer
    >>> sgd = tf_keras.optimizers.legacy.SGD(0.1)  # a legacy one, or current
    >>> net = tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(1)])
    >>> net.compile(GradientAccumulateOptimizer(sgd, accum_steps=4), loss="mse")
    >>> _ = net.fit(np.ones((32, 4)), np.ones((32, 1)), batch_size=8, verbose=0)
    >>> int(sgd.iterations)  # 4 micro-batches of 8 -> one update
    1
    """

    _flavour = FLAVOUR

    @OptimizerHost.iterations.setter
    def iterations(self, variable):
        self.inner_optimizer.iterations = variable

    @property
    def lr(self):
        return self.learning_rate

    # ---------------------------------------------------------------- update
    def apply_gradients(
        self, grads_and_vars, name=None, skip_gradients_aggregation=False, **kwargs
    ):
        """Adds ``(gradient, variable)`` pairs to the cycle, applying it on
        its last call; returns :attr:`iterations`. Gradients that the caller
        already summed over replicas (``skip_gradients_aggregation=True``, or
        the legacy ``experimental_aggregate_gradients=False``) are counted
        once."""
        return self._apply(grads_and_vars, skip_gradients_aggregation, kwargs, name)

    def _apply(self, grads_and_vars, skip_aggregation, kwargs, name=None):
        pairs = list(grads_and_vars)
        variables = [v for _, v in pairs]
        self._build_for(variables)
        reduced = skip_aggregation or not kwargs.pop(
            "experimental_aggregate_gradients", True
        )
        if self._accumulator.plain() and not reduced:
            return self.inner_optimizer.apply_gradients(pairs, name=name, **kwargs)
        # A LossScaleOptimizer inside: the caller unscaled the gradients (as
        # tf-keras' protocol has it); its scale is checked and kept per cycle.
        scaler = scaler_of(FLAVOUR, self.inner_optimizer)
        self._accumulate([g for g, _ in pairs], variables, scaler, reduced)
        return self.iterations
