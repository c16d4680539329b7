"""Keras' own guides, step by step, with the wrapper in place.

Each test follows a workflow a Keras user knows (transfer learning, tf.data
of unknown length, callbacks, weights files, recompiling, cloning) once with
plain Keras and once with the wrapper, and compares: weights with plain Keras
on the big batch (``utils.ATOL``), everything else with the plain model's own
behaviour.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator import (
    FlushPartialCycle,
    GradientAccumulateModel,
    GradientAccumulateOptimizer,
    replace_batchnorm_layers,
)
from tests import utils

B = 4  # micro-batch


def _pair(accum_steps: int, **settings):
    """A plain model and a wrapped one with the same initial weights."""
    plain = utils.seeded(utils.plain_model)
    wrapped = utils.seeded(
        lambda: utils.accumulating_model(accum_steps=accum_steps, **settings)
    )
    utils.assert_same_weights(utils.weights(wrapped), utils.weights(plain), 0.0)
    return plain, wrapped


# ------------------------------------------------------- weights interop
def test_weights_lists_and_counts_are_the_plain_models():
    plain, wrapped = _pair(4)
    for model in (plain, wrapped):
        model.compile(optimizer="adam", loss=utils.sparse_ce())
    x, y = utils.classification_data(32)
    utils.fit(wrapped, x[:12], y[:12], B)  # the state exists now
    utils.fit(plain, x[:12], y[:12], B * 4)  # so does the optimizer's
    # Same layers, so the same list up to Keras' automatic layer names.
    shapes = [[(w.name, tuple(w.shape)) for w in m.weights] for m in (plain, wrapped)]
    assert shapes[0] == shapes[1]
    assert wrapped.non_trainable_weights == []
    assert len(wrapped.get_weights()) == len(plain.get_weights())
    assert wrapped.count_params() == plain.count_params()

    totals = []
    for model in (plain, wrapped):
        printed: list[str] = []
        model.summary(print_fn=lambda text, *a, out=printed, **k: out.append(text))
        lines = "\n".join(printed).splitlines()
        totals.append([ln.strip() for ln in lines if "params" in ln])
    assert totals[0] == totals[1], totals
    assert any(ln.startswith("Total params: 587") for ln in totals[0]), totals


def test_set_weights_and_weight_files_move_both_ways(tmp_path):
    plain, wrapped = _pair(2)
    for model in (plain, wrapped):
        model.compile(optimizer="sgd", loss=utils.sparse_ce())
    x, y = utils.classification_data(16)
    utils.fit(plain, x, y, 16)  # "pretrained"
    wrapped.set_weights(plain.get_weights())
    utils.assert_same_weights(utils.weights(wrapped), utils.weights(plain), 0.0)

    utils.fit(wrapped, x, y, B)
    other = utils.seeded(utils.plain_model, seed=1)
    other.set_weights(wrapped.get_weights())
    utils.assert_same_weights(utils.weights(other), utils.weights(wrapped), 0.0)

    # save_weights files are interchangeable (optimizer state included).
    path = tmp_path / "wrapped.weights.h5"
    wrapped.save_weights(path)
    fresh = utils.seeded(utils.plain_model, seed=2)
    fresh.compile(optimizer="sgd", loss=utils.sparse_ce())
    fresh.load_weights(path)
    utils.assert_same_weights(utils.weights(fresh), utils.weights(wrapped), 0.0)

    path = tmp_path / "plain.weights.h5"
    plain.save_weights(path)
    target = utils.seeded(lambda: utils.accumulating_model(accum_steps=2), seed=3)
    target.compile(optimizer="sgd", loss=utils.sparse_ce())
    target.load_weights(path)
    utils.assert_same_weights(utils.weights(target), utils.weights(plain), 0.0)


def test_model_checkpoint_weights_only_loads_into_a_plain_model(tmp_path):
    plain, wrapped = _pair(2)
    wrapped.compile(optimizer="adam", loss=utils.sparse_ce())
    x, y = utils.classification_data(16)
    path = str(tmp_path / "ckpt.weights.h5")
    checkpoint = keras.callbacks.ModelCheckpoint(path, save_weights_only=True)
    utils.fit(wrapped, x, y, B, epochs=2, callbacks=[checkpoint])
    plain.compile(optimizer="adam", loss=utils.sparse_ce())
    plain.load_weights(path)
    utils.assert_same_weights(utils.weights(plain), utils.weights(wrapped), 0.0)
    np.testing.assert_array_equal(
        plain.predict(x, verbose=0), wrapped.predict(x, verbose=0)
    )


def test_early_stopping_restores_best_weights_as_plain_keras_does():
    """EarlyStopping(restore_best_weights=True): the same epochs, the same
    restored weights as plain Keras on the big batch, and no cycle left."""
    K = 2
    plain, wrapped = _pair(K, flush_at_end=False)
    x, y = utils.classification_data(32)
    xv, yv = utils.classification_data(16, seed=5)
    histories = {}
    for name, model, batch in (("plain", plain, B * K), ("wrapped", wrapped, B)):
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=utils.sparse_ce())
        stop = keras.callbacks.EarlyStopping(
            patience=1, restore_best_weights=True, min_delta=1e-3
        )
        histories[name] = utils.fit(
            model, x, y, batch, epochs=30, validation_data=(xv, yv), callbacks=[stop]
        ).history
    assert len(histories["wrapped"]["loss"]) == len(histories["plain"]["loss"]) < 30
    np.testing.assert_allclose(
        histories["wrapped"]["val_loss"], histories["plain"]["val_loss"], atol=1e-5
    )
    utils.assert_same_weights(utils.weights(wrapped), utils.weights(plain))
    assert wrapped._accumulator.pending == 0  # every epoch holds whole cycles


# ------------------------------------------------------ transfer learning
def _base_and_head(seed: int):
    """Keras' transfer-learning guide in small: a 'pretrained' base, a new head."""
    keras.utils.set_random_seed(seed)
    base = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu")], name="base"
    )
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(3)(base(inputs, training=False))
    return base, inputs, outputs


