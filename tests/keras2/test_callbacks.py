"""tf-keras ``AccumulationScheduler`` and ``FlushPartialCycle``, from the
user's side: accumulation schedules and flushed or dropped partial cycles
match plain tf-keras on the big batch. (What both Kerases share:
tests/both/test_callbacks.py.)"""

from __future__ import annotations

import functools

import tf_keras

from gradient_accumulator import (
    AccumulationScheduler,
    FlushPartialCycle,
    GradientAccumulateModel,
    GradientAccumulateOptimizer,
)
from tests.keras2 import utils

B, K, LR = 8, 4, 0.05


_compiled = utils.compiled


_plain = utils.compiled_plain


_wrapper = functools.partial(utils.compiled_accumulating, accum_steps=K)


def _optimizer_wrapped(inner, accum_steps=K):
    return _compiled(
        utils.plain_model, GradientAccumulateOptimizer(inner, accum_steps=accum_steps)
    )


def _fit(model, x, y, batch_size=B, **kwargs):
    return utils.fit(model, x, y, batch_size, **kwargs)


def _same(model, reference) -> float:
    diff = utils.assert_same_weights(utils.weights(model), utils.weights(reference))
    return utils.report(diff)


def test_scheduled_accum_steps_survives_a_keras_file(tmp_path):
    x, y = utils.classification_data(64)
    model = _wrapper(accum_steps=1)
    _fit(model, x, y, epochs=2, callbacks=[AccumulationScheduler({1: 8})])
    assert model.accum_steps == 8
    model.save(tmp_path / "m.keras")
    loaded = tf_keras.models.load_model(tmp_path / "m.keras")
    assert isinstance(loaded, GradientAccumulateModel)
    assert loaded.accum_steps == 8


# ----------------------------------------------------------- partial cycles
def test_drop_callback_for_optimizer_wrapper():
    x, y = utils.classification_data(40)  # 4 + 1 micro-batches per epoch
    reference = _plain()
    _fit(reference, x[:32], y[:32], batch_size=32, epochs=2)

    model = _optimizer_wrapped(tf_keras.optimizers.Adam(LR))
    _fit(model, x, y, epochs=2, callbacks=[FlushPartialCycle("drop")])
    assert int(model.optimizer.iterations) == 2
    assert model.optimizer._accumulator.pending == 0
    _same(model, reference)
