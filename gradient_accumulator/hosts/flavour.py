"""What one Keras provides to the hosts: the flavour record.

The hosts in this folder are written once and import no Keras; each public
class tells them its Keras by a :class:`Flavour` (``_flavour``), and each
Keras has one module that builds its record from its own classes and its
private names (``gradient_accumulator/flavour.py`` for Keras 3,
``gradient_accumulator/keras2/flavour.py`` for tf-keras). A third Keras is
a third such module and the thin public classes over it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

from gradient_accumulator._which_keras import KERAS3, TF_KERAS, keras_of

# Where each Keras' flavour record and public classes live.
_FLAVOUR_MODULES = {
    KERAS3: "gradient_accumulator.flavour",
    TF_KERAS: "gradient_accumulator.keras2.flavour",
}
_PUBLIC_PACKAGES = {
    KERAS3: "gradient_accumulator",
    TF_KERAS: "gradient_accumulator.keras2",
}
# The public module (the same file name in each Keras' package) of each
# public class the hosts refer to.
_PUBLIC_MODULES = {
    "GradientAccumulateModel": "model",
    "GradientAccumulateOptimizer": "optimizer",
    "AccumBatchNormalization": "batch_norm",
}


@dataclasses.dataclass(frozen=True)
class Flavour:
    """What the hosts need of one Keras."""

    name: str  # its top-level package (``keras``, ``tf_keras``), in messages
    keras: ModuleType  # the Keras module: Model, layers, callbacks, saving, ...

    # --- batch norm (hosts/batch_norm.py)
    # (layer, axis, synchronized, kwargs) -> (axis, the base class's keywords
    # beyond the shared ones); refuses or takes out of kwargs what it lacks.
    batch_norm_options: Callable[..., tuple[Any, dict]]
    # (layer, accum_steps) -> an engine whose variables the layer tracks and
    # saves as its own weights.
    layer_engine: Callable[[Any, int], Any]
    # (layer, input rank): what a build adds to Keras' (tf-keras: any rank).
    batch_norm_built: Callable[[Any, int], None]
    # (layer, input rank) -> whether the moving variance takes the unbiased
    # variance (tf-keras' fused kernel does).
    unbiased_variance: Callable[[Any, int], bool]
    fixed_weight: dict  # add_weight keywords: no autocast under mixed precision
    own_initializer: Callable  # an initializer's copy for one more weight
    training_flag: Callable  # a call's `training` as a Python bool or None
    # (layer, x, mask, axes) -> (mean, variance) to normalise with, and this
    # replica's own (mean, variance).
    batch_norm_moments: Callable[..., tuple[tuple, tuple]]
    # (variable, value, momentum): its BatchNormalization's update, verbatim.
    moving_average: Callable[[Any, Any, float], None]
    # The engine's divisor of the pooled sums: the cycle's calls (True), or 1
    # a cycle (the unbiased variance needs the big batch's size).
    counts_calls: bool

    # --- accumulate() (hosts/in_place.py)
    custom_names: dict  # class -> the name saved files give it
    compiled: Callable[[Any], bool]
    # (model, its own class) -> the config a model made accumulating saves:
    # its own class's and the settings.
    accumulated_config: Callable[[Any, type], dict]

    # --- replace_batchnorm_layers (hosts/replace_layers.py)
    graph_models: tuple[type, ...]  # the models it can rebuild layer by layer
    # (model, clone_layer) -> a copy of a functional or Sequential model,
    # nested ones included, with clone_layer(layer) for every other layer.
    clone_graph: Callable
    # model wrapper -> the keyword arguments that rebuild it with its settings
    wrapper_settings: Callable[[Any], dict]
    # Options of its BatchNormalization that AccumBatchNormalization lacks
    # (refused when set), and the config a new layer gets beyond the old's.
    batch_norm_unsupported: tuple[str, ...]
    batch_norm_config: Callable[[Any], dict]

    # --- verify (hosts/equivalence.py)
    optimizers: tuple[type, ...]  # its optimizer classes
    batch_norms: tuple[type, ...]  # its BatchNormalization classes
    copy_optimizer: Callable[[Any], Any]  # a new optimizer from one's config
    sublayers: Callable[[Any], list]  # a layer and every layer nested in it
    draws_random: Callable[[Any], bool]  # whether a layer draws random numbers
    variable_name: Callable[[Any], str]  # a variable's name in its layer

    # --- optimizer host (hosts/optimizer.py)
    # What counts as an optimizer to wrap, and its name in messages.
    optimizer_kinds: tuple
    optimizer_text: str
    # The wrapper's keyword arguments to its base class' constructor.
    optimizer_base_arguments: tuple
    # (wrapper, Settings) -> the wrapper's unbuilt engine.
    optimizer_engine: Callable
    # Whether the wrapper makes its engine's variables in the strategy it
    # was made under (not needed where the Keras' variables find it).
    optimizer_keeps_strategy: bool
    optimizer_built: Callable  # wrapper -> has it been built
    build_optimizer: Callable  # (optimizer, variables) -> None
    own_optimizer_variables: Callable  # wrapper -> its state
    optimizer_state: Callable  # optimizer -> its variables
    serialize_optimizer: Callable
    deserialize_optimizer: Callable  # (config, custom_objects)
    # Keys the Keras adds to the wrapper's config, dropped on load.
    optimizer_config_extras: tuple
    # The loss scaler around the wrapper, when called from its method.
    wrapping_loss_scaler: Callable
    # The Keras' loss-scale module: its adopt, scale_hooks and
    # apply_gradients (which applies replica-summed gradients).
    loss_scaling: ModuleType
    # Whether an adopted scaler's dynamic scale replaces the wrapped
    # optimizer's static ``loss_scale_factor``.
    scaler_replaces_loss_scale_factor: bool
    # scaler or None -> the scale the gradients given the wrapper carry.
    gradient_scale: Callable

    def public(self, name: str) -> type:
        """This Keras' public class ``name`` (``GradientAccumulateModel``, ...),
        imported when first asked for: the public modules import the hosts."""
        module = f"{_PUBLIC_PACKAGES[self.name]}.{_PUBLIC_MODULES[name]}"
        return getattr(importlib.import_module(module), name)


def flavour_of(value) -> Flavour | None:
    """The flavour of the Keras ``value`` (an instance) belongs to, or None."""
    keras = keras_of(value)
    if keras is None:
        return None
    return importlib.import_module(_FLAVOUR_MODULES[keras]).FLAVOUR
