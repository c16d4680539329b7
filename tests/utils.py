"""Shared helpers: the reference is always plain Keras on the big batch.

In the Keras of the session (``tests/flavour.py``): the tf-keras suite's
helpers (``tests/keras2/utils.py``) take theirs from here where they are
the same."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel, GradientAccumulateOptimizer
from tests.flavour import keras

# float32 with deterministic ops: accumulation reorders sums, nothing more.
ATOL = 2e-5
# Token ids 0..VOCAB-1 (0 pads) and steps of the sequence helpers.
VOCAB = 12
SEQ_LEN = 10


def seeded(build: Callable[[], keras.Model], seed: int = 0) -> keras.Model:
    """Calls ``build`` with all Keras/NumPy/TF seeds set, so that two calls
    give identical initial weights."""
    keras.utils.set_random_seed(seed)
    return build()


def mlp_layers(inputs_dim: int = 8, classes: int = 3, regularizer=None):
    """(inputs, outputs) of a small MLP, for functional models."""
    inputs = keras.Input((inputs_dim,))
    hidden = keras.layers.Dense(16, activation="tanh", kernel_regularizer=regularizer)(
        inputs
    )
    outputs = keras.layers.Dense(classes)(hidden)
    return inputs, outputs


def sequential_mlp() -> keras.Model:
    """The small MLP as a ``Sequential`` model."""
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(3),
        ]
    )


def plain_model(layers: Callable = mlp_layers) -> keras.Model:
    """A plain ``keras.Model`` over ``layers()`` (by default the small MLP)."""
    return keras.Model(*layers())


def accumulating_model(
    layers: Callable = mlp_layers, **kwargs
) -> GradientAccumulateModel:
    """``GradientAccumulateModel(**kwargs)`` over ``layers()`` (by default the
    small MLP)."""
    inputs, outputs = layers()
    return GradientAccumulateModel(inputs=inputs, outputs=outputs, **kwargs)


def cnn_layers(shape=(8, 8, 1), classes: int = 3):
    inputs = keras.Input(shape)
    h = keras.layers.Conv2D(4, 3, activation="relu")(inputs)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    outputs = keras.layers.Dense(classes)(h)
    return inputs, outputs


def sequence_layers(kind: str = "gru"):
    """(inputs, outputs) of a masked per-token tagger: Embedding(mask_zero=True),
    a GRU, an LSTM or (any other ``kind``) a TimeDistributed Dense, Dense(VOCAB)."""
    inputs = keras.Input((SEQ_LEN,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(inputs)
    if kind == "gru":
        h = keras.layers.GRU(8, return_sequences=True)(h)
    elif kind == "lstm":
        h = keras.layers.LSTM(8, return_sequences=True)(h)
    else:
        h = keras.layers.TimeDistributed(keras.layers.Dense(8, activation="tanh"))(h)
    outputs = keras.layers.Dense(VOCAB)(h)
    return inputs, outputs


# One cycle of 4 micro-batches of 8 sequence lengths: mostly padding first,
# nearly full last (about 10, 30, 55 and 78 real tokens), then a cycle in the
# reverse order (for padded_sequences).
PADDED_CYCLE = [
    [1, 1, 2, 1, 1, 2, 1, 1],
    [3, 4, 3, 5, 4, 3, 4, 4],
    [6, 7, 7, 6, 8, 7, 7, 7],
    [10, 9, 10, 10, 9, 10, 10, 10],
]
PADDED_LENGTHS = [n for micro in PADDED_CYCLE for n in micro] + [
    n for micro in reversed(PADDED_CYCLE) for n in micro
]


def pretraining_layers(
    vocab: int,
    length: int,
    heads: tuple[str, str],
    regularizer=None,
    mask_zero: bool = True,
):
    """(inputs, outputs) of a tiny BERT-like model over ``length`` token ids:
    an embedding, a dense trunk, a token head (logits per position) and a
    sequence head (2 classes), named by ``heads``."""
    token_head, sequence_head = heads
    tokens = keras.Input((length,), dtype="int32")
    h = keras.layers.Embedding(vocab, 8, mask_zero=mask_zero)(tokens)
    h = keras.layers.Dense(8, activation="tanh", kernel_regularizer=regularizer)(h)
    per_token = keras.layers.Dense(vocab, name=token_head)(h)
    pooled = keras.layers.GlobalAveragePooling1D()(h)
    per_sequence = keras.layers.Dense(2, name=sequence_head)(pooled)
    return tokens, {token_head: per_token, sequence_head: per_sequence}


def padding_heads(vocab: int, length: int, token_head: str, sequence_head: str):
    """(inputs, outputs) of two heads over ``length`` token ids: a token head
    over masked embeddings (``mask_zero``) and a sequence head (2 classes)
    pooled from unmasked ones (a masked average over padding alone is 0 / 0
    in the big batch too), by the given names."""
    tokens = keras.Input((length,), dtype="int32")
    h = keras.layers.Embedding(vocab, 8, mask_zero=True)(tokens)
    per_token = keras.layers.Dense(vocab, name=token_head)(h)
    pooled = keras.layers.GlobalAveragePooling1D()(
        keras.layers.Embedding(vocab, 4)(tokens)
    )
    per_sequence = keras.layers.Dense(2, name=sequence_head)(pooled)
    return tokens, {token_head: per_token, sequence_head: per_sequence}


def padded_sequences(lengths, seed=0):
    """Token ids in 1..VOCAB-1 for the first ``length`` steps, 0 (padding)
    after; per-token targets everywhere (the padded ones must be masked).
    ``seed`` may also be a NumPy ``Generator``, which is drawn from."""
    rng = np.random.default_rng(seed)
    x = np.zeros((len(lengths), SEQ_LEN), dtype="int32")
    for i, length in enumerate(lengths):
        x[i, :length] = rng.integers(1, VOCAB, size=length)
    y = rng.integers(0, VOCAB, size=(len(lengths), SEQ_LEN))
    return x, y


def token_corpus(n: int, length: int, vocab: int, seed: int = 0):
    """``n`` sequences of 1 to ``length`` real tokens (ids 1..vocab-1, 0 pads
    after them): micro-batches with very different token counts; targets
    ``{"tokens": one per position, "sequence": one of 2 per sequence}``."""
    rng = np.random.default_rng(seed)
    x = np.zeros((n, length), "int32")
    for i, real in enumerate(rng.integers(1, length + 1, size=n)):
        x[i, :real] = rng.integers(1, vocab, size=real)
    y = {
        "tokens": rng.integers(0, vocab, size=(n, length)),
        "sequence": rng.integers(0, 2, size=n),
    }
    return x, y


def multi_io_layers():
    """Two inputs ("a": 8, "b": 4), two outputs ("cls": 3 logits, "reg": 1)."""
    a = keras.Input((8,), name="a")
    b = keras.Input((4,), name="b")
    h = keras.layers.Concatenate()([a, b])
    h = keras.layers.Dense(16, activation="tanh")(h)
    cls = keras.layers.Dense(3, name="cls")(h)
    reg = keras.layers.Dense(1, name="reg")(h)
    return {"a": a, "b": b}, {"cls": cls, "reg": reg}


def multi_io_data(n: int, seed: int = 7):
    """``n`` samples for ``multi_io_layers``: dicts of inputs and targets."""
    rng = np.random.default_rng(seed)
    x = {
        "a": rng.normal(size=(n, 8)).astype("float32"),
        "b": rng.normal(size=(n, 4)).astype("float32"),
    }
    y = {
        "cls": rng.integers(0, 3, size=n),
        "reg": rng.normal(size=(n, 1)).astype("float32"),
    }
    return x, y


def multi_io_losses():
    """The losses of ``multi_io_layers``' outputs, by name."""
    return {"cls": sparse_ce(), "reg": keras.losses.MeanSquaredError()}


