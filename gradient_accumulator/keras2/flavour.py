"""The tf-keras flavour: what the hosts need of tf-keras, from its public
API and the private names in ``keras2/_compat``."""

from __future__ import annotations

import dataclasses

import tensorflow as tf
import tf_keras

from gradient_accumulator._which_keras import TF_KERAS
from gradient_accumulator.core.engine import Engine
from gradient_accumulator.core.settings import Settings
from gradient_accumulator.hosts.flavour import Flavour
from gradient_accumulator.keras2 import _compat, inner_optimizers, loss_scale
from gradient_accumulator.keras2._compat import (
    GLOBAL_CUSTOM_NAMES,
    Functional,
    config_as,
    draws_random,
)


def _deserialize_optimizer(config, custom_objects):
    return tf_keras.optimizers.deserialize(
        config,
        custom_objects=custom_objects,
        use_legacy_optimizer=config.get("config", {}).get("is_legacy_optimizer", False),
    )


def _build_optimizer(optimizer, variables) -> None:
    # A legacy optimizer makes its slots when it first applies.
    if not isinstance(optimizer, inner_optimizers.LegacyOptimizer):
        optimizer.build(variables)


# --- batch norm
class LayerEngine(Engine):
    """An engine whose variables are its layer's (non-trainable) weights, so
    the layer saves and restores them with its own."""

    def __init__(self, layer, settings: Settings):
        super().__init__(settings, name="accumulator")
        self._layer = layer

    def _make_variable(self, name, shape, dtype, initializer, **kwargs):
        if not isinstance(initializer, str):
            initializer = tf_keras.initializers.Constant(initializer)
        synchronization = kwargs.get("synchronization", "auto").upper()
        aggregation = kwargs.get("aggregation", "none").upper()
        return self._layer.add_weight(
            name,
            shape,
            dtype,
            initializer,
            trainable=False,
            experimental_autocast=False,
            synchronization=getattr(tf.VariableSynchronization, synchronization),
            aggregation=getattr(tf.VariableAggregation, aggregation),
        )


def _batch_norm_options(layer, axis, synchronized, kwargs):
    if isinstance(axis, list | tuple) and len(axis) == 1:
        axis = axis[0]  # a built tf-keras BatchNormalization's config
    if synchronized:
        raise ValueError(
            "The tf-keras AccumBatchNormalization does not support "
            "`synchronized=True`. Received: synchronized=True."
        )
    # tf-keras' fused kernel (its default for rank-4/5 inputs) updates the
    # moving variance with the unbiased variance: so does the layer, there.
    layer._fused_default = kwargs.pop("fused", None) is not False
    for unsupported in ("virtual_batch_size", "adjustment"):
        kwargs.pop(unsupported, None)
    return axis, {"fused": False}


def _unbiased_variance(layer, rank: int) -> bool:
    fused = rank in (4, 5) and layer._feature_axis % rank in (1, rank - 1)
    return layer._fused_default and fused


def _batch_norm_built(layer, rank: int) -> None:
    if layer._feature_axis == -1:
        # Any rank, as 0.5.x allowed: only the channels are fixed.
        channels = layer.moving_mean.shape[0]
        layer.input_spec = tf_keras.layers.InputSpec(min_ndim=2, axes={-1: channels})


def _training_flag(training):
    if training is None:
        training = tf_keras.backend.learning_phase()
    return tf.get_static_value(training)


def _batch_norm_moments(layer, inputs, mask, axes):
    if mask is None:
        moments = tf.nn.moments(inputs, axes)
    else:
        weights = tf.cast(tf.expand_dims(mask, -1), inputs.dtype)
        moments = tf.nn.weighted_moments(inputs, axes, weights)
    return moments, moments


def _moving_average(variable, value, momentum: float) -> None:
    variable.assign_sub((variable - value) * (1.0 - momentum))


# --- accumulate()
# The settings (besides accum_steps) a tf-keras accumulating model's config
# holds: the model wrapper's, which has no in-step mode.
SETTINGS = tuple(
    f.name
    for f in dataclasses.fields(Settings)
    if f.name not in ("accum_steps", "micro_batch_size")
)


def _accumulated_config(model, own: type) -> dict:
    # Its own class's config, with the settings the model wrapper saves.
    saved = model._setup.saved(tf_keras.saving.serialize_keras_object)
    settings = {k: v for k, v in saved.items() if k in SETTINGS}
    return {**config_as(model, own), **settings, "accum_steps": model.accum_steps}


# --- replace_batchnorm_layers
def _clone_graph(model, clone_layer):
    """``tf_keras.models.clone_model`` into nested models too (it has no
    ``recursive``: it would rebuild a nested model from its config, with new
    weights and its BatchNormalization layers unchanged)."""

    def clone(layer):
        if isinstance(layer, Functional):  # Sequential models included
            return _clone_graph(layer, clone_layer)
        return clone_layer(layer)

    return tf_keras.models.clone_model(model, clone_function=clone)


def _batch_norm_config(layer) -> dict:
    """What the new layer's config takes from ``layer`` beyond its config."""
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
    # A layer that tf-keras' fused kernel does not run (fused=False) updates
    # its moving variance with the biased variance: so will the new one.
    return {"axis": axis, "fused": layer.fused}


# --- verify
def _sublayers(layer) -> list:
    nested = [m for m in layer.submodules if isinstance(m, tf_keras.layers.Layer)]
    return [layer, *nested]


