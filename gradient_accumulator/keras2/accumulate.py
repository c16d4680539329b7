"""``accumulate`` for tf-keras: make a tf-keras model you already have (a
``Sequential``, a functional model, a subclass, one loaded from a file)
accumulate, keeping its class; ``stop_accumulating`` gives its class back.
The same function as Keras 3's, for tf-keras (``hosts/public.py`` makes both;
``hosts/in_place.py`` does the work)."""

from __future__ import annotations

import tf_keras

from gradient_accumulator.hosts import in_place, public
from gradient_accumulator.hosts.in_place import stop_accumulating as stop_accumulating
from gradient_accumulator.keras2.flavour import FLAVOUR
from gradient_accumulator.keras2.model import GradientAccumulateModel

accumulate = public.accumulate(FLAVOUR, __name__, GradientAccumulateModel)


@tf_keras.saving.register_keras_serializable(package="gradient_accumulator")
class Accumulating(in_place.Loader):
    """Loads a tf-keras model saved after :func:`accumulate`: rebuilds it
    with its own class's ``from_config``, then makes it accumulate with the
    saved settings."""

    _flavour = FLAVOUR
    _model_wrapper = GradientAccumulateModel
