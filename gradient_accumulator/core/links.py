"""An accumulator's links, Python-side and never saved: to its host (a
:class:`Binding`), to the accumulator it follows or those that follow it,
and to its parts (one accumulator per extra loss denominator).

:class:`Links` is the part of :class:`~gradient_accumulator.core.engine.Engine`
that makes and breaks these links and reads them for a cycle's end (a
mixin: it reads the engine's ``_wiring``, ``_parts``, ``_prefix`` and
``state`` and makes parts with its ``_new_part`` hook); :class:`Wiring`
holds them. A :class:`Group` is one accumulator's share of an update, which
a follower records for its leader and a host's binding gives at a flush.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import tensorflow as tf

from gradient_accumulator.core import arithmetic, engine_state

ApplyFn = Callable[[list], None]


def ignore(grads) -> None:
    # A part's mean joins its leader's gradient; it applies nothing itself.
    return None


class Wiring:
    """Python-side links of an accumulator, kept out of checkpoints (a
    ``tf.Module`` would track them as state): its leader and followers, the
    group a follower recorded for its leader while a step is traced, which
    variables had gradients in the last traced step, the host's binding (how
    to end a cycle outside the train step) and the compiled flush functions.

    Nothing here is state: it is rebuilt from the host at every trace, and
    :meth:`Engine.unwire` drops the traced parts when the host is
    compiled again.
    """

    def __init__(self):
        self.leader: Links | None = None
        self.followers: list[Links] = []
        self.pending: Group | None = None
        self.present: dict[int, bool] = {}
        self.binding: Binding | None = None
        self.flush_fns: dict = {}
        # A part of its leader (see Engine.part): its mean joins the
        # leader's gradient instead of being applied on its own.
        self.joins = False
        # The host reports overflowed micro-batches (Engine.add).
        self.overflows = False


@dataclass
class Binding:
    """How a host ends a cycle outside its train step (flush, drop), and
    names its variables in saved state.

    ``variables()``: the variables the state is built for (current trainable
    variables); ``apply_fn()``: the :data:`ApplyFn` to use now (read at call
    time, so a recompiled host's new optimizer is used); ``hooks()``:
    ``(on_apply, on_skip)`` for the engine; ``strategy()``: the host's
    ``tf.distribute`` strategy; ``names(variables)``: a name per variable
    that is the same for the same variable in another instance of the host
    (a saved file is matched by these names), by default its path.
    """

    variables: Callable[[], list]
    apply_fn: Callable[[], ApplyFn]
    hooks: Callable[[], tuple] = lambda: (None, None)
    strategy: Callable[[], tf.distribute.Strategy] = tf.distribute.get_strategy
    names: Callable[[list], list[str]] | None = None


@dataclass
class Group:
    """One accumulator's part of an update: what to read, apply and reset."""

    accumulator: Links
    variables: list
    buffers: list
    present: list
    apply_fn: ApplyFn


class Links:
    """Binding to a host, following a leader, and parts: the links of an
    :class:`~gradient_accumulator.core.engine.Engine` (see the module)."""

    def bind(self, binding: Binding) -> None:
        """Tells the engine how its host ends a cycle outside a train step."""
        self._wiring.binding = binding

    def unwire(self) -> None:
        """Forgets everything traced (the host was compiled again)."""
        self._wiring.flush_fns.clear()
        self._wiring.pending = None
        self._wiring.overflows = False

    def part(self, index: int, variables: Sequence) -> Links:
        """The accumulator of this one's ``index``-th extra denominator
        (1, 2, ...), built for ``variables`` (those its loss terms reach).

        A loss whose terms the big batch divides by different totals (tokens
        and sequences, positives and anchors) is exact only if each term's
        gradients are summed apart and divided by their own total at the
        cycle's end. A part holds one such sum and its total; at the end of
        the cycle its mean is added to this accumulator's before anything
        else (AGC, ``skip_update_fn``, the finite check, the apply) sees it,
        in the same all-reduce. Hosts :meth:`add` to it and end its micro-step
        with :meth:`end_micro_step` before this accumulator's own.
        Made on first use (eagerly, also from a traced step).
        """
        if index < 1 or index > len(self._parts) + 1:
            raise ValueError(
                f"part index must be between 1 and {len(self._parts) + 1}, "
                f"got {index!r}."
            )
        variables = [v for v in variables if not arithmetic.overwritten(v)]
        with tf.init_scope():
            if index > len(self._parts):
                part = self._new_part(f"{self._prefix}_part{index}")
                part._wiring.joins = True
                part.follow(self)
                self._parts.append(part)
                # A cycle ended outside the step must now end the part's too.
                self._wiring.flush_fns.clear()
            part = self._parts[index - 1]
            # Named as the leader names its sums, so that a file's parts
            # match another instance of the host.
            names = self._wiring.binding.names if self._wiring.binding else None
            part.bind(
                Binding(
                    variables=lambda: variables,
                    apply_fn=lambda: ignore,
                    names=names,
                )
            )
            part.build(variables)
        return part

    def add_part(
        self, index: int, grads: Sequence, variables: Sequence, weight=None, count=None
    ) -> None:
        """Adds one micro-batch (or slice) of the ``index``-th extra
        denominator's gradients to its :meth:`part` (replica context, no
        communication); this accumulator's next :meth:`end_micro_step`
        takes it into the cycle. ``weight``, ``count``: see :meth:`add`."""
        pairs = [
            (g, v)
            for g, v in zip(grads, variables)
            if g is not None and not arithmetic.overwritten(v)
        ]
        reached = [v for _, v in pairs]
        part = self.part(index, reached)
        present = part.add([g for g, _ in pairs], reached, weight, count)
        part.end_micro_step(reached, present, ignore)

    @property
    def parts(self) -> tuple[Links, ...]:
        """The extra denominators' accumulators made so far (see :meth:`part`)."""
        return tuple(self._parts)

    def _drop_parts(self) -> None:
        for part in self._parts:
            part.unfollow()
        self._parts = []

    def follow(self, leader: Links) -> None:
        """Lets ``leader`` decide, reduce and apply this accumulator's cycles."""
        if leader is self:
            raise ValueError("An accumulator cannot follow itself.")
        if self._wiring.leader is leader:
            return
        if self._wiring.leader is not None:
            self._wiring.leader._wiring.followers.remove(self)
        self._wiring.leader = leader
        leader._wiring.followers.append(self)

    def unfollow(self) -> None:
        """Makes this accumulator decide its own cycles again."""
        if self._wiring.leader is not None:
            self._wiring.leader._wiring.followers.remove(self)
            self._wiring.leader = None

    @property
    def leader(self) -> Links | None:
        return self._wiring.leader

    @property
    def joins(self) -> bool:
        """Whether this accumulator is a :meth:`part` of its leader: its mean
        joins the leader's gradient instead of being applied."""
        return self._wiring.joins

    @property
    def clock(self) -> Links:
        """The accumulator whose counter decides when cycles end."""
        return self if self._wiring.leader is None else self._wiring.leader

    def _take_follower_groups(self) -> list[Group]:
        """The groups this accumulator's followers recorded in this step,
        taken (each is consumed by one update)."""
        groups = []
        for follower in self._wiring.followers:
            if follower._wiring.pending is not None:
                groups.append(follower._wiring.pending)
                follower._wiring.pending = None
        return groups

    def _group_now(self) -> Group | None:
        """This accumulator's part of a cycle ended outside the train step,
        from its host's binding as it is now (variables, optimizer); None
        before it is built or bound."""
        binding = self._wiring.binding
        if not self.built or binding is None:
            return None
        variables = list(binding.variables())
        buffers = engine_state.sums_for(self.state, variables)
        # Which variables had gradients is structural: as in the last traced
        # step, or all of them before any step was traced (a loaded model).
        present = [self._wiring.present.get(id(b), True) for b in buffers]
        return Group(self, variables, buffers, present, binding.apply_fn())