def classification_data(n: int = 64, dim: int = 8, classes: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, dim)).astype("float32")
    y = rng.integers(0, classes, size=n)
    return x, y


def heterogeneous(n_micro: int, micro: int, shape, seed: int = 0) -> np.ndarray:
    """``n_micro`` micro-batches of ``micro`` samples, each with its own
    per-channel mean (from -4 to 6) and standard deviation (0.05 to 4)."""
    rng = np.random.default_rng(seed)
    parts = []
    for _ in range(n_micro):
        loc = rng.uniform(-4, 6, size=shape[-1])
        scale = rng.uniform(0.05, 4, size=shape[-1])
        parts.append(rng.normal(loc, scale, size=(micro, *shape)))
    return np.concatenate(parts).astype("float32")


def sparse_ce(**kwargs) -> keras.losses.Loss:
    """Sparse categorical cross-entropy on logits, the loss most tests use."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, **kwargs)


def compiled(
    make_model: Callable, optimizer=None, lr: float = 0.05, **compile_kwargs
) -> keras.Model:
    """``make_model()``, seeded and compiled with ``optimizer`` (by default
    ``Adam(lr)``), sparse cross-entropy and ``compile_kwargs``."""

    def build():
        model = make_model()
        model.compile(
            optimizer=optimizer or keras.optimizers.Adam(lr),
            loss=sparse_ce(),
            **compile_kwargs,
        )
        return model

    return seeded(build)


def compiled_plain(optimizer=None) -> keras.Model:
    """``compiled`` over the small MLP."""
    return compiled(plain_model, optimizer)


def compiled_accumulating(optimizer=None, **kwargs) -> GradientAccumulateModel:
    """``compiled`` over ``GradientAccumulateModel(**kwargs)`` on the MLP."""
    return compiled(lambda: accumulating_model(**kwargs), optimizer)


def fit(model: keras.Model, x, y=None, batch_size=None, epochs: int = 1, **kwargs):
    """``model.fit`` in data order (``shuffle=False``) and silently; returns
    the history."""
    return model.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **kwargs
    )


def freeze_train_unfreeze(runs, x, y, make_second_optimizer: Callable) -> None:
    """Keras' transfer-learning recipe for each ``(model, base, batch_size)``
    of ``runs``: ``base`` frozen, Adam(1e-2), 2 epochs; then unfrozen,
    recompiled with ``make_second_optimizer()``, 2 epochs more."""
    for model, base, batch_size in runs:
        base.trainable = False
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=sparse_ce())
        fit(model, x, y, batch_size, epochs=2)
        base.trainable = True
        model.compile(optimizer=make_second_optimizer(), loss=sparse_ce())
        fit(model, x, y, batch_size, epochs=2)


class Interrupt(Exception):
    """What ``InterruptAt`` raises: a training run cut short."""


class InterruptAt(keras.callbacks.Callback):
    """Raises ``Interrupt`` at the end of a given batch of a given epoch."""

    def __init__(self, epoch: int, batch: int):
        super().__init__()
        self.epoch, self.batch = epoch, batch
        self._current = None

    def on_epoch_begin(self, epoch, logs=None):
        self._current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self._current == self.epoch and batch == self.batch:
            raise Interrupt(f"interrupted at epoch {self.epoch}, batch {batch}")


def naive_sgd_step(
    layers: Callable,
    x,
    y,
    lr: float,
    micro_batch: int,
    make_loss: Callable = sparse_ce,
    sample_weight=None,
) -> list[np.ndarray]:
    """Weights after one SGD step with the *equal-weight* mean of the gradients
    of the ``micro_batch``-sized slices (what naive accumulation would apply),
    computed with plain Keras/TensorFlow from the seeded initial weights."""
    model = seeded(lambda: plain_model(layers))
    loss_fn = make_loss()
    grads = None
    starts = range(0, len(x), micro_batch)
    for start in starts:
        part = slice(start, start + micro_batch)
        weight = None if sample_weight is None else sample_weight[part]
        with tf.GradientTape() as tape:
            loss = loss_fn(y[part], model(x[part], training=True), weight)
        grads_k = tape.gradient(loss, model.trainable_weights)
        micro = [np.asarray(tf.convert_to_tensor(g)) for g in grads_k]
        grads = micro if grads is None else [a + b for a, b in zip(grads, micro)]
    return [
        w - lr * g / len(starts) for w, g in zip(weights(model), grads, strict=True)
    ]


def accumulator(model: keras.Model):
    """The accumulation state of ``model``: its own, or that of the
    ``GradientAccumulateOptimizer`` in its chain of optimizers."""
    if isinstance(model, GradientAccumulateModel):
        return model._accumulator
    optimizer = model.optimizer
    while not isinstance(optimizer, GradientAccumulateOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer._accumulator


def weights(model: keras.Model) -> list[np.ndarray]:
    """The model's trainable weights as NumPy arrays."""
    return [np.asarray(w) for w in model.trainable_weights]


