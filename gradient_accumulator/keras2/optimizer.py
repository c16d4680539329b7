"""``GradientAccumulateOptimizer`` for tf-keras: accumulation as a wrapper of
a tf-keras optimizer (current or ``tf.keras.optimizers.legacy``)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import nullcontext

import numpy as np
import tensorflow as tf
import tf_keras

from gradient_accumulator._which_keras import TF_KERAS, optimizer_wrapper_for
from gradient_accumulator.core.engine import Engine
from gradient_accumulator.core.links import Binding
from gradient_accumulator.core.validation import (
    check_accum_steps,
    take_optimizer_arguments,
)
from gradient_accumulator.core.weighting import optimizer_weight
from gradient_accumulator.keras2._compat import wrapping_loss_scaler
from gradient_accumulator.keras2.inner_optimizers import (
    LegacyOptimizer,
    apply_reduced,
    is_optimizer,
    state,
)
from gradient_accumulator.keras2.loss_scale import adopt, scale_hooks


@tf_keras.saving.register_keras_serializable(package="gradient_accumulator")
class GradientAccumulateOptimizer(tf_keras.optimizers.Optimizer):
    """Wraps a tf-keras optimizer so that it updates once per ``accum_steps``
    calls of ``apply_gradients`` (or ``minimize``).

    The wrapped optimizer sees one call per update, with the mean (or, with
    ``reduction="SUM"``, the sum) of the gradients of its ``accum_steps``
    calls: its state, ``iterations``, learning-rate schedule, clipping,
    weight decay and EMA advance once per update. Under a ``tf.distribute``
    strategy the cycle's sums are all-reduced once per update. A cycle whose
    accumulated gradient is not finite is skipped whole.

    Args: as the Keras 3 ``GradientAccumulateOptimizer``; ``optimizer`` is a
    tf-keras optimizer (``tf.keras.optimizers.*`` or
    ``tf.keras.optimizers.legacy.*`` where ``tf.keras`` is tf-keras) or the
    name of one.

    Example:

    >>> import numpy as np, tf_keras
    >>> from gradient_accumulator.keras2 import GradientAccumulateOptimizer
    >>> opt = GradientAccumulateOptimizer(tf_keras.optimizers.SGD(0.1), accum_steps=4)
    >>> model = tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(1)])
    >>> model.compile(optimizer=opt, loss="mse")
    >>> history = model.fit(np.ones((32, 4)), np.ones((32, 1)), batch_size=8, verbose=0)
    >>> int(opt.iterations)
    1
    """

    def __new__(cls, optimizer="SGD", *args, **kwargs):
        # The optimizer handed in decides which Keras's wrapper wraps it.
        other = optimizer_wrapper_for(optimizer, TF_KERAS)
        if other is not None:
            return other(optimizer, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        optimizer="SGD",
        accum_steps: int = 1,
        reduction: str = "MEAN",
        use_agc: bool = False,
        clip_factor: float = 0.01,
        eps: float = 1e-3,
        mixed_precision: bool = False,
        name: str = "GradientAccumulateOptimizer",
        skip_update_fn: Callable[[list, list], tf.Tensor] | None = None,
        **kwargs,
    ):
        check_accum_steps(accum_steps)
        inner = _resolve_optimizer(optimizer)
        reduction, use_agc = take_optimizer_arguments(
            inner, reduction, mixed_precision, use_agc, kwargs
        )
        accumulator = Engine(
            accum_steps,
            name="accumulator",
            use_agc=use_agc,
            clip_factor=clip_factor,
            eps=eps,
            skip_update_fn=skip_update_fn,
        )
        super().__init__(name=name)
        self.inner_optimizer = inner
        self.reduction = reduction
        self._accumulator = accumulator
        # The strategy the optimizer was made under: the engine's variables
        # are made in it, as the wrapped optimizer's are.
        self._strategy = tf.distribute.get_strategy()
        # The LossScaleOptimizer whose scale this optimizer's cycles use (set
        # when a step is traced). A weak reference: the scaler wraps this
        # optimizer, and a tracked back-reference would make a cycle of
        # checkpoint dependencies.
        self._scaler = _no_scaler
        # A FlushPartialCycle callback's end-of-fit action, if one is set.
        self._end_of_fit: Callable[[], None] | None = None

    # ------------------------------------------------------------ delegation
    @property
    def accum_steps(self) -> int:
        return self._accumulator.accum_steps

    @property
    def iterations(self):
        """The number of updates (not of calls)."""
        return self.inner_optimizer.iterations

    @iterations.setter
    def iterations(self, variable):
        self.inner_optimizer.iterations = variable

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def lr(self):
        return self.learning_rate

    @property
    def variables(self):
        """The wrapper's own state (cycle counters and gradient sums), then
        the wrapped optimizer's."""
        return [*self._accumulator.variables, *state(self.inner_optimizer)]

    def set_weights(self, weights) -> None:
        """Sets :attr:`variables` (the wrapper's and the wrapped optimizer's
        state, in that order), as ``.h5`` loading does."""
        variables, weights = self.variables, list(weights)
        if len(weights) != len(variables):
            raise ValueError(
                f"`set_weights` expects {len(variables)} arrays (the wrapper's "
                "state, then the wrapped optimizer's, as `variables` lists "
                f"them). Received {len(weights)}."
            )
        for variable, weight in zip(variables, weights):
            if tuple(variable.shape) != tuple(np.shape(weight)):
                raise ValueError(
                    f"Optimizer variable {variable.name} has shape "
                    f"{tuple(variable.shape)}, not compatible with provided "
                    f"weight shape {np.shape(weight)}."
                )
            variable.assign(weight)

    def finalize_variable_values(self, var_list):
        end, self._end_of_fit = self._end_of_fit, None
        if end is not None:
            end()
        finalize = getattr(self.inner_optimizer, "finalize_variable_values", None)
        if finalize is not None:
            finalize(var_list)

    # ---------------------------------------------------------------- update
    def _adopt_scaler(self) -> None:
        # Called by our methods that a wrapping LossScaleOptimizer calls
        # before its first apply_gradients.
        scaler = wrapping_loss_scaler(self)
        if scaler is not None:
            adopt(scaler)

    def compute_gradients(self, loss, var_list, tape=None):
        self._adopt_scaler()
        return super().compute_gradients(loss, var_list, tape=tape)

    def build(self, var_list):
        self._adopt_scaler()
        if getattr(self, "_built", False):
            return
        super().build(var_list)
        variables = list(var_list)
        if not isinstance(self.inner_optimizer, LegacyOptimizer):
            self.inner_optimizer.build(variables)
        # In a step (replica context) the strategy is in force already.
        scope = (
            nullcontext() if tf.distribute.has_strategy() else self._strategy.scope()
        )
        with tf.init_scope(), scope:
            self._accumulator.build(variables)
        self._accumulator.bind(
            Binding(
                variables=lambda: variables,
                apply_fn=lambda: self._apply_fn(variables),
                hooks=lambda: scale_hooks(self._scaler()),
                strategy=lambda: self._strategy,
            )
        )

    def _apply_fn(self, variables):
        return lambda grads: apply_reduced(self.inner_optimizer, grads, variables)

    def apply_gradients(
        self, grads_and_vars, name=None, skip_gradients_aggregation=False, **kwargs
    ):
        """Adds ``(gradient, variable)`` pairs to the cycle, applying it on
        its last call; returns :attr:`iterations`. Gradients that the caller
        already summed over replicas (``skip_gradients_aggregation=True``, or
        the legacy ``experimental_aggregate_gradients=False``) are counted
        once."""
        return self._apply(grads_and_vars, skip_gradients_aggregation, kwargs, name)

    def _apply_with_loss_scaler(
        self, scaler, grads_and_vars, skip_gradients_aggregation=False, **kwargs
    ):
        """``scaler.apply_gradients`` for a LossScaleOptimizer wrapping this
        one (see ``keras2.loss_scale``): unscaled gradients of one call,
        which this cycle checks and counts once, with ``scaler``'s scale."""
        return self._apply(
            grads_and_vars, skip_gradients_aggregation, kwargs, scaler=scaler
        )

    def _apply(self, grads_and_vars, skip_aggregation, kwargs, name=None, scaler=None):
        pairs = list(grads_and_vars)
        variables = [v for _, v in pairs]
        if not getattr(self, "_built", False):
            with tf.init_scope():
                self.build(variables)
        reduced = skip_aggregation or not kwargs.pop(
            "experimental_aggregate_gradients", True
        )
        if scaler is None and self._accumulator.plain() and not reduced:
            return self.inner_optimizer.apply_gradients(pairs, name=name, **kwargs)
        self._accumulate([g for g, _ in pairs], variables, reduced, scaler)
        return self.iterations

    def _accumulate(self, grads, variables, reduced: bool, scaler=None) -> None:
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        weight, count = optimizer_weight(
            self.reduction, replicas, None, self._accumulator.opens_cycle
        )
        if reduced and replicas > 1:
            # Every replica holds the total already; the engine sums again.
            weight = 1.0 / replicas
        self._scaler = _no_scaler if scaler is None else weakref.ref(scaler)
        on_apply, on_skip = scale_hooks(scaler)
        self._accumulator.step(
            grads,
            variables,
            apply_fn=self._apply_fn(variables),
            weight=weight,
            count=count,
            on_apply=on_apply,
            on_skip=on_skip,
        )

    # ------------------------------------------------------- cycle control
    def set_accum_steps(self, accum_steps: int) -> bool:
        """Changes ``accum_steps`` from the next cycle boundary on; True when
        a train function traced before must be traced again."""
        return self._accumulator.set_accum_steps(accum_steps)

    def flush(self) -> None:
        """Applies the current, incomplete cycle now (its mean gradient)."""
        self._accumulator.flush(self._strategy)

    def drop_partial_cycle(self) -> None:
        """Discards the current, incomplete cycle."""
        self._accumulator.drop(self._strategy)

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": tf_keras.optimizers.serialize(self.inner_optimizer),
            "accum_steps": self.accum_steps,
            "reduction": self.reduction,
            "use_agc": self._accumulator.use_agc,
            "clip_factor": self._accumulator.clip_factor,
            "eps": self._accumulator.eps,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config.pop("is_legacy_optimizer", None)
        config["optimizer"] = tf_keras.optimizers.deserialize(
            config["optimizer"],
            custom_objects=custom_objects,
            use_legacy_optimizer=config["optimizer"]
            .get("config", {})
            .get("is_legacy_optimizer", False),
        )
        return cls(**config)


def _no_scaler() -> None:
    return None


def _resolve_optimizer(optimizer):
    if is_optimizer(optimizer):
        if isinstance(optimizer, GradientAccumulateOptimizer):
            raise ValueError(
                "`optimizer` is already a GradientAccumulateOptimizer; "
                "wrap the underlying optimizer once."
            )
        return optimizer
    if isinstance(optimizer, str):
        try:
            return tf_keras.optimizers.get(optimizer)
        except ValueError as error:
            raise ValueError(
                "`optimizer` must be a tf-keras optimizer or the name of one "
                f"(e.g. 'sgd', 'adam'). Received: optimizer={optimizer!r}."
            ) from error
    raise TypeError(
        "`optimizer` must be a tf-keras optimizer instance "
        "(tf.keras.optimizers.* or tf.keras.optimizers.legacy.*, where "
        "tf.keras is tf-keras) or the name of one (e.g. 'sgd', 'adam'). "
        f"Received: optimizer={optimizer!r} of type {type(optimizer).__name__}."
    )
