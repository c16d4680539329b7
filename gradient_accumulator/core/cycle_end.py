"""The end of a micro-step, where a cycle ends or goes on: the one
accumulate-or-apply decision (:func:`decide`, a ``tf.cond`` on
``micro_step + 1 >= accum_steps``), the update that ends a cycle
(:func:`end_cycle`: the sums, all-reduced once, applied if finite or
skipped, then reset) and the mean gradient each replica applies
(:func:`apply_groups`); and a cycle ended outside the train step
(:func:`eager_end`, for :meth:`Engine.flush` and :meth:`Engine.drop`).

These functions take the state record (:class:`~.engine_state.EngineState`)
of the engine that decides (the leader), the groups of the update (the
leader's, then its followers' and parts') and the host's :class:`Hooks`.
The sums themselves (packed, unpacked, read, joined, reset) are
:mod:`gradient_accumulator.core.reduce`'s.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import tensorflow as tf

from gradient_accumulator.core import arithmetic, engine_state, reduce
from gradient_accumulator.core.agc import adaptive_clip_grad
from gradient_accumulator.core.engine_state import EngineState
from gradient_accumulator.core.links import Group


def nothing(*_) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Hooks:
    """What is called at the end of a cycle: ``on_apply`` after the update
    (with a bool tensor, True if a micro-batch of the cycle overflowed at
    the loss scale, when ``overflow_flag``: the host reports overflows),
    ``on_skip`` instead of it; and ``skip_update_fn`` (the engine's setting),
    which may drop a cycle as a non-finite one is."""

    on_apply: Callable[..., None] = nothing
    on_skip: Callable[[], None] = nothing
    skip_update_fn: Callable | None = None
    overflow_flag: bool = False


def _call(fn, *args) -> None:
    # tf.cond needs both branches to return the same (here: nothing).
    fn(*args)


def decide(
    state: EngineState,
    strategy,
    token,
    take_groups: Callable[[], list[Group]],
    last,
    hooks: Hooks,
):
    """Accumulates the leader's micro-batch, or ends the cycle with it
    (:func:`end_cycle`); returns the decision, a bool tensor. The target of
    :meth:`Engine.end_micro_step`'s ``merge_call``: ``take_groups()`` gives
    the leader's group, then those its followers recorded in the step."""
    # Runs in cross-replica context: TensorFlow forbids merge_call (which
    # the all-reduce and Keras' optimizer use) inside a tf.cond in replica
    # context, so the conditionals live here and the optimizer is driven
    # back in replica context, as Keras' LossScaleOptimizer does.
    groups = take_groups()
    group = groups[0]

    def update():
        end_cycle(state, strategy, groups, last, hooks)

    def accumulate():
        if last is not None:
            grads, weight, count, samples, empty = last
            engine_state.add(
                state, grads, group.variables, weight, count, samples, empty
            )
        state.micro_step.assign_add(1)

    if last is not None:
        # Read early, like the predicate below, for the same reason: the
        # cond on it inside either branch then waits for no copy.
        last = (*last, tf.convert_to_tensor(arithmetic.raw(state.empty)))

    # The predicate reads only the counter, not the micro-batch: on a GPU
    # its copy to the host (a cond's predicate is read there) overlaps the
    # forward and backward passes, as Keras' own accumulation's does.
    # Only the cond, which changes the state, waits for the data.
    is_update = state.micro_step + 1 >= state.accum_steps_variable
    with tf.control_dependencies(strategy.experimental_local_results(token)):
        tf.cond(is_update, update, accumulate)
    return is_update


def end_cycle(state: EngineState, strategy, groups, last, hooks: Hooks) -> None:
    """Applies the cycle's mean gradient of every group if it is finite (and
    ``skip_update_fn`` agrees), or drops the cycle; then starts a new one.
    ``last``: the cycle's last micro-batch, not yet added (see
    :func:`~gradient_accumulator.core.reduce.read`)."""
    replicated = strategy.num_replicas_in_sync > 1
    if replicated:
        # One all-reduce per update: every buffer and weight sum of every
        # group packed into a single vector.
        local = strategy.extended.call_for_each_replica(reduce.pack, args=(groups,))
        total = strategy.extended.reduce_to(
            tf.distribute.ReduceOp.SUM, local, destinations=local
        )
        # Every replica holds the same total, so one copy decides for all.
        first = strategy.experimental_local_results(total)[0]
        sums = list(reduce.unpack(first, groups))
        overflows = first[-1]
    else:
        total = None
        sums = [reduce.read(g, last if i == 0 else None) for i, g in enumerate(groups)]
        overflows = tf.convert_to_tensor(arithmetic.raw(state.overflows))
    applied, sums = reduce.join_parts(groups, sums)
    grads, weight_sum, samples = sums[0]
    inverse = tf.math.divide_no_nan(tf.constant(1.0), weight_sum)
    maxima = [arithmetic.overwritten(v) for v in applied[0].variables]
    # The leader's norm and every group's finite check in one pass (the
    # norm is of trained variables' gradients only).
    leader = arithmetic.squared_norm([None if m else g for g, m in zip(grads, maxima)])
    others = [t for g, w, _ in sums[1:] for t in (*g, w)]
    others += [g for g, m in zip(grads, maxima) if m]
    squares = leader + arithmetic.squared_norm([weight_sum, *others])
    ok = tf.math.is_finite(squares)
    if hooks.skip_update_fn is not None:
        mean = arithmetic.divide(grads, applied[0].variables, inverse)
        skip = tf.cast(hooks.skip_update_fn(mean, applied[0].variables), tf.bool)
        ok = tf.logical_and(ok, tf.logical_not(tf.reshape(skip, [])))

    def apply():
        # Replicas unpack the all-reduced total by every group, parts
        # included; without one the joined sums are already at hand.
        args = (groups, total, None) if replicated else (applied, None, sums)
        strategy.extended.call_for_each_replica(apply_groups, args=args)
        state.last_grad_norm.assign(tf.sqrt(leader) * inverse)
        state.last_batch.assign(samples)
        if hooks.overflow_flag:
            hooks.on_apply(overflows > 0)
        else:
            hooks.on_apply()

    def skip():
        each_replica(strategy, reduce.zero, groups)
        hooks.on_skip()

    tf.cond(ok, apply, skip)
    restart(state, strategy, groups)


def each_replica(strategy, fn, groups) -> None:
    """``fn(groups)`` on every replica."""
    if strategy.num_replicas_in_sync > 1:
        strategy.extended.call_for_each_replica(fn, args=(groups,))
    else:
        fn(groups)


def restart(state: EngineState, strategy, groups) -> None:
    """An empty cycle, at the cycle length asked for last."""
    each_replica(strategy, reduce.reset, groups)
    state.micro_step.assign(0)
    state.accum_steps_variable.assign(state.next_accum_steps)


def mean_gradient(group: Group, sums, weight_sum) -> list:
    """``sums / weight_sum``, clipped by AGC if the group's engine uses it."""
    engine = group.accumulator
    # One multiply per gradient; an empty cycle (weight 0) applies zeros.
    inverse = tf.math.divide_no_nan(tf.constant(1.0), weight_sum)
    grads = arithmetic.divide(sums, group.variables, inverse)
    if engine.use_agc:
        # Overwritten variables' new values are not clipped (nor are they
        # by Keras' clipping).
        trained = [
            i for i, v in enumerate(group.variables) if not arithmetic.overwritten(v)
        ]
        clipped = adaptive_clip_grad(
            [group.variables[i] for i in trained],
            [grads[i] for i in trained],
            engine.clip_factor,
            engine.eps,
        )
        for i, grad in zip(trained, clipped):
            grads[i] = grad
    return grads


def apply_groups(groups: list[Group], total, sums) -> None:
    """Applies every group's mean gradient (replica context): from the
    all-reduced ``total``, or from the ``sums`` at hand without one."""
    if total is not None:
        groups, sums = reduce.join_parts(groups, list(reduce.unpack(total, groups)))
    for index, (group, (grads, weight_sum, _)) in enumerate(zip(groups, sums)):
        mean = mean_gradient(group, grads, weight_sum)
        if index == 0:
            group.apply_fn(mean)
        else:
            # A follower that saw no data this cycle (e.g. flushed after a
            # layer went unused) keeps its state rather than applying zeros.
            apply = functools.partial(_call, group.apply_fn, mean)
            tf.cond(weight_sum > 0, apply, nothing)


def eager_end(state: EngineState, how: str, strategy, groups, hooks: Hooks):
    """A compiled function that ends the current cycle outside a train step,
    if it holds anything: ``how`` is "flush" (apply what it holds) or "drop";
    ``groups``: the leader's and its followers', as their hosts bind them
    now. Call it eagerly, under ``strategy``'s scope."""

    def end():
        def run():
            if how == "flush":
                end_cycle(state, strategy, groups, None, hooks)
            else:
                each_replica(strategy, reduce.zero, groups)
                restart(state, strategy, groups)

        tf.cond(state.micro_step > 0, run, nothing)

    return tf.function(end)
