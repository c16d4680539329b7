"""tf-keras under MultiWorkerMirroredStrategy: two worker processes on
127.0.0.1 (``tests/keras2/mwms_worker.py``), one CPU replica each, training
with ``model.fit`` (graph mode).

Both wrappers (the model with a current and a legacy inner optimizer, the
optimizer wrapper around a current and a legacy one), on micro-batches of
``MICRO`` per worker and ``K`` per update, end where plain tf-keras ends on
one device with the global big batch ``K * MICRO * 2``, and their traced
train function all-reduces once per update: as many gradient all-reduces as
plain tf-keras makes per big-batch step. The workers run once per module.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests import dist_utils
from tests.keras2 import utils
from tests.keras2.mwms_worker import BIG, CASES, EPOCHS, N
from tests.processes import describe, run_script

TIMEOUT = 240  # s per worker; run_script kills a worker still running then
UPDATES = EPOCHS * N // BIG


@pytest.fixture(scope="module")
def mwms(tmp_path_factory):
    """Runs the two workers on two free ports (picked now) and returns
    ``load(case, kind, worker=0)``: that worker's (weights, facts)."""
    out = tmp_path_factory.mktemp("keras2_mwms")
    ports = ",".join(map(str, dist_utils.free_ports(2)))

    def worker(index):
        return run_script(
            *("-m", "tests.keras2.mwms_worker", "--index", str(index)),
            *("--ports", ports, "--out", str(out)),
            timeout=TIMEOUT,
        )

    # Each worker waits on its own thread: the pool's exit waits for both,
    # and a worker whose peer failed fails itself within its collective
    # timeout (mwms_worker.COLLECTIVE_TIMEOUT), or is killed at TIMEOUT.
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(worker, range(2)))
    for index, result in enumerate(results):
        assert result.returncode == 0, f"worker {index}: {describe(result)}"

    def load(case, kind, worker=0):
        return dist_utils.load(out / f"w{worker}", f"{case}_{kind}")

    return load


def _check_against_reference(load, case, kind):
    """``case`` trained by ``kind`` under MWMS matches the one-device big
    batch; returns its facts."""
    reference, _ = load("single", kind)
    weights, facts = load(case, kind)
    utils.assert_same_weights(weights["init"], reference["init"], atol=0)
    utils.assert_trained(reference["init"], reference["ours"])
    utils.assert_trained(weights["init"], weights["ours"])
    diff = utils.assert_same_weights(weights["ours"], reference["ours"])
    print(f"\n{case}/{kind} under MWMS: max |w - w_bigbatch| = {diff:.3g}")
    assert facts["iterations"] == UPDATES, facts
    # Both workers end with the same weights.
    other, _ = load(case, kind, worker=1)
    utils.assert_same_weights(other["ours"], weights["ours"], atol=0)
    return facts


@pytest.mark.parametrize("kind", list(utils.MOMENTUM_AND_ADAM))
def test_plain_tf_keras_under_mwms_matches_one_device(mwms, kind):
    """The set-up's own check: plain tf-keras on the global big batch under
    MWMS (the all-reduce count's reference) trains like one device."""
    _check_against_reference(mwms, "plain", kind)


@pytest.mark.parametrize(("wrapper", "kind"), CASES)
def test_wrapper_under_mwms_matches_big_batch(mwms, wrapper, kind):
    _check_against_reference(mwms, wrapper, kind)


def _sizes(trace) -> list[int]:
    return trace["sizes"]["top"] + trace["sizes"]["nested"]


def _gradient_all_reduces(sizes: list[int]) -> list[int]:
    """The all-reduces of more than one element: the gradients' (those of
    the logs are scalars)."""
    return [size for size in sizes if size > 1]


@pytest.mark.parametrize(("wrapper", "kind"), CASES)
def test_wrapper_all_reduces_once_per_update(mwms, wrapper, kind):
    """Counted as CollectiveReduceV2 ops in every train function ``fit``
    traced: one all-reduce, in the update branch of the engine's conditional,
    carrying all the gradients at once; none on accumulate-only micro-steps.
    The others, outside the conditional, are the scalar log reductions that
    plain tf-keras makes too; and plain tf-keras all-reduces its gradients
    once per big-batch step, as one packed tensor: the same count."""
    _, facts = mwms(wrapper, kind)
    _, plain = mwms("plain", kind)
    params = facts["params"]
    assert plain["params"] == params
    (first, *_) = plain["traces"]
    logs = len(_sizes(first)) - 1
    for trace in plain["traces"]:
        assert _gradient_all_reduces(_sizes(trace)) == [params], plain
        assert len(_sizes(trace)) == logs + 1, plain
    print(f"\nplain tf-keras/{kind}: {first}")
    for trace in facts["traces"]:
        print(f"{wrapper}/{kind}: {trace}")
        assert trace["split"] == {
            "update": 1,
            "accumulate": 0,
            "other": logs,
            "conditionals": 1,
        }, (trace, plain)
        # The update's all-reduce (in the conditional's branch, not in the
        # function's own body) carries every gradient; the others are the
        # scalar ones.
        (packed,) = _gradient_all_reduces(trace["sizes"]["nested"])
        assert packed >= params, trace
        assert _gradient_all_reduces(trace["sizes"]["top"]) == [], trace
