"""Every loss reduction Keras offers, with masks, sample weights, several
outputs and regularisation, against plain Keras on the big batch.

``GradientAccumulateModel`` weights each micro-batch by the denominator Keras
divides its loss by. Terms divided by different quantities are summed apart,
one sum per denominator, each divided by its own total at the cycle's end
(``tests/keras3/test_denominators.py`` has the BERT-style case).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from tests import utils

K = 4
N = 16  # 4 micro-batches of 4
VOCAB, T = utils.VOCAB, utils.SEQ_LEN  # those of utils.padded_sequences
REDUCTIONS = ["sum", "sum_over_batch_size", "mean", "mean_with_sample_weight", "none"]


def _tagger(heads: int = 1, regularizer=None):
    def layers():
        tokens = keras.Input((T,), dtype="int32")
        h = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(tokens)
        h = keras.layers.Dense(8, activation="tanh")(h)
        outputs = {
            f"tag{i}": keras.layers.Dense(
                VOCAB, kernel_regularizer=regularizer, name=f"tag{i}"
            )(h)
            for i in range(heads)
        }
        return tokens, outputs if heads > 1 else outputs["tag0"]

    return layers


def _sequences(seed: int = 1):
    """16 sequences of 1 to 10 real tokens (0 pads), per-token targets and
    per-token weights; the micro-batches hold very different token counts."""
    rng = np.random.default_rng(seed)
    lengths = np.array([1, 2, 1, 3, 9, 10, 8, 10, 4, 5, 6, 1, 10, 2, 7, 3])
    x, y = utils.padded_sequences(lengths, rng)
    weights = rng.uniform(0.2, 2.0, (N, T)).astype("float32")
    return x, y, weights


def _pair(layers, make_loss, x, y, sample_weight=None, lr=0.5, micro_batch_size=None):
    """(initial, big-batch reference, accumulated) after one epoch: one
    update of N samples each."""
    in_step = micro_batch_size is not None
    initial, reference, accumulated = utils.train_pair(
        layers,
        lambda: keras.optimizers.SGD(lr),
        x,
        y,
        batch_size=N if in_step else N // K,
        accum_steps=1 if in_step else K,
        epochs=1,
        sample_weight=sample_weight,
        make_loss=make_loss,
        model_kwargs={"micro_batch_size": micro_batch_size},
    )
    assert int(accumulated.optimizer.iterations) == 1
    return initial, reference, accumulated


def _check(initial, reference, accumulated) -> float:
    utils.assert_trained(initial, utils.weights(reference))
    diff = utils.assert_same_weights(
        utils.weights(accumulated), utils.weights(reference)
    )
    return utils.report(diff)


@pytest.mark.parametrize("weighted", [False, True], ids=["mask", "mask+weights"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_masked_tagger_every_reduction(reduction, weighted):
    """Embedding(mask_zero=True) tagger, 16 sequences of 1-10 real tokens,
    K=4: each micro-batch counts with the denominator Keras uses (unmasked
    tokens, their weights' sum, or 1 for a sum)."""
    x, y, weights = _sequences()
    loss = lambda: utils.sparse_ce(reduction=reduction)  # noqa: E731
    _check(*_pair(_tagger(), loss, x, y, weights if weighted else None))


def test_mean_with_sample_weight_under_a_mask_is_not_a_sample_mean():
    """Non-vacuity for the mask-only case: Keras divides by unmasked tokens
    there, and weighting micro-batches by samples instead (the old rule) is
    measurably off: one SGD step from the sample-weighted mean of the
    micro-batch gradients differs from the big batch's."""
    x, y, _ = _sequences()
    layers, lr = _tagger(), 0.5
    loss = lambda: utils.sparse_ce(reduction="mean_with_sample_weight")  # noqa: E731
    _, reference, _ = _pair(layers, loss, x, y)
    naive = utils.naive_sgd_step(layers, x, y, lr, N // K, make_loss=loss)
    gap = utils.max_abs_diff(naive, utils.weights(reference))
    assert gap > 100 * utils.ATOL, f"sample weighting is only {gap:.3g} off"


def test_sum_reduction_counts_regularisation_once_per_cycle():
    """With reduction="sum" the big batch adds the L2 penalty once, not once
    per micro-batch."""
    x, y, _ = _sequences()
    layers = _tagger(regularizer=keras.regularizers.L2(0.05))
    _check(*_pair(layers, lambda: utils.sparse_ce(reduction="sum"), x, y, lr=0.05))


# ------------------------------------------------------------ several outputs
def _two_heads():
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    return inputs, {
        "cls": keras.layers.Dense(3, name="cls")(h),
        "reg": keras.layers.Dense(1, name="reg")(h),
    }


def _two_head_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 6)).astype("float32")
    y = {"cls": rng.integers(0, 3, N), "reg": rng.normal(size=(N, 1)).astype("float32")}
    return x, y, rng.uniform(0.1, 3.0, N).astype("float32")


