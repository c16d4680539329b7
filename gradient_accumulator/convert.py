"""Converting a trained model for accumulation."""

from __future__ import annotations

from gradient_accumulator.flavour import FLAVOUR
from gradient_accumulator.hosts import public

replace_batchnorm_layers = public.replace_batchnorm_layers(FLAVOUR, __name__)
