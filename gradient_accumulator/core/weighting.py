"""How much a micro-batch weighs, and what a cycle divides by: one function
per use, for every host.

The engine applies ``sum_k weight_k * g_k / sum_k count_k``. The big batch's
gradient is that sum exactly when each micro-batch's ``weight`` and
``count`` are its share of the denominator Keras' loss reduction divides the
big batch's loss by:

* mean reductions divide by the number of samples, of unmasked entries (a
  mask), or by the sum of the (masked) sample weights: the micro-batch's own
  denominator is both its weight and its count;
* ``"sum"`` and ``"none"`` do not divide: every micro-batch weighs 1 and the
  cycle's divisor is 1, so only the micro-batch that opens the cycle counts.

Terms that divide by different totals (tokens and sequences) form one
group each: the engine sums each group's gradients apart (``Engine.part``)
and divides each by its own total over the cycle, which is the big batch's
gradient, ``sum_j (sum_k S_jk) / (sum_k D_jk)``.

:func:`denominators` serves the model wrappers (streaming and in-step),
:func:`optimizer_weight` the optimizer wrapper, which sees only gradients.
A new normalisation is a new branch in :func:`_denominator`.
"""

from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from gradient_accumulator.core._tf_compat import keras_mask

_SUM_REDUCTIONS = ("sum", "none", None)


def _reduction(term):
    return getattr(term.loss, "reduction", "sum_over_batch_size")


def _denominator(term, y_pred, sample_weight, batch, merge_mask):
    """``(key, D)``: the denominator ``D`` Keras divides this loss term by on
    a micro-batch, and a key that is equal for two terms exactly when their
    denominators are the same quantity up to a constant factor (one sum of
    their gradients can then be weighted by either). ``key`` is ``"sum"``
    for a term that is not divided, ``"samples"`` for one divided by a
    multiple of the micro-batch's size, else names the mask and
    sample-weight tensors the denominator sums."""
    reduction = _reduction(term)
    if reduction in _SUM_REDUCTIONS:
        return "sum", None
    mask = keras_mask(at(y_pred, term.path))
    weights = (
        at(sample_weight, term.path)
        if tf.nest.is_nested(sample_weight)
        else sample_weight
    )
    if reduction == "mean_with_sample_weight" and weights is not None:
        # Keras divides by the sum of the (masked) sample weights; only Keras
        # 3 has this reduction, and its host says how it merges the two.
        merged = merge_mask(weights, mask)
        total = tf.reduce_sum(tf.cast(merged, tf.float32))
        return ("weights", _ref(mask), _ref(weights)), total
    if mask is not None:
        # Every mean reduction divides by the number of unmasked entries
        # (mean_with_sample_weight without sample weights: the mask's sum).
        return ("mask", _ref(mask)), tf.reduce_sum(tf.cast(mask, tf.float32))
    # The number of loss entries: a fixed multiple of the samples.
    return "samples", batch


def _ref(tensor):
    return None if tensor is None else tensor.ref()


@dataclass
class Denominator:
    """Loss terms the big batch divides by one total, and one micro-batch's
    ``weight`` (its gradients' factor) and ``count`` (its share of that
    total); ``terms``: their indices among the compiled loss terms."""

    terms: list[int]
    weight: tf.Tensor
    count: tf.Tensor
    sums: bool = False  # its terms are not divided (reduction "sum")


def _order(key) -> int:
    # The first group also carries what no term owns (regularisation, a
    # compute_loss override's extra terms): a "sum" group counts it once
    # per cycle, a "samples" group never has a total of 0.
    return {"sum": 0, "samples": 1}.get(key if isinstance(key, str) else "", 2)


