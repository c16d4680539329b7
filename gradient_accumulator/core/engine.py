"""The accumulation engine, in plain TensorFlow: the one place where the
rules of accumulation live. It imports no Keras; each host (the Keras 3 model
and optimizer wrappers, the batch-normalisation layer) translates its own
objects into the calls below.

An :class:`Engine` keeps, in float32 variables its host creates (see
:meth:`Engine._make_variable`) and saves:

* ``grad_sums[i] = sum_k w_k * g_k[i]``: the weighted sum of micro-batch
  gradients for every trainable variable ``i``;
* ``weight_sum = sum_k c_k``: the sum of the micro-batches' shares ``c_k`` of
  the big batch's denominator (usually ``c_k = w_k``);
* ``micro_step``: how many micro-batches the current cycle holds;
* ``empty``: True while ``grad_sums`` hold only the last cycle's leftovers (a
  cycle's first micro-batch overwrites them, which is cheaper than zeroing
  them at every update and adding to zeros);
* ``accum_steps``: micro-batches per cycle (a variable, so a schedule can
  change it between cycles and a checkpoint restores it);
* ``last_grad_norm`` and ``last_batch``: the global norm of the last applied
  gradient and how many samples its cycle held, for logs;
* ``overflows``: how many micro-batches of the cycle overflowed at the loss
  scale and were differentiated again at a smaller seed (the host reports
  them; the scale's ``on_apply`` hook halves the scale after such a cycle);
* ``parts``: an accumulator per extra loss denominator (:meth:`Engine.part`).

The interface, for hosts (which never read these variables themselves):

* :meth:`~Engine.build` for a list of variables; :meth:`~Engine.step` one
  micro-batch (or :meth:`~Engine.add` slices, then
  :meth:`~Engine.end_micro_step`); :meth:`~Engine.flush` /
  :meth:`~Engine.drop` a partial cycle;
* queries: :meth:`~Engine.opens_cycle` (does the next micro-batch open a
  cycle), :meth:`~Engine.plain` (is every cycle one micro-batch with
  nothing to do), :meth:`~Engine.logs`, :attr:`~Engine.pending`,
  :attr:`~Engine.accum_steps`;
* saving: :meth:`~Engine.state_items` and :meth:`~Engine.load_state`.

The one decision is made in :meth:`Engine._end_micro_step`: a micro-batch
ends its cycle when ``micro_step + 1 >= accum_steps``. Then the engine hands
``grad_sums / weight_sum`` (summed over replicas under a ``tf.distribute``
strategy, in one all-reduce) to the host's ``apply_fn`` if it is finite (and
``skip_update_fn`` agrees), and resets. Variables overwritten with their
gradient (float8 scales and amax histories) are the exception: their buffers
keep the cycle's maximum, unweighted and undivided (:func:`overwritten`).

Choosing a micro-batch's weight is the host's job (``weighting.py``): the
model wrapper uses the denominator Keras' loss reduction used for that
micro-batch, which makes the applied gradient exactly the big batch's.

An engine may *follow* another (:meth:`Engine.follow`): it then only adds,
and the leader decides, all-reduces (in the same single all-reduce) and
applies for both. This is how batch-normalisation statistics follow the
model's cycle with one counter.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import tensorflow as tf

from gradient_accumulator.core import arithmetic, saved_state
from gradient_accumulator.core.agc import adaptive_clip_grad
from gradient_accumulator.core.validation import (
    check_accum_steps,
    check_engine_settings,
)

ApplyFn = Callable[[list], None]


def _nothing(*_) -> None:
    return None


def _ignore(grads) -> None:
    # A part's mean joins its leader's gradient; it applies nothing itself.
    return None


def _name_of(variable) -> str:
    # Raw tf.Variables have no Keras path.
    name = getattr(variable, "path", None) or variable.name.split(":")[0]
    return name.replace("/", "_")


def _call(fn, *args) -> None:
    # tf.cond needs both branches to return the same (here: nothing).
    fn(*args)


class _Wiring:
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
        self.leader: Engine | None = None
        self.followers: list[Engine] = []
        self.pending: _Group | None = None
        self.keys: tuple = ()
        self.paths: tuple = ()
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
class _Group:
    """One accumulator's part of an update: what to read, apply and reset."""

    accumulator: Engine
    variables: list
    buffers: list
    present: list
    apply_fn: ApplyFn


