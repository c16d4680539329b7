"""Training control, against plain Keras on the big batch: accumulation
schedules, partial cycles (carry / flush / drop), the skip hook, cycle-aware
logs and adaptive gradient clipping (against a NumPy reference). (The
callbacks, in both Kerases: tests/both/test_callbacks.py.)"""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator import (
    GradientAccumulateModel,
    accumulate,
    adaptive_clip_grad,
    unitwise_norm,
)
from tests import utils

B = 8  # micro-batch size
K = 4
LR = 0.05


_compiled = utils.compiled


_plain = utils.compiled_plain


_accumulating = functools.partial(utils.compiled_accumulating, accum_steps=K)


def _fit(model, x, y, batch_size=B, **kwargs):
    """``utils.fit``, in micro-batches of B unless told otherwise."""
    return utils.fit(model, x, y, batch_size, **kwargs)


def _train_on(model, x, y, batches) -> None:
    """Plain Keras, one update per ``(start, stop)`` slice of ``x``/``y``."""
    for start, stop in batches:
        model.train_on_batch(x[start:stop], y[start:stop])


# ---------------------------------------------------------------- schedules
def test_changed_accum_steps_survives_keras_file(tmp_path):
    x, y = utils.classification_data(32)
    model = _accumulating(accum_steps=2)
    _fit(model, x, y)
    model.set_accum_steps(8)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.accum_steps == 8
    assert int(loaded._accumulator.accum_steps_variable) == 8


# ----------------------------------------------------------- partial cycles
def test_flush_each_epoch_matches_short_big_batches():
    """20 samples, micro-batches 8/8/4, accum_steps=4: flushing at each epoch
    end is big-batch training with one batch of 20 per epoch."""
    x, y = utils.classification_data(20)
    reference = _plain()
    _fit(reference, x, y, batch_size=32, epochs=3)

    model = _accumulating(partial_cycle="flush")
    _fit(model, x, y, epochs=3)
    assert int(model.optimizer.iterations) == 3
    utils.assert_same_weights(utils.weights(model), utils.weights(reference))


def test_carry_across_epochs_then_flush_at_end_of_fit():
    """Carry (the default before 1.0): cycles straddle the epoch boundary;
    the partial cycle left when fit ends is applied, so no data is lost."""
    x, y = utils.classification_data(20)
    xx, yy = np.concatenate([x, x]), np.concatenate([y, y])
    reference = _plain()
    # Epoch 1 holds 8/8/4, epoch 2 starts with 8: one cycle of 28 samples;
    # the remaining 8/4 of epoch 2 are flushed at the end.
    _train_on(reference, xx, yy, [(0, 28), (28, 40)])

    model = _accumulating(partial_cycle="carry")
    _fit(model, x, y, epochs=2)
    assert int(model.optimizer.iterations) == 2
    assert int(model._accumulator.micro_step) == 0
    utils.assert_same_weights(utils.weights(model), utils.weights(reference))


def test_drop_discards_partial_cycles():
    x, y = utils.classification_data(36)  # 8/8/8/8 then a 4 that is dropped
    reference = _plain()
    for _ in range(2):
        _train_on(reference, x, y, [(0, 32)])

    model = _accumulating(partial_cycle="drop")
    _fit(model, x, y, epochs=2)
    assert int(model.optimizer.iterations) == 2
    assert float(model._accumulator.weight_sum) == 0.0
    utils.assert_same_weights(utils.weights(model), utils.weights(reference))


def test_explicit_flush_and_drop_methods():
    x, y = utils.classification_data(16)
    model = _accumulating(flush_at_end=False)
    before = utils.weights(model)
    _fit(model, x, y)  # 2 of 4 micro-batches pending
    assert int(model._accumulator.micro_step) == 2
    model.drop_partial_cycle()
    assert int(model.optimizer.iterations) == 0
    assert utils.max_abs_diff(before, utils.weights(model)) == 0.0

    reference = _plain()
    reference.train_on_batch(x, y)
    _fit(model, x, y)
    model.flush()
    assert int(model.optimizer.iterations) == 1
    utils.assert_same_weights(utils.weights(model), utils.weights(reference))


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"partial_cycle": "apply"}, ValueError),
        ({"flush_at_end": 1}, TypeError),
        ({"skip_update_fn": 3}, TypeError),
    ],
)
def test_model_validates_cycle_arguments(kwargs, error):
    name = next(iter(kwargs))
    with pytest.raises(error, match=name):
        _accumulating(**kwargs)


