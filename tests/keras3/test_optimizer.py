"""GradientAccumulateOptimizer against plain Keras on the big batch.

The reference is always a plain ``keras.Model`` with the plain inner optimizer
trained with ``fit(batch_size=B * K)``; the accumulating run is the same model
compiled with ``GradientAccumulateOptimizer(inner, accum_steps=K)`` and trained
with ``fit(batch_size=B)``. Manual ``apply`` tests compare against a fresh inner
optimizer applying the mean (or sum) of the gradients once.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator import GradientAccumulateOptimizer
from tests import utils

B = 8  # micro-batch size
K = 4  # accumulation steps
N = 64  # samples: a multiple of B * K so cycles and big batches line up
EPOCHS = 3


def _compile(model: keras.Model, optimizer) -> None:
    model.compile(optimizer=optimizer, loss=utils.sparse_ce())


def _big_batch_and_accumulated(
    make_inner,
    build=utils.plain_model,
    data=None,
    make_reference=None,
    **wrapper_kwargs,
):
    """Trains the reference (plain ``make_reference()``, default
    ``make_inner()``, on the big batch) and the accumulating model; returns
    (initial weights, reference model, accumulating model)."""
    x, y = data if data is not None else utils.classification_data(N)

    reference = utils.seeded(build)
    initial = utils.weights(reference)
    _compile(reference, (make_reference or make_inner)())
    reference.fit(x, y, batch_size=B * K, epochs=EPOCHS, shuffle=False, verbose=0)

    accumulated = utils.seeded(build)
    assert utils.max_abs_diff(initial, utils.weights(accumulated)) == 0.0
    _compile(
        accumulated,
        GradientAccumulateOptimizer(make_inner(), accum_steps=K, **wrapper_kwargs),
    )
    accumulated.fit(x, y, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0)
    return initial, reference, accumulated


def _assert_equivalent(initial, reference, accumulated) -> float:
    """``utils.assert_equivalent`` plus the inner optimizer's update count.
    These tests have never asserted that the accumulated model moved (only
    the reference), hence ``accumulated_moved=False``."""
    updates = EPOCHS * N // (B * K)
    diff = utils.assert_equivalent(
        initial, reference, accumulated, updates, accumulated_moved=False
    )
    assert int(accumulated.optimizer.inner_optimizer.iterations) == updates
    return diff


# --------------------------------------------------------------------- fit
@pytest.mark.parametrize(
    "make_inner",
    [
        pytest.param(lambda: keras.optimizers.SGD(0.1), id="sgd"),
        pytest.param(lambda: keras.optimizers.SGD(0.05, momentum=0.9), id="momentum"),
        pytest.param(lambda: keras.optimizers.Adam(1e-2), id="adam"),
        pytest.param(
            lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1), id="adamw"
        ),
        pytest.param(lambda: keras.optimizers.SGD(0.5, clipnorm=0.05), id="clipnorm"),
        pytest.param(
            lambda: keras.optimizers.SGD(0.5, global_clipnorm=0.05),
            id="global_clipnorm",
        ),
        pytest.param(lambda: keras.optimizers.SGD(0.5, clipvalue=0.01), id="clipvalue"),
        pytest.param(
            lambda: keras.optimizers.SGD(
                keras.optimizers.schedules.ExponentialDecay(
                    0.2, decay_steps=1, decay_rate=0.5
                )
            ),
            id="exponential_decay",
        ),
        pytest.param(
            lambda: keras.optimizers.Adam(1e-2, use_ema=True, ema_momentum=0.5),
            id="ema",
        ),
        pytest.param(
            lambda: keras.optimizers.Adam(
                1e-2, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2
            ),
            id="ema_overwrite_frequency",
        ),
    ],
)
def test_fit_matches_big_batch(make_inner):
    """fit(batch_size=B) with the wrapper equals plain Keras fit(batch_size=B*K)."""
    initial, reference, accumulated = _big_batch_and_accumulated(make_inner)
    _assert_equivalent(initial, reference, accumulated)


@pytest.mark.parametrize("clip", ["clipnorm", "global_clipnorm", "clipvalue"])
def test_clipping_is_active_in_reference(clip):
    """Guard: the small clip values really clip on the big batch, so the
    clipping cases above are not moot."""
    x, y = utils.classification_data(N)
    runs = []
    for kwargs in ({clip: 0.05 if clip != "clipvalue" else 0.01}, {}):
        model = utils.seeded(utils.plain_model)
        _compile(model, keras.optimizers.SGD(0.5, **kwargs))
        model.fit(x, y, batch_size=B * K, epochs=1, shuffle=False, verbose=0)
        runs.append(utils.weights(model))
    assert utils.max_abs_diff(*runs) > 1e-3


def test_learning_rate_scheduler_callback_sets_inner_learning_rate():
    """keras.callbacks.LearningRateScheduler reads and sets the wrapper's
    learning_rate, which is the inner optimizer's: training equals the big
    batch under the same per-epoch schedule."""

    def schedule(epoch, lr):
        return 0.3 if epoch == 0 else lr * 0.5

    x, y = utils.classification_data(N)
    reference = utils.seeded(utils.plain_model)
    initial = utils.weights(reference)
    _compile(reference, keras.optimizers.SGD(0.1))
    reference.fit(
        x, y, batch_size=B * K, epochs=EPOCHS, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.LearningRateScheduler(schedule)],
    )  # fmt: skip

    accumulated = utils.seeded(utils.plain_model)
    opt = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=K)
    _compile(accumulated, opt)
    history = accumulated.fit(
        x, y, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.LearningRateScheduler(schedule)],
    )  # fmt: skip
    assert history.history["learning_rate"] == pytest.approx([0.3, 0.15, 0.075])
    assert float(opt.inner_optimizer.learning_rate) == pytest.approx(0.075)
    utils.assert_trained(initial, utils.weights(reference))
    utils.assert_same_weights(utils.weights(accumulated), utils.weights(reference))


def test_wrapper_clipnorm_kwarg_lands_on_inner_and_matches_big_batch():
    """clipnorm passed to the wrapper is set on the inner optimizer and acts on
    the accumulated gradient, as the big batch's own clipnorm does."""
    initial, reference, accumulated = _big_batch_and_accumulated(
        lambda: keras.optimizers.SGD(0.5),
        make_reference=lambda: keras.optimizers.SGD(0.5, clipnorm=0.05),
        clipnorm=0.05,
    )
    assert accumulated.optimizer.inner_optimizer.clipnorm == 0.05
    _assert_equivalent(initial, reference, accumulated)


