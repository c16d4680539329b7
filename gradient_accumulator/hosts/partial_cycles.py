"""When a model wrapper ends a partial cycle during ``fit``: the policy of
one ``fit`` call and the callbacks each host's ``fit`` adds to apply it,
written once for Keras 3 and tf-keras (a host mixes :class:`PartialCycles`
into its Keras' ``Callback``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable


def epoch_end_policy(partial_cycle: str, steps_per_epoch) -> str:
    """What one ``fit`` does at each epoch end: ``partial_cycle``, with
    ``"auto"`` resolved. An epoch that is a pass over the data (no
    ``steps_per_epoch``) ends like plain Keras' epoch, whose last batch is
    short: ``"epoch"``, a flush at every epoch end but the last, where
    ``flush_at_end`` decides as for ``"carry"``. Epochs cut from a stream by
    ``steps_per_epoch`` are spans of one stream of batches, which plain Keras
    never cuts short: ``"carry"``."""
    if partial_cycle != "auto":
        return partial_cycle
    return "epoch" if steps_per_epoch is None else "carry"


class PartialCycles:
    """Applies one ``fit``'s epoch-end ``policy`` (``"carry"``, ``"epoch"``,
    ``"flush"`` or ``"drop"``, see :func:`epoch_end_policy`) at epoch and
    fit ends.

    ``fit`` gets two: the first in its callback list acts at every epoch end
    (before other callbacks see the weights); the ``closing`` one, last,
    ends a carried cycle when another callback stopped training. Both act
    at the last epoch's end rather than at ``on_train_end``, because Keras
    swaps EMA weights in (``finalize_variable_values``) between the two.
    """

    def __init__(self, model, policy: str, closing: bool = False):
        super().__init__()
        self._owner = model
        self._policy = policy
        self._closing = closing

    def _end_fit(self) -> None:
        owner = self._owner
        # A FlushPartialCycle callback's end-of-fit action comes first.
        end = getattr(owner, "_end_of_fit", None)
        if end is not None:
            owner._end_of_fit = None
            end()
        if self._policy == "drop":
            owner.drop_partial_cycle()
        elif owner._flush_at_end:
            owner.flush()

    def on_epoch_end(self, epoch, logs=None):
        owner = self._owner
        if self._closing:
            if owner.stop_training:
                self._end_fit()
        elif self._policy == "flush":
            owner.flush()
        elif self._policy == "drop":
            owner.drop_partial_cycle()
        elif epoch + 1 >= (getattr(self, "params", None) or {}).get("epochs", 0):
            self._end_fit()
        elif self._policy == "epoch":
            owner.flush()

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
    policy = epoch_end_policy(model._partial_cycle, place.get("steps_per_epoch"))
    # First, so that other callbacks see the weights after a flush; a second
    # one last, which sees whether a callback stopped training.
    head = callback(model, policy)
    tail = callback(model, policy, closing=True)
    if isinstance(callbacks, callback_list):
        callbacks.callbacks.insert(0, head)
        callbacks.callbacks.append(tail)
    else:
        place["callbacks"] = [head, *(callbacks or []), tail]
    return fit(*bound.args, **bound.kwargs)
