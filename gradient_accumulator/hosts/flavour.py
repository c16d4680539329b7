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

    # --- optimizer host (hosts/optimizer.py). Defaults: so that fields of
    # other sections may come in any order; every flavour sets them all.
    # What counts as an optimizer to wrap, and its name in messages.
    optimizer_kinds: tuple = ()
    optimizer_text: str = ""
    # The wrapper's keyword arguments to its base class' constructor.
    optimizer_base_arguments: tuple = ()
    # (wrapper, Settings) -> the wrapper's unbuilt engine.
    optimizer_engine: Callable | None = None
    # Whether the wrapper makes its engine's variables in the strategy it
    # was made under (not needed where the Keras' variables find it).
    optimizer_keeps_strategy: bool = False
    optimizer_built: Callable | None = None  # wrapper -> has it been built
    build_optimizer: Callable | None = None  # (optimizer, variables) -> None
    own_optimizer_variables: Callable | None = None  # wrapper -> its state
    optimizer_state: Callable | None = None  # optimizer -> its variables
    serialize_optimizer: Callable | None = None
    deserialize_optimizer: Callable | None = None  # (config, custom_objects)
    # Keys the Keras adds to the wrapper's config, dropped on load.
    optimizer_config_extras: tuple = ()
    # The loss scaler around the wrapper, when called from its method.
    wrapping_loss_scaler: Callable | None = None
    # The Keras' loss-scale module: its adopt, scale_hooks and
    # apply_gradients (which applies replica-summed gradients).
    loss_scaling: ModuleType | None = None
    # Whether an adopted scaler's dynamic scale replaces the wrapped
    # optimizer's static ``loss_scale_factor``.
    scaler_replaces_loss_scale_factor: bool = False
    # scaler or None -> the scale the gradients given the wrapper carry.
    gradient_scale: Callable | None = None

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
