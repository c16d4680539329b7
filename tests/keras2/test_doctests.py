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
finder = doctest.DocTestFinder()
runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
seen = set()
def run(label, tests):
    failed = attempted = 0
    for test in tests:
        key = (test.filename, test.lineno, test.docstring)
        if test.examples and key not in seen:
            seen.add(key)
            result = runner.run(test)
            failed, attempted = failed + result.failed, attempted + result.attempted
    print(f"doctest {label} attempted {attempted} failed {failed}", flush=True)
for m in pkgutil.iter_modules(package.__path__):
    run(m.name, finder.find(importlib.import_module(f"{package.__name__}.{m.name}")))
# A module's search keeps only objects it finds to be its own (by __module__, or
# a function's globals), and misses public objects defined in modules not
# walked here (core's AGC functions): each public object is searched itself too,
# and what the modules already ran is not run again.
public = {f"{package.__name__}.{n}": getattr(package, n) for n in package.__all__}
run("__all__", [
    test for name, obj in public.items() for test in finder.find(obj, name)
])
"""
# >>> examples run: 57 (47 before the package's public objects were searched).
MIN_EXAMPLES = 57


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
    assert {name for name, _, _ in counts} == modules | {"__all__"}, describe(result)
    assert not [name for name, _, n in counts if int(n)], describe(result)
    public = [int(n) for name, n, _ in counts if name == "__all__"]
    assert public[0] > 0, describe(result)  # core's AGC functions
    assert sum(int(n) for _, n, _ in counts) >= MIN_EXAMPLES, describe(result)
