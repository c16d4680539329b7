"""Token-exact normalisation on padded sequences (generated data).

A per-token language-model-style loss over padded, variable-length sequences
is a mean over the *unmasked tokens of the batch*. Averaging micro-batch means
(what a naive accumulator, or Keras' own ``gradient_accumulation_steps``,
does) weights a token of a short micro-batch more than a token of a long one:
the "token-count" bug. ``GradientAccumulateModel`` weights each micro-batch by
its number of unmasked tokens, so its update is the big batch's.

Three runs from identical weights, SGD with momentum, same sample order:

* ``big-batch``: plain Keras, ``batch_size = micro_batch * accum_steps``;
* ``ours``: ``GradientAccumulateModel(accum_steps)``, ``batch_size = micro_batch``;
* ``keras-builtin``: ``SGD(gradient_accumulation_steps=accum_steps)``.

(SGD, not Adam: Keras' Adam treats repeated rows of an Embedding's sparse
gradient differently from their sum, so even plain Keras is not the big-batch
Adam step there; see the FAQ.) It prints each run's max weight difference from
the big batch and exits with status 1 if ours exceeds 1e-4.

Run:
    python examples/masked_sequence.py          # well under a minute
    python examples/masked_sequence.py --quick  # a smoke test
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
    parser.add_argument("--quick", action="store_true", help="a smoke test")
    parser.add_argument(
        "--micro-batch", type=int, default=8, help="sequences per micro-batch"
    )
    parser.add_argument(
        "--accum-steps", type=int, default=4, help="micro-batches per update"
    )
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help answers here, before TensorFlow loads

from gradient_accumulator._quiet import quiet_tensorflow

quiet_tensorflow()  # this script's run only: no TensorFlow start-up lines

import keras
import numpy as np
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel

TOLERANCE = 1e-4
VOCAB, LENGTH = 20, 12


def sequences(n: int, seed: int = 0):
    """Token sequences of 2..LENGTH tokens, padded with 0; the target is the
    next token. Lengths vary a lot between micro-batches."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, LENGTH + 1, size=n)
    tokens = rng.integers(1, VOCAB, size=(n, LENGTH + 1))
    for row, length in enumerate(lengths):
        tokens[row, length + 1 :] = 0
    return tokens[:, :-1], tokens[:, 1:]


def build(model_cls=keras.Model, optimizer=None, **kwargs) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((LENGTH,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 16, mask_zero=True)(inputs)
    h = keras.layers.GRU(16, return_sequences=True)(h)
    outputs = keras.layers.Dense(VOCAB)(h)
    model = model_cls(inputs=inputs, outputs=outputs, **kwargs)
    model.compile(
        optimizer=optimizer or keras.optimizers.SGD(0.1, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def main() -> int:
    args = build_parser().parse_args()
    tf.config.experimental.enable_op_determinism()
    big = args.micro_batch * args.accum_steps
    x, y = sequences(4 * big if args.quick else 32 * big)
    epochs = 1 if args.quick else 3
    fit = {"epochs": epochs, "shuffle": False, "verbose": 0}

    reference = build()
    reference.fit(x, y, batch_size=big, **fit)
    ours = build(GradientAccumulateModel, accum_steps=args.accum_steps)
    ours.fit(x, y, batch_size=args.micro_batch, **fit)
    builtin = build(
        optimizer=keras.optimizers.SGD(
            0.1, momentum=0.9, gradient_accumulation_steps=args.accum_steps
        )
    )
    builtin.fit(x, y, batch_size=args.micro_batch, **fit)

    def diff(model):
        return max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(model.trainable_weights, reference.trainable_weights)
        )

    tokens = int(np.count_nonzero(x))
    print(
        f"{len(x)} sequences, {tokens} unmasked tokens, micro-batch "
        f"{args.micro_batch}, accum_steps {args.accum_steps}, {epochs} epoch(s)"
    )
    print("| run | max abs weight diff vs big-batch |")
    print("|---|---|")
    print(f"| ours (token-weighted) | {diff(ours):.3g} |")
    print(f"| keras-builtin (mean of micro-batch means) | {diff(builtin):.3g} |")
    print(f"max |w_accum - w_bigbatch| = {diff(ours):.3g}")
    if diff(ours) > TOLERANCE:
        print(
            f"FAIL: token-weighted accumulation differs from the big batch by more "
            f"than {TOLERANCE:g} on padded sequences."
        )
        return 1
    print(
        f"OK: token-weighted accumulation matched the big batch on padded "
        f"sequences ({diff(ours):.1e}); averaging micro-batch means did not "
        f"({diff(builtin):.1e})."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
