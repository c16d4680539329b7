"""The tf-keras flavour: the hooks the hosts call (``hosts.flavour.Flavour``),
from tf-keras' public API and the private names in ``keras2/_compat``."""

from __future__ import annotations

import tensorflow as tf
import tf_keras

from gradient_accumulator._which_keras import KERAS3, TF_KERAS, keras_of
from gradient_accumulator.core.engine import Engine
from gradient_accumulator.hosts.flavour import Flavour
from gradient_accumulator.keras2 import _compat, inner_optimizers, loss_scale
from gradient_accumulator.keras2._compat import (
    GLOBAL_CUSTOM_NAMES,
    Functional,
    config_as,
    draws_random,
)
from gradient_accumulator.keras2.tracked_engine import LayerEngine


# Its first argument (the model) is the object whose tracking it turns off.
@tf.__internal__.tracking.no_automatic_dependency_tracking
def _untracked(model, fn):
    """``fn()``, with tf-keras tracking no attribute it sets on ``model``."""
    return fn()


class KerasFlavour(Flavour):
    """tf-keras' hooks (see ``hosts.flavour.Flavour`` for what each does)."""

    name = TF_KERAS
    keras = tf_keras

    # --- values
    fixed_weight = {"experimental_autocast": False}
    counts_calls = False
    custom_names = GLOBAL_CUSTOM_NAMES
    graph_models = (Functional,)  # Sequential models included
    batch_norm_unsupported = (
        "renorm",
        "virtual_batch_size",
        "adjustment",
        "synchronized",
    )
    optimizers = (tf_keras.optimizers.Optimizer, tf_keras.optimizers.legacy.Optimizer)
    batch_norms = (
        tf_keras.layers.BatchNormalization,
        tf_keras.layers.experimental.SyncBatchNormalization,
    )
    update_pruning_step = staticmethod(_compat.update_pruning_step)
    prunable_layers = staticmethod(_compat.prunable_layers)
    optimizer_kinds = inner_optimizers.KINDS
    optimizer_text = (
        "tf-keras optimizer (tf.keras.optimizers.* or "
        "tf.keras.optimizers.legacy.*, where tf.keras is tf-keras)"
    )
    optimizer_base_arguments = ()
    optimizer_keeps_strategy = True
    optimizer_config_extras = ("is_legacy_optimizer",)
    loss_scaler = loss_scale.LossScaleOptimizer
    inner_scaler_hint = (
        " in a custom training loop (tf-keras' compile wraps every optimizer "
        "that is not a LossScaleOptimizer in one)"
    )
    engine = Engine
    model_state_key = "accumulator:"
    keras_tensor = tf_keras.__internal__.KerasTensor
    functional = Functional
    in_step = False
    merge_mask = None  # no "mean_with_sample_weight" reduction
    guards_empty_masks = False
    # tf-keras divides a mean-reduced loss (and the regularisation losses)
    # by the replica count and lets the optimizer sum the replicas; a
    # "sum"-reduced term it does not divide (see core/loss_plan.py).
    means_divided = True
    builds_optimizer = False

    # --- batch norm
    def batch_norm_options(self, layer, axis, synchronized, kwargs):
        if isinstance(axis, list | tuple) and len(axis) == 1:
            axis = axis[0]  # a built tf-keras BatchNormalization's config
        if synchronized:
            raise ValueError(
                "The tf-keras AccumBatchNormalization does not support "
                "`synchronized=True`. Received: synchronized=True."
            )
        # tf-keras' fused kernel (its default for rank-4/5 inputs) updates
        # the moving variance with the unbiased variance: so does the layer,
        # there.
        layer._fused_default = kwargs.pop("fused", None) is not False
        for unsupported in ("virtual_batch_size", "adjustment"):
            kwargs.pop(unsupported, None)
        return axis, {"fused": False}

    def layer_engine(self, layer, settings):
        return LayerEngine(layer, settings)

    def batch_norm_built(self, layer, rank):
        if layer._feature_axis == -1:
            # Any rank, as 0.5.x allowed: only the channels are fixed.
            channels = layer.moving_mean.shape[0]
            spec = tf_keras.layers.InputSpec(min_ndim=2, axes={-1: channels})
            layer.input_spec = spec

    def unbiased_variance(self, layer, rank):
        fused = rank in (4, 5) and layer._feature_axis % rank in (1, rank - 1)
        return layer._fused_default and fused

    def own_initializer(self, initializer):
        return initializer

    def training_flag(self, training):
        if training is None:
            training = tf_keras.backend.learning_phase()
        return tf.get_static_value(training)

    def batch_norm_moments(self, layer, inputs, mask, axes):
        if mask is None:
            moments = tf.nn.moments(inputs, axes)
        else:
            weights = tf.cast(tf.expand_dims(mask, -1), inputs.dtype)
            moments = tf.nn.weighted_moments(inputs, axes, weights)
        return moments, moments

    def moving_average(self, variable, value, momentum):
        variable.assign_sub((variable - value) * (1.0 - momentum))

    # --- accumulate(), replace_batchnorm_layers, verify
    def compiled(self, model):
        return _compat.is_compiled(model)

    def accumulated_config(self, model, own):
        # Its own class's config, with the settings the model wrapper saves.
        saved = model._accumulation_settings.saved(
            tf_keras.saving.serialize_keras_object
        )
        return {**config_as(model, own), **saved, "accum_steps": model.accum_steps}

    def clone_graph(self, model, clone_layer):
        # tf_keras.models.clone_model has no ``recursive``: it would rebuild
        # a nested model from its config, with new weights and its
        # BatchNormalization layers unchanged; so nested ones are cloned here.
        def clone(layer):
            if isinstance(layer, Functional):  # Sequential models included
                return self.clone_graph(layer, clone_layer)
            return clone_layer(layer)

        return tf_keras.models.clone_model(model, clone_function=clone)

    def batch_norm_config(self, layer):
        axis = layer.axis
        if not isinstance(axis, int):
            # tf-keras turns axis into a list of positive axes when it builds.
            if len(axis) != 1:
                raise ValueError(
                    f"BatchNormalization {layer.name!r} normalises over several "
                    f"axes ({list(axis)}); AccumBatchNormalization takes one."
                )
            (axis,) = axis
            if axis == layer.input_spec.ndim - 1:
                axis = -1  # a channels-last layer, as it was most likely given
        # A layer that tf-keras' fused kernel does not run (fused=False)
        # updates its moving variance with the biased variance: so will the
        # new one.
        return {"axis": axis, "fused": layer.fused}

    def copy_optimizer(self, optimizer):
        # Current or legacy, as the optimizer is.
        return type(optimizer).from_config(optimizer.get_config())

    def sublayers(self, layer):
        nested = [m for m in layer.submodules if isinstance(m, tf_keras.layers.Layer)]
        return [layer, *nested]

    def draws_random(self, layer):
        return draws_random(layer)

    def random_states(self, model):
        # tf-keras' Dropout and noise layers draw from stateful random ops
        # whose state no variable holds: a second pass draws anew.
        return None

    def call_losses(self, model):
        return [
            loss
            for layer in self.sublayers(model)
            for loss in _compat.call_losses(layer)
        ]

    def variable_name(self, variable):
        # "dense/kernel:0" -> "kernel"
        return variable.name.split("/")[-1].split(":")[0]

    def model_optimization(self, layer):
        return _compat.model_optimization(layer)

    # --- optimizer host
    def optimizer_engine(self, wrapper, settings):
        # The engine's variables are its own (a tf.Module the wrapper tracks).
        return Engine(settings)

    def optimizer_built(self, optimizer):
        return getattr(optimizer, "_built", False)

    def optimizer_build_scope(self, optimizer):
        return tf.init_scope()

    def build_optimizer(self, optimizer, variables):
        # A legacy optimizer makes its slots when it first applies.
        if not isinstance(optimizer, inner_optimizers.LegacyOptimizer):
            optimizer.build(variables)

    def own_optimizer_variables(self, wrapper):
        return list(wrapper._accumulator.variables)

    def optimizer_state(self, optimizer):
        return inner_optimizers.state(optimizer)

    def serialize_optimizer(self, optimizer):
        return tf_keras.optimizers.serialize(optimizer)

    def deserialize_optimizer(self, config, custom_objects):
        legacy = config.get("config", {}).get("is_legacy_optimizer", False)
        return tf_keras.optimizers.deserialize(
            config, custom_objects=custom_objects, use_legacy_optimizer=legacy
        )

    def marks_wrapped_optimizer(self, name, value):
        return _compat.marks_wrapped_optimizer(name, value)

    def current_scale(self, scaler):
        return scaler.loss_scale

    def scale_loss(self, optimizer, loss):
        return loss_scale.scaled_loss(optimizer, loss)

    def dynamic_scale(self, scaler):
        return scaler.dynamic

    def cycle_scale_hooks(self, scaler):
        return loss_scale.cycle_scale_hooks(scaler)

    def apply_reduced(self, optimizer, grads, variables):
        return loss_scale.apply_gradients(optimizer, grads, variables)

    def gradient_scale(self, scaler):
        return None

    # --- model host
    def untracked(self, model, fn):
        return _untracked(model, fn)

    def own_state(self, model, name, engine):
        # The engine is not a layer attribute (its variables would join the
        # model's weights) but a checkpoint dependency of its own.
        _compat.track_state(model, name, engine)

    def disown_state(self, model, name):
        _compat.untrack_state(model, name)

    def functional_arguments(self, args, kwargs):
        # tf-keras' rule: both positional, the first positional, or both
        # keywords.
        return (
            len(args) == 2
            or (len(args) == 1 and "outputs" in kwargs)
            or ("inputs" in kwargs and "outputs" in kwargs)
        )

    def network_config(self, model):
        return _compat.functional_config(model)

    def model_from_config(self, cls, config, custom_objects, from_config):
        # tf-keras saves a Functional subclass with its own __init__ by its
        # network (and the subclass's own config).
        if all(k in config for k in ("layers", "input_layers", "output_layers")):
            inputs, outputs, _ = _compat.reconstruct_from_config(config, custom_objects)
            return cls(inputs=inputs, outputs=outputs, name=config.get("name"))
        return cls(**config)

    def forward(self, model, x):
        return model(x, training=True)

    def compute_loss(self, model, x, y, y_pred, sample_weight):
        return model.compute_loss(x, y, y_pred, sample_weight)

    def loss_terms(self, model):
        return _compat.loss_terms(model)

    def term_outputs(self, y_pred):
        return tf.nest.flatten(y_pred)

    def whole_loss(self, loss):
        return loss

    def replicas(self, model):
        return model.distribute_strategy.num_replicas_in_sync

    def loss_tracker(self, model):
        return None  # compute_loss updates it

    def state_scope(self, model):
        return model.distribute_strategy.scope()

    # --- this Keras' public classes (their modules import this one)
    def other_optimizer_wrapper(self, optimizer):
        if keras_of(optimizer) != KERAS3:
            return None
        from gradient_accumulator.keras3.optimizer import GradientAccumulateOptimizer

        return GradientAccumulateOptimizer


FLAVOUR = KerasFlavour()
