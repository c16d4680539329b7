"""The default partial cycle trains like plain Keras with the big batch, in
each Keras: epoch by epoch when an epoch is a pass over finite data (its
last, short cycle applied, as plain Keras' last batch is short), and as
one stream of cycles when ``steps_per_epoch`` cuts the epochs from a
repeated dataset (as plain Keras' stream of big batches)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel
from tests.flavour import keras, utils

MICRO, ACCUM = 8, 4
BIG = MICRO * ACCUM


def models(**settings):
    """A plain model and a model wrapper with the same initial weights."""
    keras.utils.set_random_seed(0)
    plain = keras.Model(*utils.mlp_layers())
    inputs, outputs = utils.mlp_layers()
    ours = GradientAccumulateModel(ACCUM, inputs=inputs, outputs=outputs, **settings)
    ours.set_weights(plain.get_weights())
    for model in (plain, ours):
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return plain, ours


def batches(x, y, size, known_length):
    data = tf.data.Dataset.from_tensor_slices((x, y))
    if not known_length:
        data = data.filter(lambda *_: True)  # cardinality unknown
    return data.batch(size)


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))


@pytest.mark.parametrize("known_length", [True, False], ids=["known", "unknown"])
def test_default_equals_the_big_batch_epoch_by_epoch(known_length):
    """100 samples, micro-batches of 8, accum_steps 4, 2 epochs: plain Keras
    with batch_size=32 makes 4 updates an epoch (32, 32, 32, 4 samples);
    so does the default, from a pipeline of known or unknown length, and the
    weights agree. (The reference reads the known-length pipeline: Keras
    3.15's own fit counts, and takes, one more optimizer step an epoch on a
    dataset of unknown length, 10 in all here.)"""
    x, y = utils.classification_data(n=100)
    plain, ours = models()
    plain.fit(batches(x, y, BIG, known_length=True), epochs=2, verbose=0)
    ours.fit(batches(x, y, MICRO, known_length), epochs=2, verbose=0)
    assert int(plain.optimizer.iterations) == 8
    assert int(ours.optimizer.iterations) == 8
    diff = max_diff(ours.get_weights(), plain.get_weights())
    assert diff <= utils.ATOL, diff


def test_carry_keeps_the_behaviour_before_1_0():
    """``partial_cycle="carry"`` carries the short cycle into the next epoch
    (7 updates, not the big batch's 8): the old default, still there."""
    x, y = utils.classification_data(n=100)
    plain, ours = models(partial_cycle="carry")
    plain.fit(x, y, batch_size=BIG, epochs=2, shuffle=False, verbose=0)
    ours.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    assert int(ours.optimizer.iterations) == 7
    assert max_diff(ours.get_weights(), plain.get_weights()) > 1e-3


def test_default_carries_cycles_across_epochs_cut_by_steps_per_epoch():
    """A repeated dataset cut into epochs of 6 micro-batches (a cycle and a
    half) by ``steps_per_epoch``, 4 epochs: 6 cycles of one stream, as plain
    Keras' stream of big batches of 32 (3 per epoch, 2 epochs)."""
    x, y = utils.classification_data(n=96)
    plain, ours = models()
    stream = tf.data.Dataset.from_tensor_slices((x, y)).repeat()
    plain.fit(stream.batch(BIG), steps_per_epoch=3, epochs=2, verbose=0)
    ours.fit(stream.batch(MICRO), steps_per_epoch=6, epochs=4, verbose=0)
    assert int(plain.optimizer.iterations) == 6
    assert int(ours.optimizer.iterations) == 6
    diff = max_diff(ours.get_weights(), plain.get_weights())
    assert diff <= utils.ATOL, diff


def test_flush_at_end_false_keeps_the_last_short_cycle_pending():
    """``flush_at_end=False`` keeps what the last epoch leaves pending for a
    next ``fit`` (or a checkpoint); the epochs before it end as the big
    batch's. A ``flush()`` then completes the big batch's training."""
    x, y = utils.classification_data(n=100)
    plain, ours = models(flush_at_end=False)
    plain.fit(x, y, batch_size=BIG, epochs=2, shuffle=False, verbose=0)
    ours.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    assert int(ours.optimizer.iterations) == 7
    ours.flush()
    assert int(ours.optimizer.iterations) == 8
    diff = max_diff(ours.get_weights(), plain.get_weights())
    assert diff <= utils.ATOL, diff
