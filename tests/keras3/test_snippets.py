"""Every Python code block of README.md and docs/*.md runs as shown, and so
does every ``>>>`` example in the package's docstrings.

A page's ```` ```python ```` blocks run in order in one fresh child process
(a page is read top to bottom: a later block may use what an earlier block of
the same page defined), from a temporary directory, with a timeout. The
children are forked from one process that imported TensorFlow, Keras and the
package (``tests/preloaded.py``): each page still starts from a process of its
own, and the imports are paid once instead of once per page. A block
that is deliberately not runnable (a bare signature, a fragment of a larger
program) is marked on the line just before its fence with
``<!-- not-run: why -->``; shell commands use another fence language (``bash``,
``text``). The child reports each block it finished, so a page whose blocks
were skipped or never reached fails, and the total number executed must stay
above a floor.
"""

from __future__ import annotations

import json
import pkgutil
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

import gradient_accumulator
import gradient_accumulator.keras3 as ga_keras3
from tests import doctest_child
from tests.preloaded import Preloaded
from tests.processes import REPO, describe

# Pages whose code is for tf-keras run in tests/keras2 (where tf.keras is it).
KERAS2_PAGES = [REPO / "docs" / "tf-keras.md", REPO / "docs" / "recipes-tf-keras.md"]
PAGES = [
    p
    for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    if p not in KERAS2_PAGES
]
FENCE = re.compile(r"^(?P<ticks>`{3,})(?P<info>[^`]*)$")
NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(?P<why>\S.*?)\s*-->$")
# A page may ask for no Python block to run only with a reason; more than this
# many unrun blocks means the docs drifted to illustrative fragments.
MAX_NOT_RUN = 4
MIN_EXECUTED = 31  # blocks executed over all pages (31 today: 6 in recipes.md)
# The tf-keras pages' blocks, run by tests/keras2/test_docs.py (8 today: 6 in
# recipes-tf-keras.md).
MIN_EXECUTED_TF_KERAS = 8
MIN_DOCTEST_MODULES = 5  # modules with >>> examples in their docstrings
# >>> examples run: 66 (39 before replace_batchnorm_layers and verify had
# examples in Keras 3 too and the package's public objects were searched).
MIN_DOCTEST_EXAMPLES = 66

CHILD = r"""
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
blocks = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
for block in blocks:
    # Pad with newlines so that a traceback names the Markdown file's line.
    source = "\n" * block["line"] + block["source"]
    exec(compile(source, block["path"], "exec"), namespace)
    print(f"ran {block['path']}:{block['line']}", flush=True)
"""


@dataclass
class Block:
    path: str  # relative to the repository
    line: int  # line of the opening fence (1-based); the code starts after it
    source: str
    not_run: str | None  # the reason given by a <!-- not-run: ... --> marker


def python_blocks(page: Path) -> list[Block]:
    """The ```python fenced blocks of a Markdown page, nested ones included."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match and match["info"].strip() == "python":
            end = next(
                (j for j in range(i + 1, len(lines)) if lines[j] == match["ticks"]),
                None,
            )
            assert end is not None, f"{page}:{i + 1}: unclosed code block"
            marker = NOT_RUN.match(lines[i - 1].strip()) if i else None
            blocks.append(
                Block(
                    path=str(page.relative_to(REPO)),
                    line=i + 1,
                    source="\n".join(lines[i + 1 : end]) + "\n",
                    not_run=marker["why"] if marker else None,
                )
            )
            i = end
        i += 1
    return blocks


def test_pages_have_runnable_blocks_and_few_exceptions():
    blocks = [b for page in PAGES for b in python_blocks(page)]
    run = [b for b in blocks if b.not_run is None]
    skipped = [f"{b.path}:{b.line} ({b.not_run})" for b in blocks if b.not_run]
    assert len(run) >= MIN_EXECUTED, (len(run), skipped)
    tf_keras_run = [
        b for page in KERAS2_PAGES for b in python_blocks(page) if b.not_run is None
    ]
    assert len(tf_keras_run) >= MIN_EXECUTED_TF_KERAS, len(tf_keras_run)
    assert len(skipped) <= MAX_NOT_RUN, skipped
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        # Python under another fence name would escape this test.
        for info in re.findall(r"^`{3,}(py\w*|ipython\w*)\s*$", text, re.M):
            assert info == "python", f"{page.name}: fence '{info}': use 'python'"
        # A marker must sit right above a python fence, or it marks nothing.
        markers = len(re.findall(r"<!--\s*not-run:", text))
        marked = sum(b.not_run is not None for b in python_blocks(page))
        assert markers == marked, f"{page.name}: a not-run marker is misplaced"


@pytest.fixture(scope="module")
def children():
    """Fresh child processes with TensorFlow, Keras and the package imported."""
    preloaded = Preloaded("tensorflow", "keras", "gradient_accumulator")
    yield preloaded
    preloaded.close()


@pytest.mark.parametrize(
    "page",
    [p for p in PAGES if any(b.not_run is None for b in python_blocks(p))],
    ids=lambda p: p.name,
)
def test_page_code_blocks_run(page, tmp_path, children):
    run_page_blocks(page, tmp_path, children)


def run_page_blocks(page, tmp_path, children: Preloaded):
    """Runs a page's blocks in a fresh child process and checks each finished."""
    blocks = [b for b in python_blocks(page) if b.not_run is None]
    work = tmp_path / "cwd"
    work.mkdir()
    result = children.run(
        CHILD, cwd=work, input=json.dumps([asdict(b) for b in blocks]), timeout=240
    )
    assert result.returncode == 0, describe(result)
    done = re.findall(r"^ran (\S+)$", result.stdout, re.M)
    assert done == [f"{b.path}:{b.line}" for b in blocks], describe(result)


# The tf-keras hosts (keras2) run theirs in tests/keras2, where tf.keras is
# tf-keras.
DOCTEST_CHILD = doctest_child.script(
    "gradient_accumulator",
    """def modules(package):
    import gradient_accumulator.keras3 as keras3
    names = [package.__name__] + [
        f"{package.__name__}.{m.name}"
        for m in pkgutil.iter_modules(package.__path__)
        if m.name != "keras2"
    ] + [f"{keras3.__name__}.{m.name}" for m in pkgutil.iter_modules(keras3.__path__)]
    return [(name, name) for name in names]""",
    "doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE",
)


def test_docstring_examples_run(tmp_path, children):
    """The ``>>>`` examples of every module of the package, in a child process
    (as a user would run them: no test-session settings such as op
    determinism, which makes Keras' unseeded initializers raise)."""
    result = children.run(DOCTEST_CHILD, cwd=tmp_path)
    assert result.returncode == 0, describe(result)
    counts = re.findall(
        r"^doctest (\S+) attempted (\d+) failed (\d+)$", result.stdout, re.M
    )
    modules = {m.name for m in pkgutil.iter_modules(gradient_accumulator.__path__)}
    keras3 = {m.name for m in pkgutil.iter_modules(ga_keras3.__path__)}
    assert len(counts) == len(modules - {"keras2"}) + len(keras3) + 2, describe(result)
    failed = [name for name, _, n in counts if int(n)]
    assert not failed, describe(result)
    with_examples = [name for name, n, _ in counts if int(n)]
    assert len(with_examples) >= MIN_DOCTEST_MODULES, with_examples
    public = [int(n) for name, n, _ in counts if name == "__all__"]
    assert public and public[0] > 0, describe(result)  # core's AGC functions
    examples = sum(int(n) for _, n, _ in counts)
    assert examples >= MIN_DOCTEST_EXAMPLES, describe(result)
