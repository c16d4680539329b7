"""Ops per train step of every accumulation mode on the step-bound digits MLP.

What it measures
    The same model and variants as ``benchmarks/epoch.py`` (digits MLP
    64-H-H-10, Adam(1e-3), micro-batch m, K micro-batches per update), less
    ``plain-big`` unless asked, and for each one:

    * traced ops: every op of the train step Keras traces
      (``model.train_function``'s ``tf.function``, called once per ``fit``
      step), counted in its graph and in every function it calls, the
      bodies of ``tf.cond`` branches and ``tf.while_loop`` included (both
      branches of a cond count, though one runs), grouped by op type. This
      is the graph as traced, before Grappler rewrites it;
    * executed-graph nodes: the nodes of the step's graph as TensorFlow's
      executor runs it (collected with the eager context's graph collection,
      after Grappler and after conds and loops are lowered to Switch and
      Merge nodes). The executor visits every one of them on every step,
      those of the branch not taken too (they pass a "dead" signal on), so
      their count is a per-step cost even where no kernel runs; a loop's
      body nodes are visited once per iteration;
    * executed kernels: the kernels TensorFlow's host tracer records
      (``tf.profiler``, ``host_tracer_level=3``) while the variant trains,
      per update (K micro-steps for the streaming variants, one step for
      in-step and the big batch), and the summed time of those kernels. This
      is the graph after Grappler (oneDNN fusions, constant folding); the
      tracer does not record control-flow plumbing (Switch, Merge, Identity)
      and adds its own cost to each kernel, so kernel times are estimates.
      The first ``--profile-updates`` updates after tracing are profiled:
      after a few dozen runs the executor stops recording the kernels it
      has measured as cheap;
    * time per update: ``model.train_function`` called directly (as
      ``benchmarks/overhead.py`` does), variants interleaved in a rotated
      order over ``--rounds`` rounds, median of per-round ratios to Keras'
      built-in accumulation, wall and CPU;
    * what would run on the host on a GPU machine, by inspection of the
      traced graph against the GPU kernels this TensorFlow build registers:
      op types with no GPU kernel for their dtypes (placed on the CPU), op
      types whose GPU kernel keeps every input and output in host memory,
      and for every ``tf.cond`` (``If``/``StatelessIf``) and
      ``tf.while_loop`` (``While``) whether its predicate, which the kernel
      reads in host memory, would be computed in device memory and so need
      a device-to-host copy (the step waits for it).

    Then a breakdown of the difference between ``GradientAccumulateModel``
    streaming and Keras' built-in by op type (traced ops, executed-graph
    nodes per step, kernels per update and their kernel time per update)
    and an estimate of what the difference costs: the measured time
    difference per update, less the kernel time difference, over the added
    executor nodes per update.

    ``ours-model-logs`` is the model wrapper with ``progress_logs=True``
    (three more entries in every step's logs: ``update``, ``grad_norm``,
    ``effective_batch``). ``--probes`` adds two variants of the model wrapper
    with something changed while its step is traced, to measure what it
    costs (they are probes, not options of the package):
    ``probe-constant-logs``, ``ours-model-logs`` with those entries made
    constants (the step keeps its outputs, the ops computing them are gone),
    and ``probe-unchecked``, ``ours-model`` without the finite check that
    gates the update (a NaN would reach the weights).

    The script reports and never asserts; it
    always exits 0. It uses TensorFlow internals (the eager context's graph
    collection, the kernel registry, the profiler's XSpace protobuf), so a
    TensorFlow upgrade may need it adjusted.

Run
    python benchmarks/step_ops.py                  # defaults
    python benchmarks/step_ops.py --with-big-batch --probes --rounds 60
    python benchmarks/step_ops.py --hidden 256 --accum-steps 8
    python benchmarks/step_ops.py --quick          # smoke test: 2 rounds
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

# The model, the data, the variants and the quiet TensorFlow import are
# epoch.py's (this script's directory is on sys.path when it runs).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from epoch import (
    BIG_BATCH,
    DESCRIPTIONS,
    add_model_arguments,
    build_variant,
    check_arguments,
    digits,
    gradient_accumulator,
    keras,
    stderr_captured,
    tf,
)

with stderr_captured():
    from tensorflow.python.eager import context
    from tensorflow.python.framework import kernels, op_def_registry
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

VARIANTS = (
    "plain-micro",
    "keras-builtin",
    "ours-model",
    "ours-model-logs",
    "ours-in-step",
    "ours-optimizer",
)
# --probes: the model wrapper with one of its extras taken out while its step
# is traced. Measurements of what the extra costs, not options of the
# package (without the finite check a NaN reaches the weights). They patch
# private names of the package and are skipped if those have moved.
PROBES = {
    "probe-constant-logs": "ours-model-logs with its 3 log entries made "
    "constants (the step's outputs kept, the ops computing them gone)",
    "probe-unchecked": "ours-model without the finite check (sum of squares, "
    "IsFinite and its cond)",
}
# The variant each probe changes.
PROBE_BASES = {
    "probe-constant-logs": "ours-model-logs",
    "probe-unchecked": "ours-model",
}
CONTROL_FLOW = ("If", "StatelessIf", "While", "StatelessWhile")
CALLS = ("StatefulPartitionedCall", "PartitionedCall")
PASS_THROUGH = ("Identity", "IdentityN")
# Ops of the traced graph that are bookkeeping rather than work.
PLUMBING = ("Const", "Identity", "IdentityN", "NoOp", "Placeholder")
OP_EVENT = re.compile(r"^[^\s:][^:]*:(?P<op>[A-Za-z_][A-Za-z0-9_]*)$")


# ------------------------------------------------------------- the graph
def step_function(model: keras.Model):
    """The ``tf.function`` Keras calls once per fit step: ``train_function``
    is a Python closure around it (``multi_step_on_iterator`` in
    ``keras/src/backend/tensorflow/trainer.py``)."""
    cells = model.train_function.__closure__ or ()
    for cell in cells:
        candidate = cell.cell_contents
        if isinstance(candidate, tf.types.experimental.PolymorphicFunction):
            return candidate
    raise RuntimeError("no tf.function in model.train_function's closure")


@dataclass
class Node:
    """One op of the traced step: where it is and what it is."""

    function: str  # "" for the outer graph
    node: object  # NodeDef
    branch: bool  # inside a cond branch or a while loop's body or condition


class StepGraph:
    """The traced step's GraphDef and its function library, walked from the
    outer graph through every function call, branch and loop body."""

    def __init__(self, concrete):
        self.graph_def = concrete.graph.as_graph_def()
        self.library = {f.signature.name: f for f in self.graph_def.library.function}
        self.nodes: list[Node] = []
        # function name -> [(caller function, caller NodeDef)]
        self.callers: dict[str, list[tuple[str, object]]] = collections.defaultdict(
            list
        )
        self._walk("", self.graph_def.node, branch=False)

    def _walk(self, function: str, node_defs, branch: bool) -> None:
        for node in node_defs:
            self.nodes.append(Node(function, node, branch))
            for called, inner in self._called(node):
                self.callers[called].append((function, node))
                body = self.library[called]
                self._walk(called, body.node_def, branch or inner)

    def _called(self, node) -> Iterator[tuple[str, bool]]:
        """Functions ``node`` calls, each with whether it runs conditionally
        (a cond branch, a loop's condition or body)."""
        for key, value in node.attr.items():
            conditional = node.op in CONTROL_FLOW
            if value.HasField("func") and value.func.name in self.library:
                yield value.func.name, conditional and key != "f"
            for func in value.list.func:
                if func.name in self.library:
                    yield func.name, conditional

    def runs_backward(self, function: str) -> bool:
        """Whether ``function`` or a function it calls holds backward-pass
        ops (``gradient_tape/...``)."""
        body = self.library[function].node_def
        return any("gradient_tape/" in n.name for n in body) or any(
            self.runs_backward(called) for n in body for called, _ in self._called(n)
        )

    # -- producers, for the memory a predicate lives in
    def node_named(self, function: str, name: str):
        defs = self.library[function].node_def if function else self.graph_def.node
        return next(n for n in defs if n.name == name)

    def producer(self, function: str, ref: str):
        """``(function, NodeDef, output arg name)`` that makes the tensor
        ``ref`` names in ``function``, through function arguments, calls'
        and branches' results and pass-through ops; None if it is an
        argument of the outer graph (a captured variable or the iterator)."""
        for _ in range(100):  # a chain of references, never a cycle
            name, arg, index = _split(ref, function)
            if function and name in _arg_names(self.library[function]):
                position = _arg_names(self.library[function]).index(name)
                callers = self.callers.get(function)
                if not callers:
                    return None
                caller_function, caller = callers[0]
                inputs = [i for i in caller.input if not i.startswith("^")]
                offset = 1 if caller.op in ("If", "StatelessIf") else 0
                function, ref = caller_function, inputs[position + offset]
                continue
            node = self.node_named(function, name)
            if node.op in PASS_THROUGH:
                ref = [i for i in node.input if not i.startswith("^")][index]
                continue
            if arg is None:
                arg = _output_arg(node, index)
            called = [f for f, _ in self._called(node)]
            if called and node.op != "While":
                body = self.library[called[0]]
                ret_names = [a.name for a in body.signature.output_arg]
                function, ref = called[0], body.ret[ret_names[index]]
                continue
            return function, node, arg
        return None


def _arg_names(function) -> list[str]:
    return [a.name for a in function.signature.input_arg]


def _split(ref: str, function: str) -> tuple[str, str | None, int]:
    """A tensor reference: ``node:arg:i`` in a function body, ``node:i`` or
    ``node`` in the outer graph, a bare argument name in a function."""
    parts = ref.split(":")
    if function and len(parts) == 3:
        return parts[0], parts[1], int(parts[2])
    if len(parts) == 2:
        return parts[0], None, int(parts[1])
    return parts[0], None, 0


def _output_arg(node, index: int) -> str:
    """The name of output ``index`` of ``node`` (GraphDef references count
    flat outputs; single-tensor output args, the usual case, map 1:1)."""
    op_def = op_def_registry.get(node.op)
    names = []
    for arg in op_def.output_arg:
        if arg.number_attr:
            count = node.attr[arg.number_attr].i
        elif arg.type_list_attr:
            count = len(node.attr[arg.type_list_attr].list.type)
        else:
            count = 1
        names += [arg.name] * count
    return names[index] if index < len(names) else names[-1]


# ----------------------------------------------------- GPU placement, by eye
_GPU_KERNELS: dict[str, list] = {}


def gpu_kernel(node):
    """The GPU (or any-device) kernel this build registers for ``node``'s op
    and dtypes, or None: then the op runs on the CPU of a GPU machine."""
    if node.op not in _GPU_KERNELS:
        registered = kernels.get_registered_kernels_for_op(node.op).kernel
        _GPU_KERNELS[node.op] = [
            k for k in registered if k.device_type in ("GPU", "DEFAULT")
        ]
    for kernel in _GPU_KERNELS[node.op]:
        if all(_allows(c, node) for c in kernel.constraint):
            return kernel
    return None


def _allows(constraint, node) -> bool:
    allowed = set(constraint.allowed_values.list.type)
    value = node.attr.get(constraint.name)
    if value is None:
        return True
    if value.list.type:
        return set(value.list.type) <= allowed
    return value.type in allowed


def host_only(node, kernel) -> bool:
    """Whether ``kernel`` keeps every input and output of ``node`` in host
    memory (TensorFlow's GPU kernels for int32 and shapes do)."""
    op_def = op_def_registry.get(node.op)
    args = [a.name for a in (*op_def.input_arg, *op_def.output_arg)]
    return bool(args) and set(args) <= set(kernel.host_memory_arg)


def memory(graph: StepGraph, function: str, ref: str) -> tuple[str, str]:
    """``(where, what)``: whether the tensor ``ref`` would be in "host" or
    "device" memory on a GPU machine, and the op that makes it."""
    found = graph.producer(function, ref)
    if found is None:
        return "host", "argument of the step"  # a variable handle, the iterator
    _, node, arg = found
    key = "T" if "T" in node.attr else "dtype"
    dtype = tf.dtypes.as_dtype(node.attr[key].type).name if key in node.attr else ""
    what = f"{node.op}({dtype})" if dtype else node.op
    if node.op == "Const":
        return "host", what  # placed where its consumer reads it
    kernel = gpu_kernel(node)
    if kernel is None:
        return "host", what + ", no GPU kernel"
    return ("host" if arg in kernel.host_memory_arg else "device"), what


def waits_for_gradients(graph: StepGraph, function: str, ref: str) -> bool:
    """Whether the tensor ``ref`` depends, through data or control inputs, on
    an op of the backward pass (``gradient_tape/...``): then it is known
    only once the micro-batch's gradients are."""
    todo, seen = [(function, ref)], set()
    while todo:
        function, ref = todo.pop()
        name = _split(ref.lstrip("^"), function)[0]
        if (function, name) in seen:
            continue
        seen.add((function, name))
        if "gradient_tape/" in name:
            return True
        if function and name in _arg_names(graph.library[function]):
            position = _arg_names(graph.library[function]).index(name)
            for caller_function, caller in graph.callers.get(function, []):
                inputs = [i for i in caller.input if not i.startswith("^")]
                offset = 1 if caller.op in ("If", "StatelessIf") else 0
                if position + offset < len(inputs):
                    todo.append((caller_function, inputs[position + offset]))
            continue
        node = graph.node_named(function, name)
        if any(graph.runs_backward(called) for called, _ in graph._called(node)):
            return True  # a call, cond or loop whose body has a backward pass
        todo += [(function, i) for i in node.input]
    return False


@dataclass
class Predicate:
    op: str  # If, StatelessIf, While
    where: str  # "host" or "device" memory on a GPU machine
    what: str  # the op that computes it
    waits: bool  # known only after the backward pass
    nested: bool  # inside another cond's branch or a loop

    def __str__(self) -> str:
        copy = "device -> host copy" if self.where == "device" else "on host"
        waits = ", after the gradients" if self.waits else ""
        nested = ", in a branch" if self.nested else ""
        return f"{self.op}: {self.what}, {copy}{waits}{nested}"


def predicates(graph: StepGraph) -> list[Predicate]:
    """The predicate of every cond and while loop of the step."""
    found = []
    for item in graph.nodes:
        node = item.node
        if node.op in ("If", "StatelessIf"):
            function, ref = item.function, node.input[0]
        elif node.op in ("While", "StatelessWhile"):
            condition = graph.library[node.attr["cond"].func.name]
            function = condition.signature.name
            ref = condition.ret[condition.signature.output_arg[0].name]
        else:
            continue
        where, what = memory(graph, function, ref)
        waits = waits_for_gradients(graph, function, ref)
        found.append(Predicate(node.op, where, what, waits, item.branch))
    return found


# ------------------------------------------------------------ a variant
@dataclass
class Runner:
    """One built variant: its model, input, counts and timings."""

    variant: str
    model: keras.Model
    batch_size: int
    steps_per_update: int
    iterator: object
    traced: collections.Counter = field(default_factory=collections.Counter)
    # The graph the executor runs per step: after Grappler and the lowering
    # of conds and loops to Switch/Merge/Enter/Exit/NextIteration.
    runs: collections.Counter = field(default_factory=collections.Counter)
    in_branches: int = 0
    graph: StepGraph | None = None
    executed: dict[str, float] = field(default_factory=dict)  # per update
    kernel_us: dict[str, float] = field(default_factory=dict)  # per update
    per_step: list[int] = field(default_factory=list)  # kernels, one cycle
    wall: list[float] = field(default_factory=list)  # s per update, per round
    cpu: list[float] = field(default_factory=list)

    def update(self) -> object:
        """One update's worth of steps; returns the last logs."""
        train = self.model.train_function
        for _ in range(self.steps_per_update):
            logs = train(self.iterator)
        return logs

    def record(self, updates: int) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(updates):
            logs = self.update()
        float(logs["loss"])  # the last step has finished
        self.wall.append((time.perf_counter() - wall) / updates)
        self.cpu.append((time.process_time() - cpu) / updates)


@contextlib.contextmanager
def probe_patch(variant: str):
    """While a probe's step is traced: the engine's log entries are
    constants (``probe-constant-logs``) or its sum of squares is a constant
    0, so the update is gated by a constant predicate (``probe-unchecked``)."""
    if variant == "probe-constant-logs":
        from gradient_accumulator.core import engine

        owner, name = engine.Engine, "logs"
        original = owner.logs
        value = lambda self: {  # noqa: E731
            key: tf.constant(0.0) for key in original(self)
        }
    elif variant == "probe-unchecked":
        from gradient_accumulator.core import arithmetic

        owner, name = arithmetic, "squared_norm"
        value = lambda tensors: tf.constant(0.0)  # noqa: E731
    else:
        yield
        return
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def prepare(variant: str, args: argparse.Namespace) -> Runner:
    """Builds, traces (a short fit on a tf.data pipeline of digits, batch
    dimension unknown as in fit on arrays), counts the traced ops and
    profiles the first updates (TensorFlow's executor stops recording the
    kernels it finds cheap after some dozens of runs)."""
    with probe_patch(variant):
        runner = _prepare(variant, args)
    profile(runner, args.profile_updates)
    return runner


def _prepare(variant: str, args: argparse.Namespace) -> Runner:
    k, m = args.accum_steps, args.micro_batch
    big = variant in BIG_BATCH
    batch = k * m if big else m
    x, y = digits(1)
    n = 8 * k * m  # whole batches only
    dataset = tf.data.Dataset.from_tensor_slices((x[:n], y[:n]))
    dataset = dataset.batch(batch).cache().repeat()
    model = build_variant(PROBE_BASES.get(variant, variant), args.hidden, m, k)
    steps = 1 if big else k
    eager = context.context()
    eager.enable_graph_collection()  # the graphs of functions run from now on
    try:
        model.fit(
            dataset, steps_per_epoch=2 * steps, epochs=1, verbose=0, shuffle=False
        )
        runner = Runner(variant, model, batch, steps, iter(dataset))
        runner.update()  # the direct-call path
    finally:
        metadata = eager.export_run_metadata()
        eager.disable_graph_collection()
    runner.runs = executed_graph(metadata)
    concrete = step_function(model).get_concrete_function(runner.iterator)
    runner.graph = StepGraph(concrete)
    runner.traced = collections.Counter(n.node.op for n in runner.graph.nodes)
    runner.in_branches = sum(n.branch for n in runner.graph.nodes)
    return runner


def executed_graph(metadata) -> collections.Counter:
    """Op types of the train step's graph as the executor runs it (the last
    function collected that makes the step's ``Optional`` output), without
    its arguments and results."""
    steps = [
        graph
        for graph in metadata.function_graphs
        if any(
            node.op == "OptionalFromValue"
            for part in graph.partition_graphs
            for node in part.node
        )
    ]
    if not steps:
        raise RuntimeError("the train step's executed graph was not collected")
    return collections.Counter(
        node.op
        for part in steps[-1].partition_graphs
        for node in part.node
        if node.op not in ("_Arg", "_Retval", "_DeviceArg", "_DeviceRetval")
    )


# -------------------------------------------------------------- profiling
def profile(runner: Runner, updates: int) -> None:
    """Runs ``updates`` updates under the host tracer, each step in its own
    trace span; keeps the per-update median of each op type's kernel count
    and kernel time, and the kernels of each step of the last update."""
    options = tf.profiler.experimental.ProfilerOptions(
        host_tracer_level=3, python_tracer_level=0, device_tracer_level=0
    )
    train = runner.model.train_function
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir, options=options)
        for i in range(updates * runner.steps_per_update):
            with tf.profiler.experimental.Trace("step", step_num=i, _r=1):
                float(train(runner.iterator)["loss"])
        tf.profiler.experimental.stop()
        (path,) = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
        space = xplane_pb2.XSpace()
        space.ParseFromString(Path(path).read_bytes())
    spans, events = [], []
    for plane in space.planes:
        names = plane.event_metadata
        for line in plane.lines:
            for event in line.events:
                name = names[event.metadata_id].name
                start = line.timestamp_ns * 1000 + event.offset_ps
                if name == "step":
                    spans.append((start, start + event.duration_ps))
                elif "::" not in name and (match := OP_EVENT.match(name)):
                    events.append((start, match["op"], event.duration_ps / 1e6))
    steps = []  # per step: [(op type, µs)]
    for begin, end in sorted(spans):
        steps.append([(op, us) for start, op, us in events if begin <= start <= end])
    counts, times = [], []
    for first in range(0, len(steps), runner.steps_per_update):
        kernels_run = [
            k for step in steps[first : first + runner.steps_per_update] for k in step
        ]
        counts.append(collections.Counter(op for op, _ in kernels_run))
        total: collections.Counter = collections.Counter()
        for op, us in kernels_run:
            total[op] += us
        times.append(total)
    ops = set().union(*counts)
    runner.executed = {op: statistics.median(c[op] for c in counts) for op in ops}
    runner.kernel_us = {op: statistics.median(t[op] for t in times) for op in ops}
    runner.per_step = [len(step) for step in steps[-runner.steps_per_update :]]