def _embedding_model() -> keras.Model:
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(20, 4)(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    outputs = keras.layers.Dense(3)(h)
    return keras.Model(inputs, outputs)


def test_embedding_indexed_slices_with_momentum_matches_big_batch():
    """Embedding (IndexedSlices) gradients through the wrapper with SGD momentum
    equal the big batch."""
    rng = np.random.default_rng(1)
    x = rng.integers(0, 20, size=(N, 5)).astype("int32")
    y = rng.integers(0, 3, size=N)

    # Check the premise: the embedding's gradient really is an IndexedSlices.
    model = utils.seeded(_embedding_model)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x[:B]))
    grads = tape.gradient(loss, model.trainable_variables)
    assert isinstance(grads[0], tf.IndexedSlices)

    initial, reference, accumulated = _big_batch_and_accumulated(
        lambda: keras.optimizers.SGD(0.5, momentum=0.9),
        build=_embedding_model,
        data=(x, y),
    )
    _assert_equivalent(initial, reference, accumulated)


# ------------------------------------------------------------ call forms
def test_call_forms_from_0_5_x():
    """The 0.5.x call forms build a wrapper around the expected inner optimizer."""
    keyword = GradientAccumulateOptimizer(
        optimizer=keras.optimizers.AdamW(1e-3), accum_steps=4
    )
    assert isinstance(keyword.inner_optimizer, keras.optimizers.AdamW)
    assert keyword.accum_steps == 4

    positional = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), 4)
    assert isinstance(positional.inner_optimizer, keras.optimizers.SGD)
    assert positional.accum_steps == 4
    assert float(positional.learning_rate) == pytest.approx(0.1)

    by_name = GradientAccumulateOptimizer(optimizer="sgd", accum_steps=2)
    assert isinstance(by_name.inner_optimizer, keras.optimizers.SGD)
    assert by_name.accum_steps == 2

    default = GradientAccumulateOptimizer()
    assert isinstance(default.inner_optimizer, keras.optimizers.SGD)
    assert default.accum_steps == 1

    summed = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), 4, "sum")
    assert summed.reduction == "SUM"

    clipped = GradientAccumulateOptimizer("adam", accum_steps=2, clipnorm=1.5)
    assert clipped.inner_optimizer.clipnorm == 1.5
    global_clipped = GradientAccumulateOptimizer("adam", 2, global_clipnorm=2.0)
    assert global_clipped.inner_optimizer.global_clipnorm == 2.0
    value_clipped = GradientAccumulateOptimizer("adam", 2, clipvalue=0.5)
    assert value_clipped.inner_optimizer.clipvalue == 0.5


