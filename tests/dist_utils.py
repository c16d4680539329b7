"""Starting the distributed test workers (``tests/dist_worker.py``).

Every child runs with ``sys.executable`` from the repository root (so it
imports this checkout), on the CPU, with a bounded wait, and is killed in a
``finally`` if it is still running.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


_TWO_CPUS_CHILD = """
import json, sys
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)
tf.config.experimental.enable_op_determinism()
module, name = sys.argv[1:]
result = getattr(__import__(module, fromlist=[name]), name)()
print("RESULT", json.dumps(result))
"""


def on_two_cpus(function, timeout: float = 300):
    """``function()`` (a module-level function returning JSON-able data) run
    where the CPU is two logical devices: in this process in a tf-keras
    session (``tests/conftest.py`` split its CPU), else in a child process
    whose CPU is split before TensorFlow starts (a Keras 3 session has
    started it already), with a bounded wait."""
    from tests.flavour import LEGACY_KERAS
    from tests.processes import describe, run_script

    if LEGACY_KERAS:
        return function()
    # The module by its path from the repository root (pytest may have
    # imported it under a shorter name).
    path = Path(inspect.getsourcefile(function)).resolve().relative_to(REPO)
    module = ".".join(path.with_suffix("").parts)
    child = run_script(
        "-c", _TWO_CPUS_CHILD, module, function.__name__, timeout=timeout
    )
    assert child.returncode == 0, describe(child)
    line = next(s for s in child.stdout.splitlines() if s.startswith("RESULT"))
    return json.loads(line.split(" ", 1)[1])


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


# ------------------------------------------------------- a worker's death
DEATH_WORKER = "tests.death_worker"


def _start(module: str, args: list[str], logs: Path, name: str) -> subprocess.Popen:
    """``python -m module *args`` from the repository root, leading its own
    process group, its output in ``logs/name.{out,err}`` (files: an unread
    pipe that fills up would stall the worker)."""
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"{name}.out", "w") as out, open(logs / f"{name}.err", "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=REPO,
            env=child_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILLs ``proc``'s process group (its own: start_new_session), as a
    cluster manager stops a worker; waits for it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _logs(logs: Path, name: str, proc: subprocess.Popen) -> str:
    text = [f"{name}: exit code {proc.returncode}"]
    for stream, tail in (("out", 3000), ("err", 6000)):
        path = logs / f"{name}.{stream}"
        body = path.read_text(errors="replace") if path.exists() else ""
        text.append(f"--- {stream} ---\n{body[-tail:]}")
    return "\n".join(text)


def _workers(out: Path, phase: str) -> list[subprocess.Popen]:
    ports = ",".join(map(str, free_ports(2)))
    return [
        _start(
            DEATH_WORKER,
            ["--index", str(i), "--ports", ports, "--out", str(out), "--phase", phase],
            out / "logs",
            f"{phase}-w{i}",
        )
        for i in range(2)
    ]


def kill_a_worker_and_resume(out: Path, tear, timeout: float) -> dict:
    """A cluster operator's drill with ``tests/death_worker.py``: two workers
    on free ports train with backups until worker 1 SIGKILLs itself (after a
    backup, before the next update) and worker 0 says it got there; worker 0
    is then SIGKILLed by this function, as a cluster manager stops the rest
    of a cluster that lost a worker. ``tear(out / "backup")`` may then damage
    copies of the backups; both workers restart from the backups on new
    ports and train to the end. Every wait is bounded by ``timeout`` s per
    phase; every worker still running at an error is killed. Returns facts
    about the death: whether worker 0 was still running when stopped."""
    procs: list[subprocess.Popen] = []
    try:
        procs = _workers(out, "first")
        first0, first1 = procs
        alive, dying = out / "w0" / "alive", out / "w1" / "dying"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if first1.poll() is not None and alive.exists():
                break
            if first0.poll() is not None and not alive.exists():
                break  # worker 0 failed before the kill point
            time.sleep(0.2)
        logs = "\n\n".join(
            _logs(out / "logs", f"first-w{i}", p) for i, p in enumerate(procs)
        )
        assert alive.exists(), f"worker 0 did not reach the kill point\n{logs}"
        assert dying.exists(), f"worker 1 did not reach the kill point\n{logs}"
        assert first1.returncode == -signal.SIGKILL, logs
        # The manager stops the survivor (if its peer's death has not ended it).
        facts = {"worker0_running": first0.poll() is None}
        _kill_group(first0)
        _kill_group(first1)
        tear(out / "backup")
        procs = _workers(out, "resume")
        deadline = time.monotonic() + timeout
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        failures = [
            _logs(out / "logs", f"resume-w{i}", proc)
            for i, proc in enumerate(procs)
            if proc.poll() != 0
        ]
        assert not failures, "\n\n".join(failures)
        return facts
    finally:
        for proc in procs:
            _kill_group(proc)


def tear_newest(directory: Path) -> Path:
    """Truncates to half the data file of the newest checkpoint under
    ``directory`` (``ckpt-<n>.data-...``, the highest ``n``): a backup torn
    by a death while it was written. Returns the file."""
    files = sorted(
        directory.rglob("ckpt-*.data-*"),
        key=lambda p: int(p.name.split(".")[0].split("-")[1]),
    )
    newest = files[-1]
    os.truncate(newest, newest.stat().st_size // 2)
    return newest


def drill_loader(out: Path):
    """``load(name, worker=0)``: what that worker of the drill wrote for
    ``name``, as ``(arrays by prefix, facts)``."""

    def load(name: str, worker: int = 0):
        return globals()["load"](out / f"w{worker}", name)

    return load


def max_gap(a, b) -> float:
    """Max |a - b| over two lists of arrays (booleans as 0 and 1)."""
    return max(
        (
            float(np.max(np.abs(x.astype("float64") - y.astype("float64")), initial=0))
            for x, y in zip(a, b, strict=True)
        ),
        default=0.0,
    )


def assert_within(a, b, atol: float) -> float:
    """Max |a - b| over two lists of arrays, asserted within ``atol``."""
    assert len(a) == len(b), (len(a), len(b))
    diff = max_gap(a, b)
    assert diff <= atol, f"max |a - b| = {diff:.3g} > {atol:g}"
    return diff


def assert_resumed_as(load, name: str, straight: str, updates: int, atol: float):
    """The drill's run ``name``, resumed, ends as the uninterrupted run
    ``straight``: every weight (BatchNorm's statistics and sums included),
    the optimizer's variables (moments, ``iterations``) and the engine's
    (the cycle's position, its sums) within ``atol``, ``updates`` updates,
    and both workers alike. Returns max |dw| over the weights."""
    resumed, facts = load(f"{name}_resumed")
    reference, expected = load(f"{straight}_straight")
    initial, _ = load(f"{straight}_init")
    assert max_gap(initial["t"], reference["t"]) > 1e-3  # it trained
    diff = assert_within(resumed["w"], reference["w"], atol)
    assert_within(resumed["o"], reference["o"], atol)
    assert_within(resumed.get("e", []), reference.get("e", []), atol)
    assert facts["iterations"] == expected["iterations"] == updates, facts
    assert facts.get("micro_step") == expected.get("micro_step"), facts
    other, other_facts = load(f"{name}_resumed", worker=1)
    assert_within(other["w"], resumed["w"], 0)
    assert_within(other["o"], resumed["o"], 0)
    assert other_facts == facts
    return diff


def assert_sums_split_evenly(load, case: str) -> None:
    """Each restarted worker of the drill holds half of what the killed
    run's workers held together in ``case``'s replica-local sums when the
    backup was written (their shares differed)."""
    at_backup = [load(f"{case}_at_backup", w)[0]["local"] for w in (0, 1)]
    restored = [load(f"{case}_restored", w)[0]["local"] for w in (0, 1)]
    assert max_gap(*at_backup) > 1e-3
    assert_within(restored[0], restored[1], 0)
    total = [a + b for a, b in zip(*at_backup)]
    assert_within([a + b for a, b in zip(*restored)], total, 1e-6)
