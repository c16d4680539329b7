"""Worker ``--index I`` of a two-worker ``MultiWorkerMirroredStrategy`` on
127.0.0.1 that one worker's death interrupts, for
``tests/keras2/test_worker_death.py`` (tf-keras, ``TF_USE_LEGACY_KERAS=1``)
and ``tests/keras3/test_worker_death.py`` (Keras 3): the Keras is the
environment's, as ``tests/flavour.py`` reads it.

Each Keras trains the way it trains under this strategy:

* tf-keras: ``model.fit`` with ``BackupAndRestore(save_freq=SAVE)``;
* Keras 3, whose ``fit`` fails under this strategy for every model
  (``docs/distributed.md``): the documented loop, ``strategy.run`` of the
  model's ``train_step`` per global micro-batch, with a ``tf.train.Checkpoint``
  (model, optimizer, micro-batches done) that a ``tf.train.CheckpointManager``
  writes every ``SAVE`` micro-batches: the chief into ``<backup>/<case>``,
  the other worker into a directory it deletes (both must write: a
  replica-local sum is read, for saving, by an all-reduce).

``CASES``, one model each, on ``EPOCHS`` epochs of ``BATCHES`` global
micro-batches of ``MICRO`` samples per worker, from the same initial weights:
``model`` (``GradientAccumulateModel`` over ``AccumBatchNormalization`` and
an MLP), ``optimizer`` (a plain model, ``GradientAccumulateOptimizer``),
``plain`` (plain Keras, one update per global micro-batch). All use Adam.

``--phase first`` trains every case uninterrupted (``<case>_straight``),
then every case with backups; the backups are taken after micro-batches 3
and 6 (mid-cycle), and before micro-batch ``KILL_AT`` (the second update's)
worker 1 writes ``dying`` and SIGKILLs itself while worker 0 writes ``alive``
and goes on into the update's all-reduce, where it waits for its dead peer
until the test stops it. In Keras 3 the cases train step by step side by
side, so the one SIGKILL interrupts them all; tf-keras' ``fit`` trains one
model at a time, so the cases before the last stop at the same point by an
exception on both workers (leaving their backups as a death would: nothing
is written after them) and only the last case is killed.

``--phase resume`` (both workers restarted on new ports) restarts every case
from its backup and trains to the end (``<case>_resumed``), then the torn
copies the test made (``TORN``): the newest backup's data file truncated.

Every run writes ``DIR/w<I>/<run>.npz`` (its weights ``w_*``, optimizer
variables ``o_*``, this worker's own part of the accumulated sums
``local_*``) and ``<run>.json`` (facts).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

START = time.monotonic()

WORKERS = 2
MICRO = 4  # per-worker micro-batch
GLOBAL = MICRO * WORKERS  # the global micro-batch
K = 4  # accumulation steps
BATCHES = 12  # global micro-batches per epoch: 3 cycles
N = BATCHES * GLOBAL
EPOCHS = 2
STEPS = BATCHES * EPOCHS  # 24 micro-batches, 6 updates
SAVE = 3  # a backup every 3 micro-batches: after 3 and 6, both mid-cycle
KILL_AT = 7  # worker 1 dies before this micro-batch: the second update's
LAST_BACKUP = KILL_AT // SAVE * SAVE  # 6: 1 update, 2 micro-batches pending
LR = 0.01
CASES = ("plain", "optimizer", "model")
# The torn copy of a backup (made by the test) that the resume phase
# restarts after the cases: the model case's, its newest data file truncated.
TORN = "torn"
TORN_SOURCE = "model"
COLLECTIVE_TIMEOUT = 60  # s: a worker whose peer died fails within this


def mark(label: str) -> None:
    """``label`` with the seconds since this worker started (wall, and CPU
    of this process), on stderr: where a slow drill spends its time (the
    test prints the logs on a failure)."""
    wall, cpu = time.monotonic() - START, time.process_time()
    print(f"[{wall:7.2f} s, cpu {cpu:6.2f} s] {label}", file=sys.stderr, flush=True)


class Stop(Exception):
    """How the tf-keras cases before the killed one stop at ``KILL_AT``."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--ports", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--phase", choices=("first", "resume"), required=True)
    return parser.parse_args(argv)


def setup(args) -> None:
    """Environment of this worker; must run before TensorFlow loads."""
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    os.environ["TF_CONFIG"] = json.dumps(
        {
            "cluster": {"worker": [f"127.0.0.1:{p}" for p in args.ports.split(",")]},
            "task": {"type": "worker", "index": args.index},
        }
    )


