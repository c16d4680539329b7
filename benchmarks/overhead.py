"""Time per micro-step of gradient accumulation vs plain Keras training (CPU).

What it measures
    For each model (an MLP 784-1024-1024-10 and a small CNN on 28x28x1) it
    builds four variants that all train on the same micro-batch size:

    * ``plain``: ``keras.Model``, Keras' own train step, Adam;
    * ``ours-model``: ``GradientAccumulateModel(accum_steps=K)``, Adam;
    * ``ours-optimizer``: ``keras.Model`` with
      ``GradientAccumulateOptimizer(Adam, accum_steps=K)``;
    * ``keras-builtin``: ``keras.Model`` with
      ``keras.optimizers.Adam(gradient_accumulation_steps=K)``.

    "plain" applies Adam on every micro-batch; the accumulating variants add
    the gradient to a buffer and apply Adam once every K micro-batches, so
    a ratio below 1 is possible.

Method
    Every variant is built once and warmed up (traced) with a short ``fit``
    followed by a few direct ``train_function`` calls, and one unrecorded
    round of all variants follows (the first call of a variant after others
    were built runs 2-3x slower). Then, for ``--rounds``
    rounds, each variant runs ``--steps`` micro-steps (a multiple of K, so a
    round always holds whole accumulation cycles) with the variants
    interleaved and their order rotated every round. Timing calls
    ``model.train_function(iterator)`` directly, one call per micro-step (the
    compiled Keras train step, exactly what ``fit`` calls per batch), on an
    iterator over a pre-batched, cached, repeated ``tf.data.Dataset`` of
    synthetic data. This leaves out ``fit``'s per-call set-up (callbacks,
    iterator creation), which is the same for every variant and would only
    dilute the ratios.

    Reported per variant: the median over rounds of wall-clock ms per
    micro-step, and the median over rounds of the per-round ratio to "plain"
    (each ratio pairs timings taken seconds apart, which cancels most drift
    in machine load), with the min-max range of that ratio. The same two
    medians are also given for this process' CPU time (``time.process_time``,
    all threads): on a machine shared with other jobs it moves much less than
    wall time when the process is descheduled, though TensorFlow's spinning
    worker threads add some noise of their own. The script reports and never
    asserts; it always exits 0.

    ``--probe-unchecked`` adds ``ours-model-unchecked``: the model wrapper
    with the engine's finite check (its sum of squares, which gates the
    update) replaced by a constant while its step is traced. It is a
    measurement of what the check costs, not an option of the package: that
    variant writes a NaN gradient into the weights, as Keras' built-in does.

    ``--phases`` adds a second table: each variant's micro-steps timed one
    call at a time by their position in the cycle (the last one applies the
    update), median over rounds, and the whole cycle's time relative to
    Keras' built-in. It shows where a difference comes from: the accumulating
    steps or the update step.

Run
    python benchmarks/overhead.py                      # defaults
    python benchmarks/overhead.py --phases --models mlp --rounds 40
    python benchmarks/overhead.py --rounds 5 --models mlp
    python benchmarks/overhead.py --phases --probe-unchecked --models mlp
    python benchmarks/overhead.py --quick              # smoke test, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["CUDA_VISIBLE_DEVICES"] = "-1"  # a CPU measurement, by design
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

# Run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import keras
import numpy as np
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel, GradientAccumulateOptimizer
from gradient_accumulator.core import arithmetic

VARIANTS = ("plain", "ours-model", "ours-optimizer", "keras-builtin")
PROBE = "ours-model-unchecked"  # --probe-unchecked
MODELS = ("mlp", "cnn")
CLASSES = 10
DISTINCT_BATCHES = 8  # synthetic batches cycled by the repeated dataset


# ------------------------------------------------------------------ models
def mlp_layers() -> tuple[keras.KerasTensor, keras.KerasTensor]:
    inputs = keras.Input((784,))
    h = keras.layers.Dense(1024, activation="relu")(inputs)
    h = keras.layers.Dense(1024, activation="relu")(h)
    return inputs, keras.layers.Dense(CLASSES)(h)


def cnn_layers() -> tuple[keras.KerasTensor, keras.KerasTensor]:
    inputs = keras.Input((28, 28, 1))
    h = keras.layers.Conv2D(32, 3, activation="relu")(inputs)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Conv2D(64, 3, activation="relu")(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    return inputs, keras.layers.Dense(CLASSES)(h)


LAYERS: dict[str, Callable[[], tuple[keras.KerasTensor, keras.KerasTensor]]] = {
    "mlp": mlp_layers,
    "cnn": cnn_layers,
}


def build_variant(model_name: str, variant: str, accum_steps: int) -> keras.Model:
    """A compiled model of ``model_name`` trained the ``variant`` way."""
    keras.utils.set_random_seed(0)  # same initial weights for every variant
    inputs, outputs = LAYERS[model_name]()
    if variant in ("ours-model", PROBE):
        model = GradientAccumulateModel(
            accum_steps=accum_steps, inputs=inputs, outputs=outputs
        )
        optimizer = keras.optimizers.Adam()
    else:
        model = keras.Model(inputs=inputs, outputs=outputs)
        if variant == "plain":
            optimizer = keras.optimizers.Adam()
        elif variant == "ours-optimizer":
            optimizer = GradientAccumulateOptimizer(
                keras.optimizers.Adam(), accum_steps=accum_steps
            )
        elif variant == "keras-builtin":
            optimizer = keras.optimizers.Adam(gradient_accumulation_steps=accum_steps)
        else:
            raise ValueError(f"unknown variant {variant!r}")
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def synthetic_dataset(model_name: str, batch_size: int) -> tf.data.Dataset:
    """Pre-batched, cached, endlessly repeated random (x, y) batches."""
    rng = np.random.default_rng(0)
    shape = (784,) if model_name == "mlp" else (28, 28, 1)
    n = DISTINCT_BATCHES * batch_size
    x = rng.normal(size=(n, *shape)).astype("float32")
    y = rng.integers(0, CLASSES, size=n).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    return dataset.batch(batch_size, drop_remainder=True).cache().repeat()


# ------------------------------------------------------------------ timing
@dataclass
class Runner:
    """One built, warmed-up variant and its timings, per micro-step, per round."""

    variant: str
    model: keras.Model
    iterator: tf.data.Iterator
    wall: list[float] = field(default_factory=list)  # seconds, wall clock
    cpu: list[float] = field(default_factory=list)  # seconds, this process' CPU
    phases: dict[int, list[float]] = field(default_factory=dict)  # see below

    def run(self, steps: int) -> tuple[float, float]:
        """Runs ``steps`` micro-steps; returns (wall, CPU) seconds per step."""
        train = self.model.train_function
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            logs = train(self.iterator)
        float(logs["loss"])  # make sure the last step has finished
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return wall / steps, cpu / steps

    def record(self, steps: int) -> None:
        wall, cpu = self.run(steps)
        self.wall.append(wall)
        self.cpu.append(cpu)

    def record_phases(self, accum_steps: int) -> None:
        """Times one cycle call by call: ``phases[i]`` holds the wall seconds
        of the cycle's ``i``-th micro-step, one entry per round."""
        train = self.model.train_function
        for phase in range(accum_steps):
            start = time.perf_counter()
            float(train(self.iterator)["loss"])
            self.phases.setdefault(phase, []).append(time.perf_counter() - start)


