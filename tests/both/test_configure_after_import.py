"""Importing the package starts no TensorFlow runtime, in either Keras: a
user's script can still set its threads and devices after its imports.
(Once two tests, one per Keras, running the same child script.)

The tf-keras hosts once built a ``LossScaleOptimizer`` at import to learn
its class, which created a variable and so started the runtime."""

from __future__ import annotations

import pkgutil

from tests.flavour import LEGACY_KERAS
from tests.processes import TIMEOUT, describe, run_script

# A user's script that configures TensorFlow after its imports, as TensorFlow
# allows until its runtime starts: the package's import (every public name,
# the 0.5.x paths, and under tf-keras every module of the tf-keras hosts)
# must not start it, as a tensor, a variable or a device context would. The
# thread setters and the logical CPUs fail once it has started; the visible
# devices and memory growth are what scripts set too.
CONFIGURE_AFTER_IMPORT = r"""
import importlib, pkgutil
import gradient_accumulator as ga
from gradient_accumulator._requirements import legacy_keras_requested

legacy = legacy_keras_requested()
for name in ga.__all__:
    try:
        getattr(ga, name)
    except ImportError as error:
        if not (legacy and "not available for tf-keras" in str(error)):
            raise
paths = [f"gradient_accumulator.{m}" for m in ("accumulators", "layers", "utils")]
if legacy:
    import gradient_accumulator.keras2 as keras2
    modules = pkgutil.iter_modules(keras2.__path__)
    paths += [f"{keras2.__name__}.{m.name}" for m in modules]
for path in paths:
    importlib.import_module(path)

import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
cpus = tf.config.list_physical_devices("CPU")
tf.config.set_visible_devices(cpus)
tf.config.set_logical_device_configuration(
    cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2
)
for gpu in tf.config.list_physical_devices("GPU"):
    tf.config.experimental.set_memory_growth(gpu, True)
threads = (
    tf.config.threading.get_inter_op_parallelism_threads(),
    tf.config.threading.get_intra_op_parallelism_threads(),
)
print(
    f"configured: {ga.GradientAccumulateModel.__module__} paths={len(paths)} "
    f"threads={threads} logical_cpus={len(tf.config.list_logical_devices('CPU'))}"
)
"""


def test_tensorflow_can_be_configured_after_importing_the_package():
    # The child inherits TF_USE_LEGACY_KERAS from this session.
    result = run_script("-c", CONFIGURE_AFTER_IMPORT, timeout=TIMEOUT)
    assert result.returncode == 0, describe(result)
    if LEGACY_KERAS:
        import gradient_accumulator.keras2 as keras2

        # The 0.5.x paths and every module of the tf-keras hosts were imported.
        paths = 3 + len(list(pkgutil.iter_modules(keras2.__path__)))
        module = "gradient_accumulator.keras2.model"
    else:
        paths, module = 3, "gradient_accumulator.keras3.model"
    want = f"configured: {module} paths={paths} threads=(1, 1) logical_cpus=2"
    assert want in result.stdout, describe(result)
