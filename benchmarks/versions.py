"""Time per fit() epoch of two versions of the package, side by side.

What it measures
    ``epoch.py``'s step-bound model and variants (an MLP on ``load_digits``,
    see there), trained by two checkouts of gradient-accumulator: ``--before``
    (a git revision of this repository, or a directory) and ``--after`` (this
    checkout by default). A restructuring must leave the per-step cost as it
    was; this is the before/after table ``benchmarks/README.md`` keeps.

Method
    One worker process per version (``PYTHONPATH`` at its checkout, the same
    Python, TensorFlow and Keras), each building every variant and warming it
    up with one epoch. Then, for ``--rounds`` rounds, the workers run one
    round each in turn (which one goes first alternates), never at the same
    time; a worker's round is one ``fit`` epoch of every variant in a rotated
    order, timed with ``time.perf_counter`` and ``time.process_time``.
    Reported per variant: the median ms per epoch of each version, the median
    of the per-round ratios after/before (rounds taken seconds apart, which
    cancels most drift in machine load) with their range, and each version's
    median ratio to Keras' built-in accumulation measured in its own process.
    The script reports and never asserts; it exits 0 unless a worker fails.

Run
    python benchmarks/versions.py --before 91ba877            # 9 rounds
    python benchmarks/versions.py --before 91ba877 --rounds 21
    python benchmarks/versions.py --before /path/to/checkout --after .
    python benchmarks/versions.py --before HEAD --quick       # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# keras-builtin is each version's in-process reference; the plain variants
# do not depend on the package and are left out.
VARIANTS = ("keras-builtin", "ours-model", "ours-in-step", "ours-optimizer")
WORKER_TIMEOUT = 900  # seconds for one worker's set-up or round


def worker(args: argparse.Namespace) -> None:
    """Builds the variants with the package ``PYTHONPATH`` finds, then runs a
    round for every line read from standard input, answering with JSON."""
    sys.path.insert(0, str(HERE))
    import epoch

    x, y = epoch.digits(args.scale)
    big = args.micro_batch * args.accum_steps
    runners = [
        epoch.Runner(
            variant,
            epoch.build_variant(
                variant, args.hidden, args.micro_batch, args.accum_steps
            ),
            big if variant in epoch.BIG_BATCH else args.micro_batch,
        )
        for variant in VARIANTS
    ]
    for runner in runners:
        runner.run(x, y, 1)
    print(json.dumps({"package": epoch.gradient_accumulator.__file__}), flush=True)
    for line in sys.stdin:
        shift = int(line)
        times = {}
        for runner in runners[shift:] + runners[:shift]:
            times[runner.variant] = runner.run(x, y, 1)
        print(json.dumps(times), flush=True)


class Worker:
    """A worker process for the checkout at ``root``."""

    def __init__(self, root: Path, argv: list[str]):
        env = {**os.environ, "PYTHONPATH": str(root)}
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--worker", *argv],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.package = self._answer()["package"]

    def _answer(self) -> dict:
        # A worker answers one line per request; a dead or hung one ends the run.
        import selectors

        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(WORKER_TIMEOUT):
                self.close()
                raise SystemExit(f"a worker gave no answer in {WORKER_TIMEOUT} s")
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"a worker ended with code {self.process.wait()}")
        return json.loads(line)

    def round(self, shift: int) -> dict:
        self.process.stdin.write(f"{shift}\n")
        self.process.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def checkout(spec: str, scratch: Path) -> Path:
    """A directory holding version ``spec``: itself if it is one, else the
    files of that git revision of this repository."""
    if Path(spec).is_dir():
        return Path(spec).resolve()
    archive = scratch / "before.tar"
    subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", "-o", str(archive), spec],
        check=True,
    )
    target = scratch / "before"
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    return target


def report(times: dict[str, list[dict]], packages: dict[str, str]) -> list[str]:
    def ms(version, variant, clock=0):
        return [t[variant][clock] for t in times[version]]

    lines = [
        f"before: {packages['before']}",
        f"after:  {packages['after']}",
        "",
        "| variant | before ms/epoch | after ms/epoch | after/before (median) "
        "| range | before vs keras-builtin | after vs keras-builtin "
        "| CPU after/before |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for variant in VARIANTS:
        per_round = [a / b for a, b in zip(ms("after", variant), ms("before", variant))]
        cpu = [a / b for a, b in zip(ms("after", variant, 1), ms("before", variant, 1))]
        vs_builtin = {
            v: statistics.median(
                a / b for a, b in zip(ms(v, variant), ms(v, "keras-builtin"))
            )
            for v in ("before", "after")
        }
        lines.append(
            f"| {variant} | {1000 * statistics.median(ms('before', variant)):.1f} "
            f"| {1000 * statistics.median(ms('after', variant)):.1f} "
            f"| {statistics.median(per_round):.3f} "
            f"| {min(per_round):.3f}-{max(per_round):.3f} "
            f"| {vs_builtin['before']:.3f} | {vs_builtin['after']:.3f} "
            f"| {statistics.median(cpu):.3f} |"
        )
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="a git revision or a checkout directory")
    parser.add_argument("--after", default=str(REPO), help="a checkout directory")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--scale", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--accum-steps", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="2 rounds at scale 1")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.scale = 2, 1
    if not args.worker and not args.before:
        parser.error("--before is required (a git revision or a directory)")
    for name in ("rounds", "scale", "hidden", "micro_batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.accum_steps < 2:
        parser.error("--accum-steps must be >= 2 (Keras' built-in needs it)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    model_argv = [
        f"--scale={args.scale}",
        f"--hidden={args.hidden}",
        f"--micro-batch={args.micro_batch}",
        f"--accum-steps={args.accum_steps}",
    ]
    with tempfile.TemporaryDirectory() as scratch:
        roots = {
            "before": checkout(args.before, Path(scratch)),
            "after": Path(args.after).resolve(),
        }
        workers = {}
        try:
            for version, root in roots.items():
                workers[version] = Worker(root, model_argv)
            times = {version: [] for version in roots}
            order = list(roots)
            for r in range(args.rounds):
                for version in order if r % 2 == 0 else order[::-1]:
                    times[version].append(workers[version].round(r % len(VARIANTS)))
        finally:
            for w in workers.values():
                w.close()
        packages = {v: w.package for v, w in workers.items()}
    print(
        f"{args.rounds} rounds, scale {args.scale}, K={args.accum_steps}, "
        f"m={args.micro_batch}"
    )
    print("\n".join(report(times, packages)))


if __name__ == "__main__":
    main()
