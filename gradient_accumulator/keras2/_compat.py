"""Every private tf-keras name the tf-keras hosts rely on, in one place.

tf-keras does not promise to keep these. Each has a test in
``tests/keras2/test_compat.py``, so a release that moves or changes one
fails there, by name.
"""

from __future__ import annotations

import functools
import sys
from typing import NamedTuple

import tensorflow as tf
import tf_keras

from gradient_accumulator import _requirements

with _requirements.private_names("tf-keras", f"tf-keras {tf_keras.__version__}"):
    from tf_keras.src.engine.functional import (
        Functional,
        get_network_config,
        has_functional_like_constructor,
        reconstruct_from_config,
    )
    from tf_keras.src.saving.object_registration import (
        _GLOBAL_CUSTOM_NAMES as GLOBAL_CUSTOM_NAMES,
    )

__all__ = [
    "GLOBAL_CUSTOM_NAMES",
    "Functional",
    "LossTerm",
    "call_losses",
    "config_as",
    "draws_random",
    "functional_config",
    "is_compiled",
    "loss_scale_variable",
    "loss_terms",
    "marks_wrapped_optimizer",
    "model_optimization",
    "prunable_layers",
    "pruning_step",
    "reconstruct_from_config",
    "track_state",
    "untrack_state",
    "update_pruning_step",
]


def call_losses(layer) -> list:
    """The losses ``layer`` itself added in its last call (``add_loss``,
    its activity regulariser), without its weights' penalties (tf-keras
    keeps those apart, as functions)."""
    return list(layer._eager_losses or layer._losses)


def is_compiled(model) -> bool:
    """Whether ``model.compile`` has run (tf-keras keeps no public flag)."""
    return model._is_compiled


def track_state(model, name: str, state) -> None:
    """Makes ``state`` a checkpoint dependency of ``model`` under ``name``
    without making it a layer attribute (its variables stay out of the
    model's weights)."""
    model._track_trackable(state, name=name, overwrite=True)


def untrack_state(model, name: str) -> None:
    """Removes the checkpoint dependency :func:`track_state` added."""
    model._delete_tracking(name)


def marks_wrapped_optimizer(name: str, value) -> bool:
    """Whether setting ``name`` to ``value`` is tf-keras' LossScaleOptimizer
    marking the optimizer it wraps (its constructor sets this flag)."""
    return name == "_is_wrapped_by_loss_scale_optimizer" and bool(value)


def draws_random(layer) -> bool:
    """Whether ``layer`` draws random numbers when called (tf-keras' random
    layers, ``Dropout``, noise and augmentation among them, hold a random
    generator)."""
    return getattr(layer, "_random_generator", None) is not None


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


def config_as(model, cls: type) -> dict:
    """The config ``cls.get_config`` gives ``model``, an instance of a class
    derived from ``cls`` with another constructor: tf-keras gives the
    network config only to a class with a functional model's constructor."""
    if cls.get_config is Functional.get_config and has_functional_like_constructor(cls):
        return functional_config(model)
    return cls.get_config(model)


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


# ------------------------------------------- TensorFlow Model Optimization
# TF-MOT (tf-keras only) is imported when first needed, never by the
# package's import: it sets TF_USE_LEGACY_KERAS when imported.
_TFMOT = "tensorflow_model_optimization"
_TFMOT_INSTALL = (
    "TensorFlow Model Optimization is not installed: `pip install "
    "tensorflow-model-optimization` (it needs tf-keras)."
)


def update_pruning_step():
    """A new ``tfmot.sparsity.keras.UpdatePruningStep`` (TF-MOT's public
    callback), importing TF-MOT; a clear ImportError without it."""
    try:
        from tensorflow_model_optimization.sparsity import keras as sparsity
    except ImportError as error:
        raise ImportError(_TFMOT_INSTALL) from error
    return sparsity.UpdatePruningStep()


def prunable_layers(callback) -> list:
    """The pruning wrappers an ``UpdatePruningStep`` collected from its model
    at ``on_train_begin``."""
    return list(callback.prunable_layers)


def pruning_step(layer):
    """A pruning wrapper's step variable (int64, -1 until training begins),
    which its training call increments and its schedule reads."""
    return layer.pruning_step


@functools.cache
def _tfmot_classes() -> dict[str, tuple[type, ...]]:
    from tensorflow_model_optimization.python.core.quantization.keras import (
        quantize_layer,
        quantize_wrapper,
    )
    from tensorflow_model_optimization.python.core.sparsity.keras import (
        pruning_wrapper,
    )

    return {
        "pruning": (pruning_wrapper.PruneLowMagnitude,),
        # QuantizeWrapperV2 derives from QuantizeWrapper.
        "quantization": (
            quantize_wrapper.QuantizeWrapper,
            quantize_layer.QuantizeLayer,
        ),
    }


def model_optimization(layer) -> tuple[str, object] | None:
    """``("pruning", its step variable)`` for TF-MOT's pruning wrapper,
    ``("quantization", None)`` for its quantization-aware training layers
    (the wrappers and the input's ``QuantizeLayer``), else None. Imports
    nothing: a TF-MOT layer exists only once TF-MOT is imported."""
    if _TFMOT not in sys.modules:
        return None
    for kind, classes in _tfmot_classes().items():
        if isinstance(layer, classes):
            return kind, (pruning_step(layer) if kind == "pruning" else None)
    return None
