"""Under tf-keras, importing the package starts no TensorFlow runtime: a
script can still set its threads and devices after its imports, as it can
under Keras 3 (``tests/keras3/test_quiet_start.py``, whose child script this
runs).
The tf-keras hosts once built a ``LossScaleOptimizer`` at import to learn
its class, which created a variable and so started the runtime."""

import pkgutil

import gradient_accumulator.keras2 as keras2
from tests.keras3.test_quiet_start import CONFIGURE_AFTER_IMPORT
from tests.processes import TIMEOUT, describe, run_script


def test_tensorflow_can_be_configured_after_importing_the_package():
    # The child inherits TF_USE_LEGACY_KERAS from this session.
    result = run_script("-c", CONFIGURE_AFTER_IMPORT, timeout=TIMEOUT)
    assert result.returncode == 0, describe(result)
    # The 0.5.x paths and every module of the tf-keras hosts were imported.
    paths = 3 + len(list(pkgutil.iter_modules(keras2.__path__)))
    want = (
        f"configured: gradient_accumulator.keras2.model paths={paths} "
        "threads=(1, 1) logical_cpus=2"
    )
    assert want in result.stdout, describe(result)
