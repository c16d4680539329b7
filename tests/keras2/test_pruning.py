"""TensorFlow Model Optimization's pruning under accumulation: with
``PruningStepPerUpdate`` in place of TF-MOT's ``UpdatePruningStep``, the
model wrapper, ``accumulate()`` (under a ``LossScaleOptimizer`` too) and the
optimizer wrapper prune as plain tf-keras does on the big batch:
the same masks, the same steps, the weights within round-off; with TF-MOT's
own callback they do not (its schedule runs ``accum_steps`` times too fast).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_model_optimization as tfmot
import tf_keras

from gradient_accumulator import (
    GradientAccumulateModel,
    GradientAccumulateOptimizer,
    PruningStepPerUpdate,
    accumulate,
)
from gradient_accumulator.keras2 import _compat

sparsity = tfmot.sparsity.keras

B, K, UPDATES = 8, 4, 8
ATOL = 2e-5
SCHEDULES = {
    # Sparsity rises from update 2 to 6, masks recomputed every 2nd update.
    "polynomial": lambda: sparsity.PolynomialDecay(
        0.0, 0.6, begin_step=2, end_step=6, frequency=2
    ),
    "constant": lambda: sparsity.ConstantSparsity(0.5, begin_step=3, frequency=2),
}
OPTIMIZERS = {
    "sgd": lambda: tf_keras.optimizers.SGD(0.1),
    "adam": lambda: tf_keras.optimizers.Adam(0.01),
}


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B * K * UPDATES, 12)).astype("float32")
    y = (x[:, :3].sum(axis=1) > 0).astype("int64") + (x[:, 3] > 0)
    return x, y


def _pruned(schedule: str):
    """Inputs and outputs of a seeded MLP with two pruned Dense layers."""
    tf_keras.utils.set_random_seed(1)
    inputs = tf_keras.Input((12,))
    hidden = sparsity.prune_low_magnitude(
        tf_keras.layers.Dense(16, activation="tanh"),
        pruning_schedule=SCHEDULES[schedule](),
    )(inputs)
    outputs = sparsity.prune_low_magnitude(
        tf_keras.layers.Dense(3), pruning_schedule=SCHEDULES[schedule]()
    )(hidden)
    return inputs, outputs


def _loss():
    return tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _train(host: str, schedule: str, optimizer: str, callback) -> dict:
    """Trains one epoch; the model's weights, masks and pruning steps."""
    inputs, outputs = _pruned(schedule)
    make = OPTIMIZERS[optimizer]
    batch = B
    if host == "plain":
        model, opt, batch = tf_keras.Model(inputs, outputs), make(), B * K
    elif host == "model":
        model = GradientAccumulateModel(accum_steps=K, inputs=inputs, outputs=outputs)
        opt = make()
    elif host == "accumulate":
        model = accumulate(tf_keras.Model(inputs, outputs), accum_steps=K)
        # A power-of-two loss scale: exact in float32, as without it.
        opt = tf_keras.mixed_precision.LossScaleOptimizer(make(), initial_scale=2**8)
    else:  # the optimizer wrapper
        model = tf_keras.Model(inputs, outputs)
        opt = GradientAccumulateOptimizer(make(), accum_steps=K)
    model.compile(opt, _loss())
    x, y = _data()
    model.fit(x, y, batch_size=batch, shuffle=False, verbose=0, callbacks=[callback()])
    return _state(model)


def _state(model) -> dict:
    wrappers = [layer for layer in model.layers if _kind(layer) == "pruning"]
    assert len(wrappers) == 2
    return {
        "weights": [np.array(w) for w in model.get_weights()],
        "masks": [w.pruning_vars[0][1].numpy() for w in wrappers],
        "steps": [int(_compat.pruning_step(w)) for w in wrappers],
        "updates": int(model.optimizer.iterations),
    }


def _kind(layer):
    found = _compat.model_optimization(layer)
    return found and found[0]


@functools.cache
def _reference(schedule: str, optimizer: str) -> dict:
    """Plain tf-keras on the big batch with TF-MOT's own callback."""
    return _train("plain", schedule, optimizer, sparsity.UpdatePruningStep)


