"""Running the repository's scripts in child processes, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 300  # seconds; subprocess.run kills the child when it expires


def run(
    command,
    *,
    env: dict | None = None,
    cwd: str | Path | None = None,
    timeout: float = TIMEOUT,
    input: str | None = None,
) -> subprocess.CompletedProcess:
    """``command`` (its items as strings) in a child process, its output
    captured as text, bounded in time (``subprocess.run`` kills the child
    when the timeout expires); a failure is the caller's to check."""
    return subprocess.run(
        [str(a) for a in command],
        cwd=cwd,
        env=env,
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def run_script(
    *args: str,
    timeout: float = TIMEOUT,
    cwd: str | Path = REPO,
    input: str | None = None,
) -> subprocess.CompletedProcess:
    """``python *args`` from ``cwd`` (the repository root unless told), on the
    CPU, bounded in time (``subprocess.run`` kills the child when the timeout
    expires), with ``input`` on its stdin. The child imports this checkout's
    package and ``tests``."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "-1",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "PYTHONPATH": path,
    }
    return run([sys.executable, *args], env=env, cwd=cwd, timeout=timeout, input=input)


def describe(result: subprocess.CompletedProcess) -> str:
    """A child's exit code and the tails of its output, for assertion messages."""
    return (
        f"exit code {result.returncode}\n--- stdout ---\n{result.stdout[-4000:]}"
        f"\n--- stderr ---\n{result.stderr[-4000:]}"
    )


def verdict(result: subprocess.CompletedProcess) -> str:
    """The last line an example printed: ``OK: <what it showed>`` or
    ``FAIL: <what did not hold>``."""
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    return lines[-1] if lines else ""