# ------------------------------------------------------------------ skipping
def test_skip_update_fn_skips_whole_cycles():
    """Skip cycles whose mean gradient is large: the middle cycle has
    targets that give a far larger gradient, and is skipped as a whole."""
    x, _ = utils.classification_data(96)
    y = np.concatenate([np.zeros(32), np.full(32, 100.0), np.zeros(32)]).astype(
        "float32"
    )[:, None]
    mse = keras.losses.MeanSquaredError()

    def build(model_cls, **kwargs):
        def make():
            inputs = keras.Input((8,))
            outputs = keras.layers.Dense(1)(inputs)
            model = model_cls(inputs=inputs, outputs=outputs, **kwargs)
            model.compile(optimizer=keras.optimizers.SGD(0.01), loss=mse)
            return model

        return utils.seeded(make)

    reference = build(keras.Model)
    _train_on(reference, x, y, [(0, 32), (64, 96)])

    def too_large(grads, variables):
        return tf.linalg.global_norm(grads) > 50.0

    model = build(GradientAccumulateModel, accum_steps=K, skip_update_fn=too_large)
    _fit(model, x, y)
    assert int(model.optimizer.iterations) == 2
    utils.assert_same_weights(utils.weights(model), utils.weights(reference))


# ---------------------------------------------------------------------- logs
def test_progress_logs_tell_updates_from_micro_steps():
    """With ``progress_logs=True``: ``update`` is 1 on the steps that applied a cycle,
    ``effective_batch`` its sample count, ``grad_norm`` the global norm of the
    big batch's gradient (computed here with a plain tape)."""
    x, y = utils.classification_data(2 * K * B)
    plain = _plain()
    with tf.GradientTape() as tape:
        loss = utils.sparse_ce()(y[: K * B], plain(x[: K * B]))
    expected_norm = float(
        tf.linalg.global_norm(tape.gradient(loss, plain.trainable_weights))
    )

    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append({k: float(logs[k]) for k in ("update", "grad_norm")})
            seen[-1]["effective_batch"] = float(logs["effective_batch"])

    model = _accumulating(progress_logs=True)
    history = _fit(model, x, y, callbacks=[Record()])
    assert [s["update"] for s in seen] == [0, 0, 0, 1, 0, 0, 0, 1]
    assert seen[3]["effective_batch"] == K * B
    assert seen[3]["grad_norm"] == pytest.approx(expected_norm, rel=1e-5)
    assert seen[0]["grad_norm"] == 0.0  # no update yet
    assert history.history["update"] == [1.0]


# ----------------------------------------------------------------------- AGC
def _np_unitwise_norm(x: np.ndarray) -> np.ndarray:
    if x.ndim <= 1:
        return np.sqrt(np.sum(x**2))
    axis = (0,) if x.ndim in (2, 3) else tuple(range(x.ndim - 1))
    return np.sqrt(np.sum(x**2, axis=axis, keepdims=True))


def _np_agc(param, grad, clip_factor, eps):
    max_norm = np.maximum(_np_unitwise_norm(param), eps) * clip_factor
    grad_norm = _np_unitwise_norm(grad)
    scaled = grad * (max_norm / np.maximum(grad_norm, 1e-6))
    return np.where(grad_norm > max_norm, scaled, grad)


@pytest.mark.parametrize("shape", [(), (5,), (4, 3), (2, 4, 3), (3, 3, 2, 4)])
def test_agc_matches_numpy_reference(shape):
    rng = np.random.default_rng(0)
    param = rng.normal(size=shape).astype("float32")
    grad = (rng.normal(size=shape) * 3).astype("float32")
    np.testing.assert_allclose(
        unitwise_norm(tf.constant(param)).numpy(), _np_unitwise_norm(param), rtol=1e-5
    )
    clipped = adaptive_clip_grad([param], [grad], clip_factor=0.05, eps=1e-3)[0]
    expected = _np_agc(param, grad, 0.05, 1e-3)
    assert not np.allclose(expected, grad)  # clipping acts on some units
    np.testing.assert_allclose(clipped.numpy(), expected, rtol=1e-5, atol=1e-7)


