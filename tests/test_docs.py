"""The documentation builds without a single warning, and documents every
public name.

Runs the same command as a local docs build, ``python -m sphinx -W``, in a
child process (autodoc imports the package, hence TensorFlow).
"""

from __future__ import annotations

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
