"""The supported TensorFlow/Keras/tf-keras/Python range: one definition, enforced.

``gradient_accumulator/_requirements.py`` defines the ranges (``_backend``
re-exports them) and they are checked at import; ``setup.cfg`` must say the
same to pip, and ``.ci/run``'s lowest-pair step must install the lowest
claimed pair (``.ci/lowest-pair.txt``) and run the files listed in
``.ci/lowest-tests.txt`` on it; its tf-keras step must install tf-keras. These
tests fail when one of them drifts from the others. Legacy Keras 2
(``TF_USE_LEGACY_KERAS``) is told exactly as TensorFlow tells it.
"""

from __future__ import annotations

import ast
import configparser
import importlib.metadata
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import keras
import pytest
import tensorflow as tf
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import gradient_accumulator
from gradient_accumulator import _backend, _requirements
from gradient_accumulator._backend import check_legacy_versions, check_versions
from tests import processes

REPO = Path(__file__).resolve().parents[2]
CI = REPO / ".ci"


def dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def expected_spec(low: tuple[int, ...], below: tuple[int, ...] | None) -> SpecifierSet:
    spec = f">={dotted(low)}" + (f",<{dotted(below)}" if below else "")
    return SpecifierSet(spec)


TF_SPEC = expected_spec(_backend.TENSORFLOW_MIN, _backend.TENSORFLOW_BELOW)
KERAS_SPEC = expected_spec(_backend.KERAS_MIN, _backend.KERAS_BELOW)
TF_KERAS_SPEC = expected_spec(_backend.TF_KERAS_MIN, _backend.TF_KERAS_BELOW)


# ------------------------------------------------------------ check_versions
@pytest.mark.parametrize(
    ("tf_version", "keras_version"),
    [
        ("2.16.2", "3.15.0"),  # the lowest pair CI installs
        ("2.21.0", "3.15.1"),
        ("2.16.0rc0", "3.15.0"),  # pre-release of a supported minor version
        ("2.22.0-dev20260101", "3.16.0.dev2026010103"),  # nightlies
        ("2.30.0", "3.99.0"),
    ],
)
def test_supported_pairs_pass(tf_version, keras_version):
    assert check_versions(tf_version, keras_version) is None


@pytest.mark.parametrize(
    ("tf_version", "keras_version", "found"),
    [
        ("2.15.1", "3.15.1", "found tensorflow 2.15.1, keras 3.15.1"),
        ("2.16.2", "3.14.0", "found tensorflow 2.16.2, keras 3.14.0"),
        ("2.16.2", "3.5.0", "found tensorflow 2.16.2, keras 3.5.0"),
        ("2.16.2", "4.0.0", "found tensorflow 2.16.2, keras 4.0.0"),
        ("2.16.2", "2.15.0", "found tensorflow 2.16.2, keras 2.15.0"),
        ("1.15.5", "2.3.1", "found tensorflow 1.15.5, keras 2.3.1"),
        (None, "3.15.1", "found no tensorflow, keras 3.15.1"),
        ("2.18.1", None, "found tensorflow 2.18.1, no keras"),
        (None, None, "found no tensorflow, no keras"),
        ("unknown", "3.15.1", "found tensorflow unknown, keras 3.15.1"),
    ],
)
def test_unsupported_pairs_get_one_line_naming_found_and_required(
    tf_version, keras_version, found
):
    message = check_versions(tf_version, keras_version)
    assert message is not None
    assert "\n" not in message
    assert found in message
    required = f"needs tensorflow{_backend.TENSORFLOW_SPEC} (any distribution: "
    assert required + "tensorflow, tensorflow-cpu, ...) and keras" in message
    assert f"and keras{_backend.KERAS_SPEC};" in message
    assert "Install with: pip install 'gradient-accumulator[tensorflow]'" in message


# --------------------------------------------- legacy Keras 2 (tf-keras)
@pytest.mark.parametrize(
    ("tf_version", "tf_keras_version"),
    [
        ("2.16.2", "2.16.0"),  # the lowest pair tf-keras claims
        ("2.19.0", "2.19.0"),
        ("2.21.0", "2.21.0"),
        ("2.22.0-dev20260101", "2.22.0.dev2026010108"),  # nightlies
    ],
)
def test_supported_legacy_pairs_pass(tf_version, tf_keras_version):
    assert check_legacy_versions(tf_version, tf_keras_version) is None


