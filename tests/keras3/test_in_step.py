"""In-step micro-batching (``micro_batch_size``) against plain Keras.

``GradientAccumulateModel(micro_batch_size=m)`` with ``fit(batch_size=b)``
cuts every batch into slices of ``m`` inside one ``train_step``. Every test
trains plain ``keras.Model`` with ``batch_size=b`` (the reference: same
batches, one update each) and the in-step model from the same seed and data,
and compares the weights; one fit step must be one update.
"""

from __future__ import annotations

import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import config as tf_config

from gradient_accumulator import GradientAccumulateModel
from tests import utils
from tests.processes import describe, run_script

M = 8  # micro_batch_size
EPOCHS = 2


def _train_pair(
    layers,
    make_optimizer,
    x,
    y,
    *,
    batch_size: int,
    epochs: int = EPOCHS,
    accum_steps: int = 1,
    model_compile_kwargs=None,
    **kwargs,
):
    """``utils.train_pair`` with the in-step model (``micro_batch_size=M``),
    compiled also with ``model_compile_kwargs``; returns (initial weights,
    reference, model, and the histories of the two fits)."""
    initial, reference, model = utils.train_pair(
        layers,
        make_optimizer,
        x,
        y,
        batch_size=batch_size,
        accum_steps=accum_steps,
        epochs=epochs,
        model_kwargs={"micro_batch_size": M},
        accumulated_compile_kwargs=model_compile_kwargs,
        **kwargs,
    )
    # Keras keeps the History that fit returned as model.history.
    return initial, reference, model, reference.history, model.history


# The label the differences here are printed under (pytest -s), as in
# examples/in_step.py.
LABEL = "max |w_instep - w_bigbatch|"


def _assert_equivalent(initial, reference, model, updates: int) -> float:
    # Whether the in-step model moved was never asserted here: it matches the
    # reference, which must have moved.
    return utils.assert_equivalent(
        initial, reference, model, updates, accumulated_moved=False, label=LABEL
    )


def _sgd():
    return keras.optimizers.SGD(0.1, momentum=0.9)


def _adam():
    return keras.optimizers.Adam(0.01)


# ------------------------------------------------------------ exactness
@pytest.mark.parametrize("make_optimizer", [_sgd, _adam], ids=["sgd", "adam"])
def test_batch_split_in_micro_batches_matches_big_batch(make_optimizer):
    """fit(batch_size=32) cut into 4 slices of 8: the big batch's weights,
    one update per fit step, and the big batch's logged loss and accuracy."""
    n, batch = 64, 32
    x, y = utils.classification_data(n)
    initial, reference, model, expected, history = _train_pair(
        utils.mlp_layers,
        make_optimizer,
        x,
        y,
        batch_size=batch,
        compile_kwargs={"metrics": ["accuracy"]},
    )
    _assert_equivalent(initial, reference, model, EPOCHS * n // batch)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(
            history.history[key], expected.history[key], rtol=1e-5
        )


