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
# A module's tests skip functions made in another module (the public functions
# written once in hosts/public.py): each public object is searched itself, and
# what the modules already ran is not run again.
public = {f"{package.__name__}.{n}": getattr(package, n) for n in package.__all__}
run("__all__", [
    test for name, obj in public.items() for test in finder.find(obj, name, globs={})
])
"""
# >>> examples run: 47 (before and after replace_batchnorm_layers and verify
# were made in hosts/public.py).
MIN_EXAMPLES = 47


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
    assert public[0] > 0, describe(result)  # the made public functions
    assert sum(int(n) for _, n, _ in counts) >= MIN_EXAMPLES, describe(result)
