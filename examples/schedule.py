"""Batch-size warm-up with an accumulation schedule, on scikit-learn's digits.

``AccumulationScheduler({0: 1, 1: 2, 2: 4})`` trains epoch 0 with one
micro-batch of 8 per update, epoch 1 with 2 (batch 16) and later epochs with 4
(batch 32), holding 8 samples in memory throughout. 1420 training samples
leave a partial cycle at the end of every epoch from epoch 1 on (1420 = 44 x
32 + 12); with ``partial_cycle="flush"`` it is applied at the epoch end, as
plain Keras applies its short last batch.

The reference is plain Keras trained epoch by epoch with ``batch_size`` 8, 16,
then 32, from the same weights and sample order. The script prints the
updates and the largest weight difference and exits with status 1 if it
exceeds 1e-4. ``sklearn.datasets.load_digits`` is bundled: nothing downloads.

Run:
    python examples/schedule.py          # 6 epochs, well under a minute
    python examples/schedule.py --quick  # 3 epochs on fewer samples
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
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke test: 3 epochs, 300 samples"
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

from gradient_accumulator import AccumulationScheduler, GradientAccumulateModel

TOLERANCE = 1e-4
MICRO = 8
SCHEDULE = {0: 1, 1: 2, 2: 4}


def build(model_cls=keras.Model, **kwargs) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    model = model_cls(inputs=inputs, outputs=keras.layers.Dense(10)(hidden), **kwargs)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def accum_steps_at(epoch: int) -> int:
    return [k for e, k in sorted(SCHEDULE.items()) if e <= epoch][-1]


def main() -> int:
    args = build_parser().parse_args()
    tf.config.experimental.enable_op_determinism()
    digits = load_digits()
    n = 300 if args.quick else 1420
    x = (digits.data[:n] / 16.0).astype("float32")
    y = digits.target[:n]
    epochs = 3 if args.quick else 6

    reference = build()
    for epoch in range(epochs):
        reference.fit(
            x, y, batch_size=MICRO * accum_steps_at(epoch), shuffle=False, verbose=0
        )

    model = build(GradientAccumulateModel, partial_cycle="flush")
    model.fit(
        x,
        y,
        batch_size=MICRO,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[AccumulationScheduler(SCHEDULE)],
    )
    diff = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(model.trainable_weights, reference.trainable_weights)
    )
    print(f"{n} samples, micro-batch {MICRO}, schedule {SCHEDULE}, {epochs} epochs")
    print(
        f"updates: accumulated {int(model.optimizer.iterations)}, "
        f"big batch {int(reference.optimizer.iterations)}; "
        f"accum_steps now {model.accum_steps}"
    )
    print(f"max |w_accum - w_bigbatch| = {diff:.3g}")
    if diff > TOLERANCE or model.optimizer.iterations != reference.optimizer.iterations:
        print(
            f"FAIL: the accumulation schedule did not reproduce big-batch training "
            f"with the same batch-size schedule (tolerance {TOLERANCE:g})."
        )
        return 1
    print(
        "OK: the accumulation schedule reproduced big-batch training with the "
        "same batch-size schedule, holding one micro-batch in memory."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