@pytest.mark.parametrize(
    ("n", "batch"),
    [(60, 30), (70, 32), (52, 5)],
    ids=["batch30_slices_8886", "last_batch_short_6", "batch_smaller_than_micro"],
)
def test_indivisible_batches_match_big_batch(n, batch):
    """Batches not divisible by the slice size: 30 = 8+8+8+6; a dataset of 70
    in batches of 32 whose last batch (6) is shorter than one slice; batches
    of 5 < 8 (no full slice at all). The short slice counts 6/30, not 1/4."""
    x, y = utils.classification_data(n)
    rng = np.random.default_rng(3)
    sample_weight = rng.uniform(0.1, 3.0, n).astype("float32")
    initial, reference, model, expected, history = _train_pair(
        utils.mlp_layers,
        _sgd,
        x,
        y,
        batch_size=batch,
        sample_weight=sample_weight,
        compile_kwargs={"metrics": ["accuracy"]},
    )
    _assert_equivalent(initial, reference, model, EPOCHS * -(-n // batch))
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(
            history.history[key], expected.history[key], rtol=1e-5
        )


def test_sum_reduction_matches_big_batch():
    """A loss with reduction="sum" (the batch's loss is the slices' sum, not a
    weighted mean), with a short slice: 30 = 8+8+8+6."""
    x, y = utils.classification_data(60)
    initial, reference, model, _, _ = _train_pair(
        utils.mlp_layers,
        lambda: keras.optimizers.SGD(0.005),
        x,
        y,
        batch_size=30,
        make_loss=lambda: utils.sparse_ce(reduction="sum"),
    )
    _assert_equivalent(initial, reference, model, EPOCHS * 2)


# ------------------------------------------------------- masks and weights
def _padded_sequences(n: int, seed: int = 0):
    """Slices with very different numbers of real tokens: short sequences
    first, long ones last in every batch of 32."""
    rng = np.random.default_rng(seed)
    lengths = np.tile(
        np.sort(rng.integers(1, utils.SEQ_LEN + 1, size=32)), n // 32 + 1
    )[:n]
    return utils.padded_sequences(lengths, rng)


@pytest.mark.parametrize("weighted", [False, True], ids=["mask", "mask+weights"])
def test_in_step_slices_of_masked_sequences_match_big_batch(weighted):
    """Padded sequences (Embedding mask_zero=True, per-token loss), batches of
    30 cut into 8+8+8+6: slices are weighted by their unmasked tokens (and
    per-token sample weights), not by their sizes."""
    x, y = _padded_sequences(60)
    sample_weight = (
        np.random.default_rng(4).uniform(0.2, 2.0, x.shape).astype("float32")
        if weighted
        else None
    )
    initial, reference, model, _, _ = _train_pair(
        utils.sequence_layers,
        lambda: keras.optimizers.SGD(0.5, momentum=0.9),
        x,
        y,
        batch_size=30,
        sample_weight=sample_weight,
    )
    _assert_equivalent(initial, reference, model, EPOCHS * 2)


def test_multi_output_matches_big_batch():
    """Two inputs, two outputs, a dict of losses with loss_weights."""
    x, y = utils.multi_io_data(60)
    initial, reference, model, _, _ = _train_pair(
        utils.multi_io_layers,
        _adam,
        x,
        y,
        batch_size=30,
        make_loss=utils.multi_io_losses,
        compile_kwargs={"loss_weights": {"cls": 1.0, "reg": 0.3}},
    )
    _assert_equivalent(initial, reference, model, EPOCHS * 2)


# --------------------------------------------------- composing accum_steps
def test_accum_steps_compose_with_micro_batches():
    """accum_steps=2 with micro_batch_size=8 and batch_size=16: each fit step
    is one micro-step of a 2-step cycle, so two fit steps (4 slices) make one
    update with the gradient of the 32 samples."""
    n = 64
    x, y = utils.classification_data(n)
    initial, reference, model, _, _ = _train_pair(
        utils.mlp_layers, _adam, x, y, batch_size=16, accum_steps=2
    )
    _assert_equivalent(initial, reference, model, EPOCHS * n // 32)


# ------------------------------------------------------------ other modes
@pytest.mark.parametrize(
    "compile_kwargs",
    [{"steps_per_execution": 3}, {"run_eagerly": True}],
    ids=["steps_per_execution", "run_eagerly"],
)
def test_execution_modes_match_big_batch(compile_kwargs):
    """Several steps per execution (the slice loop inside Keras' step loop)
    and eager execution (the loop and remainder run in Python)."""
    x, y = utils.classification_data(60)
    initial, reference, model, _, _ = _train_pair(
        utils.mlp_layers,
        _sgd,
        x,
        y,
        batch_size=30,
        model_compile_kwargs=compile_kwargs,
    )
    _assert_equivalent(initial, reference, model, EPOCHS * 2)


class _Subclassed(GradientAccumulateModel):
    def __init__(self, **kwargs):
        super().__init__(micro_batch_size=M, **kwargs)
        self.hidden = keras.layers.Dense(16, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.hidden(x))


def test_subclassed_model_built_inside_the_loop_matches_big_batch():
    """A subclassed model creates its variables (and the engine its state)
    in its first forward pass, which here runs inside the slice loop."""
    x, y = utils.classification_data(60)
    reference = utils.seeded(utils.plain_model)
    initial = utils.weights(reference)
    reference.compile(optimizer=_sgd(), loss=utils.sparse_ce())
    utils.fit(reference, x, y, 30, epochs=EPOCHS)
    model = utils.seeded(_Subclassed)
    assert not model.built
    model.compile(optimizer=_sgd(), loss=utils.sparse_ce())
    utils.fit(model, x, y, 30, epochs=EPOCHS)
    _assert_equivalent(initial, reference, model, EPOCHS * 2)


# ------------------------------------------------------------------- XLA
def test_in_step_slices_under_jit_compile_match_big_batch():
    """jit_compile=True: XLA compiles the slice loop (static slice shapes)
    and the remainder; op determinism is off, as Keras refuses XLA with it."""
    n = 70  # batches 32, 32, 6: full slices, and a batch shorter than one
    x, y = utils.classification_data(n)
    tf_config.disable_op_determinism()
    try:
        initial, reference, model, _, _ = _train_pair(
            utils.mlp_layers,
            _adam,
            x,
            y,
            batch_size=32,
            model_compile_kwargs={"jit_compile": True},
        )
        assert model.jit_compile is True
    finally:
        tf.config.experimental.enable_op_determinism()
    _assert_equivalent(initial, reference, model, EPOCHS * 3)


# ----------------------------------------------------------------- saving
def test_keras_file_round_trip_keeps_micro_batch_size(tmp_path):
    """.keras files keep micro_batch_size (no custom_objects needed) and the
    loaded model trains on like the original."""
    x, y = utils.classification_data(64)
    model = utils.seeded(lambda: utils.accumulating_model(micro_batch_size=5))
    assert model.micro_batch_size == 5
    assert model.get_config()["micro_batch_size"] == 5
    model.compile(optimizer=_adam(), loss=utils.sparse_ce())
    utils.fit(model, x, y, 16)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, GradientAccumulateModel)
    assert loaded.micro_batch_size == 5
    for m in (model, loaded):
        utils.fit(m, x, y, 16)
    utils.assert_same_weights(utils.weights(loaded), utils.weights(model))
    assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations) == 8


@pytest.mark.parametrize(
    ("value", "error"),
    [(0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError)],
)
def test_invalid_micro_batch_size_is_rejected(value, error):
    with pytest.raises(error, match="micro_batch_size"):
        utils.accumulating_model(micro_batch_size=value)


# ---------------------------------------------------------- mixed precision
def test_mixed_float16_stays_near_float32():
    """mixed_float16 with its dynamic loss scale trains, one update per fit
    step, and stays near float32 big-batch training.

    Tolerance 1e-3: float16 keeps 11 significant bits (relative rounding
    4.9e-4), so the hidden layer's activations and each slice's gradients
    carry ~1e-3 relative error; over 4 SGD updates of lr 0.1 that can move
    weights by up to ~1e-3 (measured here: ~2e-5, the output layer and the
    loss being float32). A wrong slice weighting or a loss scale left in the
    gradient would show far above it: training moves weights by > 1e-2.
    """
    n, batch = 60, 30
    x, y = utils.classification_data(n)
    reference = utils.seeded(utils.plain_model)
    initial = utils.weights(reference)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=utils.sparse_ce())
    utils.fit(reference, x, y, batch, epochs=EPOCHS)

    keras.mixed_precision.set_global_policy("mixed_float16")

    def layers():
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="tanh")(inputs)
        return inputs, keras.layers.Dense(3, dtype="float32")(hidden)

    model = utils.seeded(lambda: utils.accumulating_model(layers, micro_batch_size=M))
    assert model.layers[1].compute_dtype == "float16"
    # A moderate initial scale: the default (2**15) times the slice weight
    # folded into the loss (8) overflows float16 on the first steps, which
    # the dynamic scale then skips (as it should), making the update count
    # depend on the overflow history rather than on the slicing.
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=2.0**7
    )
    model.compile(optimizer=optimizer, loss=utils.sparse_ce())
    utils.fit(model, x, y, batch, epochs=EPOCHS)
    keras.mixed_precision.set_global_policy("float32")

    assert int(model.optimizer.iterations) == EPOCHS * n // batch
    utils.assert_trained(initial, utils.weights(reference))
    moved = utils.max_abs_diff(initial, utils.weights(reference))
    assert moved > 1e-2, moved  # so that 1e-3 is a meaningful bound
    diff = utils.assert_same_weights(
        utils.weights(model), utils.weights(reference), atol=1e-3
    )
    utils.report(diff, LABEL)


