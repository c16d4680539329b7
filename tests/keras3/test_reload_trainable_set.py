"""A file written mid-cycle loads wherever the plain model's file loads.

Saved accumulation state is matched to the model's variables by path. When
the loaded model trains other variables than the saved one (keras-hub
restores a LoRA model with every weight trainable; a layer frozen, LoRA
enabled or the model quantized after loading), the model loads, the pending
micro-batches are dropped with one warning, and training goes on exactly as
plain Keras on the big batch does after the same steps. Every reference is a
plain model put through the same steps (``utils.ATOL``).

keras-hub is required (CI's newest environment installs it).
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest

try:
    import keras_hub
except ImportError as error:  # not a skip: CI installs it
    raise ImportError(
        "tests/keras3/test_reload_trainable_set.py needs keras-hub: "
        "pip install -e '.[test,hub]'"
    ) from error

from gradient_accumulator import GradientAccumulateModel, accumulate
from tests import utils

B = 4  # micro-batch
K = 4  # micro-batches per update
DROPPED = "micro-batch.*dropped"


def _assert_same_models(ours, plain) -> float:
    """Every weight (trainable or not) of the two models agrees, within
    ``utils.ATOL`` or float32 rounding of large values (an int8 layer's
    scales are in the hundreds)."""
    a = [np.asarray(w) for w in ours.weights]
    b = [np.asarray(w) for w in plain.weights]
    assert len(a) == len(b)
    for mine, theirs in zip(a, b):
        np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=utils.ATOL)
    return utils.report(utils.max_abs_diff(a, b))


def _rows(data, n: int):
    """The first ``n`` samples of ``(x, y, sample_weight)``."""
    return tuple(keras.tree.map_structure(lambda t: t[:n], part) for part in data)


# ----------------------------------------------------------- keras-hub LoRA
VOCABULARY, LENGTH = 64, 12
# A GPT-2 small enough for a test (the same in tests/keras3/test_keras_hub.py).
TINY = {"num_heads": 2, "hidden_dim": 16, "intermediate_dim": 32, "dropout": 0.0}


def _gpt2() -> keras_hub.models.GPT2CausalLM:
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY,
        num_layers=1,  # one transformer block: what the tests need, half the tracing
        max_sequence_length=LENGTH + 4,
        **TINY,
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def _tokens(n: int, seed: int):
    """Padded token ids, next-token labels and the padding mask as sample
    weights: micro-batches hold 3 to 12 real tokens per sequence."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCABULARY, size=(n, LENGTH))
    lengths = rng.integers(3, LENGTH + 1, size=n)
    mask = np.arange(LENGTH)[None, :] < lengths[:, None]
    ids = np.where(mask, ids, 0)
    x = {"token_ids": ids, "padding_mask": mask}
    return x, np.roll(ids, -1, axis=1), mask.astype("float32")


def _compile_lm(lm):
    lm.compile(
        optimizer=keras.optimizers.AdamW(1e-2, weight_decay=0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"
        ),
        weighted_metrics=[],
    )


def _fit_lm(lm, data, batch_size):
    x, y, sample_weight = data
    lm.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=batch_size,
        shuffle=False,
        verbose=0,
    )


@pytest.mark.parametrize("order", ["accumulate_then_lora", "lora_then_accumulate"])
def test_keras_hub_lora_saved_mid_cycle_reloads_and_trains_on(order, tmp_path):
    def ours_build():
        lm = _gpt2()
        if order == "accumulate_then_lora":
            accumulate(lm, accum_steps=K, flush_at_end=False)
            lm.backbone.enable_lora(rank=2)
        else:
            lm.backbone.enable_lora(rank=2)
            accumulate(lm, accum_steps=K, flush_at_end=False)
        return lm

    def plain_build():
        lm = _gpt2()
        lm.backbone.enable_lora(rank=2)
        return lm

    ours, plain = utils.seeded(ours_build), utils.seeded(plain_build)
    assert len(ours.trainable_variables) == len(plain.trainable_variables) == 6
    _compile_lm(ours)
    _compile_lm(plain)
    initial = utils.weights(plain)
    # Six micro-batches: one update, then two pending at the save.
    first = _tokens(B * (K + 2), seed=1)
    _fit_lm(ours, first, B)
    _fit_lm(plain, _rows(first, B * K), B * K)
    utils.assert_trained(initial, utils.weights(plain))
    _assert_same_models(ours, plain)
    assert ours._accumulator.pending == 2

    ours.save(tmp_path / "ours.keras")
    plain.save(tmp_path / "plain.keras")
    plain_loaded = keras.models.load_model(tmp_path / "plain.keras")
    # keras-hub gives the loaded LoRA model every weight trainable (20
    # variables where 6 were saved): the two pending micro-batches are of
    # other variables.
    with pytest.warns(UserWarning, match=DROPPED):
        ours_loaded = keras.models.load_model(tmp_path / "ours.keras")
    assert type(ours_loaded) is not type(plain_loaded)
    assert isinstance(ours_loaded, type(plain_loaded))
    assert len(ours_loaded.trainable_variables) == len(plain_loaded.trainable_variables)
    assert ours_loaded._accumulator.pending == 0
    assert ours_loaded.accum_steps == K
    _assert_same_models(ours_loaded, plain_loaded)

    # keras-hub tasks override compile(), so loading does not compile them.
    _compile_lm(ours_loaded)
    _compile_lm(plain_loaded)
    before = utils.weights(plain_loaded)
    second = _tokens(B * K, seed=2)
    _fit_lm(ours_loaded, second, B)
    _fit_lm(plain_loaded, second, B * K)
    utils.assert_trained(before, utils.weights(plain_loaded))
    _assert_same_models(ours_loaded, plain_loaded)
    assert int(ours_loaded.optimizer.iterations) == int(
        plain_loaded.optimizer.iterations
    )


