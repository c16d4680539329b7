"""Converting a trained model for accumulation."""

from __future__ import annotations

import keras

from gradient_accumulator.flavour import FLAVOUR
from gradient_accumulator.hosts import replace_layers


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
    return replace_layers.replace(FLAVOUR, model, accum_steps, position)
