"""When a model wrapper ends a partial cycle during ``fit``: the callbacks
each host's ``fit`` adds, written once for Keras 3 and tf-keras (a host mixes
:class:`PartialCycles` into its Keras' ``Callback``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable


class PartialCycles:
    """Applies the model's ``partial_cycle`` policy at epoch and fit ends.

    ``fit`` gets two: the first in its callback list acts at every epoch end
    (before other callbacks see the weights); the ``closing`` one, last,
    ends a carried cycle when another callback stopped training. Both act
    at the last epoch's end rather than at ``on_train_end``, because Keras
    swaps EMA weights in (``finalize_variable_values``) between the two.
    """

    def __init__(self, model, closing: bool = False):
        super().__init__()
        self._owner = model
        self._closing = closing

    def _end_fit(self) -> None:
        owner = self._owner
        # A FlushPartialCycle callback's end-of-fit action comes first.
        end = getattr(owner, "_end_of_fit", None)
        if end is not None:
            owner._end_of_fit = None
            end()
        if owner._partial_cycle == "drop":
            owner.drop_partial_cycle()
        elif owner._flush_at_end:
            owner.flush()

    def on_epoch_end(self, epoch, logs=None):
        owner = self._owner
        if self._closing:
            if owner.stop_training:
                self._end_fit()
        elif owner._partial_cycle == "flush":
            owner.flush()
        elif owner._partial_cycle == "drop":
            owner.drop_partial_cycle()
        elif epoch + 1 >= (getattr(self, "params", None) or {}).get("epochs", 0):
            self._end_fit()

    def on_train_end(self, logs=None):
        # Nothing is pending here unless fit ended outside an epoch end.
        if not self._closing:
            self._end_fit()


def fit_with_partial_cycles(
    fit: Callable, model, callback: type, callback_list: type, args, kwargs
):
    """Calls Keras' ``fit`` with the model's two :class:`PartialCycles`
    callbacks (``callback``: the host's subclass) around the user's."""
    # Keras' fit takes callbacks as its sixth positional argument; a model
    # class may have its own fit (keras-hub tasks do): find them by its
    # signature.
    signature = inspect.signature(fit)
    bound = signature.bind(*args, **kwargs)
    named = signature.parameters.get("callbacks")
    if named is not None and named.kind is not inspect.Parameter.VAR_KEYWORD:
        place = bound.arguments
    else:
        extra = next(
            p.name
            for p in signature.parameters.values()
            if p.kind is inspect.Parameter.VAR_KEYWORD
        )
        place = bound.arguments.setdefault(extra, {})
    callbacks = place.get("callbacks")
    # First, so that other callbacks see the weights after a flush; a second
    # one last, which sees whether a callback stopped training.
    head, tail = callback(model), callback(model, closing=True)
    if isinstance(callbacks, callback_list):
        callbacks.callbacks.insert(0, head)
        callbacks.callbacks.append(tail)
    else:
        place["callbacks"] = [head, *(callbacks or []), tail]
    return fit(*bound.args, **bound.kwargs)
