"""An engine's persistent state, as one record (:class:`EngineState`), and
the functions that read and change it outside a cycle's end: the record
made for a list of trainable variables (:meth:`EngineState.create`) or
given sums for another list (:meth:`EngineState.with_sums_for`), the sums of
given variables found in it (:func:`sums_for`), a micro-batch added to it
(:func:`open_sums`, :func:`add`), its entries listed under their file keys
(:func:`items`), read back from a file (:func:`load`), and set to an empty
cycle eagerly (:func:`restart_eagerly`).

As optax's ``MultiStepsState``, the record is explicit and every function
takes it, and whatever else it needs, as arguments. Unlike that state, the
record's fields are variables, changed in place (``assign``), so that a
traced step changes them and checkpoints and files hold them; the record
itself is replaced only when the trainable variables change. What each
variable counts is listed in :mod:`gradient_accumulator.core.engine`; which
saved sum is whose is :mod:`gradient_accumulator.core.saved_state`'s.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from gradient_accumulator.core import arithmetic, saved_state

# A state variable: a tf.Variable, or the kind its host makes (a Keras
# variable), which behaves as one.
Variable = Any
# Makes a state variable: ``(name, shape, dtype, initializer="zeros",
# synchronization=..., aggregation=...)``, as ``Engine._new_variable`` does.
NewVariable = Callable[..., Variable]
# Names a list of variables in files (``Binding.names``).
Names = Callable[[list], list[str]]
# Replica-local sums: every replica adds its own micro-batches without
# communicating; reading them in cross-replica context sums over the
# replicas, which is the single all-reduce of an update. A checkpoint saves
# that sum and restores it split evenly, so the total survives.
_LOCAL = {"synchronization": "on_read", "aggregation": "sum"}
_FIRST = {"aggregation": "only_first_replica"}
# The record's fields that hold variables, in the order they are made: the
# names checkpoints know them by (see EngineState.checkpoint_children).
VARIABLE_FIELDS = (*(field for _, field in saved_state.COUNTERS), "grad_sums")


def tf_variable(
    name: str,
    shape,
    dtype: str,
    initializer,
    synchronization: str = "auto",
    aggregation: str = "none",
) -> tf.Variable:
    """A state variable as a plain ``tf.Variable``, never trainable:
    ``initializer`` is "zeros" or a value to broadcast; ``synchronization``
    and ``aggregation`` are ``tf.VariableSynchronization`` /
    ``tf.VariableAggregation`` names in lower case."""
    value = tf.zeros(shape, dtype) if initializer == "zeros" else initializer
    return tf.Variable(
        tf.cast(tf.broadcast_to(value, shape), dtype),
        trainable=False,
        name=name,
        synchronization=getattr(tf.VariableSynchronization, synchronization.upper()),
        aggregation=getattr(tf.VariableAggregation, aggregation.upper()),
    )


def _name_of(variable) -> str:
    # Raw tf.Variables have no Keras path.
    name = getattr(variable, "path", None) or variable.name.split(":")[0]
    return name.replace("/", "_")


@dataclasses.dataclass(frozen=True, eq=False)
class EngineState:
    """An engine's persistent state: its variables (the scalars, then a
    gradient sum per trainable variable, see
    :mod:`gradient_accumulator.core.engine`) and which variable each sum is
    of: ``variable_keys`` (:func:`~.arithmetic.var_key`) and ``sum_keys``
    (its key in a file, see :func:`~.saved_state.sum_keys`).

    The scalar fields are named as the attributes that held them before
    there was a record, which are the names checkpoints know them by (see
    :meth:`checkpoint_children`); :data:`.saved_state.COUNTERS` pairs each
    with its key in a file.
    """

    micro_step: Variable
    accum_steps_variable: Variable
    next_accum_steps: Variable
    weight_sum: Variable
    sample_sum: Variable
    overflows: Variable
    empty: Variable
    last_grad_norm: Variable
    last_batch: Variable
    grad_sums: tuple[Variable, ...]
    variable_keys: tuple[int, ...]
    sum_keys: tuple[str, ...]

    @classmethod
    def create(
        cls,
        new_variable: NewVariable,
        variables: Sequence,
        accum_steps: int,
        names: Names,
    ) -> EngineState:
        """The state of an empty cycle of ``accum_steps`` micro-batches with a
        gradient sum for each of ``variables``, made by ``new_variable``
        (the engine's, so of its host's kind) in the order a file of an
        optimizer that tracks them lists them; ``names(variables)`` names
        the sums in files. Eager, under the host's strategy scope."""
        return cls(
            micro_step=new_variable("micro_step", (), "int64", **_FIRST),
            accum_steps_variable=new_variable(
                "accum_steps", (), "int64", initializer=accum_steps, **_FIRST
            ),
            # What accum_steps becomes at the next cycle boundary.
            next_accum_steps=new_variable(
                "next_accum_steps", (), "int64", initializer=accum_steps, **_FIRST
            ),
            weight_sum=new_variable("weight_sum", (), "float32", **_LOCAL),
            sample_sum=new_variable("sample_sum", (), "float32", **_LOCAL),
            # Micro-batches of the cycle whose backward pass overflowed at
            # the loss scale and was redone at a smaller seed (see add).
            overflows=new_variable("overflows", (), "float32", **_LOCAL),
            # True while grad_sums hold only leftovers of the last cycle:
            # cycles end without zeroing them (see add).
            empty=new_variable(
                "empty",
                (),
                "bool",
                initializer=True,
                synchronization="on_read",
                aggregation="only_first_replica",
            ),
            last_grad_norm=new_variable("last_grad_norm", (), "float32", **_FIRST),
            last_batch=new_variable("last_batch", (), "float32", **_FIRST),
            **_gradient_sums(new_variable, variables, names),
        )

    def with_sums_for(
        self, new_variable: NewVariable, variables: Sequence, names: Names
    ) -> EngineState:
        """This state with new (zero) gradient sums, for ``variables``; the
        scalar variables are this state's (see :meth:`create` for the
        arguments)."""
        return dataclasses.replace(
            self, **_gradient_sums(new_variable, variables, names)
        )

    def is_for(self, variables: Sequence) -> bool:
        """Whether the sums are of ``variables``, in their order."""
        return tuple(arithmetic.var_key(v) for v in variables) == self.variable_keys

    def checkpoint_children(self) -> dict[str, Variable | list]:
        """The variables as checkpoints name them, in the order they were
        made: each scalar by its field's name, the sums as the list
        ``grad_sums`` (``grad_sums/0``, ``grad_sums/1``, ...)."""
        children = {name: getattr(self, name) for name in VARIABLE_FIELDS}
        children["grad_sums"] = list(self.grad_sums)
        return children


