"""``AccumulationScheduler`` and ``FlushPartialCycle``, in each Keras, against
plain Keras on the big batch: accumulation schedules, flushed or dropped
partial cycles, and the partial cycle a fit ends with under EMA.

Keras swaps the EMA weights in (``finalize_variable_values``) after the last
epoch and before ``on_train_end``: a flush after that swap trains the
averaged weights and is off the big batch (0.022 on this model before the
fix, with ``every_epoch=False``). (The other cycle controls per Keras:
tests/keras3/test_training_control.py, tests/keras2/test_callbacks.py.)
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from sklearn.datasets import load_digits

from gradient_accumulator import (
    AccumulationScheduler,
    FlushPartialCycle,
    GradientAccumulateOptimizer,
)
from tests.flavour import LEGACY_KERAS, keras, utils

B = 8  # micro-batch size
K = 4
LR = 0.05


_accumulating = functools.partial(utils.compiled_accumulating, accum_steps=K)


def _fit(model, x, y, batch_size=B, **kwargs):
    return utils.fit(model, x, y, batch_size, **kwargs)  # micro-batches of B


def _same(model, reference) -> float:
    diff = utils.assert_same_weights(utils.weights(model), utils.weights(reference))
    return utils.report(diff)


# ---------------------------------------------------------------- schedules
def test_epoch_schedule_matches_growing_big_batches():
    """{0: 1, 1: 4}: epoch 0 trains at batch 8, epoch 1 at batch 32."""
    x, y = utils.classification_data(64)
    reference = utils.compiled_plain()
    initial = utils.weights(reference)
    _fit(reference, x, y, batch_size=B)
    _fit(reference, x, y, batch_size=K * B)

    model = _accumulating(accum_steps=1)
    _fit(model, x, y, epochs=2, callbacks=[AccumulationScheduler({0: 1, 1: 4})])
    assert model.accum_steps == 4
    assert int(model.optimizer.iterations) == 64 // B + 64 // (K * B) == 10
    utils.assert_trained(initial, utils.weights(model))
    _same(model, reference)


def test_update_count_schedule_changes_only_at_cycle_boundaries():
    """fn(updates): 2 updates of 2 micro-batches, then cycles of 4. The
    change is asked for mid-cycle by the callback and must wait."""
    x, y = utils.classification_data(64)
    reference = utils.compiled_plain()
    for start, stop in [(0, 16), (16, 32), (32, 64)]:  # one update each
        reference.train_on_batch(x[start:stop], y[start:stop])

    model = _accumulating(accum_steps=2)
    schedule = AccumulationScheduler(lambda updates: 2 if updates < 2 else 4)
    _fit(model, x, y, callbacks=[schedule])
    assert int(model.optimizer.iterations) == 3
    _same(model, reference)


if LEGACY_KERAS:  # current and legacy optimizers
    SGDS = {k: utils.OPTIMIZERS[k] for k in ("sgd", "legacy_sgd")}
    ADAMS = {k: utils.OPTIMIZERS[k] for k in ("adam", "legacy_adam")}
else:
    SGDS = {"sgd": lambda: keras.optimizers.SGD(LR)}
    ADAMS = {"adam": lambda: keras.optimizers.Adam(LR)}


@pytest.mark.parametrize("make_inner", SGDS.values(), ids=SGDS.keys())
def test_schedule_with_optimizer_wrapper(make_inner):
    """From accum_steps 1 (the Keras step, traced again at the change)."""
    x, y = utils.classification_data(64)
    reference = utils.compiled_plain(make_inner())
    _fit(reference, x, y, batch_size=B)
    _fit(reference, x, y, batch_size=K * B)

    opt = GradientAccumulateOptimizer(make_inner(), accum_steps=1)
    model = utils.compiled(utils.plain_model, opt)
    _fit(model, x, y, epochs=2, callbacks=[AccumulationScheduler({0: 1, 1: 4})])
    assert opt.accum_steps == 4
    assert int(opt.iterations) == 10
    _same(model, reference)


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
            _fit(utils.compiled_plain(), x, y, callbacks=[callback])


def test_callbacks_are_the_keras_callbacks():
    for callback in (AccumulationScheduler({0: 2}), FlushPartialCycle()):
        assert isinstance(callback, keras.callbacks.Callback)


# ----------------------------------------------------------- partial cycles
@pytest.mark.parametrize("make_inner", ADAMS.values(), ids=ADAMS.keys())
def test_flush_method_and_callback_for_optimizer_wrapper(make_inner):
    """Equal micro-batches (the optimizer wrapper weighs calls equally):
    3 of 8 per epoch, flushed by the callback each epoch: the big batch of
    24 per epoch."""
    x, y = utils.classification_data(24)
    reference = utils.compiled_plain(make_inner())
    _fit(reference, x, y, batch_size=24, epochs=2)

    opt = GradientAccumulateOptimizer(make_inner(), accum_steps=K)
    model = utils.compiled(utils.plain_model, opt)
    _fit(model, x, y, epochs=2, callbacks=[FlushPartialCycle()])
    assert int(opt.iterations) == 2
    _same(model, reference)

    opt.flush()  # an empty cycle: nothing happens
    assert int(opt.iterations) == 2


def test_flush_callback_validates_arguments():
    with pytest.raises(ValueError, match="mode"):
        FlushPartialCycle(mode="apply")
    with pytest.raises(TypeError, match="every_epoch"):
        FlushPartialCycle(every_epoch="yes")


# --------------------------------------------- the last partial cycle, EMA
def _digits(n: int = 40):
    """40 samples: one cycle of 4 micro-batches and one partial of 1."""
    x, y = load_digits(return_X_y=True)
    return (x[:n] / 16.0).astype("float32"), y[:n]


def _digit_layers():
    """The small MLP on the digits' 64 pixels, 10 classes."""
    return utils.mlp_layers(inputs_dim=64, classes=10)