# -------------------------------------------------------------- reporting
def ratios(runner: Runner, reference: Runner, clock: str = "wall") -> list[float]:
    return [a / b for a, b in zip(getattr(runner, clock), getattr(reference, clock))]


def summary_table(runners: list[Runner]) -> list[str]:
    builtin = next(r for r in runners if r.variant == "keras-builtin")
    lines = [
        "| variant | fit batch | traced ops | of which in branches/loops "
        "| conds/loops | executed-graph nodes per step | of which Switch/Merge "
        "| kernels per step (accumulating / applying) "
        "| kernels per update | kernel ms per update | ms/update "
        "| vs keras-builtin | CPU vs keras-builtin |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runners:
        steps = r.per_step
        if len(steps) > 1:
            each = f"{statistics.median(steps[:-1]):.0f} / {steps[-1]}"
        else:
            each = f"- / {steps[0]}" if steps else "-"
        conds = sum(r.traced[op] for op in CONTROL_FLOW)
        lines.append(
            f"| {r.variant} | {r.batch_size} | {sum(r.traced.values())} "
            f"| {r.in_branches} | {conds} | {sum(r.runs.values())} "
            f"| {r.runs['Switch'] + r.runs['Merge']} | {each} "
            f"| {sum(r.executed.values()):.0f} "
            f"| {sum(r.kernel_us.values()) / 1000:.2f} "
            f"| {1000 * statistics.median(r.wall):.2f} "
            f"| {statistics.median(ratios(r, builtin)):.3f} "
            f"| {statistics.median(ratios(r, builtin, 'cpu')):.3f} |"
        )
    return lines


def difference_table(ours: Runner, theirs: Runner) -> list[str]:
    """Op types whose count differs between two variants: traced, in the
    executed graph (per step) and among the kernels run (per update)."""
    counts = ("traced", "runs", "executed")
    ops = sorted(set().union(*(getattr(r, c) for r in (ours, theirs) for c in counts)))
    rows = []

    def cells(mine: collections.Counter, other: collections.Counter, op=None) -> str:
        """``| ours | theirs | difference `` for one count (all ops if None)."""
        a = mine.get(op, 0) if op else sum(mine.values())
        b = other.get(op, 0) if op else sum(other.values())
        return f"| {a:g} | {b:g} | {a - b:+g} "

    for op in ops:
        pairs = [(getattr(ours, c), getattr(theirs, c)) for c in counts]
        diffs = [mine.get(op, 0) - other.get(op, 0) for mine, other in pairs]
        if not any(diffs):
            continue
        us = ours.kernel_us.get(op, 0.0) - theirs.kernel_us.get(op, 0.0)
        row = f"| {op} " + "".join(cells(*pair, op) for pair in pairs)
        rows.append((-abs(diffs[1]), -abs(diffs[2]), op, row + f"| {us:+.0f} |"))
    total = "| all " + "".join(
        cells(getattr(ours, c), getattr(theirs, c)) for c in counts
    )
    total_us = sum(ours.kernel_us.values()) - sum(theirs.kernel_us.values())
    a, b = ours.variant, theirs.variant
    return [
        f"| op type | traced: {a} | traced: {b} | diff "
        f"| executed graph per step: {a} | {b} | diff "
        f"| kernels per update: {a} | {b} | diff | kernel µs per update, diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(row for *_, row in sorted(rows)),
        total + f"| {total_us:+.0f} |",
    ]


def cost_estimate(ours: Runner, theirs: Runner) -> str:
    """Splits the measured time difference per update into kernel time and
    the rest, spread over the executor nodes the difference adds."""
    wall = statistics.median(
        1e6 * (a - b) for a, b in zip(ours.wall, theirs.wall)
    )  # µs, paired per round
    kernel = sum(ours.kernel_us.values()) - sum(theirs.kernel_us.values())
    nodes = ours.steps_per_update * sum(ours.runs.values()) - (
        theirs.steps_per_update * sum(theirs.runs.values())
    )
    line = (
        f"{ours.variant} - {theirs.variant}, per update: {wall:+.0f} µs wall "
        f"(median of per-round differences), of which kernel time {kernel:+.0f} "
        f"µs; executor nodes per update {nodes:+d}"
    )
    if nodes > 0:
        line += f"; the rest is {(wall - kernel) / nodes:+.2f} µs per added node"
    return line + "."


def host_table(runners: list[Runner]) -> list[str]:
    lines = [
        "| variant | op types with no GPU kernel (count) "
        "| op types whose GPU kernel is all host memory (count) "
        "| cond/loop predicates (op: made by, memory, waits for) |",
        "|---|---|---|---|",
    ]
    for r in runners:
        no_kernel: collections.Counter = collections.Counter()
        host: collections.Counter = collections.Counter()
        for item in r.graph.nodes:
            node = item.node
            if node.op in PLUMBING or node.op in CALLS:
                continue
            kernel = gpu_kernel(node)
            if kernel is None:
                no_kernel[node.op] += 1
            elif host_only(node, kernel):
                host[node.op] += 1
        found = collections.Counter(str(p) for p in predicates(r.graph))
        lines.append(
            f"| {r.variant} | {_listed(no_kernel)} | {_listed(host)} "
            f"| {_listed(found)} |"
        )
    return lines


def _listed(counter: collections.Counter) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(counter.items())) or "none"