class Engine(tf.Module):
    """Accumulation state and its add / decide / apply / reset rules.

    A ``tf.Module``, so a host's ``tf.train.Checkpoint`` reaches the state
    under stable names (``<host>/_accumulator/grad_sums/0``, ...). Its
    variables are made by :meth:`_make_variable`, which a host overrides to
    make its own kind (Keras variables, tracked by a layer or an optimizer).

    Args:
        accum_steps: micro-batches per optimizer update (an ``int >= 1``).
        name: prefix for the variables' names.
        use_agc: apply adaptive gradient clipping to the accumulated gradient.
        clip_factor, eps: adaptive gradient clipping parameters.
        skip_update_fn: optional ``fn(grads, variables) -> bool scalar``
            called at the end of each cycle with the mean gradient (before
            AGC); a True result drops the cycle as a non-finite one would.
    """

    def __init__(
        self,
        accum_steps: int,
        name: str = "accumulator",
        use_agc: bool = False,
        clip_factor: float = 0.01,
        eps: float = 1e-3,
        skip_update_fn: Callable[[list, list], tf.Tensor] | None = None,
    ):
        super().__init__(name=name)
        # The configured cycle length; once built, the variables hold it.
        self._initial_accum_steps = check_accum_steps(accum_steps)
        self.use_agc, self.clip_factor, self.eps, self.skip_update_fn = (
            check_engine_settings(use_agc, clip_factor, eps, skip_update_fn)
        )
        self._prefix = name
        self._wiring = _Wiring()
        # Extra denominators' accumulators (see part()): tracked, so that a
        # checkpoint holds their sums with the rest of the state.
        self._parts: list[Engine] = []
        self.built = False

    # ------------------------------------------------------------------ state
    def _make_variable(
        self,
        name: str,
        shape,
        dtype: str,
        initializer,
        synchronization: str = "auto",
        aggregation: str = "none",
    ):
        """Creates one state variable (never trainable). Hosts override this
        to make their framework's variables; ``synchronization`` and
        ``aggregation`` are ``tf.VariableSynchronization`` /
        ``tf.VariableAggregation`` names in lower case."""
        value = tf.zeros(shape, dtype) if initializer == "zeros" else initializer
        return tf.Variable(
            tf.cast(tf.broadcast_to(value, shape), dtype),
            trainable=False,
            name=name,
            synchronization=getattr(
                tf.VariableSynchronization, synchronization.upper()
            ),
            aggregation=getattr(tf.VariableAggregation, aggregation.upper()),
        )

    def _new_variable(self, name, shape, dtype, initializer="zeros", **kwargs):
        return self._make_variable(
            f"{self._prefix}_{name}", shape, dtype, initializer, **kwargs
        )

    def build(self, variables: Sequence) -> bool:
        """Creates the state for gradients of ``variables``.

        Called again with other variables (layers were frozen or unfrozen),
        it builds new gradient sums and starts an empty cycle: partial sums
        are never carried across a change of the trainable set. Returns True
        if it (re)built anything. Eager, under the host's strategy scope.
        """
        variables = list(variables)
        keys = tuple(arithmetic.var_key(v) for v in variables)
        if self.built and keys == self._wiring.keys:
            return False
        # Replica-local sums: every replica adds its own micro-batches without
        # communicating; reading them in cross-replica context sums over the
        # replicas, which is the single all-reduce of an update. A checkpoint
        # saves that sum and restores it split evenly, so the total survives.
        local = {"synchronization": "on_read", "aggregation": "sum"}
        first = {"aggregation": "only_first_replica"}
        if self.built:
            self._restart_eagerly()
            # The host asks for its parts again, for the new variables.
            self._drop_parts()
        else:
            steps = self._initial_accum_steps
            self.micro_step = self._new_variable("micro_step", (), "int64", **first)
            self.accum_steps_variable = self._new_variable(
                "accum_steps", (), "int64", initializer=steps, **first
            )
            # What accum_steps becomes at the next cycle boundary.
            self.next_accum_steps = self._new_variable(
                "next_accum_steps", (), "int64", initializer=steps, **first
            )
            self.weight_sum = self._new_variable("weight_sum", (), "float32", **local)
            self.sample_sum = self._new_variable("sample_sum", (), "float32", **local)
            # Micro-batches of the cycle whose backward pass overflowed at the
            # loss scale and was redone at a smaller seed (see add).
            self.overflows = self._new_variable("overflows", (), "float32", **local)
            # True while grad_sums hold only leftovers of the last cycle:
            # cycles end without zeroing them (see _add).
            self.empty = self._new_variable(
                "empty",
                (),
                "bool",
                initializer=True,
                synchronization="on_read",
                aggregation="only_first_replica",
            )
            self.last_grad_norm = self._new_variable(
                "last_grad_norm", (), "float32", **first
            )
            self.last_batch = self._new_variable("last_batch", (), "float32", **first)
        self.grad_sums = [
            self._new_variable(f"{_name_of(v)}_grad_sum", v.shape, "float32", **local)
            for v in variables
        ]
        self._wiring.keys = keys
        binding = self._wiring.binding
        names = binding.names if binding and binding.names else saved_state.paths
        self._wiring.paths = saved_state.sum_keys(names(variables))
        self._wiring.present = {}
        self.built = True
        return True

    def state_items(self) -> list[tuple[str, tf.Variable]]:
        """``(key, variable)`` for every state variable: what a file holds,
        each gradient sum under its variable's path."""
        if not self.built:
            return []
        return [
            *(
                (name, getattr(self, attribute))
                for name, attribute in saved_state.COUNTERS
            ),
            *zip(self._wiring.paths, self.grad_sums),
            *(
                (saved_state.part_key(index, key), variable)
                for index, part in enumerate(self._parts, start=1)
                for key, variable in part.state_items()
            ),
        ]

    @property
    def variables(self) -> list:
        return [variable for _, variable in self.state_items()]

    @property
    def pending(self) -> int:
        """Micro-batches the current cycle holds (eager)."""
        return arithmetic.now(self.micro_step) if self.built else 0

    def opens_cycle(self) -> tf.Tensor:
        """A bool tensor: the next micro-batch opens a cycle (the one its
        leader, if it follows one, keeps)."""
        return tf.equal(self.clock.micro_step, 0)

    def cycle_length(self) -> tf.Tensor:
        """Micro-batches in the current cycle, a float32 tensor (read when
        the step runs, so a scheduled change is seen)."""
        return tf.cast(self.clock.accum_steps_variable, tf.float32)

    def plain(self) -> bool:
        """Whether every cycle is one micro-batch with nothing to do at its
        end (``accum_steps`` 1 now and next, nothing pending, no AGC and no
        ``skip_update_fn``): a host may then train as if it did not
        accumulate. Eager; a host asks when it traces its step and traces
        again when :meth:`set_accum_steps` says so."""
        if self.use_agc or self.skip_update_fn is not None:
            return False
        if not self.built:
            return self._initial_accum_steps == 1
        steps = (
            arithmetic.now(self.accum_steps_variable),
            arithmetic.now(self.next_accum_steps),
        )
        return steps == (1, 1) and self.pending == 0

    def logs(self) -> dict[str, tf.Tensor]:
        """Per-step log entries that tell updates from micro-steps."""
        return {
            # 1.0 on the steps that applied an update (or skipped a cycle).
            "update": tf.cast(self.opens_cycle(), tf.float32),
            # Global norm of the last applied mean gradient, before clipping.
            "grad_norm": tf.convert_to_tensor(self.last_grad_norm),
            # Samples (over all replicas) in the last applied cycle.
            "effective_batch": tf.convert_to_tensor(self.last_batch),
        }

    def load_state(self, store) -> None:
        """Reads the state a file holds (a mapping with :meth:`state_items`'
        keys); an empty one (a plain model's file, or one saved before any
        training) leaves the state as it is.

        Gradient sums are matched to variables by path. A file whose sums
        are of other trainable variables (layers frozen or unfrozen, LoRA
        enabled, a quantized model) still loads: its pending micro-batches
        are dropped, with a warning, and the cycle settings are kept.
        """
        if not list(store.keys()):
            return
        binding = self._wiring.binding
        if not self.built and binding is not None:
            with binding.strategy().scope():
                self.build(binding.variables())
        if not self.built:
            raise ValueError(
                "Build the accumulator (`build(variables)`) before loading "
                "its state: the file's sums are matched to those variables."
            )
        store, parts = saved_state.split_parts(store)
        buffers = dict(zip(self._wiring.paths, self.grad_sums))
        sums, counters, dropped = saved_state.read(
            store, {key: b.shape for key, b in buffers.items()}
        )
        for attribute, value in counters.items():
            getattr(self, attribute).assign(value)
        if sums is not None and self._load_parts(parts):
            for key, buffer in buffers.items():
                buffer.assign(sums[key])
            return
        self._restart_eagerly()
        if dropped:
            warnings.warn(
                f"The file's accumulation state holds {dropped} micro-batch(es) "
                "of an incomplete cycle for other trainable variables than this "
                "model's (layers frozen or unfrozen, LoRA enabled, a quantized "
                "model): they were dropped, and the next cycle starts empty. "
                "Weights and cycle settings are loaded as saved.",
                stacklevel=2,
            )

    def _load_parts(self, parts: dict) -> bool:
        """Builds and loads the parts a file holds (``{index: store}``);
        False if their sums are not of this host's variables."""
        if not parts:
            return True
        binding = self._wiring.binding
        if binding is None:
            return False
        variables = list(binding.variables())
        names = binding.names if binding.names else saved_state.paths
        by_key = dict(zip(saved_state.sum_keys(names(variables)), variables))
        for index in sorted(parts):
            store = parts[index]
            if index != len(self._parts) + 1 or not set(store) & set(by_key):
                return False
            part = self.part(index, [v for k, v in by_key.items() if k in store])
            part.load_state(store)
        return True

    def _restart_eagerly(self) -> None:
        """An empty cycle at a cycle boundary, in the state variables."""
        self.micro_step.assign(0)
        self.accum_steps_variable.assign(self.next_accum_steps)
        self.weight_sum.assign(0.0)
        self.sample_sum.assign(0.0)
        self.overflows.assign(0.0)
        self.empty.assign(True)
        for part in self._parts:
            part._restart_eagerly()

    @property
    def initial_accum_steps(self) -> int:
        """The cycle length the accumulator was configured with."""
        return self._initial_accum_steps

    @property
    def accum_steps(self) -> int:
        """Micro-batches per update (the latest value asked for; eager)."""
        if not self.built:
            return self._initial_accum_steps
        return arithmetic.now(self.next_accum_steps)

    def set_accum_steps(self, accum_steps: int) -> bool:
        """Changes ``accum_steps`` from the next cycle on (now, between cycles).

        Call eagerly, e.g. from a callback; partial sums are never mixed
        across two cycle lengths. Returns True when a step traced as
        :meth:`plain` must be traced again (it no longer is).
        """
        accum_steps = check_accum_steps(accum_steps)
        was_plain = self.plain()
        if not self.built:
            self._initial_accum_steps = accum_steps
        else:
            self.next_accum_steps.assign(accum_steps)
            if self.pending == 0:
                self.accum_steps_variable.assign(accum_steps)
        return was_plain and not self.plain()

    # ------------------------------------------------------- host and links
    def bind(self, binding: Binding) -> None:
        """Tells the engine how its host ends a cycle outside a train step."""
        self._wiring.binding = binding

    def unwire(self) -> None:
        """Forgets everything traced (the host was compiled again)."""
        self._wiring.flush_fns.clear()
        self._wiring.pending = None
        self._wiring.overflows = False

    def part(self, index: int, variables: Sequence) -> Engine:
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
                    apply_fn=lambda: _ignore,
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
        part.end_micro_step(reached, present, _ignore)

    @property
    def parts(self) -> tuple[Engine, ...]:
        """The extra denominators' accumulators made so far (see :meth:`part`)."""
        return tuple(self._parts)

    def _new_part(self, name: str) -> Engine:
        """A new, unbuilt accumulator of this one's kind, for :meth:`part`
        (hosts that make their own variables override this)."""
        return Engine(self._initial_accum_steps, name=name)

    def _drop_parts(self) -> None:
        for part in self._parts:
            part.unfollow()
        self._parts = []

    def follow(self, leader: Engine) -> None:
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
    def leader(self) -> Engine | None:
        return self._wiring.leader

    @property
    def clock(self) -> Engine:
        """The accumulator whose counter decides when cycles end."""
        return self if self._wiring.leader is None else self._wiring.leader

    # ------------------------------------------------------------------- rules
    def add(
        self,
        grads: Sequence,
        variables: Sequence,
        weight=None,
        count=None,
        samples=None,
        empty=None,
        overflowed=None,
    ) -> list[bool]:
        """Adds one micro-batch to this replica's sums (no communication).

        ``sum(weight * grad)`` and ``sum(count)`` grow; ``weight=None`` adds the
        gradients as they are (the host folded the weight into its loss).
        ``count`` defaults to ``weight`` (``1`` when that is None); ``samples``
        (for logs) to 0. ``empty``: the ``empty`` flag, if already read, or
        ``False`` after :meth:`open_sums` (the sums are running sums then).
        ``overflowed``: a bool tensor, True if the micro-batch's backward pass
        overflowed at the loss scale and was redone at a smaller seed; the
        cycle's ``on_apply`` hook is then told so. Returns which gradients
        were present.
        """
        self._note_overflow(overflowed)
        buffers = self._buffers_for(variables)
        if weight is not None:
            weight = tf.cast(weight, tf.float32)

        maxima = [arithmetic.overwritten(v) for v in variables]

        def add_all(first):
            for grad, buffer, maximum in zip(grads, buffers, maxima):
                if grad is not None:
                    arithmetic.add_into(buffer, grad, weight, first, maximum)
            if first:
                # A variable without a gradient now may get one later in the
                # cycle: its sum must start from zero, not from leftovers.
                added = {id(b) for b, g in zip(buffers, grads) if g is not None}
                for buffer in self.grad_sums:
                    if id(buffer) not in added:
                        arithmetic.raw(buffer).assign(
                            tf.zeros(buffer.shape, buffer.dtype)
                        )

        if empty is False:
            add_all(False)
        else:
            if empty is None:
                empty = arithmetic.raw(self.empty)
            tf.cond(empty, lambda: add_all(True), lambda: add_all(False))
            arithmetic.raw(self.empty).assign(False)
        if count is None:
            count = 1.0 if weight is None else weight
        arithmetic.raw(self.weight_sum).assign_add(tf.cast(count, tf.float32))
        if samples is not None:
            arithmetic.raw(self.sample_sum).assign_add(tf.cast(samples, tf.float32))
        return [g is not None for g in grads]

    def _note_overflow(self, overflowed) -> None:
        if overflowed is not None:
            # Structural, like `present`: the host's on_apply takes the flag.
            self._wiring.overflows = True
            arithmetic.raw(self.overflows).assign_add(tf.cast(overflowed, tf.float32))

    def open_sums(self, variables: Sequence) -> None:
        """Readies the sums for several :meth:`add` calls in one micro-step
        (the slices of an in-step loop): an empty cycle's sums are cleared
        here, once, so that each add after it (``empty=False``) adds
        without a cond of its own. Replica context; no communication."""
        maxima = {
            id(b)
            for b, v in zip(self._buffers_for(variables), variables)
            if arithmetic.overwritten(v)
        }

        def clear():
            for buffer in self.grad_sums:
                # A cycle maximum starts below every value it will see.
                dtype = tf.as_dtype(buffer.dtype)
                fill = dtype.min if id(buffer) in maxima else 0
                value = tf.fill(buffer.shape, tf.constant(fill, dtype))
                arithmetic.raw(buffer).assign(value)

        empty = arithmetic.raw(self.empty)
        tf.cond(empty, clear, lambda: None)
        empty.assign(False)

    def step(
        self,
        grads: Sequence,
        variables: Sequence,
        apply_fn: ApplyFn,
        weight=None,
        count=None,
        samples=None,
        on_apply: Callable[..., None] | None = None,
        on_skip: Callable[[], None] | None = None,
        overflowed=None,
    ) -> tf.Tensor | None:
        """Adds one micro-batch; applies and resets at the end of a cycle.

        Args:
            grads: the micro-batch's gradients (``None`` where a variable has
                none), in the order of ``variables``.
            variables: the trainable variables the gradients belong to.
            apply_fn: called on the last micro-batch of a cycle, in replica
                context, with the accumulated gradients (``None`` kept in
                place), already summed over replicas: it must not all-reduce
                again (see ``distributed.already_reduced``).
            weight, count, samples: see :meth:`add`. The gradient applied is
                ``sum(weight * grad) / sum(count)``.
            on_apply: called, in cross-replica context, after ``apply_fn``;
                for a host that reports ``overflowed`` (see :meth:`add`), with
                a bool tensor: True if a micro-batch of the cycle overflowed
                at the loss scale.
            on_skip: called, in cross-replica context, instead of ``apply_fn``
                when the accumulated gradient holds a NaN or an Inf (or
                ``skip_update_fn`` says so). The cycle is dropped either way.

        Returns:
            A scalar bool tensor, True on micro-batches that ended a cycle;
            ``None`` for a follower, whose leader decides.
        """
        self._note_overflow(overflowed)
        last = None
        if self._wiring.leader is None and not tf.distribute.has_strategy():
            # Without a strategy the cycle's last micro-batch goes straight
            # into the applied sums rather than through the buffers (as
            # Keras' own accumulation does): a write and a read of every
            # gradient fewer per update.
            present = [g is not None for g in grads]
            last = (list(grads), weight, count, samples)
        else:
            present = self.add(grads, variables, weight, count, samples)
        return self.end_micro_step(
            variables,
            present,
            apply_fn,
            on_apply,
            on_skip,
            last=last,
            after=[*grads, weight, count],
        )

    def end_micro_step(
        self,
        variables: Sequence,
        present: Sequence[bool],
        apply_fn: ApplyFn,
        on_apply: Callable[..., None] | None = None,
        on_skip: Callable[[], None] | None = None,
        last=None,
        after: Sequence = (),
    ) -> tf.Tensor | None:
        """Ends a micro-step whose gradients :meth:`add` already added
        (``present`` as it returned); applies and resets if the cycle is
        complete. ``after``: tensors computed from the micro-batch's data,
        which every state change of the micro-step waits for. Replica
        context; see :meth:`step` for the other arguments."""
        group = _Group(
            self, list(variables), self._buffers_for(variables), list(present), apply_fn
        )
        self._wiring.present = {id(b): p for b, p in zip(group.buffers, group.present)}
        if self._wiring.leader is not None:
            # Consumed by the leader's step later in the same traced function.
            self._wiring.pending = group
            return None
        # Keras ends an epoch of unknown length by running the train function
        # once more on the exhausted iterator: the counter's update does not
        # read the data, so without this dependency it would run before the
        # end-of-data error and count a micro-batch that never came.
        with tf.control_dependencies(arithmetic.dense(after)):
            token = tf.zeros([])
        # A closure, not merge_call args: args are regrouped per replica, and
        # the (identical) mirrored objects are wanted, not PerReplica bundles.
        end = functools.partial(
            self._end_micro_step,
            group=group,
            last=last,
            on_apply=on_apply or _nothing,
            on_skip=on_skip or _nothing,
        )
        return tf.distribute.get_replica_context().merge_call(end, args=(token,))

    def _buffers_for(self, variables):
        keys = [arithmetic.var_key(v) for v in variables]
        index = {key: i for i, key in enumerate(self._wiring.keys)}
        if any(key not in index for key in keys):
            raise ValueError(
                "The gradient accumulator was built for other trainable "
                "variables than the ones training now. Call `compile()` "
                "again after changing which layers are trainable (Keras "
                "needs that too); the accumulation state is rebuilt then."
            )
        return [self.grad_sums[index[key]] for key in keys]

    def _end_micro_step(self, strategy, token, group, last, on_apply, on_skip):
        # Runs in cross-replica context: TensorFlow forbids merge_call (which
        # the all-reduce and Keras' optimizer use) inside a tf.cond in replica
        # context, so the conditionals live here and the optimizer is driven
        # back in replica context, as Keras' LossScaleOptimizer does.
        groups = [group, *self._take_followers()]

        def update():
            self._update(strategy, groups, last, on_apply, on_skip)

        def accumulate():
            if last is not None:
                grads, weight, count, samples, empty = last
                self.add(grads, group.variables, weight, count, samples, empty)
            self.micro_step.assign_add(1)

        if last is not None:
            # Read early, like the predicate below, for the same reason: the
            # cond on it inside either branch then waits for no copy.
            last = (*last, tf.convert_to_tensor(arithmetic.raw(self.empty)))

        # The predicate reads only the counter, not the micro-batch: on a GPU
        # its copy to the host (a cond's predicate is read there) overlaps the
        # forward and backward passes, as Keras' own accumulation's does.
        # Only the cond, which changes the state, waits for the data.
        is_update = self.micro_step + 1 >= self.accum_steps_variable
        with tf.control_dependencies(strategy.experimental_local_results(token)):
            tf.cond(is_update, update, accumulate)
        return is_update

    def _take_followers(self) -> list[_Group]:
        groups = []
        for follower in self._wiring.followers:
            if follower._wiring.pending is not None:
                groups.append(follower._wiring.pending)
                follower._wiring.pending = None
        return groups

    def _update(self, strategy, groups, last, on_apply, on_skip) -> None:
        replicated = strategy.num_replicas_in_sync > 1
        if replicated:
            # One all-reduce per update: every buffer and weight sum of every
            # group packed into a single vector.
            local = strategy.extended.call_for_each_replica(_pack, args=(groups,))
            total = strategy.extended.reduce_to(
                tf.distribute.ReduceOp.SUM, local, destinations=local
            )
            # Every replica holds the same total, so one copy decides for all.
            first = strategy.experimental_local_results(total)[0]
            sums = list(_unpack(first, groups))
            overflows = first[-1]
        else:
            total = None
            sums = [_read(g, last if i == 0 else None) for i, g in enumerate(groups)]
            overflows = tf.convert_to_tensor(arithmetic.raw(self.overflows))
        applied, sums = _join_parts(groups, sums)
        grads, weight_sum, samples = sums[0]
        inverse = tf.math.divide_no_nan(tf.constant(1.0), weight_sum)
        maxima = [arithmetic.overwritten(v) for v in applied[0].variables]
        # The leader's norm and every group's finite check in one pass (the
        # norm is of trained variables' gradients only).
        leader = arithmetic.squared_norm(
            [None if m else g for g, m in zip(grads, maxima)]
        )
        others = [t for g, w, _ in sums[1:] for t in (*g, w)]
        others += [g for g, m in zip(grads, maxima) if m]
        squares = leader + arithmetic.squared_norm([weight_sum, *others])
        ok = tf.math.is_finite(squares)
        if self.skip_update_fn is not None:
            mean = arithmetic.divide(grads, applied[0].variables, inverse)
            skip = tf.cast(self.skip_update_fn(mean, applied[0].variables), tf.bool)
            ok = tf.logical_and(ok, tf.logical_not(tf.reshape(skip, [])))

        def apply():
            # Replicas unpack the all-reduced total by every group, parts
            # included; without one the joined sums are already at hand.
            args = (groups, total, None) if replicated else (applied, None, sums)
            strategy.extended.call_for_each_replica(_apply_groups, args=args)
            self.last_grad_norm.assign(tf.sqrt(leader) * inverse)
            self.last_batch.assign(samples)
            if self._wiring.overflows:
                on_apply(overflows > 0)
            else:
                on_apply()

        def skip():
            self._each_replica(strategy, _zero, groups)
            on_skip()

        tf.cond(ok, apply, skip)
        self._restart(strategy, groups)

    @staticmethod
    def _each_replica(strategy, fn, groups) -> None:
        if strategy.num_replicas_in_sync > 1:
            strategy.extended.call_for_each_replica(fn, args=(groups,))
        else:
            fn(groups)

    def _restart(self, strategy, groups) -> None:
        self._each_replica(strategy, _reset, groups)
        self.micro_step.assign(0)
        self.accum_steps_variable.assign(self.next_accum_steps)

    def _mean(self, sums, weight_sum, group: _Group) -> list:
        # One multiply per gradient; an empty cycle (weight 0) applies zeros.
        inverse = tf.math.divide_no_nan(tf.constant(1.0), weight_sum)
        grads = arithmetic.divide(sums, group.variables, inverse)
        if self.use_agc:
            # Overwritten variables' new values are not clipped (nor are they
            # by Keras' clipping).
            trained = [
                i
                for i, v in enumerate(group.variables)
                if not arithmetic.overwritten(v)
            ]
            clipped = adaptive_clip_grad(
                [group.variables[i] for i in trained],
                [grads[i] for i in trained],
                self.clip_factor,
                self.eps,
            )
            for i, grad in zip(trained, clipped):
                grads[i] = grad
        return grads

    # ------------------------------------------------------- partial cycles
    def flush(self, strategy: tf.distribute.Strategy | None = None) -> None:
        """Applies what the current, incomplete cycle holds (weighted exactly
        as a big batch of just those micro-batches) and starts a new cycle.

        Eager; does nothing if the cycle is empty.
        """
        self._end_cycle_eagerly("flush", strategy)

    def drop(self, strategy: tf.distribute.Strategy | None = None) -> None:
        """Discards the current, incomplete cycle and starts a new one."""
        self._end_cycle_eagerly("drop", strategy)

    def _groupnow(self) -> _Group | None:
        """This accumulator's part of a cycle end, from its host's binding
        as it is now (variables, optimizer)."""
        binding = self._wiring.binding
        if not self.built or binding is None:
            return None
        variables = list(binding.variables())
        buffers = self._buffers_for(variables)
        # Which variables had gradients is structural: as in the last traced
        # step, or all of them before any step was traced (a loaded model).
        present = [self._wiring.present.get(id(b), True) for b in buffers]
        return _Group(self, variables, buffers, present, binding.apply_fn())

    def _end_cycle_eagerly(self, how: str, strategy) -> None:
        if self._wiring.leader is not None:
            raise ValueError(
                "This accumulator follows another one; flush or drop the "
                "cycle of the model it follows."
            )
        group = self._groupnow()
        if group is None or self.pending == 0:
            return
        binding = self._wiring.binding
        strategy = strategy or binding.strategy()
        key = (how, id(strategy))
        if key not in self._wiring.flush_fns:
            followers = [f._groupnow() for f in self._wiring.followers]
            groups = [group, *(g for g in followers if g is not None)]
            on_apply, on_skip = binding.hooks()

            def end():
                def run():
                    if how == "flush":
                        self._update(
                            strategy,
                            groups,
                            None,
                            on_apply or _nothing,
                            on_skip or _nothing,
                        )
                    else:
                        self._each_replica(strategy, _zero, groups)
                        self._restart(strategy, groups)

                tf.cond(self.micro_step > 0, run, _nothing)

            self._wiring.flush_fns[key] = tf.function(end)
        with strategy.scope():
            self._wiring.flush_fns[key]()


