"""Gradient accumulation under mixed precision, on scikit-learn's digits.

Trains one small MLP on ``sklearn.datasets.load_digits`` (bundled with
scikit-learn: nothing is downloaded), from identical initial weights, with
Adam and the same sample order:

* plain Keras with the big batch in float32 (the reference) and under each
  mixed policy (how far low precision alone moves the weights);
* ``GradientAccumulateModel`` and ``GradientAccumulateOptimizer`` with the
  micro-batch under ``mixed_float16`` (where ``compile`` adds Keras'
  ``LossScaleOptimizer`` to the model wrapper's optimizer, and the optimizer
  wrapper holds one, compiled with ``auto_scale_loss=False``) and
  ``mixed_bfloat16`` (no loss scale).

Then it feeds one accumulation cycle whose third micro-batch holds a pixel of
1e5 (Inf in float16) and shows the whole cycle skipped: weights bit-identical,
``iterations`` unchanged, the loss scale halved, training going on after.
(An Inf from the data stays Inf at every loss scale; a micro-batch whose
gradients merely overflow at the current scale is differentiated again at a
smaller one by the model wrappers, and its cycle applied: see
docs/mixed-precision.md.)

It exits with status 1 if an accumulated run ends further from the float32
big batch than ``SLACK`` times Keras' own mixed big batch does, or if the
overflow is not handled as described: it is a check as well as a demo.

Run:
    python examples/mixed_precision.py          # 10 epochs, 25 s on 2 CPU cores
    python examples/mixed_precision.py --quick  # 1 epoch, 13-24 s
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ["CUDA_VISIBLE_DEVICES"] = "-1"  # float16 kernels run on CPU too

# Run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=10, help="training epochs")
    parser.add_argument(
        "--micro-batch", type=int, default=16, help="samples per micro-batch"
    )
    parser.add_argument(
        "--accum-steps", type=int, default=4, help="micro-batches per update"
    )
    parser.add_argument("--quick", action="store_true", help="1 epoch: a smoke test")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs = 1
    if min(args.epochs, args.micro_batch, args.accum_steps) < 1:
        parser.error("--epochs, --micro-batch and --accum-steps must be >= 1")
    return args


if __name__ == "__main__":
    parse_args()  # --help and bad options answer here, before TensorFlow loads

from gradient_accumulator._quiet import quiet_tensorflow

quiet_tensorflow()  # this script's run only: no TensorFlow start-up lines

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

from gradient_accumulator import GradientAccumulateModel, GradientAccumulateOptimizer

SEED = 0
SLACK = 2.0  # accumulated vs Keras' mixed big batch, distance to float32
POLICIES = ("mixed_float16", "mixed_bfloat16")


def load_data(big_batch: int):
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")  # (1797, 64)
    y = digits.target.astype("int32")
    order = np.random.default_rng(SEED).permutation(len(x))
    x, y = x[order], y[order]
    n_train = int(len(x) * 0.8) // big_batch * big_batch  # whole big batches
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def layers():
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    return inputs, keras.layers.Dense(10)(hidden)


def build(policy: str, kind: str, accum_steps: int) -> keras.Model:
    """A compiled model under ``policy``; every call starts from the same
    weights (variables are float32 under every policy)."""
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(SEED)
    inputs, outputs = layers()
    optimizer = keras.optimizers.Adam(1e-3)
    compile_kwargs = {}
    if kind == "model wrapper":
        model = GradientAccumulateModel(accum_steps, inputs=inputs, outputs=outputs)
    else:
        model = keras.Model(inputs, outputs)
    if kind == "optimizer wrapper":
        if policy == "mixed_float16":
            # The loss scale inside the wrapper, which then checks, skips and
            # grows it per cycle; compile must not add one around it.
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
            compile_kwargs["auto_scale_loss"] = False
        optimizer = GradientAccumulateOptimizer(optimizer, accum_steps)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **compile_kwargs,
    )
    return model


def weights(model: keras.Model) -> list[np.ndarray]:
    return [w.numpy().copy() for w in model.trainable_weights]


def max_abs_diff(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def loss_scale(model: keras.Model) -> str:
    optimizer = model.optimizer
    if isinstance(optimizer, GradientAccumulateOptimizer):
        optimizer = optimizer.inner_optimizer
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return f"{float(optimizer.dynamic_scale):g}"
    return "none"


def compare(args, train, test) -> bool:
    micro, k = args.micro_batch, args.accum_steps

    def fit(policy, kind, batch_size):
        model = build(policy, kind, k)
        model.fit(*train, batch_size=batch_size, epochs=args.epochs, shuffle=False,
                  verbose=0)  # fmt: skip
        accuracy = model.evaluate(*test, batch_size=256, verbose=0)[1]
        return model, accuracy

    reference, ref_accuracy = fit("float32", "plain", micro * k)
    ok = True
    print("| policy | run | test accuracy | max abs w - w_float32 | loss scale |")
    print("|---|---|---|---|---|")
    print(f"| float32 | big batch | {ref_accuracy:.4f} | 0 | none |")
    for policy in POLICIES:
        big, accuracy = fit(policy, "plain", micro * k)
        keras_diff = max_abs_diff(weights(big), weights(reference))
        print(f"| {policy} | big batch | {accuracy:.4f} | {keras_diff:.2e} | "
              f"{loss_scale(big)} |")  # fmt: skip
        for kind in ("model wrapper", "optimizer wrapper"):
            model, accuracy = fit(policy, kind, micro)
            diff = max_abs_diff(weights(model), weights(reference))
            print(f"| {policy} | {kind} ({micro} x {k}) | {accuracy:.4f} | "
                  f"{diff:.2e} | {loss_scale(model)} |")  # fmt: skip
            if not diff <= SLACK * keras_diff:  # also catches NaN
                print(f"FAIL: {policy} {kind} is further from float32 than "
                      f"{SLACK:g} x Keras' own {policy} big batch.")  # fmt: skip
                ok = False
    return ok


def overflow(args, train) -> bool:
    micro, k = args.micro_batch, args.accum_steps
    cycle = micro * k
    model = build("mixed_float16", "model wrapper", k)
    model.fit(*train, batch_size=micro, epochs=1, shuffle=False, verbose=0)
    before, steps, scale = (
        weights(model),
        int(model.optimizer.iterations),
        loss_scale(model),
    )

    x, y = train[0][:cycle].copy(), train[1][:cycle]
    x[2 * micro, 0] = 1e5  # Inf once cast to float16
    model.fit(x, y, batch_size=micro, epochs=1, shuffle=False, verbose=0)
    unchanged = max_abs_diff(before, weights(model)) == 0.0
    same_steps = int(model.optimizer.iterations) == steps
    halved = float(loss_scale(model)) == float(scale) / 2
    print(
        f"overflow: cycle skipped = {unchanged and same_steps} (weights "
        f"bit-identical: {unchanged}, iterations {steps} -> "
        f"{int(model.optimizer.iterations)}), loss scale {scale} -> "
        f"{loss_scale(model)}"
    )
    history = model.fit(*train, batch_size=micro, epochs=1, shuffle=False, verbose=0)
    loss = history.history["loss"][-1]
    finite = all(np.all(np.isfinite(w)) for w in weights(model))
    print(f"after it: loss {loss:.4f}, weights finite: {finite}, iterations "
          f"{int(model.optimizer.iterations)}")  # fmt: skip
    ok = unchanged and same_steps and halved and finite and np.isfinite(loss)
    if not ok:
        print("FAIL: the overflowing cycle was not skipped cleanly.")
    return ok


def main(argv=None) -> int:
    args = parse_args(argv)
    tf.config.experimental.enable_op_determinism()
    train, test = load_data(args.micro_batch * args.accum_steps)
    print(
        f"digits: {len(train[0])} train / {len(test[0])} test samples; big batch "
        f"{args.micro_batch * args.accum_steps} = micro-batch {args.micro_batch} x "
        f"accum_steps {args.accum_steps}; Adam, {args.epochs} epoch(s).\n"
    )
    ok = compare(args, train, test)
    print()
    ok = overflow(args, train) and ok
    if ok:
        print(
            "OK: under mixed_float16 and mixed_bfloat16 both wrappers stayed as "
            "close to float32 training as Keras' own big batch, and an "
            "overflowing cycle was skipped whole."
        )
    else:
        print(
            "FAIL: mixed-precision accumulation did not match Keras' big batch, "
            "or an overflowing cycle was not skipped cleanly (see above)."
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
