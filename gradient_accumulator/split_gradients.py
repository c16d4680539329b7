"""One micro-batch's gradients split by loss denominator, for hosts whose
loss terms the big batch divides by different totals (see
``weighting.denominators`` and ``Engine.part``). Plain TensorFlow.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from gradient_accumulator.arithmetic import minus, overwritten
from gradient_accumulator.weighting import Denominator


def split_by_denominator(
    tape: tf.GradientTape,
    objective: tf.Tensor,
    outputs: Sequence[tf.Tensor],
    groups: Sequence[Denominator],
    variables: Sequence,
    unscale=1.0,
) -> tuple[list, list[tuple[list, tf.Tensor, tf.Tensor]]]:
    """The gradients of the first group (with everything the loss holds
    beyond the terms: regularisation), and ``(grads, weight, count)`` of
    every other group, from a persistent ``tape`` on which ``objective``
    was computed.

    ``outputs[i]``: the model output loss term ``i`` reads; ``unscale``:
    what every gradient is multiplied by besides its group's weight (the
    inverse of a loss scale and a backward share), so each group's weight
    is ``group.weight * unscale``.

    One backward pass gives the whole gradient and the loss's gradients
    with respect to the outputs; each further group's gradients come from a
    backward pass from its outputs alone, seeded with those, and the first
    group's are what remains. An extra group costs one backward pass of
    the variables its outputs reach.
    """
    outputs = list(outputs)
    found = tape.gradient(objective, [*outputs, *variables])
    seeds, rest = found[: len(outputs)], found[len(outputs) :]
    parts = []
    for group in groups[1:]:
        reached = [i for i in group.terms if seeds[i] is not None]
        own = tape.gradient(
            [outputs[i] for i in reached],
            list(variables),
            output_gradients=[seeds[i] for i in reached],
        )
        # Overwritten variables' "gradients" are new values, not sums of
        # terms: the first group keeps them whole.
        rest = [
            r if overwritten(v) else minus(r, g)
            for r, g, v in zip(rest, own, variables)
        ]
        parts.append((own, group.weight * unscale, group.count))
    return rest, parts
