"""Peak memory of one optimizer update: big batch vs accumulation modes.

Three ways to train on the same effective batch (``--effective`` samples per
update) with a small CNN whose activations dominate its memory:

* ``big batch``: plain Keras, ``train_on_batch`` on the whole batch;
* ``streaming``: ``GradientAccumulateModel(accum_steps=effective/micro)``,
  the batch given as ``accum_steps`` micro-batches of ``--micro`` (one
  ``train_on_batch`` each);
* ``in-step``: ``GradientAccumulateModel(micro_batch_size=micro)``, the whole
  batch in one ``train_on_batch``, cut into slices inside the step.

For each it measures the peak bytes TensorFlow's CPU allocator held during
one update above what it held just before (``get_memory_info('CPU:0')``,
with ``TF_CPU_ALLOCATOR_USE_BFC=1`` so that every tensor is counted; peak
reset before every measurement). Weights, optimizer state, accumulation
buffers and the input batches are allocated before the measurement and are
reported apart: the peak is what training itself adds (activations,
gradients, temporaries). Variants run interleaved for ``--rounds`` rounds,
after one warm-up update each (tracing); the table shows medians and their
ratio to the big batch. The time of each update is shown for context only:
it includes ``train_on_batch``'s per-call overhead (``accum_steps`` calls for
streaming).

Run:
    python benchmarks/memory.py            # effective 256, micro 32
    python benchmarks/memory.py --quick    # small and fast: a smoke test
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["CUDA_VISIBLE_DEVICES"] = "-1"  # a CPU measurement, by design
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# The default CPU allocator (with oneDNN) keeps statistics only for
# allocations of 256 KiB or more; the BFC allocator counts every tensor.
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import keras
import numpy as np
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel

DEVICE = "CPU:0"
VARIANTS = ("big batch", "streaming", "in-step")


def cnn_layers(size: int, width: int):
    inputs = keras.Input((size, size, 3))
    h = keras.layers.Conv2D(width, 3, padding="same", activation="relu")(inputs)
    h = keras.layers.Conv2D(width, 3, padding="same", activation="relu")(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Conv2D(2 * width, 3, padding="same", activation="relu")(h)
    h = keras.layers.Conv2D(2 * width, 3, padding="same", activation="relu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return inputs, keras.layers.Dense(10)(h)


def build(variant: str, args) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs, outputs = cnn_layers(args.image, args.width)
    if variant == "big batch":
        model = keras.Model(inputs, outputs)
    elif variant == "streaming":
        k = args.effective // args.micro
        model = GradientAccumulateModel(accum_steps=k, inputs=inputs, outputs=outputs)
    else:
        model = GradientAccumulateModel(
            micro_batch_size=args.micro, inputs=inputs, outputs=outputs
        )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def batches(variant: str, x: tf.Tensor, y: tf.Tensor, micro: int):
    """The update's data as the variant's train_on_batch calls take it,
    allocated up front (outside the measurement)."""
    if variant != "streaming":
        return [(x, y)]
    n = int(x.shape[0])
    return [
        (tf.identity(x[i : i + micro]), tf.identity(y[i : i + micro]))
        for i in range(0, n, micro)
    ]


def one_update(model: keras.Model, data) -> None:
    for x, y in data:
        model.train_on_batch(x, y)


def peak_of_update(model: keras.Model, data) -> tuple[int, float]:
    """(peak bytes above the baseline, seconds) of one update."""
    tf.config.experimental.reset_memory_stats(DEVICE)
    baseline = tf.config.experimental.get_memory_info(DEVICE)["current"]
    start = time.perf_counter()
    one_update(model, data)
    seconds = time.perf_counter() - start
    peak = int(tf.config.experimental.get_memory_info(DEVICE)["peak"]) - baseline
    return peak, seconds


def state_bytes(model: keras.Model) -> int:
    """Weights, optimizer slots and accumulation buffers (all float32 here)."""
    variables = list(model.weights) + list(model.optimizer.variables)
    return sum(
        int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
        for v in variables
        if v.dtype != "string"
    )


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--effective", type=int, default=256)
    parser.add_argument("--micro", type=int, default=32)
    parser.add_argument("--image", type=int, default=32, help="image side")
    parser.add_argument("--width", type=int, default=32, help="first conv filters")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small, fast run")
    args = parser.parse_args(argv)
    if args.quick:
        args.effective, args.micro, args.image, args.width, args.rounds = (
            64,
            8,
            16,
            8,
            1,
        )
    if min(args.effective, args.micro, args.image, args.width, args.rounds) < 1:
        parser.error("all sizes must be >= 1")
    if args.effective % args.micro:
        parser.error("--effective must be a multiple of --micro (streaming mode)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        tf.config.experimental.reset_memory_stats(DEVICE)
        tf.config.experimental.get_memory_info(DEVICE)
    except (ValueError, RuntimeError, tf.errors.OpError) as error:
        print(f"no allocator statistics for {DEVICE}: {error}")
        return 1
    rng = np.random.default_rng(0)
    shape = (args.effective, args.image, args.image, 3)
    x = tf.constant(rng.normal(size=shape).astype("float32"))
    y = tf.constant(rng.integers(0, 10, size=args.effective).astype("int32"))
    k = args.effective // args.micro
    print(
        f"CNN on {args.image}x{args.image}x3 images, widths {args.width}/"
        f"{2 * args.width}; effective batch {args.effective}: big batch, "
        f"streaming {args.micro} x {k} (accum_steps={k}), in-step "
        f"micro_batch_size={args.micro}; Adam; {args.rounds} round(s)."
    )
    models, data = {}, {}
    for variant in VARIANTS:
        models[variant] = build(variant, args)
        data[variant] = batches(variant, x, y, args.micro)
        one_update(models[variant], data[variant])  # trace and build
    peaks: dict[str, list[int]] = {v: [] for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            peak, seconds = peak_of_update(models[variant], data[variant])
            peaks[variant].append(peak)
            times[variant].append(seconds)
    updates = {v: int(models[v].optimizer.iterations) for v in VARIANTS}
    assert len(set(updates.values())) == 1, updates  # one update per round each

    median = {v: statistics.median(peaks[v]) for v in VARIANTS}
    big = median["big batch"]
    print()
    print(
        "| variant | samples in memory | peak MiB (median) | ratio vs big batch "
        "| ms/update (median) |"
    )
    print("|---|---|---|---|---|")
    for variant in VARIANTS:
        held = args.effective if variant == "big batch" else args.micro
        ms = 1000 * statistics.median(times[variant])
        print(
            f"| {variant} | {held} | {mib(median[variant])} | "
            f"{median[variant] / big:.3f} | {ms:.0f} |"
        )
    print()
    input_bytes = x.shape.num_elements() * 4 + args.effective * 4
    print(
        "peak = most bytes the BFC allocator held during one update above "
        "what it held just before; not in it (allocated before): the input "
        f"batch ({mib(input_bytes)} MiB) and the persistent state (plain "
        f"{mib(state_bytes(models['big batch']))} MiB, accumulating models "
        f"{mib(state_bytes(models['in-step']))} MiB with their float32 "
        "gradient sums)."
    )
    print(f"all rounds (MiB): { {v: [mib(p) for p in peaks[v]] for v in VARIANTS} }")
    return 0


if __name__ == "__main__":
    sys.exit(main())
