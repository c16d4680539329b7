"""Several loss denominators (MLM over masked tokens + NSP over sequences,
``tests/keras3/test_denominators.py``) under the compile/fit modes and optimizers
that touch the extra gradient sums (``Engine.part``): XLA, mixed_float16
(loss scaling and the backward share unscale every group), steps_per_execution
over an unknown-length ``tf.data`` pipeline, Adam and ``global_clipnorm``
(which must act on the folded, combined gradient). Every run is compared with
plain Keras on the concatenated big batch.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import config as tf_config

from tests import utils
from tests.keras3.test_denominators import (
    LENGTH,
    LR,
    MICRO,
    VOCAB,
    K,
    N,
    _corpus,
    _losses,
    _pretraining,
    _weights,
)
from tests.keras3.test_mixed_precision import MARGIN

CYCLE = MICRO * K
CLIPNORM = 0.02  # the first big batch's gradient norm is ~0.17 (asserted >4x)


def _train(
    make_optimizer=lambda: keras.optimizers.SGD(LR),
    *,
    epochs: int = 1,
    seed: int = 0,
    accumulated_compile_kwargs=None,
    layers=None,
):
    """Plain Keras on the big batch and the accumulating model (streaming,
    ``K`` micro-batches of ``MICRO``) on the MLM + NSP corpus; returns
    (initial, reference, accumulated)."""
    x, y, masked = _corpus(seed)
    return utils.train_pair(
        layers or _pretraining(),
        make_optimizer,
        x,
        y,
        batch_size=MICRO,
        accum_steps=K,
        epochs=epochs,
        sample_weight=_weights(masked),
        make_loss=_losses(),
        accumulated_compile_kwargs=accumulated_compile_kwargs,
    )


def _has_a_part(model) -> None:
    # The token head's denominator really went through an engine part.
    assert len(utils.accumulator(model).parts) == 1


# ---------------------------------------------------------------------- XLA
def test_loss_parts_under_jit_compile_match_big_batch():
    """jit_compile=True: XLA compiles the train step with its extra backward
    pass and the part's sums. Keras refuses XLA under op determinism, so it
    is off for this test (and restored after)."""
    tf_config.disable_op_determinism()
    try:
        initial, reference, accumulated = _train(
            accumulated_compile_kwargs={"jit_compile": True}
        )
        assert accumulated.jit_compile is True
    finally:
        tf.config.experimental.enable_op_determinism()
    # The reference is plain float32 Keras without XLA (the exact target).
    # XLA may fuse and reorder the float32 sums (the softmax cross-entropy,
    # the per-token weighted sums) but computes the same quantities, so the
    # float32 ATOL (2e-5, ~100x the ~1e-7 roundoff of a ~0.1 update) holds
    # unchanged; measured 1.1e-8.
    utils.assert_equivalent(initial, reference, accumulated, N // CYCLE)
    _has_a_part(accumulated)


# ------------------------------------------------------------ mixed_float16
def test_mixed_float16_is_as_close_to_float32_as_keras_mixed():
    """mixed_float16 (compile wraps SGD in a LossScaleOptimizer; every group's
    gradients are unscaled by the loss scale and the backward share):
    accumulating is no further from the float32 big batch than Keras' own
    mixed big batch is, times ``MARGIN`` (tests/keras3/test_mixed_precision.py).

    Measured: ours 1.0e-4, Keras' mixed 7.1e-5 (ratio 1.4; 0.4 to 1.6 over
    corpus seeds 0-5). The leader's float16 gradients are the whole
    gradient minus the token group's, so they carry the token head's float16
    rounding too, which the plain big batch does not separate. A broken
    split (one divisor for both heads) is 5.6e-3 off."""
    x, y, masked = _corpus()
    sw = _weights(masked)
    try:
        initial, reference, _ = _train()

        keras.mixed_precision.set_global_policy("mixed_float16")
        keras_mixed = utils.seeded(lambda: keras.Model(*_pretraining()()))
        assert utils.max_abs_diff(initial, utils.weights(keras_mixed)) == 0.0
        keras_mixed.compile(optimizer=keras.optimizers.SGD(LR), loss=_losses()())
        utils.fit(keras_mixed, x, y, CYCLE, sample_weight=sw)

        accumulated = utils.seeded(
            lambda: utils.accumulating_model(_pretraining(), accum_steps=K)
        )
        assert accumulated.get_layer("mlm").compute_dtype == "float16"
        accumulated.compile(optimizer=keras.optimizers.SGD(LR), loss=_losses()())
        assert isinstance(accumulated.optimizer, keras.optimizers.LossScaleOptimizer)
        utils.fit(accumulated, x, y, MICRO, sample_weight=sw)
    finally:
        keras.mixed_precision.set_global_policy("float32")

    updates = N // CYCLE
    assert int(keras_mixed.optimizer.iterations) == updates
    assert int(accumulated.optimizer.iterations) == updates
    utils.assert_trained(initial, utils.weights(accumulated))
    low_precision_error = utils.max_abs_diff(
        utils.weights(keras_mixed), utils.weights(reference)
    )
    # The policy really computed in float16, and only that far off.
    assert 0 < low_precision_error < 1e-3, low_precision_error
    ours = utils.max_abs_diff(utils.weights(accumulated), utils.weights(reference))
    utils.report(ours, "max |w_accum_mixed - w_bigbatch_f32|")
    utils.report(low_precision_error, "max |w_keras_mixed - w_bigbatch_f32|")
    assert ours <= MARGIN * low_precision_error, (ours, low_precision_error)
    _has_a_part(accumulated)


# ------------------------------------- steps_per_execution, unknown length
def _unknown_length(x, y, sw, batch: int) -> tf.data.Dataset:
    dataset = tf.data.Dataset.from_tensor_slices((x, y, sw)).batch(batch)
    dataset = dataset.filter(lambda *a: True)
    assert int(dataset.cardinality()) == int(tf.data.UNKNOWN_CARDINALITY)
    return dataset


# Keras warns so at the end of any unknown-length dataset, plain models too.
@pytest.mark.filterwarnings("ignore:Your input ran out of data")
@pytest.mark.parametrize(
    "steps_per_execution",
    [2, 3],
    ids=["aligned", "straddling"],  # 3: cycles of 4 cross executions
)
def test_steps_per_execution_on_an_unknown_length_dataset(steps_per_execution):
    """Streaming from a tf.data pipeline of unknown cardinality with
    steps_per_execution > 1: two epochs of 8 micro-batches, 4 updates."""
    x, y, masked = _corpus(seed=1)
    sw = _weights(masked)
    epochs = 2
    reference = utils.seeded(lambda: keras.Model(*_pretraining()()))
    initial = utils.weights(reference)
    reference.compile(optimizer=keras.optimizers.SGD(LR), loss=_losses()())
    utils.fit(reference, x, y, CYCLE, epochs, sample_weight=sw)

    accumulated = utils.seeded(
        lambda: utils.accumulating_model(_pretraining(), accum_steps=K)
    )
    accumulated.compile(
        optimizer=keras.optimizers.SGD(LR),
        loss=_losses()(),
        steps_per_execution=steps_per_execution,
    )
    accumulated.fit(
        _unknown_length(x, y, sw, MICRO), epochs=epochs, verbose=0, shuffle=False
    )
    utils.assert_equivalent(initial, reference, accumulated, epochs * N // CYCLE)
    _has_a_part(accumulated)


# ----------------------------------------------------- Adam, global_clipnorm
class _DenseEmbedding(keras.layers.Embedding):
    """An Embedding (same weights, same initialisation) looked up by a
    one-hot matmul, so that its gradient is dense.

    Keras' own Embedding gives an ``IndexedSlices`` gradient with one row per
    token occurrence, and on repeated tokens Keras' Adam squares those rows
    before adding duplicates up, and its global_clipnorm takes the norm of the
    unsummed rows; plain Keras' big batch is then not the update of its own
    summed gradient (docs/faq.md), while accumulation sums first. Measured on
    this corpus with the sparse embedding: 3.5e-2 off with Adam, 1.8e-4 with
    either optimizer under global_clipnorm; with this layer, ~1e-7."""

    def call(self, inputs):
        one_hot = keras.ops.one_hot(inputs, self.input_dim, dtype=self.compute_dtype)
        return keras.ops.matmul(one_hot, self.embeddings)


def _dense_pretraining():
    """``tests.keras3.test_denominators._pretraining()`` with ``_DenseEmbedding``."""

    def layers():
        tokens = keras.Input((LENGTH,), dtype="int32")
        h = _DenseEmbedding(VOCAB, 8)(tokens)
        h = keras.layers.Dense(8, activation="tanh")(h)
        mlm = keras.layers.Dense(VOCAB, name="mlm")(h)
        pooled = keras.layers.GlobalAveragePooling1D()(h)
        nsp = keras.layers.Dense(2, name="nsp")(pooled)
        return tokens, {"mlm": mlm, "nsp": nsp}

    return layers


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(
        0.01, global_clipnorm=CLIPNORM
    ),
    "sgd_global_clipnorm": lambda: keras.optimizers.SGD(
        LR, momentum=0.5, global_clipnorm=CLIPNORM
    ),
}


def _unclipped(make_optimizer):
    optimizer = make_optimizer()
    config = optimizer.get_config()
    config["global_clipnorm"] = None
    return lambda: type(optimizer).from_config(config)


def _big_batch(make_optimizer, epochs: int) -> list[np.ndarray]:
    """Plain Keras' weights after ``epochs`` on the big batch."""
    x, y, masked = _corpus()
    model = utils.seeded(lambda: keras.Model(*_dense_pretraining()()))
    model.compile(optimizer=make_optimizer(), loss=_losses()())
    utils.fit(model, x, y, CYCLE, epochs, sample_weight=_weights(masked))
    return utils.weights(model)