# ------------------------------------------------------------------ models
def build(case: str):
    """``case``'s model, seeded, built and compiled (call under the scope)."""
    from gradient_accumulator import (
        AccumBatchNormalization,
        GradientAccumulateModel,
        GradientAccumulateOptimizer,
    )
    from tests import utils
    from tests.flavour import keras

    def make():
        if case == "model":
            inputs = keras.Input((8,))
            h = AccumBatchNormalization(momentum=0.5, name="norm")(inputs)
            h = keras.layers.Dense(16, activation="tanh")(h)
            model = GradientAccumulateModel(
                accum_steps=K, inputs=inputs, outputs=keras.layers.Dense(3)(h)
            )
            optimizer = keras.optimizers.Adam(LR)
        else:
            model = utils.plain_model()
            optimizer = keras.optimizers.Adam(LR)
            if case == "optimizer":
                optimizer = GradientAccumulateOptimizer(optimizer, accum_steps=K)
        model.compile(optimizer=optimizer, loss=utils.sparse_ce())
        return model

    return utils.seeded(make)


def samples(order=None):
    """``(x, y)``: the global micro-batches ``order`` lists, in that order
    (by default all of an epoch)."""
    import numpy as np

    from tests import utils

    x, y = utils.classification_data(N)
    if order is None:
        return x, y
    rows = np.concatenate([np.arange(b * GLOBAL, (b + 1) * GLOBAL) for b in order])
    return x[rows], y[rows]


def data(order=None):
    """``samples(order)`` in global micro-batches, split between the workers
    batch by batch."""
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices(samples(order)).batch(GLOBAL)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    return dataset.with_options(options)


# What tf-keras' fit feeds a run resumed from the backup after micro-batch
# LAST_BACKUP: its fresh iterator starts the epoch from its first batch.
TF_KERAS_FED = [*range(LAST_BACKUP), *range(BATCHES - LAST_BACKUP), *range(BATCHES)]


# ------------------------------------------------------------------- state
def engine(model):
    """The model's accumulation engine, or None for a plain model."""
    from gradient_accumulator import (
        GradientAccumulateModel,
        GradientAccumulateOptimizer,
    )

    if isinstance(model, GradientAccumulateModel) or isinstance(
        model.optimizer, GradientAccumulateOptimizer
    ):
        from tests import utils

        return utils.accumulator(model)
    return None


def _value(variable):
    """A variable's (or tensor's) value as a NumPy array."""
    import numpy as np

    return np.asarray(variable.numpy() if hasattr(variable, "numpy") else variable)


def _tf_variable(variable):
    """The tf.Variable behind a Keras 3 variable, or ``variable``."""
    inner = getattr(variable, "value", None)
    return variable if inner is None or callable(inner) else inner


def local_sums(strategy, model) -> list:
    """This worker's own part of every replica-local sum (the engine's
    gradient and weight sums, AccumBatchNormalization's): read where it
    is, no all-reduce."""

    variables = [
        *model.weights,
        *_optimizer_variables(model),
        *_engine_variables(model),
    ]
    return [
        _value(strategy.experimental_local_results(_tf_variable(v))[0])
        for v in variables
        if _tf_variable(v).synchronization == _on_read()
    ]


def _on_read():
    import tensorflow as tf

    return tf.VariableSynchronization.ON_READ


def _engine_variables(model) -> list:
    state = engine(model)
    return list(state.variables) if state is not None else []


def _optimizer_variables(model) -> list:
    variables = model.optimizer.variables
    return list(variables() if callable(variables) else variables)


def snapshot(strategy, model) -> tuple[dict, dict]:
    """(arrays, facts) of ``model`` now. Reading a replica-local variable
    all-reduces it: every worker takes its snapshots at the same points."""

    from tests.dist_worker import _pack

    state = engine(model)
    facts = {"iterations": int(_value(model.optimizer.iterations))}
    if state is not None:
        facts["micro_step"] = int(_value(state.micro_step))
        facts["weight_sum"] = float(_value(state.weight_sum))
    arrays = {
        **_pack("t", [_value(w) for w in model.trainable_weights]),
        **_pack("w", [_value(w) for w in model.weights]),
        **_pack("o", [_value(v) for v in _optimizer_variables(model)]),
        **_pack("e", [_value(v) for v in _engine_variables(model)]),
        **_pack("local", local_sums(strategy, model)),
    }
    return arrays, facts


def write(out: Path, name: str, arrays: dict, facts: dict) -> None:
    import numpy as np

    np.savez(out / f"{name}.npz", **arrays)
    (out / f"{name}.json").write_text(json.dumps(facts))
    print(f"{name} done at {time.monotonic() - START:.1f} s", flush=True)


def at_kill_point(args, out: Path) -> None:
    """Worker 1 dies here (SIGKILL, nothing written after); worker 0 says
    it got here and goes on."""
    mark("kill point")
    if args.index == 1:
        (out / "dying").write_text("")
        os.kill(os.getpid(), signal.SIGKILL)
    (out / "alive").write_text("")


