"""Accumulation under the ``mixed_float16`` and ``mixed_bfloat16`` policies.

Every layout that accumulates under a loss scale is covered (``LAYOUTS``):

* ``model``: ``GradientAccumulateModel``; ``compile`` gives it
  ``LossScaleOptimizer(SGD)``.
* ``inner``: ``GradientAccumulateOptimizer(LossScaleOptimizer(SGD))`` with
  ``compile(auto_scale_loss=False)``.

A LossScaleOptimizer around the optimizer wrapper (what ``compile`` builds
from a plain model's ``GradientAccumulateOptimizer`` under mixed_float16)
is refused; under mixed_bfloat16 there is no scaler, and ``compiled`` (that
plain model) is covered too.

References are plain Keras on the big batch: float32 (the exact target) and
the same mixed policy (which shows how far low precision alone moves the
weights, and which skips overflowing big batches the way Keras does).

Tolerances. Under a mixed policy activations and their gradients are rounded
to float16 (unit roundoff 2**-11 ~ 4.9e-4) or bfloat16 (2**-8 ~ 3.9e-3), and
the big batch reduces over all samples in low precision inside its kernels
while accumulation reduces each micro-batch there and sums the micro-batches
in float32; so neither run is the float32 one. The test that matters is that
accumulating is no further from float32 than Keras' own mixed big batch is:
``ours <= MARGIN * keras_mixed`` (both measured in the same test; ~2.5e-5 and
~1.8e-4 respectively, with ours measured slightly smaller). Where the
reference is the mixed big batch itself, ``F16_ATOL = 1e-4`` is ~6x the
~1.6e-5 measured (about one float16 rounding of a ~0.1 update, times a few
updates).
"""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel, GradientAccumulateOptimizer
from tests import utils
from tests.processes import assert_quiet, describe, run_like_a_user, verdict

B = 8  # micro-batch size
K = 4  # accumulation steps
CYCLE = B * K
LR = 0.1
MARGIN = 2.0
F16_ATOL = 1e-4
LSO = keras.optimizers.LossScaleOptimizer

LAYOUTS = ["model", "inner"]


def _inner():
    # Momentum: an optimizer with state, which a skipped cycle must not touch.
    return keras.optimizers.SGD(LR, momentum=0.5)


def _build(layout: str, initial_scale=2.0**15, growth_steps=2000) -> keras.Model:
    """A compiled model accumulating ``K`` micro-batches in ``layout``, with
    a loss scale of ``initial_scale`` growing every ``growth_steps`` updates
    when mixed_float16 is on."""
    inputs, outputs = utils.mlp_layers()
    scaler = {"initial_scale": initial_scale, "dynamic_growth_steps": growth_steps}
    compile_kwargs = {}
    if layout == "model":
        # Partial cycles carry across epochs and stay pending after fit, like
        # the optimizer layouts'.
        model = GradientAccumulateModel(
            accum_steps=K,
            partial_cycle="carry",
            flush_at_end=False,
            inputs=inputs,
            outputs=outputs,
        )
        optimizer = _inner()
    else:
        model = keras.Model(inputs, outputs)
        if layout == "compiled":  # mixed_bfloat16: no loss scale
            optimizer = GradientAccumulateOptimizer(_inner(), accum_steps=K)
        else:
            optimizer = GradientAccumulateOptimizer(LSO(_inner(), **scaler), K)
            compile_kwargs["auto_scale_loss"] = False
    model.compile(optimizer=optimizer, loss=utils.sparse_ce(), **compile_kwargs)
    if layout == "model" and isinstance(model.optimizer, LSO):
        # compile() built this one with Keras' defaults.
        model.optimizer.initial_scale = initial_scale
        model.optimizer.dynamic_growth_steps = growth_steps
    return model


def _scaler(model: keras.Model) -> LSO:
    """The LossScaleOptimizer whose scale the model's loss is multiplied by."""
    optimizer = model.optimizer
    return optimizer if isinstance(optimizer, LSO) else optimizer.inner_optimizer


