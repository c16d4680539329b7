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