@pytest.mark.parametrize(
    ("tf_version", "tf_keras_version", "found", "pin"),
    [
        ("2.15.1", "2.15.1", "found tensorflow 2.15.1, tf-keras 2.15.1.", None),
        ("2.19.0", None, "found tensorflow 2.19.0, no tf-keras.", "2.19"),
        ("2.21.0", "2.15.0", "found tensorflow 2.21.0, tf-keras 2.15.0.", "2.21"),
        (None, "2.21.0", "found no tensorflow, tf-keras 2.21.0.", None),
        (None, None, "found no tensorflow, no tf-keras.", None),
        ("unknown", "2.21.0", "found tensorflow unknown, tf-keras 2.21.0.", None),
    ],
)
def test_unsupported_legacy_pairs_get_one_line_naming_found_and_how_to_install(
    tf_version, tf_keras_version, found, pin
):
    message = check_legacy_versions(tf_version, tf_keras_version)
    assert message is not None
    assert "\n" not in message
    assert found in message
    assert "TF_USE_LEGACY_KERAS" in message
    assert f"tensorflow{_backend.TENSORFLOW_SPEC} and " in message
    assert f"tf-keras{_backend.TF_KERAS_SPEC} " in message
    assert f"keras{_backend.KERAS_SPEC}" not in message  # Keras 3 is not needed
    install = "Install with: pip install 'gradient-accumulator[tf-keras]'"
    assert install in message
    # Beside a TensorFlow in range, the tf-keras of that TensorFlow (pip would
    # otherwise pick the newest tf-keras and upgrade TensorFlow to match it).
    if pin is None:
        assert "'tf-keras==" not in message
    else:
        assert f"{install} 'tf-keras=={pin}.*'" in message


LEGACY_TRUE = ["true", "True", "1"]
LEGACY_FALSE = [None, "", "0", "false", "False", "TRUE", "yes", "on", " 1", "1 "]


@pytest.mark.parametrize("value", LEGACY_TRUE + LEGACY_FALSE)
def test_legacy_keras_requested_is_tensorflows_own_decision(value, monkeypatch):
    """TensorFlow's KerasLazyLoader (what ``tf.keras`` is) routes to tf-keras
    for exactly the values legacy_keras_requested accepts. tf-keras is made
    importable by a stand-in, so TensorFlow's only question is the variable."""
    from tensorflow.python.util.lazy_loader import KerasLazyLoader

    if value is None:
        monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    else:
        monkeypatch.setenv("TF_USE_LEGACY_KERAS", value)
    monkeypatch.setitem(sys.modules, "tf_keras", types.ModuleType("tf_keras"))
    loader = KerasLazyLoader({})
    loader._initialize()
    routes_to_tf_keras = loader._tfll_keras_version == "tf_keras"
    assert loader._tfll_keras_version in ("tf_keras", "keras_3")
    assert _requirements.legacy_keras_requested() is routes_to_tf_keras
    assert routes_to_tf_keras is (value in LEGACY_TRUE)


LEGACY_TEST = re.compile(
    r"""environ\.get\(\s*["']TF_USE_LEGACY_KERAS["']\s*(?:,\s*None\s*)?\)"""
    r"""\s*in\s*(\([^)]*\))"""
)


@pytest.mark.parametrize("module", ["__init__.py", "python/util/lazy_loader.py"])
def test_tensorflow_source_tests_the_same_values(module):
    """TensorFlow's own test of the variable, where it picks the Keras it
    imports (``__init__``) and the one ``tf.keras`` is (``lazy_loader``)."""
    source = (Path(tf.__file__).parent / module).read_text()
    reads = len(re.findall(r"""["']TF_USE_LEGACY_KERAS["']""", source))
    tests = LEGACY_TEST.findall(source)
    assert tests, module
    assert {ast.literal_eval(t) for t in tests} == {_requirements.LEGACY_KERAS_VALUES}
    assert len(tests) == reads, module  # no other reading of the variable


def fake_module(version: str | None) -> types.SimpleNamespace | None:
    return None if version is None else types.SimpleNamespace(__version__=version)


