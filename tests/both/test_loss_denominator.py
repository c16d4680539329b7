"""``loss_denominator``: a model's own ``compute_loss`` (compiled without a
loss) declares what it divides a batch by, and accumulation is exact for it.

The reference is plain Keras: the same subclass, same initial weights, no
wrapper, trained on the big batch (the ``K`` micro-batches concatenated,
in order). Three own losses: a sum of squared errors (``"sum"``), a mean
over the entries the loss selects itself (non-zero targets: a function
counting them) and a mean over samples (``"samples"``, the default). The
undeclared sum and entry mean are measurably off, and warn once.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel, accumulate
from tests import dist_utils
from tests.flavour import LEGACY_KERAS, keras, utils

N, B, K = 16, 4, 2  # 16 samples, micro-batches of 4, updates of 8: 2 updates
LR = 0.1
UNSET = object()  # loss_denominator not given
MODES = ["streaming"] if LEGACY_KERAS else ["streaming", "in_step"]
register = functools.partial(
    keras.saving.register_keras_serializable, package="tests_loss_denominator"
)


def _squares(y, y_pred):
    return tf.square(tf.cast(y_pred, tf.float32) - tf.cast(y, tf.float32))


def _replica_share(mean):
    """A mean as Keras' losses return it under a strategy (and plain Keras
    needs it): this replica's share, divided by the replica count."""
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    return mean / tf.cast(replicas, mean.dtype)


def _selected(y):
    return tf.cast(tf.not_equal(y, 0), tf.float32)


@register()
def selected_entries(x, y, sample_weight):
    """The loss denominator of ``EntryMean``: its non-zero targets."""
    return tf.reduce_sum(_selected(y))


class _OwnLoss(keras.Model):
    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        return self.own_loss(y, y_pred)


@register()
class SumLoss(_OwnLoss):
    """Summed squared errors: the big batch's loss is the micro-batches' sum."""

    def own_loss(self, y, y_pred):
        return tf.reduce_sum(_squares(y, y_pred))


@register()
class EntryMean(_OwnLoss):
    """Squared errors averaged over the non-zero targets only."""

    def own_loss(self, y, y_pred):
        mask = _selected(y)
        total = tf.reduce_sum(_squares(y, y_pred) * mask)
        return _replica_share(tf.math.divide_no_nan(total, tf.reduce_sum(mask)))


@register()
class SampleMean(_OwnLoss):
    """Summed squared errors of each sample, averaged over the samples."""

    def own_loss(self, y, y_pred):
        return _replica_share(
            tf.reduce_mean(tf.reduce_sum(_squares(y, y_pred), axis=-1))
        )


