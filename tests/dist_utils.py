"""Starting the distributed test workers (``tests/dist_worker.py``).

Every child runs with ``sys.executable`` from the repository root (so it
imports this checkout), on the CPU, with a bounded wait, and is killed in a
``finally`` if it is still running.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def child_env() -> dict[str, str]:
    return {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "-1",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p
        ),
    }


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (bound to port 0, released)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _describe(name: str, proc: subprocess.Popen, out: str, err: str) -> str:
    return (
        f"{name}: exit code {proc.returncode}\n--- stdout ---\n{out[-3000:]}"
        f"\n--- stderr ---\n{err[-6000:]}"
    )


def run_workers(commands: list[list[str]], timeout: float) -> None:
    """Runs the commands concurrently; raises AssertionError (with their
    output) if any fails or they do not all finish within ``timeout`` s.

    Output goes to files, not pipes: an unread pipe that fills up would stall
    its worker, and with it the other worker's collectives.
    """
    procs, logs = [], []
    with contextlib.ExitStack() as files:
        try:
            for command in commands:
                out, err = (
                    files.enter_context(tempfile.TemporaryFile(mode="w+"))
                    for _ in range(2)
                )
                logs.append((out, err))
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "tests.dist_worker", *command],
                        cwd=REPO,
                        env=child_env(),
                        stdout=out,
                        stderr=err,
                    )
                )
            deadline = time.monotonic() + timeout
            failures = []
            for i, proc in enumerate(procs):
                try:
                    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                    name = f"worker {i}"
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=30)
                    name = f"worker {i} timed out after {timeout:.0f} s"
                if proc.returncode != 0:
                    failures.append(_describe(name, proc, *map(_read, logs[i])))
            assert not failures, "\n\n".join(failures)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)


def _read(f) -> str:
    f.seek(0)
    return f.read()


def run_mirrored(out: Path, cases: list[str], timeout: float) -> None:
    run_workers([["mirrored", "--out", str(out), "--cases", ",".join(cases)]], timeout)


def run_mwms(out: Path, cases: list[str], timeout: float) -> None:
    ports = ",".join(map(str, free_ports(2)))
    run_workers(
        [
            [
                *("mwms", "--index", str(i), "--ports", ports, "--out", str(out)),
                *("--cases", ",".join(cases)),
            ]
            for i in range(2)
        ],
        timeout,
    )


def load(out: Path, case: str) -> tuple[dict[str, list[np.ndarray]], dict]:
    """``({"ref": [...], "ours": [...], ...}, facts)`` written by a worker."""
    with np.load(out / f"{case}.npz") as data:
        groups: dict[str, list[np.ndarray]] = {}
        for key in sorted(data.files):
            groups.setdefault(key.rsplit("_", 1)[0], []).append(data[key])
    return groups, json.loads((out / f"{case}.json").read_text())
