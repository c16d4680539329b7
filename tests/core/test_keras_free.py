"""No file of ``tests/core`` imports a Keras: each is read (not imported), and
neither it nor any module of the checkout it imports, followed to the end
(``tests/utils.py``, ``gradient_accumulator/keras3/flavour.py``, ...), may import
``keras`` or ``tf_keras``. A name a module hands out from its ``__getattr__``
(the package's public classes, ``tests.flavour.keras``) is loaded by name on
first use, where reading cannot follow: taking one counts as a Keras import.
So these tests are Keras-neutral, and one environment runs them
(``tests/conftest.py``). ``tests/core/test_core.py`` checks the same of
``gradient_accumulator/core``. Not seen: an attribute of a module imported
whole (``ga.GradientAccumulateModel``), and a child process' imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KERAS = {"keras", "tf_keras"}
FILES = sorted(Path(__file__).resolve().parent.glob("*.py"))


def module_file(name: str, root: Path) -> Path | None:
    """The file of the checkout's module ``name`` (``tests.utils``), or None."""
    base = root.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _bound_at_top(tree: ast.Module) -> set[str]:
    """The names a module binds outside its functions and classes."""
    names, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        todo.extend(ast.iter_child_nodes(node))
    return names


def _lazy(module: str, name: str, root: Path) -> bool:
    """Whether ``module`` of the checkout hands ``name`` out from its
    ``__getattr__`` (it binds no such name itself)."""
    path = module_file(module, root)
    if path is None:
        return False
    bound = _bound_at_top(_parse(path))
    return "__getattr__" in bound and name not in bound


def imported(path: Path, root: Path) -> set[str]:
    """The modules ``path`` imports, anywhere in it: ``from m import n`` is
    ``m.n`` where that is a module of the checkout, ``m:n`` where ``m`` hands
    ``n`` out from its ``__getattr__``, else ``m``."""
    found = set()
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if module_file(sub, root):
                    found.add(sub)
                elif _lazy(node.module, alias.name, root):
                    found.add(f"{node.module}:{alias.name}")
                else:
                    found.add(node.module)
    return found


def keras_imports(path: Path, root: Path = REPO) -> list[str]:
    """How ``path`` reaches a Keras: a chain of imports each way
    (``tests.utils -> tests.flavour:keras``), [] if none."""
    found, seen, todo = [], set(), [(path, [])]
    while todo:
        source, chain = todo.pop()
        for name in sorted(imported(source, root)):
            if name.split(".")[0] in KERAS or ":" in name:
                found.append(" -> ".join([*chain, name]))
            elif name not in seen and (file := module_file(name, root)):
                seen.add(name)
                todo.append((file, [*chain, name]))
    return found


def test_the_core_tests_are_found():
    assert Path(__file__).resolve() in FILES and len(FILES) > 1, FILES


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_core_test_imports_no_keras(path):
    assert not keras_imports(path), (
        f"tests/core/{path.name} imports a Keras: {keras_imports(path)}; "
        "a test that needs one goes to tests/keras3, tests/keras2 or "
        "tests/both (tests/README.md)"
    )


def test_the_check_follows_helpers_and_lazy_names(tmp_path):
    """Non-vacuity: a Keras imported inside a function, through a helper of
    tests/, or as a name a module loads on first use is found; a name that
    module binds itself, and a package module without Keras, are not."""
    for folder in ("tests", "pkg"):
        (tmp_path / folder).mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text(
        "VERSION = 1\ndef __getattr__(name):\n    return name\n"
    )
    (tmp_path / "pkg" / "plain.py").write_text("import tensorflow\n")
    (tmp_path / "tests" / "helper.py").write_text("def f():\n    import tf_keras\n")
    test = tmp_path / "tests" / "test_x.py"
    test.write_text(
        "from tests import helper\n"
        "from pkg import VERSION, Model, plain\n"
        "def test():\n    from keras import ops\n"
    )
    found = sorted(keras_imports(test, tmp_path))
    assert found == ["keras", "pkg:Model", "tests.helper -> tf_keras"], found
