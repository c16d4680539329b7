"""Big batch vs gradient accumulation on scikit-learn's digits, side by side.

Trains the same small CNN on ``sklearn.datasets.load_digits`` (8x8 images,
1797 samples, bundled with scikit-learn: nothing is downloaded) two ways,
from identical initial weights, with Adam, the same epochs and the same
sample order:

* plain Keras with the big batch, ``batch_size = micro_batch * accum_steps``;
* ``GradientAccumulateModel(accum_steps)`` with ``batch_size = micro_batch``.

It prints the test accuracy of each, the largest absolute difference between
their final weights, and the peak memory of each run, and exits with status 1
if the weights differ by more than 1e-4 (or training did not move them): it is
a check as well as a demo.

The training set is cut to a whole number of big batches: with a remainder,
the big-batch run would take a short last step each epoch while a short last
accumulation cycle carries over into the next epoch, and the two runs would
no longer be the same computation.

With ``--plot DIR`` it also writes two PNGs (needs matplotlib): the training
loss of each optimizer update of both runs, overlaid
(``DIR/digits-loss-per-update.png``), and the peak memory of both ways at
effective batch sizes of 1 to 16 micro-batches, each measured over two updates
(``DIR/digits-peak-memory.png``).

Run:
    python examples/digits_demo.py                   # defaults, 17 s on 2 CPU cores
    python examples/digits_demo.py --quick           # 1 epoch, 9-13 s
    python examples/digits_demo.py --plot docs/_static  # needs matplotlib
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ["CUDA_VISIBLE_DEVICES"] = "-1"  # a CPU measurement, by design
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# TensorFlow's default CPU allocator (with oneDNN) keeps statistics only for
# allocations of 256 KiB or more; its BFC allocator counts every tensor, which
# makes tf.config.experimental.get_memory_info("CPU:0") a true peak.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "1")

# Run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=20, help="training epochs")
    parser.add_argument(
        "--micro-batch", type=int, default=16, help="samples per micro-batch"
    )
    parser.add_argument(
        "--accum-steps", type=int, default=4, help="micro-batches per update"
    )
    parser.add_argument("--quick", action="store_true", help="1 epoch: a smoke test")
    parser.add_argument(
        "--plot",
        metavar="DIR",
        help="write loss-per-update and peak-memory PNGs into DIR (needs matplotlib)",
    )
    args = parser.parse_args(argv)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error(
                "--plot needs matplotlib: pip install matplotlib "
                '(or pip install -e ".[examples]")'
            )
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

from gradient_accumulator import GradientAccumulateModel

TOLERANCE = 1e-4
SEED = 0
DEVICE = "CPU:0"


@dataclass
class Data:
    x_train: tf.Tensor  # tensors: allocated once, before any measurement
    y_train: tf.Tensor
    x_test: np.ndarray
    y_test: np.ndarray


@dataclass
class Result:
    name: str
    model: keras.Model
    accuracy: float
    peak_bytes: int | None
    seconds: float
    update_losses: list[float]


def load_data(big_batch: int, train_fraction: float = 0.8) -> Data:
    """Digits scaled to [0, 1], shuffled once with a fixed seed; the training
    set is a whole number of big batches, the rest is the test set."""
    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]  # (1797, 8, 8, 1)
    y = digits.target.astype("int32")
    order = np.random.default_rng(SEED).permutation(len(x))
    x, y = x[order], y[order]
    n_train = int(len(x) * train_fraction) // big_batch * big_batch
    if n_train == 0:
        raise SystemExit(f"big batch {big_batch} is larger than the training set")
    return Data(
        tf.constant(x[:n_train]), tf.constant(y[:n_train]), x[n_train:], y[n_train:]
    )


def cnn_layers() -> tuple[keras.KerasTensor, keras.KerasTensor]:
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(h)
    h = keras.layers.Flatten()(h)
    return inputs, keras.layers.Dense(10)(h)


def compile_model(model: keras.Model) -> keras.Model:
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def layer_weights(model: keras.Model) -> list[np.ndarray]:
    """The model's own weights, layer by layer.

    ``model.get_weights()`` is not used: on ``GradientAccumulateModel`` it
    also holds the accumulation buffers.
    """
    return [w for layer in model.layers for w in layer.get_weights()]


def set_layer_weights(model: keras.Model, weights: list[np.ndarray]) -> None:
    """The inverse of :func:`layer_weights`."""
    remaining = list(weights)
    for layer in model.layers:
        n = len(layer.weights)
        layer.set_weights(remaining[:n])
        remaining = remaining[n:]
    assert not remaining, "weight lists of different models"


def max_abs_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


class LossPerBatch(keras.callbacks.Callback):
    """Recovers each batch's mean loss from Keras' running epoch mean.

    The logged ``loss`` is the sample-weighted mean since the start of the
    epoch, so ``mean_i * n_i - mean_{i-1} * n_{i-1}`` is batch ``i``'s summed
    loss (float32 round-off of the running mean makes this good to ~1e-5).
    """

    def __init__(self, batch_size: int):
        super().__init__()
        self.batch_size = batch_size
        self.sums: list[float] = []  # summed loss of each batch
        self._seen = 0
        self._total = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._seen, self._total = 0, 0.0

    def on_train_batch_end(self, batch, logs=None):
        self._seen += self.batch_size
        total = float(logs["loss"]) * self._seen
        self.sums.append(total - self._total)
        self._total = total

    def per_update(self, batches_per_update: int) -> list[float]:
        """Mean loss of each optimizer update's big batch."""
        size = batches_per_update * self.batch_size
        sums = np.asarray(self.sums).reshape(-1, batches_per_update).sum(axis=1)
        return list(sums / size)