def _pack(groups: list[_Group]) -> tf.Tensor:
    parts = []
    replicas = tf.distribute.get_replica_context().num_replicas_in_sync
    for group in groups:
        for buffer, variable, present in zip(
            group.buffers, group.variables, group.present
        ):
            if not present:
                continue
            value = arithmetic.raw(buffer)
            if arithmetic.overwritten(variable):
                # The all-reduce sums: overwritten variables get the mean of
                # the replicas' cycle maxima.
                value = value / replicas
            parts.append(tf.reshape(value, [-1]))
        accumulator = group.accumulator
        parts.append(tf.reshape(arithmetic.raw(accumulator.weight_sum), [1]))
        parts.append(tf.reshape(arithmetic.raw(accumulator.sample_sum), [1]))
    # The leader's overflow count rides last; _unpack does not read it.
    parts.append(tf.reshape(arithmetic.raw(groups[0].accumulator.overflows), [1]))
    return tf.concat(parts, axis=0)


def _unpack(total: tf.Tensor, groups: list[_Group]):
    """Yields ``(sums, weight_sum, samples)`` per group, sums ``None`` where
    absent."""
    offset = 0
    for group in groups:
        sums = []
        for buffer, present in zip(group.buffers, group.present):
            if not present:
                sums.append(None)
                continue
            size = buffer.shape.num_elements()
            sums.append(tf.reshape(total[offset : offset + size], buffer.shape))
            offset += size
        yield sums, total[offset], total[offset + 1]
        offset += 2


