"""A quiet TensorFlow start-up for this project's own commands.

Used by the ``gradient-accumulator`` command, the demo and the examples for
their own process, never by the library: importing ``gradient_accumulator``
leaves a user's environment and logging alone.
"""

from __future__ import annotations

import os
import sys
import tempfile


def quiet_tensorflow() -> None:
    """Imports TensorFlow without its start-up lines.

    Sets ``TF_CPP_MIN_LOG_LEVEL=3`` (unless the environment sets it: export
    ``TF_CPP_MIN_LOG_LEVEL=0`` to see everything again) and ``KERAS_BACKEND``,
    then imports TensorFlow and Keras with the process's standard error
    redirected to a temporary file: the lines TensorFlow's C++ runtime writes
    before its log level applies ("All log messages before
    absl::InitializeLog() ...", "Could not find cuda drivers ...") go there,
    and are written out only if the import fails. Call it before anything
    imports TensorFlow; afterwards it does nothing.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    if "tensorflow" in sys.modules:
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            import keras  # noqa: F401
            import tensorflow  # noqa: F401
        except BaseException:
            os.dup2(saved, 2)
            captured.seek(0)
            sys.stderr.write(captured.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