# ------------------------------------------- the trainable set after loading
N = 24  # samples: three micro-batches of 8
MB = 8


def _ours() -> GradientAccumulateModel:
    """Two micro-batches a cycle; a partial one stays pending after fit."""
    return utils.accumulating_model(accum_steps=2, flush_at_end=False)


def _compile(model):
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=utils.sparse_ce())


def _saved_mid_cycle(tmp_path):
    """Ours after 3 micro-batches (one update, one pending) and plain Keras
    after the same update, both saved; the files' paths."""
    x, y = utils.classification_data(N)
    ours, plain = utils.seeded(_ours), utils.seeded(utils.plain_model)
    _compile(ours)
    _compile(plain)
    ours.fit(x, y, batch_size=MB, shuffle=False, verbose=0)
    plain.fit(x[: 2 * MB], y[: 2 * MB], batch_size=2 * MB, shuffle=False, verbose=0)
    _assert_same_models(ours, plain)
    assert ours._accumulator.pending == 1
    ours.save(tmp_path / "ours.keras")
    plain.save(tmp_path / "plain.keras")
    return tmp_path / "ours.keras", tmp_path / "plain.keras"


def _freeze_first(model):
    model.layers[1].trainable = False


def _enable_lora(model):
    model.layers[1].enable_lora(2)


def _quantize(model):
    model.quantize("int8")


@pytest.mark.parametrize("change", [_freeze_first, _enable_lora, _quantize])
def test_trainable_set_changed_after_loading_drops_the_pending_cycle(change, tmp_path):
    ours_file, plain_file = _saved_mid_cycle(tmp_path)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*dropped")
        ours = keras.models.load_model(ours_file)
    plain = keras.models.load_model(plain_file)
    assert ours._accumulator.pending == 1  # the same trainable set: kept
    utils.seeded(lambda: change(ours))  # LoRA kernels start at random
    utils.seeded(lambda: change(plain))
    with pytest.warns(UserWarning, match=DROPPED):
        _compile(ours)
    _compile(plain)
    x, y = utils.classification_data(2 * MB, seed=1)
    before = utils.weights(plain)
    ours.fit(x, y, batch_size=MB, shuffle=False, verbose=0)
    plain.fit(x, y, batch_size=2 * MB, shuffle=False, verbose=0)
    utils.assert_trained(before, utils.weights(plain))
    _assert_same_models(ours, plain)


def test_weights_file_for_other_trainables_loads_with_a_warning(tmp_path):
    """``load_weights`` into a model that trains fewer variables than the
    file's state was built for: the weights load, the cycle is dropped."""
    x, y = utils.classification_data(N)
    ours = utils.seeded(_ours)
    _compile(ours)
    ours.fit(x, y, batch_size=MB, shuffle=False, verbose=0)
    assert ours._accumulator.pending == 1
    ours.save_weights(tmp_path / "ours.weights.h5")

    frozen = utils.seeded(_ours, seed=1)
    _freeze_first(frozen)
    _compile(frozen)
    frozen.fit(x[:MB], y[:MB], batch_size=MB, verbose=0)  # builds its state
    with pytest.warns(UserWarning, match=DROPPED):
        frozen.load_weights(tmp_path / "ours.weights.h5")
    assert frozen._accumulator.pending == 0
    utils.assert_same_weights(
        [np.asarray(w) for w in frozen.weights], [np.asarray(w) for w in ours.weights]
    )
    plain = utils.seeded(utils.plain_model, seed=2)
    plain.load_weights(tmp_path / "ours.weights.h5")
    _assert_same_models(plain, ours)
