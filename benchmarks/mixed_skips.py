"""Updates applied under ``mixed_float16``: Keras' big batch vs the model wrapper.

What it measures
    MobileNetV2 (``alpha=0.35``, 32x32x3 inputs, ``weights=None``, 10
    classes) on scikit-learn's ``load_digits`` images (8x8, scaled to [0, 1],
    each pixel repeated into a 4x4 block and copied into 3 channels: nothing
    is downloaded), ``--samples`` of them in order, SGD(0.005, momentum 0.9),
    ``keras.optimizers.LossScaleOptimizer(initial_scale=--initial-scale)``,
    ``keras.utils.set_random_seed`` and deterministic ops, so every run
    starts from the same weights. Runs:

    * ``keras-f32``: plain Keras in float32 on batches of ``micro * accum``
      (the reference of the distances "to keras-f32");
    * ``keras-f16``: the same under ``mixed_float16``;
    * ``wrapper-f32`` / ``wrapper-f16``: ``GradientAccumulateModel`` with
      ``accum_steps`` micro-batches of ``--micro-batch`` and every
      BatchNormalization swapped by ``replace_batchnorm_layers``. Its float32
      run shows how far micro-batch normalisation statistics alone take it
      from the big batch, whatever the precision;
    * ``ghost-f32`` / ``ghost-f16``: plain Keras on the big batch again, with
      every BatchNormalization normalising each ``--micro-batch`` of the
      batch with that slice's own statistics ("ghost" batch normalisation,
      defined here): the function the wrapper trains, in one backward pass.
      It shows how far float16 moves that function from its float32 run
      without any accumulation.

    For each: updates applied (``optimizer.iterations``) of those possible,
    the cycles skipped, the loss scale at the end, and the L2 and largest
    absolute distance of the trainable weights to ``keras-f32``.

    ``--probe`` adds, for the wrapper under ``mixed_float16``, which
    micro-batches' scaled float16 gradients were not finite (the model is
    re-run eagerly with its micro-batch gradients observed), and the largest
    scaled gradient entry of each cycle's big batch at the same weights.

Run:
    python benchmarks/mixed_skips.py            # about two minutes on 2 cores
    python benchmarks/mixed_skips.py --probe    # plus the per-micro-batch view
    python benchmarks/mixed_skips.py --quick    # one cycle, no graph rewrites
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--accum-steps", type=int, default=4)
    parser.add_argument("--initial-scale", type=float, default=2.0**10)
    parser.add_argument("--lr", type=float, default=0.005)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--pixels",
        choices=["unit", "signed", "raw"],
        default="unit",
        help="digits pixels scaled to [0, 1], to [-1, 1] or raw (0..16)",
    )
    parser.add_argument(
        "--upsample",
        choices=["repeat", "bilinear"],
        default="repeat",
        help="8x8 -> 32x32 by repeating pixels or tf.image.resize",
    )
    parser.add_argument(
        "--runs",
        default="keras-f32,keras-f16,wrapper-f32,wrapper-f16,ghost-f32,ghost-f16",
        help="comma-separated runs (without keras-f32, the columns of the "
        "distance to it show -)",
    )
    parser.add_argument(
        "--probe", action="store_true", help="which micro-batches overflow"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one cycle, without Grappler's graph rewrites (a smoke test's run)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.samples = args.micro_batch * args.accum_steps
    return args


if __name__ == "__main__":
    ARGS = parse_args()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

from gradient_accumulator import (  # noqa: E402
    GradientAccumulateModel,
    replace_batchnorm_layers,
)

F16_MAX = 65504.0


class GhostBatchNormalization(keras.layers.BatchNormalization):
    """In training, Keras' own layer applied to each of ``chunks`` equal
    slices of the batch in turn, so each is normalised with its own
    statistics, as the wrapper's micro-batches are; otherwise Keras' layer.
    (Its moving statistics then follow the slices, not the big batch: only
    the trainable weights are compared.)"""

    chunks = 4

    def call(self, inputs, training=None, mask=None):
        if not training:
            return super().call(inputs, training=False)
        outputs = []
        for part in tf.split(inputs, self.chunks, axis=0):
            outputs.append(super().call(part, training=True))
        return tf.concat(outputs, axis=0)


def ghost(base: keras.Model, chunks: int) -> keras.Model:
    """``base`` with every BatchNormalization a GhostBatchNormalization of
    ``chunks`` slices, and the same weights."""

    def clone(layer):
        if isinstance(layer, keras.layers.BatchNormalization):
            copy = GhostBatchNormalization.from_config(layer.get_config())
            copy.chunks = chunks
            return copy
        return layer.__class__.from_config(layer.get_config())

    model = keras.models.clone_model(base, clone_function=clone)
    model.set_weights(base.get_weights())
    return model


def load_data(samples: int, pixels: str = "unit", upsample: str = "repeat"):
    digits = load_digits()
    x = digits.images[:samples].astype("float32")
    if pixels == "unit":
        x = x / 16.0
    elif pixels == "signed":
        x = x / 8.0 - 1.0
    if upsample == "repeat":
        x = np.repeat(np.repeat(x, 4, axis=1), 4, axis=2)[..., None]
    else:
        x = tf.image.resize(x[..., None], (32, 32)).numpy()
    x = np.repeat(x, 3, axis=-1)
    return x, digits.target[:samples].astype("int32")


def mobilenet() -> keras.Model:
    return keras.applications.MobileNetV2(
        alpha=0.35, input_shape=(32, 32, 3), weights=None, classes=10
    )


def build(kind: str, policy: str, args) -> keras.Model:
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(args.seed)
    base = mobilenet()
    if kind == "keras":
        model = base
    elif kind == "ghost":
        model = ghost(base, args.accum_steps)
    else:
        model = replace_batchnorm_layers(
            GradientAccumulateModel(
                accum_steps=args.accum_steps, inputs=base.inputs, outputs=base.outputs
            )
        )
    optimizer = keras.optimizers.SGD(args.lr, momentum=0.9)
    if policy == "mixed_float16":
        optimizer = keras.optimizers.LossScaleOptimizer(
            optimizer, initial_scale=args.initial_scale
        )
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    # Built before fit (for every run alike): Keras otherwise builds it inside
    # the first trace, and tf.function then traces the whole step again.
    model.optimizer.build(model.trainable_variables)
    return model


class CycleLog(keras.callbacks.Callback):
    """Iterations and scale after each cycle's last step."""

    def __init__(self, steps_per_cycle: int):
        super().__init__()
        self.steps_per_cycle = steps_per_cycle
        self.iterations: list[int] = []
        self.scales: list[float] = []

    def on_train_batch_end(self, batch, logs=None):
        if (batch + 1) % self.steps_per_cycle == 0:
            optimizer = self.model.optimizer
            self.iterations.append(int(optimizer.iterations))
            scale = getattr(optimizer, "dynamic_scale", None)
            self.scales.append(float(scale) if scale is not None else float("nan"))