def start_peak_memory() -> int | None:
    """Resets the allocator's peak; returns the bytes in use now (the
    baseline), or None if this TensorFlow build keeps no CPU statistics."""
    try:
        tf.config.experimental.reset_memory_stats(DEVICE)
        return int(tf.config.experimental.get_memory_info(DEVICE)["current"])
    except (ValueError, RuntimeError, tf.errors.OpError):
        return None


def peak_memory_since(baseline: int | None) -> int | None:
    """Peak bytes in use since :func:`start_peak_memory`, above its baseline."""
    if baseline is None:
        return None
    return int(tf.config.experimental.get_memory_info(DEVICE)["peak"]) - baseline


def train(
    name: str,
    model: keras.Model,
    data: Data,
    batch_size: int,
    batches_per_update: int,
    epochs: int,
    evaluate: bool = True,
) -> Result:
    """Fits ``model`` in order (no shuffling) and measures it."""
    # The training set is already in tensors (see main), so the dataset's copy
    # of it, the same for both runs, is part of the baseline, not the peak.
    dataset = tf.data.Dataset.from_tensor_slices((data.x_train, data.y_train))
    dataset = dataset.batch(batch_size)
    losses = LossPerBatch(batch_size)
    baseline = start_peak_memory()
    start = time.perf_counter()
    model.fit(dataset, epochs=epochs, shuffle=False, verbose=0, callbacks=[losses])
    seconds = time.perf_counter() - start
    peak = peak_memory_since(baseline)
    accuracy = float("nan")
    if evaluate:
        _, accuracy = model.evaluate(
            data.x_test, data.y_test, batch_size=256, verbose=0
        )
    return Result(
        name=name,
        model=model,
        accuracy=float(accuracy),
        peak_bytes=peak,
        seconds=seconds,
        update_losses=losses.per_update(batches_per_update),
    )


def buffer_bytes(model: keras.Model) -> int:
    """Bytes of float32 gradient sums ``GradientAccumulateModel`` keeps."""
    return sum(4 * int(np.prod(w.shape)) for w in model.trainable_weights)


def mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.2f} MiB"


def memory_sweep(
    data: Data, micro: int, factors: tuple[int, ...]
) -> list[tuple[int, int | None, int | None]]:
    """Peak memory of big-batch and accumulated training at each effective
    batch size ``micro * factor``, each over two optimizer updates on the
    same samples: ``[(effective_batch, big_peak, accumulated_peak), ...]``."""
    # Ten fresh models trace ten sets of functions, which TensorFlow reports
    # as "excessive retracing"; it is expected here.
    tf.get_logger().setLevel("ERROR")
    rows = []
    for k in factors:
        big_batch = micro * k
        n = 2 * big_batch
        if n > len(data.x_train):
            break
        subset = Data(data.x_train[:n], data.y_train[:n], data.x_test, data.y_test)
        peaks = []
        for accumulated in (False, True):
            keras.utils.set_random_seed(SEED)
            inputs, outputs = cnn_layers()
            if accumulated:
                model = GradientAccumulateModel(k, inputs=inputs, outputs=outputs)
            else:
                model = keras.Model(inputs, outputs)
            batch = micro if accumulated else big_batch
            result = train(
                "", compile_model(model), subset, batch, 1, epochs=1, evaluate=False
            )
            peaks.append(result.peak_bytes)
        rows.append((big_batch, *peaks))
    return rows