def denominators(
    terms, y_pred, sample_weight, batch, opens_cycle, merge_mask=None, own=None
) -> list[Denominator]:
    """The micro-batch's loss terms grouped by what the big batch divides
    them by, each group with the micro-batch's weight and count (the
    engine applies ``sum_k weight_k * g_k / sum_k count_k`` per group).

    ``terms``: the compiled loss terms (``[]`` for a custom ``compute_loss``:
    one group, as :func:`own_denominator` says of ``own``, the model's
    ``loss_denominator``: None or ``"samples"``, ``"sum"``, or the value of
    its function); ``batch``: the micro-batch's number of samples;
    ``opens_cycle``: a function giving a bool tensor, True if this
    micro-batch opens its cycle (called only for summed terms, whose
    cycle divides by 1); ``merge_mask(weights, mask)``: the sample weights
    as Keras' ``"mean_with_sample_weight"`` reduction masks them (asked
    only for terms with that reduction). The first group is the one that
    should also carry whatever the loss holds beyond the terms (see
    :func:`_order`).
    """
    batch = tf.cast(batch, tf.float32)
    if not terms:
        return [own_denominator(own, batch, opens_cycle)]
    found = [_denominator(t, y_pred, sample_weight, batch, merge_mask) for t in terms]
    keys: list = []
    for key, _ in found:
        if key not in keys:
            keys.append(key)
    keys.sort(key=_order)
    groups = []
    for key in keys:
        members = [i for i, (k, _) in enumerate(found) if k == key]
        if key == "sum":
            # The big batch's loss is the plain sum of the micro-batches':
            # the divisor is 1 for the cycle, however many it holds.
            weight = tf.constant(1.0)
            count = _opened(opens_cycle)
        else:
            weight = count = found[members[0]][1]
        groups.append(Denominator(members, weight, count, key == "sum"))
    return groups


def own_denominator(own, batch, opens_cycle) -> Denominator:
    """The one group of a loss the model computes itself (no compiled loss
    term), as its ``loss_denominator`` (``own``) declares: a mean over the
    samples (None, ``"samples"``), a sum (``"sum"``: the cycle divides by 1,
    as for a ``"sum"`` reduction), or a mean over ``own`` entries (the value
    of the declared function on the micro-batch: tokens, valid pixels)."""
    if own is None or (isinstance(own, str) and own == "samples"):
        return Denominator([], batch, batch)
    if isinstance(own, str) and own == "sum":
        return Denominator([], tf.constant(1.0), _opened(opens_cycle), sums=True)
    own = tf.cast(own, tf.float32)
    if own.shape.rank not in (None, 0):
        raise ValueError(
            "`loss_denominator` must return a scalar, what the loss divides "
            f"the batch by. Received a value of shape {own.shape}."
        )
    own = tf.reshape(own, [])
    return Denominator([], own, own)


def _opened(opens_cycle):
    return tf.cast(opens_cycle(), tf.float32)


def loss_share(sums: bool, count, opens_step):
    """A slice's share of its step's loss denominator (for the logged loss
    of an in-step micro-batched step): its count, or for a summed loss
    (``sums``) 1 for the step's first slice."""
    if sums:
        return tf.cast(opens_step, tf.float32)
    return tf.cast(count, tf.float32)


def backward_share(sums: bool, cycle_length, part=None):
    """What a micro-batch's loss is multiplied by before a float16 backward
    pass: about its share of the cycle's samples, ``part / cycle_length``
    (``part``: a slice's share of its step, else 1). A mean over fewer
    samples gives each sample a larger part of the backward pass than it has
    in the big batch, by that factor; a summed loss (``sums``) has none, 1.
    Hosts unscale the gradients by the same factor."""
    if sums:
        return 1.0
    share = 1.0 / cycle_length
    return share if part is None else share * part


def optimizer_weight(reduction: str, replicas: int, scale, opens_cycle, share=None):
    """``(weight, count)`` of one call of the optimizer wrapper
    (``opens_cycle``: a function giving the engine's bool tensor).

    Every call counts equally. Keras divides each replica's loss by the
    replica count and expects the optimizer to sum replicas, so each call
    counts ``1 / replicas``; ``"SUM"`` makes the divisor 1 per cycle. A
    dynamic loss ``scale`` (or None) is undone by the weight, with the
    :func:`backward_share` the scaled loss was multiplied by (``share``: a
    function giving it, asked only under a scale; None: 1).
    """
    weight = None
    if scale is not None:
        weight = 1.0 / (scale * (1.0 if share is None else share()))
    count = 1.0 / replicas
    if reduction == "SUM":
        count = tf.cast(opens_cycle(), tf.float32) * count
    return weight, count


def at(structure, path):
    """The entry of a (nested) structure at ``path``, a loss term's output."""
    for key in path:
        structure = structure[key]
    return structure
