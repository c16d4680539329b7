"""Weighted micro-batches, in each Keras: per-sample weights passed to
``fit`` and masked tokens give the big batch's weights, and the weighting
matters for the outcome; a micro-batch of padding alone adds nothing. (Once
the same tests in tests/keras3/test_model_weighting.py,
tests/keras2/test_model.py and each Keras' test_denominators.py; the other
weighting tests, per Keras, stay there.)"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import tensorflow as tf

from tests.flavour import LEGACY_KERAS, keras, utils
from tests.utils import token_corpus, train_pair  # written on the session's Keras

B = 8  # micro-batch size
K = 4  # accumulation steps
N = 64
EPOCHS = 2
LENGTHS = utils.PADDED_LENGTHS  # two cycles: 10 ... 78 real tokens per micro-batch

if LEGACY_KERAS:
    # tf-keras' masked tagger (a per-timestep Dense); per-sample weights.
    MASKED = {
        "mask": (utils.sequence_layers, None),
        "mask+sample_weight": (utils.sequence_layers, "per_sample"),
    }
else:
    # Keras 3's taggers; per-token weights: Keras 3.15 cannot broadcast
    # per-sample weights of shape (n,) against a (n, T) mask, even for
    # plain big-batch training.
    MASKED = {
        kind: (functools.partial(utils.sequence_layers, kind), None)
        for kind in ("gru", "lstm", "timedistributed")
    }
    MASKED["gru-sample_weight"] = (
        functools.partial(utils.sequence_layers, "gru"),
        "per_token",
    )


def test_sample_weight_matches_big_batch():
    """Random positive sample weights (0.1 to 3) passed to fit give the big
    batch's weights (and the weights do matter for the outcome)."""
    x, y = utils.classification_data(N)
    sample_weight = np.random.default_rng(3).uniform(0.1, 3.0, N).astype("float32")
    # SGD with momentum is linear in the gradient, so the weight difference
    # measures the weighting itself; Adam (covered in the equivalence tests)
    # divides by |g| and amplifies float32 rounding of near-zero gradient
    # entries (4e-6 on one kernel entry in Keras 3, still within ATOL).
    momentum = lambda: keras.optimizers.SGD(0.1, momentum=0.9)  # noqa: E731
    initial, reference, accumulated = train_pair(
        utils.mlp_layers,
        momentum,
        x,
        y,
        batch_size=B,
        accum_steps=K,
        epochs=EPOCHS,
        sample_weight=sample_weight,
    )
    utils.assert_equivalent(initial, reference, accumulated, EPOCHS * N // (B * K))

    # Non-vacuity: without the sample weights the big batch trains otherwise.
    unweighted = utils.seeded(utils.plain_model)
    unweighted.compile(optimizer=momentum(), loss=utils.sparse_ce())
    utils.fit(unweighted, x, y, B * K, epochs=EPOCHS)
    gap = utils.report(
        utils.max_abs_diff(utils.weights(unweighted), utils.weights(reference)),
        "non-vacuity gap",
    )
    assert gap > 1e-3, f"sample weights did not matter ({gap:.3g})"


def test_masked_weighting_differs_from_naive_mean():
    """Premise and non-vacuity of the masked tests: the big batch's loss is
    the sum over unmasked tokens divided by their number; one accumulated SGD
    step equals the big batch's and is far from the step the equal-weight
    mean of the micro-batch gradients would take, and from plain training on
    the micro-batches, so the masked tests can tell exact from naive
    accumulation. (Each Keras' masked tagger: utils.sequence_layers.)"""
    layers = utils.sequence_layers
    x, y = utils.padded_sequences(LENGTHS[: B * K])  # one cycle
    model = utils.seeded(lambda: utils.plain_model(layers))
    model.compile(optimizer="sgd", loss=utils.sparse_ce())
    logits = model(x)
    per_token = keras.losses.sparse_categorical_crossentropy(
        y, logits, from_logits=True
    )
    mask = x != 0
    expected = np.asarray(per_token)[mask].sum() / mask.sum()
    assert float(model.compute_loss(x, tf.constant(y), logits)) == pytest.approx(
        expected, 1e-5
    )

    lr = 1.0
    sgd = lambda: keras.optimizers.SGD(lr)  # noqa: E731
    initial, reference, accumulated = train_pair(
        layers, sgd, x, y, batch_size=B, accum_steps=K, epochs=1
    )
    utils.assert_equivalent(initial, reference, accumulated, 1)

    naive = utils.naive_sgd_step(layers, x, y, lr, B)
    gap = utils.report(
        utils.max_abs_diff(naive, utils.weights(reference)), "non-vacuity gap"
    )
    assert gap > 100 * utils.ATOL, f"naive mean is only {gap:.3g} off"
    assert utils.max_abs_diff(naive, utils.weights(accumulated)) > 100 * utils.ATOL

    # The big batch is not plain training on the micro-batches either (the
    # data is not trivially symmetric).
    small = utils.seeded(lambda: utils.plain_model(layers))
    small.compile(optimizer=sgd(), loss=utils.sparse_ce())
    utils.fit(small, x, y, B)
    assert utils.max_abs_diff(utils.weights(small), utils.weights(reference)) > 1e-3


@pytest.mark.parametrize("case", list(MASKED))
def test_masked_sequences_match_big_batch(case):
    """Padded sequences with very different numbers of real tokens per
    micro-batch (Embedding mask_zero=True, per-token loss) give the big
    batch's weights: micro-batches are weighted by their unmasked tokens,
    as the big batch divides by its total unmasked tokens."""
    layers, weighting = MASKED[case]
    x, y = utils.padded_sequences(LENGTHS)
    model = utils.seeded(lambda: utils.plain_model(layers))
    assert getattr(model(x[:2]), "_keras_mask", None) is not None, "mask lost"
    shape = {None: None, "per_token": x.shape, "per_sample": len(x)}[weighting]
    sample_weight = (
        None
        if shape is None
        else np.random.default_rng(4).uniform(0.2, 2.0, shape).astype("float32")
    )
    momentum = lambda: keras.optimizers.SGD(0.5, momentum=0.9)  # noqa: E731
    initial, reference, accumulated = train_pair(
        layers,
        momentum,
        x,
        y,
        batch_size=B,
        accum_steps=K,
        epochs=EPOCHS,
        sample_weight=sample_weight,
    )
    utils.assert_equivalent(initial, reference, accumulated, EPOCHS * len(x) // (B * K))


# ------------------------------------------------ a micro-batch of padding
PAD_VOCAB, PAD_LENGTH = 16, 10
# Each Keras' in-step mode (micro_batch_size) too; tf-keras has none.
PADDING_MODES = ["streaming"] if LEGACY_KERAS else ["streaming", "in_step"]


def _padded_corpus(seed: int = 0):
    """N sequences of 1-10 real tokens (0 pads after them), a token target
    per position and a sequence target, with micro-batch 1 (samples 8-15)
    all padding: a masked mean of that micro-batch alone divides 0 by 0,
    while every big batch still holds real tokens."""
    x, y = token_corpus(N, PAD_LENGTH, PAD_VOCAB, seed)
    x[B : 2 * B] = 0
    return x, y


def _token_head():
    """A token head over masked embeddings (Embedding(mask_zero=True)) and a
    dense trunk."""
    names = ("tokens", "sequence")
    inputs, outputs = utils.pretraining_layers(PAD_VOCAB, PAD_LENGTH, names)
    return inputs, outputs["tokens"]


def _token_and_sequence_heads():
    """The masked token head beside a sequence head pooled from unmasked
    embeddings (a masked mean over padding alone is 0 / 0 in the big batch
    too)."""
    return utils.padding_heads(PAD_VOCAB, PAD_LENGTH, "tokens", "sequence")


@pytest.mark.parametrize("run_eagerly", [False, True], ids=["graph", "eager"])
@pytest.mark.parametrize("mode", PADDING_MODES)
@pytest.mark.parametrize("heads", ["tokens", "tokens+sequences"])
def test_micro_batch_of_padding_contributes_nothing(heads, mode, run_eagerly):
    """A micro-batch without one unmasked token adds nothing to its cycle
    (weight 0, no NaN), as its rows add nothing to the big batch's masked
    mean, and every cycle applies, as the big batch's do; before, its NaN
    loss (0 / 0) times weight 0 stayed NaN and the finite check dropped the
    whole cycle with its three good micro-batches (1 update of 2). The
    logged losses are finite."""
    x, y = _padded_corpus()
    if heads == "tokens":
        layers, y = _token_head, y["tokens"]
        make_loss = utils.sparse_ce
    else:
        layers = _token_and_sequence_heads

        def make_loss():
            return {"tokens": utils.sparse_ce(), "sequence": utils.sparse_ce()}

    sgd = lambda: keras.optimizers.SGD(0.5, momentum=0.5)  # noqa: E731
    reference = utils.seeded(lambda: utils.plain_model(layers))
    initial = utils.weights(reference)
    reference.compile(optimizer=sgd(), loss=make_loss())
    utils.fit(reference, x, y, B * K)

    if mode == "streaming":
        settings, batch = {"accum_steps": K}, B
    else:  # each fit batch of B * K in slices of B: one update
        settings, batch = {"accum_steps": 1, "micro_batch_size": B}, B * K
    accumulated = utils.seeded(lambda: utils.accumulating_model(layers, **settings))
    assert utils.max_abs_diff(initial, utils.weights(accumulated)) == 0.0
    accumulated.compile(optimizer=sgd(), loss=make_loss(), run_eagerly=run_eagerly)
    history = utils.fit(accumulated, x, y, batch)
    utils.assert_equivalent(initial, reference, accumulated, N // (B * K))
    assert np.isfinite(history.history["loss"]).all()
