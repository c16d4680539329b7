"""The package's layout rules, read from its files (nothing is imported):

- every module, class and function keeps the size limits;
- no two modules' names differ by a letter or a suffix for different things
  (``verify``/``verification``); the 0.5.x import paths are kept as they are;
- the tf-keras flavour repeats few of its code lines from the Keras 3
  side (``FLAVOUR_REPEATS``): the logic both Kerases share is written once,
  in ``hosts/`` and ``core/``, and ``keras2/`` holds only what differs.
"""

from __future__ import annotations

import ast
import itertools
import re
from keyword import iskeyword
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "gradient_accumulator"
MODULES = sorted(PACKAGE.rglob("*.py"))
LIMITS = {"module": 600, "class": 400, "function": 80}
# 0.5.x import paths, kept as they were (``accumulators`` beside
# ``accumulate``): their names are not ours to choose.
SHIMS = {"accumulators", "layers", "utils", "agc"}
# Issue 32 asks for at most 10 %: 8.5 % (18 of 212 lines; 51 % at the
# issue, then 20 %, 13 %, 12 %, 10.5 %, 9.0 %). What is left is mostly the
# shape: the shells' class lines, the line binding each public function
# made in hosts/public.py. The shape both Kerases share by design is not
# counted (see _shared_shape): a Flavour hook's def line and a Flavour
# value's line in each Keras' subclass, a public class's ``_flavour`` line
# and its registration for saving.
FLAVOUR_REPEATS = 0.10
HOOKS = PACKAGE / "hosts" / "flavour.py"
SHARED_LINES = (
    "_flavour = FLAVOUR",
    "_model_wrapper = GradientAccumulateModel",
    '@keras.saving.register_keras_serializable(package="gradient_accumulator")',
)


def _hook_names() -> set[str]:
    """The names of ``hosts.flavour.Flavour``'s hooks: its methods and its
    annotated values (read, not imported: this folder imports no Keras)."""
    tree = ast.parse(HOOKS.read_text(encoding="utf-8"))
    (flavour,) = [n for n in tree.body if getattr(n, "name", "") == "Flavour"]
    names = {n.name for n in flavour.body if isinstance(n, ast.FunctionDef)}
    names |= {n.target.id for n in flavour.body if isinstance(n, ast.AnnAssign)}
    return names - {"__init__"}


def _shared_shape(node: ast.AST, hooks: set[str]) -> bool:
    """Whether ``node`` states a hook each Keras implements: a method or a
    class attribute of a Flavour hook's name."""
    if isinstance(node, ast.FunctionDef):
        return node.name in hooks
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        return getattr(node.targets[0], "id", None) in hooks
    return False


def _public_binding(node: ast.AST) -> bool:
    """Whether ``node`` binds a public function from its factory in
    ``hosts/public.py`` (``verify = public.verify(FLAVOUR, __name__, ...)``):
    each Keras package has the same lines, naming its own classes."""
    if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
        return False
    function = node.value.func
    return getattr(getattr(function, "value", None), "id", None) == "public"


def _sizes(path: Path) -> list[tuple[str, str, int]]:
    """``(kind, name, lines)`` for the module and each class and function
    in it, nested ones included."""
    source = path.read_text(encoding="utf-8")
    sizes = [("module", path.name, len(source.splitlines()))]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            kind = "class"
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            kind = "function"
        else:
            continue
        sizes.append((kind, node.name, node.end_lineno - node.lineno + 1))
    return sizes


@pytest.mark.parametrize(
    "path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)).replace("/", ".")
)
def test_module_keeps_the_size_limits(path):
    over = [
        f"{kind} {name}: {lines} lines (at most {LIMITS[kind]})"
        for kind, name, lines in _sizes(path)
        if lines > LIMITS[kind]
    ]
    assert not over, f"{path.relative_to(PACKAGE)}: " + "; ".join(over)


def test_the_size_check_sees_a_long_function(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("class C:\n    def f(self):\n" + "        x = 1\n" * 81)
    sizes = _sizes(source)
    assert ("function", "f", 82) in sizes and ("class", "C", 83) in sizes


def _near(a: str, b: str) -> bool:
    """Whether two module names differ by one letter, or one is the other
    with a suffix of letters (``optimizer``/``optimizers``,
    ``convert``/``conversion``-like stems share all but an ending)."""
    if a == b:
        return False
    short, long = sorted((a, b), key=len)
    if long.startswith(short) and long[len(short) :].isalpha():
        return True
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b, strict=True)) == 1
    return len(long) == len(short) + 1 and any(
        long[:i] + long[i + 1 :] == short for i in range(len(long))
    )


def _stem_root(name: str) -> str:
    # verify/verification, convert/conversion: compare the stems' first
    # five letters when both are single words.
    return name[:5] if "_" not in name and len(name) > 5 else name


