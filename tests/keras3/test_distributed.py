"""Accumulation under tf.distribute, against single-device big-batch Keras.

The training runs in child processes (``tests/dist_worker.py``): two logical
CPU devices must be configured before TensorFlow initialises, and
MultiWorkerMirroredStrategy needs one process per worker. Each child trains
with accumulation under the strategy (per-replica micro-batch 4, 2 replicas,
``K = 4``) and plain Keras on one device with the global batch
4 x 2 x 4 = 32, and writes both; the comparisons are made here. Each group of
cases runs once per session (module fixtures) and every test checks one case.
"""

from __future__ import annotations

import pytest

from tests import dist_utils, dist_worker, utils
from tests.processes import assert_quiet, describe, run_like_a_user, run_script, verdict

TIMEOUT = 420  # seconds per group of child processes
RESUME_ATOL = 1e-6

# The mirrored cases checked against the single-device big batch alone; the
# others have tests of their own below.
OWN_TESTS = {
    "model_jit",
    "opt_jit",
    "checkpoint_model",
    "checkpoint_opt",
    "model_nan_one_replica",
    "model_denominators",
}
ACCUMULATING = [c for c in dist_worker.MIRRORED_CASES if c not in OWN_TESTS]


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory):
    out = tmp_path_factory.mktemp("mirrored")
    dist_utils.run_mirrored(out, list(dist_worker.MIRRORED_CASES), TIMEOUT)
    return out


@pytest.fixture(scope="module")
def mwms(tmp_path_factory):
    out = tmp_path_factory.mktemp("mwms")
    dist_utils.run_mwms(out, list(dist_worker.MWMS_CASES), TIMEOUT)
    return out


@pytest.fixture(scope="module")
def mwms_probe(tmp_path_factory):
    """``probe(case)``: the output of a pair of workers that ran only ``case``
    (one of ``dist_worker.MWMS_PROBE_CASES``), run once per module."""
    outputs = {}

    def probe(case: str):
        assert case in dist_worker.MWMS_PROBE_CASES, case
        if case not in outputs:
            out = tmp_path_factory.mktemp(f"mwms_{case}")
            dist_utils.run_mwms(out, [case], TIMEOUT)
            outputs[case] = out
        return outputs[case]

    return probe


def _check_equivalent(out, case):
    weights, facts = dist_utils.load(out, case)
    utils.assert_trained(weights["init"], weights["ref"])
    utils.assert_trained(weights["init"], weights["ours"])
    diff = utils.assert_same_weights(weights["ours"], weights["ref"])
    print(f"{case}: max |w_accum - w_bigbatch| = {diff:.3g}")
    # optimizer.iterations counts updates: 2 epochs x 64 / 32 = 4.
    assert facts["iterations"] == facts["ref_iterations"] == 4, facts
    if "clip" in case:
        # global_clipnorm really clipped the big-batch gradient, so clipping
        # per replica (what Keras does) would have given other weights.
        assert facts["grad_norm"] > 2 * dist_worker.CLIPNORM, facts
    return facts


@pytest.mark.parametrize("case", ACCUMULATING)
def test_mirrored_matches_single_device_big_batch(mirrored, case):
    """Both wrappers under MirroredStrategy (2 CPU replicas), SGD with
    momentum, Adam with global_clipnorm, and an Embedding (IndexedSlices
    added into replica-local buffers) train like one device on the global
    batch."""
    _check_equivalent(mirrored, case)


def test_mirrored_several_denominators_match_single_device_big_batch(mirrored):
    """MLM over the masked tokens beside NSP over the sequences (the token
    head's gradients in an engine part): under MirroredStrategy each replica
    sees its own number of masked tokens, and the model wrapper still trains
    like one device on the global batch, every replica alike. Plain Keras
    under the same strategy on the global big batch (each replica divides by
    its own masked count) is measurably off: the totals must be summed over
    replicas."""
    facts = _check_equivalent(mirrored, "model_denominators")
    assert facts["parts"] == 1, facts
    assert facts["replicas_identical"], facts
    # Measured 4.3e-4 (ours: 3e-8).
    assert facts["plain_mirrored_gap"] > 10 * utils.ATOL, facts


def test_mirrored_non_finite_on_one_replica_drops_the_cycle_everywhere(mirrored):
    """A NaN in replica 1's first micro-batch only: the finite check looks at
    the all-reduced gradient, so both replicas skip that update (Keras' loss
    scale optimizer checks replica 0 alone) and apply the next one; the
    weights equal one big-batch step on the second batch and stay identical
    across replicas."""
    weights, facts = dist_utils.load(mirrored, "model_nan_one_replica")
    utils.assert_trained(weights["init"], weights["ours"])
    utils.assert_same_weights(weights["ours"], weights["ref"])
    assert facts["iterations"] == facts["ref_iterations"] == 1, facts
    assert facts["replicas_identical"], facts


