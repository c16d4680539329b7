"""``GradientAccumulateOptimizer``: accumulation as an optimizer wrapper."""

from __future__ import annotations

import keras
import tensorflow as tf

from gradient_accumulator.accumulator import Accumulator
from gradient_accumulator.loss_scale import apply_gradients, loss_scale, scale_hooks
from gradient_accumulator.validation import check_accum_steps, warn_unneeded

_REDUCTIONS = ("MEAN", "SUM")
_CLIP_ARGS = ("clipnorm", "clipvalue", "global_clipnorm")


@keras.saving.register_keras_serializable(package="gradient_accumulator")
class GradientAccumulateOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras optimizer so that it updates once per ``accum_steps`` calls.

    Use it where the training loop is not yours to change, e.g. a plain
    ``keras.Model`` under a ``tf.distribute`` strategy. The wrapped optimizer
    sees exactly one call per update, with the mean (or, with
    ``reduction="SUM"``, the sum) of the ``accum_steps`` gradients it was
    given: its state, ``iterations``, learning-rate schedule, clipping, weight
    decay and EMA advance once per update and never see a partial gradient.

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
        mixed_precision: accepted for 0.5.x compatibility and ignored.
        name: the optimizer's name.
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
        **kwargs,
    ):
        check_accum_steps(accum_steps)
        inner = _resolve_optimizer(optimizer)
        if not isinstance(reduction, str) or reduction.upper() not in _REDUCTIONS:
            raise ValueError(
                f"`reduction` must be one of {_REDUCTIONS}. "
                f"Received: reduction={reduction!r}."
            )
        warn_unneeded(
            "mixed_precision",
            mixed_precision,
            False,
            "loss scaling is detected from the optimizer.",
        )
        clip_args = {k: kwargs.pop(k) for k in _CLIP_ARGS if k in kwargs}
        if kwargs:
            raise TypeError(
                "GradientAccumulateOptimizer got unexpected keyword argument(s) "
                f"{sorted(kwargs)}. Set learning rate, weight decay and the like "
                "on the wrapped optimizer."
            )
        for key, value in clip_args.items():
            if value is not None:
                setattr(inner, key, value)
        accumulator = Accumulator(
            accum_steps,
            track=self._track_state,
            name="accumulator",
            use_agc=use_agc,
            clip_factor=clip_factor,
            eps=eps,
        )
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner
        self.reduction = reduction.upper()
        self._accumulator = accumulator

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
        return self._variables + self.inner_optimizer.variables

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def _track_state(self, variable):
        self._track_variable(variable)

    # ---------------------------------------------------------------- update
    def build(self, var_list):
        if self.built:
            return
        self.inner_optimizer.build(var_list)
        self._accumulator.build(var_list)
        super().build(var_list)

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if trainable_variables is None:
            trainable_variables = self._trainable_variables
        variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
        if self.accum_steps == 1 and not self._accumulator.use_agc:
            return self.inner_optimizer.apply(grads, variables)

        # Keras divides each replica's loss by the replica count, so the
        # replicas' gradients sum to the global micro-batch's: each replica's
        # call is 1/replicas of a micro-step. This keeps the saved sums in
        # units of global micro-steps, so a checkpoint taken mid-cycle resumes
        # exactly with any number of replicas.
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        scale = loss_scale(self.inner_optimizer)
        weight = 1.0 if scale is None else 1.0 / scale
        factor = float(self.accum_steps) if self.reduction == "SUM" else None

        def apply_fn(accumulated):
            if factor is not None:
                accumulated = [None if g is None else g * factor for g in accumulated]
            apply_gradients(self.inner_optimizer, accumulated, variables)

        on_apply, on_skip = scale_hooks(self.inner_optimizer)
        self._accumulator.step(
            grads,
            variables,
            weight,
            apply_fn=apply_fn,
            count=1.0 / replicas,
            on_apply=on_apply,
            on_skip=on_skip,
        )

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