# ---------------------------------------------------------------- tf-keras
def tf_keras_phase(args, strategy, out: Path, backup: Path) -> None:
    import tensorflow as tf

    from tests.flavour import keras

    def fit(model, dataset, epochs, *callbacks):
        mark("fit")
        model.fit(
            dataset, epochs=epochs, verbose=0, shuffle=False, callbacks=list(callbacks)
        )
        mark("fit done")

    class DieAt(keras.callbacks.Callback):
        """Before micro-batch KILL_AT of the first epoch: the death, or (a
        case before the last) Stop on both workers."""

        def __init__(self, kill: bool):
            super().__init__()
            self.kill, self.epoch = kill, None

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            if self.epoch == 0 and batch == KILL_AT:
                if self.kill:
                    at_kill_point(args, out)
                else:
                    raise Stop

    class Seen(keras.callbacks.Callback):
        """Writes ``name``: what the model holds (counters, this worker's own
        sums) before micro-batch ``at`` of the first epoch, or by default
        before the first one fit runs (after BackupAndRestore restored)."""

        def __init__(self, name: str, at=None):
            super().__init__()
            self.name, self.at, self.done = name, at, False

        def on_train_batch_begin(self, batch, logs=None):
            if not self.done and (self.at is None or batch == self.at):
                self.done = True
                facts = {"batch": int(batch), **counters(self.model)}
                write_local(out, self.name, local_sums(strategy, self.model), facts)

    if args.phase == "first":
        # The uninterrupted runs, on what a resumed run is fed (TF_KERAS_FED).
        for case in CASES:
            with strategy.scope():
                model = build(case)
            write_initial(out, case, model)
            fit(model, data(TF_KERAS_FED), 1)
            write(out, f"{case}_straight", *snapshot(strategy, model))
        for case in CASES:
            with strategy.scope():
                model = build(case)
            callback = keras.callbacks.BackupAndRestore(
                str(backup / case), save_freq=SAVE
            )
            seen = Seen(f"{case}_at_backup", at=LAST_BACKUP)
            die = DieAt(kill=case == CASES[-1])
            try:
                fit(model, data(), EPOCHS, callback, seen, die)
            except Stop:
                print(f"{case} stopped", flush=True)
        raise AssertionError("the last case's fit went past its death")
    for case in (*CASES, TORN):
        with strategy.scope():
            model = build(case if case in CASES else TORN_SOURCE)
        seen = Seen(f"{case}_restored")
        callback = keras.callbacks.BackupAndRestore(str(backup / case), save_freq=SAVE)
        try:
            fit(model, data(), EPOCHS, callback, seen)
        except (IndexError, tf.errors.OpError) as error:  # a torn file's
            arrays, facts = snapshot(strategy, model)
            write(out, f"{case}_resumed", arrays, {**facts, "error": _error(error)})
            continue
        write(out, f"{case}_resumed", *snapshot(strategy, model))


def write_initial(out: Path, case: str, model) -> None:
    from tests.dist_worker import _pack

    write(
        out,
        f"{case}_init",
        _pack("t", [_value(w) for w in model.trainable_weights]),
        {},
    )


def write_local(out: Path, name: str, local: list, facts: dict) -> None:
    from tests.dist_worker import _pack

    write(out, name, _pack("local", local), facts)


def _error(error: BaseException) -> dict:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return {
        "type": type(error).__name__,
        "bases": [c.__name__ for c in type(error).__mro__],
        "message": " ".join(lines)[-1000:],
    }


# ----------------------------------------------------------------- Keras 3
def keras3_phase(args, strategy, out: Path, backup: Path) -> None:

    if args.phase == "first":
        runs = [Run(strategy, case, None) for case in CASES]
        for run in runs:
            write_initial(out, run.case, run.model)
        for step in range(STEPS):
            for run in runs:
                run.step(step)
        for run in runs:
            write(out, f"{run.case}_straight", *snapshot(strategy, run.model))
        runs = [Run(strategy, case, backup / case, args.index) for case in CASES]
        for step in range(STEPS):
            if step == LAST_BACKUP:  # what the backup just written holds
                for run in runs:
                    facts = {"step": step, **counters(run.model)}
                    local = local_sums(strategy, run.model)
                    write_local(out, f"{run.case}_at_backup", local, facts)
            if step == KILL_AT:
                at_kill_point(args, out)
            for run in runs:
                run.step(step)
        raise AssertionError("the cases went past their death")
    for case in (*CASES, TORN):
        source = case if case in CASES else TORN_SOURCE
        run = Run(strategy, source, backup / case, args.index, save=False)
        restored = run.restore()
        mark(f"{case}: restored")
        facts = {**restored, **counters(run.model)}
        write_local(out, f"{case}_restored", local_sums(strategy, run.model), facts)
        for step in range(restored["step"], STEPS):
            run.step(step)
        write(out, f"{case}_resumed", *snapshot(strategy, run.model))


