"""Batch normalisation with gradient accumulation, on scikit-learn's digits.

Trains one small CNN with two batch-normalisation layers (the first one
normalises the raw pixels, so its statistics do not depend on the weights)
three ways, from identical initial weights and with the same sample order:

* ``big-batch``: plain Keras, ``keras.layers.BatchNormalization``,
  ``batch_size = micro_batch * accum_steps`` (the reference);
* ``accum-bn``: ``GradientAccumulateModel(accum_steps)`` with
  ``AccumBatchNormalization``, ``batch_size = micro_batch``;
* ``keras-bn``: ``GradientAccumulateModel(accum_steps)`` with Keras' layer,
  which updates its moving statistics on every micro-batch.

It prints, for the first layer, the largest difference between each
run's moving statistics and the reference's, and every run's test accuracy.
``accum-bn`` matches the reference's moving statistics to float32 rounding;
the script exits with status 1 if the difference exceeds 1e-5. (The deeper
layer's statistics, and the weights, differ slightly between ``accum-bn`` and
``big-batch``, because training normalises with micro-batch statistics: see
docs/batch-norm.md.) With ``--one-class-micro-batches`` every micro-batch holds
a single digit: the moving statistics are still exact, while how much
normalising each micro-batch with its own statistics costs depends on the
model (on this one, little; measured accuracies are in docs/batch-norm.md).

Run:
    python examples/batch_norm.py          # about a minute on 2 CPU cores
    python examples/batch_norm.py --quick  # 1 epoch of 8 cycles: 15-17 s

Last, it swaps the big-batch run's layers into AccumBatchNormalization with
``replace_batchnorm_layers`` (the workflow for a pretrained model), checks the
predictions are unchanged in inference and fine-tunes with accumulation.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ["CUDA_VISIBLE_DEVICES"] = "-1"

# Run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="1 epoch of 8 cycles: a smoke test"
    )
    parser.add_argument(
        "--micro-batch", type=int, default=8, help="samples per micro-batch"
    )
    parser.add_argument(
        "--accum-steps", type=int, default=4, help="micro-batches per update"
    )
    parser.add_argument(
        "--epochs", type=int, default=None, help="if not given: 1 with --quick, else 5"
    )
    parser.add_argument(
        "--one-class-micro-batches",
        action="store_true",
        help="every micro-batch holds a single digit (non-i.i.d. micro-batches)",
    )
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help answers here, before TensorFlow loads

from gradient_accumulator._quiet import quiet_tensorflow

quiet_tensorflow()  # this script's run only: no TensorFlow start-up lines

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

from gradient_accumulator import (
    AccumBatchNormalization,
    GradientAccumulateModel,
    replace_batchnorm_layers,
)

TOLERANCE = 1e-5
SEED = 0


def load(micro_batch: int, accum_steps: int, quick: bool, one_class: bool):
    """Train/test split, training set cut to whole cycles."""
    digits = load_digits()
    x = (digits.images[..., None] / 16.0).astype("float32")
    y = digits.target
    rng = np.random.default_rng(SEED)
    order = rng.permutation(len(x))
    x, y = x[order], y[order]
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]
    micro_batches = []
    for label in range(10) if one_class else []:
        chosen = np.flatnonzero(y_train == label)
        usable = len(chosen) // micro_batch * micro_batch
        micro_batches += np.split(chosen[:usable], usable // micro_batch)
    if not one_class:
        usable = len(x_train) // micro_batch * micro_batch
        micro_batches = np.split(np.arange(usable), usable // micro_batch)
    rng.shuffle(micro_batches)
    cycles = len(micro_batches) // accum_steps
    if quick:
        cycles = min(cycles, 8)
    index = np.concatenate(micro_batches[: cycles * accum_steps])
    return x_train[index], y_train[index], x_test, y_test


def build(norm, model_cls=keras.Model, **kwargs) -> keras.Model:
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input((8, 8, 1))
    h = norm(name="input_norm")(inputs)
    h = keras.layers.Conv2D(16, 3, padding="same")(h)
    h = norm(name="conv_norm")(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.Flatten()(h)
    outputs = keras.layers.Dense(10)(h)
    return model_cls(inputs=inputs, outputs=outputs, **kwargs)


def stats(model: keras.Model, name: str) -> np.ndarray:
    layer = model.get_layer(name)
    return np.concatenate(
        [np.asarray(layer.moving_mean), np.asarray(layer.moving_variance)]
    )


def main() -> int:
    args = build_parser().parse_args()
    epochs = args.epochs or (1 if args.quick else 5)
    tf.config.experimental.enable_op_determinism()
    big = args.micro_batch * args.accum_steps
    x, y, x_test, y_test = load(
        args.micro_batch, args.accum_steps, args.quick, args.one_class_micro_batches
    )

    def momentum(cls):
        # A short memory, so that the last cycles dominate what is compared.
        return lambda name: cls(momentum=0.9, name=name)

    runs = {
        "big-batch": (build(momentum(keras.layers.BatchNormalization)), big),
        "accum-bn": (
            build(
                momentum(AccumBatchNormalization),
                GradientAccumulateModel,
                accum_steps=args.accum_steps,
            ),
            args.micro_batch,
        ),
        "keras-bn": (
            build(
                momentum(keras.layers.BatchNormalization),
                GradientAccumulateModel,
                accum_steps=args.accum_steps,
            ),
            args.micro_batch,
        ),
    }
    for model, batch_size in runs.values():
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)

    reference = stats(runs["big-batch"][0], "input_norm")
    print(
        f"{len(x)} training samples, micro-batch {args.micro_batch}, "
        f"accum_steps {args.accum_steps}, {epochs} epoch(s)"
    )
    print(
        "| run | max abs diff of input_norm moving stats vs big-batch | test accuracy |"
    )
    print("|---|---|---|")
    diffs = {}
    for name, (model, _) in runs.items():
        diffs[name] = float(np.max(np.abs(stats(model, "input_norm") - reference)))
        _, accuracy = model.evaluate(x_test, y_test, verbose=0)
        print(f"| {name} | {diffs[name]:.3g} | {accuracy:.3f} |")
    print(f"max |moving_accum - moving_bigbatch| = {diffs['accum-bn']:.3g}")
    swap = swap_pretrained(runs["big-batch"][0], x, y, x_test, y_test, args)
    if diffs["accum-bn"] > TOLERANCE or swap > TOLERANCE:
        print(
            f"FAIL: AccumBatchNormalization's moving statistics or the swapped "
            f"model's predictions differ by more than {TOLERANCE:g}."
        )
        return 1
    print(
        "OK: AccumBatchNormalization's moving statistics matched the big batch's "
        "(Keras' layer under accumulation did not), and replace_batchnorm_layers "
        "kept the predictions."
    )
    return 0


def swap_pretrained(pretrained: keras.Model, x, y, x_test, y_test, args) -> float:
    """The fine-tuning workflow: a model trained elsewhere with Keras'
    BatchNormalization (here: the big-batch run, standing in for pretrained
    weights) gets every BN layer swapped for AccumBatchNormalization, keeping
    gamma, beta and the moving statistics, and is fine-tuned with
    accumulation. Returns the largest prediction difference in inference
    right after the swap."""
    swapped = replace_batchnorm_layers(pretrained, accum_steps=args.accum_steps)
    before = pretrained.predict(x_test, verbose=0)
    after = swapped.predict(x_test, verbose=0)
    diff = float(np.max(np.abs(before - after)))
    swaps = [
        f"{new.name} ({type(old).__name__} -> {type(new).__name__})"
        for old, new in zip(pretrained.layers, swapped.layers)
        if type(old) is not type(new)
    ]
    print(f"swapped layers: {', '.join(swaps) or 'none'}")
    print(f"max |prediction after swap - before| = {diff:.3g}")
    model = GradientAccumulateModel(
        accum_steps=args.accum_steps, inputs=swapped.inputs, outputs=swapped.outputs
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model.fit(x, y, batch_size=args.micro_batch, epochs=1, verbose=0)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    print(f"fine-tuned 1 epoch with accumulation: test accuracy {accuracy:.3f}")
    return diff


if __name__ == "__main__":
    sys.exit(main())
