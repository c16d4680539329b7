"""``accumulate`` for tf-keras: make a tf-keras model you already have (a
``Sequential``, a functional model, a subclass, one loaded from a file)
accumulate, keeping its class; ``stop_accumulating`` gives its class back.
As the Keras 3 ``accumulate`` (``gradient_accumulator.hosts.in_place`` does both),
with the tf-keras ``GradientAccumulateModel``'s settings."""

from __future__ import annotations

import tf_keras

from gradient_accumulator.core.settings import Settings
from gradient_accumulator.core.validation import check_keywords
from gradient_accumulator.hosts import in_place
from gradient_accumulator.hosts.in_place import stop_accumulating as stop_accumulating
from gradient_accumulator.keras2.flavour import FLAVOUR, SETTINGS


def accumulate(model: tf_keras.Model, accum_steps: int = 1, **settings):
    """Makes the tf-keras ``model`` accumulate gradients, in place, keeping
    its class: it trains as a tf-keras ``GradientAccumulateModel`` with the
    same arguments would, its weights lists are unchanged, and ``.keras``
    files load it back accumulating.

    Args:
        model: a tf-keras model instance whose class does not override
            ``train_step``.
        accum_steps: micro-batches per optimizer update, an ``int >= 1``.
        **settings: the model wrapper's, by keyword: ``partial_cycle``,
            ``flush_at_end``, ``skip_update_fn``, ``progress_logs``,
            ``use_agc``, ``clip_factor``, ``eps``, ``loss_denominator``.

    Returns:
        ``model`` itself.

    Example:

    >>> import numpy as np, tf_keras
    >>> from gradient_accumulator.keras2 import accumulate, stop_accumulating
    >>> model = tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(1)])
    >>> model = accumulate(model, accum_steps=4)
    >>> isinstance(model, tf_keras.Sequential)
    True
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> history = model.fit(np.ones((32, 4)), np.ones((32, 1)), batch_size=8, verbose=0)
    >>> int(model.optimizer.iterations)  # 4 micro-batches of 8 -> one update
    1
    >>> type(stop_accumulating(model)) is tf_keras.Sequential
    True
    """
    in_step = " (the in-step mode is not available for tf-keras)"
    check_keywords(
        "accumulate", settings, SETTINGS, "settings", {"micro_batch_size": in_step}
    )
    return in_place.start(
        FLAVOUR, model, lambda: Settings(accum_steps=accum_steps, **settings)
    )


class Accumulating(in_place.Loader):
    """Loads a tf-keras model saved after :func:`accumulate`: rebuilds it
    with its own class's ``from_config``, then makes it accumulate with the
    saved settings."""
