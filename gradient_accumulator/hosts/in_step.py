"""In-step micro-batching in the model wrapper (``micro_batch_size``, Keras
3): each batch ``fit`` gives ``train_step`` is cut into slices, run one
after another inside the step with their gradients accumulated."""

from __future__ import annotations

import functools

import tensorflow as tf

from gradient_accumulator.core.weighting import loss_share
from gradient_accumulator.hosts import loss_scale
from gradient_accumulator.hosts.micro_batch import batch_size, first


def in_step_train_step(model, data):
    """One ``fit`` step of ``model`` (a ``ModelHost``) = the batch cut into
    ``micro_batch_size`` slices, accumulated one after another, then one
    micro-step of the cycle.

    The full slices run in a ``tf.while_loop`` with
    ``parallel_iterations=1``, so only one slice's activations and
    gradients are alive at a time; a short remainder slice (a batch not
    divisible by the slice size) runs after the loop, in a ``tf.cond``.
    Slices are added to the replica-local sums only (``Accumulator.add``:
    no communication, no ``merge_call``, hence legal in a loop body under
    a strategy), which ``open_sums`` readies once before the loop; the one
    ``end_micro_step`` after them decides, all-reduces and applies. Full
    slices have the static size ``micro_batch_size`` and the remainder's
    size derives from the batch's shape only, which keeps every slice
    shape a compile-time constant under XLA.
    """
    flavour = model._flavour
    accumulator = model._accumulator
    size = model._accumulation_settings.micro_batch_size
    x, y, sample_weight = flavour.keras.utils.unpack_x_y_sample_weight(data)
    batch = batch_size(x)
    full = batch // size
    # A subclassed model called outside fit may build its variables (and
    # so the sums) only in its first slice: its adds clear the sums.
    opened = accumulator.built
    if opened:
        accumulator.open_sums(model.trainable_variables)
    # Which variables get gradients is structural: the same in every
    # slice, recorded when the slice is traced (run, when eager).
    present: list[list[bool]] = []

    run_slice = functools.partial(
        _run_slice, model, (x, y, sample_weight), batch, opened, present
    )

    def body(i, loss_sum, denominator):
        loss, share = run_slice(i * size, size)
        return i + 1, loss_sum + loss, denominator + share

    zero = tf.constant(0.0)
    _, loss_sum, denominator = tf.while_loop(
        lambda i, *_: i < full,
        body,
        (tf.constant(0, batch.dtype), zero, zero),
        parallel_iterations=1,
    )

    def remainder():
        # Sizes from the batch's shape inside the branch (not captured
        # tensors), so that XLA sees them as constants.
        n = batch_size(x)
        start = n // size * size
        return run_slice(start, n - start)

    # A batch whose known size the slices divide has no remainder to
    # trace: traced with a static size of 0, its loss would be of shape
    # (0,), which Keras leaves unreduced, and adding a regularisation
    # penalty to it fails.
    static = first(x).shape[0]
    if static is not None and static % size == 0:
        loss, share = zero, zero
    else:
        loss, share = tf.cond(batch > full * size, remainder, lambda: (zero, zero))
    _end_step(model, batch, loss_sum + loss, denominator + share, present[0])
    return model._with_progress(model.get_metrics_result())


def _end_step(model, batch, loss_sum, denominator, present) -> None:
    """Logs the step's loss and ends its micro-step of the cycle."""
    model._flavour.loss_tracker(model).update_state(
        tf.math.divide_no_nan(loss_sum, denominator), sample_weight=batch
    )
    variables = model.trainable_variables
    on_apply, on_skip = loss_scale.scale_hooks(model._flavour, model.optimizer)
    model._accumulator.end_micro_step(
        variables,
        present,
        # The state changes wait for the step's data (see end_micro_step).
        after=[loss_sum, denominator],
        apply_fn=model._apply_fn(variables),
        on_apply=on_apply,
        on_skip=on_skip,
    )


def _run_slice(model, data, batch, opened, present, start, length):
    """Accumulates the slice ``start:start + length`` of the step's
    ``data`` (``batch`` samples); returns its loss times its weight and its
    share of the step's loss denominator."""
    accumulator = model._accumulator
    x, y, sample_weight = data
    pick = functools.partial(_slice, start=start, length=length)
    xs, ys, ws = (tf.nest.map_structure(pick, t) for t in (x, y, sample_weight))
    opens_step = tf.equal(start, 0)
    micro = model._micro_batch_pass(
        xs, ys, ws, opens_step=opens_step, step_samples=batch
    )
    model._add_parts(micro)
    present.append(
        accumulator.add(
            micro.grads,
            micro.variables,
            weight=micro.grad_weight,
            count=micro.count,
            samples=micro.samples,
            empty=False if opened else None,
            overflowed=micro.overflowed,
        )
    )
    # Keras' stateful metrics keep additive totals (sums and counts,
    # confusion counts), so updating them slice by slice equals one
    # update with the whole batch.
    model.compute_metrics(xs, ys, micro.y_pred, sample_weight=ws)
    loss = tf.cast(micro.loss, tf.float32)
    # This slice's share of the batch's loss: loss * weight summed
    # over slices, divided by the batch's denominator, is the batch's
    # loss (for a "sum" reduction the denominator is 1 per batch).
    share = loss_share(micro.sums, micro.count, opens_step)
    # reduce_sum: scalars of a known shape (loop variables must keep
    # theirs), also from a traced but never run empty remainder.
    return (
        tf.reduce_sum(loss * tf.cast(micro.weight, tf.float32)),
        tf.reduce_sum(share),
    )


def _slice(tensor, start, length):
    """Rows ``start:start + length`` of ``tensor`` (None stays None)."""
    if tensor is None:
        return None
    if isinstance(length, int):
        # The loop's full slices: a gather has the static size ``length``
        # even where XLA compiles the loop body for a batch shorter than
        # that (the body then never runs, but a slice would not compile).
        return tf.gather(tensor, start + tf.range(length, dtype=start.dtype))
    rank = tensor.shape.rank
    return tf.slice(tensor, [start] + [0] * (rank - 1), [length] + [-1] * (rank - 1))
