"""Saving, checkpointing and resuming in the middle of an accumulation cycle.

With ``K = 4`` and epochs of 3 micro-batches, every epoch boundary falls
inside a cycle, so a save that drops the accumulation buffers, the weight sum
or the micro-step counter changes the result. Every resumed run is compared
with the uninterrupted run (within 1e-6) and with plain Keras on the big batch
(within ``utils.ATOL``).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel, GradientAccumulateOptimizer
from tests import utils

B = 8  # micro-batch size
K = 4  # accumulation steps
N = 24  # samples per epoch: 3 micro-batches, so epochs end mid-cycle
EPOCHS = 4  # 12 micro-batches = 3 updates
RESUME_ATOL = 1e-6
LR = 1e-2

KINDS = ["model_wrapper", "optimizer_wrapper"]


def _build(kind: str) -> keras.Model:
    """A compiled model accumulating ``K`` micro-batches, with Adam inside."""
    inputs, outputs = utils.mlp_layers()
    if kind == "model_wrapper":
        # These tests stop fit mid-cycle on purpose: carry the partial cycle
        # across epochs and keep it pending, as the optimizer wrapper does,
        # instead of flushing it.
        model = GradientAccumulateModel(
            accum_steps=K,
            partial_cycle="carry",
            flush_at_end=False,
            inputs=inputs,
            outputs=outputs,
        )
        model.compile(optimizer=keras.optimizers.Adam(LR), loss=utils.sparse_ce())
    else:
        model = keras.Model(inputs, outputs)
        model.compile(
            optimizer=GradientAccumulateOptimizer(
                keras.optimizers.Adam(LR), accum_steps=K
            ),
            loss=utils.sparse_ce(),
        )
    return model


def _data():
    return utils.classification_data(N)


def _big_batch_reference(x, y, epochs: int):
    """Plain Keras on the big batch: ``epochs`` passes over the data, in order,
    cut into batches of ``B * K`` (cycles run across epoch boundaries)."""
    reference = utils.seeded(utils.plain_model)
    initial = utils.weights(reference)
    reference.compile(optimizer=keras.optimizers.Adam(LR), loss=utils.sparse_ce())
    xs, ys = np.concatenate([x] * epochs), np.concatenate([y] * epochs)
    assert len(xs) % (B * K) == 0
    reference.fit(xs, ys, batch_size=B * K, epochs=1, shuffle=False, verbose=0)
    utils.assert_trained(initial, utils.weights(reference))
    return reference


def _uninterrupted(kind, x, y, epochs=EPOCHS):
    model = utils.seeded(lambda: _build(kind))
    utils.fit(model, x, y, B, epochs)
    return model


def _assert_resumed_correctly(resumed, uninterrupted, reference) -> None:
    utils.assert_same_weights(
        utils.weights(resumed), utils.weights(uninterrupted), RESUME_ATOL
    )
    utils.assert_same_weights(utils.weights(resumed), utils.weights(reference))
    updates = EPOCHS * N // (B * K)
    assert int(resumed.optimizer.iterations) == updates
    assert int(reference.optimizer.iterations) == updates


def test_uninterrupted_run_matches_big_batch_across_epochs():
    """Guard for the resume tests: the uninterrupted runs themselves equal plain
    Keras on the big batch although every epoch ends mid-cycle."""
    x, y = _data()
    reference = _big_batch_reference(x, y, EPOCHS)
    for kind in KINDS:
        model = _uninterrupted(kind, x, y)
        utils.assert_same_weights(utils.weights(model), utils.weights(reference))
        assert int(model.optimizer.iterations) == EPOCHS * N // (B * K)


# ------------------------------------------------------------ .keras files
def test_model_wrapper_keras_file_round_trip(tmp_path):
    """A GradientAccumulateModel saved to .keras loads, without custom_objects,
    as a GradientAccumulateModel with its accum_steps and AGC settings."""
    inputs, outputs = utils.mlp_layers()
    model = GradientAccumulateModel(
        accum_steps=3, use_agc=True, clip_factor=0.05, eps=1e-2,
        inputs=inputs, outputs=outputs,
    )  # fmt: skip
    model.compile(optimizer="adam", loss=utils.sparse_ce())
    model.optimizer.build(model.trainable_variables)  # save its state too
    config = model.get_config()
    assert config["accum_steps"] == 3
    assert config["use_agc"] is True
    assert config["clip_factor"] == 0.05
    assert config["eps"] == 1e-2

    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, GradientAccumulateModel)
    assert loaded.accum_steps == 3
    assert loaded.get_config()["accum_steps"] == 3
    assert loaded._accumulator.use_agc is True
    assert loaded._accumulator.clip_factor == 0.05
    assert loaded._accumulator.eps == 1e-2
    assert isinstance(loaded.optimizer, keras.optimizers.Adam)


def test_optimizer_wrapper_keras_file_round_trip(tmp_path):
    """A plain model compiled with GradientAccumulateOptimizer loads, without
    custom_objects, with a GradientAccumulateOptimizer of the same accum_steps,
    reduction, inner optimizer type and learning rate."""
    model = utils.plain_model()
    model.compile(
        optimizer=GradientAccumulateOptimizer(
            keras.optimizers.AdamW(0.003, weight_decay=0.02),
            accum_steps=5,
            reduction="SUM",
            clipnorm=0.5,
        ),
        loss=utils.sparse_ce(),
    )
    model.optimizer.build(model.trainable_variables)  # save its state too
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    opt = loaded.optimizer
    assert type(opt) is GradientAccumulateOptimizer
    assert opt.accum_steps == 5
    assert opt.reduction == "SUM"
    assert type(opt.inner_optimizer) is keras.optimizers.AdamW
    assert float(opt.learning_rate) == pytest.approx(0.003)
    assert float(opt.inner_optimizer.learning_rate) == pytest.approx(0.003)
    assert opt.inner_optimizer.weight_decay == pytest.approx(0.02)
    assert opt.inner_optimizer.clipnorm == 0.5


@pytest.mark.parametrize("kind", KINDS)
def test_keras_file_saved_mid_cycle_resumes_exactly(kind, tmp_path):
    """A .keras file saved mid-cycle (6 micro-batches, K=4) holds the pending
    buffers and micro_step: the loaded model continues to the uninterrupted
    run's weights."""
    x, y = _data()
    model = utils.seeded(lambda: _build(kind))
    utils.fit(model, x, y, B, epochs=2)  # 6 micro-batches: 1 update + 2 pending
    state = utils.accumulator(model)
    assert int(state.micro_step) == 2
    assert int(model.optimizer.iterations) == 1

    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded) is type(model)
    assert type(loaded.optimizer) is type(model.optimizer)
    loaded_state = utils.accumulator(loaded)
    assert loaded_state.accum_steps == K
    assert int(loaded_state.micro_step) == 2
    assert float(loaded_state.weight_sum) == float(state.weight_sum) > 0
    for saved, restored in zip(state.grad_sums, loaded_state.grad_sums):
        np.testing.assert_array_equal(np.asarray(restored), np.asarray(saved))
    assert int(loaded.optimizer.iterations) == 1

    utils.fit(loaded, x, y, B, epochs=EPOCHS - 2)
    _assert_resumed_correctly(
        loaded, _uninterrupted(kind, x, y), _big_batch_reference(x, y, EPOCHS)
    )


