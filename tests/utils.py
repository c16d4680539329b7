"""Shared helpers: the reference is always plain Keras on the big batch."""

from __future__ import annotations

import os
from collections.abc import Callable

import keras
import numpy as np

from gradient_accumulator import GradientAccumulateModel, GradientAccumulateOptimizer

# float32 with deterministic ops: accumulation reorders sums, nothing more.
ATOL = 2e-5


def seeded(build: Callable[[], keras.Model], seed: int = 0) -> keras.Model:
    """Calls ``build`` with all Keras/NumPy/TF seeds set, so that two calls
    give identical initial weights."""
    keras.utils.set_random_seed(seed)
    return build()


def mlp_layers(inputs_dim: int = 8, classes: int = 3):
    """(inputs, outputs) of a small MLP, for functional models."""
    inputs = keras.Input((inputs_dim,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    outputs = keras.layers.Dense(classes)(hidden)
    return inputs, outputs


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


def classification_data(n: int = 64, dim: int = 8, classes: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, dim)).astype("float32")
    y = rng.integers(0, classes, size=n)
    return x, y


def sparse_ce(**kwargs) -> keras.losses.Loss:
    """Sparse categorical cross-entropy on logits, the loss most tests use."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, **kwargs)


def fit(model: keras.Model, x, y, batch_size: int, epochs: int = 1, **kwargs):
    """``model.fit`` in data order (``shuffle=False``) and silently; returns
    the history."""
    return model.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **kwargs
    )


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
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


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
):
    """Trains plain Keras with ``batch_size=reference_batch`` (by default
    ``batch_size * accum_steps``) and ``GradientAccumulateModel(accum_steps)``
    with ``batch_size``, from the same seeded weights.

    Returns (initial weights, reference, accumulated)."""
    compile_kwargs = compile_kwargs or {}
    run = {"sample_weight": sample_weight, "epochs": epochs}
    reference = seeded(lambda: plain_model(layers))
    initial = weights(reference)
    reference.compile(optimizer=make_optimizer(), loss=make_loss(), **compile_kwargs)
    if reference_batch is None:
        reference_batch = batch_size * accum_steps
    fit(reference, x, y, reference_batch, **run)

    accumulated = seeded(lambda: accumulating_model(layers, accum_steps=accum_steps))
    assert max_abs_diff(initial, weights(accumulated)) == 0.0
    accumulated.compile(optimizer=make_optimizer(), loss=make_loss(), **compile_kwargs)
    fit(accumulated, x, y, batch_size, **run)
    return initial, reference, accumulated


def assert_equivalent(
    initial, reference, accumulated, updates: int, *, accumulated_moved: bool = True
) -> float:
    """Asserts that training moved the weights (the reference's, and the
    accumulated model's unless ``accumulated_moved=False``), that the
    accumulated model matches the reference and that both made ``updates``
    updates; reports and returns the max difference."""
    assert_trained(initial, weights(reference))
    if accumulated_moved:
        assert_trained(initial, weights(accumulated))
    diff = assert_same_weights(weights(accumulated), weights(reference))
    assert int(reference.optimizer.iterations) == updates
    assert int(accumulated.optimizer.iterations) == updates
    return report(diff)
