"""``GradientAccumulateOptimizer``'s logic, written once for both Kerases.

:class:`OptimizerHost` is the mixin under each Keras' public
``GradientAccumulateOptimizer`` (``gradient_accumulator/keras3/optimizer.py``,
``gradient_accumulator/keras2/optimizer.py``): what differs between the
Kerases (which objects are optimizers, the engine's kind, the loss scaler's
rules, saving) comes from the ``# --- optimizer host`` fields of the class's
``_flavour`` (its Keras', set in the public class). What a Keras'
optimizer API alone has (Keras 3's ``apply`` and ``scale_loss``, tf-keras'
``apply_gradients`` options) stays in its public class.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from contextlib import nullcontext

import numpy as np
import tensorflow as tf

from gradient_accumulator.core.links import Binding
from gradient_accumulator.core.settings import Settings
from gradient_accumulator.core.validation import (
    check_single_accumulation,
    take_optimizer_arguments,
)
from gradient_accumulator.core.weighting import backward_share, optimizer_weight
from gradient_accumulator.hosts import loss_scale
from gradient_accumulator.hosts.flavour import Flavour

NAME = "GradientAccumulateOptimizer"


def _no_scaler() -> None:
    return None


class OptimizerHost:
    """The optimizer wrapper's logic over a Keras' optimizer base class (see
    the public ``GradientAccumulateOptimizer`` for the arguments)."""

    # The flavour of its Keras: each Keras' public class sets it.
    _flavour: Flavour

    def __new__(cls, optimizer="SGD", *args, **kwargs):
        # The optimizer handed in decides which Keras's wrapper wraps it.
        other = cls._flavour.other_optimizer_wrapper(optimizer)
        if other is not None:
            return other(optimizer, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        optimizer="SGD",
        accum_steps: int = Settings.accum_steps,
        reduction: str = "MEAN",
        use_agc: bool = Settings.use_agc,
        clip_factor: float = Settings.clip_factor,
        eps: float = Settings.eps,
        mixed_precision: bool = False,
        name: str = NAME,
        skip_update_fn: Callable[[list, list], tf.Tensor] | None = None,
        **kwargs,
    ):
        flavour = self._flavour
        inner = self._resolve_optimizer(optimizer)
        check_single_accumulation(inner, NAME)
        reduction, use_agc = take_optimizer_arguments(
            inner, reduction, mixed_precision, use_agc, kwargs
        )
        settings = Settings(
            accum_steps=accum_steps,
            use_agc=use_agc,
            clip_factor=clip_factor,
            eps=eps,
            skip_update_fn=skip_update_fn,
        )
        accumulator = flavour.optimizer_engine(self, settings)
        super().__init__(**dict(flavour.optimizer_base_arguments), name=name)
        self.inner_optimizer = inner
        self.reduction = reduction
        self._accumulator = accumulator
        # The strategy the optimizer was made under, where the engine's
        # variables are made as the wrapped optimizer's are (None: the
        # Keras' optimizer variables find it themselves).
        self._strategy = (
            tf.distribute.get_strategy() if flavour.optimizer_keeps_strategy else None
        )
        # The LossScaleOptimizer whose scale this optimizer's cycles use (set
        # when a step is traced). A weak reference: the scaler usually wraps
        # this optimizer, and a tracked back-reference would make a cycle of
        # checkpoint dependencies.
        self._scaler = _no_scaler
        # Set by FlushPartialCycle for the length of a fit: what ends that
        # fit's partial cycle, before Keras swaps EMA weights in.
        self._end_of_fit: Callable[[], None] | None = None

    def __setattr__(self, name, value):
        # A LossScaleOptimizer marks the optimizer it wraps as it is made
        # (compile() makes one under mixed_float16): refuse it there.
        if self._flavour.marks_wrapped_optimizer(name, value) and hasattr(
            self, "inner_optimizer"
        ):
            raise loss_scale.wrapping_refused(self._flavour)
        super().__setattr__(name, value)

    def _resolve_optimizer(self, optimizer):
        kinds, text = self._flavour.optimizer_kinds, self._flavour.optimizer_text
        if isinstance(optimizer, kinds):
            if isinstance(optimizer, OptimizerHost):
                raise ValueError(
                    f"`optimizer` is already a {NAME}; wrap the underlying "
                    "optimizer once."
                )
            return optimizer
        if isinstance(optimizer, str):
            try:
                return self._flavour.keras.optimizers.get(optimizer)
            except ValueError as error:
                raise ValueError(
                    f"`optimizer` must be a {text} or the name of one (e.g. "
                    f"'sgd', 'adam', 'adamw'). Received: optimizer={optimizer!r}."
                ) from error
        raise TypeError(
            f"`optimizer` must be a {text} instance or the name of one (e.g. "
            f"'sgd', 'adam'). Received: optimizer={optimizer!r} of type "
            f"{type(optimizer).__name__}."
        )

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
        # Keras 3's base constructor sets a placeholder before inner exists.
        if hasattr(self, "inner_optimizer"):
            self.inner_optimizer.learning_rate = learning_rate

    @property
    def variables(self):
        """The wrapper's own state (cycle counters and gradient sums), then
        the wrapped optimizer's."""
        return [
            *self._flavour.own_optimizer_variables(self),
            *self._flavour.optimizer_state(self.inner_optimizer),
        ]

    def set_weights(self, weights) -> None:
        """Sets :attr:`variables` (the wrapper's and the wrapped optimizer's
        state, in that order), as ``get_weights`` and ``.h5`` files list
        them."""
        variables, weights = self.variables, list(weights)
        if len(weights) != len(variables):
            inner = self._flavour.optimizer_state(self.inner_optimizer)
            raise ValueError(
                f"`set_weights` expects {len(variables)} arrays (the wrapper's "
                f"{len(variables) - len(inner)} and the wrapped optimizer's "
                f"{len(inner)}, as `variables` lists them). Received "
                f"{len(weights)}."
            )
        for variable, weight in zip(variables, weights):
            if tuple(variable.shape) != np.shape(weight):
                name = getattr(variable, "path", variable.name)
                raise ValueError(
                    f"Optimizer variable {name} has shape "
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

    def _backward_share(self) -> float:
        """``weighting.backward_share`` of one call under a dynamic loss
        scale, fixed when the step is traced: ``scale_loss`` and ``apply``
        of one step use the same value (exactness needs only that; the size
        need only be about right)."""
        if not self._accumulates:
            return 1.0
        return backward_share(self.reduction == "SUM", float(self.accum_steps))

    @property
    def _accumulates(self) -> bool:
        # Decided when a step is traced; set_accum_steps says when to trace
        # again.
        return not self._accumulator.plain()

    # ---------------------------------------------------------------- update
    def build(self, var_list):
        if self._flavour.optimizer_built(self):
            return
        variables = list(var_list)
        self._flavour.build_optimizer(self.inner_optimizer, variables)
        # Eagerly, also when a first step is being traced: the step to trace
        # depends on the state (see _accumulates), which variables created in
        # a traced function do not hold until it runs. In a step (replica
        # context) the strategy is in force already.
        scope = (
            nullcontext()
            if self._strategy is None or tf.distribute.has_strategy()
            else self._strategy.scope()
        )
        with tf.init_scope(), scope:
            self._accumulator.build(variables)
        super().build(var_list)
        binding = {"strategy": lambda: self._strategy} if self._strategy else {}
        self._accumulator.bind(
            Binding(
                variables=lambda: variables,
                apply_fn=lambda: self._apply_fn(variables),
                hooks=lambda: loss_scale.scale_hooks(self._flavour, self._scaler()),
                **binding,
            )
        )

    def _build_for(self, variables: list) -> None:
        """Builds the wrapper for ``variables`` at its first apply, as the
        Keras' own optimizers do."""
        if not self._flavour.optimizer_built(self):
            with self._flavour.optimizer_build_scope(self):
                self.build(variables)

    def _apply_fn(self, variables):
        return functools.partial(
            loss_scale.apply_gradients,
            self._flavour,
            self.inner_optimizer,
            variables=variables,
        )

    def _accumulate(self, grads, variables, scaler, reduced: bool = False) -> None:
        """Adds one call's gradients to the cycle (``scaler``: the dynamic
        loss scaler they were computed under, or None; ``reduced``: already
        summed over replicas)."""
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        weight, count = optimizer_weight(
            self.reduction,
            replicas,
            self._flavour.gradient_scale(scaler),
            self._accumulator.opens_cycle,
            # What scale_loss multiplied the loss by, besides the scale.
            share=self._backward_share,
        )
        if reduced and replicas > 1:
            # Every replica holds the total already; the engine sums again.
            weight = 1.0 / replicas
        self._scaler = _no_scaler if scaler is None else weakref.ref(scaler)
        on_apply, on_skip = loss_scale.scale_hooks(self._flavour, scaler)
        self._accumulator.step(
            list(grads),
            variables,
            apply_fn=self._apply_fn(variables),
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
        self._accumulator.flush(self._strategy)

    def drop_partial_cycle(self) -> None:
        """Discards the current, incomplete cycle."""
        self._accumulator.drop(self._strategy)

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": self._flavour.serialize_optimizer(self.inner_optimizer),
            "accum_steps": self.accum_steps,
            "reduction": self.reduction,
            "use_agc": self._accumulator.use_agc,
            "clip_factor": self._accumulator.clip_factor,
            "eps": self._accumulator.eps,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        for key in cls._flavour.optimizer_config_extras:
            config.pop(key, None)
        config["optimizer"] = cls._flavour.deserialize_optimizer(
            config["optimizer"], custom_objects
        )
        return cls(**config)