@contextlib.contextmanager
def finite_check_removed():
    """While a step is traced, the engine's sum of squares is a constant 0, so
    its update is gated by a constant predicate (the probe variant only)."""
    original = arithmetic.squared_norm
    arithmetic.squared_norm = lambda tensors: tf.constant(0.0)
    try:
        yield
    finally:
        arithmetic.squared_norm = original


def prepare(model_name: str, variant: str, batch_size: int, accum_steps: int) -> Runner:
    """Builds a variant and traces its train step (fit, then direct calls).

    All tracing happens here: the probe's patch is gone before any other
    variant traces or any timing starts.
    """
    probe = finite_check_removed() if variant == PROBE else contextlib.nullcontext()
    with probe:
        model = build_variant(model_name, variant, accum_steps)
        dataset = synthetic_dataset(model_name, batch_size)
        model.fit(
            dataset, epochs=1, steps_per_epoch=2 * accum_steps, shuffle=False, verbose=0
        )
        runner = Runner(variant, model, iter(dataset))
        runner.run(2 * accum_steps)  # the direct-call path may trace once more
    return runner


def measure(
    model_name: str,
    rounds: int,
    steps: int,
    batch_size: int,
    accum_steps: int,
    phases: bool = False,
    variants: tuple[str, ...] = VARIANTS,
) -> list[Runner]:
    """Interleaved rounds over all variants, order rotated every round."""
    keras.backend.clear_session()
    runners = [prepare(model_name, v, batch_size, accum_steps) for v in variants]
    # The first call of each variant after the others were built is slow
    # (2-3x, for all but the last one built): one unrecorded round absorbs it.
    for runner in runners:
        runner.run(steps)
    for r in range(rounds):
        shift = r % len(runners)
        for runner in runners[shift:] + runners[:shift]:
            runner.record(steps)
            if phases:
                runner.record_phases(accum_steps)
    return runners


# ---------------------------------------------------------------- reporting
def ratios(runner: Runner, reference: Runner, clock: str = "wall") -> list[float]:
    """Per-round ratios of ``runner``'s time to ``reference``'s."""
    mine, theirs = getattr(runner, clock), getattr(reference, clock)
    return [a / b for a, b in zip(mine, theirs)]


def median_ratio(runner: Runner, reference: Runner, clock: str = "wall") -> float:
    return statistics.median(ratios(runner, reference, clock))