# -------------------------------------------------------- tf.train.Checkpoint
def _checkpoint(model):
    return tf.train.Checkpoint(model=model, optimizer=model.optimizer)


def _fresh(kind):
    """A model built and compiled like the saved one, from another seed (so a
    restore that missed a weight would show), with its optimizer built."""
    model = utils.seeded(lambda: _build(kind), seed=123)
    model.optimizer.build(model.trainable_variables)
    return model


@pytest.mark.parametrize("kind", KINDS)
def test_tf_checkpoint_mid_cycle_resumes_exactly(kind, tmp_path):
    """tf.train.Checkpoint taken after 2 epochs of 3 micro-batches (K=4, so a
    partial cycle is pending), restored into a fresh model and optimizer, then
    trained on: equals the uninterrupted run (nothing accumulated is lost)."""
    x, y = _data()
    model = utils.seeded(lambda: _build(kind))
    utils.fit(model, x, y, B, epochs=2)
    assert int(utils.accumulator(model).micro_step) == 2
    path = _checkpoint(model).save(str(tmp_path / "ckpt"))

    fresh = _fresh(kind)
    assert int(utils.accumulator(fresh).micro_step) == 0
    _checkpoint(fresh).restore(path).assert_consumed()
    assert int(utils.accumulator(fresh).micro_step) == 2
    assert float(utils.accumulator(fresh).weight_sum) == float(
        utils.accumulator(model).weight_sum
    )
    assert int(fresh.optimizer.iterations) == 1
    utils.assert_same_weights(utils.weights(fresh), utils.weights(model), 0.0)

    utils.fit(fresh, x, y, B, epochs=EPOCHS - 2)
    _assert_resumed_correctly(
        fresh, _uninterrupted(kind, x, y), _big_batch_reference(x, y, EPOCHS)
    )


