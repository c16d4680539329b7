"""Batch normalisation whose moving statistics are those of the big batch.

:class:`AccumBatchNormalization` normalises each micro-batch exactly as
``keras.layers.BatchNormalization`` does, but instead of updating the moving
mean and variance on every call it pools the micro-batches' moments (merged
as in Chan's parallel algorithm, in float32) in an :class:`Accumulator` and,
once per cycle, updates the moving statistics as Keras' layer would on the
concatenated big batch. :func:`~gradient_accumulator.replace_batchnorm_layers`
converts a model.
"""

from __future__ import annotations

import keras

from gradient_accumulator.hosts.batch_norm import AccumBatchNorm
from gradient_accumulator.keras3.flavour import FLAVOUR


@keras.saving.register_keras_serializable(package="gradient_accumulator")
class AccumBatchNormalization(AccumBatchNorm, keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` for gradient accumulation.

    In training, each micro-batch is normalised with its own statistics, as
    Keras' layer does (accumulation cannot change that: the big batch is never
    in memory). The moving mean and variance, however, are updated once per
    cycle of ``accum_steps`` micro-batches, with the exact mean and (biased)
    variance of the whole effective batch, every replica included: after a
    cycle they equal those of ``keras.layers.BatchNormalization`` trained on
    the concatenated big batch. Inference is exactly Keras' layer.

    Inside a :class:`GradientAccumulateModel` the layer follows the model's
    cycle (one counter, one all-reduce per cycle) and ``accum_steps`` may be
    omitted. Elsewhere (a plain ``keras.Model``, e.g. with
    :class:`GradientAccumulateOptimizer`) the layer counts its own training
    calls; ``accum_steps=None`` then means 1, i.e. exactly Keras' layer.

    A cycle whose pooled statistics (or, inside a model, whose gradients)
    contain a NaN or an Inf leaves the moving statistics unchanged.

    Args:
        accum_steps: micro-batches per cycle (an ``int >= 1``), or ``None`` to
            take it from the enclosing :class:`GradientAccumulateModel`. An
            explicit value must equal the model's.
        axis: as for ``keras.layers.BatchNormalization``, and likewise
            ``momentum``, ``epsilon``, ``center``, ``scale``, the
            initializers, regularizers and constraints of gamma, beta and
            the moving statistics.
        synchronized: as for ``keras.layers.BatchNormalization``: under a
            ``tf.distribute`` strategy, also normalise the forward pass with
            the statistics of all replicas' micro-batches. The moving
            statistics always pool every replica, whatever this flag.
        **kwargs: base layer arguments (``name``, ``dtype``, ``trainable``).

    Example:

    >>> import keras
    >>> from gradient_accumulator import AccumBatchNormalization
    >>> from gradient_accumulator import GradientAccumulateModel
    >>> inputs = keras.Input((8,))
    >>> h = AccumBatchNormalization()(keras.layers.Dense(16)(inputs))
    >>> model = GradientAccumulateModel(4, inputs=inputs, outputs=h)
    """

    _flavour = FLAVOUR
