"""The cycle decision stays off the micro-batch's critical path (issue 22).

On a GPU a ``tf.cond``'s predicate is read on the host. If the predicate
waits for the micro-batch's gradients, every micro-step stalls on that copy
after its backward pass; Keras' own accumulation reads only its counter, so
the copy overlaps the computation. This machine has no GPU, so the traced
graph is inspected: the decision's predicate must depend on no op of the
forward or backward pass, while the cond itself (which changes the state)
must still wait for them (datasets of unknown length, see how-it-works).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator import GradientAccumulateOptimizer
from tests import utils

COND_TYPES = {"If", "StatelessIf"}
PASS_TYPES = {"MatMul", "BiasAdd", "Tanh", "TanhGrad", "BiasAddGrad"}


def _ancestors(tensor_or_op) -> set[tf.Operation]:
    """Every op the given one waits for, through data and control inputs."""
    start = getattr(tensor_or_op, "op", tensor_or_op)
    seen, stack = set(), [start]
    while stack:
        op = stack.pop()
        for parent in [t.op for t in op.inputs] + list(op.control_inputs):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def _decision(graph: tf.Graph) -> tf.Operation:
    """The cond whose predicate compares the micro-step counter with the
    cycle length."""
    found = [
        op
        for op in graph.get_operations()
        if op.type in COND_TYPES and op.inputs[0].op.type == "GreaterEqual"
    ]
    assert len(found) == 1, [op.name for op in found]
    return found[0]


def _model(wrapper: str) -> keras.Model:
    keras.utils.set_random_seed(0)
    if wrapper == "model":
        model = utils.accumulating_model(accum_steps=4)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=utils.sparse_ce())
    else:
        model = utils.plain_model()
        optimizer = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), 4)
        model.compile(optimizer=optimizer, loss=utils.sparse_ce())
    return model


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_decision_predicate_waits_for_no_forward_or_backward_op(wrapper):
    model = _model(wrapper)
    x, y = utils.classification_data(8)
    model.fit(x, y, batch_size=8, verbose=0)  # builds state and optimizer
    data = (tf.constant(x), tf.constant(y))
    graph = tf.function(model.train_step).get_concrete_function(data).graph
    cond = _decision(graph)
    predicate = {op.type for op in _ancestors(cond.inputs[0])}
    assert not predicate & PASS_TYPES, sorted(predicate)
    # The cond itself still waits for the micro-batch's gradients.
    assert {op.type for op in _ancestors(cond)} & PASS_TYPES
    # Inside the accumulating branch, a cond's predicate is an argument (read
    # before the decision), not a variable read there after the gradients.
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    branch = library[cond.get_attr("else_branch").name]
    inner = [n for n in branch.node_def if n.op in COND_TYPES]
    assert inner, "the accumulating branch has no cond to check"
    arguments = {a.name for a in branch.signature.input_arg}
    for node in inner:
        assert node.input[0] in arguments, (node.name, node.input[0])


def test_the_graph_check_sees_a_predicate_that_waits():
    # The check above can fail: a predicate computed under a control
    # dependency on the gradients is found.
    v = tf.Variable(np.ones((2, 2), "float32"))
    counter = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.tanh(tf.matmul(x, v)))
        grad = tape.gradient(loss, v)
        with tf.control_dependencies([grad]):
            late = counter + 1 >= 4
        return tf.cond(late, lambda: tf.constant(1), lambda: tf.constant(0))

    graph = step.get_concrete_function(tf.TensorSpec((2, 2), tf.float32)).graph
    predicate = {op.type for op in _ancestors(_decision(graph).inputs[0])}
    assert predicate & PASS_TYPES
