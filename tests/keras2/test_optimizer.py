"""tf-keras ``GradientAccumulateOptimizer`` against plain tf-keras on the big
batch.

The reference is always a plain ``tf_keras.Model`` built from the same seed
(same initial weights), compiled with the plain inner optimizer and trained
with ``fit(batch_size=B * K, shuffle=False)`` in float32; the accumulating run
is the same plain model compiled with ``GradientAccumulateOptimizer(inner,
accum_steps=K)`` and trained with ``fit(batch_size=B, shuffle=False)``. The
wrapper weighs its K calls equally, so the micro-batches here are equal. Its
``iterations`` (the inner optimizer's) count updates, not micro-batches.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from gradient_accumulator import GradientAccumulateOptimizer
from tests.keras2 import utils
from tests.keras2.utils import EPOCHS, UPDATES, B, K, N


def _accumulated(make_inner, x, y, *, layers=utils.mlp_layers, **wrapper_kwargs):
    """The plain model compiled with the wrapper around ``make_inner()`` and
    trained on micro-batches of B; returns (model, wrapper)."""
    model = utils.seeded(lambda: utils.plain_model(layers))
    wrapper = GradientAccumulateOptimizer(
        make_inner(), accum_steps=wrapper_kwargs.pop("accum_steps", K), **wrapper_kwargs
    )
    assert isinstance(wrapper, tf_keras.optimizers.Optimizer)
    model.compile(optimizer=wrapper, loss=utils.sparse_ce())
    utils.fit(model, x, y, B, epochs=EPOCHS)
    return model, wrapper


def _pair(make_inner, x=None, y=None, *, make_reference=None, **kwargs):
    """Trains the big-batch reference (``make_reference()``, by default
    ``make_inner()``) and the wrapped run; returns (initial weights,
    reference, accumulated model, wrapper)."""
    if x is None:
        x, y = utils.classification_data()
    layers = kwargs.get("layers", utils.mlp_layers)
    initial, reference = utils.big_batch(
        make_reference or make_inner, x, y, layers=layers
    )
    model, wrapper = _accumulated(make_inner, x, y, **kwargs)
    return initial, reference, model, wrapper


def _assert_equivalent(initial, reference, model, wrapper, updates=UPDATES) -> float:
    diff = utils.assert_equivalent(initial, reference, model, updates)
    assert model.optimizer is wrapper
    assert int(wrapper.iterations) == int(wrapper.inner_optimizer.iterations) == updates
    return diff


# ---------------------------------------------------------------- optimizers
@pytest.mark.parametrize("optimizer", list(utils.OPTIMIZERS))
def test_optimizer_matches_big_batch(optimizer):
    """fit(batch_size=B) with the wrapper equals plain fit(batch_size=B*K), for
    current and legacy (tf_keras.optimizers.legacy) inner optimizers."""
    _assert_equivalent(*_pair(utils.OPTIMIZERS[optimizer]))


def test_digits_adam_matches_big_batch():
    """The same on real data: scikit-learn's 8x8 digits, 10 classes."""
    x, y = utils.digits_data()

    def layers():
        return utils.mlp_layers(inputs_dim=64, classes=10)

    _assert_equivalent(*_pair(utils.OPTIMIZERS["adam"], x, y, layers=layers))


@pytest.mark.parametrize("schedule", list(utils.SCHEDULES))
def test_learning_rate_schedule_advances_once_per_update(schedule):
    """ExponentialDecay (halving per update) is evaluated at the update count:
    the wrapper's ``iterations`` are the big batch's number of updates (not
    the K times larger number of micro-batches), and so are the weights."""
    initial, reference, model, wrapper = _pair(utils.SCHEDULES[schedule])
    _assert_equivalent(initial, reference, model, wrapper)
    inner = wrapper.inner_optimizer
    if isinstance(inner, utils.legacy.Optimizer):
        rates = [float(o._decayed_lr(tf.float32)) for o in (inner, reference.optimizer)]
    else:
        rates = [float(o.learning_rate) for o in (wrapper, reference.optimizer)]
    assert rates[0] == pytest.approx(rates[1], rel=1e-6)


