"""The accumulation engine, in plain TensorFlow: the one place where the
rules of accumulation live (this module and the four beside it named below).
It imports no Keras; each host (the Keras 3 model and optimizer wrappers,
the batch-normalisation layer) translates its own objects into the calls
below.

An :class:`Engine` keeps its state in one record, an
:class:`~.engine_state.EngineState` (:attr:`Engine.state`), of variables its
host creates (see :meth:`Engine._make_variable`) and saves:

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
  them; the scale's ``on_apply`` hook halves the scale after such a cycle).

Beside it, the engine holds ``parts``, an accumulator (with a record of its
own) per extra loss denominator (:meth:`Engine.part`).

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

The one decision is made in :func:`.cycle_end.decide`: a micro-batch
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

Where the rules live. :class:`Engine` is the interface above: it holds
its state record (and tracks its variables under the names checkpoints
know), ends a micro-step (:meth:`~Engine.end_micro_step`) and gathers what
a cycle's end needs (the groups, the host's hooks), with
:class:`CycleSchedule` (the cycle's length and position) as a mixin. The
rest it hands to a module per concern, each a set of functions that take
the record and explicit arguments and read or set no private attribute of
an engine's:

* ``engine_state.py``: the record (:class:`~.engine_state.EngineState`),
  made and remade for other variables, a micro-batch added to it, listed
  for a file, loaded from one and restarted;
* ``cycle_end.py``: the decision and the update that ends a cycle (read or
  all-reduce the sums, check them, apply or skip, reset), and a cycle ended
  outside the train step (flush, drop);
* ``reduce.py``: the update's sums: packed into the one all-reduce and
  unpacked, or read in place on one replica; parts joined; buffers reset;
* ``links.py``: the Python-side links (host binding, leader and followers,
  parts), as the :class:`~.links.Links` mixin of the engine and its
  records (:class:`~.links.Binding`, :class:`~.links.Group`).

None of them imports this module, so the core has no import circle.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import tensorflow as tf

from gradient_accumulator.core import arithmetic, cycle_end, engine_state, saved_state
from gradient_accumulator.core.engine_state import EngineState
from gradient_accumulator.core.links import ApplyFn, Group, Links, Wiring
from gradient_accumulator.core.settings import Settings
from gradient_accumulator.core.validation import check_accum_steps


class CycleSchedule:
    """How long cycles are, now and from the next one on, and how far the
    current one is: what a host asks an :class:`Engine` when it traces its
    step and between steps. A mixin of :class:`Engine`, whose ``state``,
    ``use_agc``, ``skip_update_fn`` and ``_initial_accum_steps`` it reads.
    """

    @property
    def pending(self) -> int:
        """Micro-batches the current cycle holds (eager)."""
        return arithmetic.now(self.state.micro_step) if self.built else 0

    def opens_cycle(self) -> tf.Tensor:
        """A bool tensor: the next micro-batch opens a cycle (the one its
        leader, if it follows one, keeps)."""
        return tf.equal(self.clock.state.micro_step, 0)

    def cycle_length(self) -> tf.Tensor:
        """Micro-batches in the current cycle, a float32 tensor (read when
        the step runs, so a scheduled change is seen)."""
        return tf.cast(self.clock.state.accum_steps_variable, tf.float32)

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
            arithmetic.now(self.state.accum_steps_variable),
            arithmetic.now(self.state.next_accum_steps),
        )
        return steps == (1, 1) and self.pending == 0

    @property
    def initial_accum_steps(self) -> int:
        """The cycle length the accumulator was configured with."""
        return self._initial_accum_steps

    @property
    def accum_steps(self) -> int:
        """Micro-batches per update (the latest value asked for; eager)."""
        if not self.built:
            return self._initial_accum_steps
        return arithmetic.now(self.state.next_accum_steps)

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
            self.state.next_accum_steps.assign(accum_steps)
            if self.pending == 0:
                self.state.accum_steps_variable.assign(accum_steps)
        return was_plain and not self.plain()


class Engine(Links, CycleSchedule, tf.Module):
    """Accumulation state and its add / decide / apply / reset rules.

    Its persistent state is one record, :attr:`state` (an
    :class:`~.engine_state.EngineState`, None until :meth:`build`). A
    ``tf.Module``, so a host's ``tf.train.Checkpoint`` reaches the record's
    variables under stable names (``<host>/_accumulator/grad_sums/0``,
    ...), which also read as the engine's attributes (``engine.micro_step``).
    They are made by :meth:`_make_variable`, which a host overrides to make
    its own kind (Keras variables, tracked by a layer or an optimizer).

    Args:
        settings: the host's checked :class:`~.settings.Settings`, of which
            the engine reads ``accum_steps`` (micro-batches per optimizer
            update), ``use_agc`` and its ``clip_factor`` and ``eps``
            (adaptive gradient clipping of the accumulated gradient), and
            ``skip_update_fn`` (an optional ``fn(grads, variables) -> bool
            scalar`` called at the end of each cycle with the mean gradient,
            before AGC; a True result drops the cycle as a non-finite one
            would). An ``int`` is taken as ``accum_steps``, with the other
            settings as keywords, and checked here.
        name: prefix for the variables' names.
    """

    def __init__(
        self,
        settings: Settings | int,
        name: str = "accumulator",
        **engine_settings,
    ):
        super().__init__(name=name)
        if not isinstance(settings, Settings):
            # The call of the layers and of direct users of the engine.
            settings = Settings(accum_steps=settings, **engine_settings)
        self.settings = settings
        self.use_agc, self.skip_update_fn = settings.use_agc, settings.skip_update_fn
        self.clip_factor, self.eps = float(settings.clip_factor), float(settings.eps)
        # The configured cycle length; once built, the variables hold it.
        self._initial_accum_steps = settings.accum_steps
        self._prefix = name
        self._wiring = Wiring()
        # Extra denominators' accumulators (see part()): tracked, so that a
        # checkpoint holds their sums with the rest of the state.
        self._parts: list[Engine] = []
        # The persistent state, once built (see _hold).
        self.state: EngineState | None = None

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
        """Creates one state variable (never trainable), a ``tf.Variable``.
        Hosts override this to make their framework's variables;
        ``synchronization`` and ``aggregation`` are
        ``tf.VariableSynchronization`` / ``tf.VariableAggregation`` names in
        lower case."""
        return engine_state.tf_variable(
            name, shape, dtype, initializer, synchronization, aggregation
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
        if self.built and self.state.is_for(variables):
            return False
        binding = self._wiring.binding
        names = binding.names if binding and binding.names else saved_state.paths
        if not self.built:
            steps = self._initial_accum_steps
            state = EngineState.create(self._new_variable, variables, steps, names)
        else:
            self._restart_eagerly()
            # The host asks for its parts again, for the new variables.
            self._drop_parts()
            state = self.state.with_sums_for(self._new_variable, variables, names)
        self._hold(state)
        self._wiring.present = {}
        return True

    def _hold(self, state: EngineState) -> None:
        """Makes ``state`` the engine's record."""
        self.state = state
        # Checkpoints name the variables as they did when each was an
        # attribute of the engine (<host>/_accumulator/micro_step,
        # .../grad_sums/0): each is tracked as assigning that attribute
        # tracked it, under that name and in that order, so files of earlier
        # releases load, also into a model restored before it was built.
        for name, value in state.checkpoint_children().items():
            tf.__internal__.tracking.sticky_attribute_assignment(
                trackable=self, name=name, value=value
            )

    def __getattr__(self, name: str):
        # The record's variables also read as the engine's attributes
        # (engine.micro_step, engine.grad_sums), the names checkpoints know
        # them by, as they did before there was a record.
        state = self.__dict__.get("state")
        if state is not None and name in engine_state.VARIABLE_FIELDS:
            return getattr(state, name)
        raise AttributeError(
            f"{type(self).__name__!r} object has no attribute {name!r}"
        )

    @property
    def built(self) -> bool:
        """Whether the state exists (:meth:`build`)."""
        return self.state is not None

    def state_items(self) -> list[tuple[str, tf.Variable]]:
        """``(key, variable)`` for every state variable: what a file holds,
        each gradient sum under its variable's path."""
        return engine_state.items(self.state, self._parts) if self.built else []

    @property
    def variables(self) -> list:
        return [variable for _, variable in self.state_items()]

    def logs(self) -> dict[str, tf.Tensor]:
        """Per-step log entries that tell updates from micro-steps."""
        return {
            # 1.0 on the steps that applied an update (or skipped a cycle).
            "update": tf.cast(self.opens_cycle(), tf.float32),
            # Global norm of the last applied mean gradient, before clipping.
            "grad_norm": tf.convert_to_tensor(self.state.last_grad_norm),
            # Samples (over all replicas) in the last applied cycle.
            "effective_batch": tf.convert_to_tensor(self.state.last_batch),
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
        parts_made = len(self._parts)
        if not engine_state.load(self.state, store, binding, parts_made, self.part):
            self._restart_eagerly()

    def _restart_eagerly(self) -> None:
        """An empty cycle, at a cycle boundary, here and in every part."""
        engine_state.restart_eagerly(self.state)
        for part in self._parts:
            part._restart_eagerly()

    # ------------------------------------------------------------ links
    # Binding, parts and followers are Links' (see links.py); a part is an
    # engine of this one's kind.
    def _new_part(self, name: str) -> Engine:
        """A new, unbuilt accumulator of this one's kind, for :meth:`part`
        (hosts that make their own variables override this)."""
        return Engine(self._part_settings(), name=name)

    def _part_settings(self) -> Settings:
        # A part only adds: the leader clips, checks and applies.
        return Settings(accum_steps=self._initial_accum_steps)

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
        return engine_state.add(
            self.state, grads, variables, weight, count, samples, empty
        )

    def _note_overflow(self, overflowed) -> None:
        if overflowed is not None:
            # Structural, like `present`: the host's on_apply takes the flag.
            self._wiring.overflows = True
            overflows = arithmetic.raw(self.state.overflows)
            overflows.assign_add(tf.cast(overflowed, tf.float32))

    def open_sums(self, variables: Sequence) -> None:
        """Readies the sums for several :meth:`add` calls in one micro-step
        (the slices of an in-step loop): an empty cycle's sums are cleared
        here, once, so that each add after it (``empty=False``) adds
        without a cond of its own. Replica context; no communication."""
        engine_state.open_sums(self.state, variables)

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
        variables = list(variables)
        buffers = engine_state.sums_for(self.state, variables)
        group = Group(self, variables, buffers, list(present), apply_fn)
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
            cycle_end.decide,
            self.state,
            # Taken when the merge runs (once for all replicas), after every
            # follower recorded its group.
            take_groups=lambda: [group, *self._take_follower_groups()],
            last=last,
            hooks=self._hooks(on_apply, on_skip),
        )
        return tf.distribute.get_replica_context().merge_call(end, args=(token,))

    def _hooks(self, on_apply, on_skip) -> cycle_end.Hooks:
        """What this engine's cycle end calls: the host's hooks and its own
        check (see :meth:`step`)."""
        return cycle_end.Hooks(
            on_apply=on_apply or cycle_end.nothing,
            on_skip=on_skip or cycle_end.nothing,
            skip_update_fn=self.skip_update_fn,
            overflow_flag=self._wiring.overflows,
        )

    # ------------------------------------------------------- partial cycles
    def flush(self, strategy: tf.distribute.Strategy | None = None) -> None:
        """Applies what the current, incomplete cycle holds (weighted exactly
        as a big batch of just those micro-batches) and starts a new cycle.

        Eager; does nothing if the cycle is empty.
        """
        self._end_eagerly("flush", strategy)

    def drop(self, strategy: tf.distribute.Strategy | None = None) -> None:
        """Discards the current, incomplete cycle and starts a new one."""
        self._end_eagerly("drop", strategy)

    def _end_eagerly(self, how: str, strategy) -> None:
        """Ends the current cycle outside a train step: ``how`` is "flush"
        or "drop" (see :meth:`flush`); one compiled function per way and
        strategy."""
        if self._wiring.leader is not None:
            raise ValueError(
                "This accumulator follows another one; flush or drop the "
                "cycle of the model it follows."
            )
        group = self._group_now()
        if group is None or self.pending == 0:
            return
        binding = self._wiring.binding
        strategy = strategy or binding.strategy()
        key = (how, id(strategy))
        if key not in self._wiring.flush_fns:
            followers = [f._group_now() for f in self._wiring.followers]
            groups = [group, *(g for g in followers if g is not None)]
            hooks = self._hooks(*binding.hooks())
            end = cycle_end.eager_end(self.state, how, strategy, groups, hooks)
            self._wiring.flush_fns[key] = end
        with strategy.scope():
            self._wiring.flush_fns[key]()
