"""The tf-keras (legacy Keras 2) hosts around the engine: the classes that
``gradient_accumulator`` exports where ``tf.keras`` is tf-keras
(``TF_USE_LEGACY_KERAS=1``)."""

from gradient_accumulator.keras2.accumulate import (
    Accumulating,
    accumulate,
    stop_accumulating,
)
from gradient_accumulator.keras2.batch_norm import AccumBatchNormalization
from gradient_accumulator.keras2.callbacks import (
    AccumulationScheduler,
    FlushPartialCycle,
)
from gradient_accumulator.keras2.model import GradientAccumulateModel
from gradient_accumulator.keras2.optimizer import GradientAccumulateOptimizer

__all__ = [
    "AccumBatchNormalization",
    "Accumulating",
    "AccumulationScheduler",
    "FlushPartialCycle",
    "GradientAccumulateModel",
    "GradientAccumulateOptimizer",
    "accumulate",
    "stop_accumulating",
]