@pytest.mark.parametrize("clip", list(utils.CLIPPING))
def test_clipping_on_inner_acts_on_accumulated_gradient(clip):
    """clipnorm / global_clipnorm / clipvalue on the inner optimizer clip the
    accumulated gradient once per update, as the big batch's own."""
    initial, reference, model, wrapper = _pair(utils.CLIPPING[clip])
    _assert_equivalent(initial, reference, model, wrapper)
    utils.assert_acted(utils.CLIPPING[clip], reference, "clipping did not act")


@pytest.mark.parametrize("clip", ["clipnorm", "global_clipnorm"])
def test_clipping_given_to_wrapper_lands_on_inner(clip):
    """clipnorm / global_clipnorm passed to the wrapper are set on the inner
    optimizer and act as the big batch's own."""
    make_reference = utils.CLIPPING[clip]
    initial, reference, model, wrapper = _pair(
        lambda: tf_keras.optimizers.SGD(0.5),
        make_reference=make_reference,
        **{clip: 0.05},
    )
    assert getattr(wrapper.inner_optimizer, clip) == 0.05
    _assert_equivalent(initial, reference, model, wrapper)


@pytest.mark.parametrize("ema", list(utils.EMA))
def test_ema_weights_match_big_batch(ema):
    """use_ema=True on the inner optimizer: the average advances once per
    update and fit ends with the EMA weights, as in plain tf-keras."""
    initial, reference, model, wrapper = _pair(utils.EMA[ema])
    _assert_equivalent(initial, reference, model, wrapper)
    utils.assert_acted(utils.EMA[ema], reference, "EMA did not change the outcome")


def test_kernel_regularizer_matches_big_batch():
    """An L2 kernel_regularizer: each equal micro-batch carries the penalty and
    the wrapper's mean of K of them is the big batch's one penalty."""
    sgd = lambda: tf_keras.optimizers.SGD(0.2)  # noqa: E731
    initial, reference, model, wrapper = _pair(sgd, layers=utils.regularized_layers)
    assert model.losses
    _assert_equivalent(initial, reference, model, wrapper)


def test_sum_reduction_with_sum_reduced_loss():
    """reduction="SUM" sums the K gradients: with a loss compiled with
    reduction="sum" that is the big batch's summed loss."""
    x, _ = utils.classification_data()
    y = np.random.default_rng(5).normal(size=(N, 1)).astype("float32")

    def layers():
        return utils.mlp_layers(classes=1)

    def loss():
        return tf_keras.losses.MeanSquaredError(reduction="sum")

    sgd = lambda: tf_keras.optimizers.SGD(0.005)  # noqa: E731
    initial, reference = utils.big_batch(sgd, x, y, layers=layers, make_loss=loss)
    model = utils.seeded(lambda: utils.plain_model(layers))
    wrapper = GradientAccumulateOptimizer(sgd(), accum_steps=K, reduction="sum")
    model.compile(optimizer=wrapper, loss=loss())
    utils.fit(model, x, y, B, epochs=EPOCHS)
    _assert_equivalent(initial, reference, model, wrapper)


# --------------------------------------------------------------------- input
def test_unknown_length_dataset_matches_numpy():
    """A tf.data.Dataset of unknown cardinality trains as numpy input and as
    the big batch."""
    x, y = utils.classification_data()
    adam = lambda: tf_keras.optimizers.Adam(0.01)  # noqa: E731
    initial, reference, model, wrapper = _pair(adam, x, y)
    _assert_equivalent(initial, reference, model, wrapper)

    streamed = utils.seeded(utils.plain_model)
    opt = GradientAccumulateOptimizer(adam(), accum_steps=K)
    streamed.compile(optimizer=opt, loss=utils.sparse_ce())
    utils.fit(streamed, utils.unknown_length(x, y, B), epochs=EPOCHS)
    _assert_equivalent(initial, reference, streamed, opt)
    diff = utils.assert_same_weights(
        utils.weights(streamed), utils.weights(model), atol=1e-7
    )
    utils.report(diff, "dataset vs numpy")


