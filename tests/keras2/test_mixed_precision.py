"""tf-keras mixed precision: ``mixed_float16`` (with tf-keras'
``LossScaleOptimizer``, current and legacy: around the model wrapper's
optimizer, or inside the optimizer wrapper in a custom loop) and
``mixed_bfloat16`` train as close to float32 as tf-keras' own mixed big
batch does, keep the scale per cycle as the big batch keeps it per step, and
skip an overflowing cycle whole, as the big batch skips its step; a
LossScaleOptimizer around the optimizer wrapper is refused. Tolerances: see
tests/keras3/test_mixed_precision.py (the Keras 3 version)."""

import pytest
import tf_keras

from gradient_accumulator import GradientAccumulateOptimizer
from tests.keras2 import utils

B, K = 8, 4
MARGIN = 2.0
OPTIMIZERS = {
    "adam": lambda: tf_keras.optimizers.Adam(0.01),
    "legacy_adam": lambda: tf_keras.optimizers.legacy.Adam(0.01),
}


def _layers():
    inputs, outputs = utils.mlp_layers()
    # As tf-keras' mixed-precision guide does: float32 outputs.
    outputs = tf_keras.layers.Activation("linear", dtype="float32")(outputs)
    return inputs, outputs


def _train(policy, optimizer, x, y, wrapped, epochs=2):
    """``wrapped``: False (plain, on the big batch), "model" or "optimizer"."""
    tf_keras.mixed_precision.set_global_policy(policy)
    try:
        inner = OPTIMIZERS[optimizer]()
        if wrapped == "model":
            model = utils.seeded(
                lambda: utils.accumulating_model(_layers, accum_steps=K)
            )
        else:
            model = utils.seeded(lambda: utils.plain_model(_layers))
        if wrapped == "optimizer":
            inner = GradientAccumulateOptimizer(inner, accum_steps=K)
        model.compile(inner, utils.sparse_ce())
        batch = B if wrapped else B * K
        model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
    return model


def _scale(scaler):
    return float(scaler.loss_scale), int(scaler.dynamic_counter.numpy())


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize(
    "policy, wrapper",
    # Under mixed_bfloat16 compile adds no scaler around the optimizer wrapper.
    [
        ("mixed_float16", "model"),
        ("mixed_bfloat16", "model"),
        ("mixed_bfloat16", "optimizer"),
    ],
)
def test_as_close_to_float32_as_the_mixed_big_batch(policy, optimizer, wrapper):
    x, y = utils.classification_data()
    reference = utils.weights(_train("float32", optimizer, x, y, wrapped=False))
    keras_mixed = _train(policy, optimizer, x, y, wrapped=False)
    ours = _train(policy, optimizer, x, y, wrapped=wrapper)
    low_precision = utils.max_abs_diff(utils.weights(keras_mixed), reference)
    assert 0 < low_precision < 1e-2, low_precision
    bound = MARGIN * low_precision
    utils.assert_same_weights(utils.weights(ours), reference, bound)
    utils.assert_same_weights(utils.weights(ours), utils.weights(keras_mixed), bound)
    assert int(ours.optimizer.iterations) == int(keras_mixed.optimizer.iterations)
    if policy == "mixed_float16":
        assert isinstance(ours.optimizer, tf_keras.mixed_precision.LossScaleOptimizer)
        # The scale's counter advances per update, as the big batch's per step.
        assert _scale(ours.optimizer) == _scale(keras_mixed.optimizer) == (2.0**15, 4)


def _custom_loop(optimizer, x, y, batch):
    """A plain model trained by tf-keras' custom-loop protocol for a
    LossScaleOptimizer (``optimizer``'s, or the one it wraps): scale the
    loss, unscale the gradients, apply."""
    import tensorflow as tf

    scaler = getattr(optimizer, "inner_optimizer", optimizer)
    if not isinstance(scaler, tf_keras.mixed_precision.LossScaleOptimizer):
        scaler = optimizer
    model = utils.seeded(lambda: utils.plain_model(_layers))
    loss_fn = utils.sparse_ce()

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            scaled = scaler.get_scaled_loss(loss_fn(yb, model(xb, training=True)))
        grads = scaler.get_unscaled_gradients(
            tape.gradient(scaled, model.trainable_variables)
        )
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    for start in range(0, len(x), batch):
        step(x[start : start + batch], y[start : start + batch])
    return model, scaler


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_an_overflowing_micro_batch_skips_its_cycle_as_the_big_batch_skips(
    optimizer, wrapper
):
    """The model wrapper in ``fit``, the optimizer wrapper (holding the
    scaler) in a custom loop, each against the big batch trained the same
    way."""
    x, y = utils.classification_data()
    x[B * K + 3, :] = 1e6  # in the second cycle: inf in float16
    if wrapper == "model":
        keras_mixed = _train("mixed_float16", optimizer, x, y, wrapped=False, epochs=1)
        ours = _train("mixed_float16", optimizer, x, y, wrapped=wrapper, epochs=1)
        big_scaler, our_scaler = keras_mixed.optimizer, ours.optimizer
    else:
        tf_keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            lso = tf_keras.mixed_precision.LossScaleOptimizer
            keras_mixed, big_scaler = _custom_loop(
                lso(OPTIMIZERS[optimizer]()), x, y, B * K
            )
            wrapped = GradientAccumulateOptimizer(lso(OPTIMIZERS[optimizer]()), K)
            ours, our_scaler = _custom_loop(wrapped, x, y, B)
        finally:
            tf_keras.mixed_precision.set_global_policy("float32")
    # tf-keras skipped the second of its 2 steps (counting it) and halved the
    # scale.
    assert int(big_scaler.iterations) == 2
    assert _scale(big_scaler) == (2.0**14, 0)
    assert int(our_scaler.iterations) == 2
    assert _scale(our_scaler) == _scale(big_scaler)
    utils.assert_finite(utils.weights(ours))
    utils.assert_same_weights(utils.weights(ours), utils.weights(keras_mixed), 1e-4)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("how", ["compile", "explicit"])
