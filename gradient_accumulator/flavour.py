"""The Keras 3 flavour: what the hosts need of Keras 3, from its public API
and the private names in ``_keras_compat``."""

from __future__ import annotations

import keras

from gradient_accumulator._which_keras import KERAS3
from gradient_accumulator.hosts.flavour import Flavour

FLAVOUR = Flavour(name=KERAS3, keras=keras)