# ---------------------------------------------------------- weights and API
def test_model_weights_are_untouched_by_the_wrapper():
    """The model compiled with the wrapper has the plain model's weights and
    parameter count; the wrapper's state is the optimizer's, not the
    model's; set_weights round-trips."""
    plain = utils.seeded(utils.plain_model)
    model, wrapper = _accumulated(
        utils.OPTIMIZERS["adam"], *utils.classification_data()
    )
    assert len(model.weights) == len(plain.weights) == 4
    assert len(model.get_weights()) == len(plain.get_weights())
    assert model.count_params() == plain.count_params()
    names = {v.name for v in model.weights}
    assert not names & {v.name for v in wrapper.variables}
    model.set_weights(plain.get_weights())
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("optimizer", ["adam", "legacy_adam"])
def test_non_finite_micro_batch_skips_its_whole_cycle(optimizer):
    """A NaN input in one micro-batch of the second of three cycles skips that
    cycle whole (weights after it bit-for-bit those before it, finite; the
    inner Adam's state and iterations untouched), and the third cycle trains
    normally: the big batch trained on cycles 1 and 3 only."""
    x, y = utils.classification_data(3 * B * K)
    x[B * K + B + 3, 2] = np.nan  # cycle 2, micro-batch 2
    make = utils.OPTIMIZERS[optimizer]

    initial, reference = utils.big_batch_without_the_middle_cycle(make, x, y)

    model = utils.seeded(utils.plain_model)
    wrapper = GradientAccumulateOptimizer(make(), accum_steps=K)
    model.compile(optimizer=wrapper, loss=utils.sparse_ce())
    utils.fit_skipping_the_middle_cycle(model, x, y, initial)
    _assert_equivalent(initial, reference, model, wrapper, updates=2)


# ---------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    ("accum_steps", "error"), [(0, ValueError), (1.5, TypeError), ("4", TypeError)]
)
def test_accum_steps_is_validated(accum_steps, error):
    with pytest.raises((ValueError, TypeError), match="accum_steps") as info:
        GradientAccumulateOptimizer(tf_keras.optimizers.SGD(), accum_steps=accum_steps)
    assert isinstance(info.value, error)


def test_reduction_is_validated():
    with pytest.raises(ValueError, match="reduction"):
        GradientAccumulateOptimizer(tf_keras.optimizers.SGD(), K, reduction="avg")


def test_keras3_optimizer_gets_the_keras3_wrapper():
    """A Keras 3 optimizer handed to the (tf-keras) public wrapper is
    wrapped by the Keras 3 wrapper: its own Keras decides."""
    from gradient_accumulator.keras3.optimizer import (
        GradientAccumulateOptimizer as Keras3Wrapper,
    )

    inner = keras.optimizers.SGD(0.1)
    # The optimizer handed in decides: a Keras 3 one gets the Keras 3 wrapper.
    wrapper = GradientAccumulateOptimizer(inner, accum_steps=K)
    assert isinstance(wrapper, Keras3Wrapper)
    assert isinstance(wrapper, keras.optimizers.Optimizer)
    assert not isinstance(wrapper, tf_keras.optimizers.Optimizer)
    assert wrapper.inner_optimizer is inner
    assert wrapper.accum_steps == K


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "legacy_adam"])
def test_accum_steps_one_is_plain_tf_keras(optimizer):
    """accum_steps=1 trains exactly as the plain inner optimizer (same batch)."""
    x, y = utils.classification_data()
    make = utils.OPTIMIZERS[optimizer]
    initial, reference = utils.big_batch(make, x, y, batch_size=B)
    model, wrapper = _accumulated(make, x, y, accum_steps=1)
    utils.assert_trained(initial, utils.weights(model))
    diff = utils.assert_same_weights(
        utils.weights(model), utils.weights(reference), 1e-7
    )
    utils.report(diff)
    assert int(wrapper.iterations) == EPOCHS * N // B
