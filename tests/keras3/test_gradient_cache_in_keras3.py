"""``gradient_cache=True`` in Keras 3: the second forward pass of each
slice draws the first pass's random numbers (its layers' seed generators
are reset between the passes); XLA compiles the slice loops; and slicing
without the cache is not the whole batch (what the cache is for)."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.framework import config as tf_config

from gradient_accumulator import GradientAccumulateModel
from tests.both.test_gradient_cache import (
    SLICE,
    TOL,
    D,
    E,
    N,
    batches,
    fit_on_batches,
    in_batch_softmax,
    two_towers,
)
from tests.utils import max_abs_diff

LR = 0.5
CACHE = {"micro_batch_size": SLICE, "gradient_cache": True}


def _dropout_towers(wrapper=None, **settings):
    keras.utils.set_random_seed(3)
    query, candidate = keras.Input((D,)), keras.Input((D,))
    towers = []
    for inputs in (query, candidate):
        hidden = keras.layers.Dense(16, activation="tanh")(inputs)
        hidden = keras.layers.Dropout(0.5)(hidden)
        towers.append(keras.layers.Dense(E, use_bias=False)(hidden))
    outputs = keras.layers.Concatenate()(towers)
    if wrapper is None:
        return keras.Model([query, candidate], outputs)
    return wrapper(inputs=[query, candidate], outputs=outputs, **settings)


def _gradient(model, query, candidate, slices: int):
    """The gradient of the batch's in-batch softmax with the model run on
    ``slices`` consecutive slices in one tape (each slice its own dropout
    draw, in order)."""
    rows = len(query) // slices
    with tf.GradientTape() as tape:
        outputs = tf.concat(
            [
                model(
                    [
                        query[i * rows : (i + 1) * rows],
                        candidate[i * rows : (i + 1) * rows],
                    ],
                    training=True,
                )
                for i in range(slices)
            ],
            0,
        )
        loss = tf.reduce_mean(in_batch_softmax(None, outputs))
    return tape.gradient(loss, model.trainable_variables)


def test_dropout_masks_of_the_second_pass_are_the_first_passes():
    """One SGD step of the cached wrapper equals the step computed in one
    pass over the same slices with the same masks; the same slices with the
    next masks (what a second pass that draws anew would use) differ."""
    query, candidate, _, labels = batches()
    query, candidate, labels = query[:N], candidate[:N], labels[:N]
    cached = _dropout_towers(
        GradientAccumulateModel, micro_batch_size=SLICE, gradient_cache=True
    )
    start = cached.get_weights()
    cached.compile(optimizer=keras.optimizers.SGD(LR), loss=in_batch_softmax)
    cached.fit([query, candidate], labels, batch_size=N, shuffle=False, verbose=0)

    reference = _dropout_towers()
    same = _gradient(reference, query, candidate, N // SLICE)
    expected = [w - LR * g.numpy() for w, g in zip(start, same)]
    assert max_abs_diff(expected, cached.get_weights()) <= TOL
    # The reference's generators now stand where a second pass that drew
    # anew would start: its masks give another step.
    redrawn = _gradient(reference, query, candidate, N // SLICE)
    moved = [w - LR * g.numpy() for w, g in zip(start, redrawn)]
    assert max_abs_diff(moved, cached.get_weights()) > 100 * TOL


def test_slicing_without_the_cache_is_not_the_whole_batch():
    """The in-step mode alone sums each slice's own in-batch loss (8
    negatives instead of 32): measurably not the big batch."""
    plain, _ = fit_on_batches(two_towers(), in_batch_softmax, "sgd")
    sliced, _ = fit_on_batches(
        two_towers(GradientAccumulateModel, micro_batch_size=SLICE),
        in_batch_softmax,
        "sgd",
    )
    assert max_abs_diff(plain.get_weights(), sliced.get_weights()) > 100 * TOL
    assert np.isfinite(plain.get_weights()[0]).all()


def test_jit_compile_and_a_batch_the_slices_do_not_divide():
    """jit_compile=True (op determinism off: Keras refuses XLA with it):
    batches of 20 in slices of 8, the last slice padded; as plain Keras
    with XLA and batch_size=20."""
    query, candidate, weights, labels = batches()
    tf_config.disable_op_determinism()
    try:
        models = []
        for wrapper, settings in ((None, {}), (GradientAccumulateModel, CACHE)):
            model = two_towers(wrapper, **settings)
            model.compile(
                optimizer=keras.optimizers.Adam(1e-2),
                loss=in_batch_softmax,
                jit_compile=True,
            )
            model.fit(
                [query[:200], candidate[:200]],
                labels[:200],
                sample_weight=weights[:200],
                batch_size=20,
                shuffle=False,
                verbose=0,
            )
            assert model.jit_compile is True
            models.append(model)
    finally:
        tf.config.experimental.enable_op_determinism()
    plain, cached = models
    assert int(cached.optimizer.iterations) == 10
    assert max_abs_diff(plain.get_weights(), cached.get_weights()) <= TOL
