"""``verify``, in each Keras: the report is right.

A model that accumulation reproduces must pass with differences at round-off
level; models with BatchNormalization, Dropout, noise or per-call state must
fail and name that layer and why. (The console command: tests/keras3/test_verify.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator import (
    AccumBatchNormalization,
    GradientAccumulateModel,
    GradientAccumulateOptimizer,
    VerifyReport,
    verify,
)
from tests.flavour import LEGACY_KERAS, keras, utils

ATOL, classification_data, mlp_layers = (
    utils.ATOL,
    utils.classification_data,
    utils.mlp_layers,
)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
layers = keras.layers


def mlp():
    return keras.Model(*mlp_layers())


def mlp_with(layer_fn):
    inputs = keras.Input((8,))
    h = layers.Dense(16, name="hidden")(inputs)
    h = layer_fn()(h)
    h = layers.Activation("tanh")(h)
    return keras.Model(inputs, layers.Dense(3, name="head")(h))


class CallCounter(layers.Layer):
    """Identity with a non-trainable variable that every training call
    changes: once per micro-batch under accumulation, once per big batch
    without."""

    def build(self, input_shape):
        self.count = self.add_weight(
            shape=(), initializer="zeros", trainable=False, name="count"
        )

    def call(self, x, training=False):
        if training:
            self.count.assign_add(1.0)
        return x


def variables(report):
    return [v for layer in report.layers for v in layer.variables]


def test_mlp_passes_with_round_off_differences():
    x, y = classification_data(n=96)
    report = verify(mlp, x, y, micro_batch_size=8, accum_steps=4, steps=3, loss=LOSS)
    assert isinstance(report, VerifyReport)
    assert report.ok, str(report)
    assert report.moved > 1e-3, str(report)  # training did move the weights
    assert report.max_abs_diff <= ATOL, str(report)
    checked = variables(report)
    assert len(checked) == 4  # two kernels, two biases
    assert [v.name for v in checked] == ["kernel", "bias", "kernel", "bias"]
    assert all(v.ok and v.max_abs_diff <= ATOL for v in checked)
    assert report.failing_layers == [] and report.causes == []
    text = str(report)
    assert "big batch 32 vs accumulated 8 x 4, 3 update(s)" in text
    assert "OK:" in text


ADAMS = {"adam": lambda: keras.optimizers.Adam(1e-2)}
if LEGACY_KERAS:
    ADAMS["legacy-adam"] = lambda: keras.optimizers.legacy.Adam(1e-2)


@pytest.mark.parametrize("make_optimizer", ADAMS.values(), ids=ADAMS.keys())
def test_adam_and_compiled_model_fn_pass(make_optimizer):
    """A compiled ``model_fn`` supplies loss and optimizer (in tf-keras,
    current or legacy); Adam is the most sensitive to gradient differences."""

    def compiled():
        model = mlp()
        model.compile(optimizer=make_optimizer(), loss=LOSS)
        return model

    x, y = classification_data(n=64)
    report = verify(compiled, x, y, micro_batch_size=4, accum_steps=4, steps=4)
    assert report.ok, str(report)
    assert report.max_abs_diff <= ATOL
    assert report.moved > 1e-2  # Adam with lr 1e-2: ~lr per step


def test_sequential_and_accumulating_model_fns():
    """A Sequential model lines up with its functional rebuild; a model_fn
    that already accumulates is compared without accumulation as reference,
    with the optimizer it wraps."""

    def sequential():
        return keras.Sequential(
            [keras.Input((8,)), layers.Dense(16, activation="tanh"),
             layers.Dense(3)]
        )  # fmt: skip

    def accumulating():
        inputs, outputs = mlp_layers()
        model = GradientAccumulateModel(6, inputs=inputs, outputs=outputs)
        with pytest.warns(UserWarning, match="every 36 micro-batches"):
            model.compile(
                optimizer=GradientAccumulateOptimizer(keras.optimizers.Adam(1e-2), 6),
                loss=LOSS,
            )
        return model

    x, y = classification_data(n=64)
    for model_fn, loss in ((sequential, LOSS), (accumulating, None)):
        report = verify(
            model_fn, x, y, micro_batch_size=4, accum_steps=4, steps=4, loss=loss
        )
        assert report.ok, str(report)
        assert report.max_abs_diff <= ATOL
        assert len(variables(report)) == 4
    assert report.moved > 1e-2  # the wrapped Adam(1e-2), not SGD's default


@pytest.mark.parametrize(
    ("layer_fn", "name", "why"),
    [
        (lambda: layers.BatchNormalization(name="bn"), "bn", "Fix: use"),
        (
            lambda: AccumBatchNormalization(name="abn"),
            "abn",
            "AccumBatchNormalization makes the moving statistics",
        ),
        (lambda: layers.Dropout(0.3, name="drop"), "drop", "random"),
        (lambda: layers.GaussianNoise(0.3, name="noise"), "noise", "random"),
        (lambda: CallCounter(name="counter"), "counter", "non-trainable state"),
    ],
    ids=["batchnorm", "accum-batchnorm", "dropout", "noise", "per-call-state"],
)
def test_layers_that_break_equivalence_are_named(layer_fn, name, why):
    x, y = classification_data(n=96)
    report = verify(
        lambda: mlp_with(layer_fn), x, y, micro_batch_size=8, accum_steps=4, loss=LOSS
    )
    assert not report.ok, str(report)
    assert [c.name for c in report.causes] == [name], str(report)
    (cause,) = report.causes
    assert not cause.ok and cause.breaks_equivalence
    assert why in cause.reason, cause.reason
    # The trainable layers around it differ too (the counter changes no
    # trainable weight), and say why.
    failing = {layer.name: layer for layer in report.failing_layers}
    if name != "counter":
        assert "hidden" in failing and "head" in failing, str(report)
    for other in ("hidden", "head"):
        if other in failing:
            assert not failing[other].breaks_equivalence
            assert name in failing[other].reason
    text = str(report)
    assert f"{name} (" in text and why in text and "FAIL:" in text
    assert text.splitlines()[-1].startswith("FAIL:")


def test_batch_norm_report_names_the_fix():
    x, y = classification_data(n=96)
    report = verify(
        lambda: mlp_with(lambda: layers.BatchNormalization(name="bn")),
        x,
        y,
        micro_batch_size=8,
        accum_steps=4,
        loss=LOSS,
    )
    fix = str(report).split("Breaks equivalence:")[1]
    assert "bn (BatchNormalization)" in fix
    assert "Fix: use gradient_accumulator.AccumBatchNormalization" in fix
    assert "replace_batchnorm_layers(model)" in fix
    assert "Differ as a consequence: hidden, head." in str(report)
    (bn,) = [layer for layer in report.layers if layer.name == "bn"]
    names = [v.name for v in bn.variables]
    assert names == ["gamma", "beta", "moving_mean", "moving_variance"]
    assert [v.trainable for v in bn.variables] == [True, True, False, False]


def test_a_nested_model_names_the_nested_cause():
    def nested():
        block_in = keras.Input((16,))
        h = layers.Dropout(0.3, name="inner_drop")(block_in)
        block = keras.Model(block_in, layers.Dense(16)(h), name="block")
        inputs = keras.Input((8,))
        h = block(layers.Dense(16, name="hidden")(inputs))
        return keras.Model(inputs, layers.Dense(3, name="head")(h))

    x, y = classification_data(n=96)
    report = verify(nested, x, y, micro_batch_size=8, accum_steps=4, loss=LOSS)
    assert [c.name for c in report.causes] == ["block"], str(report)
    assert report.causes[0].reason.startswith("nested inner_drop (Dropout): ")


def test_per_call_state_is_compared():
    """The counter's variable itself: 1 update per big batch vs 4."""
    x, y = classification_data(n=96)
    report = verify(
        lambda: mlp_with(lambda: CallCounter(name="counter")),
        x,
        y,
        micro_batch_size=8,
        accum_steps=4,
        steps=3,
        loss=LOSS,
    )
    (counter,) = [layer for layer in report.layers if layer.name == "counter"]
    (count,) = counter.variables
    assert count.name == "count" and not count.trainable
    assert count.moved == 3.0  # 3 big-batch calls
    assert count.max_abs_diff == 9.0  # 12 micro-batch calls


