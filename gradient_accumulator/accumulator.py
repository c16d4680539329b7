"""The accumulation engine: the one place where accumulation semantics live.

Every wrapper in this package (the model wrapper, the optimizer wrapper and the
batch-normalisation layer) owns an :class:`Accumulator` and feeds it one
micro-batch at a time. The engine keeps, in float32 variables that its host
tracks (so checkpoints and ``.keras`` files see them):

* ``grad_sums[i] = sum_k w_k * g_k[i]``: the weighted sum of micro-batch
  gradients for every trainable variable ``i``;
* ``weight_sum = sum_k c_k``: the sum of the micro-batches' shares ``c_k`` of
  the big batch's denominator (usually ``c_k = w_k``);
* ``micro_step``: how many micro-batches the current cycle holds;
* ``accum_steps``: micro-batches per cycle (a variable, so a schedule can
  change it between cycles and a checkpoint restores it).

On the last micro-batch of a cycle it hands ``grad_sums / weight_sum`` (summed
over replicas under a ``tf.distribute`` strategy) to the host's ``apply_fn``
and resets. Choosing a micro-batch's weight is the host's job: the model
wrapper uses the denominator Keras' loss reduction used for that micro-batch,
which makes the applied gradient exactly the big batch's.

An accumulator may *follow* another (:meth:`Accumulator.follow`): it then only
adds, and the leader decides, all-reduces (in the same single all-reduce) and
applies for both. This is how batch-normalisation statistics follow the
model's cycle with one counter.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import keras
import tensorflow as tf

from gradient_accumulator import _backend  # noqa: F401  (backend check)
from gradient_accumulator.agc import adaptive_clip_grad
from gradient_accumulator.validation import check_accum_steps, check_positive_float

ApplyFn = Callable[[list], None]


def all_finite(tensors: Sequence[tf.Tensor | None]) -> tf.Tensor:
    """A scalar bool tensor: True when no tensor holds a NaN or an Inf."""
    # One read pass and no boolean temporaries: a NaN or an Inf anywhere makes
    # the sum non-finite. (A finite sum can only overflow for gradients near
    # float32's maximum, which no optimizer update survives anyway.)
    sums = [tf.reduce_sum(t) for t in tensors if t is not None]
    if not sums:
        return tf.constant(True)
    return tf.math.is_finite(tf.add_n(sums))


def _var_key(variable) -> int:
    if isinstance(variable, keras.Variable):
        variable = variable.value
    if hasattr(variable, "_distributed_container"):
        variable = variable._distributed_container()
    return id(variable)


def _add(buffer: keras.Variable, grad, weight) -> None:
    target = buffer.value
    if isinstance(grad, tf.IndexedSlices):
        # Embedding gradients: scatter the touched rows instead of densifying
        # a whole table every micro-step.
        values = tf.cast(grad.values, tf.float32)
        if weight is not None:
            values = values * weight
        target.scatter_add(tf.IndexedSlices(values, grad.indices, grad.dense_shape))
    else:
        grad = tf.cast(grad, tf.float32)
        target.assign_add(grad if weight is None else grad * weight)


def _nothing() -> None:
    return None


@dataclass
class _Group:
    """One accumulator's part of an update: what to read, apply and reset."""

    accumulator: Accumulator
    variables: list
    buffers: list
    present: list
    apply_fn: ApplyFn

    @property
    def live(self) -> list:
        return [b for b, p in zip(self.buffers, self.present) if p]


