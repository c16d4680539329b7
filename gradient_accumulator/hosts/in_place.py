"""How ``accumulate()`` makes a model you already have accumulate, and
``stop_accumulating()`` undoes it, written once for Keras 3 and tf-keras:
the instance gets a private class derived from its Keras' model wrapper and
its own class. The public function ``accumulate`` of each Keras is made in
``hosts/public.py`` and calls :func:`start` (``stop_accumulating``, which
needs no Keras, is this module's); the host learns the Keras from its
flavour."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TypeVar

from gradient_accumulator._which_keras import other_keras
from gradient_accumulator.core.settings import SAVED, Settings
from gradient_accumulator.core.validation import check_single_accumulation
from gradient_accumulator.hosts.flavour import Flavour
from gradient_accumulator.hosts.model import ModelHost, restored

# Saved files name this loader, which rebuilds the model's own class first.
LOADER = "gradient_accumulator>Accumulating"
MODEL_CLASS = "accumulated_class"


M = TypeVar("M")  # a model of either Keras
# Each accumulating class made, by the model's own class.
_CLASSES: dict[type, type] = {}


def start(flavour: Flavour, wrapper: type, model, settings: Callable[[], Settings]):
    """Checks ``model``, then makes it accumulate with ``settings()`` as
    ``wrapper`` (its Keras' ``GradientAccumulateModel``) does."""
    if not isinstance(model, flavour.keras.Model):
        raise TypeError(
            f"`model` must be a {flavour.name}.Model instance. "
            f"Received: model={model!r} of type {type(model).__name__}. "
            + other_keras(model, flavour.name, "`model`")
        )
    if isinstance(model, ModelHost):
        raise ValueError(
            f"This {type(model).__name__} accumulates already; call "
            "stop_accumulating(model) first to change its settings."
        )
    own = type(model)
    if own.train_step is not _plain_train_step(own, flavour.name):
        raise ValueError(
            f"{own.__name__} overrides `train_step`, which accumulate() would "
            "replace. Accumulate in that train_step instead (e.g. with "
            "GradientAccumulateOptimizer), or move its logic into "
            "`compute_loss`, which accumulate() keeps."
        )
    checked = settings()
    if flavour.compiled(model):
        check_single_accumulation(
            getattr(model, "optimizer", None),
            "accumulate",
            checked.accum_steps,
            stacklevel=4,
        )
    model.__class__ = _accumulating_class(flavour, wrapper, own)
    model._start_accumulating(checked)
    if flavour.compiled(model):
        # The train function Keras traced, if any, is plain training.
        model.train_function = None
        model._sync_state()
    return model


def stop_accumulating(model: M, flush: bool = True) -> M:
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


def _plain_train_step(cls: type, package: str):
    """The ``train_step`` Keras itself gives ``cls`` (its backend trainer's)."""
    for klass in cls.__mro__:
        if klass.__module__.startswith(f"{package}.") and "train_step" in vars(klass):
            return vars(klass)["train_step"]
    return None


def _accumulating_class(flavour: Flavour, wrapper: type, own: type) -> type:
    if own not in _CLASSES:

        def get_config(self) -> dict:
            config = flavour.accumulated_config(self, own)
            config[MODEL_CLASS] = {
                "module": own.__module__,
                "class_name": own.__name__,
                "registered_name": flavour.keras.saving.get_registered_name(own),
            }
            return config

        cls = type(
            own.__name__,
            (wrapper, own),
            {
                "__module__": own.__module__,
                "__qualname__": own.__qualname__,
                "_accumulated_class": own,
                "get_config": get_config,
            },
        )
        flavour.custom_names[cls] = LOADER
        _CLASSES[own] = cls
    return _CLASSES[own]


class Loader:
    """Mixin for a Keras' ``Accumulating``, the class saved files name: it
    loads a model saved after ``accumulate``."""

    # The flavour of its Keras and its GradientAccumulateModel: each Keras'
    # public class sets them.
    _flavour: Flavour
    _model_wrapper: type

    def get_config(self) -> dict:  # Keras registers only classes that have one
        raise NotImplementedError("Models save the config of their own class.")

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Rebuilds the model with its own class's ``from_config``, then makes
        it accumulate with the saved settings (Keras then restores its
        weights and the pending state)."""
        config = dict(config)
        reference = config.pop(MODEL_CLASS)
        settings = {k: config.pop(k) for k in SAVED if k in config}
        name = reference["registered_name"]
        registered = cls._flavour.keras.saving.get_registered_object
        own = (custom_objects or {}).get(name) or registered(name)
        if own is None:
            module = importlib.import_module(reference["module"])
            own = getattr(module, reference["class_name"])
        model = own.from_config(config)
        settings = restored(cls._flavour, settings)
        return start(
            cls._flavour, cls._model_wrapper, model, lambda: Settings(**settings)
        )