@pytest.mark.parametrize("case", ["checkpoint_model", "checkpoint_opt"])
def test_mirrored_mid_cycle_checkpoint_resumes_exactly(mirrored, case):
    """A tf.train.Checkpoint and a .keras file saved 3 micro-steps into a
    cycle under MirroredStrategy keep both replicas' partial sums: restored
    into a fresh strategy-scoped model, training continues to the weights of
    the uninterrupted run (the saved model going on in memory, which matches
    the big batch); the checkpoint also resumes on a single device."""
    weights, facts = dist_utils.load(mirrored, case)
    utils.assert_trained(weights["init"], weights["ours"])
    utils.assert_same_weights(weights["ours"], weights["ref"])
    # The save happened mid-cycle, with replica partial sums that differ.
    assert facts["micro_step_at_save"] == 3, facts
    assert facts["iterations_at_save"] == 1, facts
    assert facts["replica_partials_differ"], facts
    # The counter (a mirrored variable, aggregation only_first_replica,
    # assigned in cross-replica context) is the same on every replica.
    assert facts["micro_step_per_replica_at_save"] == [3, 3], facts
    for how in ("ckpt", "keras"):
        # The restored totals are the saved replica sums.
        assert facts[f"{how}_micro_step_restored"] == 3, facts
        assert facts[f"{how}_micro_step_per_replica"] == [3, 3], facts
        assert facts[f"{how}_weight_sum_restored"] == facts["weight_sum_at_save"]
        diff = utils.assert_same_weights(
            weights[how], weights["ours"], atol=RESUME_ATOL
        )
        print(f"{case}/{how}: max |w_resumed - w_uninterrupted| = {diff:.3g}")
        assert facts[f"{how}_iterations"] == facts["iterations"] == 4, facts
    # Resumed on one device, without a strategy, from the same checkpoint.
    diff = utils.assert_same_weights(weights["single"], weights["ours"])
    print(f"{case}/single-device: max |w_resumed - w_uninterrupted| = {diff:.3g}")
    assert facts["single_iterations"] == 4, facts


@pytest.mark.parametrize("case", ["model_jit", "opt_jit"])
def test_mirrored_jit_compile_fails_exactly_as_plain_keras(mirrored, case):
    """jit_compile=True under MirroredStrategy with two local devices: Keras
    compiles the whole multi-replica step as one XLA computation, which
    cannot touch variables on the other device. Plain Keras fails the same
    way; if a TensorFlow release lifts that, ours must then match the big
    batch."""
    _, facts = dist_utils.load(mirrored, case)
    plain = facts["plain_jit_error"]
    if plain is None:
        assert "jit_error" not in facts, facts
        assert facts["jit_compile"] is True, facts
        _check_equivalent(mirrored, case)
        return
    assert "located in device" in plain, plain
    assert "located in device" in facts["jit_error"], facts


def test_mwms_two_workers_match_single_device_big_batch(mwms):
    """MultiWorkerMirroredStrategy, 2 worker processes on 127.0.0.1: the
    model wrapper (SGD) and the optimizer wrapper (Adam + global_clipnorm)."""
    for case in ("model_sgd", "opt_adam_clip"):
        _check_equivalent(mwms, case)


def test_mwms_one_all_reduce_per_update(mwms):
    """Counted in the traced train step under MWMS, where every cross-worker
    sum is a CollectiveReduceV2 op (MirroredStrategy on CPU sums local copies
    with AddN instead, so it has nothing to count): exactly one all-reduce,
    in the update branch; none on accumulate-only micro-steps and none
    outside the conditional."""
    for case in ("model_sgd", "opt_adam_clip"):
        _, facts = dist_utils.load(mwms, case)
        assert facts["collectives"] == {
            "update": 1,
            "accumulate": 0,
            "other": 0,
            "conditionals": 1,
        }, (case, facts)


def test_mwms_batch_norm_statistics_ride_in_the_same_all_reduce(mwms):
    """AccumBatchNormalization in the model under MWMS: its moving statistics
    pool every micro-batch of both workers (equal to Keras' BatchNormalization
    on the big batch), and its sums travel in the gradients' all-reduce, so
    there is still exactly one per update."""
    _, facts = dist_utils.load(mwms, "model_bn")
    print(f"model_bn: max |moving stats - big batch| = {facts['moving_stats_diff']}")
    assert facts["moving_stats_diff"] <= 1e-5, facts
    assert facts["iterations"] == facts["ref_iterations"] == 4, facts
    assert facts["collectives"] == {
        "update": 1,
        "accumulate": 0,
        "other": 0,
        "conditionals": 1,
    }, facts


