"""``accumulate``: make a model you already have accumulate, keeping its class.

A keras-hub task model (``GPT2CausalLM``, ``BertTextClassifier``, ...), a
model loaded from a ``.keras`` file or someone else's subclass cannot be
rebuilt as a :class:`~gradient_accumulator.GradientAccumulateModel` without
losing what its class gives it (``generate``, its preprocessor, its
``compile`` defaults). :func:`accumulate` instead gives that one instance a
class derived from both :class:`~gradient_accumulator.GradientAccumulateModel`
and its own class, so it trains exactly as the model wrapper does (each
micro-batch weighted by the loss denominator Keras uses) and stays everything
it was. :func:`stop_accumulating` gives it its class back.
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import tensorflow as tf

from gradient_accumulator.core.settings import Settings
from gradient_accumulator.flavour import FLAVOUR
from gradient_accumulator.hosts import in_place
from gradient_accumulator.hosts.in_place import stop_accumulating as stop_accumulating


def accumulate(
    model: keras.Model,
    accum_steps: int = Settings.accum_steps,
    *,
    micro_batch_size: int | None = Settings.micro_batch_size,
    partial_cycle: str = Settings.partial_cycle,
    flush_at_end: bool = Settings.flush_at_end,
    skip_update_fn: Callable[[list, list], tf.Tensor] | None = None,
    progress_logs: bool = Settings.progress_logs,
    use_agc: bool = Settings.use_agc,
    clip_factor: float = Settings.clip_factor,
    eps: float = Settings.eps,
    loss_denominator: str | Callable | None = Settings.loss_denominator,
) -> keras.Model:
    """Makes ``model`` accumulate gradients, in place, keeping its class.

    ``model`` trains exactly as a
    :class:`~gradient_accumulator.GradientAccumulateModel` with the same
    arguments would (see there for each argument in full): one optimizer update per
    ``accum_steps`` micro-batches, each weighted by the loss denominator
    Keras uses for it. It stays an instance of its own class (keras-hub's
    ``generate``, preprocessor and ``compile`` defaults keep working), its
    weights lists are unchanged, and ``.keras`` files round-trip it,
    accumulation settings and pending state included.

    Call it before or after ``compile`` (a compiled model retraces its
    step). A model whose class overrides ``train_step`` is refused: its step
    is its own, and the accumulating step would replace it.

    Args:
        model: a Keras model instance (functional, ``Sequential``,
            subclassed, keras-hub task, loaded from a file).
        accum_steps: micro-batches per optimizer update, an ``int >= 1``.
        micro_batch_size: ``None``, or slice each ``fit`` batch into this
            many samples inside the step (in-step micro-batching).
        partial_cycle: ``"auto"`` (the big batch's epochs: flush an
            incomplete cycle at the end of a pass over the data, carry it
            across epochs cut by ``steps_per_epoch``), ``"carry"``,
            ``"flush"`` or ``"drop"`` it at each epoch end.
        flush_at_end: flush a carried partial cycle when ``fit`` ends.
        skip_update_fn: optional ``fn(grads, variables) -> bool tensor``;
            True skips the cycle. Not saved in ``.keras`` files.
        progress_logs: add ``update``, ``grad_norm`` and ``effective_batch``
            to every step's logs.
        use_agc: adaptive gradient clipping of the accumulated gradient.
        clip_factor: its clipping factor (``> 0``).
        eps: its epsilon (``> 0``).
        loss_denominator: what the model's own ``compute_loss`` divides a
            batch by, when it is compiled without a loss: ``"samples"``,
            ``"sum"`` or a function ``f(x, y, sample_weight)`` (``None``:
            ``"samples"``, with a warning if ``compute_loss`` is overridden).

    Returns:
        ``model`` itself.

    Example:

    >>> import keras, numpy as np
    >>> import gradient_accumulator as ga
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model = ga.accumulate(model, accum_steps=4)
    >>> isinstance(model, keras.Sequential)
    True
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> _ = model.fit(np.ones((32, 4)), np.ones((32, 1)), batch_size=8, verbose=0)
    >>> int(model.optimizer.iterations)  # 4 micro-batches of 8 -> one update
    1
    >>> model = ga.stop_accumulating(model)
    >>> type(model) is keras.Sequential
    True
    """
    # Every argument but the model is a setting, by the same name.
    settings = {name: value for name, value in locals().items() if name != "model"}
    return in_place.start(FLAVOUR, model, lambda: Settings(**settings))


class Accumulating(in_place.Loader):
    """Loads a model saved after :func:`accumulate`: rebuilds it with its own
    class's ``from_config``, then makes it accumulate with the saved
    settings (Keras then restores its weights and the pending state)."""
