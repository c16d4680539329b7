"""Smoke tests: the gradient_cache example and benchmark run end to end.

Run as a user would, in a child process with a timeout, in their ``--quick``
modes. The example checks itself against plain Keras on the whole batch and
says so; the benchmark's figures depend on the machine and only the tables'
shape is checked.
"""

from __future__ import annotations

import re

import pytest

from tests.processes import assert_quiet, describe, run_like_a_user, run_script, verdict

CACHED_DIFF = re.compile(r"max \|w_cached - w_bigbatch\| = (\S+)")
SLICED_DIFF = re.compile(r"max \|w_instep - w_bigbatch\| = (\S+) \(without the cache\)")
TIME_HEADER = (
    "| variant | ms/step (median) | vs plain N (wall) | range (wall) "
    "| vs plain N (CPU) |"
)
MEMORY_HEADER = (
    "| N | N/n | cached MiB | (a) plain n + N outputs MiB | cached / (a) "
    "| cached - (a), in parameter sizes | (b) plain N MiB | cached / (b) "
    "| in-step n, no cache, MiB |"
)
NUMBER = r"[0-9]+\.[0-9]+"


@pytest.mark.script
def test_gradient_cache_example_quick_matches_big_batch():
    """The cached two towers equal plain Keras on the whole batch within
    2e-5; slicing without the cache is printed, and is far off."""
    result = run_like_a_user("examples/gradient_cache.py", "--quick")
    assert result.returncode == 0, describe(result)
    assert_quiet(result)
    assert verdict(result).startswith("OK: gradient_cache reproduced"), describe(result)
    cached = CACHED_DIFF.search(result.stdout)
    sliced = SLICED_DIFF.search(result.stdout)
    assert cached and sliced, describe(result)
    assert float(cached.group(1)) <= 2e-5, describe(result)
    assert float(sliced.group(1)) > 100 * 2e-5, describe(result)


@pytest.mark.script
def test_gradient_cache_benchmark_quick_prints_both_tables():
    result = run_script("benchmarks/gradient_cache.py", "--quick")
    assert result.returncode == 0, describe(result)
    lines = result.stdout.splitlines()
    assert TIME_HEADER in lines, describe(result)
    for variant in ("plain 32", "cached 8", "in-step 8, no cache"):
        row = re.compile(
            rf"^\| {variant} \| {NUMBER} \| ({NUMBER}) \| {NUMBER}-{NUMBER} "
            rf"\| {NUMBER} \|$"
        )
        matches = [row.match(line) for line in lines if row.match(line)]
        assert len(matches) == 1, describe(result)
        if variant.startswith("plain"):
            assert float(matches[0].group(1)) == 1.0, describe(result)
    assert MEMORY_HEADER in lines, describe(result)
    for big, k in ((16, 4), (32, 8)):
        row = re.compile(rf"^\| {big} \| {k}( \| -?{NUMBER}){{7}} \|$")
        assert sum(bool(row.match(line)) for line in lines) == 1, describe(result)
    assert "target: cached <= 1.5 x plain N" in result.stdout, describe(result)
    assert "target: cached <= 1.15 x (a)" in result.stdout, describe(result)


@pytest.mark.script
def test_a_cached_step_holds_one_slice_of_activations():
    """FAILS at 417a6ed (the package's gradient_cache): a cached step's peak
    should be one slice's activations plus the batch's outputs, about plain
    training with batch n plus the N outputs ((a), issue 43: at most 1.15x).
    Measured with one inter-op thread (no overlap by chance): 1.83-1.95x.
    ``core/gradient_cache.py::backward_slices`` runs slice 0 before its
    while loop, and the loop's first slice does not depend on it, so
    TensorFlow runs slice 1's taped forward pass while slice 0's
    activations are held. A probe that starts the loop's counter under a
    control dependency on slice 0's gradient sums measured 1.21x (and 1.42x
    with the default threads, against 2.07x). With that fix in the package
    the ratio varies from run to run even with one thread: 0.98, 1.41 and
    1.45x in three runs of this command on 2026-11-29 (a bound of 1.35 failed
    once in CI). The bound sits between those and the two slices held
    before the fix (1.83x and more), so it fails on that defect and not on
    the spread; issue 43's 1.15x is the benchmark's to show, not this
    test's."""
    result = run_script(
        "benchmarks/gradient_cache.py",
        "--part",
        "memory",
        "--inter-op",
        "1",
        "--micro",
        "32",
        "--ratios",
        "4",
        "--rounds",
        "3",
    )
    assert result.returncode == 0, describe(result)
    row = re.compile(rf"^\| 128 \| 4 \| {NUMBER} \| {NUMBER} \| ({NUMBER}) \|")
    (ratio,) = [
        float(m.group(1)) for m in map(row.match, result.stdout.splitlines()) if m
    ]
    assert ratio <= 1.65, describe(result)
