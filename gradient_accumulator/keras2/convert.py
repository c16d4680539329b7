"""``replace_batchnorm_layers`` for tf-keras: a copy of a tf-keras model whose
BatchNormalization layers accumulate (``gradient_accumulator.hosts.replace_layers``
does it for both Kerases)."""

from __future__ import annotations

import tf_keras

from gradient_accumulator.hosts import replace_layers
from gradient_accumulator.keras2._compat import Functional
from gradient_accumulator.keras2.batch_norm import AccumBatchNormalization
from gradient_accumulator.keras2.model import GradientAccumulateModel


def _clone(model, clone_layer):
    """``tf_keras.models.clone_model`` into nested models too (it has no
    ``recursive``: it would rebuild a nested model from its config, with new
    weights and its BatchNormalization layers unchanged)."""

    def clone(layer):
        if isinstance(layer, Functional):  # Sequential models included
            return _clone(layer, clone_layer)
        return clone_layer(layer)

    return tf_keras.models.clone_model(model, clone_function=clone)


def _settings(model: GradientAccumulateModel) -> dict:
    settings = {**model._setup.saved(), "skip_update_fn": model._setup.skip_update_fn}
    settings.pop("micro_batch_size")  # not an argument of the tf-keras wrapper
    return {**settings, "accum_steps": model.accum_steps}


def _config(layer) -> dict:
    """What the new layer's config takes from ``layer`` beyond its config."""
    axis = layer.axis
    if not isinstance(axis, int):
        # tf-keras turns axis into a list of positive axes when it builds.
        if len(axis) != 1:
            raise ValueError(
                f"BatchNormalization {layer.name!r} normalises over several "
                f"axes ({list(axis)}); AccumBatchNormalization takes one."
            )
        (axis,) = axis
        if axis == layer.input_spec.ndim - 1:
            axis = -1  # a channels-last layer, as it was most likely given
    # A layer that tf-keras' fused kernel does not run (fused=False) updates
    # its moving variance with the biased variance: so will the new one.
    return {"axis": axis, "fused": layer.fused}


KERAS = replace_layers.Keras(
    package="tf_keras",
    model=tf_keras.Model,
    graph_models=(Functional,),  # Sequential models included
    batch_norm=tf_keras.layers.BatchNormalization,
    accum_batch_norm=AccumBatchNormalization,
    wrapper=GradientAccumulateModel,
    clone=_clone,
    settings=_settings,
    unsupported=("renorm", "virtual_batch_size", "adjustment", "synchronized"),
    extra_config=_config,
)


def replace_batchnorm_layers(
    model: tf_keras.Model, accum_steps: int | None = None, position: str = "replace"
) -> tf_keras.Model:
    """Returns a copy of the tf-keras ``model`` with every
    ``tf_keras.layers.BatchNormalization`` (in nested functional and
    ``Sequential`` models too) replaced by the tf-keras
    :class:`AccumBatchNormalization` with the same configuration, gamma,
    beta and moving statistics; every other layer is copied with its
    weights. In inference the copy predicts what ``model`` predicts;
    ``model`` is left untouched.

    Arguments, result and errors: as the Keras 3
    ``replace_batchnorm_layers``. BatchNormalization layers with
    ``renorm``, ``virtual_batch_size``, ``adjustment`` or ``synchronized``
    are refused (``ValueError``): AccumBatchNormalization has none of them.

    Example:

    >>> import tf_keras
    >>> from gradient_accumulator.keras2 import replace_batchnorm_layers
    >>> model = tf_keras.Sequential(
    ...     [tf_keras.Input((4,)), tf_keras.layers.BatchNormalization()]
    ... )
    >>> type(replace_batchnorm_layers(model).layers[0]).__name__
    'AccumBatchNormalization'
    """
    return replace_layers.replace(KERAS, model, accum_steps, position)