@pytest.mark.parametrize(
    "make_wrapper",
    [
        pytest.param(
            lambda: GradientAccumulateOptimizer(
                optimizer=keras.optimizers.SGD(0.1), accum_steps=K
            ),
            id="keyword",
        ),
        pytest.param(
            lambda: GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), K),
            id="positional",
        ),
    ],
)
def test_call_forms_train_like_big_batch(make_wrapper):
    """Keyword and positional construction both train like the big batch."""
    x, y = utils.classification_data(N)
    reference = utils.seeded(utils.plain_model)
    initial = utils.weights(reference)
    _compile(reference, keras.optimizers.SGD(0.1))
    reference.fit(x, y, batch_size=B * K, epochs=1, shuffle=False, verbose=0)

    accumulated = utils.seeded(utils.plain_model)
    _compile(accumulated, make_wrapper())
    accumulated.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    utils.assert_trained(initial, utils.weights(reference))
    utils.assert_same_weights(utils.weights(accumulated), utils.weights(reference))


def test_string_optimizer_trains_like_big_batch():
    """optimizer="sgd" wraps Keras' default SGD (lr 0.01) exactly."""
    x, y = utils.classification_data(N)
    reference = utils.seeded(utils.plain_model)
    initial = utils.weights(reference)
    _compile(reference, "sgd")
    reference.fit(x, y, batch_size=B * K, epochs=EPOCHS, shuffle=False, verbose=0)

    accumulated = utils.seeded(utils.plain_model)
    _compile(accumulated, GradientAccumulateOptimizer(optimizer="sgd", accum_steps=K))
    accumulated.fit(x, y, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0)
    utils.assert_trained(initial, utils.weights(reference), min_change=1e-5)
    utils.assert_same_weights(utils.weights(accumulated), utils.weights(reference))


# ------------------------------------------------------- manual apply()
def _tiny() -> keras.Model:
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])


def _gradients(model, count, seed=0):
    rng = np.random.default_rng(seed)
    return [
        [
            tf.constant(rng.normal(size=v.shape).astype("float32"))
            for v in model.trainable_variables
        ]
        for _ in range(count)
    ]


def _snapshot(values) -> list[np.ndarray]:
    return [np.asarray(v).copy() for v in values]


def _assert_bitwise_equal(a, b, what):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert np.array_equal(x, y), f"{what}[{i}] changed"


def _applier(opt, model, mode):
    if mode == "eager":
        return lambda grads: opt.apply(grads, model.trainable_variables)

    @tf.function
    def apply(grads):
        opt.apply(grads, model.trainable_variables)

    return apply


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
def test_inner_state_changes_only_on_update_call(mode):
    """The first K-1 apply() calls leave inner Adam's moments, iterations and the
    weights bit-for-bit unchanged; the K-th applies Adam once to the mean."""
    model = utils.seeded(_tiny)
    opt = GradientAccumulateOptimizer(keras.optimizers.Adam(0.01), accum_steps=K)
    opt.build(model.trainable_variables)
    inner = opt.inner_optimizer
    grads = _gradients(model, K)
    apply = _applier(opt, model, mode)

    weights0 = _snapshot(model.trainable_variables)
    inner0 = _snapshot(inner.variables)
    assert len(inner.variables) > 2  # iteration, learning rate, moments
    for k in range(K - 1):
        apply(grads[k])
        _assert_bitwise_equal(_snapshot(model.trainable_variables), weights0, "w")
        _assert_bitwise_equal(_snapshot(inner.variables), inner0, "inner")
        assert int(opt.iterations) == 0
    apply(grads[K - 1])
    assert int(opt.iterations) == 1
    assert int(inner.iterations) == 1
    assert utils.max_abs_diff(_snapshot(model.trainable_variables), weights0) > 1e-3
    assert utils.max_abs_diff(_snapshot(inner.variables), inner0) > 0

    # Reference: a fresh Adam applying the mean of the K gradients once.
    reference = utils.seeded(_tiny)
    adam = keras.optimizers.Adam(0.01)
    mean = [
        tf.add_n([g[i] for g in grads]) / float(K)
        for i in range(len(model.trainable_variables))
    ]
    adam.apply(mean, reference.trainable_variables)
    utils.assert_same_weights(utils.weights(model), utils.weights(reference), 1e-6)
    utils.assert_same_weights(
        _snapshot(inner.variables), _snapshot(adam.variables), 1e-6
    )

    # The next cycle again waits K calls, then updates again.
    weights1 = _snapshot(model.trainable_variables)
    more = _gradients(model, K, seed=1)
    for k in range(K - 1):
        apply(more[k])
        _assert_bitwise_equal(_snapshot(model.trainable_variables), weights1, "w")
    apply(more[K - 1])
    assert int(opt.iterations) == 2
    adam.apply(
        [tf.add_n([g[i] for g in more]) / float(K) for i in range(2)],
        reference.trainable_variables,
    )
    utils.assert_same_weights(utils.weights(model), utils.weights(reference), 1e-6)


