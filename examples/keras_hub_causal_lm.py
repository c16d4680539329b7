"""Fine-tuning a keras-hub causal LM with accumulate(): token-exact on padded text.

A ``keras_hub.models.GPT2CausalLM`` built offline from a small configuration
(random weights, a byte-pair tokenizer of one-letter words: nothing is
downloaded) is trained on generated sentences of very different lengths,
through its own preprocessor, which pads them and passes the padding mask to
the loss as sample weights.

The loss is a per-token mean, ``SparseCategoricalCrossentropy(from_logits=True,
reduction="mean_with_sample_weight")``: the big batch's loss divides by its
number of real tokens. (keras-hub's default loss keeps Keras' default
reduction, ``"sum_over_batch_size"``, which divides by batch x sequence
length, padding included: with it the number of real tokens does not matter.)
Averaging micro-batch means weights a token of a short micro-batch more than
a token of a long one; ``accumulate`` weights each micro-batch by its real
tokens, so its update is the big batch's.

Three runs from identical weights, AdamW with a decaying learning rate, the
same sentences in the same order:

* ``big-batch``: plain keras-hub, ``batch_size = micro_batch * accum_steps``;
* ``ours``: ``gradient_accumulator.accumulate(lm, accum_steps)``,
  ``batch_size = micro_batch``;
* ``averaged``: ``GradientAccumulateOptimizer(AdamW, accum_steps)`` (each
  micro-batch weighted equally), ``batch_size = micro_batch``.

It prints each run's max weight difference from the big batch and a sample
from ``generate()`` (the model is still a ``GPT2CausalLM``), and exits with
status 1 unless ours is within 1e-4 and averaging is visibly further off.

Run (needs keras-hub, the ``hub`` extra: ``pip install ".[tensorflow,hub]"``
in a checkout of this repository):
    python examples/keras_hub_causal_lm.py          # 55 s on 2 CPU cores
    python examples/keras_hub_causal_lm.py --quick  # a smoke test, 30 s
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
        epilog='Needs keras-hub, the "hub" extra: pip install ".[tensorflow,hub]" '
        "in a checkout of this repository.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="a smoke test")
    parser.add_argument(
        "--micro-batch", type=int, default=4, help="sentences per micro-batch"
    )
    parser.add_argument(
        "--accum-steps", type=int, default=4, help="micro-batches per update"
    )
    parser.add_argument("--epochs", type=int, default=2, help="training epochs")
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help answers here, before TensorFlow loads

from gradient_accumulator._quiet import quiet_tensorflow

quiet_tensorflow()  # this script's run only: no TensorFlow start-up lines

import keras
import numpy as np
import tensorflow as tf

import gradient_accumulator as ga

TOLERANCE = 1e-4
LENGTH = 16  # tokens per padded sequence
LETTERS = "abcdefghij"


def causal_lm():
    """A GPT2CausalLM of two small transformer blocks, with its tokenizer and
    preprocessor, from a fixed seed (every call gives the same weights)."""
    import keras_hub

    keras.utils.set_random_seed(0)
    vocabulary = {"<|endoftext|>": 0, "Ġ": 1}
    for letter in LETTERS:
        vocabulary[letter] = len(vocabulary)
        vocabulary[f"Ġ{letter}"] = len(vocabulary)
    merges = [f"Ġ {letter}" for letter in LETTERS]
    tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=merges)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=tokenizer.vocabulary_size(),
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=LENGTH + 4,
        dropout=0.0,
    )
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(
        tokenizer=tokenizer, sequence_length=LENGTH
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=preprocessor)


def sentences(n: int, micro_batch: int, seed: int = 0) -> list[str]:
    """Counting sentences ("c d e f"): micro-batches alternate between short
    (1-3 words) and long (10-14 words) ones, so their real token counts
    differ by several times."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        low, high = (1, 4) if (i // micro_batch) % 2 == 0 else (10, 15)
        start = rng.integers(len(LETTERS))
        words = [
            LETTERS[(start + k) % len(LETTERS)] for k in range(rng.integers(low, high))
        ]
        out.append(" ".join(words))
    return out


def adamw():
    schedule = keras.optimizers.schedules.ExponentialDecay(1e-2, 2, 0.8)
    return keras.optimizers.AdamW(schedule, weight_decay=0.01)


def train(model, texts, batch_size, epochs, optimizer=None):
    model.compile(
        optimizer=optimizer or adamw(),
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"
        ),
    )
    data = tf.data.Dataset.from_tensor_slices(texts).batch(batch_size)
    model.fit(data, epochs=epochs, shuffle=False, verbose=0)
    return model


def main() -> int:
    args = build_parser().parse_args()
    try:
        import keras_hub
    except ImportError:
        print(
            'FAIL: keras-hub is not installed: pip install "gradient-accumulator[hub]"'
        )
        return 1
    tf.config.experimental.enable_op_determinism()
    big = args.micro_batch * args.accum_steps
    texts = sentences(2 * big if args.quick else 8 * big, args.micro_batch)
    epochs = 1 if args.quick else args.epochs

    reference = train(causal_lm(), texts, big, epochs)
    ours = ga.accumulate(causal_lm(), accum_steps=args.accum_steps)
    train(ours, texts, args.micro_batch, epochs)
    averaged = train(
        causal_lm(),
        texts,
        args.micro_batch,
        epochs,
        ga.GradientAccumulateOptimizer(adamw(), args.accum_steps),
    )

    def diff(model):
        return max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(model.trainable_weights, reference.trainable_weights)
        )

    _, _, mask = reference.preprocessor(tf.constant(texts))
    per_micro = tf.reduce_sum(
        tf.reshape(tf.cast(mask, "int32"), (-1, args.micro_batch * LENGTH)), axis=1
    )
    fewest, most = int(tf.reduce_min(per_micro)), int(tf.reduce_max(per_micro))
    print(
        f"{len(texts)} sentences padded to {LENGTH} tokens, real tokens per "
        f"micro-batch {fewest}..{most}, "
        f"micro-batch {args.micro_batch}, accum_steps {args.accum_steps}, "
        f"{epochs} epoch(s), {int(reference.optimizer.iterations)} updates"
    )
    print("| run | max abs weight diff vs big-batch |")
    print("|---|---|")
    print(f"| ours: accumulate(GPT2CausalLM), token-weighted | {diff(ours):.3g} |")
    print(f"| averaged: GradientAccumulateOptimizer | {diff(averaged):.3g} |")
    print(f"max |w_accum - w_bigbatch| = {diff(ours):.3g}")
    print(f"max |w_averaged - w_bigbatch| = {diff(averaged):.3g}")
    assert isinstance(ours, keras_hub.models.GPT2CausalLM)
    print(f"ours.generate('c d') -> {ours.generate('c d', max_length=10)!r}")
    if diff(ours) > TOLERANCE:
        print(
            f"FAIL: accumulate() differs from the big batch by {diff(ours):.3g}, "
            f"more than {TOLERANCE:g}."
        )
        return 1
    if diff(averaged) <= 10 * diff(ours):
        print(
            "FAIL: equal-weight averaging was not visibly off on this data "
            f"({diff(averaged):.3g}); the example shows nothing."
        )
        return 1
    print(
        f"OK: accumulate(GPT2CausalLM) matched the big batch on padded text "
        f"({diff(ours):.1e}); averaging micro-batch means did not "
        f"({diff(averaged):.1e})."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
