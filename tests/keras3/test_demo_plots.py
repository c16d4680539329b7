"""The demo's ``--plot``: two PNGs with matplotlib, a clear error without it,
and no need for matplotlib when ``--plot`` is not given."""

from __future__ import annotations

import pytest

from tests.processes import describe, run_script

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# Runs the demo as __main__ with matplotlib made unimportable (a None entry
# in sys.modules makes `import matplotlib` raise ImportError).
WITHOUT_MATPLOTLIB = (
    "import runpy, sys; sys.modules['matplotlib'] = None; "
    "sys.argv = ['examples/digits_demo.py', *sys.argv[1:]]; "
    "runpy.run_path('examples/digits_demo.py', run_name='__main__')"
)


@pytest.mark.script
def test_plot_writes_loss_and_memory_pngs(tmp_path):
    import matplotlib.image

    out = tmp_path / "plots"
    result = run_script("examples/digits_demo.py", "--quick", "--plot", str(out))
    assert result.returncode == 0, describe(result)
    for name in ("digits-loss-per-update.png", "digits-peak-memory.png"):
        path = out / name
        assert path.read_bytes()[:8] == PNG_SIGNATURE, name
        height, width, _ = matplotlib.image.imread(path).shape
        assert height > 100 and width > 100, (name, height, width)
    # The sweep's table: one row per effective batch size (16 and 64).
    assert "| effective batch | peak memory, big batch |" in result.stdout
    assert "\n| 16 | " in result.stdout and "\n| 64 | " in result.stdout


def test_plot_without_matplotlib_is_a_clear_error(tmp_path):
    result = run_script("-c", WITHOUT_MATPLOTLIB, "--quick", "--plot", str(tmp_path))
    assert result.returncode == 2, describe(result)
    assert "--plot needs matplotlib" in result.stderr, describe(result)
    assert "digits:" not in result.stdout  # it stopped before training


def test_demo_runs_without_matplotlib():
    result = run_script("-c", WITHOUT_MATPLOTLIB, "--quick")
    assert result.returncode == 0, describe(result)
    assert "OK: accumulation reproduced the big-batch training." in result.stdout