@pytest.mark.parametrize(
    ("legacy", "tf_keras", "keras_version", "error"),
    [
        # TFX-like: TensorFlow pulled an old Keras 3 that tf-keras users never use.
        ("1", "2.21.0", "3.8.0", None),
        ("1", None, keras.__version__, "no tf-keras."),
        ("1", "2.15.1", keras.__version__, "tf-keras 2.15.1."),
        (None, "2.21.0", "3.8.0", "keras 3.8.0."),  # Keras 3 mode: as before
        (None, None, keras.__version__, None),
    ],
)
def test_check_installed_requires_tf_keras_not_keras3_in_legacy_mode(
    legacy, tf_keras, keras_version, error, monkeypatch
):
    if legacy is None:
        monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    else:
        monkeypatch.setenv("TF_USE_LEGACY_KERAS", legacy)
    monkeypatch.setitem(sys.modules, "tf_keras", fake_module(tf_keras))
    monkeypatch.setitem(sys.modules, "keras", fake_module(keras_version))
    if error is None:
        _requirements.check_installed()
    else:
        with pytest.raises(ImportError, match=re.escape(error)) as raised:
            _requirements.check_installed()
        assert f"found tensorflow {tf.__version__}, " in str(raised.value)


@pytest.mark.parametrize(
    ("tf_version", "tf_keras", "error"),
    [
        (None, "2.21.0", None),
        (None, None, "no tf-keras."),
        (None, "2.15.1", "tf-keras 2.15.1."),
        ("2.15.1", "2.21.0", "found tensorflow 2.15.1, "),
    ],
)
def test_backend_check_requires_tf_keras_not_keras3_in_legacy_mode(
    tf_version, tf_keras, error, monkeypatch
):
    """``_backend`` checks the imported modules; in legacy mode Keras 3 (here
    an out-of-range one) and KERAS_BACKEND do not matter."""
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
    monkeypatch.setenv("KERAS_BACKEND", "jax")
    monkeypatch.setitem(sys.modules, "tf_keras", fake_module(tf_keras))
    monkeypatch.setitem(sys.modules, "keras", fake_module("3.8.0"))
    if tf_version is not None:
        monkeypatch.setitem(sys.modules, "tensorflow", fake_module(tf_version))
    if error is None:
        _backend._check()
    else:
        with pytest.raises(ImportError, match=re.escape(error)) as raised:
            _backend._check()
        assert "\n" not in str(raised.value)
        assert "gradient-accumulator[tf-keras]" in str(raised.value)


BACKEND_ALONE = f"""
import importlib.util, os, sys, types
if os.environ.get("TF_USE_LEGACY_KERAS") and not importlib.util.find_spec("tf_keras"):
    sys.modules["tf_keras"] = types.SimpleNamespace(__version__="2.21.0")
# _backend without the package's __init__ (which imports the hosts).
package = types.ModuleType("gradient_accumulator")
package.__path__ = [{str(REPO / "gradient_accumulator")!r}]
sys.modules["gradient_accumulator"] = package
import gradient_accumulator._backend
print("KERAS_IMPORTED:", "keras" in sys.modules)
"""


@pytest.mark.parametrize(("legacy", "keras_imported"), [("1", False), ("", True)])
def test_backend_imports_no_keras3_in_legacy_mode(legacy, keras_imported):
    """``import tensorflow`` itself imports Keras 3 (``keras.src.optimizers``)
    unless TF_USE_LEGACY_KERAS is set; then neither it nor ``_backend`` does."""
    result = run_python(BACKEND_ALONE, TF_USE_LEGACY_KERAS=legacy)
    assert f"KERAS_IMPORTED: {keras_imported}" in result.stdout.splitlines(), (
        result.stdout + result.stderr[-3000:]
    )


def test_tf_keras_range_follows_tensorflows():
    """tf-keras 2.X requires tensorflow 2.X: one lower bound for both."""
    assert _backend.TF_KERAS_MIN == _backend.TENSORFLOW_MIN
    assert _backend.TF_KERAS_BELOW == _backend.TENSORFLOW_BELOW
    assert SpecifierSet(_requirements.TF_KERAS_SPEC) == TF_KERAS_SPEC


