"""Local stand-ins for the data sets gradient-accumulator 0.5.2's tests
downloaded with ``tensorflow_datasets``; nothing here downloads.

``load`` answers the one call form those tests make,
``tfds.load(name, split=["train", "test"], shuffle_files=True,
as_supervised=True, with_info=True)``, with ``tf.data`` data sets of the same
element types, so the ported test bodies keep their pipelines unchanged:

* ``"mnist"``: scikit-learn's bundled 8x8 digits (1,797 images, shipped with
  the package) as ``uint8`` images of shape ``(8, 8, 1)`` in 0..255 (MNIST's
  ``(28, 28, 1)`` ``uint8`` layout) and ``int64`` labels. "train" is the first
  1,000 images, a size every batch size and cycle of the 0.5.2 tests divides
  (500, 250, 125, 100, 50, 25) as they divided MNIST's 60,000; "test" is the
  other 797.
* ``"imdb_reviews"``: generated "reviews" (``tf.string``) of 20 to 99
  letters whose label (``int64``, 0 or 1) sets which letters are more likely,
  1,000 for "train" and 500 for "test".
"""

from __future__ import annotations

import types

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

DIGITS_TRAIN = 1000
IMDB_TRAIN, IMDB_TEST = 1000, 500


def _digits():
    digits = load_digits()
    # 0..16 intensities -> MNIST's 0..255 range, so 0.5.2's normalize_img
    # (a division by 255) still maps them to [0, 1].
    images = np.minimum(digits.images * 16, 255).astype(np.uint8)[..., None]
    labels = digits.target.astype(np.int64)
    return (
        (images[:DIGITS_TRAIN], labels[:DIGITS_TRAIN]),
        (images[DIGITS_TRAIN:], labels[DIGITS_TRAIN:]),
    )


def _reviews():
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    # Label 1 favours the first half of the alphabet, label 0 the second.
    favoured = np.where(np.arange(26) < 13, 2.0, 1.0)
    weights = {1: favoured / favoured.sum(), 0: favoured[::-1] / favoured.sum()}

    def make(count):
        labels = rng.integers(0, 2, size=count)
        texts = [
            "".join(rng.choice(letters, size=rng.integers(20, 100), p=weights[y]))
            for y in labels
        ]
        return np.array(texts), labels.astype(np.int64)

    return make(IMDB_TRAIN), make(IMDB_TEST)


def load(name, split, shuffle_files=False, as_supervised=False, with_info=False):
    """``tensorflow_datasets.load`` for the calls of the 0.5.2 tests."""
    if list(split) != ["train", "test"] or not as_supervised or not with_info:
        raise NotImplementedError("only the 0.5.2 tests' call form is provided")
    if name == "mnist":
        train, test = _digits()
    elif name == "imdb_reviews":
        train, test = _reviews()
    else:
        raise NotImplementedError(f"no local stand-in for {name!r}")
    info = types.SimpleNamespace(
        name=name,
        splits={
            "train": types.SimpleNamespace(num_examples=len(train[1])),
            "test": types.SimpleNamespace(num_examples=len(test[1])),
        },
    )
    datasets = [tf.data.Dataset.from_tensor_slices(part) for part in (train, test)]
    return datasets, info
