"""``verify``: does accumulation reproduce big-batch training on *your* model?

Trains the model two ways from the same initial weights on the same samples in
the same order — plain Keras with the big batch
(``micro_batch_size * accum_steps``) and ``GradientAccumulateModel`` with the
micro-batch — and compares every variable, layer by layer
(``gradient_accumulator.hosts.equivalence`` does it for both Kerases).
"""

from __future__ import annotations

from gradient_accumulator.hosts import public
from gradient_accumulator.hosts.verify_report import (
    LayerCheck,
    VariableCheck,
    VerifyReport,
)
from gradient_accumulator.keras3.flavour import FLAVOUR
from gradient_accumulator.keras3.model import GradientAccumulateModel

__all__ = ["LayerCheck", "VariableCheck", "VerifyReport", "verify"]

verify = public.verify(FLAVOUR, __name__, GradientAccumulateModel)