def test_untrained_weights_do_not_pass():
    """Weights that training hardly moves make any comparison vacuous."""
    x, y = classification_data(n=32)
    tiny = keras.optimizers.SGD(learning_rate=1e-9)
    report = verify(
        mlp, x, y, micro_batch_size=8, accum_steps=4, steps=1, optimizer=tiny, loss=LOSS
    )
    assert report.moved <= report.tolerance
    assert not report.ok
    assert "proves nothing" in str(report)


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = layers.Dense(3)

    def call(self, x):
        return self.dense(x)


X, Y = classification_data(n=32)


@pytest.mark.parametrize(
    ("kwargs", "error", "argument"),
    [
        ({"model_fn": "mlp"}, TypeError, "model_fn"),
        ({"model_fn": lambda: 3}, TypeError, "model_fn"),
        ({"model_fn": Subclassed}, ValueError, "model_fn"),
        ({"micro_batch_size": 0}, ValueError, "micro_batch_size"),
        ({"micro_batch_size": 2.0}, TypeError, "micro_batch_size"),
        ({"accum_steps": 0}, ValueError, "accum_steps"),
        ({"accum_steps": "4"}, TypeError, "accum_steps"),
        ({"steps": 0}, ValueError, "steps"),
        ({"steps": True}, TypeError, "steps"),
        ({"tolerance": 0.0}, ValueError, "tolerance"),
        ({"tolerance": "1e-4"}, TypeError, "tolerance"),
        ({"seed": 1.5}, TypeError, "seed"),
        ({"optimizer": 0.1}, TypeError, "optimizer"),
        (
            {"optimizer": GradientAccumulateOptimizer("sgd", 4)},
            TypeError,
            "without accumulation",
        ),
        ({"loss": None}, ValueError, "loss"),
        ({"steps": 2}, ValueError, "`x` has 32 samples"),  # needs 2 * 8 * 4
        ({"y": Y[:10]}, ValueError, "`y` has 10 samples"),
        ({"x": [X, X[:16]]}, ValueError, "`x`: all arrays"),
        # Both Kerases' verify name their arguments (hosts/public.py).
        ({"micro_batch": 8}, TypeError, "unexpected keyword argument 'micro_batch'"),
    ],
)
def test_invalid_arguments_are_named(kwargs, error, argument):
    call = {
        "model_fn": mlp,
        "x": X,
        "y": Y,
        "micro_batch_size": 8,
        "accum_steps": 4,
        "steps": 1,
        "loss": LOSS,
        **kwargs,
    }
    with pytest.raises(error, match=argument):
        verify(call.pop("model_fn"), call.pop("x"), call.pop("y"), **call)