def _gradient_sums(new_variable: NewVariable, variables: Sequence, names: Names):
    """The fields of :class:`EngineState` that hold and name the gradient
    sums of ``variables`` (new ones, made by ``new_variable``)."""
    variables = list(variables)
    grad_sums = tuple(
        new_variable(f"{_name_of(v)}_grad_sum", v.shape, "float32", **_LOCAL)
        for v in variables
    )
    return {
        "grad_sums": grad_sums,
        "variable_keys": tuple(arithmetic.var_key(v) for v in variables),
        # Named after the sums are made: a host's names may be places in a
        # list of weights that the new sums join.
        "sum_keys": saved_state.sum_keys(names(variables)),
    }


def sums_for(state: EngineState, variables: Sequence) -> list[Variable]:
    """``state``'s gradient sum of each of ``variables``."""
    keys = [arithmetic.var_key(v) for v in variables]
    index = {key: i for i, key in enumerate(state.variable_keys)}
    if any(key not in index for key in keys):
        raise ValueError(
            "The gradient accumulator was built for other trainable "
            "variables than the ones training now. Call `compile()` "
            "again after changing which layers are trainable (Keras "
            "needs that too); the accumulation state is rebuilt then."
        )
    return [state.grad_sums[index[key]] for key in keys]


# ------------------------------------------------------------ a micro-batch
def add(
    state: EngineState,
    grads: Sequence,
    variables: Sequence,
    weight=None,
    count=None,
    samples=None,
    empty=None,
) -> list[bool]:
    """Adds one micro-batch's ``grads`` of ``variables`` to ``state`` (see
    :meth:`Engine.add` for the other arguments); returns which gradients
    were present. Replica context; no communication."""
    buffers = sums_for(state, variables)
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
            for buffer in state.grad_sums:
                if id(buffer) not in added:
                    arithmetic.raw(buffer).assign(tf.zeros(buffer.shape, buffer.dtype))

    if empty is False:
        add_all(False)
    else:
        if empty is None:
            empty = arithmetic.raw(state.empty)
        tf.cond(empty, lambda: add_all(True), lambda: add_all(False))
        arithmetic.raw(state.empty).assign(False)
    if count is None:
        count = 1.0 if weight is None else weight
    arithmetic.raw(state.weight_sum).assign_add(tf.cast(count, tf.float32))
    if samples is not None:
        arithmetic.raw(state.sample_sum).assign_add(tf.cast(samples, tf.float32))
    return [g is not None for g in grads]


