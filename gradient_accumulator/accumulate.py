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

import importlib
from collections.abc import Callable

import keras
import tensorflow as tf

from gradient_accumulator._keras_compat import GLOBAL_CUSTOM_NAMES
from gradient_accumulator.model import GradientAccumulateModel
from gradient_accumulator.settings import SAVED, Settings

# Saved files name this loader, which rebuilds the model's own class first.
_LOADER = "gradient_accumulator>Accumulating"
_MODEL_CLASS = "accumulated_class"
_classes: dict[type, type] = {}


def accumulate(
    model: keras.Model,
    accum_steps: int = 1,
    *,
    micro_batch_size: int | None = None,
    partial_cycle: str = "carry",
    flush_at_end: bool = True,
    skip_update_fn: Callable[[list, list], tf.Tensor] | None = None,
    progress_logs: bool = False,
    use_agc: bool = False,
    clip_factor: float = 0.01,
    eps: float = 1e-3,
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
        partial_cycle: ``"carry"``, ``"flush"`` or ``"drop"`` an incomplete
            cycle at each epoch end.
        flush_at_end: flush a carried partial cycle when ``fit`` ends.
        skip_update_fn: optional ``fn(grads, variables) -> bool tensor``;
            True skips the cycle. Not saved in ``.keras`` files.
        progress_logs: add ``update``, ``grad_norm`` and ``effective_batch``
            to every step's logs.
        use_agc: adaptive gradient clipping of the accumulated gradient.
        clip_factor: its clipping factor (``> 0``).
        eps: its epsilon (``> 0``).

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
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a keras.Model instance. "
            f"Received: model={model!r} of type {type(model).__name__}."
        )
    if isinstance(model, GradientAccumulateModel):
        raise ValueError(
            f"This {type(model).__name__} accumulates already; call "
            "stop_accumulating(model) first to change its settings."
        )
    own = type(model)
    if own.train_step is not _plain_train_step(own):
        raise ValueError(
            f"{own.__name__} overrides `train_step`, which accumulate() would "
            "replace. Accumulate in that train_step instead (e.g. with "
            "GradientAccumulateOptimizer), or move its logic into "
            "`compute_loss`, which accumulate() keeps."
        )
    settings = Settings(
        accum_steps=accum_steps,
        use_agc=use_agc,
        clip_factor=clip_factor,
        eps=eps,
        micro_batch_size=micro_batch_size,
        partial_cycle=partial_cycle,
        flush_at_end=flush_at_end,
        skip_update_fn=skip_update_fn,
        progress_logs=progress_logs,
    )
    model.__class__ = _accumulating_class(own)
    model._start_accumulating(settings)
    if model.compiled:
        # The train function Keras traced, if any, is plain training.
        model.train_function = None
        model._sync_state()
    return model


def stop_accumulating(model: keras.Model, flush: bool = True) -> keras.Model:
    """Returns a model made accumulating by :func:`accumulate` to plain
    training (its own class), in place.

    A pending partial cycle is applied first (``flush=True``, the default) or
    dropped. Compile the model again before training it further.

    Args:
        model: a model made accumulating by :func:`accumulate`.
        flush: apply (True) or drop (False) a pending partial cycle.

    Raises:
        ValueError: ``model`` was not made accumulating by :func:`accumulate`.

    Returns:
        ``model`` itself.
    """
    own = getattr(type(model), "_accumulated_class", None)
    if own is None:
        raise ValueError(
            "`model` was not made accumulating by accumulate(). Received a "
            f"model of type {type(model).__name__}."
        )
    if model._accumulator.pending:
        model.flush() if flush else model.drop_partial_cycle()
    model._stop_accumulating()
    model.__class__ = own
    model.train_function = None
    return model


def _plain_train_step(cls: type):
    """The ``train_step`` Keras itself gives ``cls`` (its backend trainer's)."""
    for klass in cls.__mro__:
        if klass.__module__.startswith("keras.") and "train_step" in vars(klass):
            return vars(klass)["train_step"]
    return None


def _accumulating_class(own: type) -> type:
    if own not in _classes:
        cls = type(
            own.__name__,
            (GradientAccumulateModel, own),
            {
                "__module__": own.__module__,
                "__qualname__": own.__qualname__,
                "_accumulated_class": own,
                "get_config": _get_config,
            },
        )
        GLOBAL_CUSTOM_NAMES[cls] = _LOADER
        _classes[own] = cls
    return _classes[own]


def _get_config(self) -> dict:
    own = type(self)._accumulated_class
    config = GradientAccumulateModel.get_config(self)
    config[_MODEL_CLASS] = {
        "module": own.__module__,
        "class_name": own.__name__,
        "registered_name": keras.saving.get_registered_name(own),
    }
    return config


@keras.saving.register_keras_serializable(package="gradient_accumulator")
class Accumulating:
    """Loads a model saved after :func:`accumulate`: rebuilds it with its own
    class's ``from_config``, then makes it accumulate with the saved
    settings (Keras then restores its weights and the pending state)."""

    def get_config(self) -> dict:  # Keras registers only classes that have one
        raise NotImplementedError("Models save the config of their own class.")

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        reference = config.pop(_MODEL_CLASS)
        settings = {k: config.pop(k) for k in SAVED if k in config}
        own = _resolve(reference, custom_objects)
        model = own.from_config(config)
        return accumulate(model, **settings)


def _resolve(reference: dict, custom_objects) -> type:
    name = reference["registered_name"]
    found = (custom_objects or {}).get(name) or keras.saving.get_registered_object(name)
    if found is None:
        module = importlib.import_module(reference["module"])
        found = getattr(module, reference["class_name"])
    return found
