"""The child script that runs a package's ``>>>`` examples, for
tests/keras3/test_snippets.py (Keras 3) and tests/keras2/test_doctests.py (tf-keras).

It prints ``doctest LABEL attempted N failed F`` for each module searched, then
for ``__all__``: a module's search keeps only objects it finds to be its own
(by ``__module__``, or a function's globals) and misses public objects defined
in modules not walked (core's AGC functions), so each public object of the
package is searched itself too; what was run once is not run again.
"""

from __future__ import annotations

_BODY = r"""
import doctest, importlib, os, pkgutil
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=FLAGS)
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
package = importlib.import_module(PACKAGE)
for label, name in modules(package):
    run(label, finder.find(importlib.import_module(name)))
public = {f"{package.__name__}.{n}": getattr(package, n) for n in package.__all__}
run("__all__", [
    test for name, obj in public.items() for test in finder.find(obj, name)
])
"""


def script(package: str, modules: str, flags: str) -> str:
    """The child's source: ``modules`` defines ``modules(package)``, the
    (label, module name) pairs to search; ``flags``, doctest option flags."""
    return f"import doctest\nPACKAGE, FLAGS = {package!r}, {flags}\n{modules}\n{_BODY}"
