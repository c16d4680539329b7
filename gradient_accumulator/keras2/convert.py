"""``replace_batchnorm_layers`` for tf-keras: a copy of a tf-keras model whose
BatchNormalization layers accumulate (``gradient_accumulator.hosts.public``
writes it once for both Kerases)."""

from __future__ import annotations

from gradient_accumulator.hosts import public
from gradient_accumulator.keras2.batch_norm import AccumBatchNormalization
from gradient_accumulator.keras2.flavour import FLAVOUR
from gradient_accumulator.keras2.model import GradientAccumulateModel

replace_batchnorm_layers = public.replace_batchnorm_layers(
    FLAVOUR, __name__, AccumBatchNormalization, GradientAccumulateModel
)