@pytest.mark.parametrize("kind", KINDS)
def test_tf_checkpoint_without_pending_buffers_would_differ(kind, tmp_path):
    """Non-vacuity: restoring the same checkpoint but zeroing the accumulation
    state afterwards ends far from the uninterrupted run, so the exact-resume
    test really depends on the saved buffers."""
    x, y = _data()
    model = utils.seeded(lambda: _build(kind))
    utils.fit(model, x, y, B, epochs=2)
    path = _checkpoint(model).save(str(tmp_path / "ckpt"))

    fresh = _fresh(kind)
    _checkpoint(fresh).restore(path).assert_consumed()
    for variable in utils.accumulator(fresh).variables:  # drop the pending cycle
        variable.assign(np.zeros(variable.shape, variable.dtype))
    utils.fit(fresh, x, y, B, epochs=EPOCHS - 2)
    uninterrupted = _uninterrupted(kind, x, y)
    diff = utils.max_abs_diff(utils.weights(fresh), utils.weights(uninterrupted))
    assert diff > 1e-3, diff


# ------------------------------------------------------- BackupAndRestore
def _interrupt_and_resume(build, x, y, backup_dir: str):
    """Trains ``build()`` under BackupAndRestore until an interruption in
    epoch 3, then resumes a fresh ``build()`` (other initial weights) from the
    backup. Returns the interrupted model, the resumed one and its history."""
    model = utils.seeded(build)
    with pytest.raises(utils.Interrupt):
        utils.fit(
            model,
            x,
            y,
            B,
            EPOCHS,
            callbacks=[
                keras.callbacks.BackupAndRestore(backup_dir),
                utils.InterruptAt(epoch=2, batch=1),
            ],
        )
    resumed = utils.seeded(build, seed=123)
    history = utils.fit(
        resumed,
        x,
        y,
        B,
        EPOCHS,
        callbacks=[keras.callbacks.BackupAndRestore(backup_dir)],
    )
    return model, resumed, history


@pytest.mark.parametrize("kind", KINDS)
def test_backup_and_restore_resumes_partial_cycle(kind, tmp_path):
    """BackupAndRestore (Keras 3.15 backs up at epoch ends by default): after an
    interruption in epoch 3, a fresh model resumes from the end of epoch 2,
    where a cycle is half done, and reaches the uninterrupted weights."""
    x, y = _data()
    model, resumed, history = _interrupt_and_resume(
        lambda: _build(kind), x, y, str(tmp_path / "backup")
    )
    # The interrupted run went past the backup (epoch 2, batches 0-1 ran).
    assert int(utils.accumulator(model).micro_step) == 0
    assert int(model.optimizer.iterations) == 2
    assert len(history.history["loss"]) == EPOCHS - 2  # resumed at epoch 2
    _assert_resumed_correctly(
        resumed, _uninterrupted(kind, x, y), _big_batch_reference(x, y, EPOCHS)
    )


@pytest.mark.parametrize("kind", KINDS)
def test_backup_and_restore_batch_frequency_saves_pending_state(kind, tmp_path):
    """BackupAndRestore(save_freq=N batches) writes the pending accumulation
    state with the weights: the backup taken mid-cycle holds micro_step and the
    buffers of the live model at that batch."""
    x, y = _data()
    backup_dir = tmp_path / "backup"

    model = utils.seeded(lambda: _build(kind))
    with pytest.raises(utils.Interrupt):
        utils.fit(
            model,
            x,
            y,
            B,
            EPOCHS,
            callbacks=[
                # 5 batches: the backup happens after micro-batch 5 (mid-cycle)
                keras.callbacks.BackupAndRestore(str(backup_dir), save_freq=5),
                utils.InterruptAt(epoch=1, batch=1),  # right after micro-batch 5
            ],
        )
    state = utils.accumulator(model)
    assert int(state.micro_step) == 1
    assert int(model.optimizer.iterations) == 1

    restored = _fresh(kind)
    restored.load_weights(backup_dir / "latest.weights.h5")
    restored_state = utils.accumulator(restored)
    assert int(restored_state.micro_step) == 1
    assert float(restored_state.weight_sum) == float(state.weight_sum) > 0
    for live, saved in zip(state.grad_sums, restored_state.grad_sums):
        np.testing.assert_array_equal(np.asarray(saved), np.asarray(live))
    utils.assert_same_weights(utils.weights(restored), utils.weights(model), 0.0)
    assert int(restored.optimizer.iterations) == 1


