"""The tf-keras flavour: what the hosts need of tf-keras, from its public
API and the private names in ``keras2/_compat``."""

from __future__ import annotations

import tf_keras

from gradient_accumulator._which_keras import TF_KERAS
from gradient_accumulator.core.engine import Engine
from gradient_accumulator.hosts.flavour import Flavour
from gradient_accumulator.keras2 import _compat, inner_optimizers, loss_scale


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


FLAVOUR = Flavour(
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
    build_optimizer=_build_optimizer,
    own_optimizer_variables=lambda wrapper: list(wrapper._accumulator.variables),
    optimizer_state=inner_optimizers.state,
    serialize_optimizer=tf_keras.optimizers.serialize,
    deserialize_optimizer=_deserialize_optimizer,
    optimizer_config_extras=("is_legacy_optimizer",),
    wrapping_loss_scaler=_compat.wrapping_loss_scaler,
    loss_scaling=loss_scale,
    scaler_replaces_loss_scale_factor=False,
    gradient_scale=lambda scaler: None,
)
