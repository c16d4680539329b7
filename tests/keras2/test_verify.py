"""tf-keras ``verify`` is the tf-keras host's, with the report types shared
with Keras 3 (the report itself: tests/both/test_verify.py), and names
TensorFlow Model Optimization's causes: a pruning schedule run per
micro-batch (and passes with ``PruningStepPerUpdate``), quantization-aware
training's ranges."""

import numpy as np
import tensorflow_model_optimization as tfmot
import tf_keras

from gradient_accumulator import (
    LayerCheck,
    PruningStepPerUpdate,
    VariableCheck,
    VerifyReport,
    verify,
)
from tests.keras2 import utils


def test_names_are_the_tf_keras_verify_and_shared_report_types():
    from gradient_accumulator import keras2
    from gradient_accumulator.hosts import equivalence

    assert verify is keras2.verify
    assert verify.__module__ == "gradient_accumulator.keras2.verify"
    assert VerifyReport is equivalence.VerifyReport
    assert (LayerCheck, VariableCheck) == (
        equivalence.LayerCheck,
        equivalence.VariableCheck,
    )


# ------------------------------------------- TensorFlow Model Optimization
sparsity = tfmot.sparsity.keras


def _pruned():
    inputs = tf_keras.Input((8,))
    schedule = sparsity.PolynomialDecay(0.0, 0.5, begin_step=1, end_step=4, frequency=1)
    hidden = sparsity.prune_low_magnitude(
        tf_keras.layers.Dense(16, activation="tanh"),
        pruning_schedule=schedule,
    )(inputs)
    return tf_keras.Model(inputs, tf_keras.layers.Dense(3, name="head")(hidden))


def _quantized():
    return tfmot.quantization.keras.quantize_model(
        tf_keras.Sequential(
            [
                tf_keras.Input((8,)),
                tf_keras.layers.Dense(16, activation="relu", name="hidden"),
                tf_keras.layers.Dense(3, name="head"),
            ]
        )
    )


def _verify(model_fn, callbacks=None):
    x, y = utils.classification_data(n=160)
    return verify(
        model_fn,
        x,
        y,
        micro_batch_size=8,
        accum_steps=4,
        steps=5,
        loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=tf_keras.optimizers.SGD(0.2),
        callbacks=callbacks,
    )


def test_pruning_passes_with_pruning_step_per_update():
    report = _verify(_pruned, lambda: [PruningStepPerUpdate()])
    assert report.ok, str(report)
    assert report.moved > 1e-2


def test_pruning_schedule_run_per_micro_batch_is_named():
    report = _verify(_pruned, lambda: [sparsity.UpdatePruningStep()])
    assert not report.ok, str(report)
    (cause,) = report.causes
    assert cause.class_name == "PruneLowMagnitude", str(report)
    reason = cause.reason
    assert "pruning schedule runs 4 times too fast" in reason
    assert "(to 20; the big batch's: 5)" in reason
    assert "PruningStepPerUpdate() in place" in reason
    assert "UpdatePruningStep" in str(report)
    assert "Differ as a consequence: head." in str(report)


def test_quantization_aware_training_is_named():
    report = _verify(_quantized)
    assert not report.ok, str(report)
    causes = {c.name: c for c in report.causes}
    assert set(causes) == {"quant_hidden", "quant_head"}, str(report)
    for cause in causes.values():
        assert cause.class_name == "QuantizeWrapperV2"
        reason = cause.reason
        assert "quantizers' ranges move per forward pass" in reason
        assert "4 times per update" in reason and "not exact" in reason
    assert np.isfinite(report.max_abs_diff)
