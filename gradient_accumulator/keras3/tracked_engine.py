"""``Accumulator``: the engine with Keras 3 variables and Keras saving.

The rules live in :mod:`gradient_accumulator.core.engine`; this class only makes
the engine's variables Keras variables (which a Keras layer or optimizer can
track as its own) and lets ``.keras`` files and ``save_weights`` hold the
state of a host that does not track it.
"""

from __future__ import annotations

from collections.abc import Callable

import keras

from gradient_accumulator.core.engine import Engine
from gradient_accumulator.core.settings import Settings
from gradient_accumulator.keras3._compat import KerasSaveable


class Accumulator(Engine, KerasSaveable):
    """Accumulation state and its add / apply / reset rules, in Keras 3
    variables (see :class:`~gradient_accumulator.core.engine.Engine`).

    The state's home is the accumulator itself, never its host's weight
    lists (so a wrapped model's ``weights``, ``get_weights`` and
    ``count_params`` are the plain model's): as a ``tf.Module`` a host's
    ``tf.train.Checkpoint`` reaches it under stable names
    (``<host>/_accumulator/grad_sums/0``, ...), and as a Keras saveable
    ``.keras`` files and ``save_weights`` hold it under
    ``<host>/_accumulator``, a path a plain model never reads. A host that
    wants the state among its own variables instead (an optimizer, a layer)
    passes ``track``.

    Args:
        settings: see :class:`~gradient_accumulator.core.engine.Engine` (an
            ``int`` with keywords is taken as there).
        track: if given, called with every variable the engine creates, so
            that the host tracks and saves it as its own.
        name: see :class:`~gradient_accumulator.core.engine.Engine`.
    """

    def __init__(
        self,
        settings: Settings | int,
        track: Callable[[keras.Variable], None] | None = None,
        name: str = "accumulator",
        **engine_settings,
    ):
        super().__init__(settings, name=name, **engine_settings)
        self._track = track

    def _make_variable(self, name, shape, dtype, initializer, **kwargs):
        variable = keras.Variable(
            initializer=initializer,
            shape=shape,
            dtype=dtype,
            trainable=False,
            # A layer's step runs inside Keras' autocast scope, where reading
            # an autocast float variable yields a float16 copy, not the state.
            autocast=False,
            name=name,
            **kwargs,
        )
        if self._track is not None:
            self._track(variable)
        return variable

    def _new_part(self, name: str) -> Accumulator:
        return Accumulator(self._part_settings(), track=self._track, name=name)

    # ----------------------------------------------------------- Keras saving
    def _obj_type(self) -> str:
        # Keras' saving walks a saveable's attributes (minus a layer's) for
        # child saveables; see __dir__.
        return "Layer"

    def __dir__(self):
        # The state has no child saveables, and Keras' saving evaluates every
        # attribute it lists: properties would read variables, and `clock`
        # (this accumulator or its leader) would send it round in circles.
        # The parts' state is this accumulator's own (under "part<i>:" keys).
        cls = type(self)
        return [
            n
            for n in super().__dir__()
            if n != "_parts" and not isinstance(getattr(cls, n, None), property)
        ]

    def save_own_variables(self, store) -> None:
        """Keras saving: writes the state (unless the host saves it)."""
        if self._track is None:
            for key, variable in self.state_items():
                store[key] = variable

    def load_own_variables(self, store) -> None:
        """Keras loading: see :meth:`Engine.load_state`."""
        if self._track is None:
            self.load_state(store)