def _sgd(model: keras.Model):
    optimizer = model.optimizer
    while hasattr(optimizer, "inner_optimizer"):
        optimizer = optimizer.inner_optimizer
    assert isinstance(optimizer, keras.optimizers.SGD)
    return optimizer


def _plain(policy: str, data, epochs: int = 1) -> keras.Model:
    """Plain Keras under ``policy`` on the big batch (``compile`` adds Keras'
    LossScaleOptimizer under mixed_float16)."""
    keras.mixed_precision.set_global_policy(policy)
    model = utils.seeded(utils.plain_model)
    model.compile(optimizer=_inner(), loss=utils.sparse_ce())
    for x, y in data:
        model.fit(x, y, batch_size=CYCLE, epochs=epochs, shuffle=False, verbose=0)
    return model


def _mixed(policy: str, layout: str, **kwargs) -> keras.Model:
    keras.mixed_precision.set_global_policy(policy)
    model = utils.seeded(lambda: _build(layout, **kwargs))
    assert model.layers[-1].compute_dtype == policy.removeprefix("mixed_")
    return model


# ------------------------------------------------------------ equivalence
@pytest.mark.parametrize(
    "policy, layout",
    [("mixed_float16", layout) for layout in LAYOUTS]
    + [("mixed_bfloat16", "model"), ("mixed_bfloat16", "compiled")],
)
def test_close_to_float32_big_batch(policy, layout):
    """Accumulating under a mixed policy is no further from float32 big-batch
    training than Keras' own mixed big batch is; the buffers are float32."""
    data = [utils.classification_data(3 * CYCLE)]
    reference = _plain("float32", data)
    keras_mixed = _plain(policy, data)
    low_precision_error = utils.max_abs_diff(
        utils.weights(keras_mixed), utils.weights(reference)
    )
    # The policy really computed in low precision, and only that far off.
    assert 0 < low_precision_error < (1e-3 if policy == "mixed_float16" else 1e-2)

    model = _mixed(policy, layout)
    initial = utils.weights(model)
    utils.fit(model, *data[0], B)
    utils.assert_trained(initial, utils.weights(model))
    utils.assert_same_weights(
        utils.weights(model), utils.weights(reference), MARGIN * low_precision_error
    )
    utils.assert_same_weights(
        utils.weights(model), utils.weights(keras_mixed), MARGIN * low_precision_error
    )
    assert int(model.optimizer.iterations) == 3
    state = utils.accumulator(model)
    assert {v.dtype for v in [state.weight_sum, *state.grad_sums]} == {"float32"}
    if policy == "mixed_float16":
        assert float(_scaler(model).dynamic_scale) == 2.0**15  # no overflow, no growth
    else:
        assert not isinstance(model.optimizer, LSO)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scale_change_mid_cycle_keeps_units(layout):
    """Each micro-batch is unscaled by the scale it was computed with: halving
    the scale after every micro-batch leaves the result unchanged."""

    class HalveScale(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            scale = _scaler(self.model).dynamic_scale
            scale.assign(scale * 0.5)

    x, y = utils.classification_data(2 * CYCLE)
    steady = _mixed("mixed_float16", layout)
    utils.fit(steady, x, y, B)
    changing = _mixed("mixed_float16", layout)
    changing.fit(x, y, batch_size=B, shuffle=False, verbose=0, callbacks=[HalveScale()])
    assert float(_scaler(changing).dynamic_scale) == 2.0 ** (15 - 2 * K)
    # Only the float16 rounding of differently scaled values differs.
    utils.assert_same_weights(utils.weights(changing), utils.weights(steady), 1e-6)
    assert int(changing.optimizer.iterations) == 2


# --------------------------------------------------------------- overflow
def _poisoned_cycle(seed: int):
    """One cycle of data whose third micro-batch holds an input that is Inf
    in float16 (1e5 > 65504) but finite in float32. Keras' mixed big batch
    skips it (asserted below), so its gradient is not finite."""
    x, y = utils.classification_data(CYCLE, seed=seed)
    x[2 * B + 3, 0] = 1e5
    return x, y


@pytest.mark.parametrize("layout", LAYOUTS)
def test_overflowing_micro_batch_skips_the_whole_cycle(layout):
    """A cycle with a non-finite micro-batch gradient changes nothing but the
    scale (halved) and the buffers (emptied), as Keras skips the big batch
    holding that sample; training then continues like Keras' mixed big
    batch."""
    clean = utils.classification_data(CYCLE, seed=1)
    poisoned = _poisoned_cycle(seed=2)
    after = utils.classification_data(2 * CYCLE, seed=3)

    model = _mixed("mixed_float16", layout)
    utils.fit(model, *clean, B)
    scaler, state, sgd = _scaler(model), utils.accumulator(model), _sgd(model)
    before = [v.numpy().copy() for v in model.trainable_weights + sgd.variables]
    assert int(model.optimizer.iterations) == 1

    utils.fit(model, *poisoned, B)  # its loss is finite (tanh saturates), not its grads
    for old, new in zip(before, model.trainable_weights + sgd.variables):
        np.testing.assert_array_equal(np.asarray(new), old)  # bit-identical
    assert int(model.optimizer.iterations) == 1
    assert float(scaler.dynamic_scale) == 2.0**14
    assert int(scaler.step_counter) == 0
    assert int(state.micro_step) == 0
    for buffer in [state.weight_sum, *state.grad_sums]:
        assert not np.any(np.asarray(buffer)), buffer.path

    history = utils.fit(model, *after, B, epochs=3)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    assert all(np.all(np.isfinite(w)) for w in utils.weights(model))
    assert int(model.optimizer.iterations) == 1 + 3 * 2

    keras_mixed = _plain("mixed_float16", [clean, poisoned])
    assert int(keras_mixed.optimizer.iterations) == 1  # Keras skipped it too
    keras_mixed.fit(*after, batch_size=CYCLE, epochs=3, shuffle=False, verbose=0)
    assert float(keras_mixed.optimizer.dynamic_scale) == 2.0**14
    utils.assert_same_weights(
        utils.weights(model), utils.weights(keras_mixed), F16_ATOL
    )


# ----------------------------------------------------------------- growth
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dynamic_scale_growth_counts_updates(layout):
    """With dynamic_growth_steps=2, 3 updates (12 micro-batches) double the
    scale once; counting micro-batches would double it 6 times."""
    x, y = utils.classification_data(3 * CYCLE)
    model = _mixed("mixed_float16", layout, initial_scale=2.0**8, growth_steps=2)
    utils.fit(model, x, y, B)
    scaler = _scaler(model)
    assert int(model.optimizer.iterations) == 3
    assert float(scaler.dynamic_scale) == 2.0**9
    assert int(scaler.step_counter) == 1


# ----------------------------------------------------------------- saving
def test_keras_file_saved_mid_cycle_resumes_exactly(tmp_path):
    """Under mixed_float16 a .keras file of the model wrapper saved mid-cycle
    loads without custom_objects, keeps the loss scale state and the pending
    buffers, and resumes to the uninterrupted run's weights."""
    layout = "model"
    x, y = utils.classification_data(3 * CYCLE // 2)  # 6 micro-batches
    kwargs = {"initial_scale": 2.0**10, "growth_steps": 1}

    uninterrupted = _mixed("mixed_float16", layout, **kwargs)
    utils.fit(uninterrupted, x, y, B, epochs=2)

    model = _mixed("mixed_float16", layout, **kwargs)
    utils.fit(model, x, y, B)  # 1 update (the scale grew) + 2 pending micro-batches
    assert float(_scaler(model).dynamic_scale) == 2.0**11
    assert int(utils.accumulator(model).micro_step) == 2
    path = tmp_path / "m.keras"
    model.save(path)

    # Like plain Keras: compile() (re-run by load_model) adds the wrapper only
    # under the mixed_float16 policy, and builds it with Keras' defaults;
    # the scale and its counter come back from the file.
    keras.mixed_precision.set_global_policy("mixed_float16")
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, LSO) and isinstance(model.optimizer, LSO)
    assert loaded.layers[-1].compute_dtype == "float16"
    scaler = _scaler(loaded)
    assert float(scaler.dynamic_scale) == 2.0**11
    assert int(scaler.step_counter) == 0
    scaler.dynamic_growth_steps = 1
    for saved, restored in zip(
        utils.accumulator(model).variables, utils.accumulator(loaded).variables
    ):
        np.testing.assert_array_equal(np.asarray(restored), np.asarray(saved))

    utils.fit(loaded, x, y, B)
    assert int(loaded.optimizer.iterations) == 3
    assert float(_scaler(loaded).dynamic_scale) == 2.0**13
    utils.assert_same_weights(utils.weights(loaded), utils.weights(uninterrupted), 1e-6)


# ---------------------------------------------------------------- example
@pytest.mark.script
def test_mixed_precision_example_quick():
    result = run_like_a_user("examples/mixed_precision.py", "--quick")
    assert result.returncode == 0, describe(result)
    assert_quiet(result)
    assert "overflow: cycle skipped" in result.stdout, describe(result)
    assert verdict(result).startswith("OK: under mixed_float16"), describe(result)


REFUSED = "A LossScaleOptimizer cannot wrap a GradientAccumulateOptimizer"


@pytest.mark.parametrize("how", ["compile", "explicit", "inner_auto_scaled"])
def test_loss_scaler_around_the_optimizer_wrapper_is_refused(how):
    """A LossScaleOptimizer around the optimizer wrapper would check, skip and
    grow per micro-batch: it is refused when it is made, with the layouts
    that work. Without a scaler (mixed_bfloat16) compile accepts the
    wrapper."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    accumulating = GradientAccumulateOptimizer(_inner(), K)
    model = utils.plain_model()
    with pytest.raises(TypeError, match=REFUSED) as refused:
        if how == "explicit":
            LSO(accumulating)
        elif how == "inner_auto_scaled":
            inner = GradientAccumulateOptimizer(LSO(_inner()), K)
            model.compile(optimizer=inner, loss=utils.sparse_ce())
        else:
            model.compile(optimizer=accumulating, loss=utils.sparse_ce())
    message = str(refused.value)
    assert "GradientAccumulateModel" in message and "accumulate(model)" in message
    assert "auto_scale_loss=False" in message

    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = utils.plain_model()
    model.compile(optimizer=accumulating, loss=utils.sparse_ce())
    assert model.optimizer is accumulating


def test_inner_scaler_file_needs_auto_scale_loss_again(tmp_path):
    """Keras saves no ``auto_scale_loss``: loading a plain model compiled
    with ``GradientAccumulateOptimizer(LossScaleOptimizer(...))`` re-runs
    compile with a scaler around it, which is refused by the same message;
    weights load with ``compile=False``."""
    model = _mixed("mixed_float16", "inner")
    utils.fit(model, *utils.classification_data(CYCLE), B)
    path = tmp_path / "inner.keras"
    model.save(path)
    with pytest.raises(TypeError, match=REFUSED):
        keras.models.load_model(path)
    loaded = keras.models.load_model(path, compile=False)
    utils.assert_same_weights(utils.weights(loaded), utils.weights(model), 0.0)


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_static_loss_scale_factor_of_the_wrapped_optimizer(policy):
    """``SGD(loss_scale_factor=128)`` inside the optimizer wrapper trains as
    plain Keras does with it on the big batch: scaled and unscaled once in
    float32, replaced by the dynamic scale of a LossScaleOptimizer under
    mixed_float16 (Keras resets the factor of the optimizer it wraps)."""
    x, y = utils.classification_data(2 * CYCLE)
    keras.mixed_precision.set_global_policy(policy)
    reference = utils.seeded(utils.plain_model)
    reference.compile(
        optimizer=keras.optimizers.SGD(LR, loss_scale_factor=128.0),
        loss=utils.sparse_ce(),
    )
    initial = utils.weights(reference)
    reference.fit(x, y, batch_size=CYCLE, shuffle=False, verbose=0)
    model = utils.seeded(utils.plain_model)
    sgd = keras.optimizers.SGD(LR, loss_scale_factor=128.0)
    if policy == "float32":
        model.compile(
            optimizer=GradientAccumulateOptimizer(sgd, K), loss=utils.sparse_ce()
        )
    else:  # the scaler inside, as compile would put it around SGD
        model.compile(
            optimizer=GradientAccumulateOptimizer(LSO(sgd), K),
            loss=utils.sparse_ce(),
            auto_scale_loss=False,
        )
    utils.fit(model, x, y, B)
    utils.assert_trained(initial, utils.weights(reference), min_change=1e-2)
    atol = utils.ATOL if policy == "float32" else F16_ATOL
    utils.report(
        utils.assert_same_weights(utils.weights(model), utils.weights(reference), atol)
    )


# -------------------------------------------------------------- predivide
def _overflows(model: keras.Model, x, y, scale: float) -> bool:
    """Whether ``model``'s float16 backward pass of the mean loss over
    ``x``, ``y`` at loss scale ``scale`` has a non-finite gradient."""
    with tf.GradientTape() as tape:
        loss = utils.sparse_ce()(y, model(x, training=True)) * scale
    grads = tape.gradient(loss, model.trainable_weights)
    return not all(bool(tf.reduce_all(tf.math.is_finite(g))) for g in grads)


@pytest.mark.parametrize("mode", ["streaming", "in-step", "optimizer"])
def test_float16_skips_no_cycle_the_big_batch_applies(mode):
    """At the largest loss scale at which the big batch's float16 backward
    pass stays finite, a micro-batch's own mean loss (each sample weighing
    ``K`` times its part of the big batch's) overflows; both wrappers divide
    each micro-batch's loss by its share of the cycle first, so they apply
    every cycle the big batch applies, with the big batch's scale and
    weights (model wrapper streaming and in-step; the optimizer wrapper
    around the LossScaleOptimizer).

    The data make the per-sample gradients the largest of the backward
    pass, which the share multiplies: one input (near zero) with labels
    alternating between two classes, so the gradients summed over samples
    (the weights') nearly cancel while each sample's logit gradient is
    about ``scale / 2 / batch``.
    """
    layers = functools.partial(utils.mlp_layers, classes=2)
    x1, _ = utils.classification_data(1, seed=4)
    x = np.repeat(x1 * 0.01, 3 * CYCLE, axis=0)
    y = np.arange(3 * CYCLE) % 2
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        probe = utils.seeded(lambda: utils.plain_model(layers))
        scale = 2.0
        while not _overflows(probe, x[:CYCLE], y[:CYCLE], 2 * scale):
            scale *= 2
            assert scale < 2.0**40, "the big batch never overflows"
        # The precondition that makes this test able to fail.
        assert _overflows(probe, x[:B], y[:B], scale), scale

        def scaled(optimizer):
            return LSO(optimizer, initial_scale=scale, dynamic_growth_steps=1000)

        def compiled(build, optimizer, **kwargs):
            model = utils.seeded(build)
            model.compile(optimizer=optimizer, loss=utils.sparse_ce(), **kwargs)
            return model

        big = compiled(lambda: utils.plain_model(layers), scaled(_inner()))
        big.fit(x, y, batch_size=CYCLE, shuffle=False, verbose=0)
        batch = CYCLE if mode == "in-step" else B
        if mode in ("streaming", "in-step"):
            settings = {"accum_steps": K} if batch == B else {"micro_batch_size": B}
            ours = compiled(
                lambda: utils.accumulating_model(layers, **settings), scaled(_inner())
            )
        else:
            ours = compiled(
                lambda: utils.plain_model(layers),
                GradientAccumulateOptimizer(scaled(_inner()), K),
                auto_scale_loss=False,
            )
        ours.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert int(big.optimizer.iterations) == 3
    assert int(ours.optimizer.iterations) == 3
    assert float(_scaler(ours).dynamic_scale) == float(big.optimizer.dynamic_scale)
    utils.report(
        utils.assert_same_weights(utils.weights(ours), utils.weights(big), F16_ATOL)
    )
