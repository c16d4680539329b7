"""tf-keras: a worker of a two-worker MultiWorkerMirroredStrategy dies
mid-cycle, the cluster manager stops the other, and both restart ``fit``
with ``BackupAndRestore`` (``tests/death_worker.py``, driven by
``tests/dist_utils.kill_a_worker_and_resume``).

The workers train with ``fit`` and ``BackupAndRestore(save_freq=3)``: the
backup that counts is written after micro-batch 6 of the first epoch,
mid-cycle (``K = 4``). Worker 1 SIGKILLs itself before micro-batch 7, whose
update would all-reduce; worker 0 is SIGKILLed by the test. (``fit`` trains
one model at a time: the cases before the last stop at the same point by an
exception on both workers, which leaves their backups as a death does.)

What tf-keras' own resumption feeds is not the uninterrupted run's data:
restarted, ``fit`` counts the epoch on from the saved step (6) but its
fresh iterator feeds the epoch from its first batch, so micro-batches 0-5
are trained twice in the first epoch and 6-11 never, for plain tf-keras as
for ours. The resumed runs are therefore compared with an uninterrupted run
of the same workers fed that sequence (``death_worker.TF_KERAS_FED``), and
plain tf-keras on one device fed it on the big batch; how far that is from
the run on the data in order is measured too.
"""

from __future__ import annotations

import shutil

import pytest

from tests import death_worker as dw
from tests import dist_utils
from tests.keras2 import utils

TIMEOUT = 240  # s per phase; every worker still running then is killed
ATOL = 1e-5
UPDATES = {"plain": dw.STEPS, "optimizer": dw.STEPS // dw.K, "model": dw.STEPS // dw.K}


@pytest.fixture(scope="module")
def drill(tmp_path_factory):
    """Runs the drill once; returns ``load(name, worker=0)``: that worker's
    ``(arrays by prefix, facts)``."""
    out = tmp_path_factory.mktemp("keras2_death")

    def tear(backup):
        shutil.copytree(backup / dw.TORN_SOURCE, backup / dw.TORN)
        dist_utils.tear_newest(backup / dw.TORN)

    dist_utils.kill_a_worker_and_resume(out, tear, TIMEOUT)
    return dist_utils.drill_loader(out)


@pytest.mark.parametrize("case", dw.CASES)
def test_tf_keras_fit_resumed_after_a_death_ends_as_a_run_fed_the_same(drill, case):
    diff = dist_utils.assert_resumed_as(drill, case, case, UPDATES[case], ATOL)
    utils.report(diff, f"{case}: max |w_resumed - w_fed_the_same|")


@pytest.mark.parametrize("case", dw.CASES)
def test_tf_keras_fit_restarts_the_epoch_at_the_saved_step(drill, case):
    """Both restarted workers' ``fit`` starts at batch 6 of the first epoch
    with the backup's counters (1 update, 2 micro-batches pending); each
    holds half of the pending sums' total over the workers, which the killed
    run's workers held in unequal shares: the total is the saved one."""
    for worker in (0, 1):
        _, saved = drill(f"{case}_at_backup", worker)
        _, restored = drill(f"{case}_restored", worker)
        assert saved["batch"] == restored["batch"] == dw.LAST_BACKUP, restored
        assert restored["iterations"] == saved["iterations"], restored
        expected = dw.LAST_BACKUP // dw.K if case != "plain" else dw.LAST_BACKUP
        assert restored["iterations"] == expected, restored
        if case != "plain":
            assert restored["micro_step"] == saved["micro_step"] == 2, restored
    if case != "plain":
        dist_utils.assert_sums_split_evenly(drill, case)


@pytest.mark.parametrize("case", ["plain", "optimizer"])
def test_tf_keras_fit_resumed_refeeds_the_epochs_first_batches(drill, case):
    """The resumed run equals plain tf-keras on one device fed
    ``TF_KERAS_FED`` (micro-batches 0-5, 0-5, then 0-11), on the global
    micro-batch (plain) or the big batch (the optimizer wrapper), and not
    the same fed the data in order (0-11, 0-11)."""
    resumed, _ = drill(f"{case}_resumed")
    initial, _ = drill(f"{case}_init")
    batch = dw.GLOBAL if case == "plain" else dw.GLOBAL * dw.K

    def one_device(order):
        model = dw.build("plain")
        utils.assert_same_weights(utils.weights(model), initial["t"], atol=0)
        x, y = dw.samples(order)
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        assert int(model.optimizer.iterations) == len(x) // batch
        return utils.weights(model)

    fed = one_device(dw.TF_KERAS_FED)
    diff = utils.assert_same_weights(resumed["t"], fed, atol=ATOL)
    utils.report(diff, f"{case}: max |w_resumed - w_one_device_fed_the_same|")
    in_order = one_device([*range(dw.BATCHES)] * dw.EPOCHS)
    gap = utils.max_abs_diff(resumed["t"], in_order)
    utils.report(gap, f"{case}: max |w_resumed - w_one_device_in_order|")
    assert gap > 1e-3, gap


def test_tf_keras_torn_backup_fails_clearly_and_trains_nothing(drill):
    """The model case's backup, its data file truncated (as a death while
    writing it leaves it): tf-keras' BackupAndRestore keeps one backup, so
    the restarted ``fit`` fails on both workers with TensorFlow's error at
    restore, before any update, and every weight stays finite."""
    initial, _ = drill(f"{dw.TORN_SOURCE}_init")
    for worker in (0, 1):
        arrays, facts = drill(f"{dw.TORN}_resumed", worker)
        assert facts["error"]["type"] == "IndexError", facts
        assert facts["error"]["message"] == "Read less bytes than requested", facts
        assert facts["iterations"] == 0 and facts["micro_step"] == 0, facts
        utils.assert_finite(arrays["w"])
        utils.assert_finite(arrays["o"])
        utils.assert_same_weights(arrays["t"], initial["t"], atol=0)