def max_abs_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b)
    )


def report(diff: float, label: str = "max |w_accum - w_bigbatch|") -> float:
    """Prints a measured difference (visible with ``pytest -s``); returns it."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    print(f"\n[{label}] {test}: {diff:.3g}")
    return diff


def assert_same_weights(a, b, atol: float = ATOL) -> float:
    """Asserts two weight lists agree within ``atol``; returns the max diff.

    Also asserts that training moved the weights at all is the caller's job
    (see ``assert_trained``)."""
    diff = max_abs_diff(a, b)
    assert diff <= atol, f"max |w_accum - w_bigbatch| = {diff:.3g} > {atol:g}"
    return diff


def assert_trained(before, after, min_change: float = 1e-4) -> None:
    """Guards equivalence tests against comparing two untouched models."""
    change = max_abs_diff(before, after)
    assert change > min_change, f"weights moved by only {change:.3g}"


def train_pair(
    layers: Callable,
    make_optimizer: Callable,
    x,
    y,
    *,
    batch_size: int,
    accum_steps: int,
    epochs: int,
    reference_batch: int | None = None,
    sample_weight=None,
    make_loss: Callable = sparse_ce,
    compile_kwargs: dict | None = None,
    model_kwargs: dict | None = None,
    accumulated_compile_kwargs: dict | None = None,
):
    """Trains plain Keras with ``batch_size=reference_batch`` (by default
    ``batch_size * accum_steps``) and ``GradientAccumulateModel(accum_steps,
    **model_kwargs)`` with ``batch_size``, from the same seeded weights; both
    are compiled with ``compile_kwargs``, the accumulated model also with
    ``accumulated_compile_kwargs``.

    Returns (initial weights, reference, accumulated)."""
    compile_kwargs = compile_kwargs or {}
    model_kwargs = model_kwargs or {}
    accumulated_compile_kwargs = accumulated_compile_kwargs or {}
    run = {"sample_weight": sample_weight, "epochs": epochs}
    reference = seeded(lambda: plain_model(layers))
    initial = weights(reference)
    reference.compile(optimizer=make_optimizer(), loss=make_loss(), **compile_kwargs)
    if reference_batch is None:
        reference_batch = batch_size * accum_steps
    fit(reference, x, y, reference_batch, **run)

    accumulated = seeded(
        lambda: accumulating_model(layers, accum_steps=accum_steps, **model_kwargs)
    )
    assert max_abs_diff(initial, weights(accumulated)) == 0.0
    accumulated.compile(
        optimizer=make_optimizer(),
        loss=make_loss(),
        **compile_kwargs,
        **accumulated_compile_kwargs,
    )
    fit(accumulated, x, y, batch_size, **run)
    return initial, reference, accumulated


def assert_equivalent(
    initial,
    reference,
    accumulated,
    updates: int,
    *,
    accumulated_moved: bool = True,
    label: str = "max |w_accum - w_bigbatch|",
) -> float:
    """Asserts that training moved the weights (the reference's, and the
    accumulated model's unless ``accumulated_moved=False``), that the
    accumulated model matches the reference and that both made ``updates``
    updates; reports (under ``label``) and returns the max difference."""
    assert_trained(initial, weights(reference))
    if accumulated_moved:
        assert_trained(initial, weights(accumulated))
    diff = assert_same_weights(weights(accumulated), weights(reference))
    assert int(reference.optimizer.iterations) == updates
    assert int(accumulated.optimizer.iterations) == updates
    return report(diff, label)
