"""tf-keras ``AccumulationScheduler`` and ``FlushPartialCycle``, from the
user's side: accumulation schedules and flushed or dropped partial cycles
(also the last one of a fit under EMA, which tf-keras swaps in before
``on_train_end``) match plain tf-keras on the big batch."""

from __future__ import annotations

import numpy as np
import pytest
import tf_keras

from gradient_accumulator import (
    AccumulationScheduler,
    FlushPartialCycle,
    GradientAccumulateModel,
    GradientAccumulateOptimizer,
)
from tests.keras2 import utils

B, K, LR = 8, 4, 0.05


def _compiled(build, optimizer=None):
    """``build()``, seeded and compiled with ``optimizer`` (Adam(LR))."""

    def make():
        model = build()
        model.compile(optimizer or tf_keras.optimizers.Adam(LR), utils.sparse_ce())
        return model

    return utils.seeded(make)


def _plain(optimizer=None):
    return _compiled(utils.plain_model, optimizer)


def _wrapper(optimizer=None, **settings):
    settings.setdefault("accum_steps", K)
    return _compiled(lambda: utils.accumulating_model(**settings), optimizer)


def _optimizer_wrapped(inner, accum_steps=K):
    return _compiled(
        utils.plain_model, GradientAccumulateOptimizer(inner, accum_steps=accum_steps)
    )


def _fit(model, x, y, batch_size=B, **kwargs):
    return utils.fit(model, x, y, batch_size, **kwargs)


def _train_on(model, x, y, batches) -> None:
    """Plain tf-keras, one update per ``(start, stop)`` slice."""
    for start, stop in batches:
        model.train_on_batch(x[start:stop], y[start:stop])


def _same(model, reference) -> float:
    diff = utils.assert_same_weights(utils.weights(model), utils.weights(reference))
    return utils.report(diff)


# ---------------------------------------------------------------- schedules
def test_epoch_schedule_matches_growing_big_batches():
    """{0: 1, 1: 4}: epoch 0 trains at batch 8, epoch 1 at batch 32."""
    x, y = utils.classification_data(64)
    reference = _plain()
    initial = utils.weights(reference)
    _fit(reference, x, y, batch_size=B)
    _fit(reference, x, y, batch_size=K * B)

    model = _wrapper(accum_steps=1)
    _fit(model, x, y, epochs=2, callbacks=[AccumulationScheduler({0: 1, 1: 4})])
    assert model.accum_steps == 4
    assert int(model.optimizer.iterations) == 64 // B + 64 // (K * B) == 10
    utils.assert_trained(initial, utils.weights(model))
    _same(model, reference)


def test_update_count_schedule_changes_only_at_cycle_boundaries():
    """fn(updates): 2 updates of 2 micro-batches, then cycles of 4; the
    change asked for mid-cycle waits for the cycle's end."""
    x, y = utils.classification_data(64)
    reference = _plain()
    _train_on(reference, x, y, [(0, 16), (16, 32), (32, 64)])

    model = _wrapper(accum_steps=2)
    schedule = AccumulationScheduler(lambda updates: 2 if updates < 2 else 4)
    _fit(model, x, y, callbacks=[schedule])
    assert int(model.optimizer.iterations) == 3
    _same(model, reference)


@pytest.mark.parametrize("kind", ["sgd", "legacy_sgd"])
def test_schedule_with_optimizer_wrapper(kind):
    """From accum_steps 1 (tf-keras' own step, traced again at the change)."""
    x, y = utils.classification_data(64)
    reference = _plain(utils.OPTIMIZERS[kind]())
    _fit(reference, x, y, batch_size=B)
    _fit(reference, x, y, batch_size=K * B)

    model = _optimizer_wrapped(utils.OPTIMIZERS[kind](), accum_steps=1)
    _fit(model, x, y, epochs=2, callbacks=[AccumulationScheduler({0: 1, 1: 4})])
    assert model.optimizer.accum_steps == 4
    assert int(model.optimizer.iterations) == 10
    _same(model, reference)


def test_scheduled_accum_steps_survives_a_keras_file(tmp_path):
    x, y = utils.classification_data(64)
    model = _wrapper(accum_steps=1)
    _fit(model, x, y, epochs=2, callbacks=[AccumulationScheduler({1: 8})])
    assert model.accum_steps == 8
    model.save(tmp_path / "m.keras")
    loaded = tf_keras.models.load_model(tmp_path / "m.keras")
    assert isinstance(loaded, GradientAccumulateModel)
    assert loaded.accum_steps == 8


@pytest.mark.parametrize(
    "schedule, error",
    [
        ({}, ValueError),
        ({-1: 2}, ValueError),
        ({True: 2}, ValueError),
        ({0: 0}, ValueError),
        ({0: 2.5}, TypeError),
        ("4", TypeError),
    ],
)
def test_scheduler_validates_schedule(schedule, error):
    with pytest.raises(error, match="schedule"):
        AccumulationScheduler(schedule)


def test_callbacks_need_an_accumulating_model():
    x, y = utils.classification_data(16)
    for callback in (AccumulationScheduler({0: 2}), FlushPartialCycle()):
        with pytest.raises(ValueError, match="GradientAccumulateModel"):
            _fit(_plain(), x, y, callbacks=[callback])


