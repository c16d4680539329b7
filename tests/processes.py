"""Running the repository's scripts in child processes, as a user would."""

from __future__ import annotations

import contextlib
import os
import re
import signal
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


# TensorFlow's C++ log lines (absl style: "E0000 00:00:1795553431.473814 28101
# cuda_platform.cc:52] ...") and the words of those a new user saw: the
# start-up lines (port.cc's oneDNN notice, cudart_stub, cpu_feature_guard,
# "All log messages before absl::InitializeLog()"), cuInit's error without a
# GPU driver, oneDNN's "Falling back to the default Eigen" and tf.data's
# "NodeDef mentions attribute use_unbounded_threadpool".
TENSORFLOW_LOG = re.compile(
    r"^[IWEF]\d{4} |absl::InitializeLog|cuInit|cudart_stub|cpu_feature_guard"
    r"|use_unbounded_threadpool|oneDNN",
    re.M,
)


def run_like_a_user(
    *args: str, timeout: float = TIMEOUT
) -> subprocess.CompletedProcess:
    """``python *args`` from the repository root in a new user's environment:
    the test session's ``TF_CPP_MIN_LOG_LEVEL`` and ``CUDA_VISIBLE_DEVICES``
    (conftest.py and CI set them) removed. The child leads its own process
    group: if the timeout expires, or the wait is interrupted, the group is
    killed, with any process the child started (examples/distributed.py's
    workers)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CPP_MIN_LOG_LEVEL", "CUDA_VISIBLE_DEVICES")
    }
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p
    )
    child = subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except BaseException:
        # Not reaped yet, so the group id is still the child's own.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.communicate(timeout=60)
        raise
    return subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)


def assert_quiet(result: subprocess.CompletedProcess) -> None:
    """No TensorFlow log line anywhere in the child's output."""
    lines = (result.stdout + "\n" + result.stderr).splitlines()
    found = "\n".join(line[:200] for line in lines if TENSORFLOW_LOG.search(line))
    assert not found, f"TensorFlow log lines:\n{found}\n{describe(result)}"
