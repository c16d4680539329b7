"""The ``gradient-accumulator`` command.

``gradient-accumulator verify`` runs :func:`gradient_accumulator.verify` on the
demo's small CNN (``examples/digits_demo.py``) and scikit-learn's bundled
digits (1797 8x8 images; nothing is downloaded), prints the per-layer table and
exits 0 if accumulation reproduced big-batch training, 1 if not.

``--help`` and ``--version`` answer without importing TensorFlow: this module
imports it only inside the command that trains, and the package's
``__init__`` loads its public names on first use.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

MODELS = {
    "cnn": "the demo's CNN: Conv2D-MaxPooling2D-Conv2D-Flatten-Dense",
    "cnn-batchnorm": "the same with BatchNormalization after the first Conv2D",
    "cnn-dropout": "the same with Dropout(0.25) before the last Dense",
}
OPTIMIZERS = ("adam", "adamw", "sgd", "rmsprop")
_D = "default: %(default)s"


def build_parser() -> argparse.ArgumentParser:
    from gradient_accumulator._version import __version__

    parser = argparse.ArgumentParser(
        prog="gradient-accumulator",
        description="Exact gradient accumulation for TensorFlow / Keras 3.",
    )
    parser.add_argument("--version", action="version", version=__version__)
    commands = parser.add_subparsers(dest="command", required=True)
    verify = commands.add_parser(
        "verify",
        help="check accumulation against big-batch training on the digits demo",
        description=(
            "Trains the demo model on scikit-learn's digits with the big batch "
            "(micro-batch x accum-steps) and with GradientAccumulateModel from the "
            "same weights, prints the largest weight difference per layer and "
            "exits 0 if every one is within the tolerance, 1 if not."
        ),
    )
    verify.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="cnn",
        help="; ".join(f"{k}: {v}" for k, v in MODELS.items()) + " (default: cnn)",
    )
    option = verify.add_argument
    option("--micro-batch", type=_positive, default=16, metavar="N", help=_D)
    option("--accum-steps", type=_positive, default=4, metavar="K", help=_D)
    option("--steps", type=_positive, default=10, help="optimizer updates; " + _D)
    option("--optimizer", choices=OPTIMIZERS, default="adam", help=_D)
    option("--learning-rate", type=_positive_float, default=1e-3, help=_D)
    option(
        "--tolerance",
        type=_positive_float,
        default=1e-4,
        help="largest absolute weight difference that passes; " + _D,
    )
    option("--seed", type=int, default=0, help="initial weights and data order; " + _D)
    return parser


def _parsed(text: str, kind: type, noun: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None


def _positive(text: str) -> int:
    value = _parsed(text, int, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = _parsed(text, float, "a number")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def digits_model(variant: str = "cnn"):
    """The demo's CNN for 8x8x1 digits, optionally with a layer that breaks
    equivalence."""
    import keras

    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    if variant == "cnn-batchnorm":
        h = keras.layers.BatchNormalization()(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(h)
    h = keras.layers.Flatten()(h)
    if variant == "cnn-dropout":
        h = keras.layers.Dropout(0.25)(h)
    return keras.Model(inputs, keras.layers.Dense(10)(h))


def digits_data(seed: int = 0):
    """Digits scaled to [0, 1], shuffled with ``seed``: ``(x, y)``."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int32")
    order = np.random.default_rng(seed).permutation(len(x))
    return x[order], y[order]


def run_verify(args: argparse.Namespace) -> int:
    try:
        import sklearn  # noqa: F401
    except ImportError:
        print(
            "gradient-accumulator verify: needs scikit-learn for the digits data: "
            'pip install "gradient-accumulator[examples]"',
            file=sys.stderr,
        )
        return 2
    from gradient_accumulator._quiet import quiet_tensorflow

    quiet_tensorflow()  # this command's own run: no TensorFlow start-up lines
    import keras
    import tensorflow as tf

    from gradient_accumulator.keras3.verify import verify

    # Same ops, same order: the remaining differences are the reordered sums.
    tf.config.experimental.enable_op_determinism()
    x, y = digits_data(args.seed)
    needed = args.micro_batch * args.accum_steps * args.steps
    if needed > len(x):
        print(
            f"gradient-accumulator verify: micro-batch x accum-steps x steps = "
            f"{needed} is more than the {len(x)} digits samples",
            file=sys.stderr,
        )
        return 2
    optimizer = type(keras.optimizers.get(args.optimizer))(
        learning_rate=args.learning_rate
    )
    report = verify(
        lambda: digits_model(args.model),
        x,
        y,
        micro_batch_size=args.micro_batch,
        accum_steps=args.accum_steps,
        steps=args.steps,
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        tolerance=args.tolerance,
        seed=args.seed,
    )
    print(f"digits, model {args.model}, {args.optimizer} lr {args.learning_rate:g}")
    print(report)
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "verify":
        return run_verify(args)
    raise AssertionError(args.command)  # argparse requires a known command


if __name__ == "__main__":
    sys.exit(main())