class Accumulator(tf.Module):
    """Accumulation state and its add / apply / reset rules.

    A ``tf.Module`` so that ``tf.train.Checkpoint`` of the host reaches the
    state under stable names (``<host>/_accumulator/grad_sums/0``, ...).

    Args:
        accum_steps: micro-batches per optimizer update (an ``int >= 1``).
        track: called with every variable the engine creates, so that the host
            (a ``keras.Model``, optimizer or layer) tracks and saves it.
        name: prefix for the variables' names.
        use_agc: apply adaptive gradient clipping to the accumulated gradient.
        clip_factor, eps: adaptive gradient clipping parameters.
    """

    def __init__(
        self,
        accum_steps: int,
        track: Callable[[keras.Variable], None],
        name: str = "accumulator",
        use_agc: bool = False,
        clip_factor: float = 0.01,
        eps: float = 1e-3,
    ):
        super().__init__(name=name)
        self._accum_steps = check_accum_steps(accum_steps)
        if not isinstance(use_agc, bool):
            raise TypeError(f"`use_agc` must be a bool. Received: use_agc={use_agc!r}")
        self.use_agc = use_agc
        self.clip_factor = check_positive_float("clip_factor", clip_factor)
        self.eps = check_positive_float("eps", eps)
        self._track = track
        self._prefix = name
        self._leader: Accumulator | None = None
        self._followers: list[Accumulator] = []
        self._pending: _Group | None = None
        self.built = False

    # ------------------------------------------------------------------ state
    def _new_variable(self, name, shape, dtype, initializer="zeros", **kwargs):
        variable = keras.Variable(
            initializer=initializer,
            shape=shape,
            dtype=dtype,
            trainable=False,
            # A layer's step runs inside Keras' autocast scope, where reading
            # an autocast float variable yields a float16 copy, not the state.
            autocast=False,
            name=f"{self._prefix}_{name}",
            **kwargs,
        )
        self._track(variable)
        return variable

    def build(self, variables: Sequence[keras.Variable]) -> None:
        """Creates the state for gradients of ``variables``."""
        if self.built:
            return
        variables = list(variables)
        self._keys = {_var_key(v): i for i, v in enumerate(variables)}
        # Replica-local sums: every replica adds its own micro-batches without
        # communicating; reading them in cross-replica context sums over the
        # replicas, which is the single all-reduce of an update. A checkpoint
        # saves that sum and restores it split evenly, so the total survives.
        local = {"synchronization": "on_read", "aggregation": "sum"}
        first = {"aggregation": "only_first_replica"}
        self.micro_step = self._new_variable("micro_step", (), "int64", **first)
        self.accum_steps_variable = self._new_variable(
            "accum_steps", (), "int64", initializer=self._accum_steps, **first
        )
        # What accum_steps becomes at the next cycle boundary.
        self.next_accum_steps = self._new_variable(
            "next_accum_steps", (), "int64", initializer=self._accum_steps, **first
        )
        self.weight_sum = self._new_variable("weight_sum", (), "float32", **local)
        self.grad_sums = [
            self._new_variable(
                f"{v.path.replace('/', '_')}_grad_sum", v.shape, "float32", **local
            )
            for v in variables
        ]
        self.built = True

    @property
    def variables(self) -> list[keras.Variable]:
        if not self.built:
            return []
        return [
            self.micro_step,
            self.accum_steps_variable,
            self.next_accum_steps,
            self.weight_sum,
            *self.grad_sums,
        ]

    @property
    def accum_steps(self) -> int:
        """Micro-batches per update (the latest value asked for)."""
        return self._accum_steps

    def set_accum_steps(self, accum_steps: int) -> None:
        """Changes ``accum_steps`` from the next cycle on (now, between cycles).

        Call eagerly, e.g. from a callback; partial sums are never mixed
        across two cycle lengths.
        """
        self._accum_steps = check_accum_steps(accum_steps)
        if not self.built:
            return
        self.next_accum_steps.assign(self._accum_steps)
        if int(self.micro_step.numpy()) == 0:
            self.accum_steps_variable.assign(self._accum_steps)

    def _restored_accum_steps(self) -> None:
        # A checkpoint holds the cycle length that was in force; keep the
        # Python-side value (used for tracing decisions) in step with it.
        if self.built:
            self._accum_steps = int(self.next_accum_steps.numpy())

    # -------------------------------------------------------------- followers
    def follow(self, leader: Accumulator) -> None:
        """Lets ``leader`` decide, reduce and apply this accumulator's cycles."""
        if leader is self:
            raise ValueError("An accumulator cannot follow itself.")
        if self._leader is leader:
            return
        if self._leader is not None:
            self._leader._followers.remove(self)
        self._leader = leader
        leader._followers.append(self)

    @property
    def leader(self) -> Accumulator | None:
        return self._leader

    @property
    def clock(self) -> Accumulator:
        """The accumulator whose counter decides when cycles end."""
        return self if self._leader is None else self._leader

    # ------------------------------------------------------------------- rules
    def add(
        self,
        grads: Sequence,
        variables: Sequence[keras.Variable],
        weight=None,
        count=None,
    ) -> list[bool]:
        """Adds one micro-batch to this replica's sums (no communication).

        ``sum(weight * grad)`` and ``sum(count)`` grow; ``weight=None`` adds the
        gradients as they are (the host folded the weight into its loss).
        ``count`` defaults to ``weight`` (``1`` when that is None). Returns
        which gradients were present.
        """
        buffers = self._buffers_for(variables)
        if weight is not None:
            weight = tf.cast(weight, tf.float32)
        for grad, buffer in zip(grads, buffers):
            if grad is not None:
                _add(buffer, grad, weight)
        if count is None:
            count = 1.0 if weight is None else weight
        self.weight_sum.value.assign_add(tf.cast(count, tf.float32))
        return [g is not None for g in grads]

    def step(
        self,
        grads: Sequence,
        variables: Sequence[keras.Variable],
        apply_fn: ApplyFn,
        weight=None,
        count=None,
        on_apply: Callable[[], None] | None = None,
        on_skip: Callable[[], None] | None = None,
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
            weight, count: see :meth:`add`. The gradient applied is
                ``sum(weight * grad) / sum(count)``.
            on_apply: called, in cross-replica context, after ``apply_fn``.
            on_skip: called, in cross-replica context, instead of ``apply_fn``
                when the accumulated gradient holds a NaN or an Inf. The
                cycle is dropped either way.

        Returns:
            A scalar bool tensor, True on micro-batches that ended a cycle;
            ``None`` for a follower, whose leader decides.
        """
        present = self.add(grads, variables, weight, count)
        group = _Group(
            self, list(variables), self._buffers_for(variables), present, apply_fn
        )
        if self._leader is not None:
            # Consumed by the leader's step later in the same traced function.
            self._pending = group
            return None
        # A closure, not merge_call args: args are regrouped per replica, and
        # the (identical) mirrored objects are wanted, not PerReplica bundles.
        end = functools.partial(
            self._end_micro_step,
            group=group,
            on_apply=on_apply or _nothing,
            on_skip=on_skip or _nothing,
        )
        return tf.distribute.get_replica_context().merge_call(end)

    def _buffers_for(self, variables):
        try:
            return [self.grad_sums[self._keys[_var_key(v)]] for v in variables]
        except KeyError as error:
            raise ValueError(
                "A trainable variable appeared after the gradient accumulator "
                "was built. Rebuild the model/optimizer (e.g. call `compile()` "
                "again) after changing which layers are trainable."
            ) from error

    def _end_micro_step(self, strategy, group, on_apply, on_skip):
        # Runs in cross-replica context: TensorFlow forbids merge_call (which
        # the all-reduce and Keras' optimizer use) inside a tf.cond in replica
        # context, so the conditionals live here and the optimizer is driven
        # back in replica context, as Keras' LossScaleOptimizer does.
        is_update = self.micro_step + 1 >= self.accum_steps_variable
        groups = [group, *self._take_followers()]

        def update():
            self._update(strategy, groups, on_apply, on_skip)

        def accumulate():
            self.micro_step.assign_add(1)

        tf.cond(is_update, update, accumulate)
        return is_update

    def _take_followers(self) -> list[_Group]:
        groups = []
        for follower in self._followers:
            if follower._pending is not None:
                groups.append(follower._pending)
                follower._pending = None
        return groups

    def _update(self, strategy, groups, on_apply, on_skip) -> None:
        replicated = strategy.num_replicas_in_sync > 1
        if replicated:
            # One all-reduce per update: every buffer and weight sum of every
            # group packed into a single vector.
            local = strategy.extended.call_for_each_replica(_pack, args=(groups,))
            total = strategy.extended.reduce_to(
                tf.distribute.ReduceOp.SUM, local, destinations=local
            )
            # Every replica holds the same total, so one copy decides for all.
            finite = all_finite(strategy.experimental_local_results(total)[:1])
        else:
            total = None
            finite = all_finite(
                [t for g in groups for t in (g.accumulator.weight_sum.value, *g.live)]
            )

        def apply():
            strategy.extended.call_for_each_replica(_apply_groups, args=(total, groups))
            on_apply()

        def skip():
            on_skip()

        tf.cond(finite, apply, skip)
        if replicated:
            strategy.extended.call_for_each_replica(_reset, args=(groups,))
        else:
            _reset(groups)
        self.micro_step.assign(0)
        self.accum_steps_variable.assign(self.next_accum_steps)

    def _mean(self, sums, weight_sum, group: _Group) -> list:
        # One multiply per gradient; an empty cycle (weight 0) applies zeros.
        inverse = tf.math.divide_no_nan(tf.constant(1.0), weight_sum)
        grads = [g * inverse if g is not None else None for g in sums]
        if self.use_agc:
            grads = adaptive_clip_grad(
                group.variables, grads, self.clip_factor, self.eps
            )
        return grads


def _pack(groups: list[_Group]) -> tf.Tensor:
    parts = []
    for group in groups:
        parts += [tf.reshape(b.value, [-1]) for b in group.live]
        parts.append(tf.reshape(group.accumulator.weight_sum.value, [1]))
    return tf.concat(parts, axis=0)


def _unpack(total: tf.Tensor | None, groups: list[_Group]):
    """Yields ``(group, sums, weight_sum)``, sums ``None`` where absent."""
    offset = 0
    for group in groups:
        sums = []
        for buffer, present in zip(group.buffers, group.present):
            if not present:
                sums.append(None)
            elif total is None:
                sums.append(tf.convert_to_tensor(buffer.value))
            else:
                size = buffer.shape.num_elements()
                sums.append(tf.reshape(total[offset : offset + size], buffer.shape))
                offset += size
        if total is None:
            weight_sum = tf.convert_to_tensor(group.accumulator.weight_sum.value)
        else:
            weight_sum = total[offset]
            offset += 1
        yield group, sums, weight_sum


def _apply_groups(total, groups: list[_Group]) -> None:
    for group, sums, weight_sum in _unpack(total, groups):
        group.apply_fn(group.accumulator._mean(sums, weight_sum, group))


def _reset(groups: list[_Group]) -> None:
    for group in groups:
        accumulator = group.accumulator
        for buffer in accumulator.grad_sums:
            buffer.value.assign(tf.zeros(buffer.shape, buffer.dtype))
        accumulator.weight_sum.value.assign(0.0)