@pytest.mark.parametrize("K", [2, 4])
def test_freeze_train_unfreeze_recompile_train_equals_big_batch(K):
    x, y = utils.classification_data(48)
    base, inputs, outputs = _base_and_head(0)
    plain = keras.Model(inputs, outputs)
    ref_base = base
    base_w, inputs_w, outputs_w = _base_and_head(0)
    wrapped = GradientAccumulateModel(K, inputs=inputs_w, outputs=outputs_w)
    utils.assert_same_weights(wrapped.get_weights(), plain.get_weights(), 0.0)
    initial = utils.weights(plain)

    runs = ((plain, ref_base, B * K), (wrapped, base_w, B))
    utils.freeze_train_unfreeze(runs, x, y, lambda: keras.optimizers.Adam(1e-3))

    utils.assert_trained(initial, utils.weights(plain))
    assert len(wrapped.trainable_weights) == len(plain.trainable_weights) == 4
    utils.report(
        utils.assert_same_weights(utils.weights(wrapped), utils.weights(plain))
    )
    assert int(wrapped.optimizer.iterations) == int(plain.optimizer.iterations)


def test_unfreezing_with_a_pending_cycle_drops_it_with_a_warning():
    base, inputs, outputs = _base_and_head(0)
    model = GradientAccumulateModel(
        4, flush_at_end=False, inputs=inputs, outputs=outputs
    )
    base.trainable = False
    model.compile(optimizer="sgd", loss=utils.sparse_ce())
    x, y = utils.classification_data(8)
    utils.fit(model, x, y, B)
    assert model._accumulator.pending == 2
    base.trainable = True
    with pytest.warns(UserWarning, match="2 micro-batch"):
        model.compile(optimizer="sgd", loss=utils.sparse_ce())
    assert model._accumulator.pending == 0
    assert len(model._accumulator.grad_sums) == len(model.trainable_weights) == 4


# ------------------------------------------------------------ recompiling
def test_recompiling_with_another_optimizer_uses_it_at_the_end_of_fit_flush():
    """compile(Adam), fit, compile(SGD), fit with a partial cycle at each end:
    the second flush steps the SGD, as plain Keras' last short batch does."""
    K = 4
    plain, wrapped = _pair(K)
    x, y = utils.classification_data(40)  # 5 micro-batches of 8: a partial cycle
    initial = utils.weights(plain)
    for model, batch in ((plain, 8 * K), (wrapped, 8)):
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=utils.sparse_ce())
        utils.fit(model, x, y, batch)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=utils.sparse_ce())
        utils.fit(model, x, y, batch)
    utils.assert_trained(initial, utils.weights(plain))
    assert int(wrapped.optimizer.iterations) == int(plain.optimizer.iterations) == 2
    utils.report(
        utils.assert_same_weights(utils.weights(wrapped), utils.weights(plain))
    )


# --------------------------------------------------- tf.data, unknown length
def _generator_dataset(x, y, batch):
    def gen():
        yield from zip(x, y)

    ds = tf.data.Dataset.from_generator(
        gen,
        output_signature=(
            tf.TensorSpec(x.shape[1:], tf.float32),
            tf.TensorSpec((), tf.int64),
        ),
    )
    return ds.batch(batch)


