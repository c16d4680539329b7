"""tf-keras ``compile(jit_compile=True)``: both wrappers train the whole step
inside one XLA computation and match plain tf-keras on the big batch, itself
compiled with ``jit_compile=True``.

The session enables op determinism (``conftest.py``). tf-keras (2.21
checked) keeps ``jit_compile=True`` under it, where Keras 3 falls back to
``jit_compile=False``; but the project's rule for XLA tests holds here too:
each test runs with determinism off, restored afterwards, and asserts that
the model really compiled with XLA.
"""

from __future__ import annotations

import pytest
import tensorflow as tf
from tensorflow.python.framework import config as tf_config

from gradient_accumulator import GradientAccumulateModel, GradientAccumulateOptimizer
from tests.keras2 import utils
from tests.keras2.utils import EPOCHS, UPDATES, B, K

INNER = utils.MOMENTUM_AND_ADAM

# Ops that write variables: the optimizer's update and the engine's sums.
_WRITES = ("Assign", "ResourceApply", "ResourceScatter")


@pytest.fixture
def without_determinism():
    """Op determinism off for one test, restored afterwards."""
    was_enabled = tf_config.is_op_determinism_enabled()
    tf_config.disable_op_determinism()
    try:
        yield
    finally:
        if was_enabled:
            tf.config.experimental.enable_op_determinism()


@pytest.fixture(scope="module")
def reference():
    """``reference(kind)``: (initial weights, weights, iterations) of plain
    tf-keras compiled with ``jit_compile=True`` and trained on the big batch,
    with ``INNER[kind]``; each kind trained once per module."""
    x, y = utils.classification_data()
    done = {}

    def train(kind):
        if kind not in done:
            initial, model = utils.big_batch(
                INNER[kind], x, y, compile_kwargs={"jit_compile": True}
            )
            assert_xla_compiled(model)
            done[kind] = initial, utils.weights(model), int(model.optimizer.iterations)
        return done[kind]

    return train


def xla_compiled_ops(model) -> list[set[str]]:
    """For every train function ``fit`` traced: the op types of the
    functions it calls with ``_XlaMustCompile=True``
    (``tf.function(jit_compile=True)``: run as one XLA computation, or
    failing, never falling back to TensorFlow's kernels), including the
    functions these call in turn."""
    traced = model.train_function._list_all_concrete_functions()
    assert traced, "fit traced no train function"
    return [_xla_ops(concrete.graph.as_graph_def()) for concrete in traced]


def _xla_ops(graph) -> set[str]:
    library = {f.signature.name: f for f in graph.library.function}

    def called(node):
        names = [a.func.name for a in node.attr.values() if a.HasField("func")]
        names += [f.name for a in node.attr.values() for f in a.list.func]
        return [name for name in names if name in library]

    def must_compile(node):
        return _marked(node) or any(_marked(library[f]) for f in called(node))

    ops: set[str] = set()
    seen: set[str] = set()

    def collect(name):
        if name not in seen:
            seen.add(name)
            for node in library[name].node_def:
                ops.add(node.op)
                for inner in called(node):
                    collect(inner)

    nodes = list(graph.node) + [n for f in library.values() for n in f.node_def]
    for node in nodes:
        if must_compile(node):
            for name in called(node):
                collect(name)
    return ops


def _marked(node_or_function) -> bool:
    attr = node_or_function.attr
    return "_XlaMustCompile" in attr and attr["_XlaMustCompile"].b


def assert_xla_compiled(model, conditional: bool = False) -> None:
    """The model kept ``jit_compile=True`` and its train step, variable
    updates (and, with ``conditional``, the engine's update-or-accumulate
    conditional) included, sits in an XLA-compiled function."""
    assert model.jit_compile is True
    for ops in xla_compiled_ops(model):
        assert ops, "no function of the train step is marked _XlaMustCompile"
        assert any(op.startswith(_WRITES) for op in ops), sorted(ops)
        if conditional:
            assert ops & {"If", "StatelessIf"}, sorted(ops)


def _accumulating(wrapper: str, make_inner):
    if wrapper == "model":
        model = utils.seeded(lambda: utils.accumulating_model(accum_steps=K))
        assert isinstance(model, GradientAccumulateModel)
        optimizer = make_inner()
    else:
        model = utils.seeded(utils.plain_model)
        optimizer = GradientAccumulateOptimizer(make_inner(), accum_steps=K)
    model.compile(optimizer=optimizer, loss=utils.sparse_ce(), jit_compile=True)
    return model


@pytest.mark.usefixtures("without_determinism")
@pytest.mark.parametrize("kind", list(INNER))
@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_jit_compile_matches_big_batch(wrapper, kind, reference):
    assert not tf_config.is_op_determinism_enabled()
    initial, expected, ref_iterations = reference(kind)
    x, y = utils.classification_data()
    model = _accumulating(wrapper, INNER[kind])
    utils.fit(model, x, y, B, epochs=EPOCHS)
    assert_xla_compiled(model, conditional=True)
    got = utils.weights(model)
    utils.assert_trained(initial, expected)
    utils.assert_trained(initial, got)
    utils.report(utils.assert_same_weights(got, expected))
    assert int(model.optimizer.iterations) == ref_iterations == UPDATES
    if wrapper == "optimizer":
        inner = model.optimizer.inner_optimizer
        assert int(inner.iterations) == UPDATES


def test_xla_check_sees_no_xla_without_jit_compile():
    """The check's negative control: a model compiled without
    ``jit_compile`` has no XLA-compiled function in its train step."""
    x, y = utils.classification_data()
    _, model = utils.big_batch(INNER["sgd_momentum"], x, y, epochs=1)
    assert not model.jit_compile
    assert all(ops == set() for ops in xla_compiled_ops(model))
