"""A micro-batch's loss-scaled backward pass, recomputed at a smaller seed
when it overflows: plain TensorFlow, no Keras.

Under ``mixed_float16`` a micro-batch's weight gradients are sums over its
own samples. Where the big batch's samples cancel, a micro-batch's may not,
so its float16 backward pass can overflow at a loss scale the big batch
survives; skipping the whole cycle for it would drop an update the big batch
applies. :func:`finite_gradients` instead differentiates the same tape again
with the seed halved until the gradients are finite, and says which seed it
used, so the caller unscales by it: the float32 sums stay exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf


def finite_gradients(
    tape: tf.GradientTape,
    target: tf.Tensor,
    sources: Sequence,
    scale: tf.Tensor,
    retries: int = 8,
    floor: float = 1.0,
) -> tuple[list, tf.Tensor]:
    """``(grads, factor)``: the gradients of ``factor * target`` with respect
    to ``sources``, ``target`` being a loss already multiplied by the loss
    scale ``scale``.

    ``factor`` is 1 when those of ``target`` itself are finite (one backward
    pass, as ``tape.gradient``). Otherwise the backward pass is run again
    from the same forward pass (``tape`` must be persistent) with ``factor``
    halved each time, until the gradients are finite, ``retries`` passes
    were made, or ``scale * factor`` would go below ``floor``; the last
    attempt is returned, non-finite when none was finite. ``factor`` is a
    power of two, so dividing by it is exact. Gradients that are None stay
    None. The default, 8 halvings, rescues a micro-batch up to 256 times
    larger than float16 holds at ``scale``; a NaN from the data costs at
    most that many passes before its cycle is skipped.
    """
    grads = list(tape.gradient(target, sources))
    present = [i for i, g in enumerate(grads) if g is not None]
    first = [grads[i] for i in present]
    one = tf.constant(1.0, tf.float32)
    scale = tf.cast(scale, tf.float32)

    def retry():
        lowest = tf.maximum(
            2.0 * floor / scale, tf.pow(0.5, tf.cast(retries, tf.float32) - 1.0)
        )

        def more(factor, finite, _):
            return tf.logical_and(tf.logical_not(finite), factor >= lowest)

        def again(factor, _, __):
            factor = factor / 2.0
            seed = tf.fill(tf.shape(target), tf.cast(factor, target.dtype))
            redone = tape.gradient(target, sources, output_gradients=seed)
            redone = [redone[i] for i in present]
            return factor, _all_finite(redone), redone

        factor, _, redone = tf.while_loop(
            more, again, (one, tf.constant(False), first), parallel_iterations=1
        )
        return factor, redone

    # Without overflow this costs one finite check; the retry runs only when
    # this micro-batch overflowed. Its branch reads the forward pass's
    # tensors, which therefore outlive the first backward pass (until the
    # check), not only as far as it needs them.
    factor, kept = tf.cond(_all_finite(first), lambda: (one, first), retry)
    for i, grad in zip(present, kept):
        grads[i] = grad
    return grads, factor


def _all_finite(grads: Sequence) -> tf.Tensor:
    if not grads:
        return tf.constant(True)
    checks = [
        tf.reduce_all(
            tf.math.is_finite(g.values if isinstance(g, tf.IndexedSlices) else g)
        )
        for g in grads
    ]
    return tf.reduce_all(tf.stack(checks))