def train(kind: str, policy: str, data, args) -> tuple[keras.Model, CycleLog]:
    model = build(kind, policy, args)
    x, y = data
    batch = args.micro_batch * (1 if kind == "wrapper" else args.accum_steps)
    log = CycleLog(args.accum_steps if kind == "wrapper" else 1)
    model.fit(x, y, batch_size=batch, shuffle=False, verbose=0, callbacks=[log])
    return model, log


def skipped(log: CycleLog) -> list[int]:
    done = [0, *log.iterations]
    return [i for i in range(len(log.iterations)) if done[i + 1] == done[i]]


def distance(model: keras.Model, reference: keras.Model) -> tuple[float, float]:
    ours = [np.asarray(v, "float64") for v in model.trainable_weights]
    ref = [np.asarray(v, "float64") for v in reference.trainable_weights]
    assert [a.shape for a in ours] == [b.shape for b in ref]
    diff = np.concatenate([(a - b).ravel() for a, b in zip(ours, ref)])
    return float(np.sqrt(np.sum(diff**2))), float(np.max(np.abs(diff)))


def probe(data, args) -> None:
    """Re-runs the float16 wrapper eagerly, observing each micro-batch's
    scaled float16 gradients, and measures each cycle's big batch (one
    scaled float16 backward pass of its mean loss at the wrapper's weights
    when the cycle starts) at the same scale."""
    model = build("wrapper", "mixed_float16", args)
    model.compile(
        optimizer=model.optimizer,
        loss="sparse_categorical_crossentropy",
        run_eagerly=True,
    )
    big = build("keras", "mixed_float16", args)
    x, y = data
    cycle = args.micro_batch * args.accum_steps
    rows = []
    original = model._micro_batch_pass

    def observed(*a, **kw):
        micro = original(*a, **kw)
        largest = max(float(tf.reduce_max(tf.abs(g))) for g in micro.grads)
        finite = all(bool(tf.reduce_all(tf.math.is_finite(g))) for g in micro.grads)
        rows.append((largest, finite))
        return micro

    # This instance only, in this diagnostic run.
    model._micro_batch_pass = observed
    loss = keras.losses.SparseCategoricalCrossentropy()
    for start in range(0, len(x), cycle):
        scale = (
            float(model.optimizer.dynamic_scale)
            if model.optimizer.built
            else args.initial_scale
        )
        # The big batch at the wrapper's weights (same variable order);
        # its BatchNormalization is Keras' own, in training mode.
        for ours, theirs in zip(model.weights, big.weights):
            if (
                ours.shape == theirs.shape
                and ours.path.split("/")[-1] == (theirs.path.split("/")[-1])
            ):
                theirs.assign(ours)
        for ours, theirs in zip(model.trainable_weights, big.trainable_weights):
            theirs.assign(ours)
        xb, yb = x[start : start + cycle], y[start : start + cycle]
        with tf.GradientTape() as tape:
            scaled = loss(yb, big(xb, training=True)) * scale
        grads = tape.gradient(scaled, big.trainable_weights)
        big_largest = max(float(tf.reduce_max(tf.abs(g))) for g in grads)
        big_finite = all(bool(tf.reduce_all(tf.math.is_finite(g))) for g in grads)
        first = len(rows)
        model.fit(xb, yb, batch_size=args.micro_batch, shuffle=False, verbose=0)
        print(
            f"cycle {start // cycle}: scale {scale:g}; big batch largest scaled "
            f"gradient {big_largest:.6g} ({'finite' if big_finite else 'NOT finite'})"
        )
        for k, (largest, finite) in enumerate(rows[first:]):
            state = "finite" if finite else "NOT finite"
            print(
                f"  micro-batch {k}: largest scaled gradient of its backward pass "
                f"(after the 1/{args.accum_steps} share) {largest:.6g} ({state})"
            )
        print(f"  -> iterations {int(model.optimizer.iterations)}")


