"""The tf-keras engines: :class:`LayerEngine`, whose variables are its layer's
weights (``AccumBatchNormalization``). The model and optimizer wrappers use
the core's ``Engine`` itself, a ``tf.Module`` they track."""

from __future__ import annotations

import tensorflow as tf
import tf_keras

from gradient_accumulator.core.engine import Engine
from gradient_accumulator.core.settings import Settings


class LayerEngine(Engine):
    """An engine whose variables are its layer's (non-trainable) weights, so
    the layer saves and restores them with its own."""

    def __init__(self, layer, settings: Settings):
        super().__init__(settings, name="accumulator")
        self._layer = layer

    def _make_variable(self, name, shape, dtype, initializer, **kwargs):
        if not isinstance(initializer, str):
            initializer = tf_keras.initializers.Constant(initializer)
        synchronization = kwargs.get("synchronization", "auto").upper()
        aggregation = kwargs.get("aggregation", "none").upper()
        return self._layer.add_weight(
            name,
            shape,
            dtype,
            initializer,
            trainable=False,
            experimental_autocast=False,
            synchronization=getattr(tf.VariableSynchronization, synchronization),
            aggregation=getattr(tf.VariableAggregation, aggregation),
        )
