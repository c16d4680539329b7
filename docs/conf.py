"""Sphinx configuration: MyST Markdown pages plus autodoc of the public API.

Build: ``python -m sphinx -W -b html docs docs/_build/html`` (tests/test_docs.py
runs exactly this, so a warning fails CI).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # document this checkout, installed or not

# autodoc imports the package, hence TensorFlow: keep it quiet and on the CPU.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from gradient_accumulator import __version__  # noqa: E402

project = "gradient-accumulator"
author = "gradient-accumulator contributors"
copyright = "gradient-accumulator contributors, MIT licence"
release = __version__
version = __version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]

napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_typehints = "description"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}

myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

html_theme = "alabaster"
html_static_path = ["_static"]
html_title = f"gradient-accumulator {release}"
