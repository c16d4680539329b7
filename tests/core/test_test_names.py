"""The tests' own names, read from their files (nothing is imported): no test
name is in both per-Keras folders, ``tests/keras3`` and ``tests/keras2``.

A behaviour tested in both Kerases is one test in ``tests/both``
(``tests/README.md``); where the two folders test different things, the
names say what differs. ``tests/keras2/test_05_suite.py``, the verbatim
0.5.x port, keeps its names and is not read.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
VERBATIM = {"test_05_suite.py"}
# Same behaviour, one test per Keras, not yet merged into tests/both (their
# helpers and parameters differ per Keras). This list only shrinks: a name
# that stops being in both folders fails the test until it is taken out.
NOT_YET_MERGED: set[str] = set()


def names_in(folder: Path) -> dict[str, list[str]]:
    """``{test name: ["file.py", ...]}`` of the test functions (at module
    level and in classes) of ``folder``'s ``test_*.py`` files."""
    names: dict[str, list[str]] = {}
    for path in sorted(folder.glob("test_*.py")):
        if path.name in VERBATIM:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        scopes = [tree.body]
        scopes += [n.body for n in tree.body if isinstance(n, ast.ClassDef)]
        for body in scopes:
            for node in body:
                function = (ast.FunctionDef, ast.AsyncFunctionDef)
                if isinstance(node, function) and node.name.startswith("test"):
                    names.setdefault(node.name, []).append(path.name)
    return names


def shared_names(keras3: Path, keras2: Path) -> dict[str, tuple[list, list]]:
    """The test names of both folders, with the files holding them."""
    ours, theirs = names_in(keras3), names_in(keras2)
    return {name: (ours[name], theirs[name]) for name in ours.keys() & theirs.keys()}


def test_no_test_name_is_in_both_per_keras_folders():
    shared = shared_names(TESTS / "keras3", TESTS / "keras2")
    new = {name: files for name, files in shared.items() if name not in NOT_YET_MERGED}
    assert not new, (
        "the same test name in tests/keras3 and tests/keras2 (keras3 files, "
        f"keras2 files): {new}. The same behaviour is one test in tests/both; "
        "different behaviours get names that say what differs."
    )
    merged = NOT_YET_MERGED - shared.keys()
    assert not merged, (
        f"no longer in both folders, take out of NOT_YET_MERGED: {merged}"
    )


def test_the_name_check_sees_a_shared_name(tmp_path):
    for folder, extra in (("keras3", "a"), ("keras2", "b")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / f"test_{extra}.py").write_text(
            "def test_same():\n    pass\n\n\n"
            f"class TestX:\n    def test_{extra}_only(self):\n        pass\n"
            "    def test_in_class(self):\n        pass\n\n\n"
            "def helper():\n    pass\n",
            encoding="utf-8",
        )
    (tmp_path / "keras2" / "test_05_suite.py").write_text(
        "def test_a_only():\n    pass\n", encoding="utf-8"
    )
    shared = shared_names(tmp_path / "keras3", tmp_path / "keras2")
    assert shared == {
        "test_same": (["test_a.py"], ["test_b.py"]),
        "test_in_class": (["test_a.py"], ["test_b.py"]),
    }