def _filtered_dataset(x, y, batch):
    ds = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True)
    return ds.batch(batch)


def _tfrecord_dataset(x, y, batch, folder):
    path = str(folder / "data.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        for features, label in zip(x, y):
            example = tf.train.Example(
                features=tf.train.Features(
                    feature={
                        "x": tf.train.Feature(
                            float_list=tf.train.FloatList(value=features)
                        ),
                        "y": tf.train.Feature(
                            int64_list=tf.train.Int64List(value=[label])
                        ),
                    }
                )
            )
            writer.write(example.SerializeToString())
    spec = {
        "x": tf.io.FixedLenFeature([x.shape[1]], tf.float32),
        "y": tf.io.FixedLenFeature([], tf.int64),
    }

    def parse(record):
        parsed = tf.io.parse_single_example(record, spec)
        return parsed["x"], parsed["y"]

    return tf.data.TFRecordDataset(path).map(parse).batch(batch)


DATASETS = {
    "generator": _generator_dataset,
    "filter": _filtered_dataset,
    "tfrecord": _tfrecord_dataset,
}


@pytest.mark.parametrize("K", [2, 4, 5])
@pytest.mark.parametrize("source", sorted(DATASETS))
def test_model_wrapper_on_unknown_length_datasets_equals_big_batch(K, source, tmp_path):
    """Three epochs of 6 micro-batches each: with K=4, 5 each epoch ends
    with a short cycle, applied as plain Keras' short last batch, so the
    run equals plain Keras with batches of B * K epoch by epoch (no
    micro-batch lost where the data runs out)."""
    epochs, n = 3, 24
    x, y = utils.classification_data(n)
    make = DATASETS[source]
    args = (tmp_path,) if source == "tfrecord" else ()
    ds = make(x, y, B, *args)
    assert int(ds.cardinality()) == int(tf.data.UNKNOWN_CARDINALITY)

    plain, wrapped = _pair(K)
    for model in (plain, wrapped):
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=utils.sparse_ce())
    wrapped.fit(ds, epochs=epochs, verbose=0)
    utils.fit(plain, x, y, B * K, epochs=epochs)
    assert int(wrapped.optimizer.iterations) == int(plain.optimizer.iterations)
    utils.report(
        utils.assert_same_weights(utils.weights(wrapped), utils.weights(plain))
    )


@pytest.mark.parametrize("K", [2, 4, 5])
def test_optimizer_wrapper_on_unknown_length_datasets_equals_big_batch(K):
    epochs, n = 3, 24
    x, y = utils.classification_data(n)
    plain = utils.seeded(utils.plain_model)
    model = utils.seeded(utils.plain_model)
    plain.compile(optimizer=keras.optimizers.Adam(1e-2), loss=utils.sparse_ce())
    model.compile(
        optimizer=GradientAccumulateOptimizer(keras.optimizers.Adam(1e-2), K),
        loss=utils.sparse_ce(),
    )
    model.fit(_generator_dataset(x, y, B), epochs=epochs, verbose=0)
    micro = epochs * n // B
    updates = micro // K
    xs, ys = np.concatenate([x] * epochs), np.concatenate([y] * epochs)
    utils.fit(plain, xs[: updates * K * B], ys[: updates * K * B], B * K)
    assert int(model.optimizer.iterations) == updates
    assert int(model.optimizer._accumulator.micro_step.numpy()) == micro % K
    utils.report(utils.assert_same_weights(utils.weights(model), utils.weights(plain)))


# --------------------------------------------------------------------- EMA
def _ema_adam():
    return keras.optimizers.Adam(1e-2, use_ema=True, ema_momentum=0.5)


def test_ema_with_a_flushed_partial_cycle_equals_big_batch():
    K = 4
    plain, wrapped = _pair(K)
    x, y = utils.classification_data(40)  # 10 micro-batches: 2 cycles + 2 flushed
    for model, batch in ((plain, B * K), (wrapped, B)):
        model.compile(optimizer=_ema_adam(), loss=utils.sparse_ce())
        utils.fit(model, x, y, batch)
    assert int(wrapped.optimizer.iterations) == int(plain.optimizer.iterations) == 3
    utils.report(
        utils.assert_same_weights(utils.weights(wrapped), utils.weights(plain))
    )


