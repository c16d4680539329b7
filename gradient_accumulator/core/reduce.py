"""The update's sums, across replicas in one all-reduce: every group's
buffers, weight sum and sample count packed into a single vector
(:func:`pack`) and cut back into per-group sums (:func:`unpack`); on one
replica the same sums read in place, the cycle's last micro-batch added on
the way (:func:`read`); parts' means folded into their leader's sums
(:func:`join_parts`); and the buffers left behind by an update
(:func:`reset`) or a dropped cycle (:func:`zero`).

A *group* (:class:`~gradient_accumulator.core.links.Group`) is one
accumulator's share of an update: the leader's and each follower's. These
functions run in replica context, or on the one replica; the decision to
call them is :func:`gradient_accumulator.core.cycle_end.decide`'s.
"""

from __future__ import annotations

import tensorflow as tf

from gradient_accumulator.core import arithmetic
from gradient_accumulator.core.links import Group


def pack(groups: list[Group]) -> tf.Tensor:
    parts = []
    replicas = tf.distribute.get_replica_context().num_replicas_in_sync
    for group in groups:
        for buffer, variable, present in zip(
            group.buffers, group.variables, group.present
        ):
            if not present:
                continue
            value = arithmetic.raw(buffer)
            if arithmetic.overwritten(variable):
                # The all-reduce sums: overwritten variables get the mean of
                # the replicas' cycle maxima.
                value = value / replicas
            parts.append(tf.reshape(value, [-1]))
        state = group.accumulator.state
        parts.append(tf.reshape(arithmetic.raw(state.weight_sum), [1]))
        parts.append(tf.reshape(arithmetic.raw(state.sample_sum), [1]))
    # The leader's overflow count rides last; unpack does not read it.
    overflows = groups[0].accumulator.state.overflows
    parts.append(tf.reshape(arithmetic.raw(overflows), [1]))
    return tf.concat(parts, axis=0)


def unpack(total: tf.Tensor, groups: list[Group]):
    """Yields ``(sums, weight_sum, samples)`` per group, sums ``None`` where
    absent."""
    offset = 0
    for group in groups:
        sums = []
        for buffer, present in zip(group.buffers, group.present):
            if not present:
                sums.append(None)
                continue
            size = buffer.shape.num_elements()
            sums.append(tf.reshape(total[offset : offset + size], buffer.shape))
            offset += size
        yield sums, total[offset], total[offset + 1]
        offset += 2


def read(group: Group, last) -> tuple[list, tf.Tensor, tf.Tensor]:
    """A group's sums, weight sum and sample count, plus the not yet added
    micro-batch ``last = (grads, weight, count, samples, empty)`` if given
    (``empty``: the value the accumulator's ``empty`` flag had)."""
    state = group.accumulator.state
    live = [b if p else None for b, p in zip(group.buffers, group.present)]
    weight_sum = tf.convert_to_tensor(arithmetic.raw(state.weight_sum))
    sample_sum = tf.convert_to_tensor(arithmetic.raw(state.sample_sum))
    if last is None:
        sums = [
            None if b is None else tf.convert_to_tensor(arithmetic.raw(b)) for b in live
        ]
        return sums, weight_sum, sample_sum
    grads, weight, count, samples, empty = last
    weight = None if weight is None else tf.cast(weight, tf.float32)
    triples = [
        (b, g, arithmetic.overwritten(v))
        for b, g, v in zip(live, grads, group.variables)
        if g is not None
    ]

    def alone():
        # The cycle is this one micro-batch (accum_steps 1): the buffers hold
        # only leftovers.
        return [
            arithmetic.plus(
                tf.zeros(b.shape) if arithmetic.sparse(g) else None, g, weight, maximum
            )
            for b, g, maximum in triples
        ]

    def added():
        return [
            arithmetic.plus(
                None if b is None else tf.convert_to_tensor(arithmetic.raw(b)),
                g,
                weight,
                maximum,
            )
            for b, g, maximum in triples
        ]

    totals = iter(tf.cond(empty, alone, added) if triples else [])
    sums = [None if g is None else next(totals) for g in grads]
    if count is None:
        count = 1.0 if weight is None else weight
    if samples is not None:
        sample_sum = sample_sum + tf.cast(samples, tf.float32)
    return sums, weight_sum + tf.cast(count, tf.float32), sample_sum


def join_parts(groups: list[Group], sums: list) -> tuple[list, list]:
    """``groups`` and their ``(sums, weight_sum, samples)`` with every part
    (see :meth:`Engine.part`) folded into the leader's: the leader's entry
    becomes the sum of the means, with weight sum 1. Without parts, as given."""
    joined = [i for i, g in enumerate(groups) if g.accumulator.joins]
    if not joined:
        return groups, sums
    leader, (grads, weight_sum, samples) = groups[0], sums[0]
    mean = arithmetic.divide(
        grads, leader.variables, tf.math.divide_no_nan(1.0, weight_sum)
    )
    index = {arithmetic.var_key(v): i for i, v in enumerate(leader.variables)}
    for i in joined:
        part_sums, part_weight, _ = sums[i]
        # A total of 0 (every entry of the cycle masked) contributes
        # nothing, as the big batch's divide-no-NaN reduction does.
        inverse = tf.math.divide_no_nan(1.0, part_weight)
        for variable, part_sum in zip(groups[i].variables, part_sums):
            if part_sum is None:
                continue
            at = index[arithmetic.var_key(variable)]
            term = part_sum * inverse
            mean[at] = term if mean[at] is None else mean[at] + term
    kept = [i for i in range(1, len(groups)) if i not in joined]
    return (
        [leader, *(groups[i] for i in kept)],
        [(mean, tf.constant(1.0), samples), *(sums[i] for i in kept)],
    )


def reset(groups: list[Group]) -> None:
    # The buffers keep their contents; `empty` makes the next add overwrite.
    for group in groups:
        state = group.accumulator.state
        arithmetic.raw(state.weight_sum).assign(0.0)
        arithmetic.raw(state.sample_sum).assign(0.0)
        arithmetic.raw(state.overflows).assign(0.0)
        arithmetic.raw(state.empty).assign(True)


def zero(groups: list[Group]) -> None:
    # A dropped cycle's sums may hold NaN or Inf: leave nothing of it behind.
    for group in groups:
        for buffer in group.accumulator.state.grad_sums:
            arithmetic.raw(buffer).assign(tf.zeros(buffer.shape, buffer.dtype))
