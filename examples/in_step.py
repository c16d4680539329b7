"""In-step micro-batching on scikit-learn's digits: the big batch, sliced.

``GradientAccumulateModel(micro_batch_size=16)`` with ``fit(batch_size=64)``
keeps the input pipeline, the progress bar, callbacks and learning-rate
schedules at the big batch (one fit step = one update) while each step runs
the batch as slices of 16, so only one slice's activations are alive at a
time. Batches of 64 over 1437 samples leave a short last batch of 29 each
epoch (16 + 13): it is weighted exactly too.

The script trains the same small CNN twice from identical weights, with Adam
and a decaying learning rate, on ``sklearn.datasets.load_digits`` (bundled:
nothing is downloaded): plain Keras with ``batch_size=64``, and the in-step
model with ``batch_size=64, micro_batch_size=16``. It prints both test
accuracies, the number of updates and the largest weight difference, and
exits with status 1 if the weights differ by more than 1e-4.

Run:
    python examples/in_step.py           # 10 epochs, well under a minute
    python examples/in_step.py --quick   # 1 epoch: a smoke test
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")

# Run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=10, help="training epochs")
    parser.add_argument(
        "--batch-size", type=int, default=64, help="fit's batch: one update each"
    )
    parser.add_argument(
        "--micro-batch-size", type=int, default=16, help="samples per slice"
    )
    parser.add_argument("--quick", action="store_true", help="1 epoch")
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help answers here, before TensorFlow loads

from gradient_accumulator._quiet import quiet_tensorflow

quiet_tensorflow()  # this script's run only: no TensorFlow start-up lines

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

from gradient_accumulator import GradientAccumulateModel

TOLERANCE = 1e-4


def cnn_layers():
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(h)
    h = keras.layers.Flatten()(h)
    return inputs, keras.layers.Dense(10)(h)


def train(model: keras.Model, x, y, batch_size: int, epochs: int) -> keras.Model:
    schedule = keras.optimizers.schedules.ExponentialDecay(3e-3, 20, 0.8)
    model.compile(
        optimizer=keras.optimizers.Adam(schedule),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.epochs = 1
    tf.config.experimental.enable_op_determinism()

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    n_train = int(0.8 * len(x))
    x_train, y_train, x_test, y_test = (
        x[:n_train],
        y[:n_train],
        x[n_train:],
        y[n_train:],
    )

    keras.utils.set_random_seed(0)
    plain = keras.Model(*cnn_layers())
    keras.utils.set_random_seed(0)
    inputs, outputs = cnn_layers()
    sliced = GradientAccumulateModel(
        micro_batch_size=args.micro_batch_size, inputs=inputs, outputs=outputs
    )
    initial = [w.numpy() for w in plain.trainable_weights]

    train(plain, x_train, y_train, args.batch_size, args.epochs)
    train(sliced, x_train, y_train, args.batch_size, args.epochs)

    diff = max(
        float(np.max(np.abs(a.numpy() - b.numpy())))
        for a, b in zip(plain.trainable_weights, sliced.trainable_weights, strict=True)
    )
    moved = max(
        float(np.max(np.abs(a.numpy() - b)))
        for a, b in zip(plain.trainable_weights, initial, strict=True)
    )
    steps = -(-n_train // args.batch_size) * args.epochs
    print(
        f"digits: {n_train} train samples, batch_size={args.batch_size}, "
        f"micro_batch_size={args.micro_batch_size}, {args.epochs} epoch(s), "
        f"{steps} fit steps."
    )
    for name, model in (("plain big batch", plain), ("in-step slices", sliced)):
        _, accuracy = model.evaluate(x_test, y_test, verbose=0)
        print(
            f"{name}: test accuracy {accuracy:.4f}, "
            f"updates {int(model.optimizer.iterations)}"
        )
    print(f"max |w_instep - w_bigbatch| = {diff:.3e} (tolerance {TOLERANCE:g})")
    if moved <= TOLERANCE:
        print("FAIL: training did not move the weights.")
        return 1
    if not diff <= TOLERANCE:
        print("FAIL: in-step micro-batching differs from the big batch.")
        return 1
    if int(sliced.optimizer.iterations) != steps:
        print("FAIL: not one update per fit step.")
        return 1
    print("OK: in-step micro-batching reproduced the big-batch training.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
