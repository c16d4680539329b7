"""The documentation builds without a single warning, and documents every
public name.

Runs the same command as a local docs build, ``python -m sphinx -W``, in a
child process (autodoc imports the package, hence TensorFlow).
"""

from __future__ import annotations

import gradient_accumulator
from tests.processes import REPO, describe, run_script


def test_docs_build_without_warnings(tmp_path):
    html = tmp_path / "html"
    result = run_script(
        "-m",
        "sphinx",
        "-W",  # any warning fails the build
        "--keep-going",  # ... after reporting all of them
        "-q",
        "-b",
        "html",
        "-d",
        str(tmp_path / "doctrees"),
        "docs",
        str(html),
    )
    assert result.returncode == 0, describe(result)

    api = (html / "api.html").read_text(encoding="utf-8")
    for name in gradient_accumulator.__all__:
        # autodoc skips public names without a docstring.
        assert f'id="gradient_accumulator.{name}"' in api, (
            f"{name} is exported but not on the API page: does it have a docstring?"
        )
    # Pages that include files from outside docs/ show their content.
    benchmarks = (html / "benchmarks.html").read_text(encoding="utf-8")
    assert "Overhead per micro-step" in benchmarks
    changelog = (html / "changelog.html").read_text(encoding="utf-8")
    assert gradient_accumulator.__version__.split(".dev")[0] in changelog
    # Every figure a page shows was copied into the site.
    for image in (REPO / "docs" / "_static").glob("*.png"):
        assert (html / "_static" / image.name).is_file(), image.name