# ---------------------------------------------------- subclassed models
@keras.saving.register_keras_serializable(package="tests_state")
class StateNet(GradientAccumulateModel):
    """The same MLP as ``utils.mlp_layers``, subclassed."""

    def __init__(self, **kwargs):
        kwargs.setdefault("accum_steps", K)
        # Stopped mid-cycle on purpose: cycles carry across epochs and stay
        # pending after fit, as in the other tests of this file.
        kwargs.setdefault("partial_cycle", "carry")
        kwargs.setdefault("flush_at_end", False)
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="tanh")
        self.head = keras.layers.Dense(3)

    def call(self, inputs):
        return self.head(self.hidden(inputs))


def _build_subclassed(x=None) -> StateNet:
    """A compiled subclassed model, built by calling it (as Keras asks of
    subclassed models before loading weights into them) unless ``x`` is None."""
    model = StateNet()
    if x is not None:
        model(x[:1])
    model.compile(optimizer=keras.optimizers.Adam(LR), loss=utils.sparse_ce())
    return model


def _subclassed_uninterrupted(x, y):
    model = utils.seeded(lambda: _build_subclassed(x))
    utils.fit(model, x, y, B, EPOCHS)
    return model


def test_subclassed_model_wrapper_trains_when_fit_builds_it():
    """fit() on a subclassed model that was never called (Keras builds it while
    tracing train_step) creates the accumulation state for all its variables
    and trains like the big batch."""
    x, y = _data()
    model = utils.seeded(_build_subclassed)  # not built
    utils.fit(model, x, y, B, EPOCHS)
    assert (
        len(utils.accumulator(model).grad_sums) == len(model.trainable_variables) == 4
    )
    utils.assert_same_weights(
        utils.weights(model), utils.weights(_big_batch_reference(x, y, EPOCHS))
    )


def test_subclassed_model_wrapper_tf_checkpoint_resumes_exactly(tmp_path):
    """tf.train.Checkpoint of a subclassed model taken mid-cycle, restored into
    a fresh, built subclassed model (its accumulation state is created at the
    first train step and restored then): continues to the uninterrupted run."""
    x, y = _data()
    model = utils.seeded(lambda: _build_subclassed(x))
    utils.fit(model, x, y, B, epochs=2)
    assert int(utils.accumulator(model).micro_step) == 2
    path = _checkpoint(model).save(str(tmp_path / "ckpt"))

    fresh = utils.seeded(lambda: _build_subclassed(x), seed=123)
    fresh.optimizer.build(fresh.trainable_variables)
    _checkpoint(fresh).restore(path).assert_existing_objects_matched()
    utils.fit(fresh, x, y, B, epochs=EPOCHS - 2)
    _assert_resumed_correctly(
        fresh, _subclassed_uninterrupted(x, y), _big_batch_reference(x, y, EPOCHS)
    )


def test_subclassed_model_wrapper_keras_file_saved_mid_cycle_resumes_exactly(
    tmp_path,
):
    """A trained subclassed GradientAccumulateModel saved mid-cycle to .keras
    loads (without custom_objects: the subclass is registered) and continues
    to the uninterrupted run's weights."""
    x, y = _data()
    model = utils.seeded(lambda: _build_subclassed(x))
    utils.fit(model, x, y, B, epochs=2)
    assert int(utils.accumulator(model).micro_step) == 2
    path = tmp_path / "m.keras"
    model.save(path)

    loaded = keras.models.load_model(path)
    assert type(loaded) is StateNet
    assert loaded.accum_steps == K
    assert int(utils.accumulator(loaded).micro_step) == 2
    utils.fit(loaded, x, y, B, epochs=EPOCHS - 2)
    _assert_resumed_correctly(
        loaded, _subclassed_uninterrupted(x, y), _big_batch_reference(x, y, EPOCHS)
    )


def test_subclassed_model_wrapper_backup_and_restore_resumes(tmp_path):
    """BackupAndRestore with a subclassed model: a fresh, built subclassed model
    resumes from the end-of-epoch backup (a partial cycle pending) and reaches
    the uninterrupted weights."""
    x, y = _data()
    _, resumed, _ = _interrupt_and_resume(
        lambda: _build_subclassed(x), x, y, str(tmp_path / "backup")
    )
    _assert_resumed_correctly(
        resumed, _subclassed_uninterrupted(x, y), _big_batch_reference(x, y, EPOCHS)
    )
