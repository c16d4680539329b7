"""GradientAccumulateModel against plain Keras on the big batch, in each
Keras, for the inner optimizer's own settings: the optimizer itself (SGD,
momentum, Adam, AdamW, ...; tf-keras' legacy ones too), learning-rate
schedules, use_ema and clipping. (Once the same tests in
tests/keras3/test_model_equivalence.py and tests/keras2/test_model.py.)

The reference is a plain model built from the same seed and trained with
``fit(batch_size=B * K, shuffle=False)``; the accumulating run is
``GradientAccumulateModel(accum_steps=K)`` on micro-batches of B. Every test
also checks that training moved the weights, and the EMA and clipping tests
that the setting changed the outcome.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tests.flavour import LEGACY_KERAS, keras, utils
from tests.utils import train_pair  # written on the session's Keras

B = 8  # micro-batch size
K = 4  # accumulation steps
N = 64  # samples: a multiple of B * K, so cycles and big batches line up
EPOCHS = 2
UPDATES = EPOCHS * N // (B * K)


def _cnn_data(n: int = N):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 3, size=n)
    return x, y


if LEGACY_KERAS:
    # Current and legacy tf-keras optimizers, on the MLP.
    OPTIMIZERS = {
        f"mlp-{name}": (utils.mlp_layers, utils.classification_data, make)
        for name, make in utils.OPTIMIZERS.items()
    }
    SCHEDULES, EMA, CLIPPING = utils.SCHEDULES, utils.EMA, utils.CLIPPING
else:
    _KERAS3_OPTIMIZERS = {
        "sgd": lambda: keras.optimizers.SGD(0.1),
        "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(0.01),
        "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    }
    OPTIMIZERS = {
        f"{architecture}-{name}": (layers, data, make)
        for architecture, layers, data in (
            ("mlp", utils.mlp_layers, utils.classification_data),
            ("cnn", utils.cnn_layers, _cnn_data),
        )
        for name, make in _KERAS3_OPTIMIZERS.items()
    }
    schedules = keras.optimizers.schedules
    SCHEDULES = {
        # Halves every update: advancing per micro-batch would shrink it 16-fold.
        "exponential": lambda: keras.optimizers.SGD(
            schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.5)
        ),
        "piecewise": lambda: keras.optimizers.SGD(
            schedules.PiecewiseConstantDecay([1, 2], [0.2, 0.05, 0.01])
        ),
        "cosine": lambda: keras.optimizers.Adam(
            schedules.CosineDecay(0.02, decay_steps=UPDATES)
        ),
    }
    EMA = {
        "ema": lambda: keras.optimizers.Adam(0.02, use_ema=True, ema_momentum=0.5),
    }
    CLIPPING = {
        "clipnorm": lambda: keras.optimizers.SGD(0.5, clipnorm=0.05),
        "clipvalue": lambda: keras.optimizers.SGD(0.5, clipvalue=0.005),
        "global_clipnorm": lambda: keras.optimizers.SGD(0.5, global_clipnorm=0.05),
    }


def _equivalent(make_optimizer, x, y, layers=utils.mlp_layers):
    """Trains the pair, asserts it equivalent; returns (reference,
    accumulated)."""
    initial, reference, accumulated = train_pair(
        layers, make_optimizer, x, y, batch_size=B, accum_steps=K, epochs=EPOCHS
    )
    utils.assert_equivalent(initial, reference, accumulated, UPDATES)
    return reference, accumulated


def _assert_acted(make_optimizer, reference, x, y, failure: str) -> None:
    """Non-vacuity of a clipping or EMA case: ``reference`` ends away from
    the big batch trained with the same optimizer without them."""
    config = make_optimizer().get_config()
    for key in ("clipnorm", "clipvalue", "global_clipnorm"):
        config[key] = None
    if "use_ema" in config:
        config["use_ema"] = False
    kind = type(make_optimizer())
    plain = utils.seeded(utils.plain_model)
    plain.compile(optimizer=kind.from_config(config), loss=utils.sparse_ce())
    utils.fit(plain, x, y, B * K, epochs=EPOCHS)
    gap = utils.report(
        utils.max_abs_diff(utils.weights(plain), utils.weights(reference)),
        "non-vacuity gap",
    )
    assert gap > 1e-3, f"{failure} ({gap:.3g})"


def _current_learning_rate(optimizer) -> float:
    if LEGACY_KERAS and isinstance(optimizer, keras.optimizers.legacy.Optimizer):
        return float(optimizer._decayed_lr(tf.float32))
    return float(optimizer.learning_rate)


@pytest.mark.parametrize("case", list(OPTIMIZERS))
def test_optimizer_matches_big_batch(case):
    """K micro-batches of B give the big batch's weights and one update per
    cycle, for each inner optimizer (Keras 3: SGD, momentum, Adam and AdamW
    on an MLP and a CNN; tf-keras: current and legacy optimizers)."""
    layers, data, make_optimizer = OPTIMIZERS[case]
    x, y = data(N)
    _equivalent(make_optimizer, x, y, layers)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_learning_rate_schedule_advances_once_per_update(schedule):
    """A learning-rate schedule is evaluated at the update count, not the
    micro-batch count: weights, ``iterations`` and the current learning rate
    match the big batch's."""
    x, y = utils.classification_data(N)
    reference, accumulated = _equivalent(SCHEDULES[schedule], x, y)
    assert _current_learning_rate(accumulated.optimizer) == pytest.approx(
        _current_learning_rate(reference.optimizer), rel=1e-6
    )


@pytest.mark.parametrize("ema", list(EMA))
def test_ema_weights_match_big_batch(ema):
    """With use_ema=True the moving average advances once per update, and
    fit's final EMA swap gives the big batch's weights."""
    x, y = utils.classification_data(N)
    reference, _ = _equivalent(EMA[ema], x, y)
    _assert_acted(EMA[ema], reference, x, y, "EMA did not change the outcome")


@pytest.mark.parametrize("clip", list(CLIPPING))
def test_clipping_acts_on_accumulated_gradient(clip):
    """clipnorm / clipvalue / global_clipnorm on the inner optimizer clip the
    accumulated gradient once per update, as the big batch's own (clipping
    each micro-batch would give other weights)."""
    x, y = utils.classification_data(N)
    reference, _ = _equivalent(CLIPPING[clip], x, y)
    _assert_acted(CLIPPING[clip], reference, x, y, "clipping did not act")
