"""Exact gradient accumulation for TensorFlow / Keras 3."""

from gradient_accumulator import _backend  # noqa: F401  (fails on other backends)
from gradient_accumulator._version import __version__
from gradient_accumulator.accumulator import Accumulator
from gradient_accumulator.agc import adaptive_clip_grad, compute_norm, unitwise_norm
from gradient_accumulator.batch_norm import AccumBatchNormalization
from gradient_accumulator.callbacks import AccumulationScheduler, FlushPartialCycle
from gradient_accumulator.convert import replace_batchnorm_layers
from gradient_accumulator.model import GradientAccumulateModel
from gradient_accumulator.optimizer import GradientAccumulateOptimizer
from gradient_accumulator.verify import LayerCheck, VariableCheck, VerifyReport, verify

__all__ = [
    "AccumBatchNormalization",
    "AccumulationScheduler",
    "Accumulator",
    "FlushPartialCycle",
    "GradientAccumulateModel",
    "GradientAccumulateOptimizer",
    "LayerCheck",
    "VariableCheck",
    "VerifyReport",
    "__version__",
    "adaptive_clip_grad",
    "compute_norm",
    "replace_batchnorm_layers",
    "unitwise_norm",
    "verify",
]
