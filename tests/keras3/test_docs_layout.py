"""The documentation's layout, checked in headless Chromium by
``docs/check_layout.py`` (see its docstring for the rules).

Skipped, with the reason, when Chromium, chromedriver or selenium is missing
(``apt-get install chromium chromium-driver``; selenium is in the test extra).
"""

from __future__ import annotations

import importlib.util
import shutil

import pytest

from tests.processes import REPO, describe, run_script, verdict

BROWSER = any(
    shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")
)
missing = [
    what
    for what, present in (
        ("Chromium", BROWSER),
        ("chromedriver", shutil.which("chromedriver")),
        ("selenium", importlib.util.find_spec("selenium")),
    )
    if not present
]
pytestmark = pytest.mark.skipif(
    bool(missing),
    reason=f"no {', '.join(missing)}: apt-get install chromium chromium-driver",
)

OVERFLOWING = """<!doctype html><html><head><meta name="viewport"
content="width=device-width, initial-scale=1"></head><body><main>
<div style="width: 300px"><pre style="width: 900px; overflow-x: hidden">
{line}</pre></div></main></body></html>"""


def test_checker_catches_an_overflowing_code_block(tmp_path):
    """The check can fail: a pre wider than its container and the window."""
    page = tmp_path / "bad.html"
    page.write_text(OVERFLOWING.format(line="x = 1  # " + "y" * 200))
    result = run_script("docs/check_layout.py", "--page", str(page), timeout=180)
    assert result.returncode == 1, describe(result)
    assert "is wider than its container" in result.stdout, describe(result)
    assert "is clipped" in result.stdout, describe(result)
    assert "page is" in result.stdout, describe(result)
    assert verdict(result).startswith("FAIL:"), describe(result)


# A table wider than its scrolling box (as Furo wraps every table), a heading
# whose command breaks after a hyphen, and one whose compound word does
# (allowed); the page itself does not scroll sideways.
CUT_TABLE_AND_HEADINGS = """<!doctype html><html><head><meta name="viewport"
content="width=device-width, initial-scale=1"></head><body><article>
<section><h2 style="width: 120px; font-size: 20px">Run
<code>--probe-unchecked</code></h2>
<h2 style="width: 110px; font-size: 20px">In-step micro-batching</h2>
<div style="width: 300px; overflow-x: auto"><table><tr>{cells}</tr></table></div>
</section></article></body></html>"""


def test_checker_catches_a_cut_table_and_a_heading_broken_inside_code(tmp_path):
    page = tmp_path / "bad.html"
    cells = "".join(f"<td>column{i}_{'x' * 20}</td>" for i in range(8))
    page.write_text(CUT_TABLE_AND_HEADINGS.format(cells=cells))
    result = run_script("docs/check_layout.py", "--page", str(page), timeout=180)
    assert result.returncode == 1, describe(result)
    out = result.stdout
    for width in (1280, 390):
        assert f"bad.html at {width} px: table 1 (" in out, describe(result)
        assert 'breaks inside "--probe-unchecked"' in out, describe(result)
    assert "are hidden or behind a scrollbar" in out, describe(result)
    assert "micro-batching" not in out, describe(result)  # a compound word
    assert "page is" not in out, describe(result)
    assert verdict(result).startswith("FAIL:"), describe(result)


def test_docs_layout_at_desktop_and_phone_width():
    result = run_script("docs/check_layout.py", timeout=420)  # builds the docs
    assert result.returncode == 0, describe(result)
    docs = REPO / "docs"
    pages = len(list(docs.glob("*.md"))) + len(list(docs.glob("api/*.md")))
    ok = f"OK: {pages} pages at 1280 px and 390 px"
    assert verdict(result).startswith(ok), describe(result)