class Compiled(keras.Model):
    """Overrides ``compute_loss`` around the compiled loss."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, **kw):
        return super().compute_loss(x, y, y_pred, sample_weight, **kw)


CASES = {  # own loss -> (its class, what it divides by)
    "sum": (SumLoss, "sum"),
    "entries": (EntryMean, selected_entries),
    "samples": (SampleMean, "samples"),
}


def _data():
    """Targets with 0 to 3 non-zero entries per sample, so that micro-batches
    (and replicas' halves of them) select very different numbers."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 4)).astype("float32")
    y = rng.normal(size=(N, 3)).astype("float32")
    keep = rng.random((N, 3)) < np.linspace(0.15, 0.95, N)[:, None]
    keep[::2, 0] = True  # every replica's half of a micro-batch selects some
    return x, np.where(keep, y, 0.0).astype("float32")


def _build(cls):
    def build():
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        return cls(inputs, keras.layers.Dense(3)(hidden))

    return utils.seeded(build)


def _settings(mode, declared, replicas=1):
    settings = {} if declared is UNSET else {"loss_denominator": declared}
    if mode == "streaming":
        return {**settings, "accum_steps": K}, B
    return {**settings, "micro_batch_size": B // replicas}, B * K


def _sgd(policy: str, learning_rate: float = LR):
    """SGD, under mixed_float16 in a LossScaleOptimizer of a moderate initial
    scale (Keras' 2**15 overflows the sum's first steps, which both runs
    would skip)."""
    sgd = keras.optimizers.SGD(learning_rate)
    if policy == "float32":
        return sgd
    if LEGACY_KERAS:
        return keras.mixed_precision.LossScaleOptimizer(sgd, initial_scale=2.0**7)
    return keras.optimizers.LossScaleOptimizer(sgd, initial_scale=2.0**7)


@functools.cache
def _reference(name: str, policy: str = "float32") -> tuple:
    """(initial, trained) weights of plain Keras on the big batch."""
    keras.mixed_precision.set_global_policy(policy)
    try:
        plain = _build(CASES[name][0])
        initial = utils.weights(plain)
        plain.compile(optimizer=_sgd(policy))
        utils.fit(plain, *_data(), B * K)
        return initial, utils.weights(plain)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _train(name, mode, declared=UNSET, strategy=None, policy="float32"):
    """Weights of the own loss ``name`` made accumulating with
    ``loss_denominator=declared`` (under ``strategy``, ``policy``), trained
    on the micro-batches of the big batch."""
    initial = _reference(name, policy)[0]
    replicas = strategy.num_replicas_in_sync if strategy else 1
    settings, batch = _settings(mode, declared, replicas)
    keras.mixed_precision.set_global_policy(policy)
    try:
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = accumulate(_build(CASES[name][0]), **settings)
            model.compile(optimizer=_sgd(policy))
        assert utils.max_abs_diff(initial, utils.weights(model)) == 0.0
        utils.fit(model, *_data(), batch)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert int(np.asarray(model.optimizer.iterations)) == N // (B * K)
    return utils.weights(model)


def _gap(name, mode, declared=UNSET, strategy=None):
    """max |w_accum - w_bigbatch| of :func:`_train` (float32)."""
    initial, reference = _reference(name)
    utils.assert_trained(initial, reference)
    weights = _train(name, mode, declared, strategy)
    return utils.max_abs_diff(weights, reference)


# ------------------------------------------------------------ exactness
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_declared_own_loss_matches_big_batch(name, mode):
    gap = utils.report(_gap(name, mode, CASES[name][1]), f"{name} {mode}")
    assert gap <= utils.ATOL, gap


@pytest.mark.parametrize("mode", MODES)
def test_undeclared_sum_and_entry_mean_are_off_and_warn_once(mode):
    """Non-vacuity: weighed by samples, the sum and the entry mean are far
    from their big batch; the warning names the assumption and the setting,
    once per model."""
    for name in ("sum", "entries"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gap = utils.report(_gap(name, mode), f"undeclared {name} {mode}")
        assert gap > 50 * utils.ATOL, f"undeclared {name} only {gap:.3g} off"
        said = [str(w.message) for w in caught if "loss_denominator" in str(w.message)]
        assert len(said) == 1, said
        assert "mean over samples" in said[0] and "compute_loss" in said[0]


def test_no_warning_when_declared_or_compiled():
    x, y = _data()
    models = [accumulate(_build(SampleMean), accum_steps=K, loss_denominator="samples")]
    models.append(accumulate(_build(Compiled), accum_steps=K))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for model, loss in zip(models, (None, "mse")):
            model.compile(optimizer=keras.optimizers.SGD(LR), loss=loss)
            utils.fit(model, x, y, B)
    assert not [w for w in caught if "loss_denominator" in str(w.message)]


# ---------------------------------------------- strategy, mixed precision
def _mirrored_gaps() -> dict:
    """Each declared own loss and mode under MirroredStrategy over two
    logical CPUs (configured before TensorFlow starts), against plain Keras
    on one device: each replica counts its own samples or entries (the
    means divided by the replica count, as Keras' losses are)."""
    strategy = tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    assert strategy.num_replicas_in_sync == 2
    return {
        f"{name} {mode}": _gap(name, mode, CASES[name][1], strategy)
        for name in ("sum", "entries")
        for mode in MODES
    }


def test_declared_own_loss_under_mirrored_strategy_matches_big_batch():
    gaps = dist_utils.on_two_cpus(_mirrored_gaps)
    for case, gap in gaps.items():
        utils.report(gap, f"mirrored {case}")
    assert max(gaps.values()) <= utils.ATOL, gaps


@pytest.mark.parametrize("mode", MODES)
def test_declared_own_loss_under_mixed_float16_is_as_close_as_keras_mixed(mode):
    """Under a loss scale the sum is not scaled down before its backward
    pass, and the entry mean is weighed by its count on its unscaled
    gradients. Float16 rounds the gradients' sums over samples (the big
    batch's over 8, ours over 4), so the bound is
    tests/keras3/test_mixed_precision.py's: no further from float32 than
    plain Keras mixed is, within a factor 2.
    On data float16 holds exactly the gap is 0 (the next test)."""
    for name in ("sum", "entries"):
        keras_mixed = utils.max_abs_diff(
            _reference(name, "mixed_float16")[1], _reference(name)[1]
        )
        assert 0 < keras_mixed < 1e-2
        weights = _train(name, mode, CASES[name][1], policy="mixed_float16")
        for to in ("mixed_float16", "float32"):
            gap = utils.max_abs_diff(weights, _reference(name, to)[1])
            utils.report(
                gap,
                f"mixed_float16 {name} {mode} to {to} (Keras mixed: {keras_mixed:.2g})",
            )
            assert gap <= 2 * keras_mixed, (name, to, gap, keras_mixed)


# ----------------------------- mixed_float16 on data float16 holds exactly
EXACT_LR = 2.0**-3
EXACT_COUNTS = (4, 4, 2, 2)  # the entries each micro-batch selects
WRONG = {"sum": UNSET, "entries": "sum", "samples": "sum"}  # non-vacuity


def _exact_data():
    """Inputs in {-1, 0, 1}, targets in {+-1/2, +-1} where selected (else 0),
    EXACT_COUNTS of them per micro-batch (equal within a cycle, so that every
    count and every cycle's total is a power of two)."""
    rng = np.random.default_rng(3)
    x = rng.integers(-1, 2, size=(N, 4)) * (rng.random((N, 4)) < 0.5)
    y = rng.integers(1, 3, size=(N, 3)) / 2 * rng.choice([-1, 1], size=(N, 3))
    keep = np.zeros((N // B, B * 3), bool)
    for micro, count in enumerate(EXACT_COUNTS):
        keep[micro, rng.choice(B * 3, size=count, replace=False)] = True
    y = np.where(keep.reshape(N, 3), y, 0.0)
    return x.astype("float32"), y.astype("float32")


def _exact_initial() -> list[np.ndarray]:
    """A kernel in quarters within [-1/2, 1/2], a bias in halves."""
    rng = np.random.default_rng(4)
    kernel = rng.integers(-2, 3, size=(4, 3)) / 4
    return [
        kernel.astype("float32"),
        (rng.integers(-1, 2, size=3) / 2).astype("float32"),
    ]


def _exact_run(name, policy, mode=None, declared=UNSET) -> list[np.ndarray]:
    """Weights of the own loss ``name``, one Dense layer from
    :func:`_exact_initial`, trained on :func:`_exact_data` under ``policy``
    (SGD at EXACT_LR): plain Keras on the big batch (``mode`` None), or
    made accumulating in ``mode`` with ``loss_denominator=declared``."""
    keras.mixed_precision.set_global_policy(policy)
    try:
        inputs = keras.Input((4,))
        dense = keras.layers.Dense(3)
        model = CASES[name][0](inputs, dense(inputs))
        model.set_weights(_exact_initial())
        assert (dense.compute_dtype, dense.kernel.dtype) == (
            "float16" if policy == "mixed_float16" else "float32",
            "float32",
        )
        batch = B * K
        if mode is not None:
            settings, batch = _settings(mode, declared)
            model = accumulate(model, **settings)
        model.compile(optimizer=_sgd(policy, EXACT_LR))
        with warnings.catch_warnings():  # WRONG["sum"]: undeclared, warns
            warnings.simplefilter("ignore")
            utils.fit(model, *_exact_data(), batch)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert int(np.asarray(model.optimizer.iterations)) == N // (B * K)
    return utils.weights(model)


@functools.cache
def _exact_keras(name: str) -> list[np.ndarray]:
    """Plain Keras mixed_float16 on the big batch, checked to be bit for bit
    its float32 run: float16 rounded nothing."""
    mixed = _exact_run(name, "mixed_float16")
    utils.assert_trained(_exact_initial(), mixed)
    assert utils.max_abs_diff(mixed, _exact_run(name, "float32")) == 0.0
    return mixed


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_declared_own_loss_under_mixed_float16_matches_keras_mixed_exactly(name, mode):
    """Declared, each own loss under mixed_float16 (a float16 layer, loss
    scale 2**7) is within 2e-5 of plain Keras mixed_float16 on the big batch
    (measured: 0), on data float16 holds exactly.

    The data are so chosen that float16 represents every intermediate value
    exactly: inputs in {-1, 0, 1}, targets in halves, a kernel in quarters,
    a bias in halves, every batch, count and cycle total a power of two, a
    learning rate and a loss scale powers of two, two updates: every
    product, every sum of a forward pass, every gradient (scaled or not) and
    every updated weight has few significant bits (at most 10 here, of
    float16's 11). Then summing a micro-batch's gradients in float16 and
    the big batch's give the same numbers, and the comparison measures what
    the accumulation itself does (the loss scale and its unscaling, the
    backward share, each micro-batch's weight and the cycle's denominator),
    not float16's rounding, which the bounded test above measures (2e-3 on
    random data, plain Keras mixed as far). Non-vacuity: plain Keras mixed
    is bit for bit its float32 run (so nothing rounded), the layer computes
    in float16, and a wrong denominator (undeclared for the sum, ``"sum"``
    for the means) lands far off. The micro-batches of a cycle select equal
    counts (unequal counts would not be powers of two with their total), so
    the weighing by unequal counts is the float32 tests'."""
    keras_mixed = _exact_keras(name)
    weights = _exact_run(name, "mixed_float16", mode, CASES[name][1])
    gap = utils.report(
        utils.max_abs_diff(weights, keras_mixed), f"exact mixed_float16 {name} {mode}"
    )
    assert gap <= utils.ATOL, gap
    wrong = _exact_run(name, "mixed_float16", mode, WRONG[name])
    off = utils.report(
        utils.max_abs_diff(wrong, keras_mixed),
        f"exact mixed_float16 {name} {mode} wrong",
    )
    assert off > 50 * utils.ATOL, off


# ------------------------------------------------- arguments and saving
@pytest.mark.parametrize(
    ("value", "error"), [("mean", ValueError), (2, TypeError), (["sum"], TypeError)]
)
def test_bad_values_name_the_argument(value, error):
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(3)(inputs)
    with pytest.raises(error, match="loss_denominator"):
        GradientAccumulateModel(inputs=inputs, outputs=outputs, loss_denominator=value)
    model = keras.Model(inputs, outputs)
    with pytest.raises(error, match="loss_denominator"):
        accumulate(model, accum_steps=2, loss_denominator=value)
    assert not isinstance(model, GradientAccumulateModel)


def test_declared_with_a_compiled_loss_is_refused():
    model = accumulate(_build(keras.Model), accum_steps=K, loss_denominator="sum")
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    with pytest.raises(ValueError, match=r"loss_denominator='sum'.*compiled loss"):
        utils.fit(model, *_data(), B)


@pytest.mark.parametrize("name", ["sum", "entries"])
def test_keras_file_round_trips_the_setting(name, tmp_path):
    """A string, and a registered function, load without custom_objects:
    saved mid-cycle, the loaded model ends the training as plain Keras on
    the big batch. The model wrapper's own config keeps it too."""
    x, y = _data()
    cls, declared = CASES[name]
    model = accumulate(
        _build(cls), accum_steps=K, loss_denominator=declared, flush_at_end=False
    )
    model.compile(optimizer=keras.optimizers.SGD(LR))
    utils.fit(model, x[: B * K + B], y[: B * K + B], B)  # one micro-batch pending
    model.save(tmp_path / "own.keras")
    loaded = keras.models.load_model(tmp_path / "own.keras")
    assert isinstance(loaded, cls) and isinstance(loaded, GradientAccumulateModel)
    assert loaded._accumulation_settings.loss_denominator == declared
    assert loaded._accumulator.pending == 1
    utils.fit(loaded, x[B * K + B :], y[B * K + B :], B)
    gap = utils.assert_same_weights(utils.weights(loaded), _reference(name)[1])
    utils.report(gap, f"{name} saved mid-cycle, loaded")

    inputs = keras.Input((4,))
    wrapper = GradientAccumulateModel(
        inputs=inputs, outputs=keras.layers.Dense(3)(inputs), loss_denominator=declared
    )
    wrapper.save(tmp_path / "wrapper.keras")
    loaded = keras.models.load_model(tmp_path / "wrapper.keras")
    assert loaded._accumulation_settings.loss_denominator == declared
