"""The Keras packages, ``gradient_accumulator/keras3`` and
``gradient_accumulator/keras2``, have one shape: the same module files, the
same public names in each module (less the few one Keras alone has), and
the same call signatures, because every public class and function of both
comes from ``hosts/`` (the public classes add no ``__init__`` of their own).
The private modules behind them (``_compat``, ``flavour``, ``loss_scale``,
``inner_optimizers``, ``tracked_engine``) have the same files, their
contents are each Keras' own. A third Keras is one more folder of this
shape. Read, not imported: this folder imports no Keras."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "gradient_accumulator"
FOLDERS = {"keras3": PACKAGE / "keras3", "keras2": PACKAGE / "keras2"}
# The modules of the public names (``gradient_accumulator.__all__``).
API = (
    "accumulate",
    "batch_norm",
    "callbacks",
    "convert",
    "model",
    "optimizer",
    "verify",
)
# What one Keras has and the other lacks: Keras 3's engine class is public
# (0.5.x exported an ``Accumulator``); TensorFlow Model Optimization, whose
# pruning callback is wrapped, builds on tf-keras only.
OWN = {
    "keras3": {"tracked_engine.Accumulator"},
    "keras2": {"callbacks.PruningStepPerUpdate"},
}


def _modules(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.py"))


def _public_names(folder: Path) -> set[str]:
    """``module.name`` of each public top-level class, function or binding."""
    names = set()
    for path in [*(folder / f"{m}.py" for m in API), folder / "tracked_engine.py"]:
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef):
                found = [node.name]
            elif isinstance(node, ast.Assign):
                found = [t.id for t in node.targets if isinstance(t, ast.Name)]
            else:
                found = []
            names |= {f"{path.stem}.{n}" for n in found if not n.startswith("_")}
    return names


def _own_inits(folder: Path) -> list[str]:
    """The public classes that define an ``__init__`` of their own."""
    found = []
    for path in [p for p in folder.glob("*.py") if p.stem in API]:
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            public = isinstance(node, ast.ClassDef) and not node.name.startswith("_")
            if public and any(getattr(f, "name", "") == "__init__" for f in node.body):
                found.append(f"{path.stem}.{node.name}")
    return found


def test_the_keras_packages_have_the_same_module_files():
    keras3, keras2 = (_modules(f) for f in FOLDERS.values())
    assert keras3 == keras2, (
        f"only Keras 3: {set(keras3) - set(keras2)}; "
        f"only tf-keras: {set(keras2) - set(keras3)}"
    )


def test_the_keras_packages_have_the_same_public_names():
    engines = {"keras3": "Accumulator", "keras2": "LayerEngine"}
    names = {
        k: _public_names(f) - OWN[k] - {f"tracked_engine.{engines[k]}"}
        for k, f in FOLDERS.items()
    }
    assert names["keras3"] == names["keras2"], (
        f"only Keras 3: {sorted(names['keras3'] - names['keras2'])}; "
        f"only tf-keras: {sorted(names['keras2'] - names['keras3'])}"
    )
    for keras, own in OWN.items():
        assert own <= _public_names(FOLDERS[keras])  # the exceptions exist


@pytest.mark.parametrize("keras", sorted(FOLDERS))
def test_public_classes_take_the_hosts_signatures(keras):
    assert _own_inits(FOLDERS[keras]) == []


def test_the_checks_see_a_difference(tmp_path):
    (tmp_path / "model.py").write_text(
        "class A:\n    def __init__(self, x):\n        pass\n"
    )
    (tmp_path / "tracked_engine.py").write_text("")
    for module in API:
        if module != "model":
            (tmp_path / f"{module}.py").write_text("_private = 1\n")
    assert _public_names(tmp_path) == {"model.A"}
    assert _own_inits(tmp_path) == ["model.A"]
    assert "model.py" in _modules(tmp_path)