# Traced, the update branch of the call without a bias gradient hands Keras'
# optimizer a None for it, which Keras filters out with this warning.
@pytest.mark.filterwarnings("ignore:Gradients do not exist:UserWarning")
@pytest.mark.parametrize("mode", ["eager", "tf_function"])
def test_variable_first_without_gradient_starts_its_cycle_from_zero(mode):
    """A variable with no gradient in a cycle's first call but gradients later
    (a custom loop with a data-dependent branch) adds from zero, not from what
    the previous cycle left in its buffer."""
    model = utils.seeded(_tiny)
    opt = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=K)
    reference = utils.seeded(_tiny)
    sgd = keras.optimizers.SGD(0.1)
    first, second = _gradients(model, K), _gradients(model, K, seed=1)
    second[0][1] = None  # no bias gradient in the second cycle's first call
    if mode == "eager":
        calls = [lambda g: opt.apply(g, model.trainable_variables)] * 2
    else:
        # One traced function per set of gradients present, as in a custom loop.
        calls = [
            tf.function(lambda g: opt.apply(g, model.trainable_variables))
            for _ in range(2)
        ]
    for cycle in (first, second):
        for g in cycle:
            calls[g[1] is None](g)
        mean = [
            tf.add_n([g[i] for g in cycle if g[i] is not None]) / float(K)
            for i in range(2)
        ]
        sgd.apply(mean, reference.trainable_variables)
    assert int(opt.iterations) == 2
    utils.assert_same_weights(utils.weights(model), utils.weights(reference), 1e-6)


def test_sum_reduction_applies_sum_of_gradients():
    """reduction="SUM" applies the sum of the K gradients (vs SGD on the sum)."""
    model = utils.seeded(_tiny)
    opt = GradientAccumulateOptimizer(
        keras.optimizers.SGD(0.1), accum_steps=K, reduction="SUM"
    )
    grads = _gradients(model, K)
    for g in grads:
        opt.apply(g, model.trainable_variables)
    assert int(opt.iterations) == 1

    reference = utils.seeded(_tiny)
    initial = utils.weights(reference)
    total = [tf.add_n([g[i] for g in grads]) for i in range(2)]
    keras.optimizers.SGD(0.1).apply(total, reference.trainable_variables)
    utils.assert_trained(initial, utils.weights(reference))
    utils.assert_same_weights(utils.weights(model), utils.weights(reference), 1e-6)

    # And it is not the mean: the mean would move the weights K times less.
    mean_model = utils.seeded(_tiny)
    keras.optimizers.SGD(0.1).apply(
        [t / float(K) for t in total], mean_model.trainable_variables
    )
    assert utils.max_abs_diff(utils.weights(model), utils.weights(mean_model)) > 1e-3


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_gradient_skips_whole_cycle(mode, bad):
    """A NaN/Inf in one micro-batch skips the whole cycle (weights, inner state
    and iterations unchanged); the next finite cycle updates normally."""
    model = utils.seeded(_tiny)
    opt = GradientAccumulateOptimizer(keras.optimizers.Adam(0.01), accum_steps=K)
    opt.build(model.trainable_variables)
    inner = opt.inner_optimizer
    apply = _applier(opt, model, mode)

    weights0 = _snapshot(model.trainable_variables)
    inner0 = _snapshot(inner.variables)
    poisoned = _gradients(model, K, seed=2)
    kernel = poisoned[1][0].numpy()
    kernel[0, 0] = bad
    poisoned[1][0] = tf.constant(kernel)
    for g in poisoned:
        apply(g)
    _assert_bitwise_equal(_snapshot(model.trainable_variables), weights0, "w")
    _assert_bitwise_equal(_snapshot(inner.variables), inner0, "inner")
    assert int(opt.iterations) == 0

    finite = _gradients(model, K, seed=3)
    for g in finite:
        apply(g)
    assert int(opt.iterations) == 1
    assert all(np.all(np.isfinite(w)) for w in utils.weights(model))

    # Exactly one Adam step on the mean of the finite cycle: nothing from the
    # skipped cycle leaked into the accumulation buffers.
    reference = utils.seeded(_tiny)
    adam = keras.optimizers.Adam(0.01)
    adam.apply(
        [tf.add_n([g[i] for g in finite]) / float(K) for i in range(2)],
        reference.trainable_variables,
    )
    utils.assert_trained(weights0, utils.weights(reference))
    utils.assert_same_weights(utils.weights(model), utils.weights(reference), 1e-6)