# ------------------------------------------------------- MirroredStrategy
_MIRRORED_CHILD = textwrap.dedent(
    """
    import os
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    tf.config.experimental.enable_op_determinism()
    import keras
    from tests import utils

    for n, batch in ((64, 32), (56, 28)):
        x, y = utils.classification_data(n)
        reference = utils.compiled(
            utils.plain_model, keras.optimizers.Adam(0.01), metrics=["accuracy"]
        )
        initial = utils.weights(reference)
        expected = utils.fit(reference, x, y, batch, epochs=2).history

        strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
        assert strategy.num_replicas_in_sync == 2
        with strategy.scope():
            model = utils.seeded(
                lambda: utils.accumulating_model(micro_batch_size=8)
            )
            model.compile(
                optimizer=keras.optimizers.Adam(0.01),
                loss=utils.sparse_ce(),
                metrics=["accuracy"],
            )
        got = utils.fit(model, x, y, batch, epochs=2)
        logs = max(
            abs(a / b - 1)
            for key in ("loss", "accuracy")
            for a, b in zip(got.history[key], expected[key])
        )
        moved = utils.max_abs_diff(initial, utils.weights(reference))
        diff = utils.max_abs_diff(utils.weights(model), utils.weights(reference))
        print(
            f"RESULT batch={batch} moved={moved:.3e} diff={diff:.3e} "
            f"iterations={int(model.optimizer.iterations.numpy())} logs={logs:.3e}"
        )
    """
)


def test_mirrored_strategy_matches_single_device_big_batch():
    """Two logical CPU replicas (a child process: devices must be configured
    before TensorFlow starts). Each replica slices its half of the batch
    (16 = 8+8, and 14 = 8+6); the engine's one all-reduce per update makes
    it the single-device big batch, with the big batch's logged loss and
    accuracy (metrics updated per slice in each replica)."""
    child = run_script("-c", _MIRRORED_CHILD, timeout=240)
    assert child.returncode == 0, describe(child)
    out = child.stdout
    results = [
        line.split()[1:] for line in out.splitlines() if line.startswith("RESULT")
    ]
    assert len(results) == 2, out
    for fields in results:
        values = dict(f.split("=") for f in fields)
        assert float(values["moved"]) > 1e-4, out
        assert float(values["diff"]) <= utils.ATOL, out
        assert int(values["iterations"]) == 4, out
        assert float(values["logs"]) <= 1e-5, out  # logged loss and accuracy
        print(f"\n[mirrored] {' '.join(fields)}")
