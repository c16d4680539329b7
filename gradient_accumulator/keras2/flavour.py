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
from gradient_accumulator.keras2 import _compat as compat
from gradient_accumulator.keras2 import loss_scale
from gradient_accumulator.keras2.inner_optimizers import apply_reduced


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
        inputs, outputs, _ = compat.reconstruct_from_config(config, custom_objects)
        return cls(inputs=inputs, outputs=outputs, name=config.get("name"), **settings)
    return cls(**config, **settings)


def _scale_loss(optimizer, loss):
    scaler = loss_scale.scaler_of(optimizer)
    return loss if scaler is None else scaler.get_scaled_loss(loss)


def _loss_scale(optimizer):
    scaler = loss_scale.scaler_of(optimizer)
    return None if scaler is None else scaler.loss_scale


_MODEL_HOST = {
    "engine": Engine,
    # The engine is not a layer attribute (its variables would join the
    # model's weights) but a checkpoint dependency of its own.
    "untracked": _untracked,
    "own_state": compat.track_state,
    "disown_state": compat.untrack_state,
    "keras_tensor": tf_keras.__internal__.KerasTensor,
    "functional": compat.Functional,
    "functional_arguments": _functional_arguments,
    "custom_names": compat.GLOBAL_CUSTOM_NAMES,
    "network_config": compat.functional_config,
    "model_from_config": _rebuild,
    "in_step": False,
    "sublayers": lambda model: model.submodules,
    "forward": lambda model, x: model(x, training=True),
    "compute_loss": lambda model, *args: model.compute_loss(*args),
    "loss_terms": compat.loss_terms,
    "term_outputs": tf.nest.flatten,
    "merge_mask": None,
    "guards_empty_masks": False,
    # tf-keras divides a mean-reduced loss (and the regularisation losses)
    # by the replica count and lets the optimizer sum the replicas; a
    # "sum"-reduced term it does not divide (see core/loss_plan.py).
    "whole_loss": lambda loss: loss,
    "means_divided": True,
    "replicas": lambda model: model.distribute_strategy.num_replicas_in_sync,
    "loss_tracker": lambda model: None,  # compute_loss updates it
    "builds_optimizer": False,
    "state_scope": lambda model: model.distribute_strategy.scope(),
    "scaler_of": loss_scale.scaler_of,
    "loss_scale": _loss_scale,
    "scale_hooks": loss_scale.scale_hooks,
    "scale_loss": _scale_loss,
    "apply_gradients": apply_reduced,
}

FLAVOUR = Flavour(name=TF_KERAS, keras=tf_keras, **_MODEL_HOST)