def test_model_fn_must_build_the_same_architecture():
    sizes = iter([16, 32])

    def changing():
        inputs = keras.Input((8,))
        h = layers.Dense(next(sizes))(inputs)
        return keras.Model(inputs, layers.Dense(3)(h))

    with pytest.raises(ValueError, match="same architecture"):
        verify(changing, X, Y, micro_batch_size=8, accum_steps=4, steps=1, loss=LOSS)


def test_multi_input_dict_data():
    def two_inputs():
        a, b = keras.Input((4,), name="a"), keras.Input((4,), name="b")
        h = layers.Concatenate()([a, b])
        return keras.Model({"a": a, "b": b}, layers.Dense(3)(h))

    x = {"a": X[:, :4], "b": X[:, 4:]}
    report = verify(
        two_inputs, x, Y, micro_batch_size=4, accum_steps=2, steps=2, loss=LOSS
    )
    assert report.ok, str(report)
    assert report.max_abs_diff <= ATOL


def test_report_is_plain_data():
    """Numbers in the report are Python floats (printable, comparable)."""
    x, y = classification_data(n=32)
    report = verify(mlp, x, y, micro_batch_size=4, accum_steps=2, steps=2, loss=LOSS)
    for layer in report.layers:
        for v in layer.variables:
            assert type(v.max_abs_diff) is float and type(v.moved) is float
            assert np.isfinite(v.max_abs_diff)


