"""``python -m build`` makes an sdist and a wheel that install and import.

``python -m build`` builds the sdist, then the wheel from the unpacked sdist,
so a file missing from the sdist breaks the wheel too. The wheel is installed
without dependencies into a fresh virtual environment that sees this
environment's packages through a ``.pth`` file (TensorFlow is not installed
again), and imported from a directory outside the checkout.
"""

from __future__ import annotations

import email.parser
import json
import os
import site
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import gradient_accumulator
from gradient_accumulator import _requirements
from tests import processes

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 300  # seconds per child process; subprocess.run kills it on expiry
SDIST_FILES = ("setup.cfg", "pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md")

# Run inside the fresh environment: where the package comes from and what it has.
PROBE = """
import importlib, json, pkgutil, sys
import gradient_accumulator as ga
from importlib.metadata import version
print(json.dumps({
    "file": ga.__file__,
    "version": ga.__version__,
    "metadata_version": version("gradient-accumulator"),
    "modules": sorted(m.name for m in pkgutil.iter_modules(ga.__path__)),
    "all_resolve": all(hasattr(ga, name) for name in ga.__all__),
}))
"""


def run(*args, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    result = processes.run(args, cwd=cwd, env=env, timeout=TIMEOUT)
    assert result.returncode == 0, (
        f"{args}: exit code {result.returncode}\n--- stdout ---\n"
        f"{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
    )
    return result


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "build", "--outdir", out, REPO, cwd=REPO)
    return out


PACKAGE = REPO / "gradient_accumulator"


def python_files(folder: Path) -> set[str]:
    """The ``.py`` files under ``folder``, subfolders' included (the tf-keras
    hosts' subpackage, tests/keras2), as paths relative to the checkout."""
    return {
        p.relative_to(REPO).as_posix()
        for p in folder.rglob("*.py")
        if "__pycache__" not in p.parts
    }


def package_modules() -> set[str]:
    """The package's top-level modules and subpackages, as pkgutil names them."""
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    return modules | {p.parent.name for p in PACKAGE.glob("*/__init__.py")}


def test_sdist_has_sources_tests_and_metadata(dist):
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    for name in SDIST_FILES:
        assert name in names, name
    for name in python_files(REPO / "tests") | python_files(PACKAGE):
        assert name in names, name
    assert "gradient_accumulator/py.typed" in names


def test_wheel_has_every_module_and_py_typed(dist):
    (wheel,) = dist.glob("*.whl")
    version = gradient_accumulator.__version__
    assert wheel.name.startswith(f"gradient_accumulator-{version}-"), wheel.name
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        entry_points = whl.read(
            f"gradient_accumulator-{version}.dist-info/entry_points.txt"
        ).decode()
    expected = python_files(PACKAGE) | {"gradient_accumulator/py.typed"}
    assert expected <= names, sorted(expected - names)
    assert not any(n.startswith(("tests/", "examples/", "docs/")) for n in names)
    assert "gradient-accumulator = gradient_accumulator.cli:main" in entry_points


def test_wheel_installs_and_imports_in_a_fresh_venv(dist, tmp_path):
    (wheel,) = dist.glob("*.whl")
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    # Dependencies (TensorFlow, Keras) come from this environment: its
    # site-packages go on the new venv's path as plain directories, so their
    # .pth files (among them an editable install of this checkout) are not run.
    own_site = run(
        python,
        "-c",
        "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        cwd=tmp_path,
    ).stdout.strip()
    parents = dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"]])
    Path(own_site, "_parent_env.pth").write_text("\n".join(parents) + "\n")

    # The wheel whatever the parent environment holds: pip sees its packages
    # through that path, and an install of this package there (of another
    # checkout, in a reused environment) would pass for the wheel's.
    run(
        sys.executable, "-m", "pip", "--python", python, "install", "--quiet",
        "--no-deps", "--no-index", "--ignore-installed", wheel, cwd=tmp_path,
    )  # fmt: skip

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(CUDA_VISIBLE_DEVICES="-1", TF_CPP_MIN_LOG_LEVEL="2")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    probe = json.loads(
        run(python, "-c", PROBE, cwd=outside, env=env).stdout.strip().splitlines()[-1]
    )
    package = Path(probe["file"]).parent
    assert package.is_relative_to(venv), probe["file"]  # not this checkout
    assert probe["version"] == gradient_accumulator.__version__
    assert probe["metadata_version"] == gradient_accumulator.__version__
    assert (package / "py.typed").is_file()
    assert set(probe["modules"]) == package_modules()
    assert probe["all_resolve"]

    script = venv / ("Scripts" if os.name == "nt" else "bin") / "gradient-accumulator"
    version = run(script, "--version", cwd=outside, env=env).stdout.strip()
    assert version == gradient_accumulator.__version__


