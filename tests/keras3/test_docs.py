"""The documentation builds without a single warning, and documents every
public name.

Runs the same command as a local docs build, ``python -m sphinx -W``, in a
child process (autodoc imports the package, hence TensorFlow).
"""

from __future__ import annotations

import configparser
import html as html_text
import re
from pathlib import Path

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

    check_api_pages(html)
    # __version__ shows the version, not the docstring of Python's str.
    api = _text(html / "api.html")
    version = gradient_accumulator.__version__
    assert f"in this build of the documentation: {version}" in api
    assert "Create a new string object" not in api
    # Pages that include files from outside docs/ show their content.
    benchmarks = (html / "benchmarks.html").read_text(encoding="utf-8")
    assert "Overhead per micro-step" in benchmarks
    changelog = (html / "changelog.html").read_text(encoding="utf-8")
    assert gradient_accumulator.__version__.split(".dev")[0] in changelog
    # Every figure a page shows was copied into the site.
    for image in (REPO / "docs" / "_static").glob("*.png"):
        assert (html / "_static" / image.name).is_file(), image.name


# Internal hooks and Keras overrides that must not pad the API pages.
NOT_API = ("follow_model", "end_micro_step", "train_step", "load_own_variables")
KERAS_TEXT = ("You can override this method", "Subclasses should override")
PAGES = {
    "GradientAccumulateModel": "GradientAccumulateModel",
    "GradientAccumulateOptimizer": "GradientAccumulateOptimizer",
    "accumulate": "accumulate",
    "stop_accumulating": "accumulate",
    "AccumBatchNormalization": "AccumBatchNormalization",
    "replace_batchnorm_layers": "AccumBatchNormalization",
    "AccumulationScheduler": "AccumulationScheduler",
    "FlushPartialCycle": "FlushPartialCycle",
    "Accumulator": "Accumulator",
    "verify": "verify",
    "VerifyReport": "verify",
    "LayerCheck": "verify",
    "VariableCheck": "verify",
    "adaptive_clip_grad": "agc",
    "unitwise_norm": "agc",
    "compute_norm": "agc",
    "__version__": "../api",
}


def _text(page: Path) -> str:
    """A page's visible text, tags dropped and whitespace collapsed."""
    body = re.sub(r"<[^>]+>", " ", page.read_text(encoding="utf-8"))
    return re.sub(r"\s+", " ", html_text.unescape(body))


def check_api_pages(html: Path) -> None:
    assert set(PAGES) == set(gradient_accumulator.__all__), "update PAGES"
    for name, page in PAGES.items():
        source = (html / "api" / f"{page}.html").read_text(encoding="utf-8")
        # autodoc skips public names without a docstring.
        assert f'id="gradient_accumulator.{name}"' in source, (
            f"{name} is exported but not on api/{page}.html"
        )
    for page in (html / "api").glob("*.html"):
        source = page.read_text(encoding="utf-8")
        text = _text(page)
        for internal in NOT_API:
            assert f'.{internal}"' not in source, f"{page.name} documents {internal}"
        for keras_text in KERAS_TEXT:
            assert keras_text not in text, f"{page.name}: Keras' docstring text"
        # Real constructor signatures, never Keras' __new__(*args, **kwargs).
        assert "( * args , ** kwargs )" not in text, page.name
        # A property's docstring is prose, not "type: description".
        assert "Type: Micro-batches" not in text, page.name
    model = _text(html / "api" / "GradientAccumulateModel.html")
    signature = "GradientAccumulateModel ( accum_steps = 1 ,"
    assert signature in model, "the constructor's signature"
    fit = model[model.index(" fit ( ") :]
    assert "batch_size is the micro-batch" in fit, "fit says what batch_size is"
    assert "batch_size * accum_steps" in fit
    norm = _text(html / "api" / "AccumBatchNormalization.html")
    assert "AccumBatchNormalization ( accum_steps = None , axis = -1" in norm
    assert "Micro-batches per cycle as given ( None : the model" in norm


# ------------------------------------------------------------- install lines
# This version is not on PyPI: there `gradient-accumulator` is 0.5.2 (numpy
# <= 1.23.2, no extras), so an install line naming the distribution installs
# the predecessor. Until the release, every install line installs a checkout
# (`.`, `.[extras]`) or a wheel built from one.
FENCE = re.compile(r"^```+\s*(\w*)")
PIP_INSTALL = re.compile(r"\bpip install\s+(.*?)\s*(?:&&|#|$)")
WHEEL = re.compile(r"dist/gradient_accumulator-([^-]+)-py3-none-any\.whl\[([a-z,-]+)\]")


def shell_lines(page: Path) -> list[str]:
    """The lines of a page's ``bash`` code blocks, in order."""
    lines, language = [], None
    for line in page.read_text(encoding="utf-8").splitlines():
        fence = FENCE.match(line.strip())
        if fence:
            language = None if language is not None else fence.group(1)
        elif language == "bash":
            lines.append(line)
    return lines


def install_targets(lines: list[str]) -> list[str]:
    """What each ``pip install`` of ``lines`` installs (options left out)."""
    targets = []
    for line in lines:
        for args in PIP_INSTALL.findall(line):
            targets += [a.strip("\"'") for a in args.split() if not a.startswith("-")]
    return targets


def declared_extras() -> set[str]:
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    return set(config["options.extras_require"])


def test_install_lines_install_this_version_not_the_predecessor():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    version = gradient_accumulator.__version__
    assert ".dev" in version, "released: the install lines may name PyPI again"
    extras = declared_extras()
    for page in pages:
        for target in install_targets(shell_lines(page)):
            name = re.split(r"[\[=<>~ ]", target)[0]
            assert name != "gradient-accumulator", f"{page.name}: {target} is 0.5.2"
            for wheel_version, wheel_extras in WHEEL.findall(target):
                assert wheel_version == version, f"{page.name}: {target}"
                assert set(wheel_extras.split(",")) <= extras, target
            for local in re.findall(r"^\.\[([a-z,-]+)\]$", target):
                assert set(local.split(",")) <= extras, f"{page.name}: {target}"
        text = page.read_text(encoding="utf-8")
        for stated in re.findall(r"This version \(([^)]+)\) is not on PyPI", text):
            assert stated == version, page.name
    # The README's first install command installs the checkout with a
    # TensorFlow extra, and the page says why.
    readme = REPO / "README.md"
    first = install_targets(shell_lines(readme))[0]
    assert first == ".[tensorflow]", first
    assert "is not on PyPI yet" in readme.read_text(encoding="utf-8")
    # Each page that shows how to install shows the checkout and its extras.
    for name in ("index.md", "getting-started.md"):
        targets = install_targets(shell_lines(REPO / "docs" / name))
        assert {".[tensorflow]", ".[cpu]", ".[and-cuda]", "."} <= set(targets), name


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_benchmarks_page_shows_the_epoch_benchmarks_figure():
    """The benchmarks page's figure is the one ``benchmarks/epoch.py --plot``
    writes (tests/keras3/test_examples.py's run of it draws one too)."""
    name = "epoch-time-ratios.png"
    readme = (REPO / "benchmarks" / "README.md").read_text(encoding="utf-8")
    assert f"](../docs/_static/{name})" in readme
    assert "--plot docs/_static" in readme
    assert (REPO / "docs" / "_static" / name).read_bytes()[:8] == PNG_SIGNATURE
