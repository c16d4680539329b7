"""The ``>>>`` examples of the tf-keras hosts run, in a child process where
``tf.keras`` is tf-keras (as a user would run them)."""

import os
import pkgutil
import re

import gradient_accumulator.keras2
from tests import doctest_child
from tests.processes import describe, run_script

CHILD = doctest_child.script(
    "gradient_accumulator.keras2",
    """def modules(package):
    return [
        (m.name, f"{package.__name__}.{m.name}")
        for m in pkgutil.iter_modules(package.__path__)
    ]""",
    "doctest.ELLIPSIS",
)
# >>> examples run: 57 (47 before the package's public objects were searched).
MIN_EXAMPLES = 57


def test_tf_keras_modules_docstring_examples_run(tmp_path):
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
