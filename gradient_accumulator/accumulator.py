"""The accumulation engine: the one place where accumulation semantics live.

Every wrapper in this package (the model wrapper, the optimizer wrapper and the
batch-normalisation layer) owns an :class:`Accumulator` and feeds it one
micro-batch at a time. The engine keeps, in float32 variables that its host
tracks (so checkpoints and ``.keras`` files see them):

* ``grad_sums[i] = sum_k w_k * g_k[i]``: the weighted sum of micro-batch
  gradients for every trainable variable ``i``;
* ``weight_sum = sum_k w_k``: the sum of the micro-batch weights;
* ``micro_step``: how many micro-batches the current cycle holds.

On the last micro-batch of a cycle it hands ``grad_sums / weight_sum`` (summed
over replicas under a ``tf.distribute`` strategy) to the host's ``apply_fn``
and resets. Choosing a micro-batch's weight is the host's job: the model
wrapper uses the denominator Keras' loss reduction used for that micro-batch,
which makes the applied gradient exactly the big batch's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import keras
import tensorflow as tf

from gradient_accumulator import _backend  # noqa: F401  (backend check)
from gradient_accumulator.agc import adaptive_clip_grad
from gradient_accumulator.validation import check_accum_steps, check_positive_float

ApplyFn = Callable[[list], None]


def all_finite(tensors: Sequence[tf.Tensor | None]) -> tf.Tensor:
    """A scalar bool tensor: True when no tensor holds a NaN or an Inf."""
    checks = [tf.reduce_all(tf.math.is_finite(t)) for t in tensors if t is not None]
    if not checks:
        return tf.constant(True)
    return tf.reduce_all(tf.stack(checks))


def _var_key(variable) -> int:
    if isinstance(variable, keras.Variable):
        variable = variable.value
    if hasattr(variable, "_distributed_container"):
        variable = variable._distributed_container()
    return id(variable)


def _add(buffer: keras.Variable, grad, weight: tf.Tensor) -> None:
    target = buffer.value
    if isinstance(grad, tf.IndexedSlices):
        # Embedding gradients: scatter the touched rows instead of densifying
        # a whole table every micro-step.
        values = tf.cast(grad.values, tf.float32) * weight
        if isinstance(target, tf.distribute.DistributedValues):
            # A replica-local (SyncOnRead) buffer refuses scatter ops as a
            # whole; in replica context the replica's own component is what
            # assign_add would update, so scatter into that.
            target = target._get_on_device_or_primary()
        target.scatter_add(tf.IndexedSlices(values, grad.indices, grad.dense_shape))
    else:
        target.assign_add(tf.cast(grad, tf.float32) * weight)


def _call(fn, *args) -> None:
    # tf.cond needs both branches to return the same (here: nothing).
    fn(*args)


def _nothing() -> None:
    return None


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
        self.accum_steps = check_accum_steps(accum_steps)
        if not isinstance(use_agc, bool):
            raise TypeError(f"`use_agc` must be a bool. Received: use_agc={use_agc!r}")
        self.use_agc = use_agc
        self.clip_factor = check_positive_float("clip_factor", clip_factor)
        self.eps = check_positive_float("eps", eps)
        self._track = track
        self._prefix = name
        self.built = False

    # ------------------------------------------------------------------ state
    def _new_variable(self, name, shape, dtype, initializer="zeros", **kwargs):
        variable = keras.Variable(
            initializer=initializer,
            shape=shape,
            dtype=dtype,
            trainable=False,
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
        self.micro_step = self._new_variable(
            "micro_step", (), "int64", aggregation="only_first_replica"
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
        return [self.micro_step, self.weight_sum, *self.grad_sums]

    # ------------------------------------------------------------------- rules
    def step(
        self,
        grads: Sequence,
        variables: Sequence[keras.Variable],
        weight,
        apply_fn: ApplyFn,
        count=None,
        on_apply: Callable[[], None] | None = None,
        on_skip: Callable[[], None] | None = None,
    ) -> tf.Tensor:
        """Adds one micro-batch; applies and resets at the end of a cycle.

        Args:
            grads: the micro-batch's gradients (``None`` where a variable has
                none), in the order of ``variables``.
            variables: the trainable variables the gradients belong to.
            weight: a scalar, this micro-batch's weight ``w_k``.
            apply_fn: called on the last micro-batch of a cycle, in replica
                context, with the accumulated gradients (``None`` kept in
                place), already summed over replicas: it must not all-reduce
                again (see ``distributed.already_reduced``).
            count: what this micro-batch adds to the divisor; defaults to
                ``weight``. The gradient applied is
                ``sum(weight * grad) / sum(count)``.
            on_apply: called, in cross-replica context, after ``apply_fn``.
            on_skip: called, in cross-replica context, instead of ``apply_fn``
                when the accumulated gradient holds a NaN or an Inf. The
                cycle is dropped either way.

        Returns:
            A scalar bool tensor, True on micro-batches that ended a cycle.
        """
        buffers = self._buffers_for(variables)
        weight = tf.cast(weight, tf.float32)
        for grad, buffer in zip(grads, buffers):
            if grad is not None:
                _add(buffer, grad, weight)
        count = weight if count is None else tf.cast(count, tf.float32)
        self.weight_sum.value.assign_add(count)
        present = [g is not None for g in grads]
        context = tf.distribute.get_replica_context()
        # A closure, not merge_call args: args are regrouped per replica, and
        # the (identical) mirrored objects are wanted, not PerReplica bundles.
        end = functools.partial(
            self._end_micro_step,
            variables=variables,
            buffers=buffers,
            present=present,
            apply_fn=apply_fn,
            on_apply=on_apply or _nothing,
            on_skip=on_skip or _nothing,
        )
        return context.merge_call(end)

    def _buffers_for(self, variables):
        try:
            return [self.grad_sums[self._keys[_var_key(v)]] for v in variables]
        except KeyError as error:
            raise ValueError(
                "A trainable variable appeared after the gradient accumulator "
                "was built. Rebuild the model/optimizer (e.g. call `compile()` "
                "again) after changing which layers are trainable."
            ) from error

    def _end_micro_step(
        self, strategy, variables, buffers, present, apply_fn, on_apply, on_skip
    ):
        # Runs in cross-replica context: TensorFlow forbids merge_call (which
        # the all-reduce and Keras' optimizer use) inside a tf.cond in replica
        # context, so the conditionals live here and the optimizer is driven
        # back in replica context, as Keras' LossScaleOptimizer does.
        is_update = self.micro_step + 1 >= self.accum_steps
        replicated = strategy.num_replicas_in_sync > 1

        def update():
            if replicated:
                # One all-reduce per update: every buffer and the weight sum
                # packed into a single vector.
                local = strategy.extended.call_for_each_replica(
                    _pack, args=(buffers, present, self.weight_sum)
                )
                total = strategy.extended.reduce_to(
                    tf.distribute.ReduceOp.SUM, local, destinations=local
                )
                finite = all_finite(strategy.experimental_local_results(total))
            else:
                total = None
                finite = all_finite([self.weight_sum.value, *buffers])

            def apply():
                strategy.extended.call_for_each_replica(
                    self._apply_mean,
                    args=(total, variables, buffers, present, apply_fn),
                )
                on_apply()

            tf.cond(finite, apply, lambda: _call(on_skip))
            if replicated:
                strategy.extended.call_for_each_replica(self._reset_local)
            else:
                self._reset_local()
            self.micro_step.assign(0)

        def accumulate():
            self.micro_step.assign_add(1)

        tf.cond(is_update, update, accumulate)
        return is_update

    def _apply_mean(self, total, variables, buffers, present, apply_fn) -> None:
        if total is None:
            sums = [tf.convert_to_tensor(b.value) for b in buffers]
            weight_sum = tf.convert_to_tensor(self.weight_sum.value)
        else:
            sums, weight_sum = _unpack(total, buffers, present)
        grads = [
            tf.math.divide_no_nan(g, weight_sum) if p else None
            for g, p in zip(sums, present)
        ]
        if self.use_agc:
            grads = adaptive_clip_grad(variables, grads, self.clip_factor, self.eps)
        apply_fn(grads)

    def _reset_local(self) -> None:
        for buffer in self.grad_sums:
            buffer.value.assign(tf.zeros_like(buffer.value))
        self.weight_sum.value.assign(0.0)


def _pack(buffers, present, weight_sum) -> tf.Tensor:
    parts = [tf.reshape(b.value, [-1]) for b, p in zip(buffers, present) if p]
    return tf.concat([*parts, tf.reshape(weight_sum.value, [1])], axis=0)


def _unpack(
    total: tf.Tensor, buffers, present
) -> tuple[list[tf.Tensor | None], tf.Tensor]:
    sums, offset = [], 0
    for buffer, p in zip(buffers, present):
        if not p:
            # _pack left it out: a variable without a gradient.
            sums.append(None)
            continue
        size = buffer.shape.num_elements()
        sums.append(tf.reshape(total[offset : offset + size], buffer.shape))
        offset += size
    return sums, total[offset]
