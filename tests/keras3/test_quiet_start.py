"""The first minute of a new user: ``--help`` and ``--version`` answer without
importing TensorFlow, the command's and every example's run prints no
TensorFlow log lines, every example states its defaults and ends with a
verdict, and the package's public names load on first use without changing
what ``import`` gives.

No timing is asserted: "fast" is checked as "TensorFlow was never imported".
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

from tests.processes import (
    REPO,
    assert_quiet,
    describe,
    run_like_a_user,
    run_script,
)

EXAMPLES = sorted((REPO / "examples").glob("*.py"))

# Runs a script or module as __main__ with the given argv, then reports which
# heavy modules the process imported (also when argparse exits).
PROBE = r"""
import runpy, sys
target, *argv = sys.argv[1:]
try:
    if target.endswith(".py"):
        sys.argv = [target, *argv]
        runpy.run_path(target, run_name="__main__")
    else:
        sys.argv = [target, *argv]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
except SystemExit as exit:
    code = exit.code
else:
    code = 0
heavy = sorted(m for m in ("tensorflow", "keras") if m in sys.modules)
print(f"PROBE exit={code} heavy={','.join(heavy) or 'none'}")
"""


def probe(*args: str) -> tuple[subprocess.CompletedProcess, str]:
    result = run_script("-c", PROBE, *args)
    lines = [line for line in result.stdout.splitlines() if line.startswith("PROBE")]
    return result, lines[-1] if lines else ""


def imported_heavy(stderr: str) -> list[str]:
    """TensorFlow or Keras modules in ``-X importtime`` output."""
    found = re.findall(r"^import time:.*\|\s+(tensorflow|keras)(?:\.|$)", stderr, re.M)
    return sorted(set(found))


def command(*args: str) -> subprocess.CompletedProcess:
    """The real command, ``python -m gradient_accumulator.cli``, with
    ``-X importtime`` listing every module it imports on stderr."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p
    )
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "gradient_accumulator.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize(
    "args",
    [
        ("--help",),
        ("--version",),
        ("verify", "--help"),
        ("verify", "--accum-steps", "0"),
    ],
    ids=["help", "version", "verify-help", "bad-option"],
)
def test_cli_answers_without_tensorflow(args):
    result = command(*args)
    assert result.returncode == (2 if "0" in args else 0), describe(result)
    assert "import time:" in result.stderr, describe(result)  # the probe works
    assert imported_heavy(result.stderr) == [], describe(result)
    if "--version" in args:
        from gradient_accumulator import __version__

        assert result.stdout.startswith(__version__), describe(result)


def test_an_ordinary_import_registers_the_classes_with_keras(tmp_path):
    """Outside the project's own programs (here a user's script, not in
    examples/), ``import gradient_accumulator`` loads everything, so that
    ``keras.models.load_model`` finds the package's classes."""
    script = tmp_path / "train.py"
    script.write_text(
        "import gradient_accumulator, keras\n"
        "print(keras.saving.get_registered_object("
        "'gradient_accumulator>GradientAccumulateModel').__name__)\n",
        encoding="utf-8",
    )
    result = run_script(str(script))
    assert result.returncode == 0, describe(result)
    assert result.stdout.split()[-1] == "GradientAccumulateModel", describe(result)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_help_shows_defaults_without_tensorflow(example):
    result, line = probe(str(example.relative_to(REPO)), "--help")
    assert line == "PROBE exit=0 heavy=none", describe(result)
    options = re.findall(r"^  (?:-\w, )?(--[\w-]+)", result.stdout, re.M)
    options = [o for o in options if o != "--help"]
    assert options, describe(result)
    # ArgumentDefaultsHelpFormatter: "(default: ...)" after every option.
    assert result.stdout.count("(default:") == len(options), describe(result)


