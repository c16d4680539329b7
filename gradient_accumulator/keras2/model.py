"""``GradientAccumulateModel`` for tf-keras: a ``tf.keras.Model`` (where
``tf.keras`` is tf-keras) whose ``fit`` accumulates."""

from __future__ import annotations

import tf_keras

from gradient_accumulator.hosts.model import ModelHost
from gradient_accumulator.keras2.flavour import FLAVOUR


@tf_keras.saving.register_keras_serializable(package="gradient_accumulator")
class GradientAccumulateModel(ModelHost, tf_keras.Model):
    """A tf-keras model that applies one optimizer update per
    ``accum_steps`` micro-batches, with the gradient of the concatenated big
    batch.

    Build it like a functional model (or subclass it) and train with
    ``fit``: ``fit(x, y, batch_size=8)`` with ``accum_steps=4`` trains like
    ``batch_size=32`` while holding 8 samples in memory. Each micro-batch is
    weighted by the denominator tf-keras' loss reduction used for it (its
    samples, or its unmasked entries under a Keras mask), so masks, sample
    weights and a short last micro-batch give exactly the big batch's
    gradient. ``optimizer.iterations``, schedules, clipping, weight decay and
    EMA advance once per update.

    Args: as the Keras 3 ``GradientAccumulateModel``; ``micro_batch_size``
    only with ``gradient_cache=True`` (tf-keras has no in-step mode of its
    own), and layers that draw random numbers are refused there (tf-keras'
    random ops cannot be replayed in the second forward pass).

    Example:

    >>> import numpy as np, tf_keras
    >>> from gradient_accumulator.keras2 import GradientAccumulateModel
    >>> x, y = np.ones((32, 4)), np.ones((32, 1))
    >>> inputs = tf_keras.Input((4,))
    >>> outputs = tf_keras.layers.Dense(1)(inputs)
    >>> model = GradientAccumulateModel(accum_steps=4, inputs=inputs, outputs=outputs)
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> history = model.fit(x, y, batch_size=8, verbose=0)
    >>> int(model.optimizer.iterations)  # 4 micro-batches of 8 -> one update
    1
    """

    _flavour = FLAVOUR


# ``.h5`` files name a model by its bare class name (``.keras`` files by the
# registered one): loading them needs no custom_objects either.
tf_keras.utils.get_custom_objects()[GradientAccumulateModel.__name__] = (
    GradientAccumulateModel
)
