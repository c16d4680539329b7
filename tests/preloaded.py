"""Fresh child processes that start with TensorFlow, Keras and the package
already imported: a server process imports them once and forks one child per
run, so each run is still a process of its own (its own Keras state, its own
exit code, stdout and stderr) without paying for the imports again (about 6 s
of CPU each).

A run's code executes as ``python -c CODE`` would in the child: as
``__main__``, from ``cwd``, with ``input`` on its standard input, under
``processes.run_script``'s environment (CPU only, this checkout on
``PYTHONPATH``). The fork happens before any TensorFlow op has run (its
thread pools start on first use). For the tests that run many programs of
the same kind (the docs pages' code blocks); a test about what a new
process imports or prints at start-up needs ``processes.run_script``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.processes import REPO, TIMEOUT

SERVER = r"""
import importlib, json, os, sys, traceback
for name in sys.argv[1:]:
    importlib.import_module(name)
replies = os.fdopen(os.dup(1), "w")
sys.stdout.flush()
sys.stderr.flush()
for line in sys.stdin:
    run = json.loads(line)
    pid = os.fork()
    if pid == 0:
        replies.close()
        code = 1
        try:
            os.chdir(run["cwd"])
            for fd, path, flags in (
                (0, run["stdin"], os.O_RDONLY),
                (1, run["stdout"], os.O_WRONLY),
                (2, run["stderr"], os.O_WRONLY),
            ):
                file = os.open(path, flags)
                os.dup2(file, fd)
                os.close(file)
            sys.stdin = open(0, closefd=False)
            sys.argv = ["-c"]
            sys.path[0] = ""
            try:
                exec(compile(run["code"], "<string>", "exec"), {"__name__": "__main__"})
                code = 0
            except SystemExit as exit:
                if exit.code is None or isinstance(exit.code, int):
                    code = exit.code or 0
                else:
                    print(exit.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    replies.write(json.dumps(os.waitstatus_to_exitcode(status)) + "\n")
    replies.flush()
"""


class Preloaded:
    """A server process that imports ``modules`` once and forks a fresh child
    for each ``run``; started on first use, again if a run timed out."""

    def __init__(self, *modules: str):
        self.modules = modules
        self.server: subprocess.Popen | None = None
        self.scratch = tempfile.TemporaryDirectory(prefix="preloaded-")

    def _start(self) -> subprocess.Popen:
        path = os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p
        )
        env = {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": "-1",
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "PYTHONPATH": path,
        }
        self.log = Path(self.scratch.name) / "server.log"
        with open(self.log, "w") as log:
            return subprocess.Popen(
                [sys.executable, "-c", SERVER, *self.modules],
                cwd=REPO,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
            )

    def run(
        self,
        code: str,
        *,
        cwd: str | Path,
        input: str | None = None,
        timeout: float = TIMEOUT,
    ) -> subprocess.CompletedProcess:
        """``python -c code`` from ``cwd``, as a forked child of the server."""
        if self.server is None or self.server.poll() is not None:
            self.server = self._start()
        files = Path(tempfile.mkdtemp(dir=self.scratch.name))
        stdin, stdout, stderr = (files / n for n in ("stdin", "stdout", "stderr"))
        stdin.write_text(input or "", encoding="utf-8")
        stdout.touch()
        stderr.touch()
        request = {
            "code": code,
            "cwd": str(cwd),
            "stdin": str(stdin),
            "stdout": str(stdout),
            "stderr": str(stderr),
        }
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        ready, _, _ = select.select([self.server.stdout], [], [], timeout)
        reply = self.server.stdout.readline() if ready else ""
        args = ["<preloaded>", "-c", code]
        if not reply:
            self._stop()  # the server and its child: one process group
            if ready:
                raise RuntimeError(
                    f"the preloaded server ended:\n{self.log.read_text()[-4000:]}"
                )
            raise subprocess.TimeoutExpired(args, timeout)
        return subprocess.CompletedProcess(
            args,
            json.loads(reply),
            stdout.read_text(encoding="utf-8"),
            stderr.read_text(encoding="utf-8"),
        )

    def _stop(self) -> None:
        if self.server is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.server.pid, signal.SIGKILL)
            self.server.wait(timeout=60)
            self.server = None

    def close(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.stdin.close()  # its loop ends; it exits
            try:
                self.server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._stop()
        self.server = None
        self.scratch.cleanup()