def test_every_example_is_run_by_a_test_that_checks_its_verdict():
    """Each example's --quick run is tested, and that test checks the last
    line (``verdict(...)``): an example cannot end without one unnoticed."""
    checked = set()
    for path in (REPO / "tests" / "keras3").glob("test_*.py"):
        for source in _tests_with_their_helpers(path):
            if "verdict(result)" in source:
                checked.update(re.findall(r"examples/(\w+\.py)", source))
    assert checked == {p.name for p in EXAMPLES}


def _tests_with_their_helpers(path) -> list[str]:
    """The source of each test function in ``path``, followed by the source
    of each of the file's own functions it calls (a shared helper may run
    the example and check its output for the test)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    sources = []
    for name, node in functions.items():
        if name.startswith("test_"):
            called = {
                c.func.id
                for c in ast.walk(node)
                if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
            }
            helpers = [functions[n] for n in sorted(called) if n in functions]
            sources.append("\n".join(ast.unparse(f) for f in [node, *helpers]))
    return sources


def test_the_example_scan_reads_the_helpers_a_test_calls(tmp_path):
    """Non-vacuity: a test whose helper checks the verdict counts, a test
    that checks nothing does not."""
    path = tmp_path / "test_x.py"
    # Spelled out of pieces, so that the scan of this file does not read this
    # test as one that checks an example.
    check, folder = "verdict" + "(result)", "exam" + "ples"
    path.write_text(
        f"def _run(s):\n    result = run_like_a_user(s)\n    {check}\n"
        f"def test_a():\n    _run('{folder}/a.py')\n"
        f"def test_b():\n    run_like_a_user('{folder}/b.py')\n"
    )
    sources = _tests_with_their_helpers(path)
    assert [check in s for s in sources] == [True, False]


def test_the_command_prints_no_tensorflow_log_lines():
    """``gradient-accumulator verify`` silences TensorFlow for a user who set
    nothing (neither TF_CPP_MIN_LOG_LEVEL nor CUDA_VISIBLE_DEVICES)."""
    command = ["verify", "--micro-batch", "8", "--accum-steps", "2", "--steps", "2"]
    result = run_like_a_user("-m", "gradient_accumulator.cli", *command)
    assert result.returncode == 0, describe(result)
    assert_quiet(result)


def test_every_example_run_is_checked_for_tensorflow_log_lines():
    """Each example's --quick run is tested as a new user runs it
    (``run_like_a_user``: the command its docstring gives), and that test
    checks the whole output for TensorFlow log lines (``assert_quiet``): one
    run per example checks its numbers, its verdict and its quiet."""
    checked = set()
    for path in (REPO / "tests" / "keras3").glob("test_*.py"):
        for body in _tests_with_their_helpers(path):
            if "run_like_a_user(" in body and "assert_quiet(result)" in body:
                checked.update(re.findall(r"examples/(\w+\.py)", body))
    assert checked == {p.name for p in EXAMPLES}


LAZY = r"""
import sys
import gradient_accumulator as ga
print("after import:", "tensorflow" in sys.modules)
import gradient_accumulator.keras3.verify  # a submodule named as a function
print("verify is the function:", callable(ga.verify) and ga.verify.__module__)
names = {name: getattr(ga, name) for name in ga.__all__}
from gradient_accumulator import *
print("star:", sorted(n for n in ga.__all__ if n != "__version__" and n in globals()))
print("all:", sorted(names), sorted(dir(ga)) == sorted(set(dir(ga))))
try:
    ga.not_a_name
except AttributeError as error:
    print("missing:", error)
"""


def test_package_exports_every_public_name():
    result = run_script("-c", LAZY)
    assert result.returncode == 0, describe(result)
    out = result.stdout
    assert "after import: True" in out, describe(result)
    assert "verify is the function: gradient_accumulator.keras3.verify" in out, out
    import gradient_accumulator

    public = sorted(gradient_accumulator.__all__)
    assert f"all: {public} True" in out, out
    star = [n for n in public if n != "__version__"]
    assert f"star: {star}" in out, out
    assert "has no attribute 'not_a_name'" in out, out
