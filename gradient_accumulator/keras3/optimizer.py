"""``GradientAccumulateOptimizer``: accumulation as an optimizer wrapper."""

from __future__ import annotations

import keras

from gradient_accumulator.hosts.loss_scale import scaler_of
from gradient_accumulator.hosts.optimizer import OptimizerHost
from gradient_accumulator.keras3._compat import optimizer_built_variables
from gradient_accumulator.keras3.flavour import FLAVOUR


@keras.saving.register_keras_serializable(package="gradient_accumulator")
class GradientAccumulateOptimizer(OptimizerHost, keras.optimizers.Optimizer):
    """Wraps a Keras optimizer so that it updates once per ``accum_steps`` calls.

    Use it where the training loop is not yours to change, e.g. a plain
    ``keras.Model`` under a ``tf.distribute`` strategy. The wrapped optimizer
    sees exactly one call per update, with the mean (or, with
    ``reduction="SUM"``, the sum) of the ``accum_steps`` gradients it was
    given: its state, ``iterations``, learning-rate schedule, clipping, weight
    decay and EMA advance once per update and never see a partial gradient.

    For loss scaling (``"mixed_float16"``), put the ``LossScaleOptimizer``
    inside it and compile with ``auto_scale_loss=False``: micro-batches are
    unscaled before they are added, and a cycle with a non-finite gradient
    is skipped whole and halves the scale, which grows per update. A
    ``LossScaleOptimizer`` around it (which ``compile`` would add) is
    refused with a ``TypeError``: it would check and skip per micro-batch.

    The wrapper sees only gradients, so every micro-batch counts equally. For
    exact weighting of masked or weighted micro-batches of unequal size, use
    :class:`GradientAccumulateModel`.

    Args:
        optimizer: a ``keras.optimizers.Optimizer`` instance, or the name of
            one (``"sgd"``, ``"adam"``, ...).
        accum_steps: calls per update, an ``int >= 1``.
        reduction: ``"MEAN"`` (default) or ``"SUM"`` of the accumulated
            gradients.
        use_agc: apply adaptive gradient clipping to the accumulated gradient.
        clip_factor: adaptive gradient clipping factor (``> 0``).
        eps: adaptive gradient clipping epsilon (``> 0``).
        mixed_precision: accepted for 0.5.x compatibility and ignored (see
            loss scaling above).
        name: the optimizer's name.
        skip_update_fn: optional ``fn(grads, variables) -> bool tensor``,
            called with the accumulated mean gradient at the end of each
            cycle; True skips the cycle (non-finite cycles are always
            skipped). Not serialized.
        **kwargs: ``clipnorm``, ``clipvalue`` or ``global_clipnorm``, set on
            the wrapped optimizer (they act on the accumulated gradient).

    Example:

    >>> import keras, numpy as np
    >>> from gradient_accumulator import GradientAccumulateOptimizer
    >>> opt = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=4)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer=opt, loss="mse")
    >>> history = model.fit(np.ones((32, 4)), np.ones((32, 1)), batch_size=8, verbose=0)
    >>> int(opt.iterations)
    1
    """

    _flavour = FLAVOUR

    def scale_loss(self, loss):
        loss = self.inner_optimizer.scale_loss(loss)
        if self._has_own_loss_scaler:
            loss = loss * self._backward_share()
        return loss

    def get_weights(self) -> list:
        """The values of :attr:`variables`: the wrapper's own state (cycle
        counters and gradient sums) and the wrapped optimizer's."""
        return [v.numpy() for v in self.variables]

    def set_weights(self, weights) -> None:
        """Sets :attr:`variables` (the wrapper's and the wrapped optimizer's
        state, as :meth:`get_weights` lists them)."""
        if not self.built:
            raise ValueError(
                "You are calling `set_weights()` on an optimizer that has not "
                "yet been built. Call `optimizer.build(trainable_variables)` "
                "first."
            )
        super().set_weights(weights)

    # ---------------------------------------------------------------- update
    def apply_gradients(self, grads_and_vars):
        """Adds ``(gradient, variable)`` pairs to the cycle (applying it on
        its last call), as Keras' ``apply_gradients``; variables may be
        ``keras.Variable`` or raw ``tf.Variable``. Returns
        :attr:`iterations`, the number of updates so far."""
        grads, trainable_variables = zip(*grads_and_vars)
        self.apply(grads, trainable_variables)
        # As Keras' optimizers: the update count (the wrapped optimizer's).
        return self.iterations

    def apply(self, grads, trainable_variables=None):
        variables = self._prepare(trainable_variables)
        if not self._accumulates:
            return self.inner_optimizer.apply(list(grads), variables)
        self._accumulate(
            grads, variables, scaler_of(self._flavour, self.inner_optimizer)
        )

    @property
    def _has_own_loss_scaler(self) -> bool:
        return scaler_of(self._flavour, self.inner_optimizer) is not None

    def _prepare(self, trainable_variables) -> list:
        if trainable_variables is None:
            trainable_variables = optimizer_built_variables(self)
        variables = list(trainable_variables)
        self._build_for(variables)
        return variables
