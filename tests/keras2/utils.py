"""Shared helpers of the tf-keras exactness tests: the reference is always
plain tf-keras ``fit`` on the big batch, from the same seed and weights."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf
import tf_keras

# The helpers that are the same in both Kerases, for the tests that import
# them from here.
from tests.utils import (  # noqa: F401
    ATOL,
    PADDED_LENGTHS,
    SEQ_LEN,
    VOCAB,
    accumulating_model,
    assert_same_weights,
    assert_trained,
    classification_data,
    compiled,
    compiled_accumulating,
    compiled_plain,
    fit,
    max_abs_diff,
    mlp_layers,
    padded_sequences,
    padding_heads,
    plain_model,
    pretraining_layers,
    report,
    seeded,
    sequential_mlp,
    sparse_ce,
)

B = 8  # micro-batch size
K = 4  # accumulation steps
N = 64  # samples: a multiple of B * K, so cycles and big batches line up
EPOCHS = 2
UPDATES = EPOCHS * N // (B * K)

legacy = tf_keras.optimizers.legacy

# Inner optimizers, each a fresh instance per call.
OPTIMIZERS = {
    "sgd": lambda: tf_keras.optimizers.SGD(0.1),
    "nesterov": lambda: tf_keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: tf_keras.optimizers.Adam(0.01),
    "adamw": lambda: tf_keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "rmsprop": lambda: tf_keras.optimizers.RMSprop(0.01),
    "legacy_sgd": lambda: legacy.SGD(0.1),
    "legacy_adam": lambda: legacy.Adam(0.01),
}


# SGD with momentum and Adam, current and legacy: the inner optimizers of the
# XLA and multi-worker tests.
MOMENTUM_AND_ADAM = {
    "sgd_momentum": lambda: tf_keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": OPTIMIZERS["adam"],
    "legacy_sgd_momentum": lambda: legacy.SGD(0.05, momentum=0.9),
    "legacy_adam": OPTIMIZERS["legacy_adam"],
}


def _halving(kind):
    """``kind`` SGD whose learning rate halves at every update: advancing per
    micro-batch instead would shrink it K-fold faster."""
    schedule = tf_keras.optimizers.schedules.ExponentialDecay(
        0.2, decay_steps=1, decay_rate=0.5
    )
    return lambda: kind.SGD(schedule)


SCHEDULES = {
    "exponential_decay": _halving(tf_keras.optimizers),
    "legacy_exponential_decay": _halving(legacy),
}

# Clipping on the inner optimizer, small enough to act (see unclipped_gap).
CLIPPING = {
    "clipnorm": lambda: tf_keras.optimizers.SGD(0.5, clipnorm=0.05),
    "global_clipnorm": lambda: tf_keras.optimizers.SGD(0.5, global_clipnorm=0.05),
    "clipvalue": lambda: tf_keras.optimizers.SGD(0.5, clipvalue=0.005),
    "legacy_clipnorm": lambda: legacy.SGD(0.5, clipnorm=0.05),
}

EMA = {
    "ema": lambda: tf_keras.optimizers.Adam(0.02, use_ema=True, ema_momentum=0.5),
    "ema_overwrite_frequency": lambda: tf_keras.optimizers.Adam(
        0.02, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2
    ),
}


# -------------------------------------------------------------------- models
def regularized_layers():
    """The MLP with an L2 kernel regularizer on its hidden layer."""
    return mlp_layers(regularizer=tf_keras.regularizers.L2(0.05))


def sequence_layers():
    """(inputs, outputs) of a masked per-token tagger: Embedding(mask_zero=True),
    a per-timestep Dense, Dense(VOCAB) logits (the mask propagates)."""
    inputs = tf_keras.Input((SEQ_LEN,), dtype="int32")
    h = tf_keras.layers.Embedding(VOCAB, 8, mask_zero=True)(inputs)
    h = tf_keras.layers.Dense(8, activation="tanh")(h)
    outputs = tf_keras.layers.Dense(VOCAB)(h)
    return inputs, outputs


def two_output_layers():
    """One input (8), two outputs: "cls" (3 logits) and "reg" (1)."""
    inputs = tf_keras.Input((8,))
    h = tf_keras.layers.Dense(16, activation="tanh")(inputs)
    cls = tf_keras.layers.Dense(3, name="cls")(h)
    reg = tf_keras.layers.Dense(1, name="reg")(h)
    return inputs, {"cls": cls, "reg": reg}


def digits_data(n: int = N):
    """The first ``n`` of scikit-learn's bundled 8x8 digits, flattened and
    scaled to [0, 1], with their labels (0..9)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (digits.data[:n] / 16.0).astype("float32"), digits.target[:n]


def two_output_data(n: int, seed: int = 7):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = {
        "cls": rng.integers(0, 3, size=n),
        "reg": rng.normal(size=(n, 1)).astype("float32"),
    }
    return x, y


def unknown_length(x, y, batch_size: int) -> tf.data.Dataset:
    """``(x, y)`` in batches of ``batch_size``, of unknown cardinality."""
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
    dataset = dataset.filter(lambda *a: True)
    assert int(dataset.cardinality()) == int(tf.data.UNKNOWN_CARDINALITY)
    return dataset


