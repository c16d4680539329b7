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
    PruningStepPerUpdate,
)
from gradient_accumulator.keras2.convert import replace_batchnorm_layers
from gradient_accumulator.keras2.model import GradientAccumulateModel
from gradient_accumulator.keras2.optimizer import GradientAccumulateOptimizer
from gradient_accumulator.keras2.verify import (
    LayerCheck,
    VariableCheck,
    VerifyReport,
    verify,
)

__all__ = [
    "AccumBatchNormalization",
    "Accumulating",
    "AccumulationScheduler",
    "FlushPartialCycle",
    "GradientAccumulateModel",
    "GradientAccumulateOptimizer",
    "LayerCheck",
    "PruningStepPerUpdate",
    "VariableCheck",
    "VerifyReport",
    "accumulate",
    "replace_batchnorm_layers",
    "stop_accumulating",
    "verify",
]