def _ema_sgd():
    return keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.9)


def _ema_accumulating(wrapper: str):
    if wrapper == "model":
        # Without the model's own epoch-end and end-of-fit flushes, so the
        # callback decides.
        return utils.compiled(
            lambda: utils.accumulating_model(
                _digit_layers, accum_steps=K, partial_cycle="carry", flush_at_end=False
            ),
            _ema_sgd(),
        )
    optimizer = GradientAccumulateOptimizer(_ema_sgd(), accum_steps=K)
    return utils.compiled(lambda: utils.plain_model(_digit_layers), optimizer)


def _ema_big_batch(x, y, epochs: int, mode: str):
    """Plain Keras on the concatenated stream of micro-batches, in batches of
    K * B; a dropped partial cycle is a stream cut before it."""
    xs, ys = np.concatenate([x] * epochs), np.concatenate([y] * epochs)
    if mode == "drop":
        keep = len(xs) // (K * B) * K * B
        xs, ys = xs[:keep], ys[:keep]
    plain = utils.compiled(lambda: utils.plain_model(_digit_layers), _ema_sgd())
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
    # The stopping callback runs after FlushPartialCycle at the epoch end, so
    # only the host's end-of-fit moment (before the EMA swap) can flush.
    x, y = _digits()
    model = _ema_accumulating(wrapper)
    callbacks = [FlushPartialCycle("flush", every_epoch=False), _StopAfterFirstEpoch()]
    utils.fit(model, x, y, B, epochs=3, callbacks=callbacks)
    plain = _ema_big_batch(x, y, 1, "flush")
    assert int(model.optimizer.iterations) == int(plain.optimizer.iterations) == 2
    _same(model, plain)


def test_a_fit_without_the_callback_keeps_its_partial_cycle():
    # The callback's end-of-fit action is for its own fit only.
    x, y = _digits()
    model = _ema_accumulating("optimizer")
    utils.fit(model, x, y, B, callbacks=[FlushPartialCycle("flush", every_epoch=False)])
    assert int(model.optimizer.iterations) == 2
    utils.fit(model, x, y, B)
    # 5 more micro-batches: one more cycle, one micro-batch still pending.
    assert int(model.optimizer.iterations) == 3
    assert model.optimizer._accumulator.pending == 1


def test_pruning_step_per_update_is_for_tf_keras():
    """TensorFlow Model Optimization is tf-keras only, and so is its callback
    (its behaviour: tests/keras2/test_pruning.py)."""
    import gradient_accumulator as ga

    if LEGACY_KERAS:
        from gradient_accumulator.keras2 import PruningStepPerUpdate

        assert ga.PruningStepPerUpdate is PruningStepPerUpdate
        assert issubclass(PruningStepPerUpdate, keras.callbacks.Callback)
        return
    message = r"is for tf-keras \(TF_USE_LEGACY_KERAS=1\), as TensorFlow Model"
    with pytest.raises(ImportError, match=message):
        from gradient_accumulator import PruningStepPerUpdate
    with pytest.raises(ImportError, match=message):
        ga.PruningStepPerUpdate  # noqa: B018
    assert "PruningStepPerUpdate" not in ga.__all__
