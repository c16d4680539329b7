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

from gradient_accumulator._which_keras import KERAS3, TF_KERAS, keras_of, keras_of_class

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
    # (layer, Settings) -> an engine whose variables the layer tracks and
    # saves as its own weights.
    layer_engine: Callable[[Any, Any], Any]
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

    # --- TensorFlow Model Optimization (hosts/pruning.py, verify; tf-keras)
    # layer -> ("pruning", its step variable) for TF-MOT's pruning wrapper,
    # ("quantization", None) for its quantization-aware layers, else None.
    model_optimization: Callable[[Any], tuple[str, Any] | None]
    # () -> a new UpdatePruningStep; (that callback) -> the pruning wrappers
    # it collected. None where TF-MOT cannot be (Keras 3).
    update_pruning_step: Callable[[], Any] | None
    prunable_layers: Callable[[Any], list] | None

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
    # wrapper -> the context its first apply builds it in.
    optimizer_build_scope: Callable
    build_optimizer: Callable  # (optimizer, variables) -> None
    own_optimizer_variables: Callable  # wrapper -> its state
    optimizer_state: Callable  # optimizer -> its variables
    serialize_optimizer: Callable
    deserialize_optimizer: Callable  # (config, custom_objects)
    # Keys the Keras adds to the wrapper's config, dropped on load.
    optimizer_config_extras: tuple
    # The loss scaler around the wrapper, when called from its method.
    wrapping_loss_scaler: Callable
    # Loss scaling (hosts/loss_scale.py): the Keras' LossScaleOptimizer; the
    # class (derived from the one it takes over) that a scaler wrapping an
    # accumulating optimizer becomes, and the wrapper's and the Keras' names
    # in adopt's message.
    loss_scaler: type
    cycle_loss_scaler: type
    loss_scaler_names: tuple[str, str]
    current_scale: Callable  # scaler -> its loss scale, a tensor
    scale_loss: Callable  # (optimizer, loss) -> the loss as it scales it
    dynamic_scale: Callable  # scaler -> whether its scale changes
    # dynamic scaler -> the engine's (on_apply, on_skip), which keep its
    # scale per cycle.
    cycle_scale_hooks: Callable
    # (optimizer, grads, variables): applies unscaled gradients already
    # summed over replicas (replica context); never given a scaler.
    apply_reduced: Callable
    # Whether an adopted scaler's dynamic scale replaces the wrapped
    # optimizer's static ``loss_scale_factor``.
    scaler_replaces_loss_scale_factor: bool
    # scaler or None -> the scale the gradients given the wrapper carry.
    gradient_scale: Callable

    # --- model host (hosts/model.py, hosts/micro_batch.py, hosts/in_step.py)
    # Construction and saving.
    engine: type  # the engine class a model holds its state in
    # The prefix of the engine's state's keys in the model's own entry of
    # ``.keras`` files, or None where the engine saves itself (Keras 3).
    model_state_key: str | None
    # (model, fn): fn(), without tracking the attributes it sets as the
    # model's (tf-keras would make the engine's variables model weights).
    untracked: Callable
    # (model, name, engine) / (model, name): makes the engine a checkpoint
    # dependency of the model, or no longer (no-ops where Keras tracks it).
    own_state: Callable
    disown_state: Callable
    keras_tensor: type  # symbolic inputs: (inputs, outputs) given
    functional: type  # Keras' Functional
    # (args, kwargs) -> whether Keras builds a functional model of them.
    functional_arguments: Callable
    # (model) -> the network config of a functional model, or None to take
    # Keras' get_config.
    network_config: Callable
    # (cls, config, custom_objects, from_config): a model from its config
    # (from_config: Keras' own, for a config of no network).
    model_from_config: Callable
    in_step: bool  # has in-step micro-batching (micro_batch_size)
    forward: Callable  # (model, x) -> y_pred, in training
    # (model, x, y, y_pred, sample_weight) -> the loss Keras differentiates.
    compute_loss: Callable
    # (model) -> the compiled loss terms (``.loss``, ``.path`` into
    # term_outputs(y_pred)), [] before compile or for a custom loss.
    loss_terms: Callable
    term_outputs: Callable  # (y_pred) -> what paths index
    # (weights, mask) -> the sample weights as "mean_with_sample_weight"
    # masks them; None: no such reduction (no sample weights asked).
    merge_mask: Callable
    # Keras' masked mean guards a mask of no entry (0 / 0) itself.
    guards_empty_masks: bool
    # The replica convention (see core/loss_plan.py): (loss) -> the loss
    # Keras divided by the replica count made whole again, and whether
    # Keras divides only mean terms (and the penalty) instead.
    whole_loss: Callable
    means_divided: bool
    replicas: Callable  # (model) -> replicas in sync
    loss_tracker: Callable  # (model) -> the logged loss's Mean, or None
    # Keras builds the optimizer only at its first apply, after the step
    # reads the loss scale: the host builds it first.
    builds_optimizer: bool
    # (model) -> a context in which the step builds the engine's variables.
    state_scope: Callable

    @classmethod
    def from_namespace(cls, namespace: dict, **given: Any) -> Flavour:
        """The record of a flavour module: each field not ``given`` is the
        module's private function or value named for it (``_batch_norm_moments``
        for ``batch_norm_moments``), as a Keras 3 backend is found by its
        functions' names."""
        values = dict(given)
        missing, twice = [], []
        for field in dataclasses.fields(cls):
            own = namespace.get(f"_{field.name}")
            if field.name in given:
                if own is not None:
                    twice.append(field.name)
            elif own is None:
                missing.append(field.name)
            else:
                values[field.name] = own
        if missing or twice:
            raise TypeError(
                f"Flavour {given.get('name')!r}: each field needs exactly one "
                f"value. Missing: {missing}; given twice: {twice}."
            )
        return cls(**values)

    def public(self, name: str) -> type:
        """This Keras' public class ``name`` (``GradientAccumulateModel``, ...),
        imported when first asked for: the public modules import the hosts."""
        module = f"{_PUBLIC_PACKAGES[self.name]}.{_PUBLIC_MODULES[name]}"
        return getattr(importlib.import_module(module), name)


