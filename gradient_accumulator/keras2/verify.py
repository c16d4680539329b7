"""``verify`` for tf-keras: does accumulation reproduce big-batch training on
your tf-keras model? As the Keras 3 ``verify``
(``gradient_accumulator.hosts.public`` writes it once for both Kerases)."""

from __future__ import annotations

from gradient_accumulator.hosts import public
from gradient_accumulator.hosts.verify_report import (
    LayerCheck,
    VariableCheck,
    VerifyReport,
)
from gradient_accumulator.keras2.flavour import FLAVOUR
from gradient_accumulator.keras2.model import GradientAccumulateModel

__all__ = ["LayerCheck", "VariableCheck", "VerifyReport", "verify"]

verify = public.verify(FLAVOUR, __name__, GradientAccumulateModel)