def counters(model) -> dict:
    """The optimizer's updates and the cycle's position (no all-reduce)."""

    facts = {"iterations": int(_value(model.optimizer.iterations))}
    state = engine(model)
    if state is not None:
        facts["micro_step"] = int(_value(state.micro_step))
    return facts


class Run:
    """One case in the documented loop: its model, step function and
    (with ``backup``) a checkpoint written every SAVE micro-batches."""

    def __init__(
        self,
        strategy,
        case: str,
        backup: Path | None,
        index: int = 0,
        save: bool = True,
    ):
        import tensorflow as tf

        from tests.dist_worker import mwms_step_function

        self.strategy, self.case, self.backup = strategy, case, backup
        with strategy.scope():
            self.model = build(case)
            self.model.optimizer.build(self.model.trainable_variables)
            state = engine(self.model)
            if state is not None and not state.built:
                state.build(self.model.trainable_variables)
        self.function = mwms_step_function(strategy, self.model)
        self.done = tf.Variable(0, dtype="int64")  # micro-batches trained
        self.checkpoint = tf.train.Checkpoint(
            model=self.model, optimizer=self.model.optimizer, done=self.done
        )
        self.batches = None
        self.save = backup is not None and save
        if self.save:
            # The chief writes the backups; the other worker writes into a
            # directory of its own and deletes it.
            self.own = (
                backup if index == 0 else backup.parent / f"{backup.name}-w{index}"
            )
            self.manager = tf.train.CheckpointManager(
                self.checkpoint, str(self.own), max_to_keep=2
            )
        mark(f"{case}: built")

    def step(self, step: int) -> None:
        first = self.batches is None
        if first:
            dataset = data().repeat(EPOCHS).skip(step)
            self.batches = iter(self.strategy.experimental_distribute_dataset(dataset))
            mark(f"{self.case}: dataset at {step}")
        self.function(next(self.batches))
        self.done.assign_add(1)
        if first:
            mark(f"{self.case}: first step done")
        if self.save and (step + 1) % SAVE == 0:
            self.manager.save()
            if self.own != self.backup:
                shutil.rmtree(self.own, ignore_errors=True)
            mark(f"{self.case}: saved after {step + 1}")

    def restore(self) -> dict:
        """Restores the newest backup that reads (``docs/distributed.md``);
        returns where it resumes, and the error of every newer one, with
        whether the model's variables were all finite after it."""
        import numpy as np
        import tensorflow as tf

        state = tf.train.get_checkpoint_state(str(self.backup))
        skipped = []
        for path in reversed(state.all_model_checkpoint_paths):
            try:
                self.checkpoint.read(path).assert_existing_objects_matched()
            except (IndexError, tf.errors.OpError) as error:
                values = [*self.model.weights, *_optimizer_variables(self.model)]
                finite = all(np.all(np.isfinite(_value(v))) for v in values)
                skipped.append(
                    {"path": Path(path).name, "finite": bool(finite), **_error(error)}
                )
                continue
            return {
                "step": int(self.done.numpy()),
                "path": Path(path).name,
                "skipped": skipped,
            }
        raise AssertionError(f"no backup reads: {skipped}")


# -------------------------------------------------------------------- main
def main(argv=None) -> None:
    args = parse_args(argv)
    setup(args)

    mark("started")
    import tensorflow as tf

    from tests import flavour

    mark("imported")
    tf.config.experimental.enable_op_determinism()
    # No tf.data autotuning in any iterator: debug mode turns it off in every
    # one TensorFlow makes, also the per-device iterators of the
    # MultiDeviceIterator behind a distributed dataset, which a dataset's
    # own options do not reach. Deleting an autotuned iterator there waits
    # for its tuning thread, which sleeps out its period (doubling up to
    # 60 s) unwoken: each deleted iterator (the Keras 3 loop's runs', each
    # tf-keras fit's) stalled its worker, and the other in the next
    # collective, from seconds to a minute. The data are in-memory slices
    # batched in order: what is fed, and in which order, is unchanged.
    tf.data.experimental.enable_debug_mode()
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            timeout_seconds=COLLECTIVE_TIMEOUT
        )
    )
    assert strategy.num_replicas_in_sync == WORKERS, strategy.num_replicas_in_sync
    mark("strategy")
    root = Path(args.out)
    out = root / f"w{args.index}"
    out.mkdir(parents=True, exist_ok=True)
    phase = tf_keras_phase if flavour.LEGACY_KERAS else keras3_phase
    phase(args, strategy, out, root / "backup")
    mark("exit")
    # TensorFlow's collective runtime can abort in its destructors at
    # interpreter exit after all work is written: skip the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
