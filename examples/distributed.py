"""Gradient accumulation with MultiWorkerMirroredStrategy, on one machine.

Started without ``--worker``, the script launches two copies of itself as
workers on 127.0.0.1 (free ports picked at run time, every wait bounded,
children killed on exit). Each worker trains a ``GradientAccumulateModel``
on the digits data (scikit-learn's bundled copy) with a per-replica
micro-batch of 8 and ``accum_steps=4``: a global batch of
8 x 2 replicas x 4 = 64. Worker 0 then trains plain Keras on one device with
``batch_size=64`` from the same initial weights and prints the max weight
difference (float32 round-off, ~1e-7).

On real machines, run the same script with ``--worker`` on every host and
TF_CONFIG set there (see docs/distributed.md).

    python examples/distributed.py           # a few epochs, ~1 min
    python examples/distributed.py --quick   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

WORKERS = 2
MICRO = 8  # per-replica micro-batch
K = 4  # accumulation steps
TOLERANCE = 1e-4  # float32 round-off is ~1e-7


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="one short epoch")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds to wait for the workers"
    )
    parser.add_argument(
        "--worker",
        action="store_true",
        help="run as one worker; TF_CONFIG must be set (multi-machine use)",
    )
    return parser.parse_args(argv)


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def launch(args) -> int:
    """Starts the workers on loopback and waits for them (bounded)."""
    ports = free_ports(WORKERS)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    repo = Path(__file__).resolve().parents[1]
    procs = []
    try:
        for index in range(WORKERS):
            env = {
                **os.environ,
                "TF_CONFIG": json.dumps(
                    {"cluster": cluster, "task": {"type": "worker", "index": index}}
                ),
                "PYTHONPATH": os.pathsep.join(
                    p for p in (str(repo), os.environ.get("PYTHONPATH")) if p
                ),
            }
            command = [sys.executable, str(Path(__file__).resolve()), "--worker"]
            procs.append(
                subprocess.Popen(
                    command + (["--quick"] if args.quick else []),
                    env=env,
                    # Worker 0 reports; the other one's output is kept quiet.
                    stdout=None if index == 0 else subprocess.DEVNULL,
                    stderr=None if index == 0 else subprocess.DEVNULL,
                )
            )
        deadline = time.monotonic() + args.timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"FAIL: a worker timed out after {args.timeout:.0f} s.")
                return 1
        codes = [p.returncode for p in procs]
        if any(codes):
            print(f"FAIL: the workers exited with codes {codes}.")
            return 1
        return 0  # worker 0 printed the verdict
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def train_under(strategy, model, dataset, epochs: int) -> None:
    """What ``model.fit`` runs per batch, under MWMS.

    Keras 3's ``fit`` fails under MultiWorkerMirroredStrategy for any
    strategy-scoped model (docs/distributed.md has the details), so this runs
    the model's own ``train_step`` on every replica in a ``tf.function``.
    Under MirroredStrategy plain ``model.fit`` works.
    """
    import tensorflow as tf

    with strategy.scope():
        model.optimizer.build(model.trainable_variables)

    @tf.function
    def step(batch):
        strategy.run(model.train_step, args=(batch,))

    for _ in range(epochs):
        for batch in strategy.experimental_distribute_dataset(dataset):
            step(batch)


def worker(args) -> bool:
    """Trains one worker's share; worker 0 compares and prints the verdict.
    Returns False if the accumulated weights differ from the big batch's."""
    from gradient_accumulator._quiet import quiet_tensorflow

    quiet_tensorflow()  # this script's run only: no TensorFlow start-up lines
    import keras
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits

    from gradient_accumulator import GradientAccumulateModel

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    replicas = strategy.num_replicas_in_sync
    global_micro = MICRO * replicas  # what one step of the dataset holds
    big = global_micro * K  # samples per optimizer update
    epochs = 1 if args.quick else 3

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target
    n = (len(x) // big) * big  # whole updates only, so both runs match
    if args.quick:
        n = 4 * big
    x, y = x[:n], y[:n]

    def build(cls, **kwargs):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((64,))
        h = keras.layers.Dense(64, activation="relu")(inputs)
        outputs = keras.layers.Dense(10)(h)
        model = cls(inputs=inputs, outputs=outputs, **kwargs)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3, global_clipnorm=1.0),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    with strategy.scope():
        model = build(GradientAccumulateModel, accum_steps=K)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_micro)
    start = time.perf_counter()
    train_under(strategy, model, dataset, epochs)
    seconds = time.perf_counter() - start

    task = json.loads(os.environ["TF_CONFIG"])["task"]
    if task["index"] != 0:
        return True
    reference = build(keras.Model)  # one device, the global big batch
    reference.fit(x, y, batch_size=big, epochs=epochs, shuffle=False, verbose=0)
    diff = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(model.trainable_weights, reference.trainable_weights)
    )
    print(
        f"{replicas} replicas x micro-batch {MICRO} x accum_steps {K} "
        f"= global batch {big}; {epochs} epoch(s) of {n} samples in {seconds:.1f} s"
    )
    print(f"optimizer updates: {int(model.optimizer.iterations.numpy())}")
    print(f"max |w_accum - w_bigbatch| = {diff:.3g}")
    ok = diff <= TOLERANCE
    if ok:
        print(
            f"OK: accumulation under MultiWorkerMirroredStrategy ({replicas} "
            "workers) reproduced one-device big-batch training."
        )
    else:
        print(
            f"FAIL: accumulation under MultiWorkerMirroredStrategy differs from "
            f"one-device big-batch training by more than {TOLERANCE:g}."
        )
    return ok


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.worker:
        return launch(args)
    if "TF_CONFIG" not in os.environ:
        print("--worker needs TF_CONFIG (see docs/distributed.md)", file=sys.stderr)
        return 2
    ok = worker(args)
    sys.stdout.flush()
    sys.stderr.flush()
    # TensorFlow's collective runtime can abort in its destructors at exit,
    # after everything is done; skip the teardown.
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    sys.exit(main())