def _close(a: str, b: str) -> bool:
    a, b = a.lstrip("_"), b.lstrip("_")
    return a != b and (_near(a, b) or _stem_root(a) == _stem_root(b))


def test_no_two_module_names_a_letter_or_a_suffix_apart():
    names = {p.stem for p in MODULES if p.stem != "__init__"} - SHIMS
    close = [
        (a, b) for a, b in itertools.combinations(sorted(names), 2) if _close(a, b)
    ]
    assert not close, f"module names too close for different things: {close}"


def test_the_name_check_sees_near_names():
    near = [("optimizer", "optimizers"), ("accumulate", "accumulator")]
    near += [("verify", "verification"), ("_keras_compat", "keras_compat")]
    assert all(_close(a, b) for a, b in near[:3]) and not _close(*near[3])
    assert not _close("model", "engine") and not _close("engine", "engine_state")


def _code_lines(path: Path) -> list[str]:
    """The module's code lines that say something: not blank, comment,
    import or docstring, with two or more names that are not Python's
    keywords (``return None``, ``raise ValueError(``, ``trainable=False,``
    name nothing two modules could share); a tf-keras name reads as its
    Keras 3 one."""
    source = path.read_text(encoding="utf-8")
    skipped: set[int] = set()
    hooks = _hook_names()
    for node in ast.walk(ast.parse(source)):
        is_doc = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        if is_doc or isinstance(node, ast.Import | ast.ImportFrom):
            skipped.update(range(node.lineno, node.end_lineno + 1))
        elif _shared_shape(node, hooks):
            skipped.add(node.lineno)  # the def or assignment line only
        elif _public_binding(node):
            skipped.update(range(node.lineno, node.end_lineno + 1))
    lines = []
    for number, line in enumerate(source.splitlines(), start=1):
        text = re.sub(r"#.*$", "", line).strip()
        text = text.replace("tf_keras", "keras").replace("tf.keras", "keras")
        names = [w for w in re.findall(r"[A-Za-z_]\w*", text) if not iskeyword(w)]
        shared = number in skipped or text in SHARED_LINES
        if not shared and len(names) >= 2:
            lines.append(text)
    return lines


def _repeats(flavour: list[Path], others: list[Path]) -> tuple[int, int]:
    """``(repeated, total)``: the flavour's code lines, and how many of them
    stand in one of ``others``."""
    seen = {line for path in others for line in _code_lines(path)}
    lines = [line for path in flavour for line in _code_lines(path)]
    return sum(line in seen for line in lines), len(lines)


def test_the_tf_keras_flavour_repeats_little_of_keras_3():
    tf_keras = [p for p in MODULES if "keras2" in p.parts]
    others = [p for p in MODULES if "keras2" not in p.parts]
    repeated, total = _repeats(tf_keras, others)
    assert repeated <= FLAVOUR_REPEATS * total, (
        f"{repeated} of the tf-keras flavour's {total} code lines repeat a "
        f"Keras 3 line ({repeated / total:.0%}; at most {FLAVOUR_REPEATS:.0%})"
    )


def test_the_repeat_count_reads_through_names_and_skips_prose(tmp_path):
    ours, theirs = tmp_path / "a.py", tmp_path / "b.py"
    ours.write_text(
        '"""A docstring line."""\nimport tf_keras\nx = tf_keras.Model()\n'
        "y = compute(x)  # a comment\nz = 1\ndef f():\n    return None\n"
    )
    theirs.write_text("x = keras.Model()\n")
    assert _repeats([ours], [theirs]) == (1, 2)


def test_the_repeat_count_skips_the_hooks_each_keras_implements(tmp_path):
    ours, theirs = tmp_path / "a.py", tmp_path / "b.py"
    ours.write_text(
        "class F(Flavour):\n    functional = Functional\n"
        "    def forward(self, model, x):\n        return model(x, training=True)\n"
        "    def helper(self, model):\n        return model\n"
    )
    theirs.write_text(
        "functional = Functional\ndef forward(self, model, x):\n"
        "    return model(x, training=True)\ndef helper(self, model):\n"
        "    return model\n"
    )
    assert {"forward", "functional", "other_optimizer_wrapper"} <= _hook_names()
    # The hook's def and value lines are shared shape; its body and a
    # method that is no hook are code.
    assert _repeats([ours], [theirs]) == (2, 3)


def test_the_repeat_count_skips_the_bindings_of_public_functions(tmp_path):
    ours, theirs = tmp_path / "a.py", tmp_path / "b.py"
    binding = "verify = public.verify(\n    FLAVOUR, __name__, Model\n)\n"
    ours.write_text(binding + "check = other.verify(FLAVOUR, __name__, Model)\n")
    theirs.write_text(binding + "check = other.verify(FLAVOUR, __name__, Model)\n")
    assert _repeats([ours], [theirs]) == (1, 1)