def _mask_mismatches(a: dict, b: dict) -> int:
    return sum(int(np.sum(m != n)) for m, n in zip(a["masks"], b["masks"]))


def _max_diff(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(v - w))) for v, w in zip(a["weights"], b["weights"]))


@pytest.mark.parametrize(
    "host, schedule, optimizer",
    [
        ("model", "polynomial", "sgd"),
        ("accumulate", "constant", "adam"),
        ("optimizer", "polynomial", "adam"),
    ],
)
def test_pruning_follows_the_updates(host, schedule, optimizer):
    big = _reference(schedule, optimizer)
    assert big["updates"] == UPDATES and big["steps"] == [UPDATES, UPDATES]
    # The schedule pruned within the run: some weights are masked.
    assert all(0.3 < float(np.mean(m == 0)) < 0.7 for m in big["masks"])
    ours = _train(host, schedule, optimizer, PruningStepPerUpdate)
    assert ours["updates"] == UPDATES
    assert ours["steps"] == big["steps"]
    assert _mask_mismatches(ours, big) == 0
    assert _max_diff(ours, big) <= ATOL


def test_tfmot_callback_under_accumulation_does_not_match():
    """The non-vacuity: the same run with TF-MOT's own callback advances the
    step per micro-batch, and the masks and weights differ."""
    big = _reference("polynomial", "sgd")
    theirs = _train("model", "polynomial", "sgd", sparsity.UpdatePruningStep)
    assert theirs["steps"] == [K * UPDATES, K * UPDATES]
    assert _mask_mismatches(theirs, big) > 0
    assert _max_diff(theirs, big) > 100 * ATOL


def test_on_a_plain_model_it_is_tfmots_callback():
    """One callback list serves both runs: without accumulation it prunes
    as ``UpdatePruningStep`` with a fresh optimizer, to the bit."""
    big = _reference("constant", "adam")
    ours = _train("plain", "constant", "adam", PruningStepPerUpdate)
    assert ours["steps"] == big["steps"]
    assert _mask_mismatches(ours, big) == 0
    for got, want in zip(ours["weights"], big["weights"]):
        np.testing.assert_array_equal(got, want)


def test_steps_per_execution_above_one_is_refused():
    """Keras calls back once per execution: the steps in between would each
    advance the pruning step."""
    model = tf_keras.Model(*_pruned("constant"))
    model.compile("sgd", _loss(), steps_per_execution=2)
    x, y = _data()
    with pytest.raises(ValueError, match="steps_per_execution=1"):
        model.fit(x, y, batch_size=B, verbose=0, callbacks=[PruningStepPerUpdate()])


def test_a_run_resumed_mid_cycle_stays_right(tmp_path):
    """Stopped after 6 micro-batches (mid-cycle, the masks due at the cycle's
    update), checkpointed, restored into a new model and trained on: the
    big batch's masks and weights (the callback keeps no state)."""
    x, y = _data()

    def model(**settings):
        inputs, outputs = _pruned("polynomial")
        wrapped = GradientAccumulateModel(
            accum_steps=K, inputs=inputs, outputs=outputs, **settings
        )
        wrapped.compile(OPTIMIZERS["sgd"](), _loss())
        return wrapped

    def fit(wrapped, start, stop):
        wrapped.fit(
            x[start:stop],
            y[start:stop],
            batch_size=B,
            shuffle=False,
            verbose=0,
            callbacks=[PruningStepPerUpdate()],
        )

    first = model(flush_at_end=False)
    fit(first, 0, 6 * B)
    assert int(first.optimizer.iterations) == 1
    path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).save(
        tmp_path / "ckpt"
    )
    resumed = model()
    resumed.optimizer.build(resumed.trainable_variables)
    tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).restore(
        path
    ).assert_existing_objects_matched()
    fit(resumed, 6 * B, len(x))
    ours, big = _state(resumed), _reference("polynomial", "sgd")
    assert ours["updates"] == UPDATES and ours["steps"] == big["steps"]
    assert _mask_mismatches(ours, big) == 0
    assert _max_diff(ours, big) <= ATOL
