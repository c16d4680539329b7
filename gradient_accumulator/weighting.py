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

:func:`micro_batch_weight` serves the model wrapper (streaming and in-step),
:func:`optimizer_weight` the optimizer wrapper, which sees only gradients.
A new normalisation is a new branch in :func:`_denominator`.
"""

from __future__ import annotations

import tensorflow as tf

from gradient_accumulator._tf_compat import keras_mask

_SUM_REDUCTIONS = ("sum", "none", None)


def _reduction(term):
    return getattr(term.loss, "reduction", "sum_over_batch_size")


def _denominator(term, y_pred, sample_weight, batch):
    """``(key, D)``: the denominator ``D`` Keras divides this loss term by on
    a micro-batch, and a key that is equal for two terms exactly when their
    denominators are the same quantity up to a constant factor (the engine
    can then weight micro-batches by either). ``key`` is ``"sum"`` for a
    term that is not divided, ``"samples"`` for one divided by a multiple of
    the micro-batch's size, else names the mask and sample-weight tensors
    the denominator sums."""
    reduction = _reduction(term)
    if reduction in _SUM_REDUCTIONS:
        return "sum", None
    mask = keras_mask(_at(y_pred, term.path))
    weights = (
        _at(sample_weight, term.path)
        if tf.nest.is_nested(sample_weight)
        else sample_weight
    )
    if reduction == "mean_with_sample_weight" and weights is not None:
        # Keras divides by the sum of the (masked) sample weights. Only Keras
        # 3 has this reduction, so only its terms import it.
        from gradient_accumulator._keras_compat import apply_mask

        merged = apply_mask(weights, mask, dtype="float32", reduction=reduction)
        total = tf.reduce_sum(tf.cast(merged, tf.float32))
        # Several terms' weight sums are checked to agree at run time (Keras
        # gives every output its own copy of one sample_weight array).
        return ("weights", _ref(mask)), total
    if mask is not None:
        # Every mean reduction divides by the number of unmasked entries
        # (mean_with_sample_weight without sample weights: the mask's sum).
        return ("mask", _ref(mask)), tf.reduce_sum(tf.cast(mask, tf.float32))
    # The number of loss entries: a fixed multiple of the samples.
    return "samples", batch


def _same_weight_sums(terms, totals):
    """The first term's weight sum, after checking that every term's is the
    same (one sample_weight array for all outputs). A mismatch stops
    training with an error naming the outputs; where asserts do not run
    (XLA), it makes the cycle non-finite, so it is skipped, never applied."""
    first = totals[0]
    same = tf.reduce_all(tf.stack([tf.equal(t, first) for t in totals[1:]]))
    names = ", ".join("/".join(map(str, t.path)) or "0" for t in terms)
    check = tf.debugging.Assert(
        same,
        [
            "GradientAccumulateModel: the outputs "
            f"{names} use reduction=mean_with_sample_weight with different "
            "sample weights, so each would need its own divisor; exact "
            "accumulation needs the same sample weights for every output "
            "(one sample_weight array)."
        ],
    )
    with tf.control_dependencies([check]):
        return tf.where(same, first, tf.constant(float("nan")))


def _ref(tensor):
    return None if tensor is None else tensor.ref()


def _describe(key) -> str:
    if key == "sum":
        return "not divided (a sum)"
    if key == "samples":
        return "divided by the number of samples"
    if key[0] == "mask":
        return "divided by its number of unmasked entries"
    return "divided by the sum of its sample weights (masked)"


def _inexact_message(terms, found) -> str:
    lines = [
        f"  output {'/'.join(map(str, t.path)) or '0'!r}: "
        f"reduction={_reduction(t)!r}, {_describe(key)}"
        for t, (key, _) in zip(terms, found)
    ]
    return (
        "GradientAccumulateModel cannot accumulate this loss exactly: its "
        "terms are normalised by different denominators, and the big "
        "batch's gradient would need each term divided by its own total "
        "over the cycle, known only at the cycle's end:\n"
        + "\n".join(lines)
        + "\nExact combinations: every term reduced by 'sum' (or 'none'); or "
        "every term divided by the same quantity - the number of samples "
        "(mean reductions without masks, 'mean_with_sample_weight' without "
        "sample weights), the unmasked entries of one mask, or the sum of "
        "the same sample weights (one sample_weight array for all outputs, "
        "all of them 'mean_with_sample_weight'). Use one of these "
        "(e.g. reduction='sum' with a constant scale in loss_weights), or "
        "GradientAccumulateOptimizer, which averages micro-batch gradients."
    )


def sums_losses(terms) -> bool:
    """Whether the loss is a plain sum (every term reduced by "sum" or not
    reduced): the big batch's loss is then the micro-batches' sum."""
    return bool(terms) and all(_reduction(t) in _SUM_REDUCTIONS for t in terms)


def micro_batch_weight(terms, y_pred, sample_weight, batch, opens_cycle):
    """``(weight, count)`` of one micro-batch of the model wrapper.

    ``terms``: the compiled loss terms (``[]`` for a custom ``compute_loss``:
    samples are counted); ``batch``: the micro-batch's number of samples;
    ``opens_cycle``: a bool tensor, True if this micro-batch opens its cycle
    (read only for a summed loss; None otherwise).

    With several loss terms the engine's one divisor is exact only if every
    term's denominator is the same quantity up to a constant factor (see
    :func:`_denominator`); any other combination is refused here, when the
    first step is traced, naming the outputs and reductions.
    """
    batch = tf.cast(batch, tf.float32)
    if not terms:
        return batch, batch
    if sums_losses(terms):
        # The big batch's loss is the plain sum of the micro-batches': the
        # divisor is 1 for the cycle, however many micro-batches it holds.
        return tf.constant(1.0), tf.cast(opens_cycle, tf.float32)
    found = [_denominator(t, y_pred, sample_weight, batch) for t in terms]
    keys = {key for key, _ in found}
    if len(keys) > 1:
        raise ValueError(_inexact_message(terms, found))
    total = found[0][1]
    if len(found) > 1 and found[0][0][0] == "weights":
        total = _same_weight_sums(terms, [d for _, d in found])
    return total, total


def loss_share(terms, count, opens_step):
    """A slice's share of its step's loss denominator (for the logged loss
    of an in-step micro-batched step): its count, or for a summed loss 1
    for the step's first slice."""
    if sums_losses(terms):
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


def _at(structure, path):
    for key in path:
        structure = structure[key]
    return structure
