"""Smoke tests: the README's demo and the benchmark run end to end.

Each script runs in a child process exactly as a user would start it, in its
``--quick`` mode. The benchmark is only checked for its output's shape: its
timings depend on the machine and are never asserted.
"""

from __future__ import annotations

import re

from tests.processes import describe, run_script

WEIGHT_DIFF = re.compile(r"max \|w_accum - w_bigbatch\| = (\S+)")
TABLE_HEADER = "| model | variant | ms/micro-step | ratio vs plain |"


def test_digits_demo_quick_matches_big_batch():
    result = run_script("examples/digits_demo.py", "--quick")
    assert result.returncode == 0, describe(result)
    match = WEIGHT_DIFF.search(result.stdout)
    assert match, describe(result)
    assert float(match.group(1)) <= 1e-4, describe(result)


def test_overhead_benchmark_quick_prints_table():
    result = run_script(
        "benchmarks/overhead.py",
        "--quick",
        "--models",
        "mlp",
        "--phases",
        "--probe-unchecked",
    )
    assert result.returncode == 0, describe(result)
    lines = result.stdout.splitlines()
    assert any(line.startswith(TABLE_HEADER) for line in lines), describe(result)
    number = r"[0-9]+\.[0-9]+"
    variants = ("plain", "ours-model", "ours-optimizer", "keras-builtin")
    for variant in (*variants, "ours-model-unchecked"):
        row = re.compile(rf"^\| mlp \| {variant} \| {number} \| ({number}) \|")
        assert any(row.match(line) for line in lines), describe(result)
        # --phases: four micro-steps (accum_steps 4), the cycle, its ratio.
        phases = re.compile(rf"^\| mlp \| {variant}( \| {number}){{6}} \|$")
        assert any(phases.match(line) for line in lines), describe(result)
    assert "target: ours <= 1.03 x plain and <= keras-builtin" in lines, describe(
        result
    )


def test_schedule_example_quick_matches_big_batch():
    result = run_script("examples/schedule.py", "--quick")
    assert result.returncode == 0, describe(result)
    match = WEIGHT_DIFF.search(result.stdout)
    assert match and float(match.group(1)) <= 1e-4, describe(result)
    assert "accum_steps now 4" in result.stdout, describe(result)


def test_masked_sequence_example_quick_is_token_exact():
    result = run_script("examples/masked_sequence.py", "--quick")
    assert result.returncode == 0, describe(result)
    match = WEIGHT_DIFF.search(result.stdout)
    assert match and float(match.group(1)) <= 1e-4, describe(result)
    naive = re.search(r"\| keras-builtin [^|]*\| (\S+) \|", result.stdout)
    # The naive average is visibly off: the example shows a real difference.
    assert naive and float(naive.group(1)) > 100 * float(match.group(1)), describe(
        result
    )
