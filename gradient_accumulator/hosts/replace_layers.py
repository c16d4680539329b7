"""How ``replace_batchnorm_layers`` converts a model, written once for Keras 3
and tf-keras: a copy of the model in which every BatchNormalization of the
Keras is an ``AccumBatchNormalization`` with the same configuration and
state. Each Keras' ``convert`` module keeps the public function and its docs;
the host learns the Keras from its flavour."""

from __future__ import annotations

from gradient_accumulator._which_keras import other_keras
from gradient_accumulator.core.validation import check_accum_steps
from gradient_accumulator.hosts.batch_norm import AccumBatchNorm
from gradient_accumulator.hosts.flavour import Flavour
from gradient_accumulator.hosts.model import ModelHost


def replace(
    flavour: Flavour,
    accum_batch_norm: type,
    wrapper: type,
    model,
    accum_steps: int | None,
    position: str,
):
    """``replace_batchnorm_layers``: see the Keras 3 ``convert`` module
    (``accum_batch_norm``, ``wrapper``: the Keras' ``AccumBatchNormalization``
    and ``GradientAccumulateModel``)."""
    if position != "replace":
        raise ValueError(
            f"`position` must be 'replace'. Received: position={position!r}."
        )
    if accum_steps is not None:
        check_accum_steps(accum_steps)
    model_class = flavour.keras.Model
    if not isinstance(model, model_class):
        raise TypeError(
            f"`model` must be a {flavour.name}.Model (functional or "
            f"Sequential). Received: model={model!r} of type "
            f"{type(model).__name__}. " + other_keras(model, flavour.name, "`model`")
        )
    if not isinstance(model, flavour.graph_models):
        raise TypeError(
            "replace_batchnorm_layers can only rebuild functional or Sequential "
            f"models; {type(model).__name__!r} is subclassed. Use "
            "AccumBatchNormalization in its code instead."
        )

    pairs: list[tuple[object, object]] = []

    def clone_layer(layer):
        if type(layer) is flavour.keras.layers.BatchNormalization:
            new = accum_batch_norm.from_config(
                {**_batch_norm_config(flavour, layer), "accum_steps": accum_steps}
            )
        else:
            new = layer.__class__.from_config(layer.get_config())
        pairs.append((layer, new))
        return new

    source = model
    if isinstance(model, ModelHost):
        # Clone the graph alone: Keras would call the model's class with
        # (inputs, outputs), which this constructor reads as accum_steps.
        source = model_class(model.inputs, model.outputs, name=model.name)
    new_model = flavour.clone_graph(source, clone_layer)
    # After the whole clone: a nested Sequential without an Input builds its
    # layers only when the outer graph calls it.
    for old, new in pairs:
        if isinstance(new, AccumBatchNorm) and not isinstance(old, AccumBatchNorm):
            for name in ("gamma", "beta", "moving_mean", "moving_variance"):
                value, target = getattr(old, name), getattr(new, name)
                if value is not None:
                    target.assign(value)
            new.accumulation_shift.assign(old.moving_mean)
        elif old.weights:
            new.set_weights(old.get_weights())

    if isinstance(model, ModelHost):
        functional = new_model
        # Its settings, and the function a config leaves out.
        settings = {
            **model._settings(),
            "skip_update_fn": model._accumulation_settings.skip_update_fn,
        }
        new_model = wrapper(
            **settings,
            inputs=functional.inputs,
            outputs=functional.outputs,
            name=model.name,
        )
        compiled = model.get_compile_config()  # empty or None before compile
        if compiled:
            new_model.compile_from_config(compiled)
    return new_model


def _batch_norm_config(flavour: Flavour, layer) -> dict:
    config = layer.get_config()
    for key in flavour.batch_norm_unsupported:
        value = config.get(key, getattr(layer, key, None))
        if value:
            raise ValueError(
                f"BatchNormalization {layer.name!r} uses {key}={value!r}, which "
                "AccumBatchNormalization does not support."
            )
    return {**config, **flavour.batch_norm_config(layer)}