def test_agc_acts_once_on_the_accumulated_gradient():
    """use_agc=True with SGD: one update equals NumPy's SGD step with AGC
    applied to the big batch's mean gradient (from a plain tape)."""
    x, y = utils.classification_data(K * B)
    plain = _plain()
    with tf.GradientTape() as tape:
        loss = utils.sparse_ce()(y, plain(x))
    grads = tape.gradient(loss, plain.trainable_weights)
    params = utils.weights(plain)
    expected = [
        p - LR * _np_agc(p, g.numpy(), 0.01, 1e-3) for p, g in zip(params, grads)
    ]

    model = _accumulating(keras.optimizers.SGD(LR), use_agc=True)
    _fit(model, x, y)
    assert int(model.optimizer.iterations) == 1
    got = utils.weights(model)
    clipped_anything = utils.max_abs_diff(
        expected, [p - LR * g.numpy() for p, g in zip(params, grads)]
    )
    assert clipped_anything > 1e-4
    utils.assert_same_weights(got, expected, atol=1e-6)


def test_flush_includes_batch_norm_statistics():
    """A flushed partial cycle also updates AccumBatchNormalization's moving
    statistics with the pooled statistics of exactly the flushed
    micro-batches (inputs that do not depend on weights: BN comes first)."""
    from gradient_accumulator import AccumBatchNormalization

    rng = np.random.default_rng(3)
    x = (rng.normal(size=(20, 8)) * np.arange(1, 21)[:, None]).astype("float32")
    _, y = utils.classification_data(20)

    def build(norm, model_cls, **kwargs):
        inputs = keras.Input((8,))
        outputs = keras.layers.Dense(3)(norm(inputs))
        model = model_cls(inputs=inputs, outputs=outputs, **kwargs)
        model.compile(optimizer=keras.optimizers.SGD(LR), loss=utils.sparse_ce())
        return model

    reference = build(keras.layers.BatchNormalization(momentum=0.5), keras.Model)
    _fit(reference, x, y, batch_size=32, epochs=2)
    model = build(
        AccumBatchNormalization(momentum=0.5),
        GradientAccumulateModel,
        accum_steps=K,
        partial_cycle="flush",
    )
    _fit(model, x, y, epochs=2)
    ours, theirs = model.layers[1], reference.layers[1]
    assert int(model.optimizer.iterations) == 2
    for a, b in [
        (ours.moving_mean, theirs.moving_mean),
        (ours.moving_variance, theirs.moving_variance),
    ]:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert float(np.max(np.abs(np.asarray(ours.moving_mean)))) > 0.1


@pytest.mark.parametrize("mode", ["streaming", "in-step", "accumulate"])
def test_step_logs_are_the_plain_models_by_default(mode, tmp_path):
    """Without ``progress_logs`` every step logs what the plain model's step
    logs (the same keys, for callbacks and ``History``); with it, the three
    progress entries come on top, in every mode and after a ``.keras`` round
    trip (the setting is saved)."""
    x, y = utils.classification_data(2 * K * B)
    keys = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            keys.append(sorted(logs))

    def make(**progress):
        if mode == "accumulate":
            return _compiled(
                lambda: accumulate(utils.plain_model(), accum_steps=K, **progress),
                None,
            )
        if mode == "in-step":
            return _accumulating(accum_steps=1, micro_batch_size=B, **progress)
        return _accumulating(**progress)

    batch = K * B if mode == "in-step" else B
    _fit(_plain(), x, y, batch_size=batch, callbacks=[Record()])
    plain_keys = keys[-1]
    keys.clear()
    history = _fit(make(), x, y, batch_size=batch, callbacks=[Record()])
    assert keys and all(k == plain_keys for k in keys), (keys, plain_keys)
    assert sorted(history.history) == plain_keys

    progress = ["effective_batch", "grad_norm", "update"]
    model = make(progress_logs=True)
    keys.clear()
    _fit(model, x, y, batch_size=batch, callbacks=[Record()])
    assert all(k == sorted(plain_keys + progress) for k in keys), keys
    path = str(tmp_path / "progress.keras")
    model.save(path)
    reloaded = keras.models.load_model(path)
    keys.clear()
    _fit(reloaded, x, y, batch_size=batch, callbacks=[Record()])
    assert all(k == sorted(plain_keys + progress) for k in keys), keys


def test_progress_logs_must_be_a_bool():
    with pytest.raises(TypeError, match="progress_logs"):
        utils.accumulating_model(accum_steps=K, progress_logs="yes")
