"""Which wrapper's method called an inner object's method: how an inner
optimizer learns the ``LossScaleOptimizer`` around it, in either Keras (each
``_compat`` module names its Keras' class and how far to look)."""

from __future__ import annotations

import sys


def calling_wrapper(inner, wrapper: type, frames: int):
    """The instance of ``wrapper`` whose ``inner_optimizer`` is ``inner`` and
    whose method is among the ``frames`` callers of the function that called
    this one's caller (the method of ``inner``); else None."""
    frame = sys._getframe(2)
    for _ in range(frames):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if (
            isinstance(candidate, wrapper)
            and getattr(candidate, "inner_optimizer", None) is inner
        ):
            return candidate
        frame = frame.f_back
    return None
