"""tf-keras ``GradientAccumulateModel`` against plain tf-keras on the big batch.

The reference is always a plain ``tf_keras.Model`` built from the same seed
(same initial weights) and trained with ``fit(batch_size=B * K,
shuffle=False)`` in float32; the accumulating run is
``GradientAccumulateModel(accum_steps=K, inputs=..., outputs=...)`` over the
same layers, trained with ``fit(batch_size=B, shuffle=False)``. Its weights
must end within ``utils.ATOL`` of the reference's, after the same number of
optimizer updates. Every test also checks that training moved the weights, so
none can pass by comparing two untouched models.
"""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from gradient_accumulator import GradientAccumulateModel
from tests.keras2 import utils
from tests.keras2.utils import EPOCHS, UPDATES, B, K, N


def _pair(
    make_optimizer,
    x,
    y,
    *,
    layers=utils.mlp_layers,
    accum_steps=K,
    epochs=EPOCHS,
    reference_batch=B * K,
    make_loss=utils.sparse_ce,
    compile_kwargs=None,
    model_kwargs=None,
    **fit_kwargs,
):
    """Trains the big-batch reference and the accumulating model (micro-batches
    of B); returns (initial weights, reference, accumulated)."""
    initial, reference = utils.big_batch(
        make_optimizer,
        x,
        y,
        layers=layers,
        batch_size=reference_batch,
        epochs=epochs,
        make_loss=make_loss,
        compile_kwargs=compile_kwargs,
        **fit_kwargs,
    )
    accumulated = utils.seeded(
        lambda: utils.accumulating_model(
            layers, accum_steps=accum_steps, **model_kwargs or {}
        )
    )
    assert isinstance(accumulated, tf_keras.Model)
    assert utils.max_abs_diff(initial, utils.weights(accumulated)) == 0.0
    accumulated.compile(
        optimizer=make_optimizer(), loss=make_loss(), **compile_kwargs or {}
    )
    utils.fit(accumulated, x, y, B, epochs=epochs, **fit_kwargs)
    return initial, reference, accumulated


def _current_learning_rate(optimizer) -> float:
    if isinstance(optimizer, utils.legacy.Optimizer):
        return float(optimizer._decayed_lr(tf.float32))
    return float(optimizer.learning_rate)


# ---------------------------------------------------------------- optimizers
def test_digits_adam_matches_big_batch():
    """The same on real data: scikit-learn's 8x8 digits, 10 classes."""
    x, y = utils.digits_data()
    layers = functools.partial(utils.mlp_layers, inputs_dim=64, classes=10)
    initial, reference, accumulated = _pair(
        utils.OPTIMIZERS["adam"], x, y, layers=layers
    )
    utils.assert_equivalent(initial, reference, accumulated, UPDATES)


# ------------------------------------------------------------ exact weighting
LENGTHS = utils.PADDED_LENGTHS