def flavour_of(value) -> Flavour | None:
    """The flavour of the Keras ``value`` (an instance) belongs to, or None."""
    return _flavour(keras_of(value))


def _flavour(keras: str | None) -> Flavour | None:
    if keras is None:
        return None
    return importlib.import_module(_FLAVOUR_MODULES[keras]).FLAVOUR


def _class_flavour(cls: type) -> Flavour | None:
    """The flavour of the Keras ``cls`` derives from; for a class of no
    Keras base (``Accumulating``), of the public package it is defined in."""
    keras = keras_of_class(cls)
    if keras is None:
        package = cls.__module__.rpartition(".")[0]
        keras = next((k for k, p in _PUBLIC_PACKAGES.items() if p == package), None)
    return _flavour(keras)


class Flavoured:
    """Base of the hosts: gives the public class of each Keras (the first
    class derived from a host) ``_flavour``, the flavour of its Keras, and
    registers it under ``gradient_accumulator>`` its name when the host is
    ``_serializable``, as
    ``keras.saving.register_keras_serializable(package="gradient_accumulator")``
    would. Classes derived from a public class (a user's subclass, a
    functional variant, an accumulating class) inherit its flavour and are
    not registered."""

    _flavour: Flavour | None = None
    _serializable = False  # set by the hosts of classes saved files name

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls._flavour is not None:
            return
        cls._flavour = _class_flavour(cls)
        if cls._serializable and cls._flavour is not None:
            saving = cls._flavour.keras.saving
            saving.register_keras_serializable(package="gradient_accumulator")(cls)
