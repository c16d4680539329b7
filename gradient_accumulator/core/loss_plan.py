"""How one micro-batch's loss is weighted, scaled and unscaled before its
backward pass: one record, :class:`LossPlan`, decided in one place,
:func:`loss_plan`, for every model host and both Kerases.

The engine applies ``sum_k weight_k * g_k / sum_k count_k`` per denominator
group (``weighting.denominators``). A micro-batch's weight goes either into
its loss (one multiply of a scalar) or onto its gradients (with the
unscaling, when a loss scale, several denominators or float8 layers need
the gradients of the micro-batch's own loss); either way the sums the
engine keeps hold the same quantity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import tensorflow as tf

from gradient_accumulator.core.weighting import Denominator, backward_share


@dataclasses.dataclass(frozen=True)
class LossPlan:
    """What a host does with one micro-batch's loss.

    ``groups``: the denominator groups, in the engine's replica convention
    (weights and counts the engine sums over replicas); ``loss_weight``:
    what the loss is multiplied by before the loss scale and the backward
    pass; ``unscale``: what every gradient is multiplied by besides its
    group's weight, or None when the one group's weight is in
    ``loss_weight``; ``retry_scale``: the loss scale under which an
    overflowing backward pass is redone at a smaller seed, or None;
    ``drops_penalty``: None, or a bool tensor, True when this micro-batch
    must take the regularisation penalty out of its (summed) loss, divided
    by ``penalty_divisor`` (the penalty is in the loss once per big batch).
    """

    groups: list[Denominator]
    loss_weight: tf.Tensor | float
    unscale: tf.Tensor | float | None
    retry_scale: tf.Tensor | None = None
    drops_penalty: tf.Tensor | None = None
    penalty_divisor: int = 1


def loss_plan(
    groups: Sequence[Denominator],
    *,
    scale: tf.Tensor | None = None,
    overwrites: bool = False,
    cycle_length: Callable[[], tf.Tensor] | None = None,
    part: tf.Tensor | None = None,
    penalty: bool = False,
    replicas: int = 1,
    means_divided: bool = False,
    own: bool = False,
) -> LossPlan:
    """The :class:`LossPlan` of a micro-batch whose loss terms form
    ``groups`` (``weighting.denominators``, as the host's Keras reduces).

    ``scale``: the dynamic loss scale, or None; ``overwrites``: the model
    trains float8 variables overwritten with their gradient
    (``arithmetic.overwritten``); ``cycle_length``: a function giving the
    cycle's length (asked only under a scale); ``part``: an in-step slice's
    share of its step, else None; ``penalty``: the loss holds a
    regularisation penalty (and is a scalar).

    ``replicas`` and ``means_divided`` say the Keras' replica convention.
    ``means_divided`` (tf-keras): Keras divided each replica's mean terms
    and its penalty by the replica count and leaves summed terms whole,
    expecting the optimizer to sum the replicas; the engine takes a
    weighted mean over replicas, so a mean group weighs ``replicas`` times
    its denominator and a summed one counts ``1 / replicas`` per replica.
    Otherwise (Keras 3) the host undid Keras' division of the whole loss
    before (``unscale_loss_for_distribution``), and the groups stand.

    ``own``: the loss is the model's own (no compiled term): a penalty in
    it is kept as it is; replicas as for compiled terms (``micro_batch``).
    """
    first = groups[0]
    drops = None
    if penalty and first.sums and not own:
        # A summed loss adds the penalty once per big batch: only the
        # micro-batch that opens the cycle (count > 0) keeps it (the
        # weights, hence the penalty, are the same all cycle).
        drops = tf.logical_not(first.count > 0)
    if means_divided:
        groups = [_per_replica(group, replicas) for group in groups]
    float8 = overwrites and len(groups) == 1
    if scale is not None and not float8:
        # A micro-batch's mean loss gives each of its samples about
        # accum_steps times the part of the backward pass it has in the big
        # batch, so float16 would overflow (and skip the cycle) where the
        # big batch does not: the loss is divided by that factor first. The
        # gradients are unscaled by it and by the loss scale, so the sums
        # stay in one unit and exactly weighted whatever the factor.
        sums = len(groups) == 1 and groups[0].sums
        loss_weight = tf.stop_gradient(backward_share(sums, cycle_length(), part))
        unscale = 1.0 / (scale * loss_weight)
    elif len(groups) > 1 or float8:
        # Each denominator's weight goes on its own gradients. float8 layers
        # record the backward pass's magnitudes (their output-gradient amax)
        # as Keras' own accumulation does: from the micro-batch's own loss,
        # so the weight goes on the gradients; unscaling there keeps every
        # sum in one unit.
        loss_weight = 1.0
        unscale = 1.0 if scale is None else 1.0 / scale
    else:
        # Weighting the scalar loss rather than the gradients spares a
        # multiply over every gradient element on every micro-step.
        loss_weight, unscale = tf.stop_gradient(groups[0].weight), None
    return LossPlan(
        groups=list(groups),
        loss_weight=loss_weight,
        unscale=unscale,
        # A micro-batch's gradients sum its own samples, which need not
        # cancel as the big batch's do: an overflow the big batch need not
        # have is recomputed at a smaller seed instead of skipping the
        # cycle. float8 layers record their backward pass and are not
        # differentiated twice.
        retry_scale=None if float8 else scale,
        drops_penalty=drops,
        penalty_divisor=replicas if means_divided else 1,
    )


def _per_replica(group: Denominator, replicas: int) -> Denominator:
    if group.sums:
        return dataclasses.replace(group, count=group.count / replicas)
    return dataclasses.replace(group, weight=tf.stop_gradient(group.weight) * replicas)