def available_probes() -> list[str]:
    """The probes whose patched names this package version has."""
    from gradient_accumulator.core import arithmetic, engine

    found = []
    for probe, owner, name in (
        ("probe-constant-logs", getattr(engine, "Engine", None), "logs"),
        ("probe-unchecked", arithmetic, "squared_norm"),
    ):
        if hasattr(owner, name):
            found.append(probe)
        else:
            print(f"{probe} skipped: the package has no {name} to patch")
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds")
    parser.add_argument(
        "--updates", type=int, default=20, help="updates per variant per round"
    )
    parser.add_argument(
        "--profile-updates", type=int, default=3, help="updates profiled per variant"
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--with-big-batch",
        action="store_true",
        help="also plain-big (plain Keras at batch K*m), the in-step mode's peer",
    )
    parser.add_argument(
        "--probes",
        action="store_true",
        help=f"add the probes {', '.join(PROBES)}: the model wrapper with an "
        "extra taken out, to measure what it costs",
    )
    parser.add_argument(
        "--quick", action="store_true", help="2 rounds, 2 updates each: a smoke test"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.updates = 2, 2
    check_arguments(parser, args, ("rounds", "updates", "profile_updates"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    k, m = args.accum_steps, args.micro_batch
    variants = (("plain-big",) if args.with_big_batch else ()) + VARIANTS
    if args.probes:
        variants += tuple(available_probes())
    print(
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}, CPU; "
        f"gradient_accumulator from {Path(gradient_accumulator.__file__).parent}; "
        f"digits MLP 64-{args.hidden}-{args.hidden}-10, Adam(1e-3), micro-batch "
        f"{m}, accum_steps {k}; {args.rounds} rounds of {args.updates} updates "
        f"per variant, interleaved; load average {os.getloadavg()[0]:.2f}.",
        flush=True,
    )
    keras.backend.clear_session()
    runners = [prepare(v, args) for v in variants]
    for runner in runners:  # unrecorded: the first calls after building
        runner.record(1)
        runner.wall.clear()
        runner.cpu.clear()
    for r in range(args.rounds):
        shift = r % len(runners)
        for runner in runners[shift:] + runners[:shift]:
            runner.record(args.updates)
    by_name = {r.variant: r for r in runners}

    print()
    print("\n".join(summary_table(runners)))
    print()
    print(
        "traced ops: the step's graph and every function it calls (both "
        "branches of each cond), before Grappler. kernels: recorded by the host "
        "tracer after Grappler, per update (K micro-steps streaming, one step "
        "in-step), median over the profiled updates; control-flow plumbing is "
        "not recorded. ms/update: train_function called directly, median over "
        "rounds; ratios: median of per-round ratios."
    )
    for runner in runners:
        print(f"  {runner.variant}: {({**DESCRIPTIONS, **PROBES})[runner.variant]}")
    print()
    print(
        "Difference by op type, GradientAccumulateModel streaming (ours-model) "
        "against Keras' built-in accumulation (keras-builtin):"
    )
    print()
    ours, theirs = by_name["ours-model"], by_name["keras-builtin"]
    print("\n".join(difference_table(ours, theirs)))
    print()
    print(cost_estimate(ours, theirs))
    print()
    print(
        "On a GPU machine (by inspection of the traced graph against this "
        "build's registered GPU kernels; Const, Identity, NoOp and calls left "
        "out). A predicate in device memory is copied to the host before its "
        "cond or loop can run:"
    )
    print()
    print("\n".join(host_table(runners)))
    print()
    print(f"load average {os.getloadavg()[0]:.2f} at end.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