def _read(group: _Group, last) -> tuple[list, tf.Tensor, tf.Tensor]:
    """A group's sums, weight sum and sample count, plus the not yet added
    micro-batch ``last = (grads, weight, count, samples, empty)`` if given
    (``empty``: the value the accumulator's ``empty`` flag had)."""
    accumulator = group.accumulator
    live = [b if p else None for b, p in zip(group.buffers, group.present)]
    weight_sum = tf.convert_to_tensor(arithmetic.raw(accumulator.weight_sum))
    sample_sum = tf.convert_to_tensor(arithmetic.raw(accumulator.sample_sum))
    if last is None:
        sums = [
            None if b is None else tf.convert_to_tensor(arithmetic.raw(b)) for b in live
        ]
        return sums, weight_sum, sample_sum
    grads, weight, count, samples, empty = last
    weight = None if weight is None else tf.cast(weight, tf.float32)
    triples = [
        (b, g, arithmetic.overwritten(v))
        for b, g, v in zip(live, grads, group.variables)
        if g is not None
    ]

    def alone():
        # The cycle is this one micro-batch (accum_steps 1): the buffers hold
        # only leftovers.
        return [
            arithmetic.plus(
                tf.zeros(b.shape) if arithmetic.sparse(g) else None, g, weight, maximum
            )
            for b, g, maximum in triples
        ]

    def added():
        return [
            arithmetic.plus(
                None if b is None else tf.convert_to_tensor(arithmetic.raw(b)),
                g,
                weight,
                maximum,
            )
            for b, g, maximum in triples
        ]

    totals = iter(tf.cond(empty, alone, added) if triples else [])
    sums = [None if g is None else next(totals) for g in grads]
    if count is None:
        count = 1.0 if weight is None else weight
    if samples is not None:
        sample_sum = sample_sum + tf.cast(samples, tf.float32)
    return sums, weight_sum + tf.cast(count, tf.float32), sample_sum


