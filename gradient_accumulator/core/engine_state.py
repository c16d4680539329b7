"""An engine's state variables: made for a list of trainable variables
(:func:`build`), listed under their file keys (:func:`items`), read back from
a file (:func:`load`), and set to an empty cycle eagerly
(:func:`restart_eagerly`).

The engine's variables are listed in :mod:`gradient_accumulator.core.engine`;
which saved sum is whose is :mod:`gradient_accumulator.core.saved_state`'s.
These functions take the engine, whose ``_new_variable`` (hence the host's
``_make_variable``) makes the variables.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import tensorflow as tf

from gradient_accumulator.core import arithmetic, saved_state


def _name_of(variable) -> str:
    # Raw tf.Variables have no Keras path.
    name = getattr(variable, "path", None) or variable.name.split(":")[0]
    return name.replace("/", "_")


def build(engine, variables: Sequence) -> bool:
    """The state for gradients of ``variables`` (see :meth:`Engine.build`)."""
    variables = list(variables)
    keys = tuple(arithmetic.var_key(v) for v in variables)
    if engine.built and keys == engine._wiring.keys:
        return False
    # Replica-local sums: every replica adds its own micro-batches without
    # communicating; reading them in cross-replica context sums over the
    # replicas, which is the single all-reduce of an update. A checkpoint
    # saves that sum and restores it split evenly, so the total survives.
    local = {"synchronization": "on_read", "aggregation": "sum"}
    first = {"aggregation": "only_first_replica"}
    if engine.built:
        restart_eagerly(engine)
        # The host asks for its parts again, for the new variables.
        engine._drop_parts()
    else:
        steps = engine._initial_accum_steps
        engine.micro_step = engine._new_variable("micro_step", (), "int64", **first)
        engine.accum_steps_variable = engine._new_variable(
            "accum_steps", (), "int64", initializer=steps, **first
        )
        # What accum_steps becomes at the next cycle boundary.
        engine.next_accum_steps = engine._new_variable(
            "next_accum_steps", (), "int64", initializer=steps, **first
        )
        engine.weight_sum = engine._new_variable("weight_sum", (), "float32", **local)
        engine.sample_sum = engine._new_variable("sample_sum", (), "float32", **local)
        # Micro-batches of the cycle whose backward pass overflowed at the
        # loss scale and was redone at a smaller seed (see add).
        engine.overflows = engine._new_variable("overflows", (), "float32", **local)
        # True while grad_sums hold only leftovers of the last cycle:
        # cycles end without zeroing them (see _add).
        engine.empty = engine._new_variable(
            "empty",
            (),
            "bool",
            initializer=True,
            synchronization="on_read",
            aggregation="only_first_replica",
        )
        engine.last_grad_norm = engine._new_variable(
            "last_grad_norm", (), "float32", **first
        )
        engine.last_batch = engine._new_variable("last_batch", (), "float32", **first)
    engine.grad_sums = [
        engine._new_variable(f"{_name_of(v)}_grad_sum", v.shape, "float32", **local)
        for v in variables
    ]
    engine._wiring.keys = keys
    binding = engine._wiring.binding
    names = binding.names if binding and binding.names else saved_state.paths
    engine._wiring.paths = saved_state.sum_keys(names(variables))
    engine._wiring.present = {}
    engine.built = True
    return True


def items(engine) -> list[tuple[str, tf.Variable]]:
    """``(key, variable)`` per state variable (see :meth:`Engine.state_items`)."""
    if not engine.built:
        return []
    return [
        *(
            (name, getattr(engine, attribute))
            for name, attribute in saved_state.COUNTERS
        ),
        *zip(engine._wiring.paths, engine.grad_sums),
        *(
            (saved_state.part_key(index, key), variable)
            for index, part in enumerate(engine._parts, start=1)
            for key, variable in part.state_items()
        ),
    ]


def load(engine, store) -> None:
    """Reads a file's state into ``engine`` (see :meth:`Engine.load_state`)."""
    if not list(store.keys()):
        return
    binding = engine._wiring.binding
    if not engine.built and binding is not None:
        with binding.strategy().scope():
            engine.build(binding.variables())
    if not engine.built:
        raise ValueError(
            "Build the accumulator (`build(variables)`) before loading "
            "its state: the file's sums are matched to those variables."
        )
    store, parts = saved_state.split_parts(store)
    buffers = dict(zip(engine._wiring.paths, engine.grad_sums))
    sums, counters, dropped = saved_state.read(
        store, {key: b.shape for key, b in buffers.items()}
    )
    for attribute, value in counters.items():
        getattr(engine, attribute).assign(value)
    if sums is not None and _load_parts(engine, parts):
        for key, buffer in buffers.items():
            buffer.assign(sums[key])
        return
    restart_eagerly(engine)
    if dropped:
        warnings.warn(
            f"The file's accumulation state holds {dropped} micro-batch(es) "
            "of an incomplete cycle for other trainable variables than this "
            "model's (layers frozen or unfrozen, LoRA enabled, a quantized "
            "model): they were dropped, and the next cycle starts empty. "
            "Weights and cycle settings are loaded as saved.",
            # Points at Engine.load_state's caller, as before the move.
            stacklevel=3,
        )


def _load_parts(engine, parts: dict) -> bool:
    """Builds and loads the parts a file holds (``{index: store}``);
    False if their sums are not of this host's variables."""
    if not parts:
        return True
    binding = engine._wiring.binding
    if binding is None:
        return False
    variables = list(binding.variables())
    names = binding.names if binding.names else saved_state.paths
    by_key = dict(zip(saved_state.sum_keys(names(variables)), variables))
    for index in sorted(parts):
        store = parts[index]
        if index != len(engine._parts) + 1 or not set(store) & set(by_key):
            return False
        part = engine.part(index, [v for k, v in by_key.items() if k in store])
        part.load_state(store)
    return True


def restart_eagerly(engine) -> None:
    """An empty cycle at a cycle boundary, in the state variables."""
    engine.micro_step.assign(0)
    engine.accum_steps_variable.assign(engine.next_accum_steps)
    engine.weight_sum.assign(0.0)
    engine.sample_sum.assign(0.0)
    engine.overflows.assign(0.0)
    engine.empty.assign(True)
    for part in engine._parts:
        restart_eagerly(part)
