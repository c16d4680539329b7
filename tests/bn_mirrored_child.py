"""Child process of test_batch_norm.py: AccumBatchNormalization under a
MirroredStrategy over two logical CPU devices.

Prints one JSON line of max differences against single-device references:
moving statistics against ``keras.layers.BatchNormalization`` on the big batch
(all micro-batches of all replicas), and, for ``synchronized=True``, weights
against one device that sees each global micro-batch whole.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

# Must happen before anything initialises TensorFlow's devices.
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)
tf.config.experimental.enable_op_determinism()

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gradient_accumulator import (  # noqa: E402
    AccumBatchNormalization,
    GradientAccumulateModel,
    GradientAccumulateOptimizer,
)
from tests.keras3.test_batch_norm import heterogeneous, moving_stats  # noqa: E402
from tests.utils import max_abs_diff, weights  # noqa: E402

ACCUM, GLOBAL_MICRO, CYCLES, MOMENTUM = 2, 8, 2, 0.5


def build(cls, synchronized=False, layer_steps=None, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    norm = AccumBatchNormalization(
        accum_steps=layer_steps, momentum=MOMENTUM, synchronized=synchronized
    )
    outputs = keras.layers.Dense(2)(norm(inputs))
    return cls(inputs=inputs, outputs=outputs, **kwargs)


def main():
    x = heterogeneous(ACCUM * CYCLES, GLOBAL_MICRO, (4,))
    y = np.random.default_rng(1).normal(size=(len(x), 2)).astype("float32")
    reference = keras.layers.BatchNormalization(momentum=MOMENTUM)
    big = ACCUM * GLOBAL_MICRO
    for start in range(0, len(x), big):
        reference(x[start : start + big], training=True)
    expected = moving_stats(reference)

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    result = {"replicas": strategy.num_replicas_in_sync}

    def fit(model, optimizer):
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=GLOBAL_MICRO, shuffle=False, verbose=0)
        return model

    trained = {}
    for name, synchronized in (("model", False), ("model_synchronized", True)):
        with strategy.scope():
            model = build(GradientAccumulateModel, synchronized, accum_steps=ACCUM)
            fit(model, keras.optimizers.SGD(0.1))
        trained[name] = model
        result[f"{name}_stats"] = max_abs_diff(moving_stats(model.layers[1]), expected)

    with strategy.scope():
        model = build(keras.Model, layer_steps=ACCUM)
        fit(
            model,
            GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=ACCUM),
        )
    result["optimizer_stats"] = max_abs_diff(moving_stats(model.layers[1]), expected)

    # One device, whole global micro-batches: what synchronized=True computes.
    single = build(GradientAccumulateModel, accum_steps=ACCUM)
    fit(single, keras.optimizers.SGD(0.1))
    single_weights = weights(single)

    def weights_diff(model):
        return max_abs_diff(weights(model), single_weights)

    result["model_synchronized_weights"] = weights_diff(trained["model_synchronized"])
    result["model_local_vs_global_weights"] = weights_diff(trained["model"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
