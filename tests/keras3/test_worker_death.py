"""Keras 3: a worker of a two-worker MultiWorkerMirroredStrategy dies
mid-cycle, the cluster manager stops the other, and both restart from the
last backup (``tests/death_worker.py``, driven by
``tests/dist_utils.kill_a_worker_and_resume``).

Keras 3's ``fit`` fails under this strategy for every model, so the workers
train with the loop of ``docs/distributed.md`` (``strategy.run`` of
``train_step`` per global micro-batch) and back up with a
``tf.train.CheckpointManager`` every 3 micro-batches: after micro-batches 3
and 6, both mid-cycle (``K = 4``). Worker 1 SIGKILLs itself before
micro-batch 7, whose update would all-reduce; worker 0, waiting in that
all-reduce, is SIGKILLed by the test. The restarted workers restore the
newest backup that reads and skip the micro-batches it holds, so the resumed
run is the uninterrupted one: the three cases (plain Keras, the optimizer
wrapper, the model wrapper over ``AccumBatchNormalization``) are compared
with an uninterrupted run of the same workers.

The replica-local sums are not restored as they were: the checkpoint holds
their sum over the workers and every restarted worker gets half of it. The
next update all-reduces them, so only that total matters, and it is
restored exactly, the same way on both workers.
"""

from __future__ import annotations

import shutil

import pytest

from tests import death_worker as dw
from tests import dist_utils, utils

TIMEOUT = 240  # s per phase; every worker still running then is killed
ATOL = 1e-5
UPDATES = {"plain": dw.STEPS, "optimizer": dw.STEPS // dw.K, "model": dw.STEPS // dw.K}


@pytest.fixture(scope="module")
def drill(tmp_path_factory):
    """Runs the drill once; returns ``load(name, worker=0)``: that worker's
    ``(arrays by prefix, facts)``, and the torn file's name."""
    out = tmp_path_factory.mktemp("keras3_death")
    torn = []

    def tear(backup):
        shutil.copytree(backup / dw.TORN_SOURCE, backup / dw.TORN)
        torn.append(dist_utils.tear_newest(backup / dw.TORN).name)

    dist_utils.kill_a_worker_and_resume(out, tear, TIMEOUT)

    def load(name, worker=0):
        return dist_utils.load(out / f"w{worker}", name)

    load.torn = torn[0]
    return load


@pytest.mark.parametrize("case", dw.CASES)
def test_keras3_cluster_resumed_after_a_death_ends_as_uninterrupted(drill, case):
    diff = dist_utils.assert_resumed_as(drill, case, case, UPDATES[case], ATOL)
    utils.report(diff, f"{case}: max |w_resumed - w_uninterrupted|")


@pytest.mark.parametrize("case", dw.CASES)
def test_keras3_restarted_workers_resume_mid_cycle(drill, case):
    """Both restarted workers resume after micro-batch 6 with the backup's
    counters (1 update, 2 micro-batches of the second cycle pending); each
    holds half of the pending sums' total over the workers, which the killed
    run's workers held in unequal shares: the total is the saved one."""
    for worker in (0, 1):
        _, saved = drill(f"{case}_at_backup", worker)
        _, restored = drill(f"{case}_restored", worker)
        assert saved["step"] == restored["step"] == dw.LAST_BACKUP, restored
        assert restored["iterations"] == saved["iterations"], restored
        expected = dw.LAST_BACKUP // dw.K if case != "plain" else dw.LAST_BACKUP
        assert restored["iterations"] == expected, restored
        if case != "plain":
            assert restored["micro_step"] == saved["micro_step"] == 2, restored
    if case != "plain":
        dist_utils.assert_sums_split_evenly(drill, case)


def test_keras3_torn_backup_falls_back_to_the_previous_one(drill):
    """The newest backup of the model case, its data file truncated (as a
    death while writing it leaves it): reading it fails with a clear error
    and restores nothing non-finite; the loop of ``docs/distributed.md``
    then restores the previous backup (after micro-batch 3: no update yet,
    3 micro-batches pending) on both workers, and the run resumed from it
    ends as the uninterrupted one."""
    for worker in (0, 1):
        _, facts = drill(f"{dw.TORN}_restored", worker)
        (skipped,) = facts["skipped"]
        assert skipped["path"] + ".data-00000-of-00001" == drill.torn, facts
        assert skipped["type"] == "IndexError", skipped
        assert skipped["message"] == "Read less bytes than requested", skipped
        assert skipped["finite"], skipped
        assert facts["step"] == dw.SAVE, facts
        assert facts["iterations"] == 0 and facts["micro_step"] == dw.SAVE, facts
    source = dw.TORN_SOURCE
    diff = dist_utils.assert_resumed_as(drill, dw.TORN, source, UPDATES[source], ATOL)
    utils.report(diff, "torn, resumed from the previous backup: max |dw|")
