"""``gradient-accumulator verify``, the console command (Keras 3): it passes
the demo model, fails and names BatchNormalization with its fix, and names
bad arguments. (``verify`` itself, in each Keras: tests/both/test_verify.py.)
"""

from __future__ import annotations

import configparser
import sys

import pytest

from gradient_accumulator import cli
from tests.processes import REPO, describe, run_script


# ------------------------------------------------------------------- console
def run_cli(*args: str):
    return run_script("-m", "gradient_accumulator.cli", *args)


SMALL = ("--micro-batch", "8", "--accum-steps", "2", "--steps", "3")


def test_console_script_is_declared():
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    scripts = config["options.entry_points"]["console_scripts"].strip().splitlines()
    assert "gradient-accumulator = gradient_accumulator.cli:main" in scripts


def test_cli_verify_passes_on_the_demo_model():
    result = run_cli("verify", *SMALL)
    assert result.returncode == 0, describe(result)
    assert "OK: max |w_accumulated - w_big_batch|" in result.stdout, describe(result)
    assert "conv2d (Conv2D)" in result.stdout, describe(result)


def test_cli_verify_fails_and_names_batchnorm():
    result = run_cli("verify", "--model", "cnn-batchnorm", *SMALL)
    assert result.returncode == 1, describe(result)
    assert "Breaks equivalence:" in result.stdout, describe(result)
    assert "batch_normalization (BatchNormalization)" in result.stdout
    # ... and the fix.
    fix = result.stdout.split("Breaks equivalence:")[1]
    assert "Fix: use gradient_accumulator.AccumBatchNormalization" in fix
    assert "replace_batchnorm_layers(model)" in fix
    assert result.stdout.splitlines()[-1].startswith("FAIL:")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["verify", "--accum-steps", "0"], "--accum-steps: must be >= 1"),
        (["verify", "--micro-batch", "x"], "--micro-batch: 'x' is not an integer"),
        (["verify", "--tolerance", "-1"], "--tolerance: must be > 0"),
        (["verify", "--model", "resnet"], "--model: invalid choice"),
        ([], "required: command"),
    ],
)
def test_cli_rejects_bad_arguments(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_without_scikit_learn_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # import raises ImportError
    assert cli.main(["verify"]) == 2
    assert 'pip install "gradient-accumulator[examples]"' in capsys.readouterr().err
