"""tf-keras under MirroredStrategy (two logical CPUs, see conftest.py): both
wrappers match plain tf-keras on the big batch, and sum the replicas' cycle
once per update."""

import contextlib
import functools

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from gradient_accumulator import GradientAccumulateModel, GradientAccumulateOptimizer

ATOL = 2e-5
MICRO, STEPS = 8, 4


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = rng.normal(size=(64, 2)).astype("float32")
    return x, y


def _model(cls=tf_keras.Model, **kwargs):
    tf_keras.utils.set_random_seed(1)
    inputs = tf_keras.Input((6,))
    hidden = tf_keras.layers.Dense(8, activation="tanh")(inputs)
    outputs = tf_keras.layers.Dense(2)(hidden)
    return cls(inputs=inputs, outputs=outputs, **kwargs)


def _optimizer(kind):
    return {
        "adam": lambda: tf_keras.optimizers.Adam(0.01),
        "legacy_sgd": lambda: tf_keras.optimizers.legacy.SGD(0.1, momentum=0.9),
    }[kind]()


def _big_batch(kind, strategy=None):
    """The plain model's weights after the big batch (under ``strategy``, if
    given) and the reductions its train function traced."""
    strategy = strategy or tf.distribute.get_strategy()
    x, y = _data()
    with _count_reductions(strategy) as counts:
        with strategy.scope():
            model = _model(_counting(tf_keras.Model))
            model.compile(_optimizer(kind), "mse")
        model.fit(x, y, batch_size=MICRO * STEPS, epochs=2, shuffle=False, verbose=0)
    counts["traces"] = _traces(model, strategy)
    return model.get_weights(), counts


def _counting(cls):
    """``cls`` counting the calls of its train step (``traces``): once per
    replica in each trace, as the step is a graph."""

    class Counting(cls):
        traces = 0

        def train_step(self, data):
            type(self).traces += 1
            return super().train_step(data)

    return Counting


def _traces(model, strategy) -> int:
    """The traces of a ``_counting`` model's train step under ``strategy``."""
    return model.traces // strategy.num_replicas_in_sync


@contextlib.contextmanager
def _count_reductions(strategy):
    """Counts the cross-replica reductions traced under ``strategy`` (this
    instance only, while in the block); the eager ones (metrics read at an
    epoch's end) are not counted."""
    names = ("reduce_to", "batch_reduce_to")
    counts = dict.fromkeys(names, 0)
    extended = strategy.extended
    for name in names:
        original = getattr(extended, name)

        @functools.wraps(original)
        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] += int(tf.inside_function())
            return _original(*args, **kwargs)

        setattr(extended, name, counted)
    try:
        yield counts
    finally:
        for name in names:
            delattr(extended, name)  # the class's method again


@pytest.mark.parametrize("kind", ["adam", "legacy_sgd"])
@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_mirrored_matches_the_big_batch_with_one_reduction(wrapper, kind, mirrored):
    strategy = mirrored
    with _count_reductions(strategy) as counts:
        with strategy.scope():
            if wrapper == "model":
                model = _model(_counting(GradientAccumulateModel), accum_steps=STEPS)
                model.compile(_optimizer(kind), "mse")
            else:
                model = _model(_counting(tf_keras.Model))
                inner = _optimizer(kind)
                model.compile(GradientAccumulateOptimizer(inner, STEPS), "mse")
        x, y = _data()
        model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    want, plain = _big_batch(kind, strategy)
    for got, expected in zip(model.get_weights(), want):
        np.testing.assert_allclose(got, expected, atol=ATOL)
    assert model.optimizer.iterations.numpy() == 4
    # Plain tf-keras sums the gradients over replicas in one batch_reduce_to
    # per trace of its train step (its reduce_to calls read metrics); the
    # wrappers replace it with the engine's one reduce_to of the packed
    # cycle, and the wrapped optimizer, told the gradients are summed
    # already, reduces nothing. Per trace: the model wrapper builds a
    # non-legacy optimizer before tracing, so it traces once where plain
    # tf-keras traces twice.
    traces = _traces(model, strategy)
    assert plain["batch_reduce_to"] == plain["traces"] >= 1, plain
    assert counts["batch_reduce_to"] == 0, (counts, plain)
    metric_reads = plain["reduce_to"] / plain["traces"]
    assert counts["reduce_to"] == traces * (metric_reads + 1), (counts, traces, plain)
    assert traces == (1 if (wrapper, kind) == ("model", "adam") else 2), traces


def test_custom_loop_with_the_optimizer_wrapper_matches_the_big_batch(mirrored):
    strategy = mirrored
    x, y = _data()

    def train(model, optimizer, batch_size):
        data = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
        )

        @tf.function
        def step(features, labels):
            def replica_step(features, labels):
                with tf.GradientTape() as tape:
                    per_sample = tf_keras.losses.mean_squared_error(
                        labels, model(features, training=True)
                    )
                    loss = tf.nn.compute_average_loss(
                        per_sample, global_batch_size=batch_size
                    )
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))

            strategy.run(replica_step, args=(features, labels))

        for features, labels in data:
            step(features, labels)
        return model.get_weights()

    with strategy.scope():
        plain, wrapped = _model(), _model()
        want = train(plain, tf_keras.optimizers.Adam(0.01), MICRO * STEPS)
        wrapper = GradientAccumulateOptimizer(
            tf_keras.optimizers.Adam(0.01), accum_steps=STEPS
        )
    got = train(wrapped, wrapper, MICRO)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=ATOL)
    assert wrapper.iterations.numpy() == 2
