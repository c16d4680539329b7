"""Makes the saved files of ``tests/both/test_saved_files.py``: ``.keras``
files saved mid-cycle by a given version of the package, each with an
``.npz`` that holds what that version computed when it went on training.

Run by hand, not by pytest, once per Keras, with ``PYTHONPATH`` at a checkout
of the version whose files you want (the files now here were made by commit
91ba877, the version before the hosts were written once)::

    mkdir -p /tmp/ga-91ba877
    git archive 91ba877 | tar -x -C /tmp/ga-91ba877
    CUDA_VISIBLE_DEVICES=-1 PYTHONPATH=/tmp/ga-91ba877 \\
        .venv-ci-low/bin/python tests/data/make_saved_files.py saved_91ba877
    CUDA_VISIBLE_DEVICES=-1 PYTHONPATH=/tmp/ga-91ba877 TF_USE_LEGACY_KERAS=1 \\
        .venv-ci-low/bin/python tests/data/make_saved_files.py saved_91ba877

from the repository root, in the lowest pair's environment (``.ci/run``
makes ``.venv-ci-low``: TensorFlow 2.16, Keras 3.15.0, tf-keras 2.16): Keras
reads files of its own and earlier releases, not of later ones (tf-keras
2.16 refuses a 2.21 file's ``InputLayer``), so files made there load in
every environment CI tests. The numbers are the same in each (0 apart).

Files go to ``tests/data/<name>/keras3/`` or ``.../tf_keras/``. For each
case, a tiny model (seeded weights, seeded data) trains 6 micro-batches with
``accum_steps=4``, so one update is applied and 2 micro-batches are pending
when it is saved; the in-memory model then trains on 6 more micro-batches
(which close the pending cycle and one more) and the ``.npz`` keeps those
micro-batches (``x``, ``y``), the pending count at saving (``pending``) and
the weights after (``w0``, ``w1``, ...). The cases:

- ``model_bn``: a functional ``GradientAccumulateModel`` with an
  ``AccumBatchNormalization`` layer, Adam;
- ``accumulate``: a plain ``keras.Model`` made accumulating by
  ``accumulate(model, accum_steps=4)``;
- ``optimizer``: a plain model compiled with
  ``GradientAccumulateOptimizer(Adam, accum_steps=4)``.
"""

from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path

import numpy as np
import tensorflow as tf

import gradient_accumulator as ga

LEGACY = os.environ.get("TF_USE_LEGACY_KERAS", "") not in ("", "0", "false")
if LEGACY:
    import tf_keras as keras
else:
    import keras

# As the test session runs (tests/conftest.py): without it, the weights a
# resumed model reaches differ in their last bits from those computed here.
tf.config.experimental.enable_op_determinism()

K = 4  # micro-batches per update
B = 4  # micro-batch size
SAVED_MICRO_BATCHES = 6  # one update, 2 pending
NEXT_MICRO_BATCHES = 6  # closes the pending cycle and one more
FEATURES, CLASSES = 5, 3


def data(seed: int, micro_batches: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(micro_batches * B, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(micro_batches * B,)).astype("int32")
    return x, y


def _layers(batch_norm):
    inputs = keras.Input(shape=(FEATURES,))
    hidden = keras.layers.Dense(4, activation="tanh")(inputs)
    if batch_norm is not None:
        hidden = batch_norm(hidden)
    outputs = keras.layers.Dense(CLASSES)(hidden)
    return inputs, outputs


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def model_bn():
    inputs, outputs = _layers(ga.AccumBatchNormalization(accum_steps=K))
    model = ga.GradientAccumulateModel(
        accum_steps=K, flush_at_end=False, inputs=inputs, outputs=outputs
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=_loss())
    return model


def accumulate():
    model = keras.Model(*_layers(None))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=_loss())
    return ga.accumulate(model, accum_steps=K, flush_at_end=False)


def optimizer():
    model = keras.Model(*_layers(None))
    wrapped = ga.GradientAccumulateOptimizer(keras.optimizers.Adam(0.01), accum_steps=K)
    model.compile(optimizer=wrapped, loss=_loss())
    return model


CASES = {"model_bn": model_bn, "accumulate": accumulate, "optimizer": optimizer}


def pending(model) -> int:
    """The micro-batches the model's accumulation holds (0.5.x to now keep
    them on the model's, or the optimizer wrapper's, accumulator)."""
    owner = model if hasattr(model, "_accumulator") else model.optimizer
    return int(owner._accumulator.pending)


def fit(model, x, y) -> None:
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)


def repack(path: Path) -> None:
    """Deflates the members of a ``.keras`` zip, which Keras stores
    uncompressed (its weights file is mostly empty HDF5 space): the same
    bytes inside, an eighth of the size in the repository."""
    with zipfile.ZipFile(path) as source:
        members = [(info.filename, source.read(info)) for info in source.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
        for name, content in members:
            out.writestr(name, content)


def make(name: str, build, folder: Path) -> None:
    keras.utils.set_random_seed(0)
    model = build()
    fit(model, *data(1, SAVED_MICRO_BATCHES))
    held = pending(model)
    assert held == SAVED_MICRO_BATCHES % K, (name, held)
    model.save(folder / f"{name}.keras")
    repack(folder / f"{name}.keras")
    x, y = data(2, NEXT_MICRO_BATCHES)
    fit(model, x, y)
    weights = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    np.savez_compressed(folder / f"{name}.npz", x=x, y=y, pending=held, **weights)


def main() -> None:
    folder = Path(__file__).resolve().parent / sys.argv[1]
    folder = folder / ("tf_keras" if LEGACY else "keras3")
    folder.mkdir(parents=True, exist_ok=True)
    print("package:", ga.__file__, "->", folder)
    for name, build in CASES.items():
        make(name, build, folder)


if __name__ == "__main__":
    main()
