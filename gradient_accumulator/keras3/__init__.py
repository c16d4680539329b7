"""The Keras 3 hosts around the engine: the classes that
``gradient_accumulator`` exports where ``tf.keras`` is Keras 3 (the
default). The same modules and names as ``gradient_accumulator.keras2``."""

from gradient_accumulator.keras3.accumulate import (
    Accumulating,
    accumulate,
    stop_accumulating,
)
from gradient_accumulator.keras3.batch_norm import AccumBatchNormalization
from gradient_accumulator.keras3.callbacks import (
    AccumulationScheduler,
    FlushPartialCycle,
)
from gradient_accumulator.keras3.convert import replace_batchnorm_layers
from gradient_accumulator.keras3.model import GradientAccumulateModel
from gradient_accumulator.keras3.optimizer import GradientAccumulateOptimizer
from gradient_accumulator.keras3.tracked_engine import Accumulator
from gradient_accumulator.keras3.verify import (
    LayerCheck,
    VariableCheck,
    VerifyReport,
    verify,
)

__all__ = [
    "AccumBatchNormalization",
    "Accumulating",
    "AccumulationScheduler",
    "Accumulator",
    "FlushPartialCycle",
    "GradientAccumulateModel",
    "GradientAccumulateOptimizer",
    "LayerCheck",
    "VariableCheck",
    "VerifyReport",
    "accumulate",
    "replace_batchnorm_layers",
    "stop_accumulating",
    "verify",
]