# --- model host
@tf.__internal__.tracking.no_automatic_dependency_tracking
def _untracked(model, fn):
    """``fn()``, with tf-keras tracking no attribute it sets on ``model``."""
    return fn()


def _functional_arguments(args, kwargs) -> bool:
    """Whether a model is built from ``inputs`` and ``outputs`` (tf-keras'
    rule: both positional, the first positional, or both keywords)."""
    return (
        len(args) == 2
        or (len(args) == 1 and "outputs" in kwargs)
        or ("inputs" in kwargs and "outputs" in kwargs)
    )


def _rebuild(cls, config, custom_objects, from_config):
    """A model of class ``cls`` from its config: tf-keras saves a Functional
    subclass with its own __init__ by its network and settings."""
    names = [f.name for f in dataclasses.fields(Settings)]
    settings = {k: config.pop(k) for k in names if k in config}
    if all(k in config for k in ("layers", "input_layers", "output_layers")):
        inputs, outputs, _ = _compat.reconstruct_from_config(config, custom_objects)
        return cls(inputs=inputs, outputs=outputs, name=config.get("name"), **settings)
    return cls(**config, **settings)


FLAVOUR = Flavour.from_namespace(
    globals(),
    name=TF_KERAS,
    keras=tf_keras,
    # --- optimizer host
    optimizer_kinds=inner_optimizers.KINDS,
    optimizer_text=(
        "tf-keras optimizer (tf.keras.optimizers.* or "
        "tf.keras.optimizers.legacy.*, where tf.keras is tf-keras)"
    ),
    optimizer_base_arguments=(),
    # The engine's variables are its own (a tf.Module the wrapper tracks).
    optimizer_engine=lambda wrapper, settings: Engine(settings),
    optimizer_keeps_strategy=True,
    optimizer_built=lambda optimizer: getattr(optimizer, "_built", False),
    optimizer_build_scope=lambda optimizer: tf.init_scope(),
    own_optimizer_variables=lambda wrapper: list(wrapper._accumulator.variables),
    optimizer_state=inner_optimizers.state,
    serialize_optimizer=tf_keras.optimizers.serialize,
    optimizer_config_extras=("is_legacy_optimizer",),
    wrapping_loss_scaler=_compat.wrapping_loss_scaler,
    cycle_loss_scaler=loss_scale.CycleLossScaleOptimizer,
    loss_scaler=loss_scale.LossScaleOptimizer,
    loss_scaler_names=("The tf-keras GradientAccumulateOptimizer", "tf-keras"),
    current_scale=lambda scaler: scaler.loss_scale,
    scale_loss=loss_scale.scaled_loss,
    dynamic_scale=lambda scaler: scaler.dynamic,
    cycle_scale_hooks=loss_scale.cycle_scale_hooks,
    apply_reduced=loss_scale.apply_gradients,
    scaler_replaces_loss_scale_factor=False,
    gradient_scale=lambda scaler: None,
    # --- batch norm
    layer_engine=LayerEngine,
    fixed_weight={"experimental_autocast": False},
    own_initializer=lambda initializer: initializer,
    counts_calls=False,
    # --- accumulate()
    custom_names=GLOBAL_CUSTOM_NAMES,
    compiled=lambda model: model._is_compiled,
    # --- replace_batchnorm_layers
    graph_models=(Functional,),  # Sequential models included
    batch_norm_unsupported=(
        "renorm",
        "virtual_batch_size",
        "adjustment",
        "synchronized",
    ),
    # --- verify
    optimizers=(tf_keras.optimizers.Optimizer, tf_keras.optimizers.legacy.Optimizer),
    batch_norms=(
        tf_keras.layers.BatchNormalization,
        tf_keras.layers.experimental.SyncBatchNormalization,
    ),
    # Current or legacy, as the optimizer is.
    copy_optimizer=lambda optimizer: type(optimizer).from_config(
        optimizer.get_config()
    ),
    draws_random=draws_random,
    # "dense/kernel:0" -> "kernel"
    variable_name=lambda variable: variable.name.split("/")[-1].split(":")[0],
    model_optimization=_compat.model_optimization,
    update_pruning_step=_compat.update_pruning_step,
    prunable_layers=_compat.prunable_layers,
    # --- model host
    engine=Engine,
    model_state_key="accumulator:",
    # The engine is not a layer attribute (its variables would join the
    # model's weights) but a checkpoint dependency of its own.
    own_state=_compat.track_state,
    disown_state=_compat.untrack_state,
    keras_tensor=tf_keras.__internal__.KerasTensor,
    functional=_compat.Functional,
    network_config=_compat.functional_config,
    model_from_config=_rebuild,
    in_step=False,
    forward=lambda model, x: model(x, training=True),
    compute_loss=lambda model, *args: model.compute_loss(*args),
    loss_terms=_compat.loss_terms,
    term_outputs=tf.nest.flatten,
    merge_mask=None,
    guards_empty_masks=False,
    # tf-keras divides a mean-reduced loss (and the regularisation losses)
    # by the replica count and lets the optimizer sum the replicas; a
    # "sum"-reduced term it does not divide (see core/loss_plan.py).
    whole_loss=lambda loss: loss,
    means_divided=True,
    replicas=lambda model: model.distribute_strategy.num_replicas_in_sync,
    loss_tracker=lambda model: None,  # compute_loss updates it
    builds_optimizer=False,
    state_scope=lambda model: model.distribute_strategy.scope(),
)
