"""What ``import gradient_accumulator`` offers a user, in each Keras: the
public names of that Keras and nothing else in ``dir()`` and tab completion,
each one importable and on an API page."""

from __future__ import annotations

import re
from pathlib import Path

import gradient_accumulator
from tests.flavour import LEGACY_KERAS

API = Path(__file__).resolve().parents[2] / "docs" / "api"


def test_dir_lists_the_public_names_only():
    names = dir(gradient_accumulator)
    assert names == sorted(gradient_accumulator.__all__), names
    leaked = {"os", "sys", "importlib", "itertools", "types", "annotations"}
    assert not leaked & set(names), leaked & set(names)
    assert all(not n.startswith("_") or n == "__version__" for n in names), names


def test_every_public_name_resolves_and_has_an_api_page():
    pages = "\n".join(p.read_text() for p in API.glob("*.md"))
    documented = set(re.findall(r"\.\. (?:auto|py:)\w+:: (\w+)", pages))
    for name in gradient_accumulator.__all__:
        assert getattr(gradient_accumulator, name) is not None, name
        if name != "__version__":  # on docs/api.md itself
            assert name in documented, f"{name} has no page under docs/api"


def test_the_public_names_are_this_keras_ones():
    """tf-keras has TF-MOT's pruning callback and not Keras 3's engine
    class; a star import takes every name of ``__all__``."""
    public = set(gradient_accumulator.__all__)
    assert ("PruningStepPerUpdate" in public) == LEGACY_KERAS, sorted(public)
    assert ("Accumulator" in public) == (not LEGACY_KERAS), sorted(public)
    assert "Accumulating" not in public  # the loader saved files name
    namespace: dict = {}
    exec("from gradient_accumulator import *", namespace)
    assert public <= set(namespace), public - set(namespace)


def test_the_root_names_are_the_package_names_of_this_keras():
    """The root's written-out name list (kept by hand so the project's
    programs list the names without loading Keras) is exactly this Keras'
    package's ``__all__``, plus the 0.5.x clipping functions."""
    if LEGACY_KERAS:
        from gradient_accumulator import keras2 as package
    else:
        from gradient_accumulator import keras3 as package
    clipping = {"adaptive_clip_grad", "compute_norm", "unitwise_norm"}
    root = set(gradient_accumulator._exports())
    assert root == set(package.__all__) | clipping, root ^ (
        set(package.__all__) | clipping
    )
