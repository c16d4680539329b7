"""``verify`` for tf-keras: does accumulation reproduce big-batch training on
your tf-keras model? As the Keras 3 ``verify``
(``gradient_accumulator.hosts.equivalence`` does it for both Kerases)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tf_keras

from gradient_accumulator.hosts import equivalence
from gradient_accumulator.hosts.equivalence import (
    LayerCheck,
    VariableCheck,
    VerifyReport,
)
from gradient_accumulator.keras2._compat import draws_random
from gradient_accumulator.keras2.batch_norm import AccumBatchNormalization
from gradient_accumulator.keras2.model import GradientAccumulateModel
from gradient_accumulator.keras2.optimizer import GradientAccumulateOptimizer

__all__ = ["LayerCheck", "VariableCheck", "VerifyReport", "verify"]

_OPTIMIZERS = (tf_keras.optimizers.Optimizer, tf_keras.optimizers.legacy.Optimizer)


def _new_optimizer(spec: Any):
    """A fresh optimizer per run (current or legacy, as ``spec`` is)."""
    if isinstance(spec, str):
        return tf_keras.optimizers.get(spec)
    return type(spec).from_config(spec.get_config())


def _sublayers(layer) -> list:
    nested = [m for m in layer.submodules if isinstance(m, tf_keras.layers.Layer)]
    return [layer, *nested]


KERAS = equivalence.Keras(
    package="tf_keras",
    model=tf_keras.Model,
    wrapper=GradientAccumulateModel,
    optimizers=_OPTIMIZERS,
    accumulating_optimizer=GradientAccumulateOptimizer,
    input_layer=tf_keras.layers.InputLayer,
    batch_norms=(
        tf_keras.layers.BatchNormalization,
        tf_keras.layers.experimental.SyncBatchNormalization,
    ),
    accum_batch_norm=AccumBatchNormalization,
    set_random_seed=tf_keras.utils.set_random_seed,
    new_optimizer=_new_optimizer,
    sublayers=_sublayers,
    draws_random=draws_random,
    # "dense/kernel:0" -> "kernel"
    variable_name=lambda variable: variable.name.split("/")[-1].split(":")[0],
)


def verify(
    model_fn: Callable[[], tf_keras.Model], x: Any, y: Any, **options: Any
) -> VerifyReport:
    """Checks that the tf-keras ``GradientAccumulateModel`` trains
    ``model_fn()``'s tf-keras model exactly like plain tf-keras on the big
    batch, and names the layers that keep it from doing so: as the Keras 3
    ``verify``, with the same keyword arguments (``micro_batch_size=8``,
    ``accum_steps=4``, ``optimizer``, ``loss``, ``steps=3``,
    ``tolerance=1e-4``, ``seed=0``, ``callbacks=None``), checks and
    report.

    ``model_fn`` builds a functional or ``Sequential`` tf-keras model;
    ``optimizer`` is a tf-keras optimizer name or instance, current or
    legacy (``tf_keras.optimizers.legacy``). Seeds are set with
    ``tf_keras.utils.set_random_seed(seed)``.

    Example:

    >>> import numpy as np, tf_keras
    >>> from gradient_accumulator.keras2 import verify
    >>> def model_fn():
    ...     inputs = tf_keras.Input((4,))
    ...     return tf_keras.Model(inputs, tf_keras.layers.Dense(2)(inputs))
    >>> x, y = np.ones((32, 4), "float32"), np.zeros((32, 2), "float32")
    >>> report = verify(model_fn, x, y, micro_batch_size=4, accum_steps=2, loss="mse")
    >>> report.ok
    True
    """
    return equivalence.run(KERAS, model_fn, x, y, options)