def test_the_running_pair_is_in_range():
    """This environment imported the package, so its pair must be supported."""
    assert check_versions(tf.__version__, keras.__version__) is None


def test_exactly_one_tensorflow_distribution_is_installed():
    """Two distributions (tensorflow and tensorflow-cpu, say) would write
    over each other's files in one ``tensorflow`` package: installing this
    package must never add a second one."""
    providers = importlib.metadata.packages_distributions().get("tensorflow", [])
    assert len(set(providers)) == 1, providers


# ------------------------------------------------------- setup.cfg agrees
def setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    return config


def requirements(text: str) -> dict[str, Requirement]:
    reqs = [Requirement(line) for line in text.strip().splitlines() if line.strip()]
    return {r.name: r for r in reqs}


def test_setup_cfg_python_bound_is_the_defined_one():
    assert setup_cfg()["options"]["python_requires"].strip() == (
        f">={dotted(_backend.PYTHON_MIN)}"
    )
    assert sys.version_info[:2] >= _backend.PYTHON_MIN


def test_setup_cfg_requires_keras_but_no_tensorflow_distribution():
    """pip may not pull a second TensorFlow beside tensorflow-cpu (or any
    other distribution): TensorFlow comes from an extra or from the user,
    and the import-time check enforces its range."""
    reqs = requirements(setup_cfg()["options"]["install_requires"])
    assert set(reqs) == {"keras", "numpy"}, sorted(reqs)
    assert reqs["keras"].specifier == KERAS_SPEC


@pytest.mark.parametrize(
    ("extra", "distribution", "markers"),
    [
        ("tensorflow", "tensorflow", set()),
        ("cpu", "tensorflow-cpu", set()),
        ("and-cuda", "tensorflow", {"and-cuda"}),
    ],
)
def test_setup_cfg_tensorflow_extras_have_the_defined_range(
    extra, distribution, markers
):
    reqs = requirements(setup_cfg()["options.extras_require"][extra])
    assert set(reqs) == {distribution}, sorted(reqs)
    assert reqs[distribution].specifier == TF_SPEC
    assert reqs[distribution].extras == markers


def test_readme_installs_use_declared_extras_and_the_demo_gets_a_tensorflow():
    """The README's install lines name extras setup.cfg declares, and its
    fresh-machine demo command pulls a TensorFlow through one (the package
    itself depends on none)."""
    readme = (REPO / "README.md").read_text()
    declared = set(setup_cfg()["options.extras_require"])
    used = re.findall(r"gradient-accumulator\[([a-z,-]+)\]", readme)
    used += re.findall(r'pip install -e "\.\[([a-z,-]+)\]"', readme)
    assert used
    for extras in used:
        assert set(extras.split(",")) <= declared, extras
    (demo,) = [line for line in readme.splitlines() if "digits_demo.py" in line]
    (extras,) = re.findall(r'pip install -e "\.\[([a-z,-]+)\]"', demo)
    assert {"tensorflow", "cpu", "and-cuda"} & set(extras.split(",")), demo
    for needed in ("tensorflow", "cpu", "and-cuda", "tf-keras"):
        assert f'"gradient-accumulator[{needed}]"' in readme
    assert f"tf-keras >= {dotted(_backend.TF_KERAS_MIN)}" in readme


def test_setup_cfg_tf_keras_extra_has_the_defined_range():
    reqs = requirements(setup_cfg()["options.extras_require"]["tf-keras"])
    assert set(reqs) == {"tf-keras"}, sorted(reqs)
    assert reqs["tf-keras"].specifier == TF_KERAS_SPEC
    assert not reqs["tf-keras"].extras and reqs["tf-keras"].marker is None