def write_plots(
    directory: str,
    big: Result,
    accum: Result,
    sweep: list[tuple[int, int | None, int | None]],
    micro: int,
    caption: str,
) -> list[Path]:
    """Writes the loss-per-update and peak-memory PNGs; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "digits-loss-per-update.png", out / "digits-peak-memory.png"]

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    updates = np.arange(1, len(big.update_losses) + 1)
    ax.plot(updates, big.update_losses, label=big.name, linewidth=4, alpha=0.4)
    ax.plot(updates, accum.update_losses, label=accum.name, linestyle="--")
    ax.set_xlabel("optimizer update")
    ax.set_ylabel("training loss of the update's batch")
    ax.set_title("digits, Adam: big batch vs gradient accumulation")
    ax.text(0.98, 0.6, caption, transform=ax.transAxes, ha="right", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    measured = [(b, p, q) for b, p, q in sweep if p is not None and q is not None]
    if measured:
        sizes = [b for b, _, _ in measured]
        ax.plot(sizes, [p / 2**20 for _, p, _ in measured], "o-", label="big batch")
        ax.plot(
            sizes,
            [q / 2**20 for _, _, q in measured],
            "s--",
            label=f"accumulated (micro-batch {micro})",
        )
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no CPU allocator statistics", ha="center")
    ax.set_xlabel("effective batch size")
    ax.set_ylabel("peak memory during fit (MiB)")
    ax.set_title("digits CNN: peak TensorFlow CPU allocator memory")
    fig.tight_layout()
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tf.config.experimental.enable_op_determinism()
    micro, k = args.micro_batch, args.accum_steps
    big_batch = micro * k
    data = load_data(big_batch)
    updates = len(data.x_train) // big_batch * args.epochs
    print(
        f"digits: {len(data.x_train)} train / {len(data.x_test)} test samples; "
        f"big batch {big_batch} = micro-batch {micro} x accum_steps {k}; "
        f"Adam, {args.epochs} epoch(s), {updates} updates each run."
    )

    keras.utils.set_random_seed(SEED)
    big_model = compile_model(keras.Model(*cnn_layers()))
    initial = layer_weights(big_model)
    inputs, outputs = cnn_layers()
    accum_model = compile_model(
        GradientAccumulateModel(accum_steps=k, inputs=inputs, outputs=outputs)
    )
    set_layer_weights(accum_model, initial)
    assert max_abs_diff(initial, layer_weights(accum_model)) == 0.0

    big = train(f"big batch ({big_batch})", big_model, data, big_batch, 1, args.epochs)
    accum = train(
        f"accumulated ({micro} x {k})", accum_model, data, micro, k, args.epochs
    )

    diff = max_abs_diff(layer_weights(big.model), layer_weights(accum.model))
    moved = max_abs_diff(initial, layer_weights(big.model))
    loss_diff = max(
        abs(a - b) for a, b in zip(big.update_losses, accum.update_losses, strict=True)
    )

    print()
    print("| run | test accuracy | peak memory | fit time |")
    print("|---|---|---|---|")
    for r in (big, accum):
        print(
            f"| {r.name} | {r.accuracy:.4f} | {mib(r.peak_bytes)} | {r.seconds:.1f} s |"
        )
    print()
    if big.peak_bytes is None or accum.peak_bytes is None:
        print(
            "peak memory: n/a, tf.config.experimental.get_memory_info keeps no "
            "statistics for CPU:0 in this set-up (TF_CPU_ALLOCATOR_USE_BFC=1 "
            "enables them)."
        )
    else:
        print(
            "peak memory = the most bytes TensorFlow's CPU allocator (BFC, which "
            "counts every tensor) held during fit() above what it held just "
            "before (tf.config.experimental.get_memory_info('CPU:0'), reset per "
            "run): input batches, activations, gradients, optimizer temporaries "
            "and Adam's state. Not counted: the accumulation buffers "
            f"({mib(buffer_bytes(accum.model))}, one float32 copy of the trainable "
            "weights, allocated when the model is built) and anything outside "
            "TensorFlow's allocator (runtime, Python objects): it is not process "
            "RSS. It varies by ~20% between runs with thread scheduling. "
            f"Ratio big/accumulated: {big.peak_bytes / max(accum.peak_bytes, 1):.2f}x."
        )
    print(
        f"loss per update: big batch {big.update_losses[0]:.4f} -> "
        f"{big.update_losses[-1]:.4f}, accumulated {accum.update_losses[0]:.4f} -> "
        f"{accum.update_losses[-1]:.4f}; max |difference| {loss_diff:.2e} "
        "(recovered from Keras' running means, good to ~1e-5)"
    )
    print(f"weights moved by training: max |w_trained - w_initial| = {moved:.3e}")
    print(f"max |w_accum - w_bigbatch| = {diff:.3e} (tolerance {TOLERANCE:g})")
    if args.plot:
        factors = (1, 4) if args.quick else (1, 2, 4, 8, 16)
        sweep = memory_sweep(data, micro, factors)
        print()
        print("| effective batch | peak memory, big batch | peak memory, accumulated |")
        print("|---|---|---|")
        for size, p, q in sweep:
            print(f"| {size} | {mib(p)} | {mib(q)} |")
        caption = f"max |loss diff| {loss_diff:.1e}\nmax |weight diff| {diff:.1e}"
        for path in write_plots(args.plot, big, accum, sweep, micro, caption):
            print(f"plot written to {path}")

    if moved <= TOLERANCE:
        print("FAIL: training did not move the weights; the comparison is vacuous.")
        return 1
    if not diff <= TOLERANCE:  # also catches NaN
        print("FAIL: accumulated and big-batch weights differ.")
        return 1
    print("OK: accumulation reproduced the big-batch training.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