# ------------------------------------------- state get_weights() leaves out
class _Step:
    """Where a layer keeps state outside its weights (as TensorFlow Model
    Optimization's pruning wrapper keeps its step and masks)."""

    def __init__(self):
        self.step = tf.Variable(0.0, trainable=False, name="step")


class HiddenStep(layers.Layer):
    """Scales by ``1 + step / 10``, ``step`` counting training calls in a
    variable that ``weights`` and ``get_weights()`` do not hold."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.state = _Step()

    def call(self, x, training=False):
        if training:
            self.state.step.assign_add(1.0)
        return x * (1.0 + self.state.step / 10.0)


class LeftOut(layers.Layer):
    """A layer whose ``get_weights()`` leaves out a variable it adds with
    ``add_weight`` (the pruning wrapper's ``mask``, ``threshold`` and
    ``pruning_step`` so), counting training calls."""

    def build(self, input_shape):
        self.scale = self.add_weight(name="scale", shape=(), initializer="ones")
        self.count = self.add_weight(
            name="count", shape=(), initializer="zeros", trainable=False
        )

    def get_weights(self):
        return [self.scale.numpy()]

    def set_weights(self, weights):
        self.scale.assign(weights[0])

    def call(self, x, training=False):
        if training:
            self.count.assign_add(1.0)
        return x * self.scale * (1.0 + self.count / 10.0)


@pytest.mark.parametrize(("layer", "names"), [(HiddenStep, "step"), (LeftOut, "count")])
def test_names_per_call_state_that_get_weights_leaves_out(layer, names):
    x, y = classification_data(n=96)
    report = verify(
        lambda: mlp_with(layer), x, y, micro_batch_size=8, steps=3, loss=LOSS
    )
    assert not report.ok
    (cause,) = report.causes
    assert cause.class_name == layer.__name__
    assert f"get_weights() leaves out ({names})" in cause.reason
    assert "4 times per update" in cause.reason


def test_a_model_instead_of_a_function_that_builds_one_is_named():
    x, y = classification_data(n=96)
    with pytest.raises(TypeError, match="a Functional instance") as error:
        verify(mlp(), x, y, loss=LOSS)
    assert f"{keras.__name__}.models.clone_model" in str(error.value)
    report = verify(lambda: keras.models.clone_model(mlp()), x, y, loss=LOSS)
    assert report.ok, str(report)


class _Batches(keras.callbacks.Callback):
    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def on_train_batch_begin(self, batch, logs=None):
        self.seen.append(self.model)


def test_callbacks_are_new_for_each_run_and_a_failed_run_is_named():
    """The pruning wrapper fails a run without its callback; any error of a
    run is re-raised naming the run and the ``callbacks`` option."""
    x, y = classification_data(n=96)
    seen = []
    report = verify(
        mlp,
        x,
        y,
        micro_batch_size=8,
        steps=3,
        loss=LOSS,
        callbacks=lambda: [_Batches(seen)],
    )
    assert report.ok
    assert len(seen) == 3 + 3 * 4 and len({id(m) for m in seen}) == 2
    with pytest.raises(TypeError, match="`callbacks` must be None or a function"):
        verify(mlp, x, y, loss=LOSS, callbacks=[_Batches(seen)])
    with pytest.raises(
        RuntimeError,
        match=r"(?s)training the plain, big batch run .* `callbacks=lambda",
    ):
        verify(mlp, x, y.astype("float32") + 0.5, loss="categorical_crossentropy")


# ------------------------------------------------------- in-batch negatives
class InBatchScores(layers.Layer):
    """Each query's score against every candidate of the batch: a retrieval
    model's in-batch negatives."""

    def call(self, inputs):
        queries, candidates = inputs
        return tf.matmul(queries, candidates, transpose_b=True)


