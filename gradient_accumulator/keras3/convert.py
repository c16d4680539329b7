"""Converting a trained model for accumulation."""

from __future__ import annotations

from gradient_accumulator.hosts import public
from gradient_accumulator.keras3.batch_norm import AccumBatchNormalization
from gradient_accumulator.keras3.flavour import FLAVOUR
from gradient_accumulator.keras3.model import GradientAccumulateModel

replace_batchnorm_layers = public.replace_batchnorm_layers(
    FLAVOUR, __name__, AccumBatchNormalization, GradientAccumulateModel
)
