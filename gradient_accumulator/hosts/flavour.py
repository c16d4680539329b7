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

    # --- model host (hosts/model.py, hosts/micro_batch.py, hosts/in_step.py)
    # Construction and saving.
    engine: type | None = None  # the engine class a model holds its state in
    # (model, fn): fn(), without tracking the attributes it sets as the
    # model's (tf-keras would make the engine's variables model weights).
    untracked: Callable | None = None
    # (model, name, engine) / (model, name): makes the engine a checkpoint
    # dependency of the model, or no longer (no-ops where Keras tracks it).
    own_state: Callable | None = None
    disown_state: Callable | None = None
    keras_tensor: type | None = None  # symbolic inputs: (inputs, outputs) given
    functional: type | None = None  # Keras' Functional
    # (args, kwargs) -> whether Keras builds a functional model of them.
    functional_arguments: Callable | None = None
    custom_names: dict | None = None  # Keras' registry of class -> saved name
    # (model) -> the network config of a functional model, or None to take
    # Keras' get_config.
    network_config: Callable | None = None
    # (cls, config, custom_objects, from_config): a model from its config
    # (from_config: Keras' own, for a config of no network).
    model_from_config: Callable | None = None
    in_step: bool = False  # has in-step micro-batching (micro_batch_size)
    # Training.
    sublayers: Callable | None = None  # (model) -> every nested layer
    forward: Callable | None = None  # (model, x) -> y_pred, in training
    # (model, x, y, y_pred, sample_weight) -> the loss Keras differentiates.
    compute_loss: Callable | None = None
    # (model) -> the compiled loss terms (``.loss``, ``.path`` into
    # term_outputs(y_pred)), [] before compile or for a custom loss.
    loss_terms: Callable | None = None
    term_outputs: Callable | None = None  # (y_pred) -> what paths index
    # (weights, mask) -> the sample weights as "mean_with_sample_weight"
    # masks them; None: no such reduction (no sample weights asked).
    merge_mask: Callable | None = None
    # Keras' masked mean guards a mask of no entry (0 / 0) itself.
    guards_empty_masks: bool = True
    # The replica convention (see core/loss_plan.py): (loss) -> the loss
    # Keras divided by the replica count made whole again, and whether
    # Keras divides only mean terms (and the penalty) instead.
    whole_loss: Callable | None = None
    means_divided: bool = False
    replicas: Callable | None = None  # (model) -> replicas in sync
    loss_tracker: Callable | None = None  # (model) -> the logged loss's Mean, or None
    # Keras builds the optimizer only at its first apply, after the step
    # reads the loss scale: the host builds it first.
    builds_optimizer: bool = False
    # (model) -> a context in which the step builds the engine's variables.
    state_scope: Callable | None = None
    # The loss-scale hooks (the loss_scale modules): (optimizer) -> the
    # scaler or None; the dynamic scale or None; (on_apply, on_skip).
    scaler_of: Callable | None = None
    loss_scale: Callable | None = None
    scale_hooks: Callable | None = None
    scale_loss: Callable | None = None  # (optimizer, loss) -> scaled loss
    # (optimizer, grads, variables): applies reduced, unscaled gradients.
    apply_gradients: Callable | None = None

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
