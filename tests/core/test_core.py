"""``gradient_accumulator/core`` imports no Keras: every module in the folder
is read (not imported) and may import only the standard library,
TensorFlow, NumPy and other modules of the folder. A Keras import there
would tie the engine to one Keras; an import of a host would make the
hosts' and the core's change one change.

And the modules the engine hands its state record to read no private
attribute of another object (``engine._wiring``): they take the record and
explicit arguments, so what they change is what they are given."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "gradient_accumulator" / "core"
MODULES = sorted(CORE.glob("*.py"))
ALLOWED = {"tensorflow", "numpy", "gradient_accumulator"}


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at its top or inside a function, with
    ``from gradient_accumulator import x`` read as ``gradient_accumulator.x``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" for a in node.names]
            found |= (
                set(names) if node.module == "gradient_accumulator" else {node.module}
            )
    return found


def test_the_core_folder_holds_the_engine_and_its_rules():
    names = {p.stem for p in MODULES}
    assert {"engine", "settings", "weighting", "arithmetic"} <= names, names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_core_module_imports_no_keras_and_no_host(path):
    for module in _imports(path):
        top = module.split(".")[0]
        if top == "gradient_accumulator":
            inside = module.split(".")[:2] == ["gradient_accumulator", "core"]
            assert inside, (
                f"{path.name} imports {module}, outside gradient_accumulator/core"
            )
        else:
            assert top in ALLOWED or top in sys.stdlib_module_names, (
                f"{path.name} imports {module}"
            )


HOSTS = CORE.parent / "hosts"
# What the hosts, written once for every Keras, may import of the package:
# the core, each other, and the table that tells an object's Keras.
HOST_IMPORTS = ("core", "hosts", "_which_keras")


@pytest.mark.parametrize("path", sorted(HOSTS.glob("*.py")), ids=lambda p: p.name)
def test_host_module_imports_no_keras(path):
    """A host learns its Keras from the flavour record it is given, never by
    importing one: that is what makes it one host for every Keras."""
    for module in _imports(path):
        parts = module.split(".")
        if parts[0] == "gradient_accumulator":
            assert len(parts) > 1 and parts[1] in HOST_IMPORTS, (
                f"hosts/{path.name} imports {module}"
            )
        else:
            assert parts[0] in ALLOWED or parts[0] in sys.stdlib_module_names, (
                f"hosts/{path.name} imports {module}"
            )


def test_the_check_sees_a_keras_import(tmp_path):
    """Non-vacuity: the reader finds imports at the top, inside functions
    and relative to the package."""
    source = tmp_path / "m.py"
    source.write_text(
        "import keras\n"
        "def f():\n    from tf_keras import layers\n"
        "from gradient_accumulator import model\n"
    )
    assert {"keras", "tf_keras", "gradient_accumulator.model"} <= _imports(source)


# The engine's own modules (its class, and Links, its mixin) and the one
# that holds TensorFlow's private names; every other core module takes the
# engine's state record and explicit arguments instead (issue 42).
OWN_PRIVATE = {"engine.py", "links.py", "_tf_compat.py"}


def _private_reads(path: Path) -> list[str]:
    """Every ``x._name`` in ``path`` (read or set) whose ``x`` is not
    ``self`` or ``cls``, as ``line: x._name``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        owner = ast.unparse(node.value)
        if not node.attr.startswith("__") and owner not in ("self", "cls"):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize(
    "path", [p for p in MODULES if p.name not in OWN_PRIVATE], ids=lambda p: p.name
)
def test_core_module_reads_no_private_attribute_of_another_object(path):
    assert not _private_reads(path), f"{path.name}: {_private_reads(path)}"


def test_the_check_sees_a_private_read(tmp_path):
    """Non-vacuity: reads and writes through any object but ``self``."""
    source = tmp_path / "m.py"
    source.write_text(
        "def f(engine, group):\n"
        "    engine._wiring.pending = None\n"
        "    return group.accumulator._parts, self._ok, x.__class__\n"
    )
    assert _private_reads(source) == [
        "2: engine._wiring",
        "3: group.accumulator._parts",
    ]