def _apply_groups(groups: list[_Group], total, sums) -> None:
    if total is not None:
        groups, sums = _join_parts(groups, list(_unpack(total, groups)))
    for index, (group, (grads, weight_sum, _)) in enumerate(zip(groups, sums)):
        mean = group.accumulator._mean(grads, weight_sum, group)
        if index == 0:
            group.apply_fn(mean)
        else:
            # A follower that saw no data this cycle (e.g. flushed after a
            # layer went unused) keeps its state rather than applying zeros.
            apply = functools.partial(_call, group.apply_fn, mean)
            tf.cond(weight_sum > 0, apply, _nothing)


def _join_parts(groups: list[_Group], sums: list) -> tuple[list, list]:
    """``groups`` and their ``(sums, weight_sum, samples)`` with every part
    (see :meth:`Engine.part`) folded into the leader's: the leader's entry
    becomes the sum of the means, with weight sum 1. Without parts, as given."""
    joined = [i for i, g in enumerate(groups) if g.accumulator._wiring.joins]
    if not joined:
        return groups, sums
    leader, (grads, weight_sum, samples) = groups[0], sums[0]
    mean = arithmetic.divide(
        grads, leader.variables, tf.math.divide_no_nan(1.0, weight_sum)
    )
    index = {arithmetic.var_key(v): i for i, v in enumerate(leader.variables)}
    for i in joined:
        part_sums, part_weight, _ = sums[i]
        # A total of 0 (every entry of the cycle masked) contributes
        # nothing, as the big batch's divide-no-NaN reduction does.
        inverse = tf.math.divide_no_nan(1.0, part_weight)
        for variable, part_sum in zip(groups[i].variables, part_sums):
            if part_sum is None:
                continue
            at = index[arithmetic.var_key(variable)]
            term = part_sum * inverse
            mean[at] = term if mean[at] is None else mean[at] + term
    kept = [i for i in range(1, len(groups)) if i not in joined]
    return (
        [leader, *(groups[i] for i in kept)],
        [(mean, tf.constant(1.0), samples), *(sums[i] for i in kept)],
    )


def _reset(groups: list[_Group]) -> None:
    # The buffers keep their contents; `empty` makes the next add overwrite.
    for group in groups:
        accumulator = group.accumulator
        arithmetic.raw(accumulator.weight_sum).assign(0.0)
        arithmetic.raw(accumulator.sample_sum).assign(0.0)
        arithmetic.raw(accumulator.overflows).assign(0.0)
        arithmetic.raw(accumulator.empty).assign(True)


def _zero(groups: list[_Group]) -> None:
    # A dropped cycle's sums may hold NaN or Inf: leave nothing of it behind.
    for group in groups:
        for buffer in group.accumulator.grad_sums:
            arithmetic.raw(buffer).assign(tf.zeros(buffer.shape, buffer.dtype))
