"""``accumulate``: make a model you already have accumulate, keeping its class.

A keras-hub task model (``GPT2CausalLM``, ``BertTextClassifier``, ...), a
model loaded from a ``.keras`` file or someone else's subclass cannot be
rebuilt as a :class:`~gradient_accumulator.GradientAccumulateModel` without
losing what its class gives it (``generate``, its preprocessor, its
``compile`` defaults). :func:`accumulate` instead gives that one instance a
class derived from both :class:`~gradient_accumulator.GradientAccumulateModel`
and its own class, so it trains exactly as the model wrapper does (each
micro-batch weighted by the loss denominator Keras uses) and stays everything
it was. :func:`stop_accumulating` gives it its class back. (``hosts/public.py``
makes the function, the same for both Kerases; ``hosts/in_place.py`` does
the work.)
"""

from __future__ import annotations

import keras

from gradient_accumulator.hosts import in_place, public
from gradient_accumulator.hosts.in_place import stop_accumulating as stop_accumulating
from gradient_accumulator.keras3.flavour import FLAVOUR
from gradient_accumulator.keras3.model import GradientAccumulateModel

accumulate = public.accumulate(FLAVOUR, __name__, GradientAccumulateModel)


@keras.saving.register_keras_serializable(package="gradient_accumulator")
class Accumulating(in_place.Loader):
    """Loads a model saved after :func:`accumulate`: rebuilds it with its own
    class's ``from_config``, then makes it accumulate with the saved
    settings (Keras then restores its weights and the pending state)."""

    _flavour = FLAVOUR
    _model_wrapper = GradientAccumulateModel