def table_rows(model_name: str, runners: list[Runner]) -> list[str]:
    plain = next(r for r in runners if r.variant == "plain")
    rows = []
    for runner in runners:
        rs = ratios(runner, plain)
        rows.append(
            f"| {model_name} | {runner.variant} "
            f"| {1000 * statistics.median(runner.wall):.2f} "
            f"| {statistics.median(rs):.3f} | {min(rs):.3f}-{max(rs):.3f} "
            f"| {1000 * statistics.median(runner.cpu):.2f} "
            f"| {median_ratio(runner, plain, 'cpu'):.3f} |"
        )
    return rows


def phase_rows(model_name: str, runners: list[Runner]) -> list[str]:
    """Median ms per position in the cycle, and the cycle vs keras-builtin."""
    cycle = {
        r.variant: [sum(times) for times in zip(*r.phases.values())] for r in runners
    }
    keras_cycle = cycle["keras-builtin"]
    rows = []
    for runner in runners:
        medians = [1000 * statistics.median(runner.phases[i]) for i in runner.phases]
        ratio = statistics.median(
            a / b for a, b in zip(cycle[runner.variant], keras_cycle)
        )
        rows.append(
            f"| {model_name} | {runner.variant} | "
            + " | ".join(f"{m:.2f}" for m in medians)
            + f" | {1000 * statistics.median(cycle[runner.variant]):.2f}"
            f" | {ratio:.3f} |"
        )
    return rows


# Per micro-step at the same micro-batch: the package's overhead targets.
PLAIN_TARGET = 1.03
BUILTIN_TARGET = 1.05


def verdicts(model_name: str, runners: list[Runner]) -> list[str]:
    """One line per wrapper of ours: median ratios to plain and keras-builtin."""
    by_name = {r.variant: r for r in runners}
    plain, keras_builtin = by_name["plain"], by_name["keras-builtin"]
    lines = []
    for name in ("ours-model", "ours-optimizer"):
        ours = by_name[name]
        parts = []
        for clock in ("wall", "cpu"):
            vs_plain = median_ratio(ours, plain, clock)
            vs_keras = median_ratio(ours, keras_builtin, clock)
            met = vs_plain <= PLAIN_TARGET and vs_keras <= BUILTIN_TARGET
            parts.append(
                f"{clock}: {vs_plain:.3f} x plain, {vs_keras:.3f} x keras-builtin "
                f"({'met' if met else 'not met'})"
            )
        lines.append(f"{model_name} {name}: " + "; ".join(parts))
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--steps", type=int, default=None, help="micro-steps per round (default 8*K)"
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--accum-steps", type=int, default=4)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument(
        "--quick", action="store_true", help="2 rounds of K steps: a smoke test"
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="also time each position in the cycle, one call at a time",
    )
    parser.add_argument(
        "--probe-unchecked",
        action="store_true",
        help=f"add {PROBE!r}: the model wrapper without its finite check (a probe)",
    )
    args = parser.parse_args(argv)
    k = args.accum_steps
    if k < 2 or args.batch_size < 1:
        # Keras' gradient_accumulation_steps (the baseline) requires >= 2.
        parser.error("--accum-steps must be >= 2 and --batch-size >= 1")
    if args.quick:
        args.rounds, args.steps = 2, k
    if args.steps is None:
        args.steps = 8 * k
    if args.steps < 1 or args.steps % k:
        parser.error(f"--steps must be a positive multiple of --accum-steps ({k})")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown or not args.models:
        parser.error(f"--models takes a comma list of {MODELS}; got {unknown}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}, CPU; "
        f"micro-batch {args.batch_size}, accum_steps {args.accum_steps}, "
        f"{args.steps} micro-steps per variant per round, {args.rounds} rounds, "
        "timing model.train_function calls directly, variants interleaved.",
        flush=True,
    )
    rows: list[str] = []
    lines: list[str] = []
    phases: list[str] = []
    for model_name in args.models:
        runners = measure(
            model_name,
            args.rounds,
            args.steps,
            args.batch_size,
            args.accum_steps,
            args.phases,
            VARIANTS + ((PROBE,) if args.probe_unchecked else ()),
        )
        rows += table_rows(model_name, runners)
        lines += verdicts(model_name, runners)
        if args.phases:
            phases += phase_rows(model_name, runners)
    print()
    print(
        "| model | variant | ms/micro-step | ratio vs plain | "
        "ratio range (min-max over rounds) | CPU ms/micro-step | CPU ratio vs plain |"
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print(
        "ms/micro-step: wall clock, median over rounds; ratio: median of per-round "
        "ratios. CPU: this process' CPU time (all threads), less sensitive to other "
        "processes on a shared machine."
    )
    print(
        f"target: ours <= {PLAIN_TARGET} x plain and <= {BUILTIN_TARGET} x "
        "keras-builtin (with the finite check on)"
    )
    print("\n".join(lines))
    if phases:
        k = args.accum_steps
        print()
        print(
            "| model | variant | "
            + " | ".join(f"micro-step {i + 1} ms" for i in range(k))
            + " | cycle ms | cycle ratio vs keras-builtin |"
        )
        print("|---|---|" + "---|" * (k + 2))
        print("\n".join(phases))
        print()
        print(
            f"Each call timed alone, median over rounds; micro-step {k} applies "
            "the update."
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