def _two_losses(cls, reg):
    return lambda: {
        "cls": utils.sparse_ce(reduction=cls),
        "reg": keras.losses.MeanSquaredError(reduction=reg),
    }


@pytest.mark.parametrize(
    ("cls", "reg", "weighted"),
    [
        ("sum", "sum", False),
        ("sum", "sum", True),
        ("sum_over_batch_size", "mean", True),
        ("mean_with_sample_weight", "mean_with_sample_weight", True),
        ("mean_with_sample_weight", "sum_over_batch_size", False),
    ],
)
def test_two_outputs_exact_combinations(cls, reg, weighted):
    """Two outputs whose losses share one denominator (or are both sums);
    one sample_weight array serves both outputs."""
    x, y, weights = _two_head_data()
    _check(
        *_pair(_two_heads, _two_losses(cls, reg), x, y, weights if weighted else None)
    )


def test_two_summed_outputs_in_step():
    x, y, _ = _two_head_data()
    _check(*_pair(_two_heads, _two_losses("sum", "sum"), x, y, micro_batch_size=4))


@pytest.mark.parametrize("micro_batch_size", [None, 4], ids=["streaming", "in-step"])
@pytest.mark.parametrize(
    ("cls", "reg", "weighted"),
    [
        ("sum", "sum_over_batch_size", False),
        ("mean_with_sample_weight", "sum_over_batch_size", True),
    ],
)
def test_two_outputs_with_different_denominators(cls, reg, weighted, micro_batch_size):
    """A sum beside a mean, a sample-weight mean beside a sample mean: each
    output's gradients are summed apart and divided by its own total."""
    x, y, weights = _two_head_data()
    losses = _two_losses(cls, reg)
    sample_weight = weights if weighted else None
    _check(
        *_pair(
            _two_heads, losses, x, y, sample_weight, micro_batch_size=micro_batch_size
        )
    )


def test_different_sample_weights_per_output():
    """mean_with_sample_weight on two outputs with their own sample weights:
    two totals per cycle."""
    x, y, weights = _two_head_data()
    mean = "mean_with_sample_weight"
    per_output = {"cls": weights, "reg": weights[::-1].copy()}
    _check(*_pair(_two_heads, _two_losses(mean, mean), x, y, per_output))


def test_two_heads_on_one_mask_and_on_two_masks():
    """Two tagging heads over one masked trunk share its mask (one sum); a
    head whose output is masked otherwise has its own total."""
    x, y, _ = _sequences()
    targets = {"tag0": y, "tag1": y[:, ::-1].copy()}
    both = lambda: {  # noqa: E731
        "tag0": utils.sparse_ce(reduction="mean"),
        "tag1": utils.sparse_ce(reduction="sum_over_batch_size"),
    }
    _check(*_pair(_tagger(heads=2), both, x, targets))

    def other_mask():
        tokens = keras.Input((T,), dtype="int32")
        h = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(tokens)
        other = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(tokens[:, ::-1])
        return tokens, {
            "tag0": keras.layers.Dense(VOCAB, name="tag0")(h),
            "tag1": keras.layers.Dense(VOCAB, name="tag1")(other),
        }

    _check(*_pair(other_mask, both, x, targets))
