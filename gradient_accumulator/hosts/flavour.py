"""What one Keras provides to the hosts: the hooks of :class:`Flavour`.

The hosts in this folder are written once and import no Keras; each public
class tells them its Keras by a :class:`Flavour` instance (``_flavour``),
and each Keras has one module whose subclass implements the hooks from its
own classes and its private names (``gradient_accumulator/keras3/flavour.py`` for
Keras 3, ``gradient_accumulator/keras2/flavour.py`` for tf-keras). A third
Keras is a third such subclass and the thin public classes over it.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from types import ModuleType
from typing import Any


class Flavour(abc.ABC):
    """What the hosts need of one Keras: the hooks each Keras' subclass
    implements (``gradient_accumulator/keras3/flavour.py``: Keras 3,
    ``gradient_accumulator/keras2/flavour.py``: tf-keras), as Keras 3's
    backends override its ``_backend_*`` methods.

    Two kinds: *methods* (``abc.abstractmethod`` here: a subclass that
    leaves one out cannot be instantiated), and *values*, class attributes
    annotated here (a subclass that leaves one out is refused when its
    instance is made, with the names). A grep for a hook's name finds it
    here, in each Keras and in the host that calls it."""

    # ---------------------------------------------------------------- values
    name: str  # its top-level package (``keras``, ``tf_keras``), in messages
    keras: ModuleType  # the Keras module: Model, layers, callbacks, saving, ...

    # batch norm (hosts/batch_norm.py)
    fixed_weight: dict  # add_weight keywords: no autocast under mixed precision
    # The engine's divisor of the pooled sums: the cycle's calls (True), or 1
    # a cycle (the unbiased variance needs the big batch's size).
    counts_calls: bool

    # accumulate() (hosts/in_place.py), replace_batchnorm_layers, verify
    custom_names: dict  # class -> the name saved files give it
    graph_models: tuple[type, ...]  # the models it can rebuild layer by layer
    # Options of its BatchNormalization that AccumBatchNormalization lacks
    # (refused when set).
    batch_norm_unsupported: tuple[str, ...]
    optimizers: tuple[type, ...]  # its optimizer classes
    batch_norms: tuple[type, ...]  # its BatchNormalization classes
    # TensorFlow Model Optimization (hosts/pruning.py; tf-keras only): () -> a
    # new UpdatePruningStep, and (that callback) -> the pruning wrappers it
    # collected; None where TF-MOT cannot be (Keras 3).
    update_pruning_step: Callable[[], Any] | None
    prunable_layers: Callable[[Any], list] | None

    # optimizer host (hosts/optimizer.py, hosts/loss_scale.py)
    # What counts as an optimizer to wrap, and its name in messages.
    optimizer_kinds: tuple
    optimizer_text: str
    # The wrapper's keyword arguments to its base class' constructor.
    optimizer_base_arguments: tuple
    # Whether the wrapper makes its engine's variables in the strategy it
    # was made under (not needed where the Keras' variables find it).
    optimizer_keeps_strategy: bool
    # Keys the Keras adds to the wrapper's config, dropped on load.
    optimizer_config_extras: tuple
    # The Keras' LossScaleOptimizer, and how to use one inside the optimizer
    # wrapper with this Keras (the end of the refusal of one around it).
    loss_scaler: type
    inner_scaler_hint: str

    # model host (hosts/model.py, hosts/micro_batch.py, hosts/in_step.py)
    engine: type  # the engine class a model holds its state in
    # The prefix of the engine's state's keys in the model's own entry of
    # ``.keras`` files, or None where the engine saves itself (Keras 3).
    model_state_key: str | None
    keras_tensor: type  # symbolic inputs: (inputs, outputs) given
    functional: type  # Keras' Functional
    in_step: bool  # has in-step micro-batching (micro_batch_size)
    # (weights, mask) -> the sample weights as "mean_with_sample_weight"
    # masks them; None: no such reduction (no sample weights asked).
    merge_mask: Callable | None
    # Keras' masked mean guards a mask of no entry (0 / 0) itself.
    guards_empty_masks: bool
    # Whether Keras divides only mean terms (and the penalty) by the replica
    # count (see core/loss_plan.py and whole_loss).
    means_divided: bool
    # Keras builds the optimizer only at its first apply, after the step
    # reads the loss scale: the host builds it first.
    builds_optimizer: bool

    def __init__(self) -> None:
        missing = [
            name
            for klass in type(self).__mro__
            for name in vars(klass).get("__annotations__", {})
            if not hasattr(type(self), name)
        ]
        if missing:
            raise TypeError(
                f"{type(self).__name__} leaves out the values {missing} of "
                "its Flavour (see gradient_accumulator/hosts/flavour.py)."
            )

    # --------------------------------------------------- methods: batch norm
    @abc.abstractmethod
    def batch_norm_options(self, layer, axis, synchronized, kwargs) -> tuple:
        """(axis, the base class's keywords beyond the shared ones); refuses
        or takes out of ``kwargs`` what the Keras lacks."""

    @abc.abstractmethod
    def layer_engine(self, layer, settings):
        """An engine whose variables ``layer`` tracks and saves as its own
        weights."""

    @abc.abstractmethod
    def batch_norm_built(self, layer, rank: int) -> None:
        """What a build adds to Keras' (tf-keras: any input rank)."""

    @abc.abstractmethod
    def unbiased_variance(self, layer, rank: int) -> bool:
        """Whether the moving variance takes the unbiased variance (tf-keras'
        fused kernel does)."""

    @abc.abstractmethod
    def own_initializer(self, initializer):
        """An initializer's copy for one more weight."""

    @abc.abstractmethod
    def training_flag(self, training):
        """A call's ``training`` as a Python bool or None."""

    @abc.abstractmethod
    def batch_norm_moments(self, layer, inputs, mask, axes) -> tuple:
        """((mean, variance) to normalise with, this replica's own (mean,
        variance))."""

    @abc.abstractmethod
    def moving_average(self, variable, value, momentum: float) -> None:
        """Its BatchNormalization's moving-average update, verbatim."""

    # ------------------------- methods: accumulate(), replace layers, verify
    @abc.abstractmethod
    def compiled(self, model) -> bool:
        """Whether ``model`` has been compiled."""

    @abc.abstractmethod
    def accumulated_config(self, model, own: type) -> dict:
        """The config a model made accumulating saves: its own class's
        (``own``) and the settings."""

    @abc.abstractmethod
    def clone_graph(self, model, clone_layer):
        """A copy of a functional or Sequential ``model``, nested ones
        included, with ``clone_layer(layer)`` for every other layer."""

    @abc.abstractmethod
    def batch_norm_config(self, layer) -> dict:
        """The config a new AccumBatchNormalization gets beyond ``layer``'s."""

    @abc.abstractmethod
    def copy_optimizer(self, optimizer):
        """A new optimizer from ``optimizer``'s config."""

    @abc.abstractmethod
    def sublayers(self, layer) -> list:
        """``layer`` and every layer nested in it."""

    @abc.abstractmethod
    def draws_random(self, layer) -> bool:
        """Whether ``layer`` draws random numbers when called."""

    @abc.abstractmethod
    def random_states(self, model) -> list | None:
        """The variables holding the state of the random draws of
        ``model``'s layers, which a second forward pass resets to draw the
        same numbers again (``gradient_cache``); None when this Keras draws
        from a state it cannot reset."""

    @abc.abstractmethod
    def call_losses(self, model) -> list:
        """The losses ``model``'s layers added in its last call
        (``add_loss``, activity regularisers), without the weights'
        regularisation penalties."""

    @abc.abstractmethod
    def variable_name(self, variable) -> str:
        """A variable's name in its layer."""

    @abc.abstractmethod
    def model_optimization(self, layer) -> tuple[str, Any] | None:
        """("pruning", its step variable) for TF-MOT's pruning wrapper,
        ("quantization", None) for its quantization-aware layers, else None."""

    # ----------------------------------------------- methods: optimizer host
    @abc.abstractmethod
    def optimizer_engine(self, wrapper, settings):
        """The optimizer wrapper's unbuilt engine."""

    @abc.abstractmethod
    def optimizer_built(self, optimizer) -> bool:
        """Whether ``optimizer`` has been built."""

    @abc.abstractmethod
    def optimizer_build_scope(self, optimizer):
        """The context the wrapper's first apply builds it in."""

    @abc.abstractmethod
    def build_optimizer(self, optimizer, variables) -> None:
        """Builds ``optimizer`` for ``variables``."""

    @abc.abstractmethod
    def own_optimizer_variables(self, wrapper) -> list:
        """The wrapper's own state (not the wrapped optimizer's)."""

    @abc.abstractmethod
    def optimizer_state(self, optimizer) -> list:
        """``optimizer``'s variables."""

    @abc.abstractmethod
    def serialize_optimizer(self, optimizer) -> dict:
        """``optimizer``'s config, as the Keras saves it."""

    @abc.abstractmethod
    def deserialize_optimizer(self, config, custom_objects):
        """An optimizer from what :meth:`serialize_optimizer` gave."""

    @abc.abstractmethod
    def marks_wrapped_optimizer(self, name: str, value) -> bool:
        """Whether setting attribute ``name`` of an optimizer to ``value`` is
        what the Keras' LossScaleOptimizer does to the optimizer it wraps,
        when it is made."""

    @abc.abstractmethod
    def current_scale(self, scaler):
        """The loss scale of ``scaler``, a tensor."""

    @abc.abstractmethod
    def scale_loss(self, optimizer, loss):
        """``loss`` as ``optimizer`` scales it."""

    @abc.abstractmethod
    def dynamic_scale(self, scaler) -> bool:
        """Whether ``scaler``'s scale changes."""

    @abc.abstractmethod
    def cycle_scale_hooks(self, scaler) -> tuple:
        """The engine's (on_apply, on_skip) that keep a dynamic ``scaler``'s
        scale per cycle."""

    @abc.abstractmethod
    def apply_reduced(self, optimizer, grads, variables) -> None:
        """Applies unscaled gradients already summed over replicas (replica
        context); never given a scaler."""

    @abc.abstractmethod
    def gradient_scale(self, scaler):
        """The scale the gradients given the wrapper carry (``scaler`` or
        None); None if they carry none."""

    # --------------------------------------------------- methods: model host
    @abc.abstractmethod
    def untracked(self, model, fn):
        """``fn()``, without tracking the attributes it sets as ``model``'s
        (tf-keras would make the engine's variables model weights)."""

    @abc.abstractmethod
    def own_state(self, model, name: str, engine) -> None:
        """Makes ``engine`` a checkpoint dependency of ``model`` (a no-op
        where Keras tracks it)."""

    @abc.abstractmethod
    def disown_state(self, model, name: str) -> None:
        """Undoes :meth:`own_state`."""

    @abc.abstractmethod
    def functional_arguments(self, args, kwargs) -> bool:
        """Whether Keras builds a functional model of these arguments."""

    @abc.abstractmethod
    def network_config(self, model) -> dict | None:
        """The network config of a functional ``model``, or None to take
        Keras' get_config."""

    @abc.abstractmethod
    def model_from_config(self, cls, config, custom_objects, from_config):
        """A model of class ``cls`` from its config (``from_config``: Keras'
        own, for a config of no network)."""

    @abc.abstractmethod
    def forward(self, model, x):
        """``model``'s output for ``x``, in training."""

    @abc.abstractmethod
    def compute_loss(self, model, x, y, y_pred, sample_weight):
        """The loss Keras differentiates."""

    @abc.abstractmethod
    def loss_terms(self, model) -> list:
        """The compiled loss terms (``.loss``, ``.path`` into
        :meth:`term_outputs`), [] before compile or for a custom loss."""

    @abc.abstractmethod
    def term_outputs(self, y_pred):
        """What the loss terms' paths index."""

    @abc.abstractmethod
    def whole_loss(self, loss):
        """The loss Keras divided by the replica count made whole again (see
        core/loss_plan.py)."""

    @abc.abstractmethod
    def replicas(self, model) -> int:
        """The replicas in sync."""

    @abc.abstractmethod
    def loss_tracker(self, model):
        """The logged loss's Mean, or None."""

    @abc.abstractmethod
    def state_scope(self, model):
        """A context in which the step builds the engine's variables."""

    # ------------------------------------------- the other Keras' optimizer wrapper
    @abc.abstractmethod
    def other_optimizer_wrapper(self, optimizer) -> type | None:
        """The other Keras' ``GradientAccumulateOptimizer`` when
        ``optimizer`` is that Keras', else None: the optimizer handed in
        decides which Keras' wrapper wraps it."""
