"""Loss terms that the big batch divides by different totals, against plain
Keras on the big batch.

BERT-style pretraining averages its token head (MLM) over the masked
positions and its sequence head (NSP) over the sequences; a cycle's
micro-batches hold very different numbers of masked positions. The big
batch's gradient is, per head, the head's summed gradient over the cycle
divided by the head's total over the cycle, so ``GradientAccumulateModel``
keeps one gradient sum per denominator (``Engine.part``) and divides each by
its own total at the cycle's end.
A micro-batch of padding alone, in either Keras: tests/both/test_weighting.py.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from gradient_accumulator import GradientAccumulateModel, GradientAccumulateOptimizer
from tests import utils

VOCAB, LENGTH, N = 32, 10, 32
MICRO, K, LR = 4, 4, 0.5
MEAN_WEIGHTED = "mean_with_sample_weight"


def _pretraining(regularizer=None, keras_mask: bool = False):
    """A tiny BERT-like model: embedding, a dense trunk, a token head
    ("mlm", logits per position) and a sequence head ("nsp")."""

    def layers():
        return utils.pretraining_layers(
            VOCAB, LENGTH, ("mlm", "nsp"), regularizer, mask_zero=keras_mask
        )

    return layers


def _corpus(seed: int = 0, padded: bool = False):
    """32 sequences with 5-60% of positions masked for prediction (their
    per-token weights are 1, the rest 0); with ``padded``, 1-10 real tokens
    and 0-padding after them."""
    rng = np.random.default_rng(seed)
    x = rng.integers(1, VOCAB, size=(N, LENGTH)).astype("int32")
    if padded:
        for i, length in enumerate(rng.integers(1, LENGTH + 1, size=N)):
            x[i, length:] = 0
    fraction = rng.uniform(0.05, 0.6, size=N)
    masked = (rng.uniform(size=(N, LENGTH)) < fraction[:, None]).astype("float32")
    masked[np.arange(N), rng.integers(0, LENGTH, size=N)] = 1.0  # at least one
    y = {
        "mlm": rng.integers(0, VOCAB, size=(N, LENGTH)),
        "nsp": rng.integers(0, 2, size=N),
    }
    return x, y, masked


def _losses(mlm: str = MEAN_WEIGHTED, nsp: str = "sum_over_batch_size"):
    return lambda: {
        "mlm": utils.sparse_ce(reduction=mlm),
        "nsp": utils.sparse_ce(reduction=nsp),
    }


def _weights(masked, nsp=None):
    return {"mlm": masked, "nsp": np.ones(N, "float32") if nsp is None else nsp}


def _pair(layers, losses, x, y, sample_weight, micro_batch_size=None, n=N):
    in_step = micro_batch_size is not None
    x = x[:n]
    y = {k: v[:n] for k, v in y.items()} if isinstance(y, dict) else y[:n]
    if sample_weight is not None:
        sample_weight = {k: v[:n] for k, v in sample_weight.items()}
    return utils.train_pair(
        layers,
        lambda: keras.optimizers.SGD(LR),
        x,
        y,
        batch_size=MICRO * K if in_step else MICRO,
        accum_steps=1 if in_step else K,
        reference_batch=MICRO * K,
        epochs=1,
        sample_weight=sample_weight,
        make_loss=losses,
        model_kwargs={"micro_batch_size": micro_batch_size},
    )


def _exact(initial, reference, accumulated, updates: int = N // (MICRO * K)) -> float:
    return utils.assert_equivalent(initial, reference, accumulated, updates)


MODES = pytest.mark.parametrize(
    "micro_batch_size", [None, MICRO], ids=["streaming", "in-step"]
)


@MODES
def test_mlm_plus_nsp(micro_batch_size):
    """Token loss over the masked positions, sequence loss over the
    sequences, an L2 penalty on the trunk (counted once per update)."""
    x, y, masked = _corpus()
    layers = _pretraining(regularizer=keras.regularizers.L2(0.01))
    _exact(*_pair(layers, _losses(), x, y, _weights(masked), micro_batch_size))


@MODES
def test_keras_mask_beside_a_sequence_mean(micro_batch_size):
    """Padded sequences: the token head is averaged over the unmasked
    (Embedding(mask_zero=True)) tokens, the sequence head over sequences."""
    x, y, _ = _corpus(seed=1, padded=True)
    layers = _pretraining(keras_mask=True)
    _exact(
        *_pair(layers, _losses(mlm="sum_over_batch_size"), x, y, None, micro_batch_size)
    )


@MODES
@pytest.mark.parametrize(
    ("mlm", "nsp", "nsp_weights"),
    [
        ("sum", "sum_over_batch_size", False),  # a sum beside a mean
        (MEAN_WEIGHTED, "sum", False),
        (MEAN_WEIGHTED, MEAN_WEIGHTED, True),  # per-output sample weights
    ],
    ids=["sum+mean", "weighted-mean+sum", "two-weight-arrays"],
)
def test_other_combinations(mlm, nsp, nsp_weights, micro_batch_size):
    x, y, masked = _corpus(seed=2)
    rng = np.random.default_rng(5)
    nsp_w = rng.uniform(0.2, 2.0, N).astype("float32") if nsp_weights else None
    _exact(
        *_pair(
            _pretraining(),
            _losses(mlm, nsp),
            x,
            y,
            _weights(masked, nsp_w),
            micro_batch_size,
        )
    )


def test_partial_last_cycle_is_flushed_exactly():
    """28 sequences, K=4 micro-batches of 4: the second cycle holds three
    micro-batches and is applied, weighted as a big batch of those 12."""
    x, y, masked = _corpus(seed=3)
    _exact(*_pair(_pretraining(), _losses(), x, y, _weights(masked), n=28), updates=2)


def test_equal_or_one_divisor_weighting_is_measurably_off():
    """Non-vacuity: the optimizer wrapper (equal micro-batch weights) on the
    same data is far from the big batch that the model wrapper matches."""
    x, y, masked = _corpus()
    initial, reference, _ = _pair(_pretraining(), _losses(), x, y, _weights(masked))
    equal = utils.seeded(lambda: keras.Model(*_pretraining()()))
    assert utils.max_abs_diff(initial, utils.weights(equal)) == 0.0
    equal.compile(
        optimizer=GradientAccumulateOptimizer(keras.optimizers.SGD(LR), K),
        loss=_losses()(),
    )
    utils.fit(equal, x, y, MICRO, sample_weight=_weights(masked))
    gap = utils.max_abs_diff(utils.weights(equal), utils.weights(reference))
    assert gap > 100 * utils.ATOL, f"equal weighting is only {gap:.3g} off"


def test_extra_buffers_cover_only_what_their_terms_reach():
    """The token head's sums live in a part of the engine built for the
    variables its terms reach (embedding, trunk, token head), not for the
    sequence head; a one-denominator model builds no part."""
    x, y, masked = _corpus()
    _, _, model = _pair(_pretraining(), _losses(), x, y, _weights(masked))
    (part,) = utils.accumulator(model).parts
    sequence_head = {id(w) for w in model.get_layer("nsp").trainable_weights}
    reached = [v for v in model.trainable_weights if id(v) not in sequence_head]
    assert sum(_size(b) for b in part.grad_sums) == sum(_size(v) for v in reached)

    single = utils.seeded(lambda: _accumulating(_pretraining()))
    single.compile(
        optimizer=keras.optimizers.SGD(LR), loss=_losses(mlm="mean", nsp="mean")()
    )
    utils.fit(single, x, y, MICRO)
    assert int(single.optimizer.iterations) == 2
    assert utils.accumulator(single).parts == ()


def _size(variable) -> int:
    return int(np.prod(variable.shape))


def _accumulating(layers, **kwargs) -> GradientAccumulateModel:
    inputs, outputs = layers()
    return GradientAccumulateModel(K, inputs=inputs, outputs=outputs, **kwargs)


@pytest.mark.parametrize("how", ["keras_file", "checkpoint"])
def test_resumes_mid_cycle_with_its_parts(tmp_path, how):
    """Saved after 2 of 4 micro-batches, reloaded into a fresh model and
    trained on: the same weights as the uninterrupted run."""
    import tensorflow as tf

    x, y, masked = _corpus(seed=4)
    sw = _weights(masked)
    x, y = x[:16], {k: v[:16] for k, v in y.items()}
    sw = {k: v[:16] for k, v in sw.items()}

    def build():
        model = _accumulating(_pretraining(), flush_at_end=False)
        model.compile(optimizer=keras.optimizers.SGD(LR), loss=_losses()())
        return model

    def fit_part(model, part: slice):
        targets = {k: v[part] for k, v in y.items()}
        weights = {k: v[part] for k, v in sw.items()}
        utils.fit(model, x[part], targets, MICRO, sample_weight=weights)

    whole = utils.seeded(build)
    utils.fit(whole, x, y, MICRO, sample_weight=sw)
    first = utils.seeded(build)
    fit_part(first, slice(0, 8))
    assert int(first.optimizer.iterations) == 0
    second = utils.seeded(build, seed=9)
    if how == "keras_file":
        path = str(tmp_path / "mid.keras")
        first.save(path)
        second = keras.models.load_model(path)
    else:
        fit_part(second, slice(0, 4))
        checkpoint = tf.train.Checkpoint(model=first, optimizer=first.optimizer)
        saved = checkpoint.save(str(tmp_path / "ckpt"))
        tf.train.Checkpoint(model=second, optimizer=second.optimizer).restore(saved)
    fit_part(second, slice(8, 16))
    assert int(second.optimizer.iterations) == 1
    utils.assert_same_weights(utils.weights(second), utils.weights(whole), atol=1e-6)
