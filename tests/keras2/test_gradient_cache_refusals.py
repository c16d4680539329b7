"""``gradient_cache=True`` in tf-keras: Dropout and noise layers draw from
stateful random ops that a second forward pass cannot replay, so a model
with one is refused at its first step, with the reason."""

from __future__ import annotations

import tf_keras

from tests.both.test_gradient_cache import refused


def test_tf_keras_dropout_is_refused_it_cannot_be_replayed():
    refused(tf_keras.layers.Dropout(0.2), "replayed")


def test_tf_keras_gaussian_noise_is_refused_too():
    refused(tf_keras.layers.GaussianNoise(0.1), "replayed")
