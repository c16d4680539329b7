"""Every private Keras / TensorFlow name this package relies on, in one place.

Keras and TensorFlow do not promise to keep these. Each has a test in
``tests/keras3/test_keras_compat.py``, so a release that moves or changes one fails
there, by name, instead of somewhere inside a train step. An import that
fails here names the installed Keras version and the tested range.
"""

from __future__ import annotations

import keras

from gradient_accumulator import _requirements
from gradient_accumulator._backend import KERAS_SPEC
from gradient_accumulator.core._tf_compat import (
    distributed_container,
    keras_mask,
    on_device_or_primary,
)

with _requirements.private_names(
    "Keras",
    f"keras {keras.__version__}",
    f"; supported: keras{KERAS_SPEC}, tested from its lower bound to the "
    "newest release CI saw",
):
    from keras.src.layers.normalization.batch_normalization import (
        _clone_initializer as clone_initializer,
    )
    from keras.src.losses.loss import apply_mask, unscale_loss_for_distribution
    from keras.src.models.functional import Functional, functional_from_config
    from keras.src.models.model import functional_init_arguments
    from keras.src.saving.keras_saveable import KerasSaveable
    from keras.src.saving.object_registration import GLOBAL_CUSTOM_NAMES

__all__ = [
    "GLOBAL_CUSTOM_NAMES",
    "Functional",
    "GraphRunHook",
    "KerasSaveable",
    "all_layers",
    "apply_mask",
    "batch_norm_moments",
    "batch_norm_reduction_axes",
    "call_has_training_arg",
    "call_losses",
    "clone_initializer",
    "compute_loss",
    "distributed_container",
    "flat_losses",
    "functional_from_config",
    "functional_init_arguments",
    "keras_mask",
    "loss_tracker",
    "on_device_or_primary",
    "optimizer_built_variables",
    "optimizer_own_variables",
    "optimizer_variable_tracker",
    "seed_generators",
    "set_all_reduce",
    "track_variable",
    "unscale_loss_for_distribution",
]


def track_variable(layer, variable) -> None:
    """Adds ``variable`` to ``layer``'s own variables, also after Keras
    locked the layer's tracker (it does once the layer is built)."""
    tracker = layer._tracker
    locked = tracker.locked
    tracker.unlock()
    layer._track_variable(variable)
    if locked:
        tracker.lock()


def seed_generators(layer) -> list:
    """The seed generators ``layer`` draws its random numbers from (Keras'
    ``Dropout``, noise and random augmentation layers hold one each)."""
    return list(getattr(layer, "_seed_generators", None) or [])


def call_losses(layer) -> list:
    """The losses ``layer`` itself added in its last call (``add_loss``,
    its activity regulariser), without its weights' penalties."""
    return list(layer._losses)


class GraphRunHook:
    """Mixin for a model class: calls ``self._before_graph_run()`` each time
    Keras runs the functional model's graph on new inputs, which
    ``keras.models.clone_model`` does (through ``Functional``'s private
    ``_run_through_graph``) right before it builds the clone."""

    def _before_graph_run(self) -> None:
        pass

    def _run_through_graph(self, *args, **kwargs):
        self._before_graph_run()
        return super()._run_through_graph(*args, **kwargs)


def compute_loss(model: keras.Model, **kwargs):
    """The loss Keras' train step differentiates: the model's
    ``compute_loss`` called with the arguments its signature takes."""
    return model._compute_loss(**kwargs)


def batch_norm_moments(layer, inputs, mask):
    """Keras' BatchNormalization moments of ``inputs`` (masked, and across
    replicas when the layer is ``synchronized``)."""
    return layer._moments(inputs, mask)


def batch_norm_reduction_axes(layer) -> list[int]:
    """The axes a built BatchNormalization layer reduces over."""
    return layer._reduction_axes


def optimizer_variable_tracker(optimizer):
    """The function through which a Keras optimizer tracks (and saves) a
    variable as its own state."""
    return optimizer._track_variable


def optimizer_own_variables(optimizer) -> list:
    """The variables a Keras optimizer tracks as its own state."""
    return optimizer._variables


def optimizer_built_variables(optimizer) -> list:
    """The trainable variables a Keras optimizer was built for."""
    return optimizer._trainable_variables


def loss_tracker(model: keras.Model):
    """The ``Mean`` metric behind the ``loss`` entry of ``fit``'s logs."""
    return model._loss_tracker


def call_has_training_arg(model: keras.Model) -> bool:
    """Whether ``model.call`` takes a ``training`` argument."""
    return model._call_has_training_arg


def flat_losses(model: keras.Model) -> list:
    """The compiled loss terms, each with ``.loss`` and ``.path`` (the
    output it applies to), or ``[]`` before compile or for a custom
    ``compute_loss``."""
    compiled = getattr(model, "_compile_loss", None)
    return list(getattr(compiled, "_flat_losses", None) or [])


def all_layers(layer) -> list:
    """``layer`` and every layer nested in it (nested models included)."""
    return list(layer._flatten_layers(include_self=True, recursive=True))


def set_all_reduce(optimizer, function) -> None:
    """Replaces (``function``) or restores (``None``) the per-instance hook
    through which Keras' TensorFlow optimizer sums gradients over replicas."""
    if function is None:
        del optimizer._all_reduce_sum_gradients
    else:
        optimizer._all_reduce_sum_gradients = function
