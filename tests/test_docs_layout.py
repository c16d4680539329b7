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


def test_docs_layout_at_desktop_and_phone_width():
    result = run_script("docs/check_layout.py", timeout=420)  # builds the docs
    assert result.returncode == 0, describe(result)
    pages = 3 + len(list((REPO / "docs" / "api").glob("*.md")))  # see pages_of
    ok = f"OK: {pages} pages at 1280 px and 390 px"
    assert verdict(result).startswith(ok), describe(result)