def in_batch_loss(y_true, scores):
    """Softmax cross-entropy of each query's own candidate (the diagonal)
    against the batch's others."""
    labels = tf.range(tf.shape(scores)[0])
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels, scores)


def retrieval():
    query = keras.Input((8,), name="query")
    candidate = keras.Input((8,), name="candidate")
    q = layers.Dense(6, name="query_tower")(query)
    c = layers.Dense(6, name="candidate_tower")(candidate)
    scores = InBatchScores(name="scores")([q, c])
    return keras.Model([query, candidate], scores)


def test_in_batch_negatives_are_named():
    x, _ = classification_data(n=96)
    rng = np.random.default_rng(3)
    pairs = [x, (x + 0.3 * rng.normal(size=x.shape)).astype("float32")]
    report = verify(
        retrieval,
        pairs,
        np.zeros((96, 1), "float32"),
        micro_batch_size=8,
        accum_steps=4,
        loss=in_batch_loss,
        optimizer=keras.optimizers.SGD(0.5),
    )
    assert not report.ok, str(report)
    assert [c.name for c in report.causes] == ["scores"], str(report)
    (cause,) = report.causes
    assert "in-batch negatives" in cause.reason
    assert "its own 8 candidates, not the big batch's 32" in cause.reason
    towers = {x.name: x for x in report.failing_layers}
    assert {"query_tower", "candidate_tower"} <= set(towers), str(report)
    assert "follows from scores" in towers["query_tower"].reason


def per_step():
    """Three scores for each of 3 steps: axis 1 is the sequence's, 3 for
    any batch size (the size of one of the probe's batches too)."""
    inputs = keras.Input((3, 8))
    h = layers.Dense(6, activation="tanh", name="per_step")(inputs)
    return keras.Model(inputs, layers.Dense(3, name="head")(h))


def test_a_sequence_axis_is_not_taken_for_in_batch_negatives():
    x, y = classification_data(n=96)
    x = np.stack([x, x[::-1], 0.5 * x], axis=1)
    y = np.stack([y, y[::-1], y], axis=1)
    report = verify(per_step, x, y, micro_batch_size=8, loss=LOSS)
    assert report.ok, str(report)
    assert report.moved > 1e-3


def test_a_model_fn_returning_a_model_again_is_refused():
    """``lambda: model`` (or a new model over the same layers) makes both runs
    train one set of variables, and the comparison of a model with itself
    says OK: refused, saying how to write the builder; ``clone_model``
    builds two models and the same model is then compared for real."""

    def with_dropout():
        inputs = keras.Input((8,))
        h = layers.Dense(16)(inputs)
        h = layers.BatchNormalization()(h)
        h = layers.Dropout(0.3)(h)
        return keras.Model(inputs, layers.Dense(3)(h))

    model = with_dropout()
    x, y = classification_data(n=96)
    options = {"micro_batch_size": 8, "accum_steps": 4, "loss": LOSS}
    with pytest.raises(ValueError, match=r"the same model twice.*clone_model"):
        verify(lambda: model, x, y, **options)
    with pytest.raises(ValueError, match=r"sharing 8 variable\(s\).*new layers"):
        verify(lambda: keras.Model(model.inputs, model.outputs), x, y, **options)
    report = verify(lambda: keras.models.clone_model(model), x, y, **options)
    assert not report.ok and report.max_abs_diff > 1e-3, str(report)


