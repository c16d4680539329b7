"""``python -m build`` makes an sdist and a wheel that install and import.

``python -m build`` builds the sdist, then the wheel from the unpacked sdist,
so a file missing from the sdist breaks the wheel too. The wheel is installed
without dependencies into a fresh virtual environment that sees this
environment's packages through a ``.pth`` file (TensorFlow is not installed
again), and imported from a directory outside the checkout.
"""

from __future__ import annotations

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

import gradient_accumulator

REPO = Path(__file__).resolve().parents[1]
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
    result = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
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


def package_modules() -> set[str]:
    return {p.name for p in (REPO / "gradient_accumulator").glob("*.py")}


def test_sdist_has_sources_tests_and_metadata(dist):
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    for name in SDIST_FILES:
        assert name in names, name
    for test in (REPO / "tests").glob("*.py"):
        assert f"tests/{test.name}" in names, test.name
    for module in package_modules() | {"py.typed"}:
        assert f"gradient_accumulator/{module}" in names, module


def test_wheel_has_every_module_and_py_typed(dist):
    (wheel,) = dist.glob("*.whl")
    version = gradient_accumulator.__version__
    assert wheel.name.startswith(f"gradient_accumulator-{version}-"), wheel.name
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        entry_points = whl.read(
            f"gradient_accumulator-{version}.dist-info/entry_points.txt"
        ).decode()
    expected = {f"gradient_accumulator/{m}" for m in package_modules()}
    expected.add("gradient_accumulator/py.typed")
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

    run(
        sys.executable, "-m", "pip", "--python", python, "install", "--quiet",
        "--no-deps", "--no-index", wheel, cwd=tmp_path,
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
    modules = {m.removesuffix(".py") for m in package_modules()} - {"__init__"}
    assert set(probe["modules"]) == modules
    assert probe["all_resolve"]

    script = venv / ("Scripts" if os.name == "nt" else "bin") / "gradient-accumulator"
    version = run(script, "--version", cwd=outside, env=env).stdout.strip()
    assert version == gradient_accumulator.__version__
