"""How ``replace_batchnorm_layers`` converts a model, written once for Keras 3
and tf-keras: a copy of the model in which every BatchNormalization of the
Keras is an ``AccumBatchNormalization`` with the same configuration and
state. Each Keras' ``convert`` module describes its Keras in a :class:`Keras`
and keeps the public function and its docs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from gradient_accumulator._which_keras import other_keras
from gradient_accumulator.core.validation import check_accum_steps


@dataclasses.dataclass(frozen=True)
class Keras:
    """What converting a model needs of one Keras."""

    package: str  # its top-level package, in messages
    model: type  # its Model
    graph_models: tuple[type, ...]  # the models it can rebuild layer by layer
    batch_norm: type  # exactly this class is replaced
    accum_batch_norm: type  # by this one
    wrapper: type  # its GradientAccumulateModel
    # clone(model, clone_layer): a copy of a functional or Sequential model,
    # nested ones included, with clone_layer(layer) for every other layer.
    clone: Callable
    # The keyword arguments that rebuild a wrapper with its settings.
    settings: Callable[[object], dict]
    # Options of its BatchNormalization that AccumBatchNormalization lacks
    # (refused when set), and the config a new layer gets beyond the old's.
    unsupported: tuple[str, ...] = ("renorm",)
    extra_config: Callable[[object], dict] = lambda layer: {}


def replace(keras: Keras, model, accum_steps: int | None, position: str):
    """``replace_batchnorm_layers``: see the Keras 3 ``convert`` module."""
    if position != "replace":
        raise ValueError(
            f"`position` must be 'replace'. Received: position={position!r}."
        )
    if accum_steps is not None:
        check_accum_steps(accum_steps)
    if not isinstance(model, keras.model):
        raise TypeError(
            f"`model` must be a {keras.package}.Model (functional or "
            f"Sequential). Received: model={model!r} of type "
            f"{type(model).__name__}. " + other_keras(model, keras.package, "`model`")
        )
    if not isinstance(model, keras.graph_models):
        raise TypeError(
            "replace_batchnorm_layers can only rebuild functional or Sequential "
            f"models; {type(model).__name__!r} is subclassed. Use "
            "AccumBatchNormalization in its code instead."
        )

    pairs: list[tuple[object, object]] = []

    def clone_layer(layer):
        if type(layer) is keras.batch_norm:
            new = keras.accum_batch_norm.from_config(
                {**_batch_norm_config(keras, layer), "accum_steps": accum_steps}
            )
        else:
            new = layer.__class__.from_config(layer.get_config())
        pairs.append((layer, new))
        return new

    source = model
    if isinstance(model, keras.wrapper):
        # Clone the graph alone: Keras would call the model's class with
        # (inputs, outputs), which this constructor reads as accum_steps.
        source = keras.model(model.inputs, model.outputs, name=model.name)
    new_model = keras.clone(source, clone_layer)
    # After the whole clone: a nested Sequential without an Input builds its
    # layers only when the outer graph calls it.
    for old, new in pairs:
        if isinstance(new, keras.accum_batch_norm) and not isinstance(
            old, keras.accum_batch_norm
        ):
            for name in ("gamma", "beta", "moving_mean", "moving_variance"):
                value, target = getattr(old, name), getattr(new, name)
                if value is not None:
                    target.assign(value)
            new.accumulation_shift.assign(old.moving_mean)
        elif old.weights:
            new.set_weights(old.get_weights())

    if isinstance(model, keras.wrapper):
        functional = new_model
        new_model = keras.wrapper(
            **keras.settings(model),
            inputs=functional.inputs,
            outputs=functional.outputs,
            name=model.name,
        )
        compiled = model.get_compile_config()  # empty or None before compile
        if compiled:
            new_model.compile_from_config(compiled)
    return new_model


def _batch_norm_config(keras: Keras, layer) -> dict:
    config = layer.get_config()
    for key in keras.unsupported:
        value = config.get(key, getattr(layer, key, None))
        if value:
            raise ValueError(
                f"BatchNormalization {layer.name!r} uses {key}={value!r}, which "
                "AccumBatchNormalization does not support."
            )
    return {**config, **keras.extra_config(layer)}
