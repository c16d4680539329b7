"""One micro-batch's gradients from its tape, as the engine takes them: in
one backward pass, split by loss denominator when the big batch divides its
loss terms by different totals (see ``weighting.denominators`` and
``Engine.part``), or recomputed at a smaller seed when a loss-scaled
backward pass overflows (``overflow.finite_gradients``). Plain TensorFlow;
every model host calls :func:`split_gradients`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import tensorflow as tf

from gradient_accumulator.core.arithmetic import minus, overwritten
from gradient_accumulator.core.overflow import finite_gradients
from gradient_accumulator.core.weighting import Denominator


@dataclasses.dataclass
class MicroGradients:
    """What :func:`split_gradients` hands to ``Engine.step``.

    ``grads`` and ``weight`` go to ``step`` (``weight`` None: the weight is
    already in the loss); ``parts``, ``(grads, weight, count)`` of every
    denominator group after the first, to ``add_part(1..)``; ``overflowed``
    (None, or a boolean tensor) to ``step(overflowed=...)``.
    """

    grads: list
    weight: tf.Tensor | None
    parts: list = dataclasses.field(default_factory=list)
    overflowed: tf.Tensor | None = None


def split_gradients(
    tape: tf.GradientTape,
    objective: tf.Tensor,
    variables: Sequence,
    groups: Sequence[Denominator],
    outputs=(),
    unscale=None,
    retry_scale=None,
) -> MicroGradients:
    """One micro-batch's gradients of ``objective`` (its loss, times any
    loss weight and loss scale) with respect to ``variables``.

    ``groups``: its loss terms by denominator (``weighting.denominators``);
    with more than one, ``outputs[i]`` is the model output term ``i`` reads
    and ``tape`` must be persistent. ``unscale``: what every gradient is
    multiplied by besides its group's weight, or None when the one group's
    weight is already in ``objective``. ``retry_scale``: the loss scale in
    ``objective`` when an overflowing backward pass is to be recomputed at a
    smaller seed (persistent ``tape``), else None.

    The weight of a group's gradients is ``group.weight * unscale`` (divided
    by the retry's seed factor); the sums the engine keeps therefore hold
    the same quantity whichever path ran.
    """
    first = groups[0]
    if len(groups) > 1:
        unscale = 1.0 if unscale is None else unscale
        grads, parts = split_by_denominator(
            tape, objective, outputs, groups, variables, unscale
        )
        return MicroGradients(grads, first.weight * unscale, parts)
    if retry_scale is not None:
        grads, factor = finite_gradients(tape, objective, variables, retry_scale)
        unscale = 1.0 if unscale is None else unscale
        return MicroGradients(
            grads, first.weight * unscale / factor, overflowed=factor < 1.0
        )
    grads = tape.gradient(objective, variables)
    return MicroGradients(grads, group_weight(first, unscale))


def group_weight(group: Denominator, unscale) -> tf.Tensor | None:
    """What the engine weighs the gradients of ``group``, the only one, by:
    None when its weight is already in the loss (``unscale`` None)."""
    return None if unscale is None else group.weight * unscale


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
