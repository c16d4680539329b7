"""The Keras 3 flavour: what the hosts need of Keras 3, from its public API
and the private names in ``_keras_compat``."""

from __future__ import annotations

import contextlib
import functools

import keras
import tensorflow as tf
from keras import ops

from gradient_accumulator import _keras_compat as compat
from gradient_accumulator import loss_scale
from gradient_accumulator._keras_compat import (
    GLOBAL_CUSTOM_NAMES,
    Functional,
    all_layers,
    batch_norm_moments,
    batch_norm_reduction_axes,
    clone_initializer,
    track_variable,
)
from gradient_accumulator._which_keras import KERAS3
from gradient_accumulator.core.validation import check_bool
from gradient_accumulator.hosts import loss_scale as host_loss_scale
from gradient_accumulator.hosts.flavour import Flavour
from gradient_accumulator.tracked_engine import Accumulator


def _optimizer_engine(wrapper, settings) -> Accumulator:
    # The wrapper tracks (and saves) the engine's variables as its own.
    return Accumulator(settings, track=compat.optimizer_variable_tracker(wrapper))


# --- batch norm
def _batch_norm_options(layer, axis, synchronized, kwargs):
    check_bool("synchronized", synchronized)
    return axis, {"synchronized": synchronized}


def _batch_norm_moments(layer, inputs, mask, axes):
    moments = batch_norm_moments(layer, inputs, mask)
    if layer.synchronized and mask is None:
        # The forward pass used every replica's moments; the pool needs this
        # replica's own (the engine sums replicas at the cycle end).
        return moments, ops.moments(inputs, axes=batch_norm_reduction_axes(layer))
    return moments, moments


def _moving_average(variable, value, momentum: float) -> None:
    # Keras' update, verbatim (not assign_moving_average's form).
    moving = ops.cast(variable, variable.dtype)
    variable.assign(moving * momentum + value * (1.0 - momentum))


def _no_change(*args) -> None:
    return None


# --- replace_batchnorm_layers
def _clone_graph(model, clone_layer):
    return keras.models.clone_model(model, clone_function=clone_layer, recursive=True)


# --- model host
def _model_from_config(cls, config, custom_objects, from_config):
    """A model of class ``cls`` from its config (a functional one's holds
    its network)."""
    if all(k in config for k in ("layers", "input_layers", "name")):
        return compat.functional_from_config(cls, config, custom_objects=custom_objects)
    return from_config(config, custom_objects=custom_objects)


def _forward(model, x):
    return model(x, training=True) if compat.call_has_training_arg(model) else model(x)


def _compute_loss(model, x, y, y_pred, sample_weight):
    return compat.compute_loss(
        model, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
    )


def _merge_mask(weights, mask):
    return compat.apply_mask(
        weights, mask, dtype="float32", reduction="mean_with_sample_weight"
    )


FLAVOUR = Flavour.from_namespace(
    globals(),
    name=KERAS3,
    keras=keras,
    # --- optimizer host
    optimizer_kinds=(keras.optimizers.Optimizer,),
    optimizer_text="keras.optimizers.Optimizer",
    optimizer_base_arguments=(("learning_rate", 0.0),),
    optimizer_keeps_strategy=False,
    optimizer_built=lambda optimizer: optimizer.built,
    optimizer_build_scope=lambda optimizer: keras.name_scope(
        optimizer.name, caller=optimizer
    ),
    build_optimizer=lambda optimizer, variables: optimizer.build(variables),
    own_optimizer_variables=compat.optimizer_own_variables,
    optimizer_state=lambda optimizer: optimizer.variables,
    serialize_optimizer=keras.saving.serialize_keras_object,
    deserialize_optimizer=lambda config, custom_objects: (
        keras.saving.deserialize_keras_object(config, custom_objects=custom_objects)
    ),
    optimizer_config_extras=(),
    wrapping_loss_scaler=compat.wrapping_loss_scaler,
    cycle_loss_scaler=loss_scale.CycleLossScaleOptimizer,
    loss_scaler=keras.optimizers.LossScaleOptimizer,
    loss_scaler_names=("GradientAccumulateOptimizer", "Keras"),
    current_scale=lambda scaler: tf.convert_to_tensor(scaler.dynamic_scale),
    # Keras' own rule, also for an optimizer's static loss_scale_factor.
    scale_loss=lambda optimizer, loss: optimizer.scale_loss(loss),
    dynamic_scale=lambda scaler: True,
    cycle_scale_hooks=loss_scale.scale_hooks,
    apply_reduced=loss_scale.apply_reduced,
    scaler_replaces_loss_scale_factor=True,
    gradient_scale=lambda scaler: host_loss_scale.loss_scale(FLAVOUR, scaler),
    # --- batch norm
    layer_engine=lambda layer, settings: Accumulator(
        settings, track=functools.partial(track_variable, layer), name="accumulator"
    ),
    batch_norm_built=_no_change,
    unbiased_variance=lambda layer, rank: False,
    fixed_weight={"autocast": False},
    own_initializer=clone_initializer,
    training_flag=lambda training: training,
    counts_calls=True,
    # --- accumulate()
    custom_names=GLOBAL_CUSTOM_NAMES,
    compiled=lambda model: model.compiled,
    accumulated_config=lambda model, own: FLAVOUR.public(
        "GradientAccumulateModel"
    ).get_config(model),
    # --- replace_batchnorm_layers
    graph_models=(keras.Sequential, Functional),
    batch_norm_unsupported=("renorm",),
    batch_norm_config=lambda layer: {},
    # --- verify
    optimizers=(keras.optimizers.Optimizer,),
    batch_norms=(keras.layers.BatchNormalization,),
    copy_optimizer=lambda optimizer: keras.optimizers.deserialize(
        keras.optimizers.serialize(optimizer)
    ),
    sublayers=all_layers,
    draws_random=lambda layer: bool(getattr(layer, "_seed_generators", None)),
    variable_name=lambda variable: variable.path.split("/")[-1],
    model_optimization=lambda layer: None,  # TF-MOT is tf-keras only
    update_pruning_step=None,
    prunable_layers=None,
    # --- model host
    engine=Accumulator,
    model_state_key=None,  # the engine is a Keras saveable
    untracked=lambda model, fn: fn(),
    own_state=_no_change,
    disown_state=_no_change,
    keras_tensor=keras.KerasTensor,
    functional=compat.Functional,
    functional_arguments=compat.functional_init_arguments,
    network_config=_no_change,
    in_step=True,
    loss_terms=compat.flat_losses,
    term_outputs=lambda y_pred: y_pred,
    guards_empty_masks=True,
    # Keras divides each replica's loss by the replica count so that a sum
    # of replica gradients is a mean. The engine divides by the summed
    # micro-batch weights itself, so differentiate the per-replica loss as
    # it is.
    whole_loss=compat.unscale_loss_for_distribution,
    means_divided=False,
    replicas=lambda model: tf.distribute.get_strategy().num_replicas_in_sync,
    loss_tracker=compat.loss_tracker,
    builds_optimizer=True,
    state_scope=lambda model: contextlib.nullcontext(),
)
