"""What ``gradient_cache=True`` costs: time per step and peak memory.

A two-tower retrieval model trained with an in-batch softmax (each query
against the batch's candidates), the loss that couples a batch's samples
and that ``GradientAccumulateModel(micro_batch_size=n, gradient_cache=True)``
computes exactly on a batch of N run in slices of n.

Time (this process, TensorFlow's default CPU allocator)
    Towers of ``--depth`` Dense layers of ``--width`` units (relu) on 64
    input features, a 128-unit projection each; Adam. Variants, each its own
    model, traced and warmed up first:

    * ``plain N``: plain Keras on the whole batch of N (the reference);
    * ``cached n``: the cached wrapper fed batches of N in slices of n, for
      each ``--slices`` n;
    * ``in-step n, no cache``: ``micro_batch_size=n`` alone, for each
      ``--slices`` n (not exact for this loss: each slice sees n
      negatives), what slicing costs without the second forward pass.

    ``model.train_function`` is called directly (as ``overhead.py`` does),
    ``--steps`` steps per variant per round, variants interleaved in a
    rotated order over ``--rounds`` rounds; the table gives each variant's
    median ms/step and the median of its per-round ratios to ``plain N``,
    wall clock and this process' CPU time.

Memory (a child process: ``TF_CPU_ALLOCATOR_USE_BFC=1`` before TensorFlow
loads, as in ``memory.py``)
    Token towers whose activations outweigh their weights (``--tokens``
    positions of 64 features, two per-token Dense layers of 256 units,
    mean pooling, a 128-unit projection), so that what is measured is what
    the batch size moves. One update each, peak bytes the BFC allocator
    held above what it held just before (``get_memory_info('CPU:0')``,
    peak reset before each), medians over interleaved rounds:

    * ``cached N/n``: batch N in slices of ``--micro`` n, for N/n from 4
      to 32 (``--ratios``);
    * (a) ``plain n + N outputs``: plain Keras on a batch of n, plus the
      bytes of the whole batch's N outputs (which the cache must hold);
    * (b) ``plain N``: plain Keras on the whole batch;
    * ``in-step N/n, no cache``: ``micro_batch_size=n`` alone (not exact
      for this loss), what slicing holds without the cache.

    The excess of the cached step over (a) is also given in units of the
    model's parameter bytes (a buffer of the weights' size, such as the
    slices' gradient sum, is one). With ``--inter-op 1`` TensorFlow's
    executor runs one op at a time, so independent ops overlap only as far
    as the graph's order lets them: the peak is what the step's data
    dependencies allow, not also what two threads happened to run at once.

Run:
    python benchmarks/gradient_cache.py            # time and memory
    python benchmarks/gradient_cache.py --quick    # small and fast: a smoke test
    python benchmarks/gradient_cache.py --part time --rounds 21
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["CUDA_VISIBLE_DEVICES"] = "-1"  # a CPU measurement, by design
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import keras
import numpy as np
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel

MEMORY_CHILD = "--memory-child"
DEVICE = "CPU:0"
FEATURES = 64  # per input position, each tower
EMBEDDING = 128  # each tower's output


def in_batch_softmax(y_true, y_pred):
    """Each query's own candidate among the batch's candidates."""
    query, candidate = tf.split(y_pred, 2, axis=1)
    logits = tf.matmul(query, candidate, transpose_b=True)
    labels = tf.range(tf.shape(query)[0])
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)


def dense_tower(inputs, width: int, depth: int):
    h = inputs
    for _ in range(depth):
        h = keras.layers.Dense(width, activation="relu")(h)
    return keras.layers.Dense(EMBEDDING, use_bias=False)(h)


def token_tower(inputs, width: int):
    h = keras.layers.Dense(width, activation="relu")(inputs)
    h = keras.layers.Dense(width, activation="relu")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.layers.Dense(EMBEDDING, use_bias=False)(h)


def build(shape: tuple, tower, micro: int | None, cache: bool) -> keras.Model:
    """A two-tower model (query, candidate) compiled with Adam and the
    in-batch softmax; ``micro``: ``micro_batch_size`` (None: plain Keras)."""
    keras.utils.set_random_seed(0)
    inputs = [keras.Input(shape), keras.Input(shape)]
    outputs = keras.layers.Concatenate()([tower(t) for t in inputs])
    if micro is None:
        model = keras.Model(inputs, outputs)
    else:
        model = GradientAccumulateModel(
            micro_batch_size=micro,
            gradient_cache=cache,
            inputs=inputs,
            outputs=outputs,
        )
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=in_batch_softmax)
    return model


def batch(shape: tuple, size: int, seed: int = 0):
    """A batch of (query, candidate) pairs and dummy targets, as tensors."""
    rng = np.random.default_rng(seed)
    query = rng.normal(size=(size, *shape)).astype("float32")
    candidate = (query + 0.5 * rng.normal(size=query.shape)).astype("float32")
    x = (tf.constant(query), tf.constant(candidate))
    return x, tf.zeros((size, 1))


# -------------------------------------------------------------------- time
class Timed:
    """One variant, traced and warmed up, and its times per round."""

    def __init__(self, name: str, model: keras.Model, x, y):
        self.name = name
        self.model = model
        dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
        self.iterator = iter(dataset)
        model.fit(dataset, steps_per_epoch=2, epochs=1, shuffle=False, verbose=0)
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def run(self, steps: int) -> tuple[float, float]:
        train = self.model.train_function
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            logs = train(self.iterator)
        float(logs["loss"])  # the last step has finished
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return wall / steps, cpu / steps

    def record(self, steps: int) -> None:
        wall, cpu = self.run(steps)
        self.wall.append(wall)
        self.cpu.append(cpu)


def time_variants(args) -> list[Timed]:
    shape = (FEATURES,)

    def tower(t):
        return dense_tower(t, args.width, args.depth)

    x, y = batch(shape, args.batch)
    specs = [(f"plain {args.batch}", None, False)]
    specs += [(f"cached {n}", n, True) for n in args.slices]
    specs += [(f"in-step {n}, no cache", n, False) for n in args.slices]
    return [Timed(name, build(shape, tower, n, c), x, y) for name, n, c in specs]


def measure_time(args) -> None:
    print(
        f"Time: two towers of {args.depth} x Dense({args.width}, relu) on "
        f"{FEATURES} features, {EMBEDDING}-d outputs, in-batch softmax, Adam; "
        f"batch N={args.batch}; {args.rounds} interleaved round(s) of "
        f"{args.steps} step(s)."
    )
    runners = time_variants(args)
    for runner in runners:  # the first calls after building the others
        runner.run(args.steps)
    for r in range(args.rounds):
        shift = r % len(runners)
        for runner in runners[shift:] + runners[:shift]:
            runner.record(args.steps)
    plain = runners[0]
    print()
    print(
        "| variant | ms/step (median) | vs plain N (wall) | range (wall) "
        "| vs plain N (CPU) |"
    )
    print("|---|---|---|---|---|")
    for runner in runners:
        wall = [a / b for a, b in zip(runner.wall, plain.wall)]
        cpu = [a / b for a, b in zip(runner.cpu, plain.cpu)]
        print(
            f"| {runner.name} | {1000 * statistics.median(runner.wall):.1f} | "
            f"{statistics.median(wall):.3f} | {min(wall):.2f}-{max(wall):.2f} | "
            f"{statistics.median(cpu):.3f} |"
        )
    updates = {int(r.model.optimizer.iterations) for r in runners}
    assert len(updates) == 1, updates  # one update per step, every variant
    print()
    print("target: cached <= 1.5 x plain N (the extra forward pass is the floor)")


# ------------------------------------------------------------------ memory
def peak_of_update(model: keras.Model, x, y) -> int:
    """Peak bytes above the baseline during one train_on_batch."""
    tf.config.experimental.reset_memory_stats(DEVICE)
    baseline = tf.config.experimental.get_memory_info(DEVICE)["current"]
    model.train_on_batch(x, y)
    return int(tf.config.experimental.get_memory_info(DEVICE)["peak"]) - baseline


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def memory_peaks(args) -> dict[str, list[int]]:
    """Each variant's peak bytes of one update, per round (interleaved)."""
    shape = (args.tokens, FEATURES)

    def tower(t):
        return token_tower(t, args.token_width)

    n = args.micro
    variants = {f"plain {n}": (build(shape, tower, None, False), batch(shape, n))}
    for k in args.ratios:
        big = batch(shape, k * n)
        variants[f"plain {k * n}"] = (build(shape, tower, None, False), big)
        variants[f"cached {k * n}"] = (build(shape, tower, n, True), big)
        variants[f"in-step {k * n}"] = (build(shape, tower, n, False), big)
    for model, (x, y) in variants.values():
        model.train_on_batch(x, y)  # trace and build
    peaks: dict[str, list[int]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (model, (x, y)) in variants.items():
            peaks[name].append(peak_of_update(model, x, y))
    params = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    peaks["parameter bytes"] = [4 * params]
    return peaks


def measure_memory(args) -> int:
    try:
        tf.config.experimental.reset_memory_stats(DEVICE)
        tf.config.experimental.get_memory_info(DEVICE)
    except (ValueError, RuntimeError, tf.errors.OpError) as error:
        print(f"no allocator statistics for {DEVICE}: {error}")
        return 1
    peaks = memory_peaks(args)
    median = {name: statistics.median(p) for name, p in peaks.items()}
    n, params = args.micro, median.pop("parameter bytes")
    print(
        f"Memory: token towers ({args.tokens} x {FEATURES} inputs, 2 x "
        f"Dense({args.token_width}) per token, mean pooling, {EMBEDDING}-d "
        f"outputs; {mib(params)} MiB of float32 parameters), in-batch softmax, "
        f"Adam; slices of n={n}; peak of one update, median of {args.rounds} "
        f"interleaved round(s); inter-op threads: {args.inter_op or 'default'}."
    )
    print()
    print(
        "| N | N/n | cached MiB | (a) plain n + N outputs MiB | cached / (a) "
        "| cached - (a), in parameter sizes | (b) plain N MiB | cached / (b) "
        "| in-step n, no cache, MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for k in args.ratios:
        cached = median[f"cached {k * n}"]
        small = median[f"plain {n}"] + k * n * 2 * EMBEDDING * 4
        whole = median[f"plain {k * n}"]
        print(
            f"| {k * n} | {k} | {mib(cached)} | {mib(small)} | "
            f"{cached / small:.3f} | {(cached - small) / params:.2f} | "
            f"{mib(whole)} | {cached / whole:.3f} | "
            f"{mib(median[f'in-step {k * n}'])} |"
        )
    print()
    print(f"plain n={n} alone: {mib(median[f'plain {n}'])} MiB")
    print("target: cached <= 1.15 x (a)")
    del peaks["parameter bytes"]
    print(f"all rounds (MiB): { {k: [mib(p) for p in v] for k, v in peaks.items()} }")
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("time", "memory", "both"), default="both")
    parser.add_argument("--batch", type=int, default=256, help="time: N")
    parser.add_argument("--slices", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--width", type=int, default=512, help="time: Dense units")
    parser.add_argument("--depth", type=int, default=3, help="time: Dense layers")
    parser.add_argument("--steps", type=int, default=5, help="time: steps a round")
    parser.add_argument("--micro", type=int, default=8, help="memory: n")
    parser.add_argument("--ratios", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--tokens", type=int, default=64, help="memory: positions")
    parser.add_argument("--token-width", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--inter-op",
        type=int,
        default=0,
        help="memory: TensorFlow's inter-op threads (0: its default); with 1 "
        "the executor runs one op at a time, so no two passes overlap",
    )
    parser.add_argument("--quick", action="store_true", help="small, fast run")
    parser.add_argument(MEMORY_CHILD, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.slices, args.width, args.depth = 32, [8], 32, 2
        args.steps, args.rounds, args.micro, args.ratios = 1, 1, 4, [4, 8]
        args.tokens, args.token_width = 4, 16
    sizes = [args.batch, *args.slices, args.width, args.depth, args.steps]
    sizes += [args.micro, *args.ratios, args.tokens, args.token_width, args.rounds]
    if min(sizes) < 1:
        parser.error("all sizes must be >= 1")
    return args


def run_memory_child(argv: list[str]) -> int:
    """This script again, for the memory part only, in a child process whose
    TensorFlow starts with the BFC allocator: the default CPU allocator (with
    oneDNN) keeps statistics only for allocations of 256 KiB or more; the
    BFC allocator counts every tensor."""
    rest = [a for a in argv if a not in ("--part", "time", "memory", "both")]
    command = [sys.executable, __file__, *rest, "--part", "memory", MEMORY_CHILD]
    env = {**os.environ, "TF_CPU_ALLOCATOR_USE_BFC": "1"}
    return subprocess.run(command, env=env, check=False).returncode


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.memory_child:
        tf.config.threading.set_inter_op_parallelism_threads(args.inter_op)
        if os.environ.get("TF_CPU_ALLOCATOR_USE_BFC") != "1":
            print("the memory part needs TF_CPU_ALLOCATOR_USE_BFC=1 at start-up")
            return 1
        return measure_memory(args)
    if args.part in ("time", "both"):
        measure_time(args)
    if args.part in ("memory", "both"):
        print(flush=True)
        return run_memory_child(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