def main(args) -> None:
    tf.config.experimental.enable_op_determinism()
    if args.quick:
        # A smoke test's run, one step per graph: Grappler's rewrites of the
        # four MobileNetV2 graphs would be a fifth of its CPU time (measured:
        # 140 -> 110 s). Every run alike; the figures move by rounding only.
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    data = load_data(args.samples, args.pixels, args.upsample)
    cycles = args.samples // (args.micro_batch * args.accum_steps)
    runs = {}
    wanted = set(args.runs.split(","))
    for name, kind, policy in [
        ("keras-f32", "keras", "float32"),
        ("keras-f16", "keras", "mixed_float16"),
        ("wrapper-f32", "wrapper", "float32"),
        ("wrapper-f16", "wrapper", "mixed_float16"),
        ("ghost-f32", "ghost", "float32"),
        ("ghost-f16", "ghost", "mixed_float16"),
    ]:
        if name in wanted:
            runs[name] = train(kind, policy, data, args)
    keras.mixed_precision.set_global_policy("float32")
    reference = runs.get("keras-f32", (None,))[0]
    print(
        f"MobileNetV2 alpha 0.35, {args.samples} digits, micro-batch "
        f"{args.micro_batch} x {args.accum_steps}, initial scale "
        f"{args.initial_scale:g}, TF {tf.__version__}, Keras {keras.__version__}"
    )
    print()
    print(
        "| run | updates | skipped cycles | final scale | L2 to keras-f32 "
        "| max to keras-f32 | L2 to own f32 | max to own f32 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, (model, log) in runs.items():
        l2, largest = distance(model, reference) if reference else (np.nan, np.nan)
        # The same runner in float32: what precision alone moved (for the
        # wrapper, micro-batch normalisation statistics are in both).
        own = runs.get(name.replace("f16", "f32"), (None,))[0]
        l2_own, largest_own = distance(model, own) if own else (np.nan, np.nan)
        scale = log.scales[-1] if log.scales else float("nan")
        scale_text = "-" if np.isnan(scale) else f"{scale:g}"
        print(
            f"| {name} | {int(model.optimizer.iterations)} of {cycles} "
            f"| {skipped(log) or '-'} | {scale_text} | {l2:.4e} | {largest:.4e} "
            f"| {l2_own:.4e} | {largest_own:.4e} |"
        )
    if {"wrapper-f32", "ghost-f32"} <= set(runs):
        # One function, accumulated or in one pass: float32 rounding only,
        # which this network's first updates amplify.
        l2, largest = distance(runs["wrapper-f32"][0], runs["ghost-f32"][0])
        print()
        print(f"wrapper-f32 to ghost-f32: L2 {l2:.4e}, max {largest:.4e}")
    if args.probe:
        print()
        probe(data, args)
        keras.mixed_precision.set_global_policy("float32")


if __name__ == "__main__":
    main(ARGS)
