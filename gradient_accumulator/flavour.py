"""The Keras 3 flavour: what the hosts need of Keras 3, from its public API
and the private names in ``_keras_compat``."""

from __future__ import annotations

import keras

from gradient_accumulator import _keras_compat, loss_scale
from gradient_accumulator._which_keras import KERAS3
from gradient_accumulator.hosts.flavour import Flavour
from gradient_accumulator.tracked_engine import Accumulator


def _optimizer_engine(wrapper, settings) -> Accumulator:
    # The wrapper tracks (and saves) the engine's variables as its own.
    return Accumulator(
        settings, track=_keras_compat.optimizer_variable_tracker(wrapper)
    )


FLAVOUR = Flavour(
    name=KERAS3,
    keras=keras,
    # --- optimizer host
    optimizer_kinds=(keras.optimizers.Optimizer,),
    optimizer_text="keras.optimizers.Optimizer",
    optimizer_base_arguments=(("learning_rate", 0.0),),
    optimizer_engine=_optimizer_engine,
    optimizer_keeps_strategy=False,
    optimizer_built=lambda optimizer: optimizer.built,
    build_optimizer=lambda optimizer, variables: optimizer.build(variables),
    own_optimizer_variables=_keras_compat.optimizer_own_variables,
    optimizer_state=lambda optimizer: optimizer.variables,
    serialize_optimizer=keras.saving.serialize_keras_object,
    deserialize_optimizer=lambda config, custom_objects: (
        keras.saving.deserialize_keras_object(config, custom_objects=custom_objects)
    ),
    optimizer_config_extras=(),
    wrapping_loss_scaler=_keras_compat.wrapping_loss_scaler,
    loss_scaling=loss_scale,
    scaler_replaces_loss_scale_factor=True,
    gradient_scale=loss_scale.loss_scale,
)