def _big_batch_grad_norm() -> float:
    """Global norm of the first big batch's gradient at the initial weights,
    with Keras' own loss (token term over the masked tokens)."""
    x, y, masked = _corpus()
    model = utils.seeded(lambda: keras.Model(*_dense_pretraining()()))
    model.compile(optimizer=keras.optimizers.SGD(LR), loss=_losses()())
    sw = {k: tf.constant(v[:CYCLE]) for k, v in _weights(masked).items()}
    yb = {k: tf.constant(v[:CYCLE]) for k, v in y.items()}
    with tf.GradientTape() as tape:
        pred = model(x[:CYCLE], training=True)
        loss = model.compute_loss(x[:CYCLE], yb, pred, sw)
    grads = tape.gradient(loss, model.trainable_weights)
    return float(tf.linalg.global_norm([tf.convert_to_tensor(g) for g in grads]))


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_adam_and_global_clipnorm_match_big_batch(optimizer):
    """Adam (state from the combined gradient) and global_clipnorm, which
    must scale the folded gradient of both denominators by the big batch's
    global norm. Two epochs, 4 updates."""
    make = OPTIMIZERS[optimizer]
    epochs = 2
    initial, reference, accumulated = _train(
        make, epochs=epochs, layers=_dense_pretraining()
    )
    utils.assert_equivalent(initial, reference, accumulated, epochs * N // CYCLE)
    _has_a_part(accumulated)
    if "clipnorm" in optimizer:
        # Clipping was active: far below the gradient's norm, and the big
        # batch without it ends elsewhere.
        assert _big_batch_grad_norm() > 4 * CLIPNORM
        unclipped = _big_batch(_unclipped(make), epochs=epochs)
        gap = utils.max_abs_diff(unclipped, utils.weights(reference))
        utils.report(gap, "max |w_unclipped - w_clipped| (big batch)")
        assert gap > 100 * utils.ATOL, f"clipping moved the weights by {gap:.3g}"
