"""The tf-keras flavour: what the hosts need of tf-keras, from its public
API and the private names in ``keras2/_compat``."""

from __future__ import annotations

import tf_keras

from gradient_accumulator._which_keras import TF_KERAS
from gradient_accumulator.hosts.flavour import Flavour

FLAVOUR = Flavour(name=TF_KERAS, keras=tf_keras)
