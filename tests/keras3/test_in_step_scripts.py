"""Smoke tests: the in-step example and the memory benchmark run end to end.

Run as a user would, in a child process with a timeout (``run_script``), in
their ``--quick`` modes. The benchmark's figures depend on the machine and are
only checked for the table's shape; the example checks itself against the big
batch and says so in its output.
"""

from __future__ import annotations

import re

import pytest

from tests.processes import assert_quiet, describe, run_like_a_user, run_script, verdict

WEIGHT_DIFF = re.compile(r"max \|w_instep - w_bigbatch\| = (\S+)")
MEMORY_HEADER = (
    "| variant | samples in memory | peak MiB (median) | ratio vs big batch |"
)


@pytest.mark.script
def test_in_step_example_quick_matches_big_batch():
    result = run_like_a_user("examples/in_step.py", "--quick")
    assert result.returncode == 0, describe(result)
    assert verdict(result).startswith("OK: "), describe(result)
    assert_quiet(result)
    match = WEIGHT_DIFF.search(result.stdout)
    assert match, describe(result)
    assert float(match.group(1)) <= 1e-4, describe(result)
    assert verdict(result).startswith("OK: in-step micro-batching reproduced"), (
        describe(result)
    )


@pytest.mark.script
def test_memory_benchmark_quick_prints_table():
    result = run_script("benchmarks/memory.py", "--quick")
    assert result.returncode == 0, describe(result)
    lines = result.stdout.splitlines()
    assert any(line.startswith(MEMORY_HEADER) for line in lines), describe(result)
    ratios = {}
    for variant in ("big batch", "streaming", "in-step"):
        row = re.compile(rf"^\| {variant} \| \d+ \| [0-9.]+ \| ([0-9.]+) \| \d+ \|$")
        matches = [row.match(line) for line in lines if row.match(line)]
        assert len(matches) == 1, describe(result)
        ratios[variant] = float(matches[0].group(1))
    assert ratios["big batch"] == 1.0, describe(result)
