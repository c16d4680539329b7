"""``gradient_accumulator.agc``, the 0.5.x path of adaptive gradient clipping
(:mod:`gradient_accumulator.core.agc`)."""

from gradient_accumulator.core.agc import (
    adaptive_clip_grad,
    compute_norm,
    unitwise_norm,
)

__all__ = ["adaptive_clip_grad", "compute_norm", "unitwise_norm"]
