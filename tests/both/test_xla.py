"""``compile(jit_compile=True)``, in each Keras: both wrappers train the
whole step inside one XLA computation and match plain Keras on the big
batch, compiled with XLA and without it. (Once
tests/keras3/test_model_modes.py's XLA test, the model wrapper with Adam
against plain Keras without XLA, and tests/keras2/test_xla.py, both
wrappers against plain tf-keras with XLA.)

The session enables op determinism (``tests/conftest.py``). Keras 3 falls
back to ``jit_compile=False`` under it; tf-keras (2.21 checked) keeps
``jit_compile=True``; but the project's rule for XLA tests holds in both:
each test runs with determinism off, restored afterwards, and asserts that
the model really compiled with XLA.
"""

from __future__ import annotations

import pytest
import tensorflow as tf
from tensorflow.python.framework import config as tf_config

from gradient_accumulator import GradientAccumulateModel, GradientAccumulateOptimizer
from tests.flavour import LEGACY_KERAS, keras, utils

B = 8  # micro-batch size
K = 4  # accumulation steps
N = 64
EPOCHS = 2
UPDATES = EPOCHS * N // (B * K)

# SGD with momentum and Adam; tf-keras' legacy ones too.
INNER = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
}
if LEGACY_KERAS:
    INNER = dict(utils.MOMENTUM_AND_ADAM)

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
    """``reference(kind, jit_compile)``: (initial weights, weights,
    iterations) of plain Keras, compiled with ``jit_compile`` and trained on
    the big batch with ``INNER[kind]``; each trained once per module (from a
    test, so with determinism off)."""
    x, y = utils.classification_data(N)
    done = {}

    def train(kind, jit_compile):
        if (kind, jit_compile) not in done:
            model = utils.seeded(utils.plain_model)
            initial = utils.weights(model)
            model.compile(
                optimizer=INNER[kind](),
                loss=utils.sparse_ce(),
                jit_compile=jit_compile,
            )
            utils.fit(model, x, y, B * K, epochs=EPOCHS)
            if jit_compile:
                assert_xla_compiled(model)
            else:
                assert all(ops == set() for ops in xla_compiled_ops(model))
            done[kind, jit_compile] = (
                initial,
                utils.weights(model),
                int(model.optimizer.iterations),
            )
        return done[kind, jit_compile]

    return train


def xla_compiled_ops(model) -> list[set[str]]:
    """For every train function ``fit`` traced: the op types of the
    functions it calls with ``_XlaMustCompile=True``
    (``tf.function(jit_compile=True)``: run as one XLA computation, or
    failing, never falling back to TensorFlow's kernels), including the
    functions these call in turn."""
    traced = [
        concrete
        for function in _tf_functions(model.train_function)
        for concrete in function._list_all_concrete_functions()
    ]
    assert traced, "fit traced no train function"
    return [_xla_ops(concrete.graph.as_graph_def()) for concrete in traced]


def _tf_functions(train_function) -> list:
    """tf-keras' train function is a ``tf.function``; Keras 3's is a Python
    function that calls its ``tf.function`` (the one ``fit`` runs, calling
    the step compiled with ``jit_compile``), held in its closure."""
    if hasattr(train_function, "_list_all_concrete_functions"):
        return [train_function]
    cells = [cell.cell_contents for cell in train_function.__closure__ or ()]
    return [f for f in cells if hasattr(f, "_list_all_concrete_functions")]


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
    assert model.jit_compile is True
    return model


@pytest.mark.usefixtures("without_determinism")
@pytest.mark.parametrize("kind", list(INNER))
@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_jit_compile_matches_big_batch(wrapper, kind, reference):
    """Micro-batches of 8, 4 per update, 2 epochs of 64 samples: the
    XLA-compiled accumulating step (its update-or-accumulate conditional
    inside the XLA computation) ends on the weights of plain Keras on
    batches of 32, with XLA and without, after the same 4 updates."""
    assert not tf_config.is_op_determinism_enabled()
    x, y = utils.classification_data(N)
    model = _accumulating(wrapper, INNER[kind])
    initial = utils.weights(model)
    utils.fit(model, x, y, B, epochs=EPOCHS)
    assert_xla_compiled(model, conditional=True)
    got = utils.weights(model)
    utils.assert_trained(initial, got)
    for jit_compile in (True, False):
        start, expected, ref_iterations = reference(kind, jit_compile)
        assert utils.max_abs_diff(start, initial) == 0.0
        utils.assert_trained(initial, expected)
        utils.report(
            utils.assert_same_weights(got, expected),
            f"max |w_accum - w_bigbatch| (reference jit_compile={jit_compile})",
        )
        assert int(model.optimizer.iterations) == ref_iterations == UPDATES
    if wrapper == "optimizer":
        inner = model.optimizer.inner_optimizer
        assert int(inner.iterations) == UPDATES


def test_xla_check_sees_no_xla_without_jit_compile():
    """The check's negative control: a model compiled without
    ``jit_compile`` has no XLA-compiled function in its train step."""
    x, y = utils.classification_data(N)
    model = utils.seeded(utils.plain_model)
    model.compile(optimizer=INNER["sgd_momentum"](), loss=utils.sparse_ce())
    utils.fit(model, x, y, B * K)
    assert not model.jit_compile
    assert all(ops == set() for ops in xla_compiled_ops(model))
