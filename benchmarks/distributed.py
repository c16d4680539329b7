"""One all-reduce per update vs one per micro-step, 2 workers on loopback.

What it measures
    Two ``MultiWorkerMirroredStrategy`` workers (processes on 127.0.0.1, CPU,
    one replica each) train an MLP of about 10M parameters
    (1024-2048-2048-1024-1024-10) with Adam and ``accum_steps=8``, two ways:

    * ``ours``: ``GradientAccumulateModel(accum_steps=8)``; replica-local
      sums, one all-reduce per update;
    * ``naive``: a train step that all-reduces every micro-batch's gradients
      through the replica context (``ctx.all_reduce``) before adding them to
      a buffer, then applies Adam on the 8th; what a wrapper that
      accumulates already-reduced gradients does.

    Both run the same per-replica micro-batch (16) through
    ``strategy.run`` in a ``tf.function`` (Keras 3.15's ``fit`` fails under
    MWMS, see docs/distributed.md). Reported: the median over rounds of ms per
    update (8 micro-steps), the median of the per-round ratio naive / ours,
    and the all-reduces per update of each, counted as ``CollectiveReduceV2``
    ops in the traced step functions (times how often each runs per update),
    not assumed.

Method
    Both variants are built and traced first, then ``--rounds`` rounds each
    time ``--updates`` updates of both variants, interleaved, order rotated
    every round. Worker 0 prints; the script never asserts on timings.

Run
    python benchmarks/distributed.py             # about 2-4 min on 2 cores
    python benchmarks/distributed.py --quick     # smoke test, small model
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

REPO = Path(__file__).resolve().parents[1]
K = 8
MICRO = 16
WORKERS = 2
COLLECTIVES = ("CollectiveReduce", "CollectiveReduceV2", "CollectiveReduceV3")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small, fast run")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--updates", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ports", default="", help=argparse.SUPPRESS)
    parser.add_argument("--done", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 5
    if args.updates is None:
        args.updates = 1 if args.quick else 3
    return args


# ------------------------------------------------------------------ parent
def free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def launch(args) -> int:
    ports = ",".join(map(str, free_ports(WORKERS)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p
        ),
    }
    command = [sys.executable, str(Path(__file__).resolve())]
    command += ["--rounds", str(args.rounds), "--updates", str(args.updates)]
    command += ["--ports", ports] + (["--quick"] if args.quick else [])
    done = tempfile.TemporaryDirectory()
    command += ["--done", str(Path(done.name, "worker-0"))]
    procs = []
    try:
        for i in range(WORKERS):
            procs.append(
                subprocess.Popen(
                    [*command, "--worker", str(i)],
                    cwd=REPO,
                    env=env,
                    # Worker 0 reports; an unread pipe could fill and
                    # stall worker 1 (and with it every collective).
                    stdout=subprocess.DEVNULL if i else None,
                    stderr=subprocess.DEVNULL if i else None,
                )
            )
        deadline = time.monotonic() + args.timeout
        codes = []
        for proc in procs:
            remaining = max(1.0, deadline - time.monotonic())
            try:
                proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                print(f"worker timed out after {args.timeout:.0f} s", file=sys.stderr)
                return 1
            codes.append(proc.returncode)
        return 0 if all(c == 0 for c in codes) else 1
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        done.cleanup()


# ------------------------------------------------------------------ worker
def count_collectives(concrete) -> dict:
    """Collective all-reduces in a traced function: in total, and in the
    branches of a conditional whose branches differ in them."""
    graph_def = concrete.graph.as_graph_def()
    library = {f.signature.name: f for f in graph_def.library.function}
    memo = {}

    def calls(node):
        names = [a.func.name for a in node.attr.values() if a.HasField("func")]
        names += [f.name for a in node.attr.values() for f in a.list.func]
        return [n for n in names if n in library]

    def total(nodes):
        return sum(
            (n.op in COLLECTIVES) + sum(fn_total(c) for c in calls(n)) for n in nodes
        )

    def fn_total(name):
        if name not in memo:
            memo[name] = 0
            memo[name] = total(library[name].node_def)
        return memo[name]

    branches = []

    def search(nodes):
        for node in nodes:
            if node.op in ("If", "StatelessIf"):
                then = fn_total(node.attr["then_branch"].func.name)
                other = fn_total(node.attr["else_branch"].func.name)
                if then != other:
                    branches.append((then, other))
                    continue
            for name in calls(node):
                search(library[name].node_def)

    search(graph_def.node)
    grand = total(graph_def.node)
    taken = sum(t for t, _ in branches)
    skipped = sum(e for _, e in branches)
    return {"always": grand - taken - skipped, "update": taken, "other": skipped}


def worker(args) -> None:
    ports = args.ports.split(",")
    os.environ["TF_CONFIG"] = json.dumps(
        {
            "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
            "task": {"type": "worker", "index": args.worker},
        }
    )
    import keras
    import numpy as np
    import tensorflow as tf

    from gradient_accumulator import GradientAccumulateModel
    from gradient_accumulator.keras3.inner_optimizers import already_reduced

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    widths = (64, 64) if args.quick else (2048, 2048, 1024, 1024)
    dim = 64 if args.quick else 1024
    rng = np.random.default_rng(0)
    x = rng.normal(size=(MICRO * WORKERS * K, dim)).astype("float32")
    y = rng.integers(0, 10, size=len(x))
    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .batch(MICRO * WORKERS)
        .cache()
        .repeat()
    )
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def layers():
        inputs = keras.Input((dim,))
        h = inputs
        for width in widths:
            h = keras.layers.Dense(width, activation="relu")(h)
        return inputs, keras.layers.Dense(10)(h)

    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs, outputs = layers()
        ours = GradientAccumulateModel(accum_steps=K, inputs=inputs, outputs=outputs)
        ours.compile(optimizer=keras.optimizers.Adam(1e-4), loss=loss_fn)
        ours.optimizer.build(ours.trainable_variables)

        keras.utils.set_random_seed(0)
        naive = keras.Model(*layers())
        naive_opt = keras.optimizers.Adam(1e-4)
        naive_opt.build(naive.trainable_variables)
        buffers = [
            keras.Variable(
                tf.zeros(v.shape),
                trainable=False,
                synchronization="on_read",
                aggregation="mean",
            )
            for v in naive.trainable_variables
        ]
    params = sum(int(np.prod(v.shape)) for v in naive.trainable_variables)

    @tf.function
    def ours_step(batch):
        strategy.run(ours.train_step, args=(batch,))

    def naive_replica(batch, update: bool):
        xb, yb = batch
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, naive(xb, training=True))
        grads = tape.gradient(loss, naive.trainable_variables)
        context = tf.distribute.get_replica_context()
        # The naive part: every micro-step's gradients cross the network.
        grads = context.all_reduce(tf.distribute.ReduceOp.SUM, grads)
        for buffer, grad in zip(buffers, grads):
            buffer.value.assign_add(grad)
        if update:
            scale = 1.0 / (K * strategy.num_replicas_in_sync)
            with already_reduced(naive_opt):
                naive_opt.apply(
                    [b.value * scale for b in buffers], naive.trainable_variables
                )
            for buffer in buffers:
                buffer.value.assign(tf.zeros_like(buffer.value))

    @tf.function
    def naive_accumulate(batch):
        strategy.run(naive_replica, args=(batch, False))

    @tf.function
    def naive_update(batch):
        strategy.run(naive_replica, args=(batch, True))

    iterator = iter(strategy.experimental_distribute_dataset(dataset))

    def run_ours(updates):
        for _ in range(updates * K):
            ours_step(next(iterator))

    def run_naive(updates):
        for _ in range(updates):
            for _ in range(K - 1):
                naive_accumulate(next(iterator))
            naive_update(next(iterator))

    # Trace and warm up.
    run_ours(1)
    run_naive(1)
    batch = next(iterator)
    counts = count_collectives(ours_step.get_concrete_function(batch))
    per_update = {
        # ours: the conditional's update branch runs once per update.
        "ours": K * counts["always"] + (K - 1) * counts["other"] + counts["update"],
        "naive": (K - 1)
        * sum(count_collectives(naive_accumulate.get_concrete_function(batch)).values())
        + sum(count_collectives(naive_update.get_concrete_function(batch)).values()),
    }

    variants = {"ours": run_ours, "naive": run_naive}
    times = {name: [] for name in variants}
    order = list(variants)
    for r in range(args.rounds):
        for name in order[r % 2 :] + order[: r % 2]:
            start = time.perf_counter()
            variants[name](args.updates)
            times[name].append((time.perf_counter() - start) * 1e3 / args.updates)
    if args.worker == 0:
        report(args, params, times, per_update)
        Path(args.done).touch()
    else:
        # The last all-reduce can return here while worker 0 still fetches
        # its share from this process, which must not exit before that
        # ("Socket closed" on worker 0): wait until worker 0 is through.
        deadline = time.monotonic() + 120.0
        while not Path(args.done).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    sys.stdout.flush()
    sys.stderr.flush()
    # Exit here: destroying the iterator over the repeated dataset (and
    # TensorFlow's collective runtime at interpreter exit) can block or abort
    # after all work is done.
    os._exit(0)


def report(args, params, times, per_update) -> None:
    ratios = [n / o for n, o in zip(times["naive"], times["ours"])]
    print(
        f"{WORKERS} MWMS workers on 127.0.0.1 (CPU), MLP with {params:,} "
        f"parameters, Adam, accum_steps={K}, per-replica micro-batch {MICRO}, "
        f"{args.rounds} rounds x {args.updates} updates"
    )
    print()
    print("| variant | ms/update (median) | all-reduces/update | ratio vs ours |")
    print("|---|---|---|---|")
    ours_ms = statistics.median(times["ours"])
    print(f"| ours | {ours_ms:.1f} | {per_update['ours']} | 1.000 |")
    print(
        f"| naive | {statistics.median(times['naive']):.1f} | "
        f"{per_update['naive']} | {statistics.median(ratios):.3f} |"
    )
    print()
    print(
        f"naive / ours per round: min {min(ratios):.3f}, max {max(ratios):.3f}",
        flush=True,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is None:
        return launch(args)
    worker(args)  # exits the process
    return 0


if __name__ == "__main__":
    sys.exit(main())
