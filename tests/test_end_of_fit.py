"""The partial cycle a fit ends with, under EMA, for every setting of
``FlushPartialCycle`` and both wrappers, against plain Keras on the big batch.

Keras swaps the EMA weights in (``finalize_variable_values``) after the last
epoch and before ``on_train_end``: a flush after that swap trains the
averaged weights and is off the big batch (0.022 on this model before the
fix, with ``every_epoch=False``).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from sklearn.datasets import load_digits

from gradient_accumulator import (
    FlushPartialCycle,
    GradientAccumulateOptimizer,
)
from tests import utils

K, B = 4, 8  # 40 samples: one cycle of 4 micro-batches and one partial of 1


def _digits(n: int = 40):
    x, y = load_digits(return_X_y=True)
    return (x[:n] / 16.0).astype("float32"), y[:n]


def _layers():
    """The small MLP on the digits' 64 pixels, 10 classes."""
    return utils.mlp_layers(inputs_dim=64, classes=10)


def _ema_sgd():
    return keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.9)


def _accumulating(wrapper: str) -> keras.Model:
    if wrapper == "model":
        # Without the model's own end-of-fit flush, so the callback decides.
        model = utils.accumulating_model(_layers, accum_steps=K, flush_at_end=False)
        model.compile(optimizer=_ema_sgd(), loss=utils.sparse_ce())
    else:
        model = utils.plain_model(_layers)
        optimizer = GradientAccumulateOptimizer(_ema_sgd(), accum_steps=K)
        model.compile(optimizer=optimizer, loss=utils.sparse_ce())
    return model


def _big_batch(x, y, epochs: int, mode: str) -> keras.Model:
    """Plain Keras on the concatenated stream of micro-batches, in batches of
    K * B; a dropped partial cycle is a stream cut before it."""
    xs, ys = np.concatenate([x] * epochs), np.concatenate([y] * epochs)
    if mode == "drop":
        keep = len(xs) // (K * B) * K * B
        xs, ys = xs[:keep], ys[:keep]
    plain = utils.seeded(lambda: utils.plain_model(_layers))
    plain.compile(optimizer=_ema_sgd(), loss=utils.sparse_ce())
    utils.fit(plain, xs, ys, K * B)
    return plain


class _StopAfterFirstEpoch(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        self.model.stop_training = True


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
@pytest.mark.parametrize("mode", ["flush", "drop"])
@pytest.mark.parametrize("every_epoch", [True, False])
def test_last_partial_cycle_under_ema_equals_big_batch(wrapper, mode, every_epoch):
    x, y = _digits()
    epochs = 1 if every_epoch else 2  # every_epoch=False carries across epochs
    model = utils.seeded(lambda: _accumulating(wrapper))
    before = utils.weights(model)
    callback = FlushPartialCycle(mode, every_epoch=every_epoch)
    utils.fit(model, x, y, B, epochs=epochs, callbacks=[callback])
    plain = _big_batch(x, y, epochs, mode)
    assert int(model.optimizer.iterations) == int(plain.optimizer.iterations)
    utils.assert_trained(before, utils.weights(model))
    utils.report(utils.assert_same_weights(utils.weights(model), utils.weights(plain)))


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_flush_when_a_later_callback_stops_training(wrapper):
    # The stopping callback runs after FlushPartialCycle at the epoch end, so
    # only the host's end-of-fit moment (before the EMA swap) can flush.
    x, y = _digits()
    model = utils.seeded(lambda: _accumulating(wrapper))
    callbacks = [FlushPartialCycle("flush", every_epoch=False), _StopAfterFirstEpoch()]
    utils.fit(model, x, y, B, epochs=3, callbacks=callbacks)
    plain = _big_batch(x, y, 1, "flush")
    assert int(model.optimizer.iterations) == int(plain.optimizer.iterations) == 2
    utils.report(utils.assert_same_weights(utils.weights(model), utils.weights(plain)))


def test_a_fit_without_the_callback_keeps_its_partial_cycle():
    # The callback's end-of-fit action is for its own fit only.
    x, y = _digits()
    model = utils.seeded(lambda: _accumulating("optimizer"))
    utils.fit(model, x, y, B, callbacks=[FlushPartialCycle("flush", every_epoch=False)])
    assert int(model.optimizer.iterations) == 2
    utils.fit(model, x, y, B)
    # 5 more micro-batches: one more cycle, one micro-batch still pending.
    assert int(model.optimizer.iterations) == 3
    assert model.optimizer._accumulator.pending == 1
