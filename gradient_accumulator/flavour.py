"""The Keras 3 flavour: what the hosts need of Keras 3, from its public API
and the private names in ``_keras_compat``."""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from gradient_accumulator import _keras_compat as compat
from gradient_accumulator import loss_scale
from gradient_accumulator._which_keras import KERAS3
from gradient_accumulator.hosts.flavour import Flavour
from gradient_accumulator.tracked_engine import Accumulator


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


def _weights_under_mask(weights, mask):
    return compat.apply_mask(
        weights, mask, dtype="float32", reduction="mean_with_sample_weight"
    )


def _nothing(*_):
    return None


_MODEL_HOST = {
    "engine": Accumulator,
    "untracked": lambda model, fn: fn(),
    "own_state": _nothing,
    "disown_state": _nothing,
    "keras_tensor": keras.KerasTensor,
    "functional": compat.Functional,
    "functional_arguments": compat.functional_init_arguments,
    "custom_names": compat.GLOBAL_CUSTOM_NAMES,
    "network_config": _nothing,
    "model_from_config": _model_from_config,
    "in_step": True,
    "sublayers": lambda model: compat.all_layers(model)[1:],
    "forward": _forward,
    "compute_loss": _compute_loss,
    "loss_terms": compat.flat_losses,
    "term_outputs": lambda y_pred: y_pred,
    "merge_mask": _weights_under_mask,
    "guards_empty_masks": True,
    # Keras divides each replica's loss by the replica count so that a sum
    # of replica gradients is a mean. The engine divides by the summed
    # micro-batch weights itself, so differentiate the per-replica loss as
    # it is.
    "whole_loss": compat.unscale_loss_for_distribution,
    "means_divided": False,
    "replicas": lambda model: tf.distribute.get_strategy().num_replicas_in_sync,
    "loss_tracker": compat.loss_tracker,
    "builds_optimizer": True,
    "state_scope": lambda model: contextlib.nullcontext(),
    "scaler_of": loss_scale.scaler_of,
    "loss_scale": loss_scale.loss_scale,
    "scale_hooks": loss_scale.scale_hooks,
    "scale_loss": lambda optimizer, loss: optimizer.scale_loss(loss),
    "apply_gradients": loss_scale.apply_gradients,
}

FLAVOUR = Flavour(name=KERAS3, keras=keras, **_MODEL_HOST)
