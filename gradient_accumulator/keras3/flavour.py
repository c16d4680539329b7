"""The Keras 3 flavour: the hooks the hosts call (``hosts.flavour.Flavour``),
from Keras 3's public API and the private names in ``keras3/_compat.py``."""

from __future__ import annotations

import contextlib
import functools

import keras
import tensorflow as tf
from keras import ops

from gradient_accumulator._which_keras import KERAS3, TF_KERAS, keras_of
from gradient_accumulator.core.validation import check_bool
from gradient_accumulator.hosts import loss_scale as host_loss_scale
from gradient_accumulator.hosts.flavour import Flavour
from gradient_accumulator.hosts.model import ModelHost
from gradient_accumulator.keras3 import _compat as compat
from gradient_accumulator.keras3 import loss_scale
from gradient_accumulator.keras3._compat import (
    GLOBAL_CUSTOM_NAMES,
    Functional,
    all_layers,
    batch_norm_moments,
    batch_norm_reduction_axes,
    clone_initializer,
    track_variable,
)
from gradient_accumulator.keras3.tracked_engine import Accumulator


class KerasFlavour(Flavour):
    """Keras 3's hooks (see ``hosts.flavour.Flavour`` for what each does)."""

    name = KERAS3
    keras = keras

    # --- values
    fixed_weight = {"autocast": False}
    counts_calls = True
    custom_names = GLOBAL_CUSTOM_NAMES
    graph_models = (keras.Sequential, Functional)
    batch_norm_unsupported = ("renorm",)
    optimizers = (keras.optimizers.Optimizer,)
    batch_norms = (keras.layers.BatchNormalization,)
    update_pruning_step = None  # TF-MOT is tf-keras only
    prunable_layers = None
    optimizer_kinds = (keras.optimizers.Optimizer,)
    optimizer_text = "keras.optimizers.Optimizer"
    optimizer_base_arguments = (("learning_rate", 0.0),)
    optimizer_keeps_strategy = False
    optimizer_config_extras = ()
    loss_scaler = keras.optimizers.LossScaleOptimizer
    inner_scaler_hint = (
        ", and pass compile(..., auto_scale_loss=False) so that compile adds "
        "no LossScaleOptimizer around it"
    )
    engine = Accumulator
    model_state_key = None  # the engine is a Keras saveable
    keras_tensor = keras.KerasTensor
    functional = Functional
    in_step = True
    guards_empty_masks = True
    means_divided = False
    builds_optimizer = True

    # --- batch norm
    def batch_norm_options(self, layer, axis, synchronized, kwargs):
        check_bool("synchronized", synchronized)
        return axis, {"synchronized": synchronized}

    def layer_engine(self, layer, settings):
        track = functools.partial(track_variable, layer)
        return Accumulator(settings, track=track, name="accumulator")

    def batch_norm_built(self, layer, rank):
        return None

    def unbiased_variance(self, layer, rank):
        return False

    def own_initializer(self, initializer):
        return clone_initializer(initializer)

    def training_flag(self, training):
        return training

    def batch_norm_moments(self, layer, inputs, mask, axes):
        moments = batch_norm_moments(layer, inputs, mask)
        if layer.synchronized and mask is None:
            # The forward pass used every replica's moments; the pool needs
            # this replica's own (the engine sums replicas at the cycle end).
            own = ops.moments(inputs, axes=batch_norm_reduction_axes(layer))
            return moments, own
        return moments, moments

    def moving_average(self, variable, value, momentum):
        # Keras' update, verbatim (not assign_moving_average's form).
        moving = ops.cast(variable, variable.dtype)
        variable.assign(moving * momentum + value * (1.0 - momentum))

    # --- accumulate(), replace_batchnorm_layers, verify
    def compiled(self, model):
        return model.compiled

    def accumulated_config(self, model, own):
        # The model wrapper's config: its class's, with the settings.
        return ModelHost.get_config(model)

    def clone_graph(self, model, clone_layer):
        return keras.models.clone_model(
            model, clone_function=clone_layer, recursive=True
        )

    def batch_norm_config(self, layer):
        return {}

    def copy_optimizer(self, optimizer):
        return keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))

    def sublayers(self, layer):
        return all_layers(layer)

    def draws_random(self, layer):
        return bool(compat.seed_generators(layer))

    def random_states(self, model):
        layers = all_layers(model)
        return [g.state for layer in layers for g in compat.seed_generators(layer)]

    def call_losses(self, model):
        return [
            loss for layer in all_layers(model) for loss in compat.call_losses(layer)
        ]

    def variable_name(self, variable):
        return variable.path.split("/")[-1]

    def model_optimization(self, layer):
        return None  # TF-MOT is tf-keras only

    # --- optimizer host
    def optimizer_engine(self, wrapper, settings):
        # The wrapper tracks (and saves) the engine's variables as its own.
        return Accumulator(settings, track=compat.optimizer_variable_tracker(wrapper))

    def optimizer_built(self, optimizer):
        return optimizer.built

    def optimizer_build_scope(self, optimizer):
        return keras.name_scope(optimizer.name, caller=optimizer)

    def build_optimizer(self, optimizer, variables):
        optimizer.build(variables)

    def own_optimizer_variables(self, wrapper):
        return compat.optimizer_own_variables(wrapper)

    def optimizer_state(self, optimizer):
        return optimizer.variables

    def serialize_optimizer(self, optimizer):
        return keras.saving.serialize_keras_object(optimizer)

    def deserialize_optimizer(self, config, custom_objects):
        return keras.saving.deserialize_keras_object(
            config, custom_objects=custom_objects
        )

    def marks_wrapped_optimizer(self, name, value):
        # Keras' LossScaleOptimizer turns off the static loss scale of the
        # optimizer it wraps, the only one who sets it once it is made.
        return name == "loss_scale_factor" and value is None

    def current_scale(self, scaler):
        return tf.convert_to_tensor(scaler.dynamic_scale)

    def scale_loss(self, optimizer, loss):
        # Keras' own rule, also for an optimizer's static loss_scale_factor.
        return optimizer.scale_loss(loss)

    def dynamic_scale(self, scaler):
        return True

    def cycle_scale_hooks(self, scaler):
        return loss_scale.scale_hooks(scaler)

    def apply_reduced(self, optimizer, grads, variables):
        loss_scale.apply_reduced(optimizer, grads, variables)

    def gradient_scale(self, scaler):
        return host_loss_scale.loss_scale(self, scaler)

    # --- model host
    def untracked(self, model, fn):
        return fn()

    def own_state(self, model, name, engine):
        return None  # Keras tracks the engine, a model attribute

    def disown_state(self, model, name):
        return None

    def functional_arguments(self, args, kwargs):
        return compat.functional_init_arguments(args, kwargs)

    def network_config(self, model):
        return None

    def model_from_config(self, cls, config, custom_objects, from_config):
        # A functional model's config holds its network.
        if all(k in config for k in ("layers", "input_layers", "name")):
            return compat.functional_from_config(
                cls, config, custom_objects=custom_objects
            )
        return from_config(config, custom_objects=custom_objects)

    def forward(self, model, x):
        if compat.call_has_training_arg(model):
            return model(x, training=True)
        return model(x)

    def compute_loss(self, model, x, y, y_pred, sample_weight):
        return compat.compute_loss(
            model, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )

    def loss_terms(self, model):
        return compat.flat_losses(model)

    def term_outputs(self, y_pred):
        return y_pred

    # A value (None in tf-keras, which has no such reduction): a function.
    @staticmethod
    def merge_mask(weights, mask):
        return compat.apply_mask(
            weights, mask, dtype="float32", reduction="mean_with_sample_weight"
        )

    def whole_loss(self, loss):
        # Keras divides each replica's loss by the replica count so that a
        # sum of replica gradients is a mean. The engine divides by the
        # summed micro-batch weights itself, so differentiate the
        # per-replica loss as it is.
        return compat.unscale_loss_for_distribution(loss)

    def replicas(self, model):
        return tf.distribute.get_strategy().num_replicas_in_sync

    def loss_tracker(self, model):
        return compat.loss_tracker(model)

    def state_scope(self, model):
        return contextlib.nullcontext()

    # --- this Keras' public classes (their modules import this one)
    def other_optimizer_wrapper(self, optimizer):
        if keras_of(optimizer) != TF_KERAS:
            return None
        # Imports tf-keras, which only a tf-keras optimizer here implies.
        from gradient_accumulator.keras2.optimizer import GradientAccumulateOptimizer

        return GradientAccumulateOptimizer


FLAVOUR = KerasFlavour()