def test_callbacks_are_tf_keras_callbacks():
    for callback in (AccumulationScheduler({0: 2}), FlushPartialCycle()):
        assert isinstance(callback, tf_keras.callbacks.Callback)


# ----------------------------------------------------------- partial cycles
@pytest.mark.parametrize("kind", ["adam", "legacy_adam"])
def test_flush_callback_for_optimizer_wrapper(kind):
    """3 micro-batches of 8 per epoch, flushed each epoch: the big batch of
    24 per epoch."""
    x, y = utils.classification_data(24)
    reference = _plain(utils.OPTIMIZERS[kind]())
    _fit(reference, x, y, batch_size=24, epochs=2)

    model = _optimizer_wrapped(utils.OPTIMIZERS[kind]())
    _fit(model, x, y, epochs=2, callbacks=[FlushPartialCycle()])
    assert int(model.optimizer.iterations) == 2
    _same(model, reference)
    model.optimizer.flush()  # an empty cycle: nothing happens
    assert int(model.optimizer.iterations) == 2


def test_drop_callback_for_optimizer_wrapper():
    x, y = utils.classification_data(40)  # 4 + 1 micro-batches per epoch
    reference = _plain()
    _fit(reference, x[:32], y[:32], batch_size=32, epochs=2)

    model = _optimizer_wrapped(tf_keras.optimizers.Adam(LR))
    _fit(model, x, y, epochs=2, callbacks=[FlushPartialCycle("drop")])
    assert int(model.optimizer.iterations) == 2
    assert model.optimizer._accumulator.pending == 0
    _same(model, reference)


def test_flush_callback_validates_arguments():
    with pytest.raises(ValueError, match="mode"):
        FlushPartialCycle(mode="apply")
    with pytest.raises(TypeError, match="every_epoch"):
        FlushPartialCycle(every_epoch="yes")


# --------------------------------------------- the last partial cycle, EMA
def _digit_layers():
    return utils.mlp_layers(inputs_dim=64, classes=10)


def _ema_sgd():
    return tf_keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.9)


def _ema_accumulating(wrapper: str):
    if wrapper == "model":
        # Without the model's own end-of-fit flush: the callback decides.
        build = lambda: utils.accumulating_model(  # noqa: E731
            _digit_layers, accum_steps=K, flush_at_end=False
        )
        return _compiled(build, _ema_sgd())
    build = lambda: utils.plain_model(_digit_layers)  # noqa: E731
    return _compiled(build, GradientAccumulateOptimizer(_ema_sgd(), accum_steps=K))


def _ema_big_batch(x, y, epochs: int, mode: str):
    """Plain tf-keras on the stream of micro-batches in batches of K * B; a
    dropped partial cycle is a stream cut before it."""
    xs, ys = np.concatenate([x] * epochs), np.concatenate([y] * epochs)
    if mode == "drop":
        keep = len(xs) // (K * B) * K * B
        xs, ys = xs[:keep], ys[:keep]
    plain = _compiled(lambda: utils.plain_model(_digit_layers), _ema_sgd())
    utils.fit(plain, xs, ys, K * B)
    return plain


class _StopAfterFirstEpoch(tf_keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        self.model.stop_training = True


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
@pytest.mark.parametrize("mode", ["flush", "drop"])
@pytest.mark.parametrize("every_epoch", [True, False])
def test_last_partial_cycle_under_ema_equals_big_batch(wrapper, mode, every_epoch):
    """40 samples: a cycle of 4 micro-batches and a partial one of 1."""
    x, y = utils.digits_data(40)
    epochs = 1 if every_epoch else 2  # every_epoch=False carries across epochs
    model = _ema_accumulating(wrapper)
    before = utils.weights(model)
    callback = FlushPartialCycle(mode, every_epoch=every_epoch)
    utils.fit(model, x, y, B, epochs=epochs, callbacks=[callback])
    plain = _ema_big_batch(x, y, epochs, mode)
    assert int(model.optimizer.iterations) == int(plain.optimizer.iterations)
    utils.assert_trained(before, utils.weights(model))
    _same(model, plain)


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_flush_when_a_later_callback_stops_training(wrapper):
    x, y = utils.digits_data(40)
    model = _ema_accumulating(wrapper)
    callbacks = [FlushPartialCycle("flush", every_epoch=False), _StopAfterFirstEpoch()]
    utils.fit(model, x, y, B, epochs=3, callbacks=callbacks)
    plain = _ema_big_batch(x, y, 1, "flush")
    assert int(model.optimizer.iterations) == int(plain.optimizer.iterations) == 2
    _same(model, plain)


def test_a_fit_without_the_callback_keeps_its_partial_cycle():
    x, y = utils.digits_data(40)
    model = _ema_accumulating("optimizer")
    utils.fit(model, x, y, B, callbacks=[FlushPartialCycle("flush", every_epoch=False)])
    assert int(model.optimizer.iterations) == 2
    utils.fit(model, x, y, B)
    # 5 more micro-batches: one more cycle, one micro-batch still pending.
    assert int(model.optimizer.iterations) == 3
    assert model.optimizer._accumulator.pending == 1
