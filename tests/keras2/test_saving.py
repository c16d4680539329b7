"""tf-keras saving: every format tf-keras users save in loads without
custom_objects and trains on as the original does, and a checkpoint taken
mid-cycle resumes the cycle."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from gradient_accumulator import GradientAccumulateModel, GradientAccumulateOptimizer
from tests.utils import Interrupt, InterruptAt  # the same in both Kerases

MICRO, STEPS = 8, 4


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    return x, (x[:, :2] * 2.0 - x[:, 2:4]).astype("float32")


def _model(wrapper, **settings):
    tf_keras.utils.set_random_seed(1)
    inputs = tf_keras.Input((6,))
    outputs = tf_keras.layers.Dense(2)(tf_keras.layers.Dense(8, "tanh")(inputs))
    if wrapper == "plain":
        model = tf_keras.Model(inputs, outputs)
        model.compile(tf_keras.optimizers.Adam(0.01), "mse")
    elif wrapper == "model":
        model = GradientAccumulateModel(
            accum_steps=STEPS, inputs=inputs, outputs=outputs, **settings
        )
        model.compile(tf_keras.optimizers.Adam(0.01), "mse")
    else:
        model = tf_keras.Model(inputs, outputs)
        optimizer = GradientAccumulateOptimizer(
            tf_keras.optimizers.Adam(0.01), accum_steps=STEPS
        )
        model.compile(optimizer, "mse")
    return model


def _fit(model, x, y):
    # The plain model trains on the big batch.
    plain = type(model.optimizer) is tf_keras.optimizers.Adam and not isinstance(
        model, GradientAccumulateModel
    )
    batch = MICRO * STEPS if plain else MICRO
    model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)


def _save_load_train(wrapper, path):
    x, y = _data()
    model = _model(wrapper)
    _fit(model, x[:32], y[:32])  # whole cycles: nothing pending
    path.parent.mkdir(exist_ok=True)
    model.save(path)
    loaded = tf_keras.models.load_model(path)
    assert type(loaded) is type(model)
    assert type(loaded.optimizer) is type(model.optimizer)
    for got, want in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, want)
    iterations = loaded.optimizer.iterations.numpy()
    _fit(loaded, x[32:], y[32:])
    return iterations, loaded.get_weights()


@pytest.mark.parametrize("path", ["m.keras", "m.h5", "saved_model_dir"])
@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_saved_model_loads_and_trains_on_as_the_plain_model(wrapper, path, tmp_path):
    """What a format keeps of the optimizer is tf-keras' choice (a SavedModel
    directory restores no optimizer state): the same as for the plain model
    on the big batch."""
    iterations, got = _save_load_train(wrapper, tmp_path / wrapper / path)
    plain_iterations, want = _save_load_train("plain", tmp_path / "plain" / path)
    assert iterations == plain_iterations
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=2e-5)


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_weights_files_are_the_plain_models(wrapper, tmp_path):
    model = _model(wrapper)
    plain = tf_keras.Model(model.inputs, model.outputs)
    assert [w.name for w in model.weights] == [w.name for w in plain.weights]
    assert model.count_params() == plain.count_params()
    x, y = _data()
    _fit(model, x[:40], y[:40])  # one update and a pending micro-batch
    model.save_weights(tmp_path / "w.h5")
    fresh = tf_keras.models.clone_model(plain)
    fresh.load_weights(tmp_path / "w.h5")
    for got, want in zip(fresh.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, want)


def _finish_as(straight, model, x, y) -> None:
    """``model``, restored after 3 micro-batches, trains on the rest of the
    data: the 2 updates and the weights of the run never interrupted."""
    _fit(model, x[24:], y[24:])
    assert model.optimizer.iterations.numpy() == 2
    for got, want in zip(model.get_weights(), straight.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_checkpoint_mid_cycle_resumes_the_cycle(wrapper, tmp_path):
    x, y = _data()
    straight = _model(wrapper)
    _fit(straight, x, y)  # 8 micro-batches, 2 updates
    # Not flushed at the end of fit, as a run interrupted mid-cycle is not.
    settings = {"flush_at_end": False} if wrapper == "model" else {}
    first = _model(wrapper, **settings)
    _fit(first, x[:24], y[:24])  # 3 micro-batches of the first cycle
    assert first.optimizer.iterations.numpy() == 0
    checkpoint = tf.train.Checkpoint(model=first, optimizer=first.optimizer)
    path = checkpoint.save(tmp_path / "ckpt")
    resumed = _model(wrapper)
    resumed.optimizer.build(resumed.trainable_variables)
    tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).restore(
        path
    ).assert_existing_objects_matched()
    _finish_as(straight, resumed, x, y)


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_keras_file_mid_cycle_resumes_the_cycle(wrapper, tmp_path):
    x, y = _data()
    straight = _model(wrapper)
    _fit(straight, x, y)
    settings = {"flush_at_end": False} if wrapper == "model" else {}
    first = _model(wrapper, **settings)
    _fit(first, x[:24], y[:24])  # 3 micro-batches of the first cycle
    first.save(tmp_path / "m.keras")
    loaded = tf_keras.models.load_model(tmp_path / "m.keras")
    _finish_as(straight, loaded, x, y)


@pytest.mark.parametrize("wrapper", ["model", "optimizer"])
def test_backup_and_restore_resumes_a_partial_cycle(wrapper, tmp_path):
    """40 samples, micro-batches of 8, cycles of 4: each epoch ends mid-cycle.
    Interrupted in epoch 3, a fresh model resumes from the end-of-epoch-2
    backup, a cycle half done, and reaches the uninterrupted weights."""
    x, y = _data()
    x, y = x[:40], y[:40]

    def fit(model, epochs, *callbacks):
        model.fit(
            x,
            y,
            batch_size=MICRO,
            epochs=epochs,
            shuffle=False,
            verbose=0,
            callbacks=list(callbacks),
        )

    straight = _model(wrapper)
    fit(straight, 4)
    backup = str(tmp_path / "backup")
    interrupted = _model(wrapper)
    with pytest.raises(Interrupt):
        fit(
            interrupted,
            4,
            tf_keras.callbacks.BackupAndRestore(backup),
            InterruptAt(epoch=2, batch=1),
        )
    resumed = _model(wrapper)
    # Other initial weights: the backup must restore them all.
    resumed.set_weights([w + 0.5 for w in resumed.get_weights()])
    fit(resumed, 4, tf_keras.callbacks.BackupAndRestore(backup))
    assert resumed.optimizer.iterations.numpy() == straight.optimizer.iterations.numpy()
    for got, want in zip(resumed.get_weights(), straight.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-6)