def test_split_collectives_counts_per_branch():
    """The counter itself, on a hand-built graph: collectives inside the
    branches of a cond and one outside are attributed where they sit."""
    import tensorflow as tf

    group = tf.constant(2)
    key = tf.constant(1)

    @tf.function
    def fn(x, flag):
        def reduce(t):
            return tf.raw_ops.CollectiveReduceV2(
                input=t,
                group_size=group,
                group_key=key,
                instance_key=tf.constant(3),
                ordering_token=[],
                merge_op="Add",
                final_op="Id",
            )

        y = tf.cond(flag, lambda: reduce(reduce(x)), lambda: x + 1.0)
        return reduce(y)

    graph = fn.get_concrete_function(
        tf.TensorSpec([2], tf.float32), tf.TensorSpec([], tf.bool)
    ).graph
    counts = dist_worker.split_collectives(graph.as_graph_def())
    assert counts == {"update": 2, "accumulate": 0, "other": 1, "conditionals": 1}


def test_mwms_jit_compile_unsupported_on_cpu_for_plain_keras_too(mwms_probe):
    """XLA has no CPU implementation of collectives: a jit-compiled step under
    MWMS fails on CPU for plain Keras, and ours fails the same way."""
    _, facts = dist_utils.load(mwms_probe("model_jit"), "model_jit")
    assert facts["plain_jit_error"] is not None, facts
    assert "Collectives are not yet implemented for CPU" in facts["plain_jit_error"]
    assert "Collectives are not yet implemented for CPU" in facts["jit_error"]


# ------------------------------------------------------ example and benchmark
@pytest.mark.script
def test_distributed_example_quick_matches_big_batch():
    """examples/distributed.py launches its 2 MWMS workers on loopback and
    reports the weight difference against one-device big-batch Keras."""
    import re

    import tensorflow as tf

    result = run_like_a_user("examples/distributed.py", "--quick", timeout=TIMEOUT)
    assert result.returncode == 0, describe(result)
    assert verdict(result).startswith("OK: "), describe(result)
    # TensorFlow 2.16 prints its coordination service's start-up line (and
    # absl's notice before it) under MultiWorkerMirroredStrategy: seen in
    # the lowest pair's CI, not yet silenced. This run's quiet is checked
    # from TensorFlow 2.17 on (it was checked on the newest pair only).
    if tuple(int(n) for n in tf.__version__.split(".")[:2]) >= (2, 17):
        assert_quiet(result)
    match = re.search(r"max \|w_accum - w_bigbatch\| = (\S+)", result.stdout)
    assert match, describe(result)
    assert float(match.group(1)) <= utils.ATOL, describe(result)
    assert "optimizer updates: 4" in result.stdout, describe(result)
    assert verdict(result).startswith("OK: accumulation under Multi"), describe(result)


@pytest.mark.script
def test_distributed_benchmark_quick_prints_counted_table():
    """benchmarks/distributed.py --quick prints its table; the all-reduce
    counts are counted from the traced graphs: 1 per update for ours and
    accum_steps (8) for the naive step. Timings are never asserted."""
    import re

    result = run_script("benchmarks/distributed.py", "--quick", timeout=TIMEOUT)
    assert result.returncode == 0, describe(result)
    rows = {
        m.group(1): int(m.group(2))
        for m in re.finditer(
            r"^\| (ours|naive) \| [0-9.]+ \| (\d+) \| [0-9.]+ \|$",
            result.stdout,
            re.MULTILINE,
        )
    }
    assert rows == {"ours": 1, "naive": 8}, describe(result)


def test_mwms_plain_model_fit_fails_in_keras_for_plain_models_too(mwms_probe):
    """Under MWMS, Keras 3's own ``model.fit`` fails for a plain keras.Model
    (it reduces the whole (x, y) batch with strategy.reduce, which MWMS
    rejects), and ours fails the same way (each fit in a pair of workers of
    its own), so the MWMS tests run ``train_step`` through ``strategy.run``
    instead (docs/distributed.md).
    If a Keras release fixes fit, ours must then match the big batch."""
    _, plain = dist_utils.load(mwms_probe("model_fit_plain"), "model_fit_plain")
    weights, facts = dist_utils.load(mwms_probe("model_fit"), "model_fit")
    if plain["plain_fit_error"] is None:
        assert "fit_error" not in facts, facts
        utils.assert_same_weights(weights["ours"], weights["ref"])
        assert facts["iterations"] == 4, facts
        return
    assert "PerReplica" in plain["plain_fit_error"], plain
    assert "PerReplica" in facts["fit_error"], facts