def text_classifier():
    """The text-classification tutorial's model: token ids, an embedding,
    average pooling and two dense layers."""
    inputs = keras.Input((40,), dtype="int32")
    h = layers.Embedding(2000, 16, name="embedding")(inputs)
    h = layers.GlobalAveragePooling1D()(h)
    h = layers.Dense(16, activation="relu")(h)
    return keras.Model(inputs, layers.Dense(1, activation="sigmoid")(h))


def padded_token_data(n=512, seed=0):
    """Sequences of 5 to 40 tokens padded with id 0: the padding token is
    gathered thousands of times in every batch."""
    rng = np.random.default_rng(seed)
    x = np.zeros((n, 40), "int32")
    for row, length in zip(x, rng.integers(5, 41, n)):
        row[:length] = rng.integers(1, 2000, length)
    y = (x[:, :3].sum(axis=1) % 2).astype("float32")
    return x, y


def dense_big_batch_embedding(initial, x, y, big, steps):
    """Plain Keras trained on the big batches with the embedding's gradient
    made dense before Adam: the mathematically dense big batch."""
    model = text_classifier()
    model.set_weights(initial)
    loss_fn = keras.losses.BinaryCrossentropy()
    optimizer = keras.optimizers.Adam()
    for step in range(steps):
        xb, yb = x[step * big : (step + 1) * big], y[step * big : (step + 1) * big]
        with tf.GradientTape() as tape:
            loss = loss_fn(yb[:, None], model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        grads = [tf.convert_to_tensor(g) for g in grads]  # IndexedSlices -> dense
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return model.get_layer("embedding").get_weights()[0]


def test_sparse_embedding_rows_with_adam_are_named_with_the_dense_reference():
    """Keras 3's Adam takes an embedding's sparse gradient row by row, so a
    repeated token (the padding) enters its second moment once per
    occurrence; accumulation sums first. verify names that cause (the layer,
    the optimizer, which run is the dense one); the accumulated run equals
    the big batch with a dense gradient. tf-keras' optimizers add repeated
    rows up before the update: there the two runs agree and verify says OK."""
    x, y = padded_token_data()
    report = verify(
        text_classifier, x, y, micro_batch_size=8, accum_steps=4, steps=16,
        optimizer="adam", loss="binary_crossentropy",
    )  # fmt: skip
    if LEGACY_KERAS:
        assert report.ok, str(report)
        return
    assert not report.ok, str(report)
    assert [c.name for c in report.causes] == ["embedding"], str(report)
    (cause,) = report.causes
    assert "the big batch's Adam" in cause.reason, cause.reason
    assert "accumulated run is the mathematically dense one" in cause.reason
    assert 'docs/verify.md, "Sparse rows"' in cause.reason
    assert "no known cause" not in str(report), str(report)
    # The cause is the big batch's: against the dense big batch the
    # package's run is exact.
    initial = text_classifier().get_weights()
    dense = dense_big_batch_embedding(initial, x, y, 32, 16)
    plain = text_classifier()
    ours = GradientAccumulateModel(4, inputs=plain.inputs, outputs=plain.outputs)
    ours.set_weights(initial)
    ours.compile(optimizer="adam", loss="binary_crossentropy")
    ours.fit(x[: 32 * 16], y[: 32 * 16], batch_size=8, shuffle=False, verbose=0)
    got = ours.get_layer("embedding").get_weights()[0]
    assert np.max(np.abs(got - dense)) <= ATOL


def test_sparse_rows_with_sgd_are_exact_and_name_nothing():
    """SGD is linear in the gradient: repeated rows give the same update
    taken apart or summed, and verify says OK on the same model."""
    x, y = padded_token_data()
    report = verify(
        text_classifier, x, y, micro_batch_size=8, accum_steps=4, steps=8,
        optimizer=keras.optimizers.SGD(0.5), loss="binary_crossentropy",
    )  # fmt: skip
    assert report.ok, str(report)