def test_ema_with_flush_partial_cycle_callback_and_optimizer_wrapper():
    K = 4
    plain = utils.seeded(utils.plain_model)
    model = utils.seeded(utils.plain_model)
    x, y = utils.classification_data(40)
    plain.compile(optimizer=_ema_adam(), loss=utils.sparse_ce())
    utils.fit(plain, x, y, B * K, epochs=2)
    model.compile(
        optimizer=GradientAccumulateOptimizer(_ema_adam(), K), loss=utils.sparse_ce()
    )
    utils.fit(model, x, y, B, epochs=2, callbacks=[FlushPartialCycle()])
    assert int(model.optimizer.iterations) == int(plain.optimizer.iterations) == 6
    utils.report(utils.assert_same_weights(utils.weights(model), utils.weights(plain)))


# ------------------------------------------- loading, cloning, subclassing
def test_flush_right_after_load_model_applies_the_saved_pending_cycle(tmp_path):
    K = 4
    plain, wrapped = _pair(K, flush_at_end=False)
    x, y = utils.classification_data(24)  # 6 micro-batches: 1 cycle + 2 pending
    for model in (plain, wrapped):
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=utils.sparse_ce())
    utils.fit(wrapped, x, y, B)
    assert wrapped._accumulator.pending == 2
    path = tmp_path / "pending.keras"
    wrapped.save(path)

    loaded = keras.models.load_model(path)
    assert loaded._accumulator.pending == 2
    loaded.flush()
    assert loaded._accumulator.pending == 0
    utils.fit(plain, x, y, B * K)  # batches of 16 and 8: the same two updates
    assert int(loaded.optimizer.iterations) == 2
    utils.report(utils.assert_same_weights(utils.weights(loaded), utils.weights(plain)))

    again = keras.models.load_model(path)
    again.drop_partial_cycle()
    assert again._accumulator.pending == 0
    assert int(again.optimizer.iterations) == 1
    utils.assert_same_weights(utils.weights(again), utils.weights(wrapped), 0.0)


def test_clone_model_keeps_the_class_and_settings_and_trains_alike():
    K = 2
    plain, wrapped = _pair(K, partial_cycle="flush", use_agc=False)
    clone = keras.models.clone_model(wrapped)
    assert isinstance(clone, GradientAccumulateModel)
    assert clone.accum_steps == K
    assert clone.get_config()["partial_cycle"] == "flush"
    clone.set_weights(plain.get_weights())
    x, y = utils.classification_data(32)
    for model, batch in ((plain, B * K), (clone, B)):
        model.compile(optimizer="adam", loss=utils.sparse_ce())
        utils.fit(model, x, y, batch, epochs=2)
    utils.assert_same_weights(utils.weights(clone), utils.weights(plain))


class FourStepModel(GradientAccumulateModel):
    """The subclassing pattern of docs/model-wrapper.md."""

    def __init__(self, **kwargs):
        super().__init__(accum_steps=4, **kwargs)


def test_documented_subclass_pattern_round_trips_through_keras_files(tmp_path):
    keras.saving.get_custom_objects()["FourStepModel"] = FourStepModel
    try:
        inputs, outputs = utils.mlp_layers()
        model = FourStepModel(inputs=inputs, outputs=outputs)
        model.compile(optimizer="sgd", loss=utils.sparse_ce())
        x, y = utils.classification_data(16)
        utils.fit(model, x, y, B)
        path = tmp_path / "sub.keras"
        model.save(path)
        loaded = keras.models.load_model(path)
    finally:
        keras.saving.get_custom_objects().pop("FourStepModel")
    assert type(loaded).__name__ == "FourStepModel"
    assert loaded.accum_steps == 4
    utils.assert_same_weights(utils.weights(loaded), utils.weights(model), 0.0)


def test_replace_batchnorm_layers_keeps_every_setting():
    def skip(grads, variables):
        return tf.constant(False)

    inputs = keras.Input((8,))
    h = keras.layers.BatchNormalization()(keras.layers.Dense(8)(inputs))
    model = GradientAccumulateModel(
        accum_steps=3,
        micro_batch_size=2,
        partial_cycle="drop",
        flush_at_end=False,
        skip_update_fn=skip,
        use_agc=True,
        clip_factor=0.02,
        eps=1e-2,
        inputs=inputs,
        outputs=keras.layers.Dense(3)(h),
    )
    converted = replace_batchnorm_layers(model)
    assert converted.get_config()["accum_steps"] == 3
    for key in ("micro_batch_size", "partial_cycle", "flush_at_end", "use_agc",
                "clip_factor", "eps"):  # fmt: skip
        assert converted.get_config()[key] == model.get_config()[key], key
    assert converted._accumulator.skip_update_fn is skip
