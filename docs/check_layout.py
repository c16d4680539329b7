"""Checks the built documentation's layout in a real browser (headless Chromium).

Renders every page made from docs/*.md and docs/api/*.md at a desktop width
(1280 px) and a phone width (390 px, mobile emulation) and fails when:

- the page is wider than the window (anything makes it scroll sideways);
- a code block (``pre``) is wider than its container, or its content overflows
  with no scrollbar to reach it (clipped);
- a table does not show all its columns: it is wider than the content column,
  so that part of it is hidden or behind a scrollbar (Furo puts every table
  in a box that scrolls sideways);
- a heading is cut, or breaks a line inside a word or inside code (a command
  such as ``epoch.py --rounds 31`` split after a hyphen); it may break only
  between words and after the hyphen of a compound word (``micro-step``);
- at the desktop width, a code block needs a horizontal scrollbar at all (the
  content column must fit the project's 88-character lines; a program's
  output, a ``text`` block, is as wide as the program prints it), or a name in
  the navigation sidebar is cut off.

On a phone, a code block whose lines are longer than the screen scrolls
inside its own box: that is the accepted behaviour, the page itself must not.
docs/_static/layout.css sets the phone-width type of tables and headings.

Usage (needs Chromium, its driver and selenium; on Debian:
``apt-get install chromium chromium-driver`` and ``pip install selenium``)::

    python docs/check_layout.py                  # builds the docs, then checks
    python docs/check_layout.py --html DIR       # checks an existing build
    python docs/check_layout.py --page FILE ...  # checks these HTML files only

Prints one line per problem and a last line ``OK: ...`` or ``FAIL: ...``;
exits 0, 1 (layout problems) or 2 (no browser or driver).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIDTHS = {"desktop": 1280, "phone": 390}
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
DRIVER = "chromedriver"
DOCS = ROOT / "docs"

# Runs in the page; returns a list of problems (strings).
MEASURE = """
const desktop = arguments[0];
const problems = [];
const width = document.documentElement.clientWidth;
const page = document.documentElement.scrollWidth;
if (page > width + 1) {
  problems.push(`page is ${page} px wide in a ${width} px window`);
}
const textOf = (el) => {  // visible text, without the heading's "¶" link
  const copy = el.cloneNode(true);
  copy.querySelectorAll(".headerlink").forEach((a) => a.remove());
  return (copy.textContent || "").replace(/\\s+/g, " ").trim();
};
const describe = (el) => {
  const text = textOf(el).slice(0, 50);
  return `${el.tagName.toLowerCase()} "${text}"`;
};
for (const pre of document.querySelectorAll("article pre, main pre")) {
  const box = pre.getBoundingClientRect();
  const parent = pre.parentElement.getBoundingClientRect();
  if (box.right > parent.right + 1 || box.left < parent.left - 1) {
    problems.push(`${describe(pre)} is wider than its container`);
  }
  if (box.right > width + 1) {
    problems.push(`${describe(pre)} runs past the window's right edge`);
  }
  const overflow = pre.scrollWidth > pre.clientWidth + 1;
  const scrolls = ["auto", "scroll"].includes(getComputedStyle(pre).overflowX);
  if (overflow && !scrolls) {
    problems.push(`${describe(pre)} is clipped: no scrollbar for its overflow`);
  }
  const output = pre.closest(".highlight-text") !== null;
  if (overflow && desktop && !output) {
    problems.push(
      `${describe(pre)} needs a scrollbar at ${width} px ` +
      `(${pre.scrollWidth} > ${pre.clientWidth})`
    );
  }
}
// A table shows all its columns: it fits the content column, and no
// ancestor (Furo's scrolling table wrapper, the article) cuts it.
const tables = [...document.querySelectorAll("article table, main table")];
const tableName = (table) => {
  const cells = [...table.rows[0].cells].map((c) => c.textContent.trim());
  const section = table.closest("section");
  const heading = section && section.querySelector("h1, h2, h3, h4, h5, h6");
  const under = heading ? ` under "${textOf(heading).slice(0, 40)}"` : "";
  return `table ${tables.indexOf(table) + 1} ("${cells[0]}" ... "${cells.at(-1)}", ` +
    `${cells.length} columns)${under}`;
};
for (const table of tables) {
  if (table.offsetParent === null) continue;
  const box = table.getBoundingClientRect();
  let cut = null;
  for (let el = table.parentElement; el && el !== document.body;
       el = el.parentElement) {
    if (getComputedStyle(el).overflowX !== "visible") {
      cut = Math.round(box.right - el.getBoundingClientRect().right);
      break;
    }
  }
  if (cut !== null && cut > 1) {
    problems.push(
      `${tableName(table)} is cut: ${cut} px of its ${Math.round(box.width)} ` +
      `are hidden or behind a scrollbar`
    );
  } else if (box.right > width + 1) {
    problems.push(`${tableName(table)} runs past the window's right edge`);
  }
}
// A heading fits its column and wraps only between words: never inside code
// (a command such as "epoch.py --rounds 31" split after a hyphen), nor
// inside a word, except after the hyphen of a compound word ("micro-step").
for (const heading of document.querySelectorAll(
    "article h1, article h2, article h3, article h4, article h5, article h6")) {
  if (heading.scrollWidth > heading.clientWidth + 1) {
    problems.push(`heading ${describe(heading)} is cut`);
  }
  const walker = document.createTreeWalker(heading, NodeFilter.SHOW_TEXT);
  const chars = [];
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    if (node.parentElement.closest(".headerlink")) continue;
    const code = node.parentElement.closest("code") !== null;
    for (let i = 0; i < node.data.length; i++) {
      const range = document.createRange();
      range.setStart(node, i);
      range.setEnd(node, i + 1);
      chars.push({ch: node.data[i], code, rect: range.getClientRects()[0]});
    }
  }
  const text = chars.map((c) => c.ch).join("").replace(/\\s/g, " ");
  const letter = (c) => c && !c.code && /\\p{L}/u.test(c.ch);
  for (let i = 1; i < chars.length; i++) {
    const a = chars[i - 1], b = chars[i];
    if (!a.rect || !b.rect || /\\s/.test(a.ch) || /\\s/.test(b.ch)) continue;
    if (b.rect.top < a.rect.bottom - 2) continue;  // same line
    if (a.ch === "-" && !a.code && letter(chars[i - 2]) && letter(b)) continue;
    const start = text.lastIndexOf(" ", i - 1) + 1;
    const end = text.indexOf(" ", i) < 0 ? text.length : text.indexOf(" ", i);
    problems.push(
      `heading ${describe(heading)} breaks inside "${text.slice(start, end)}" ` +
      `("${text.slice(start, i)}" / "${text.slice(i, end)}")`
    );
  }
}
if (desktop) {
  for (const link of document.querySelectorAll(".sidebar-tree a")) {
    if (link.offsetParent !== null && link.scrollWidth > link.clientWidth + 1) {
      problems.push(`sidebar entry "${link.textContent.trim()}" is cut off`);
    }
  }
}
return problems;
"""


def find_browser() -> tuple[str, str] | None:
    """Paths of Chromium and its driver, or None."""
    browser = next((p for p in map(shutil.which, BROWSERS) if p), None)
    driver = shutil.which(DRIVER)
    return (browser, driver) if browser and driver else None


def build_docs(out: Path) -> Path:
    html = out / "html"
    doctrees = str(out / "doctrees")
    command = ["-m", "sphinx", "-W", "-q", "-b", "html", "-d", doctrees]
    subprocess.run(
        [sys.executable, *command, str(ROOT / "docs"), str(html)], check=True
    )
    return html


def pages_of(html: Path) -> list[Path]:
    """Every page made from docs/*.md and docs/api/*.md (not Sphinx's own
    search and index pages)."""
    names = [p.relative_to(ROOT / "docs") for p in sorted(DOCS.glob("*.md"))]
    names += [p.relative_to(ROOT / "docs") for p in sorted(DOCS.glob("api/*.md"))]
    return [html / name.with_suffix(".html") for name in names]


def start_browser(browser: str, driver: str, profile: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--window-size=1280,900",
    ):
        options.add_argument(flag)
    # An explicit driver path: Selenium Manager never downloads anything.
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)


def check(pages: list[Path], browser: str, driver: str) -> list[str]:
    problems = []
    with tempfile.TemporaryDirectory(prefix="ga-chromium-") as profile:
        chrome = start_browser(browser, driver, Path(profile))
        try:
            for name, width in WIDTHS.items():
                chrome.execute_cdp_cmd(
                    "Emulation.setDeviceMetricsOverride",
                    {
                        "width": width,
                        "height": 900,
                        "deviceScaleFactor": 1,
                        "mobile": name == "phone",
                    },
                )
                for page in pages:
                    chrome.get(page.resolve().as_uri())
                    found = chrome.execute_script(MEASURE, name == "desktop")
                    problems += [f"{page.name} at {width} px: {p}" for p in found]
        finally:
            chrome.quit()
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--html", type=Path, help="an existing HTML build")
    parser.add_argument("--page", type=Path, nargs="+", help="check only these")
    args = parser.parse_args(argv)
    found = find_browser()
    if found is None:
        print(
            "SKIP: no Chromium and chromedriver on PATH "
            "(Debian: apt-get install chromium chromium-driver)"
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="ga-docs-") as tmp:
        if args.page:
            pages = args.page
        else:
            html = args.html or build_docs(Path(tmp))
            pages = pages_of(html)
        missing = [str(p) for p in pages if not p.is_file()]
        if missing:
            print(f"FAIL: no such page: {', '.join(missing)}")
            return 1
        problems = check(pages, *found)
    for problem in problems:
        print(problem)
    widths = " and ".join(f"{w} px" for w in WIDTHS.values())
    if problems:
        print(f"FAIL: {len(problems)} layout problem(s) in {len(pages)} pages.")
        return 1
    print(
        f"OK: {len(pages)} pages at {widths}: no code block overflows, every "
        "table shows all its columns, headings break between words."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
