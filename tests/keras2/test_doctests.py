"""The ``>>>`` examples of the tf-keras hosts run, in a child process where
``tf.keras`` is tf-keras (as a user would run them)."""

import os
import pkgutil
import re

import gradient_accumulator.keras2
from tests.processes import describe, run_script

CHILD = r"""
import doctest, importlib, pkgutil
import gradient_accumulator.keras2 as package
for m in pkgutil.iter_modules(package.__path__):
    module = importlib.import_module(f"{package.__name__}.{m.name}")
    failed, attempted = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    print(f"doctest {m.name} attempted {attempted} failed {failed}", flush=True)
"""


def test_docstring_examples_run(tmp_path):
    assert os.environ.get("TF_USE_LEGACY_KERAS")  # the child inherits it
    result = run_script("-c", CHILD, cwd=tmp_path)
    assert result.returncode == 0, describe(result)
    counts = re.findall(
        r"^doctest (\S+) attempted (\d+) failed (\d+)$", result.stdout, re.M
    )
    modules = {
        m.name for m in pkgutil.iter_modules(gradient_accumulator.keras2.__path__)
    }
    assert {name for name, _, _ in counts} == modules, describe(result)
    assert not [name for name, _, n in counts if int(n)], describe(result)
    assert sum(int(n) for _, n, _ in counts) >= 8, describe(result)
