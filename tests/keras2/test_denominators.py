"""tf-keras: loss terms that the big batch divides by different totals,
against plain tf-keras on the big batch.

A token head averaged over the unmasked tokens (Embedding(mask_zero=True))
beside a sequence head averaged over the sequences, and a ``"sum"`` beside a
mean: each denominator's gradients are summed apart and divided by their own
total at the cycle's end, as in the Keras 3 hosts (``Engine.part``).
A micro-batch of padding alone, in either Keras: tests/both/test_weighting.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import tf_keras

from tests.keras2 import utils
from tests.keras2.utils import B, K
from tests.utils import token_corpus

VOCAB, LENGTH, N = 16, 10, 64


def _pretraining(regularizer=None):
    return utils.pretraining_layers(VOCAB, LENGTH, ("tokens", "sequence"), regularizer)


def _corpus(seed: int = 0):
    """64 sequences of 1-10 real tokens (0 pads): micro-batches with very
    different token counts."""
    return token_corpus(N, LENGTH, VOCAB, seed)


def _losses(sequence_reduction: str = "auto"):
    return lambda: {
        "tokens": utils.sparse_ce(),
        "sequence": utils.sparse_ce(reduction=sequence_reduction),
    }


def _pair(layers, losses, x, y, lr=0.5):
    sgd = lambda: tf_keras.optimizers.SGD(lr, momentum=0.5)  # noqa: E731
    initial, reference = utils.big_batch(
        sgd, x, y, layers=layers, make_loss=losses, epochs=1
    )
    accumulated = utils.seeded(lambda: utils.accumulating_model(layers, accum_steps=K))
    assert utils.max_abs_diff(initial, utils.weights(accumulated)) == 0.0
    accumulated.compile(optimizer=sgd(), loss=losses())
    utils.fit(accumulated, x, y, B)
    return initial, reference, accumulated


@pytest.mark.parametrize(
    ("reduction", "regularized"),
    [("auto", True), ("sum", False)],
    ids=["tokens+sequences+l2", "tokens+sum"],
)
def test_token_and_sequence_heads_match_big_batch(reduction, regularized):
    x, y = _corpus()
    regularizer = tf_keras.regularizers.L2(0.01) if regularized else None
    initial, reference, accumulated = _pair(
        lambda: _pretraining(regularizer), _losses(reduction), x, y
    )
    utils.assert_equivalent(initial, reference, accumulated, N // (B * K))
    assert len(accumulated._accumulator.parts) == 1


def test_equal_weighting_is_measurably_off():
    """Non-vacuity: the optimizer wrapper's equal micro-batch weights on the
    same data are far from the big batch the model wrapper matches."""
    from gradient_accumulator import GradientAccumulateOptimizer

    x, y = _corpus()
    initial, reference, _ = _pair(_pretraining, _losses(), x, y)
    equal = utils.seeded(lambda: utils.plain_model(_pretraining))
    assert utils.max_abs_diff(initial, utils.weights(equal)) == 0.0
    inner = tf_keras.optimizers.SGD(0.5, momentum=0.5)
    equal.compile(optimizer=GradientAccumulateOptimizer(inner, K), loss=_losses()())
    utils.fit(equal, x, y, B)
    gap = utils.max_abs_diff(utils.weights(equal), utils.weights(reference))
    assert gap > 100 * utils.ATOL, f"equal weighting is only {gap:.3g} off"


@pytest.mark.parametrize(
    ("reduction", "regularized"),
    [("auto", True), ("sum", False)],
    ids=["tokens+sequences+l2", "tokens+sum"],
)
def test_mirrored_token_and_sequence_heads_match_big_batch(
    reduction, regularized, mirrored
):
    """Under MirroredStrategy (2 logical CPUs, conftest.py), global
    micro-batch 2 x 4 = ``B``: every replica counts its own unmasked tokens,
    and the model wrapper, built and compiled in the strategy's scope, still
    trains like plain tf-keras on one device on the big batch. Plain tf-keras
    under the same strategy on the big batch (each replica divides by its own
    token count) is measurably off."""
    x, y = _corpus()
    regularizer = tf_keras.regularizers.L2(0.01) if regularized else None
    layers = lambda: _pretraining(regularizer)  # noqa: E731
    losses = _losses(reduction)
    sgd = lambda: tf_keras.optimizers.SGD(0.5, momentum=0.5)  # noqa: E731
    initial, reference = utils.big_batch(
        sgd, x, y, layers=layers, make_loss=losses, epochs=1
    )
    assert mirrored.num_replicas_in_sync * (B // 2) == B
    with mirrored.scope():
        accumulated = utils.seeded(
            lambda: utils.accumulating_model(layers, accum_steps=K)
        )
        accumulated.compile(optimizer=sgd(), loss=losses())
    assert utils.max_abs_diff(initial, utils.weights(accumulated)) == 0.0
    utils.fit(accumulated, x, y, B)  # global batch: B // 2 per replica
    utils.assert_trained(initial, utils.weights(reference))
    utils.assert_trained(initial, utils.weights(accumulated))
    diff = utils.assert_same_weights(
        utils.weights(accumulated), utils.weights(reference)
    )
    utils.report(diff)
    # (utils.assert_equivalent's int() does not take a MirroredVariable.)
    assert int(reference.optimizer.iterations) == N // (B * K)
    assert accumulated.optimizer.iterations.numpy() == N // (B * K)
    assert len(accumulated._accumulator.parts) == 1

    with mirrored.scope():
        plain = utils.seeded(lambda: utils.plain_model(layers))
        plain.compile(optimizer=sgd(), loss=losses())
    utils.fit(plain, x, y, B * K)
    gap = utils.max_abs_diff(utils.weights(plain), utils.weights(reference))
    utils.report(gap, "max |w_plain_mirrored - w_bigbatch|")
    assert gap > 10 * utils.ATOL, f"per-replica normalisation only {gap:.3g} off"


def _one_padding_micro_batch(seed: int = 0):
    """The corpus with micro-batch 1 (samples 8-15) all padding: tf-keras'
    masked mean of that micro-batch alone divides 0 by 0, while every big
    batch still holds real tokens."""
    x, y = _corpus(seed)
    x[B : 2 * B] = 0
    return x, y


def _tokens_only():
    inputs, outputs = _pretraining()
    return inputs, outputs["tokens"]


def test_nan_from_the_data_still_skips_its_cycle():
    """A NaN in a micro-batch that does count (an input the first Dense
    reads) still skips its cycle as documented: weights finite, one update
    fewer than cycles."""
    inputs = tf_keras.Input((4,))
    outputs = tf_keras.layers.Dense(1)(inputs)
    from gradient_accumulator import GradientAccumulateModel

    model = GradientAccumulateModel(accum_steps=K, inputs=inputs, outputs=outputs)
    model.compile(optimizer=tf_keras.optimizers.SGD(0.1), loss="mse")
    x = np.ones((N, 4), "float32")
    x[B + 1, 2] = np.nan
    utils.fit(model, x, np.ones((N, 1), "float32"), B)
    utils.assert_finite(utils.weights(model))
    assert int(model.optimizer.iterations) == N // (B * K) - 1


def test_micro_batch_of_padding_under_mixed_float16():
    """Under a loss scale the micro-batch's weight goes on its unscaled
    gradients instead of its loss: the padding micro-batch still adds
    nothing, and the wrapper applies every update the mixed big batch
    applies, within float16's distance of it."""
    tf_keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = _one_padding_micro_batch()
    y = y["tokens"]
    sgd = lambda: tf_keras.optimizers.SGD(0.5, momentum=0.5)  # noqa: E731
    initial, reference = utils.big_batch(
        sgd, x, y, layers=_tokens_only, make_loss=utils.sparse_ce, epochs=1
    )
    accumulated = utils.seeded(
        lambda: utils.accumulating_model(_tokens_only, accum_steps=K)
    )
    accumulated.compile(optimizer=sgd(), loss=utils.sparse_ce())
    utils.fit(accumulated, x, y, B)
    utils.assert_finite(utils.weights(accumulated))
    updates = N // (B * K)
    assert int(reference.optimizer.iterations) == updates
    assert int(accumulated.optimizer.iterations) == updates
    utils.assert_trained(initial, utils.weights(accumulated))
    gap = utils.max_abs_diff(utils.weights(accumulated), utils.weights(reference))
    utils.report(gap, "max |w_accum - w_bigbatch| (both mixed_float16)")
    assert gap < 1e-2
