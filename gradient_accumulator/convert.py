"""Converting a trained model for accumulation."""

from __future__ import annotations

import keras

from gradient_accumulator._keras_compat import Functional
from gradient_accumulator.batch_norm import AccumBatchNormalization
from gradient_accumulator.model import GradientAccumulateModel
from gradient_accumulator.validation import check_accum_steps


def replace_batchnorm_layers(
    model: keras.Model, accum_steps: int | None = None, position: str = "replace"
) -> keras.Model:
    """Returns a copy of ``model`` with every ``BatchNormalization`` accumulating.

    Every ``keras.layers.BatchNormalization`` (in nested functional and
    ``Sequential`` models too) becomes an :class:`AccumBatchNormalization`
    with the same configuration, gamma, beta, moving mean and moving
    variance; every other layer is copied with its weights. In inference the
    returned model predicts exactly what ``model`` predicts. ``model`` itself
    is left untouched (no layer or variable is shared).

    Args:
        model: a functional or ``Sequential`` ``keras.Model`` (a
            :class:`GradientAccumulateModel` stays one, with its settings).
            Subclassed models cannot be rebuilt layer by layer: use
            :class:`AccumBatchNormalization` in their code instead.
        accum_steps: given to every new layer; ``None`` (the default) takes it
            from the :class:`GradientAccumulateModel` the layers end up in.
        position: only ``"replace"``, accepted for 0.5.x compatibility.

    Returns:
        The converted model, compiled like ``model`` if ``model`` was.
        Subclasses of ``BatchNormalization`` are copied unchanged.
    """
    if position != "replace":
        raise ValueError(
            f"`position` must be 'replace'. Received: position={position!r}."
        )
    if accum_steps is not None:
        check_accum_steps(accum_steps)
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a keras.Model (functional or Sequential). "
            f"Received: model={model!r} of type {type(model).__name__}."
        )
    if not isinstance(model, keras.Sequential) and not _is_functional(model):
        raise TypeError(
            "replace_batchnorm_layers can only rebuild functional or Sequential "
            f"models; {type(model).__name__!r} is subclassed. Use "
            "AccumBatchNormalization in its code instead."
        )

    pairs: list[tuple[keras.layers.Layer, keras.layers.Layer]] = []

    def clone(layer):
        config = layer.get_config()
        if type(layer) is keras.layers.BatchNormalization:
            if config.get("renorm"):
                raise ValueError(
                    f"BatchNormalization {layer.name!r} uses renorm=True, which "
                    "AccumBatchNormalization does not support."
                )
            new = AccumBatchNormalization.from_config(
                {**config, "accum_steps": accum_steps}
            )
        else:
            new = layer.__class__.from_config(config)
        pairs.append((layer, new))
        return new

    source = model
    if isinstance(model, GradientAccumulateModel):
        # Clone the graph alone: Keras would call the model's class with
        # (inputs, outputs), which this constructor reads as accum_steps.
        source = keras.Model(model.inputs, model.outputs, name=model.name)
    new_model = keras.models.clone_model(source, clone_function=clone, recursive=True)
    for old, new in pairs:
        if isinstance(new, AccumBatchNormalization) and not isinstance(
            old, AccumBatchNormalization
        ):
            for name in ("gamma", "beta", "moving_mean", "moving_variance"):
                source, target = getattr(old, name), getattr(new, name)
                if source is not None:
                    target.assign(source)
            new.accumulation_shift.assign(old.moving_mean)
        elif old.weights:
            new.set_weights(old.get_weights())

    if isinstance(model, GradientAccumulateModel):
        functional = new_model
        new_model = GradientAccumulateModel(
            **model._settings(),
            skip_update_fn=model._accumulator.skip_update_fn,
            inputs=functional.inputs,
            outputs=functional.outputs,
            name=model.name,
        )
        if model.compiled:
            new_model.compile_from_config(model.get_compile_config())
    return new_model


def _is_functional(model) -> bool:
    return isinstance(model, Functional)
