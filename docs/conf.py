"""Sphinx configuration: MyST Markdown pages plus autodoc of the public API.

Build: ``python -m sphinx -W -b html docs docs/_build/html`` (tests/keras3/test_docs.py
runs exactly this, so a warning fails CI).
"""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

from sphinx.ext.napoleon import _process_docstring as napoleon_process_docstring

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
    "sphinx_copybutton",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]

napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_typehints = "description"
autodoc_member_order = "bysource"
# Each API page lists the members it documents (the package's own public API,
# not Keras' inherited methods nor internal hooks such as follow_model).
autodoc_default_options = {"show-inheritance": True}
autodoc_inherit_docstrings = False  # never show Keras' text as ours

myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# Furo: a maintained theme made for library documentation. Its content column
# is wide enough for 88-character code lines, the sidebar wraps long class
# names instead of cutting them, it is responsive down to phone widths (the
# navigation folds away) and it has light and dark modes. Checked in a real
# browser by docs/check_layout.py.
html_theme = "furo"
html_static_path = ["_static"]
html_css_files = ["layout.css"]  # tables and headings on phones
html_title = f"gradient-accumulator {release}"
# sphinx-copybutton: leave out prompts and output when copying shell lines.
copybutton_prompt_text = r"\$ |>>> |\.\.\. "
copybutton_prompt_is_regexp = True


def _init_signature(app, what, name, obj, options, signature, return_annotation):
    """Keras layers and models define ``__new__(cls, *args, **kwargs)``, which
    autodoc shows as the class signature: show ``__init__``'s instead."""
    if what != "class" or signature not in (None, "(*args, **kwargs)"):
        return None
    parameters = list(inspect.signature(obj.__init__).parameters.values())[1:]
    plain = [p.replace(annotation=inspect.Parameter.empty) for p in parameters]
    return str(inspect.Signature(plain)), return_annotation


def _napoleon_except_properties(app, what, name, obj, options, lines):
    """Napoleon reads a property's first line ``text (``None``: other)`` as
    ``type: description`` and renders "Type: text (None"; a property's
    docstring here is plain prose, so napoleon leaves it alone."""
    if what != "property":
        napoleon_process_docstring(app, what, name, obj, options, lines)


def setup(app):
    app.connect("autodoc-process-signature", _init_signature)
    for listener in list(app.events.listeners["autodoc-process-docstring"]):
        if listener.handler is napoleon_process_docstring:
            app.disconnect(listener.id)
    app.connect("autodoc-process-docstring", _napoleon_except_properties)