def test_a_loss_scaler_around_the_optimizer_wrapper_is_refused(how, optimizer):
    """It would check, skip and grow per micro-batch: refused as it is made
    (tf-keras' compile makes one under mixed_float16), with what works."""
    accumulating = GradientAccumulateOptimizer(OPTIMIZERS[optimizer](), K)
    tf_keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = utils.plain_model(_layers)
        with pytest.raises(TypeError, match="cannot wrap a GradientAccumulate") as e:
            if how == "compile":
                model.compile(accumulating, utils.sparse_ce())
            else:
                tf_keras.mixed_precision.LossScaleOptimizer(accumulating)
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
    assert "GradientAccumulateModel" in str(e.value)
    assert "custom training loop" in str(e.value)


def _overflows(model, x, y, scale: float) -> bool:
    """Whether ``model``'s float16 backward pass of the mean loss over
    ``x``, ``y`` at loss scale ``scale`` has a non-finite gradient."""
    import tensorflow as tf

    with tf.GradientTape() as tape:
        loss = utils.sparse_ce()(y, model(x, training=True)) * scale
    grads = tape.gradient(loss, model.trainable_weights)
    return not all(bool(tf.reduce_all(tf.math.is_finite(g))) for g in grads)


def test_a_micro_batch_overflowing_where_the_big_batch_does_not_is_redone():
    """One input repeated, micro-batches of one label each: each micro-batch's
    weight gradients sum equal per-sample gradients, where the big batch's
    two labels cancel. At the big batch's largest finite scale a micro-batch
    overflows even after its share of the cycle; it is differentiated again
    at a smaller seed instead of skipping the cycle: every update the big
    batch applies is applied, and the scale is halved after the rescued
    cycle, as after an overflow."""
    import numpy as np

    cycles = 3
    x1, _ = utils.classification_data(1, seed=4)
    x = np.repeat(x1 * 0.01, cycles * B * K, axis=0)
    y = (np.arange(cycles * B * K) // B) % 2

    def layers():
        inputs, outputs = utils.mlp_layers(classes=2)
        # float32 outputs (as in _layers): the loss's seed must hold the scale.
        return inputs, tf_keras.layers.Activation("linear", dtype="float32")(outputs)

    reference = utils.seeded(lambda: utils.plain_model(layers))
    reference.compile(tf_keras.optimizers.SGD(0.1), utils.sparse_ce())
    reference.fit(x, y, batch_size=B * K, shuffle=False, verbose=0)

    tf_keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        probe = utils.seeded(lambda: utils.plain_model(layers))
        scale = 2.0
        while not _overflows(probe, x[: B * K], y[: B * K], 2 * scale):
            scale *= 2
            assert scale < 2.0**40, "the big batch never overflows"
        assert _overflows(probe, x[:B], y[:B], scale / K)  # the precondition

        def train(wrapped: bool):
            build = (
                (lambda: utils.accumulating_model(layers, accum_steps=K))
                if wrapped
                else (lambda: utils.plain_model(layers))
            )
            model = utils.seeded(build)
            optimizer = tf_keras.mixed_precision.LossScaleOptimizer(
                tf_keras.optimizers.SGD(0.1),
                initial_scale=scale,
                dynamic_growth_steps=1000,
            )
            model.compile(optimizer, utils.sparse_ce())
            batch = B if wrapped else B * K
            model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
            return model

        big, ours = train(False), train(True)
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
    assert int(big.optimizer.iterations) == cycles
    assert float(big.optimizer.loss_scale) == scale
    assert int(ours.optimizer.iterations) == cycles
    assert scale / 2**cycles <= float(ours.optimizer.loss_scale) < scale
    low_precision = utils.max_abs_diff(utils.weights(big), utils.weights(reference))
    utils.assert_same_weights(
        utils.weights(ours), utils.weights(reference), MARGIN * low_precision
    )
