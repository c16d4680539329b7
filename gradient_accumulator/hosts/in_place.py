"""How ``accumulate()`` makes a model you already have accumulate, and
``stop_accumulating()`` undoes it, written once for Keras 3 and tf-keras:
the instance gets a private class derived from its Keras' model wrapper and
its own class. Each Keras' ``accumulate`` module describes its Keras in a
:class:`Keras` and keeps the public functions and their docs."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

from gradient_accumulator._which_keras import other_keras
from gradient_accumulator.core.settings import SAVED, Settings
from gradient_accumulator.core.validation import check_single_accumulation

# Saved files name this loader, which rebuilds the model's own class first.
LOADER = "gradient_accumulator>Accumulating"
MODEL_CLASS = "accumulated_class"


@dataclasses.dataclass(frozen=True)
class Keras:
    """What making a model accumulating needs of one Keras."""

    package: str  # its top-level package: whose train_step is the plain one
    model: type  # its Model
    wrapper: type  # its GradientAccumulateModel
    custom_names: dict  # class -> the name saved files give it
    registered_name: Callable[[type], str]
    registered_object: Callable  # (name, custom_objects) -> class or None
    compiled: Callable[[object], bool]
    # The config a model made accumulating saves: its own class's and the
    # settings (without the loader's reference to its class).
    config: Callable[[object, type], dict]
    classes: dict = dataclasses.field(default_factory=dict)


def start(keras: Keras, model, settings: Callable[[], Settings]):
    """Checks ``model``, then makes it accumulate with ``settings()``."""
    if not isinstance(model, keras.model):
        raise TypeError(
            f"`model` must be a {keras.package}.Model instance. "
            f"Received: model={model!r} of type {type(model).__name__}. "
            + other_keras(model, keras.package, "`model`")
        )
    if isinstance(model, keras.wrapper):
        raise ValueError(
            f"This {type(model).__name__} accumulates already; call "
            "stop_accumulating(model) first to change its settings."
        )
    own = type(model)
    if own.train_step is not _plain_train_step(own, keras.package):
        raise ValueError(
            f"{own.__name__} overrides `train_step`, which accumulate() would "
            "replace. Accumulate in that train_step instead (e.g. with "
            "GradientAccumulateOptimizer), or move its logic into "
            "`compute_loss`, which accumulate() keeps."
        )
    checked = settings()
    if keras.compiled(model):
        check_single_accumulation(
            getattr(model, "optimizer", None),
            "accumulate",
            checked.accum_steps,
            stacklevel=4,
        )
    model.__class__ = _accumulating_class(keras, own)
    model._start_accumulating(checked)
    if keras.compiled(model):
        # The train function Keras traced, if any, is plain training.
        model.train_function = None
        model._sync_state()
    return model


def stop(model, flush: bool):
    """``stop_accumulating``: see the Keras 3 ``accumulate`` module."""
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


def _accumulating_class(keras: Keras, own: type) -> type:
    if own not in keras.classes:

        def get_config(self) -> dict:
            config = keras.config(self, own)
            config[MODEL_CLASS] = {
                "module": own.__module__,
                "class_name": own.__name__,
                "registered_name": keras.registered_name(own),
            }
            return config

        cls = type(
            own.__name__,
            (keras.wrapper, own),
            {
                "__module__": own.__module__,
                "__qualname__": own.__qualname__,
                "_accumulated_class": own,
                "get_config": get_config,
            },
        )
        keras.custom_names[cls] = LOADER
        keras.classes[own] = cls
    return keras.classes[own]


def load(keras: Keras, config: dict, custom_objects, accumulate: Callable):
    """Rebuilds a model saved after ``accumulate`` with its own class's
    ``from_config``, then makes it accumulate with the saved settings."""
    config = dict(config)
    reference = config.pop(MODEL_CLASS)
    settings = {k: config.pop(k) for k in SAVED if k in config}
    name = reference["registered_name"]
    own = (custom_objects or {}).get(name) or keras.registered_object(name)
    if own is None:
        module = importlib.import_module(reference["module"])
        own = getattr(module, reference["class_name"])
    return accumulate(own.from_config(config), **settings)