def test_wheel_metadata_has_the_extras_and_no_tensorflow(dist):
    """The ``tf-keras`` extra pulls tf-keras in the defined range; outside the
    extras the wheel requires Keras and numpy only (no TensorFlow, no tf-keras)."""
    (wheel,) = dist.glob("*.whl")
    version = gradient_accumulator.__version__
    with zipfile.ZipFile(wheel) as whl:
        text = whl.read(f"gradient_accumulator-{version}.dist-info/METADATA")
    metadata = email.parser.Parser().parsestr(text.decode())
    extras = set(metadata.get_all("Provides-Extra"))
    assert {"tensorflow", "cpu", "and-cuda", "tf-keras"} <= extras, sorted(extras)
    reqs = [Requirement(line) for line in metadata.get_all("Requires-Dist")]
    assert {r.name for r in reqs if r.marker is None} == {"keras", "numpy"}
    (tf_keras,) = [r for r in reqs if r.name == "tf-keras"]
    assert tf_keras.specifier == SpecifierSet(_requirements.TF_KERAS_SPEC)
    assert tf_keras.marker is not None
    assert tf_keras.marker.evaluate({"extra": "tf-keras"})
    for other in extras - {"tf-keras"}:
        assert not tf_keras.marker.evaluate({"extra": other}), other


def test_wheel_metadata_tells_a_user_where_and_what(dist):
    """``pip show`` and PyPI's sidebar: a home page, an author, the project's
    links, a licence (an SPDX expression: setuptools deprecates licence
    classifiers) and a development status, and a Python classifier for
    every minor version from ``python_requires``' lower bound on."""
    (wheel,) = dist.glob("*.whl")
    version = gradient_accumulator.__version__
    with zipfile.ZipFile(wheel) as whl:
        text = whl.read(f"gradient_accumulator-{version}.dist-info/METADATA")
    metadata = email.parser.Parser().parsestr(text.decode())
    assert metadata.get("Home-page", "").startswith("https://"), metadata.items()
    assert metadata.get("Author"), metadata.items()
    links = dict(line.split(", ", 1) for line in metadata.get_all("Project-URL") or [])
    assert {"Source", "Documentation", "Changelog", "Issues"} <= set(links), links
    assert all(url.startswith("https://") for url in links.values()), links
    classifiers = set(metadata.get_all("Classifier"))
    licence = metadata.get("License-Expression") or metadata.get("License")
    assert licence == "MIT", metadata.items()
    assert any(c.startswith("Development Status :: ") for c in classifiers)
    low = SpecifierSet(metadata["Requires-Python"])
    pythons = {
        c.rsplit(" :: ", 1)[1]
        for c in classifiers
        if c.startswith("Programming Language :: Python :: 3.")
    }
    assert "{}.{}".format(*_requirements.PYTHON_MIN) in pythons, pythons
    assert all(low.contains(f"{p}.0") for p in pythons), (pythons, low)
    minors = sorted(int(p.split(".")[1]) for p in pythons)
    assert minors == list(range(minors[0], minors[-1] + 1)), minors
