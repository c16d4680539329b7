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
from gradient_accumulator.keras2.flavour import FLAVOUR

__all__ = ["LayerCheck", "VariableCheck", "VerifyReport", "verify"]


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
    return equivalence.run(FLAVOUR, model_fn, x, y, options)