def open_sums(state: EngineState, variables: Sequence) -> None:
    """Clears an empty cycle's sums once, so that several :func:`add` calls
    (``empty=False``) add to them without a cond each (see
    :meth:`Engine.open_sums`). Replica context; no communication."""
    maxima = {
        id(b)
        for b, v in zip(sums_for(state, variables), variables)
        if arithmetic.overwritten(v)
    }

    def clear():
        for buffer in state.grad_sums:
            # A cycle maximum starts below every value it will see.
            dtype = tf.as_dtype(buffer.dtype)
            fill = dtype.min if id(buffer) in maxima else 0
            value = tf.fill(buffer.shape, tf.constant(fill, dtype))
            arithmetic.raw(buffer).assign(value)

    empty = arithmetic.raw(state.empty)
    tf.cond(empty, clear, lambda: None)
    empty.assign(False)


# ------------------------------------------------------------------ files
def items(state: EngineState, parts: Sequence) -> list[tuple[str, Variable]]:
    """``(key, variable)`` per entry of a file (see
    :meth:`Engine.state_items`): ``state``'s, then each of ``parts``' (the
    engine's extra-denominator accumulators) behind its part key."""
    return [
        *((name, getattr(state, field)) for name, field in saved_state.COUNTERS),
        *zip(state.sum_keys, state.grad_sums),
        *(
            (saved_state.part_key(index, key), variable)
            for index, part in enumerate(parts, start=1)
            for key, variable in part.state_items()
        ),
    ]


def load(
    state: EngineState,
    store,
    binding,
    parts_made: int,
    part: Callable[[int, list], Any],
) -> bool:
    """Assigns what a file holds (``store``, with :func:`items`' keys) to
    ``state``, and its parts' entries to parts built by ``part(index,
    variables)`` (:meth:`Engine.part`; ``parts_made`` of them exist) for
    ``binding``'s variables (the engine's host's
    :class:`~.links.Binding`, or None).

    Returns False when the file's sums are of other variables: the scalars
    that still apply (the schedule, the logs) are loaded, and the caller
    must start an empty cycle; a warning says what was dropped.
    """
    store, parts = saved_state.split_parts(store)
    buffers = dict(zip(state.sum_keys, state.grad_sums))
    sums, counters, dropped = saved_state.read(
        store, {key: b.shape for key, b in buffers.items()}
    )
    for field, value in counters.items():
        getattr(state, field).assign(value)
    if sums is not None and _load_parts(parts, binding, parts_made, part):
        for key, buffer in buffers.items():
            buffer.assign(sums[key])
        return True
    if dropped:
        warnings.warn(
            f"The file's accumulation state holds {dropped} micro-batch(es) "
            "of an incomplete cycle for other trainable variables than this "
            "model's (layers frozen or unfrozen, LoRA enabled, a quantized "
            "model): they were dropped, and the next cycle starts empty. "
            "Weights and cycle settings are loaded as saved.",
            # Points at Engine.load_state's caller.
            stacklevel=3,
        )
    return False


def _load_parts(stores: dict, binding, parts_made: int, part) -> bool:
    """Builds and loads the parts a file holds (``stores``: ``{index:
    store}``; see :func:`load` for the rest); False if their sums are not of
    ``binding``'s variables."""
    if not stores:
        return True
    if binding is None:
        return False
    variables = list(binding.variables())
    names = binding.names if binding.names else saved_state.paths
    by_key = dict(zip(saved_state.sum_keys(names(variables)), variables))
    for index in sorted(stores):
        store = stores[index]
        if index != parts_made + 1 or not set(store) & set(by_key):
            return False
        part(index, [v for k, v in by_key.items() if k in store]).load_state(store)
        parts_made += 1  # part() made it
    return True


def restart_eagerly(state: EngineState) -> None:
    """An empty cycle at a cycle boundary, in ``state``'s variables (the
    sums are overwritten by the next cycle's first micro-batch)."""
    state.micro_step.assign(0)
    state.accum_steps_variable.assign(state.next_accum_steps)
    state.weight_sum.assign(0.0)
    state.sample_sum.assign(0.0)
    state.overflows.assign(0.0)
    state.empty.assign(True)
