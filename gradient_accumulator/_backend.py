"""Fails at import, with a clear message, on any Keras backend but TensorFlow."""

import keras

if keras.config.backend() != "tensorflow":
    raise ImportError(
        "gradient_accumulator supports only the TensorFlow backend of Keras 3, "
        f"but KERAS_BACKEND is {keras.config.backend()!r}. Set "
        "KERAS_BACKEND=tensorflow (or remove the setting) before importing it."
    )
