"""Files saved by an earlier version load in this one and resume training
exactly, in each Keras (issue 32: files saved before the hosts were written
once still load).

``tests/data/saved_<commit>/<keras>/`` holds ``.keras`` files saved
mid-cycle (2 micro-batches pending of 4) by commit 91ba877, the version
before that restructuring, and by a36fc7b, the version before the Keras
packages were made symmetric (issue 42), each with an ``.npz``: the
micro-batches that version trained
on next and the weights it reached. Made by ``tests/data/make_saved_files.py``
(its docstring says how). Loaded here with ``load_model`` and no
``custom_objects``, each model must hold the pending micro-batches and,
trained on the same micro-batches, reach the same weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

# Only the package, as a user who loads a file has imported it: load_model
# finds its classes by their registered names.
import gradient_accumulator  # noqa: F401
from tests.flavour import NAME, keras

DATA = Path(__file__).resolve().parent.parent / "data"
VERSIONS = ["saved_91ba877", "saved_a36fc7b"]
CASES = ["model_bn", "accumulate", "optimizer"]
K = 4  # accum_steps of every saved model
B = 4  # micro-batch size
# The same arithmetic on the same numbers gives the very same weights (a
# difference of 0 where the files were made); the margin is for the last bits
# another CPU's kernels may round differently (a BatchNorm moving variance of
# 6.14 came 1.4e-6, 3 float32 steps, apart on TensorFlow 2.16 on an AMD
# EPYC), a few units in the last place of each weight's magnitude, far below
# the 1e-2 and more that a lost pending state makes.
ATOL = 1e-6
RTOL = 1e-6


def _pending(model) -> int:
    """Micro-batches the model's accumulation holds: on the model's own
    accumulator (the model wrapper, ``accumulate``) or on its optimizer's
    (the optimizer wrapper)."""
    owner = model if hasattr(model, "_accumulator") else model.optimizer
    return int(owner._accumulator.pending)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("version", VERSIONS)
def test_saved_file_loads_and_resumes_exactly(version, case):
    folder = DATA / version / NAME
    stored = np.load(folder / f"{case}.npz")
    model = keras.models.load_model(folder / f"{case}.keras")

    assert _pending(model) == int(stored["pending"]) == 2
    model.fit(
        stored["x"], stored["y"], batch_size=B, epochs=1, shuffle=False, verbose=0
    )

    weights = model.get_weights()
    assert f"w{len(weights)}" not in stored  # as many weights as were saved
    worst = 0.0
    for i, got in enumerate(weights):
        want = stored[f"w{i}"]
        assert (got.shape, got.dtype) == (want.shape, want.dtype), f"w{i}"
        # Weights are float32, or the bool and int counters of the
        # accumulation state, which must match exactly.
        difference = np.abs(got.astype("float64") - want.astype("float64"))
        worst = max(worst, float(np.max(difference, initial=0.0)))
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"w{i}")
    print(f"{version}/{NAME}/{case}: max abs difference {worst:.3g}")