@pytest.mark.parametrize(
    ("n", "reference_batch"), [(N, B * K), (36, B * K)], ids=["64", "36"]
)
def test_two_outputs_two_losses_loss_weights(n, reference_batch):
    """Two outputs, a loss each and loss_weights match the big batch, also with
    a short last cycle (36 samples: 32, then 4 flushed at the end of fit)."""
    x, y = utils.two_output_data(n)

    def losses():
        return {"cls": utils.sparse_ce(), "reg": tf_keras.losses.MeanSquaredError()}

    adam = lambda: tf_keras.optimizers.Adam(0.01)  # noqa: E731
    initial, reference, accumulated = _pair(
        adam,
        x,
        y,
        layers=utils.two_output_layers,
        make_loss=losses,
        compile_kwargs={"loss_weights": {"cls": 1.0, "reg": 0.3}},
        reference_batch=reference_batch,
        epochs=1 if n % (B * K) else EPOCHS,
    )
    updates = (1 if n % (B * K) else EPOCHS) * -(-n // reference_batch)
    utils.assert_equivalent(initial, reference, accumulated, updates)


def _regression_layers():
    return utils.mlp_layers(classes=1)


def _sum_mse():
    return tf_keras.losses.MeanSquaredError(reduction="sum")


@pytest.mark.parametrize("n", [N, 36])
def test_sum_reduced_loss_matches_big_batch(n):
    """A loss compiled with reduction="sum": the big batch's loss is the sum of
    the micro-batches' sums (also for a flushed short cycle of 4)."""
    x, _ = utils.classification_data(n)
    y = np.random.default_rng(5).normal(size=(n, 1)).astype("float32")
    epochs = EPOCHS if n % (B * K) == 0 else 1
    sgd = lambda: tf_keras.optimizers.SGD(0.005)  # noqa: E731
    initial, reference, accumulated = _pair(
        sgd, x, y, layers=_regression_layers, make_loss=_sum_mse, epochs=epochs
    )
    utils.assert_equivalent(initial, reference, accumulated, epochs * -(-n // (B * K)))
    # Non-vacuity: averaging the micro-batch sums would step K times shorter.
    _, averaged = utils.big_batch(
        lambda: tf_keras.optimizers.SGD(0.005 / K),
        x,
        y,
        layers=_regression_layers,
        make_loss=_sum_mse,
        epochs=epochs,
    )
    assert utils.max_abs_diff(utils.weights(averaged), utils.weights(reference)) > 1e-3


@pytest.mark.parametrize("n", [N, 36])
def test_kernel_regularizer_counts_once_per_update(n):
    """An L2 kernel_regularizer: the big batch adds the penalty once per update,
    not once per micro-batch (also for a flushed short cycle)."""
    x, y = utils.classification_data(n)
    epochs = EPOCHS if n % (B * K) == 0 else 1
    sgd = lambda: tf_keras.optimizers.SGD(0.2)  # noqa: E731
    initial, reference, accumulated = _pair(
        sgd, x, y, layers=utils.regularized_layers, epochs=epochs
    )
    assert accumulated.losses, "no regularization loss"
    utils.assert_equivalent(initial, reference, accumulated, epochs * -(-n // (B * K)))
    _, unregularized = utils.big_batch(sgd, x, y, epochs=epochs)
    gap = utils.report(
        utils.max_abs_diff(utils.weights(unregularized), utils.weights(reference)),
        "non-vacuity gap",
    )
    assert gap > 1e-3, f"the regularizer did not matter ({gap:.3g})"


# ------------------------------------------------------ short micro-batches
def _short_case(case: str, n: int):
    if case == "masked":
        x, y = utils.padded_sequences(LENGTHS[:n], seed=5)
        return utils.sequence_layers, x, y, None
    x, y = utils.classification_data(n)
    sample_weight = None
    if case == "sample_weight":
        sample_weight = np.random.default_rng(6).uniform(0.1, 3.0, n).astype("float32")
    return utils.mlp_layers, x, y, sample_weight


@pytest.mark.parametrize("case", ["mlp", "sample_weight", "masked"])
def test_short_last_cycle_flushed_at_end_of_fit(case):
    """36 samples, micro-batches of 8, K=4: one update of 32, then a partial
    cycle of 4 flushed at the end of fit (the default), which is exactly the
    big batch's last batch of 4 (batch_size=32 on the same 36 samples)."""
    layers, x, y, sample_weight = _short_case(case, 36)
    sgd = lambda: tf_keras.optimizers.SGD(0.5)  # noqa: E731
    initial, reference, accumulated = _pair(
        sgd, x, y, layers=layers, epochs=1, sample_weight=sample_weight
    )
    utils.assert_equivalent(initial, reference, accumulated, 2)
    assert accumulated._accumulator.pending == 0


@pytest.mark.parametrize("case", ["mlp", "sample_weight", "masked"])
def test_short_micro_batch_inside_a_cycle(case):
    """28 samples: one cycle of micro-batches 8, 8, 8, 4 equals one big batch of
    28; the short micro-batch counts 4/28 of the update, not 1/4 (the naive
    equal-weight mean is measurably off)."""
    layers, x, y, sample_weight = _short_case(case, 28)
    lr = 0.5
    sgd = lambda: tf_keras.optimizers.SGD(lr)  # noqa: E731
    initial, reference, accumulated = _pair(
        sgd,
        x,
        y,
        layers=layers,
        reference_batch=28,
        epochs=3,
        sample_weight=sample_weight,
    )
    utils.assert_equivalent(initial, reference, accumulated, 3)
    naive = utils.naive_sgd_step(layers, x, y, lr, B, sample_weight=sample_weight)
    _, once = utils.big_batch(
        sgd, x, y, layers=layers, batch_size=28, epochs=1, sample_weight=sample_weight
    )
    gap = utils.report(
        utils.max_abs_diff(naive, utils.weights(once)), "non-vacuity gap"
    )
    assert gap > 100 * utils.ATOL, f"naive mean is only {gap:.3g} off"


# ------------------------------------------------------------ partial cycles
def test_partial_cycle_flush_each_epoch():
    """partial_cycle="flush": each epoch of 36 is an update of 32 and one of 4,
    as the big batch's epochs are."""
    x, y = utils.classification_data(36)
    adam = lambda: tf_keras.optimizers.Adam(0.01)  # noqa: E731
    initial, reference, accumulated = _pair(
        adam, x, y, model_kwargs={"partial_cycle": "flush"}
    )
    utils.assert_equivalent(initial, reference, accumulated, 2 * EPOCHS)


def test_partial_cycle_drop():
    """partial_cycle="drop" discards the 4-sample partial cycle of each epoch:
    the big batch trained on the first 32 of the 36 samples."""
    x, y = utils.classification_data(36)
    adam = lambda: tf_keras.optimizers.Adam(0.01)  # noqa: E731
    initial, reference = utils.big_batch(adam, x[:32], y[:32])
    accumulated = utils.seeded(
        lambda: utils.accumulating_model(accum_steps=K, partial_cycle="drop")
    )
    accumulated.compile(optimizer=adam(), loss=utils.sparse_ce())
    utils.fit(accumulated, x, y, B, epochs=EPOCHS)
    assert accumulated._accumulator.pending == 0
    utils.assert_equivalent(initial, reference, accumulated, EPOCHS)


def test_flush_at_end_false_leaves_partial_cycle_pending():
    """flush_at_end=False: after fit on 36 samples the 4-sample cycle is still
    pending (weights as the big batch after its first update only); an
    explicit flush() then gives the big batch's second update."""
    x, y = utils.classification_data(36)
    adam = lambda: tf_keras.optimizers.Adam(0.01)  # noqa: E731
    initial, first = utils.big_batch(adam, x[:32], y[:32], epochs=1)
    accumulated = utils.seeded(
        lambda: utils.accumulating_model(accum_steps=K, flush_at_end=False)
    )
    accumulated.compile(optimizer=adam(), loss=utils.sparse_ce())
    utils.fit(accumulated, x, y, B)
    assert accumulated._accumulator.pending == 1
    utils.assert_equivalent(initial, first, accumulated, 1)

    accumulated.flush()
    assert accumulated._accumulator.pending == 0
    _, both = utils.big_batch(adam, x, y, epochs=1)
    utils.assert_equivalent(initial, both, accumulated, 2)


# --------------------------------------------------------------------- input
@pytest.mark.parametrize(
    ("n", "cycles"),
    [
        (N, [(0, 32), (32, 64), (64, 96), (96, 128)]),
        (36, [(0, 32), (32, 60), (60, 72)]),
    ],
    ids=["64", "36-carry"],
)
def test_unknown_length_dataset_matches_numpy(n, cycles):
    """A tf.data.Dataset of unknown cardinality trains as numpy input does,
    and as plain tf-keras on the big batches: with 36 samples and
    ``partial_cycle="carry"`` (the default's epoch ends: tests/both/
    test_partial_cycles.py) the cycles carry
    across the epoch boundary (epoch 1 ends with 4 samples, completed by 24
    of epoch 2: a batch of 28), and the 12 left at the end of fit are
    flushed. ``cycles``: the reference's batches of the epochs concatenated."""
    x, y = utils.classification_data(n)
    adam = lambda: tf_keras.optimizers.Adam(0.01)  # noqa: E731

    reference = utils.seeded(utils.plain_model)
    initial = utils.weights(reference)
    reference.compile(optimizer=adam(), loss=utils.sparse_ce())
    xx, yy = np.concatenate([x] * EPOCHS), np.concatenate([y] * EPOCHS)
    for start, stop in cycles:
        reference.train_on_batch(xx[start:stop], yy[start:stop])

    runs = []
    for data, batch_size in (((x, y), B), ((utils.unknown_length(x, y, B),), None)):
        model = utils.seeded(
            lambda: utils.accumulating_model(accum_steps=K, partial_cycle="carry")
        )
        model.compile(optimizer=adam(), loss=utils.sparse_ce())
        utils.fit(model, *data, batch_size=batch_size, epochs=EPOCHS)
        utils.assert_equivalent(initial, reference, model, len(cycles))
        runs.append(utils.weights(model))
    utils.report(utils.assert_same_weights(*runs, atol=1e-7), "dataset vs numpy")


# ---------------------------------------------------------- weights and API
def test_weights_are_the_plain_models():
    """model.weights, get_weights() and count_params() are the plain model's,
    before and after training (the accumulation state is not among them), and
    set_weights(plain.get_weights()) round-trips."""
    plain = utils.seeded(utils.plain_model)
    model = utils.seeded(lambda: utils.accumulating_model(accum_steps=K))

    def check():
        assert len(model.weights) == len(plain.weights) == 4
        assert [w.shape for w in model.weights] == [w.shape for w in plain.weights]
        assert [w.name.split("/")[-1] for w in model.weights] == [
            w.name.split("/")[-1] for w in plain.weights
        ]
        assert len(model.trainable_weights) == len(plain.trainable_weights)
        assert len(model.non_trainable_weights) == len(plain.non_trainable_weights)
        assert len(model.get_weights()) == len(plain.get_weights())
        assert model.count_params() == plain.count_params() == 8 * 16 + 16 + 16 * 3 + 3

    check()
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)
    model.compile(optimizer="adam", loss=utils.sparse_ce())
    x, y = utils.classification_data()
    utils.fit(model, x, y, B)
    assert model._accumulator.built
    check()

    model.set_weights(plain.get_weights())
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(model.weights, plain.weights):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_non_finite_micro_batch_skips_its_whole_cycle():
    """A NaN input in one micro-batch of the second of three cycles: that cycle
    is skipped whole (weights after it bit-for-bit those before it, finite,
    Adam's state untouched), the third cycle trains normally: the big batch
    trained on cycles 1 and 3 only."""
    x, y = utils.classification_data(3 * B * K)
    x[B * K + B + 3, 2] = np.nan  # cycle 2, micro-batch 2
    adam = lambda: tf_keras.optimizers.Adam(0.01)  # noqa: E731

    initial, reference = utils.big_batch_without_the_middle_cycle(adam, x, y)

    model = utils.seeded(lambda: utils.accumulating_model(accum_steps=K))
    model.compile(optimizer=adam(), loss=utils.sparse_ce())
    utils.fit_skipping_the_middle_cycle(model, x, y, initial)
    utils.assert_equivalent(initial, reference, model, 2)


@pytest.mark.parametrize(
    ("accum_steps", "error"), [(0, ValueError), (1.5, TypeError), ("4", TypeError)]
)
def test_accum_steps_is_validated(accum_steps, error):
    with pytest.raises((ValueError, TypeError), match="accum_steps") as info:
        utils.accumulating_model(accum_steps=accum_steps)
    assert isinstance(info.value, error)


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "legacy_adam"])
def test_accum_steps_one_is_plain_tf_keras(optimizer):
    """accum_steps=1 trains exactly as the plain model (same batch size)."""
    x, y = utils.classification_data()
    make = utils.OPTIMIZERS[optimizer]
    initial, reference = utils.big_batch(make, x, y, batch_size=B)
    model = utils.seeded(lambda: utils.accumulating_model(accum_steps=1))
    model.compile(optimizer=make(), loss=utils.sparse_ce())
    utils.fit(model, x, y, B, epochs=EPOCHS)
    utils.assert_trained(initial, utils.weights(model))
    diff = utils.assert_same_weights(
        utils.weights(model), utils.weights(reference), 1e-7
    )
    utils.report(diff)
    assert int(model.optimizer.iterations) == EPOCHS * N // B


def test_keras3_model_class_is_not_the_tf_keras_one():
    """Guard of the set-up: with TF_USE_LEGACY_KERAS=1 the package exports the
    tf-keras host, not the Keras 3 one."""
    assert issubclass(GradientAccumulateModel, tf_keras.Model)
    assert not issubclass(GradientAccumulateModel, keras.Model)


def test_a_keras_3_model_given_to_the_tf_keras_classes_is_named():
    """Keras 3 code run with TF_USE_LEGACY_KERAS=1 fails at once with a
    message naming both Kerases and the switch (before: tf-keras'
    "'KerasTensor' object has no attribute 'node'")."""
    from gradient_accumulator import accumulate, replace_batchnorm_layers, verify

    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(1)(inputs)
    model = keras.Model(inputs, outputs)
    for call in (
        lambda: GradientAccumulateModel(accum_steps=2, inputs=inputs, outputs=outputs),
        lambda: accumulate(model, accum_steps=2),
        lambda: replace_batchnorm_layers(model),
        lambda: verify(lambda: model, np.ones((96, 4)), np.ones((96, 1)), loss="mse"),
    ):
        with pytest.raises(TypeError, match=r"is Keras 3 \(keras\)") as error:
            call()
        assert "the tf-keras (tf_keras, legacy Keras 2) ones" in str(error.value)
        assert "unset TF_USE_LEGACY_KERAS" in str(error.value)


def test_micro_batch_size_is_refused_at_construction():
    """tf-keras has no in-step micro-batching: the argument is named at
    construction (before: tf-keras' "Keyword argument not understood")."""
    inputs = tf_keras.Input((4,))
    outputs = tf_keras.layers.Dense(1)(inputs)
    with pytest.raises(TypeError, match=r"`micro_batch_size`.*not available"):
        GradientAccumulateModel(micro_batch_size=2, inputs=inputs, outputs=outputs)