# ------------------------------------------- CI tests the lowest claimed pair
def lowest_pair() -> dict[str, str]:
    pins = {}
    for line in (CI / "lowest-pair.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.strip()] = version.strip()
    return pins


def test_ci_lowest_pair_is_the_claimed_lower_bound():
    pins = lowest_pair()
    # The full tensorflow distribution: tf-keras requires it by name.
    assert set(pins) == {"tensorflow", "keras", "tf-keras"}, pins
    release = {name: tuple(int(p) for p in v.split(".")) for name, v in pins.items()}
    assert release["tensorflow"][:2] == _backend.TENSORFLOW_MIN
    assert release["keras"][:2] == _backend.KERAS_MIN
    assert release["tf-keras"][:2] == _backend.TF_KERAS_MIN
    assert check_versions(pins["tensorflow"], pins["keras"]) is None


def test_ci_runs_the_tf_keras_tests_at_the_lowest_pair_too():
    assert ci_installs()["low"] == {
        "tensorflow",
        "tf-keras",
        "test",
        "recipes-tf-keras",
    }
    script = (CI / "run").read_text()
    assert "listed .ci/lowest-tests-tf-keras.txt" in script
    low_tfk = r'"\$\{low_tfk_tests\[@\]\}"'
    assert re.search(
        r'TF_USE_LEGACY_KERAS=1 run_pytest "\$low/bin/python" ' + low_tfk, script
    )
    # The newest tf-keras runs the whole suite (the 0.5.x port with it).
    assert re.search(
        r'TF_USE_LEGACY_KERAS=1 run_pytest "\$tfk/bin/python" tests\b', script
    )


def lowest_tf_keras_files() -> list[Path]:
    lines = (CI / "lowest-tests-tf-keras.txt").read_text().splitlines()
    return [REPO / s for line in lines if (s := line.split("#", 1)[0].strip())]


def test_ci_lowest_tf_keras_list_holds_the_version_sensitive_tests():
    """The lowest tf-keras runs what can depend on the version: every test
    of both Kerases, the private names the package uses, saving and
    loading, distributed and mixed precision, and a file naming each public
    class; the verbatim 0.5.x port runs once, with the newest tf-keras."""
    entries = lowest_tf_keras_files()
    assert REPO / "tests" / "both" in entries, entries
    files = []
    for path in entries:
        assert path.exists(), path
        assert path == REPO / "tests" / "both" or (
            path.parent == REPO / "tests" / "keras2" and path.name.startswith("test_")
        ), path
        files += sorted(path.glob("test_*.py")) if path.is_dir() else [path]
    names = {path.name for path in files}
    private_names = "test_compat.py"  # tests every name of keras2/_compat.py
    assert {private_names, "test_saving.py", "test_distributed.py"} <= names, names
    assert {"test_multi_worker.py", "test_mixed_precision.py"} <= names, names
    assert "test_05_suite.py" not in names  # once, in the newest tf-keras
    sources = "\n".join(path.read_text() for path in files)
    assert "load_model(" in sources
    for name in (
        "GradientAccumulateModel",
        "GradientAccumulateOptimizer",
        "AccumBatchNormalization",
        "AccumulationScheduler",
        "FlushPartialCycle",
        "PruningStepPerUpdate",
        "accumulate",
        "verify",
    ):
        assert re.search(rf"\b{name}\b", sources), name


def lowest_test_files() -> list[Path]:
    lines = (CI / "lowest-tests.txt").read_text().splitlines()
    return [REPO / s for line in lines if (s := line.split("#", 1)[0].strip())]


def test_ci_lowest_test_list_names_existing_test_files():
    files = lowest_test_files()
    assert files
    for path in files:
        assert path.is_file(), path
        # Keras 3 tests, Keras-neutral ones (tests/core), or the shared ones
        # (tests/both) in their Keras 3 run.
        folders = ("keras3", "core", "both")
        assert path.parent in [REPO / "tests" / f for f in folders], path
        assert path.name.startswith("test_"), path


def test_ci_lowest_tests_cover_every_public_keras_class_and_saving():
    """Each public layer, model, optimizer and callback is named by a test file
    the lowest pair runs; those files save and load models, and include the
    distributed and mixed-precision equivalence tests."""
    files = lowest_test_files()
    sources = "\n".join(path.read_text() for path in files)
    keras_bases = (
        keras.layers.Layer,
        keras.optimizers.Optimizer,
        keras.callbacks.Callback,
    )
    public = [
        name
        for name in gradient_accumulator.__all__
        if inspect.isclass(obj := getattr(gradient_accumulator, name))
        and issubclass(obj, keras_bases)
    ]
    assert "GradientAccumulateModel" in public  # a Model is a Layer
    missing = [name for name in public if not re.search(rf"\b{name}\b", sources)]
    assert not missing, missing
    assert "load_model(" in sources
    names = {path.name for path in files}
    assert {"test_distributed.py", "test_mixed_precision.py"} <= names


def test_ci_lowest_pair_leaves_out_script_runs_only():
    """On the lowest pair .ci/run deselects the tests marked ``script``; each
    of those in its files runs a script of examples/ or benchmarks/ (the
    package's own behaviour is tested by the rest, which runs there)."""
    script = (CI / "run").read_text()
    assert re.search(r'run_pytest "\$low/bin/python" -m "not script" ', script)
    marked = []
    for path in lowest_test_files():
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and any(
                ast.unparse(d) == "pytest.mark.script" for d in node.decorator_list
            ):
                marked.append(node.name)
                source = ast.get_source_segment(path.read_text(), node)
                assert re.search(r"[\"'](examples|benchmarks)/", source), node.name
    assert len(marked) >= 4, marked  # the examples of distribution, BN, float16


def test_ci_run_installs_the_lowest_pair_and_runs_the_list():
    script = (CI / "run").read_text()
    assert ".ci/lowest-pair.txt" in script
    assert ".ci/lowest-tests.txt" in script
    assert "pip check" in script


def ci_installs() -> dict[str, set[str]]:
    """``.ci/run``'s ``install VENV EXTRAS`` lines: venv variable -> extras."""
    script = (CI / "run").read_text()
    found = re.findall(r'^\s*install "\$(\w+)" ([a-z,-]+)', script, re.MULTILINE)
    installs: dict[str, set[str]] = {}
    for venv, extras in found:
        installs.setdefault(venv, set()).update(extras.split(","))
    return installs


def test_ci_run_installs_declared_extras():
    declared = set(setup_cfg()["options.extras_require"])
    installs = ci_installs()
    assert {"venv", "low", "tfk"} <= set(installs), installs
    for venv, extras in installs.items():
        assert extras <= declared, (venv, extras)


def test_ci_puts_each_recipe_library_beside_its_keras():
    """The recipes' pages run against the real libraries: keras-rs with
    Keras 3, TF-MOT and TFRS with tf-keras only (TF-MOT sets
    TF_USE_LEGACY_KERAS=1 when imported, which would turn a Keras 3 run)."""
    extras = setup_cfg()["options.extras_require"]
    assert "keras-rs" in extras["recipes"]
    assert "tensorflow-model-optimization" in extras["recipes-tf-keras"]
    assert "tensorflow-recommenders" in extras["recipes-tf-keras"]
    installs = ci_installs()
    assert "recipes" in installs["venv"]
    assert "recipes-tf-keras" not in installs["venv"]
    assert all("recipes-tf-keras" in installs[v] for v in ("low", "tfk"))


def test_ci_run_tests_tf_keras_with_the_tensorflow_distribution():
    """tf-keras requires the ``tensorflow`` distribution by name: beside
    tensorflow-cpu ([cpu]) pip would install a second TensorFlow."""
    assert ci_installs()["tfk"] == {
        "tensorflow",
        "tf-keras",
        "test",
        "recipes-tf-keras",
    }
    script = (CI / "run").read_text()
    assert "${GA_TFK_VENV:-.venv-ci-tfk}" in script
    assert '"${GA_TFK:-1}" != 0' in script
    assert re.search(
        r'TF_USE_LEGACY_KERAS=1 run_pytest "\$tfk/bin/python" tests\b', script
    )


# ------------------------------------------------------------ at import time
def run_python(code: str, **environ: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    env.pop("TF_USE_LEGACY_KERAS", None)
    env.update(environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    return processes.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, timeout=180
    )


IMPORT_AND_REPORT = """
import json
try:
    import gradient_accumulator
except ImportError as error:
    print("IMPORT_ERROR:", json.dumps(str(error)))
else:
    print("IMPORTED")
print("KERAS_IMPORTED:", "keras" in sys.modules)
"""


def import_error(code: str) -> tuple[str, bool]:
    """The ImportError message of ``import gradient_accumulator`` after
    ``code`` in a fresh interpreter, and whether Keras was imported."""
    result = run_python("import sys\n" + textwrap.dedent(code) + IMPORT_AND_REPORT)
    report = dict(
        line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line
    )
    assert "IMPORT_ERROR" in report, result.stdout + result.stderr[-3000:]
    message = json.loads(report["IMPORT_ERROR"])
    assert "\n" not in message  # one line
    return message, report["KERAS_IMPORTED"] == "True"


def test_import_without_tensorflow_fails_in_one_line():
    message, _ = import_error("sys.modules['tensorflow'] = None  # not installed")
    assert f"found no tensorflow, keras {keras.__version__}." in message
    assert f"needs tensorflow{_backend.TENSORFLOW_SPEC} " in message
    assert "gradient-accumulator[tensorflow]" in message


def test_import_with_old_tensorflow_fails_in_one_line_before_keras():
    """An old TensorFlow is reported before Keras is imported (Keras' own
    import would fail inside keras.src, or misbehave, on it)."""
    message, keras_imported = import_error(
        """
        import types
        sys.modules['tensorflow'] = types.SimpleNamespace(__version__='2.15.1')
        """
    )
    assert f"found tensorflow 2.15.1, keras {keras.__version__}." in message
    assert not keras_imported


def test_import_with_keras_outside_the_range_fails_in_one_line():
    message, _ = import_error(
        """
        import keras
        keras.__version__ = '3.14.0'  # what an older Keras reports
        """
    )
    assert f"found tensorflow {tf.__version__}, keras 3.14.0." in message
    assert f"keras{_backend.KERAS_SPEC}" in message


def test_import_in_range_succeeds():
    result = run_python("import sys\n" + IMPORT_AND_REPORT)
    assert "IMPORTED" in result.stdout.splitlines(), result.stdout + result.stderr


# ------------------------------------------------------ private Keras names
def test_a_moved_private_keras_name_fails_in_one_line_naming_the_range():
    """A Keras release without one of the private names ``keras3/_compat.py``
    imports (here: ``apply_mask`` removed) stops the import with one line
    naming the Keras version and the supported range."""
    result = run_python(
        """
        import keras.src.losses.loss as loss
        del loss.apply_mask
        try:
            import gradient_accumulator
        except ImportError as error:
            print("MESSAGE", str(error))
        """
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("MESSAGE")]
    assert len(lines) == 1, result.stdout + result.stderr
    assert "apply_mask" in lines[0]
    assert f"keras {keras.__version__} does not have" in lines[0]
    assert f"keras{_backend.KERAS_SPEC}" in lines[0]


def test_tests_sharing_a_module_fixture_run_on_one_worker(tmp_path):
    """The test extra's pytest and pytest-xdist keep ``tests/xdist_groups.py``'s
    groups together under ``--dist loadgroup`` (pytest 9.2 dropped them
    silently, pytest-xdist#1386): a module fixture is built once, not once
    per worker (the distributed fixtures cost a minute each)."""
    (tmp_path / "conftest.py").write_text(
        "from tests.xdist_groups import pytest_collection_modifyitems  # noqa\n"
    )
    (tmp_path / "test_probe.py").write_text(
        textwrap.dedent(
            """
            import os
            import pytest

            @pytest.fixture(scope="module")
            def shared():
                return os.getpid()

            @pytest.mark.parametrize("i", range(6))
            def test_shared(shared, i):
                assert shared == os.getpid()
                print("WORKER", os.getpid())

            @pytest.mark.parametrize("i", range(6))
            def test_alone(i):
                print("ALONE", os.getpid())
            """
        )
    )
    args = ("-m", "pytest", "-n", "2", "--dist", "loadgroup", "-rA")
    result = processes.run_script(
        *args, "-p", "no:cacheprovider", cwd=tmp_path, timeout=120
    )
    assert result.returncode == 0, processes.describe(result)
    shared = set(re.findall(r"^WORKER (\d+)$", result.stdout, re.M))
    alone = set(re.findall(r"^ALONE (\d+)$", result.stdout, re.M))
    assert len(shared) == 1, processes.describe(result)
    # Not vacuous: the run had two workers (xdist may give all the single
    # tests to the worker the group did not take).
    assert len(shared | alone) == 2, processes.describe(result)