def big_batch(
    make_optimizer: Callable,
    x,
    y,
    *,
    layers: Callable = mlp_layers,
    batch_size: int = B * K,
    epochs: int = EPOCHS,
    make_loss: Callable = sparse_ce,
    compile_kwargs: dict | None = None,
    **fit_kwargs,
):
    """The reference: plain tf-keras, seeded, trained with ``fit`` on the big
    batch. Returns (initial weights, model)."""
    model = seeded(lambda: plain_model(layers))
    initial = weights(model)
    model.compile(optimizer=make_optimizer(), loss=make_loss(), **compile_kwargs or {})
    fit(model, x, y, batch_size, epochs=epochs, **fit_kwargs)
    return initial, model


def naive_sgd_step(layers: Callable, x, y, lr: float, micro_batch: int, **loss):
    """Weights after one SGD step with the *equal-weight* mean of the
    gradients of the ``micro_batch``-sized slices (what naive accumulation
    would apply), with tf-keras' own compiled loss (masks and sample weights
    as ``fit`` applies them), from the seeded initial weights.

    ``loss``: ``make_loss`` and ``sample_weight``."""
    make_loss = loss.get("make_loss", sparse_ce)
    sample_weight = loss.get("sample_weight")
    model = seeded(lambda: plain_model(layers))
    model.compile(optimizer=tf_keras.optimizers.SGD(lr), loss=make_loss())
    starts = range(0, len(x), micro_batch)
    total = None
    for start in starts:
        part = slice(start, start + micro_batch)
        weight = None if sample_weight is None else tf.constant(sample_weight[part])
        with tf.GradientTape() as tape:
            pred = model(x[part], training=True)
            value = model.compute_loss(x[part], tf.constant(y[part]), pred, weight)
        grads = tape.gradient(value, model.trainable_weights)
        grads = [tf.convert_to_tensor(g).numpy() for g in grads]
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    return [w - lr * g / len(starts) for w, g in zip(weights(model), total)]


class WeightsAtBatchEnd(tf_keras.callbacks.Callback):
    """Records the trainable weights after every training step."""

    def __init__(self):
        super().__init__()
        self.seen: list[list[np.ndarray]] = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(weights(self.model))


def big_batch_without_the_middle_cycle(make_optimizer: Callable, x, y):
    """The reference of a run whose second of three cycles is skipped: plain
    tf-keras, seeded, trained on cycles 1 and 3 in batches of B * K.
    Returns (initial weights, model)."""
    reference = seeded(plain_model)
    initial = weights(reference)
    reference.compile(optimizer=make_optimizer(), loss=sparse_ce())
    for start in (0, 2 * B * K):
        fit(reference, x[start : start + B * K], y[start : start + B * K], B * K)
    return initial, reference


def fit_skipping_the_middle_cycle(model, x, y, initial) -> None:
    """Fits ``model`` in micro-batches of B over three cycles of K, the second
    holding a non-finite micro-batch: the first cycle moves the weights, the
    second leaves them bit-for-bit (and finite), the third moves them."""
    seen = WeightsAtBatchEnd()
    fit(model, x, y, B, callbacks=[seen])
    assert len(seen.seen) == 3 * K
    after_first, after_second = seen.seen[K - 1], seen.seen[2 * K - 1]
    assert_trained(initial, after_first)
    assert_finite(after_second)
    assert max_abs_diff(after_first, after_second) == 0.0
    assert_trained(after_second, seen.seen[-1])
    assert_finite(weights(model))


# ----------------------------------------------------------------- checking
def weights(model) -> list[np.ndarray]:
    """The model's trainable weights as NumPy arrays."""
    return [w.numpy() for w in model.trainable_weights]


def assert_finite(values) -> None:
    assert all(np.all(np.isfinite(v)) for v in values), "non-finite weights"


def assert_equivalent(initial, reference, accumulated, updates: int) -> float:
    """Both models moved, agree within ``ATOL`` and made ``updates`` optimizer
    updates; reports and returns the max difference."""
    assert_trained(initial, weights(reference))
    assert_trained(initial, weights(accumulated))
    diff = assert_same_weights(weights(accumulated), weights(reference))
    assert int(reference.optimizer.iterations) == updates
    assert int(accumulated.optimizer.iterations) == updates
    return report(diff)


def unclipped_gap(make_optimizer: Callable, reference, x, y) -> float:
    """How far the big batch trained with ``make_optimizer()`` stripped of
    clipping and EMA ends from ``reference``: non-vacuity of those cases.
    (The stripped runs are few and identical across tests: cached.)"""
    config = make_optimizer().get_config()
    for key in ("clipnorm", "clipvalue", "global_clipnorm"):
        config[key] = None
    if "use_ema" in config:
        config["use_ema"] = False
    config.pop("name", None)
    kind = type(make_optimizer())
    key = (kind, repr(sorted(config.items())), x.tobytes(), y.tobytes())
    if key not in _STRIPPED:
        _, plain = big_batch(lambda: kind.from_config(config), x, y)
        _STRIPPED[key] = weights(plain)
    return max_abs_diff(_STRIPPED[key], weights(reference))


_STRIPPED: dict = {}


def assert_acted(make_optimizer: Callable, reference, failure: str) -> None:
    """Non-vacuity of a clipping or EMA case: ``reference`` (trained on
    ``classification_data()``) ends away from the big batch trained without
    them; ``failure`` says what did not act."""
    x, y = classification_data()
    gap = report(unclipped_gap(make_optimizer, reference, x, y), "non-vacuity gap")
    assert gap > 1e-3, f"{failure} ({gap:.3g})"
