"""A two-tower retrieval model with an in-batch softmax, sliced exactly.

An in-batch softmax scores each query against every candidate of its batch:
the batch's other candidates are its negatives, so the loss couples the
batch's samples and a bigger batch is a harder, better task. Cutting the
batch into micro-batches changes the loss itself (each slice would see only
its own candidates), so neither ``accum_steps`` nor ``micro_batch_size``
alone trains as the big batch. ``GradientAccumulateModel(micro_batch_size=n,
gradient_cache=True)`` does: it runs the batch forward in slices of n without
keeping their activations, computes the loss once on the whole batch's
outputs, and back-propagates each slice again from the cached gradient of
the loss with respect to its outputs (Gao et al. 2021, "GradCache").

The script trains the same two towers three times from identical weights,
with Adam, on generated query/candidate pairs (nothing is downloaded):

* plain Keras with ``batch_size=N`` (the reference);
* ``GradientAccumulateModel(micro_batch_size=n, gradient_cache=True)`` with
  ``batch_size=N``: must equal the reference (max |dw| <= 2e-5);
* ``GradientAccumulateModel(micro_batch_size=n)`` without the cache, for
  contrast: each slice's softmax over its own n candidates.

It prints each model's recall@1 on held-out pairs (each query against all
held-out candidates), the updates and the largest weight difference to the
reference, and exits with status 1 if the cached model differs by more than
2e-5.

Run:
    python examples/gradient_cache.py           # 4 epochs, about 20 s on a CPU
    python examples/gradient_cache.py --quick   # 1 epoch: a smoke test
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
    parser.add_argument("--epochs", type=int, default=4, help="training epochs")
    parser.add_argument("--pairs", type=int, default=4096, help="training pairs")
    parser.add_argument(
        "--batch-size", type=int, default=128, help="fit's batch N: the negatives"
    )
    parser.add_argument(
        "--micro-batch-size", type=int, default=32, help="samples per slice n"
    )
    parser.add_argument("--quick", action="store_true", help="1 epoch, 512 pairs")
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help answers here, before TensorFlow loads

from gradient_accumulator._quiet import quiet_tensorflow

quiet_tensorflow()  # this script's run only: no TensorFlow start-up lines

import keras
import numpy as np
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel

TOLERANCE = 2e-5
FEATURES = 32
EMBEDDING = 16
HELD_OUT = 512


def pairs(count: int, seed: int):
    """Queries and their candidates: a fixed nonlinear map of the query, noisy."""
    mix = np.random.default_rng(0).normal(size=(FEATURES, FEATURES)) / 4
    rng = np.random.default_rng(seed)
    query = rng.normal(size=(count, FEATURES))
    candidate = np.tanh(query @ mix) + 0.3 * rng.normal(size=(count, FEATURES))
    return query.astype("float32"), candidate.astype("float32")


def towers():
    """Query and candidate towers, unit-normalised embeddings side by side."""
    query, candidate = keras.Input((FEATURES,)), keras.Input((FEATURES,))
    embedded = []
    for inputs in (query, candidate):
        h = keras.layers.Dense(64, activation="relu")(inputs)
        h = keras.layers.Dense(EMBEDDING, use_bias=False)(h)
        embedded.append(keras.layers.UnitNormalization()(h))
    return [query, candidate], keras.layers.Concatenate()(embedded)


def in_batch_softmax(y_true, y_pred, temperature=0.1):
    """Each query's own candidate among all the batch's candidates."""
    query, candidate = keras.ops.split(y_pred, 2, axis=1)
    logits = keras.ops.matmul(query, keras.ops.transpose(candidate)) / temperature
    labels = keras.ops.arange(keras.ops.shape(query)[0])
    return keras.losses.sparse_categorical_crossentropy(
        labels, logits, from_logits=True
    )


def train(model: keras.Model, data, batch_size: int, epochs: int) -> keras.Model:
    query, candidate = data
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss=in_batch_softmax)
    dummy = np.zeros((len(query), 1), "float32")  # the loss reads no targets
    model.fit(
        [query, candidate],
        dummy,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=False,
        verbose=0,
    )
    return model


def recall_at_1(model: keras.Model, query, candidate) -> float:
    """How often a held-out query's own candidate scores highest of all."""
    embedded = model.predict([query, candidate], batch_size=256, verbose=0)
    scores = embedded[:, :EMBEDDING] @ embedded[:, EMBEDDING:].T
    return float(np.mean(np.argmax(scores, axis=1) == np.arange(len(query))))


def max_diff(a: keras.Model, b) -> float:
    other = b if isinstance(b, list) else [w.numpy() for w in b.trainable_weights]
    return max(
        float(np.max(np.abs(x.numpy() - y)))
        for x, y in zip(a.trainable_weights, other, strict=True)
    )


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.epochs, args.pairs = 1, 512
    tf.config.experimental.enable_op_determinism()
    data, held_out = pairs(args.pairs, 1), pairs(HELD_OUT, 2)
    n, big = args.micro_batch_size, args.batch_size

    models = {}
    for name, settings in (
        ("plain Keras", None),
        ("gradient_cache", {"micro_batch_size": n, "gradient_cache": True}),
        ("in-step, no cache", {"micro_batch_size": n}),
    ):
        keras.utils.set_random_seed(0)
        inputs, outputs = towers()
        if settings is None:
            models[name] = keras.Model(inputs, outputs)
        else:
            models[name] = GradientAccumulateModel(
                inputs=inputs, outputs=outputs, **settings
            )
    initial = [w.numpy() for w in models["plain Keras"].trainable_weights]
    for model in models.values():
        train(model, data, big, args.epochs)

    plain = models["plain Keras"]
    updates = -(-args.pairs // big) * args.epochs
    print(
        f"{args.pairs} query/candidate pairs, batch_size={big} (in-batch "
        f"negatives), micro_batch_size={n}, {args.epochs} epoch(s), Adam."
    )
    for name, model in models.items():
        print(
            f"{name}: recall@1 {recall_at_1(model, *held_out):.3f} over "
            f"{HELD_OUT} held-out candidates, updates "
            f"{int(model.optimizer.iterations)}"
        )
    cached = max_diff(models["gradient_cache"], plain)
    sliced = max_diff(models["in-step, no cache"], plain)
    print(f"max |w_cached - w_bigbatch| = {cached:.3e} (tolerance {TOLERANCE:g})")
    print(f"max |w_instep - w_bigbatch| = {sliced:.3e} (without the cache)")
    if max_diff(plain, initial) <= 100 * TOLERANCE:
        print("FAIL: training did not move the weights.")
        return 1
    if not cached <= TOLERANCE:
        print("FAIL: gradient_cache differs from the big batch.")
        return 1
    if int(models["gradient_cache"].optimizer.iterations) != updates:
        print("FAIL: not one update per fit step.")
        return 1
    print(
        "OK: gradient_cache reproduced the big batch's in-batch softmax "
        f"({sliced / max(cached, 1e-12):.0f}x closer than slicing without it)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
