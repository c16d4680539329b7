"""The first minute of a new user: ``--help`` and ``--version`` answer without
importing TensorFlow, runs print no TensorFlow start-up lines, every example
states its defaults and ends with a verdict, and the package's public names
load on first use without changing what ``import`` gives.

No timing is asserted: "fast" is checked as "TensorFlow was never imported".
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

from tests.processes import REPO, describe, run_script

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


def test_an_ordinary_import_registers_the_classes_with_keras():
    """Outside the command, ``import gradient_accumulator`` loads everything,
    so that ``keras.models.load_model`` finds the package's classes."""
    code = (
        "import gradient_accumulator, keras; "
        "print(keras.saving.get_registered_object("
        "'gradient_accumulator>GradientAccumulateModel').__name__)"
    )
    result = run_script("-c", code)
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
    for path in (REPO / "tests").glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                source = ast.unparse(node)
                if "verdict(result)" in source:
                    checked.update(re.findall(r"examples/(\w+\.py)", source))
    assert checked == {p.name for p in EXAMPLES}


def test_runs_print_no_tensorflow_start_up_lines():
    """The command's own run silences TensorFlow, for a user who set nothing
    (the test session's TF_CPP_MIN_LOG_LEVEL removed from the child)."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p
    )
    env["CUDA_VISIBLE_DEVICES"] = "-1"
    command = ["verify", "--micro-batch", "8", "--accum-steps", "2", "--steps", "2"]
    result = subprocess.run(
        [sys.executable, "-m", "gradient_accumulator.cli", *command],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, describe(result)
    noise = re.compile(r"^[IWE]\d{4} |absl::InitializeLog|cuInit|oneDNN", re.M)
    assert not noise.search(result.stderr), describe(result)


LAZY = r"""
import sys
import gradient_accumulator as ga
print("after import:", "tensorflow" in sys.modules)
import gradient_accumulator.verify  # binds the submodule on the package ...
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
    assert "verify is the function: gradient_accumulator.verify" in out, out
    import gradient_accumulator

    public = sorted(gradient_accumulator.__all__)
    assert f"all: {public} True" in out, out
    star = [n for n in public if n != "__version__"]
    assert f"star: {star}" in out, out
    assert "has no attribute 'not_a_name'" in out, out
