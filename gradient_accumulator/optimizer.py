"""``GradientAccumulateOptimizer``: accumulation as an optimizer wrapper."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from gradient_accumulator._keras_compat import (
    optimizer_built_variables,
    optimizer_own_variables,
    optimizer_variable_tracker,
    wrapping_loss_scaler,
)
from gradient_accumulator._which_keras import KERAS3, optimizer_wrapper_for
from gradient_accumulator.core.links import Binding
from gradient_accumulator.core.validation import (
    check_accum_steps,
    check_single_accumulation,
    take_optimizer_arguments,
)
from gradient_accumulator.core.weighting import backward_share, optimizer_weight
from gradient_accumulator.loss_scale import (
    adopt,
    apply_gradients,
    keras_apply,
    loss_scale,
    scale_hooks,
    scaler_of,
)
from gradient_accumulator.tracked_engine import Accumulator


@keras.saving.register_keras_serializable(package="gradient_accumulator")
class GradientAccumulateOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras optimizer so that it updates once per ``accum_steps`` calls.

    Use it where the training loop is not yours to change, e.g. a plain
    ``keras.Model`` under a ``tf.distribute`` strategy. The wrapped optimizer
    sees exactly one call per update, with the mean (or, with
    ``reduction="SUM"``, the sum) of the ``accum_steps`` gradients it was
    given: its state, ``iterations``, learning-rate schedule, clipping, weight
    decay and EMA advance once per update and never see a partial gradient.

    Under the ``"mixed_float16"`` policy ``compile`` wraps it in a
    ``LossScaleOptimizer``, which then hands whole cycles to it: micro-batches
    are unscaled before they are added, and a cycle with a non-finite
    gradient is skipped whole and halves the scale, which grows per update.

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
        mixed_precision: accepted for 0.5.x compatibility and ignored: loss
            scaling is handled automatically.
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

    def __new__(cls, optimizer="SGD", *args, **kwargs):
        # The optimizer handed in decides which Keras's wrapper wraps it.
        other = optimizer_wrapper_for(optimizer, KERAS3)
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
        check_single_accumulation(inner, "GradientAccumulateOptimizer")
        reduction, use_agc = take_optimizer_arguments(
            inner, reduction, mixed_precision, use_agc, kwargs
        )
        accumulator = Accumulator(
            accum_steps,
            track=optimizer_variable_tracker(self),
            name="accumulator",
            use_agc=use_agc,
            clip_factor=clip_factor,
            eps=eps,
            skip_update_fn=skip_update_fn,
        )
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner
        self.reduction = reduction
        self._accumulator = accumulator
        # The LossScaleOptimizer whose scale this optimizer's cycles use (set
        # when a step is traced; see loss_scale.py). A weak reference: the
        # scaler usually wraps this optimizer, and a tracked back-reference
        # would make a cycle of checkpoint dependencies.
        self._scaler = _no_scaler
        # Set by FlushPartialCycle for the length of a fit: what ends that
        # fit's partial cycle, before Keras swaps EMA weights in.
        self._end_of_fit: Callable[[], None] | None = None

    # ------------------------------------------------------------ delegation
    @property
    def accum_steps(self) -> int:
        return self._accumulator.accum_steps

    @property
    def iterations(self):
        """The number of updates (not of calls)."""
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        # Keras' base constructor sets a placeholder before inner exists.
        if hasattr(self, "inner_optimizer"):
            self.inner_optimizer.learning_rate = learning_rate

    @property
    def variables(self):
        return optimizer_own_variables(self) + self.inner_optimizer.variables

    def scale_loss(self, loss):
        loss = self.inner_optimizer.scale_loss(loss)
        if self._has_own_loss_scaler:
            loss = loss * self._backward_share()
        return loss

    def _backward_share(self) -> float:
        """``weighting.backward_share`` of one call under a dynamic loss
        scale, fixed when the step is traced: ``scale_loss`` and ``apply``
        of one step use the same value (exactness needs only that; the size
        need only be about right)."""
        if not self._accumulates:
            return 1.0
        return backward_share(self.reduction == "SUM", float(self.accum_steps))

    def finalize_variable_values(self, var_list):
        end, self._end_of_fit = self._end_of_fit, None
        if end is not None:
            end()
        self.inner_optimizer.finalize_variable_values(var_list)

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
        variables, weights = self.variables, list(weights)
        if len(weights) != len(variables):
            raise ValueError(
                f"`set_weights` expects {len(variables)} arrays (the wrapper's "
                f"{len(optimizer_own_variables(self))} and the wrapped optimizer's "
                f"{len(self.inner_optimizer.variables)}, as `get_weights` "
                f"returns them). Received {len(weights)}."
            )
        for variable, weight in zip(variables, weights):
            if tuple(variable.shape) != np.shape(weight):
                raise ValueError(
                    f"Optimizer variable {variable.path} has shape "
                    f"{tuple(variable.shape)}, not compatible with provided "
                    f"weight shape {np.shape(weight)}."
                )
            variable.assign(weight)

    # ---------------------------------------------------------------- update
    def build(self, var_list):
        # A LossScaleOptimizer builds the optimizer it wraps (compile() puts
        # one around this one under mixed_float16): it must hand whole cycles
        # to us, and, as Keras does for the optimizer it wraps directly, its
        # dynamic scale replaces any static factor of the wrapped optimizer.
        scaler = wrapping_loss_scaler(self)
        if scaler is not None:
            adopt(scaler)
            self.inner_optimizer.loss_scale_factor = None
        if self.built:
            return
        self.inner_optimizer.build(var_list)
        # Eagerly, also when a first step is being traced: the step to trace
        # depends on the state (see _accumulates), which variables created in
        # a traced function do not hold until it runs.
        with tf.init_scope():
            self._accumulator.build(var_list)
        super().build(var_list)
        variables = list(var_list)
        self._accumulator.bind(
            Binding(
                variables=lambda: variables,
                apply_fn=lambda: functools.partial(
                    apply_gradients, self.inner_optimizer, variables=variables
                ),
                hooks=lambda: scale_hooks(self._scaler()),
            )
        )

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
        self._accumulate(grads, variables, scaler_of(self.inner_optimizer))

    def _apply_with_loss_scaler(self, scaler, grads, trainable_variables=None):
        """``scaler.apply`` when ``scaler`` is a LossScaleOptimizer wrapping
        this optimizer (see ``loss_scale._apply``): ``grads`` are scaled by
        ``scaler``'s dynamic scale, which this cycle then owns."""
        if self._has_own_loss_scaler:
            # The loss was scaled by our own scaler (``scaler.scale_loss``
            # passes through too): ``scaler`` is a shell added by compile().
            return self.apply(grads, trainable_variables)
        if not self._accumulates:
            # One call per update: Keras' own per-call loss scaling is right.
            return keras_apply(scaler, grads, trainable_variables)
        self._accumulate(grads, self._prepare(trainable_variables), scaler)

    @property
    def _has_own_loss_scaler(self) -> bool:
        return scaler_of(self.inner_optimizer) is not None

    @property
    def _accumulates(self) -> bool:
        # Decided when a step is traced; set_accum_steps says when to trace
        # again.
        return not self._accumulator.plain()

    def _prepare(self, trainable_variables) -> list:
        if trainable_variables is None:
            trainable_variables = optimizer_built_variables(self)
        variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
        return variables

    def _accumulate(self, grads, variables, scaler) -> None:
        grads = list(grads)
        weight, count = optimizer_weight(
            self.reduction,
            tf.distribute.get_strategy().num_replicas_in_sync,
            loss_scale(scaler),
            self._accumulator.opens_cycle,
            # What scale_loss multiplied the loss by, besides the scale.
            share=self._backward_share,
        )

        def apply_fn(accumulated):
            apply_gradients(self.inner_optimizer, accumulated, variables)

        self._scaler = _no_scaler if scaler is None else weakref.ref(scaler)
        on_apply, on_skip = scale_hooks(scaler)
        self._accumulator.step(
            grads,
            variables,
            apply_fn=apply_fn,
            weight=weight,
            count=count,
            on_apply=on_apply,
            on_skip=on_skip,
        )

    # ------------------------------------------------------- cycle control
    def set_accum_steps(self, accum_steps: int) -> bool:
        """Changes ``accum_steps`` from the next cycle boundary on.

        Returns True when a train function traced before must be traced again
        (``model.make_train_function(force=True)``);
        :class:`~gradient_accumulator.AccumulationScheduler` does that.
        """
        return self._accumulator.set_accum_steps(accum_steps)

    def flush(self) -> None:
        """Applies the current, incomplete cycle now (its mean gradient)."""
        self._accumulator.flush()

    def drop_partial_cycle(self) -> None:
        """Discards the current, incomplete cycle."""
        self._accumulator.drop()

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "accum_steps": self.accum_steps,
            "reduction": self.reduction,
            "use_agc": self._accumulator.use_agc,
            "clip_factor": self._accumulator.clip_factor,
            "eps": self._accumulator.eps,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["optimizer"] = keras.saving.deserialize_keras_object(
            config["optimizer"], custom_objects=custom_objects
        )
        return cls(**config)


def _no_scaler() -> None:
    return None


def _resolve_optimizer(optimizer) -> keras.optimizers.Optimizer:
    if isinstance(optimizer, keras.optimizers.Optimizer):
        if isinstance(optimizer, GradientAccumulateOptimizer):
            raise ValueError(
                "`optimizer` is already a GradientAccumulateOptimizer; "
                "wrap the underlying optimizer once."
            )
        return optimizer
    if isinstance(optimizer, str):
        try:
            return keras.optimizers.get(optimizer)
        except ValueError as error:
            raise ValueError(
                "`optimizer` must be a keras.optimizers.Optimizer or the name of "
                f"one (e.g. 'sgd', 'adam', 'adamw'). Received: optimizer={optimizer!r}."
            ) from error
    raise TypeError(
        "`optimizer` must be a keras.optimizers.Optimizer instance or the name "
        "of one (e.g. 'sgd', 'adam'). Received: "
        f"optimizer={optimizer!r} of type {type(optimizer).__name__}."
    )
