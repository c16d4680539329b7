"""Every private tf-keras name the tf-keras hosts rely on, in one place.

tf-keras does not promise to keep these. Each has a test in
``tests/keras2/test_compat.py``, so a release that moves or changes one
fails there, by name.
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf
import tf_keras

try:
    from tf_keras.src.engine.functional import (
        Functional,
        get_network_config,
        reconstruct_from_config,
    )
    from tf_keras.src.saving.object_registration import (
        _GLOBAL_CUSTOM_NAMES as GLOBAL_CUSTOM_NAMES,
    )
except ImportError as error:  # pragma: no cover - depends on the release
    raise ImportError(
        f"gradient_accumulator needs private tf-keras names that tf-keras "
        f"{tf_keras.__version__} does not have ({error})."
    ) from error

__all__ = [
    "GLOBAL_CUSTOM_NAMES",
    "LossTerm",
    "functional_config",
    "loss_scale_variable",
    "loss_terms",
    "reconstruct_from_config",
]


def loss_scale_variable(scaler):
    """The variable holding a dynamic ``LossScaleOptimizer``'s scale (its
    ``loss_scale`` property gives only a tensor)."""
    return scaler._loss_scale.current_loss_scale


def functional_config(model) -> dict | None:
    """A functional model's network config (its layers and their links),
    as tf-keras saves a ``Functional``; None for a subclassed model."""
    if not (isinstance(model, Functional) and model._is_graph_network):
        return None
    return get_network_config(
        model, config={"name": model.name, "trainable": model.trainable}
    )


class LossTerm(NamedTuple):
    """One compiled loss term: its loss object (with ``reduction``) and the
    index of the output it applies to among the flattened outputs (a
    ``path`` as ``weighting`` reads it)."""

    loss: object
    path: tuple[int, ...]


def loss_terms(model) -> list[LossTerm]:
    """The compiled loss terms of ``model``, once its compiled loss has run
    (it aligns its losses with the flattened outputs then); ``[]`` before
    compile or without a compiled loss."""
    container = getattr(model, "compiled_loss", None)
    losses = getattr(container, "_losses", None)
    if not losses:
        return []
    return [
        LossTerm(loss, (i,))
        for i, loss in enumerate(tf.nest.flatten(losses))
        if loss is not None
    ]
