"""Child process for the distributed tests (``tests/keras3/test_distributed.py``).

Run from the repository root as ``python -m tests.dist_worker MODE ...``:

* ``mirrored --out DIR --cases a,b``: one process, ``MirroredStrategy`` over
  two logical CPU devices (set up before TensorFlow initialises, which is why
  this runs in its own process);
* ``mwms --index I --ports P0,P1 --out DIR --cases a,b``: worker ``I`` of a
  two-worker ``MultiWorkerMirroredStrategy`` on 127.0.0.1.

For every case it trains a tiny model with accumulation under the strategy
and the plain-Keras single-device reference on the concatenated big batch
(global batch = per-replica micro-batch x replicas x ``K``), and writes both
weight lists, plus facts the tests assert on, to ``DIR/<case>.npz`` and
``DIR/<case>.json``. Under MWMS only worker 0 writes. Nothing is compared
here: the pytest side does that.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

REPLICAS = 2
MICRO = 4  # per-replica micro-batch
K = 4  # accumulation steps
GLOBAL_MICRO = MICRO * REPLICAS
BIG = GLOBAL_MICRO * K  # the reference's batch
N = 64  # samples: 8 global micro-batches = 2 updates per epoch
EPOCHS = 2
LR_SGD = 0.1
LR_ADAM = 0.01
CLIPNORM = 0.05  # well below the gradients' global norm, so it always clips
VOCAB, SEQ = 40, 6

MIRRORED_CASES = (
    "model_sgd",
    "model_adam_clip",
    "opt_sgd",
    "opt_adam_clip",
    "model_embedding",
    "opt_embedding",
    "model_jit",
    "opt_jit",
    "checkpoint_model",
    "checkpoint_opt",
    "model_unused_weight",
    "model_nan_one_replica",
    "model_denominators",
)
MWMS_CASES = ("model_sgd", "opt_adam_clip", "model_bn")
# Cases that probe Keras' own failures under MWMS, each run by its own pair of
# workers: after a collective op has failed, TensorFlow's collective runtime
# can crash natively ("double free or corruption") in whatever runs next in
# the same processes. So Keras' plain ``fit`` and ours are two cases: run in
# one pair, the first to fail could leave a collective pending that fails the
# second ("UnavailableError ... could be from a previous operation", seen
# once in the lowest pair).
MWMS_PROBE_CASES = ("model_jit", "model_fit", "model_fit_plain")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("mirrored", "mwms"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default="")
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--ports", default="")
    return parser.parse_args(argv)


def setup(args) -> None:
    """Device / cluster set-up; must run before TensorFlow initialises."""
    if args.mode == "mwms":
        ports = args.ports.split(",")
        os.environ["TF_CONFIG"] = json.dumps(
            {
                "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                "task": {"type": "worker", "index": args.index},
            }
        )
        return
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    setup(args)

    import keras
    import tensorflow as tf
    from tensorflow.python.framework import config as tf_config

    # Full tracebacks in the test's failure output.
    keras.config.disable_traceback_filtering()
    # No tf.data autotuning, also in the per-device iterators behind a
    # distributed dataset (see tests/death_worker.py): deleting one waits
    # for its tuning thread to sleep out its period. In-memory slices
    # batched in order: what is fed, and in which order, is unchanged.
    tf.data.experimental.enable_debug_mode()
    if args.mode == "mirrored":
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        default = MIRRORED_CASES
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        default = MWMS_CASES
    assert strategy.num_replicas_in_sync == REPLICAS, strategy.num_replicas_in_sync
    cases = [c for c in args.cases.split(",") if c] or list(default)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chief = args.mode == "mirrored" or args.index == 0
    for case in cases:
        # Keras refuses XLA while op determinism is on (it falls back to
        # jit_compile=False with a warning), so the XLA cases run without it.
        if case.endswith("_jit"):
            tf_config.disable_op_determinism()
        else:
            tf.config.experimental.enable_op_determinism()
        result, facts = run_case(case, strategy, out, chief)
        if chief:
            import numpy as np

            np.savez(out / f"{case}.npz", **result)
            (out / f"{case}.json").write_text(json.dumps(facts))
        print(f"case {case} done", flush=True)
    if args.mode == "mwms":
        # TensorFlow's collective runtime can abort in its destructors at
        # interpreter exit ("double free or corruption") after all work is
        # done and written; skip the teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# ----------------------------------------------------------------- models
def _data(case: str):
    import numpy as np

    from tests import utils

    if _architecture(case) == "embedding":
        rng = np.random.default_rng(3)
        # Few distinct tokens per micro-batch: sparse rows, some repeated.
        x = rng.integers(0, VOCAB, size=(N, SEQ)).astype("int32")
        y = rng.integers(0, 3, size=N)
        return x, y
    return utils.classification_data(N)


def _architecture(case: str) -> str:
    """The layers a case trains: "bn", "embedding", "unused" or "mlp"."""
    return next((k for k in ("bn", "embedding", "unused") if k in case), "mlp")


def _layers(case: str, reference: bool = False):
    import keras

    from gradient_accumulator import AccumBatchNormalization
    from tests import utils

    architecture = _architecture(case)
    if architecture == "bn":
        # Normalising the inputs: statistics that do not depend on weights,
        # so the pooled ones must equal Keras' on the big batch exactly.
        inputs = keras.Input((8,))
        norm = keras.layers.BatchNormalization if reference else AccumBatchNormalization
        h = norm(momentum=0.5, name="norm")(inputs)
        h = keras.layers.Dense(16, activation="tanh")(h)
        return inputs, keras.layers.Dense(3)(h)
    if architecture == "embedding":
        inputs = keras.Input((SEQ,), dtype="int32")
        h = keras.layers.Embedding(VOCAB, 8)(inputs)
        h = keras.layers.GlobalAveragePooling1D()(h)
        outputs = keras.layers.Dense(3)(h)
        return inputs, outputs
    if architecture == "unused":
        # A trainable weight without a gradient, ahead of the others.
        inputs = keras.Input((8,))
        h = _with_unused_weight_class()()(inputs)
        h = keras.layers.Dense(16, activation="tanh")(h)
        return inputs, keras.layers.Dense(3)(h)
    return utils.mlp_layers()


@functools.cache
def _with_unused_weight_class():
    """A layer with a trainable weight that gets no gradient (made once, on
    first use, so that importing this module does not import Keras)."""
    import keras

    class WithUnusedWeight(keras.layers.Layer):
        def build(self, input_shape):
            self.unused = self.add_weight(shape=(5,), initializer="ones")
            self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones")

        def call(self, x):
            return x * self.scale

    return WithUnusedWeight


def _inner_optimizer(case: str):
    import keras

    if "embedding" in case:
        # Linear in the gradient: Keras' Adam squares an IndexedSlices'
        # rows before summing duplicates, so a plain-Keras reference on
        # repeated tokens would not be the big batch's Adam step.
        return keras.optimizers.SGD(0.5, momentum=0.9)
    if "adam" in case or "checkpoint" in case:
        kwargs = {"global_clipnorm": CLIPNORM} if "clip" in case else {}
        return keras.optimizers.Adam(LR_ADAM, **kwargs)
    return keras.optimizers.SGD(LR_SGD, momentum=0.5)


def build_accumulating(case: str):
    """The model under test: built and compiled under the current strategy."""
    import keras

    from gradient_accumulator import (
        GradientAccumulateModel,
        GradientAccumulateOptimizer,
    )
    from tests import utils

    jit = case.endswith("_jit")

    def build():
        inputs, outputs = _layers(case)
        if case.startswith(("model", "checkpoint_model")):
            # Checkpoint cases stop fit mid-cycle on purpose: no flush.
            model = GradientAccumulateModel(
                accum_steps=K, flush_at_end=False, inputs=inputs, outputs=outputs
            )
            model.compile(
                optimizer=_inner_optimizer(case),
                loss=utils.sparse_ce(),
                jit_compile=jit,
            )
        else:
            model = keras.Model(inputs, outputs)
            model.compile(
                optimizer=GradientAccumulateOptimizer(
                    _inner_optimizer(case), accum_steps=K
                ),
                loss=utils.sparse_ce(),
                jit_compile=jit,
            )
        return model

    return utils.seeded(build)


def build_reference(case: str):
    """Plain Keras, one device, same initial weights."""
    import keras

    from tests import utils

    def build():
        inputs, outputs = _layers(case, reference=True)
        model = keras.Model(inputs, outputs)
        model.compile(
            optimizer=_inner_optimizer(case), loss=utils.sparse_ce(), jit_compile=False
        )
        return model

    return utils.seeded(build)


# Trained references by what they depend on (see trained_reference).
_REFERENCES: dict[tuple[str, str], tuple] = {}


def trained_reference(case: str, x, y):
    """``(reference, initial weights, facts)``: the case's plain one-device
    model trained on the big batches. Cases whose data, layers and optimizer
    agree (model_sgd, opt_sgd, the XLA and NaN cases; each wrapper pair)
    train the same reference, so this process trains it once."""
    import keras

    from tests import utils

    optimizer = keras.optimizers.serialize(_inner_optimizer(case))
    optimizer["config"].pop("name", None)
    key = (_architecture(case), json.dumps(optimizer, sort_keys=True, default=str))
    if key not in _REFERENCES:
        reference = build_reference(case)
        initial = utils.weights(reference)
        facts = {}
        if "clip" in case:
            # A forward pass in training mode: it would move BatchNorm
            # statistics.
            facts["grad_norm"] = _initial_grad_norm(reference, x, y)
        reference.fit(_dataset(x, y, BIG), epochs=EPOCHS, verbose=0, shuffle=False)
        facts["ref_iterations"] = _iterations(reference)
        _REFERENCES[key] = (reference, initial, facts)
    reference, initial, facts = _REFERENCES[key]
    return reference, initial, dict(facts)


def _dataset(x, y, batch):
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def _pack(prefix, arrays):
    return {f"{prefix}_{i:02d}": a for i, a in enumerate(arrays)}


def _packed(initial, reference, ours=None, **more) -> dict:
    """The arrays a case returns: the initial weights, the reference's and
    (if given) ``ours``, then ``more`` lists by prefix; nothing on a worker
    that trained no reference (it writes nothing)."""
    from tests import utils

    if reference is None:
        return {}
    result = {**_pack("init", initial), **_pack("ref", utils.weights(reference))}
    if ours is not None:
        result.update(_pack("ours", ours))
    for prefix, arrays in more.items():
        result.update(_pack(prefix, arrays))
    return result


def _identical_on_replicas(strategy, model) -> bool:
    """Whether every replica holds the same trainable weights, bit for bit."""
    import numpy as np

    return all(
        len({np.asarray(v).tobytes() for v in _local(strategy, w)}) == 1
        for w in model.trainable_weights
    )


def _iterations(model) -> int:
    return int(model.optimizer.iterations.numpy())


# ------------------------------------------------------------------ cases
def run_case(case, strategy, out: Path, chief: bool):
    import tensorflow as tf

    from tests import utils

    if case == "model_denominators":  # its own model, data and reference
        return _denominators_case(case, strategy)
    x, y = _data(case)
    if case == "model_fit_plain":
        # Plain Keras' ``model.fit`` under this strategy (the workaround
        # fit_under exists for), alone in its pair of workers.
        ds = _dataset(x, y, GLOBAL_MICRO)

        def plain_fit():
            _plain_under(strategy, case, jit=False).fit(ds, epochs=1, verbose=0)

        return {}, {"plain_fit_error": _fit_error(plain_fit)}
    if chief:
        reference, initial, facts = trained_reference(case, x, y)
    else:
        # Only the chief writes (main): the other MWMS worker needs no
        # reference, and training one would only take CPU from the chief.
        reference, initial, facts = None, None, {}
    if case == "model_nan_one_replica":
        return _nan_case(case, strategy, x, y, initial, facts)

    if case.startswith("checkpoint"):
        ours, resumed = _checkpoint_case(case, strategy, x, y, out, facts)
        return _packed(initial, reference, ours, **resumed), facts

    ds = _dataset(x, y, GLOBAL_MICRO)
    if case == "model_fit":
        # Our model's plain ``model.fit`` under this strategy (fit_under works
        # around Keras' MWMS failures; this checks that ours fails as Keras'
        # does, model_fit_plain).
        with strategy.scope():
            model = build_accumulating(case)
        error = _fit_error(lambda: model.fit(ds, epochs=EPOCHS, verbose=0))
        if error is not None:
            facts["fit_error"] = error
            return _packed(initial, reference), facts
        facts["iterations"] = _iterations(model)
        return _packed(initial, reference, utils.weights(model)), facts
    if case.endswith("_jit"):
        # Whether plain Keras can XLA-compile a train step under this
        # strategy at all: if it cannot, ours cannot either, and the test
        # checks that both fail the same way.
        facts["plain_jit_error"] = _fit_error(
            lambda: fit_under(strategy, _plain_under(strategy, case), ds)
        )
    with strategy.scope():
        model = build_accumulating(case)

    def fit():
        fit_under(strategy, model, ds, epochs=EPOCHS)

    error = _fit_error(fit) if case.endswith("_jit") else fit()
    if error is not None:
        facts["jit_error"] = error
        return _packed(initial, reference), facts
    facts["iterations"] = _iterations(model)
    facts["jit_compile"] = bool(model.jit_compile)
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        facts["collectives"] = collective_counts(model, strategy, ds)
    if "bn" in case and chief:
        facts["moving_stats_diff"] = _moving_stats_diff(model, reference)
    return _packed(initial, reference, utils.weights(model)), facts


def _moving_stats_diff(model, reference) -> float:
    import numpy as np

    ours, theirs = model.get_layer("norm"), reference.get_layer("norm")
    assert not np.allclose(np.asarray(theirs.moving_variance), 1.0)  # moved
    return max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in [
            (ours.moving_mean, theirs.moving_mean),
            (ours.moving_variance, theirs.moving_variance),
        ]
    )


def fit_under(strategy, model, dataset, epochs=1):
    """Trains ``model`` on ``dataset`` under ``strategy``.

    MirroredStrategy: plain ``model.fit``. MultiWorkerMirroredStrategy:
    Keras 3.15's ``fit`` fails under it for any strategy-scoped model, ours or
    not: ``_maybe_symbolic_build`` calls ``strategy.reduce("MEAN", (x, y))``
    and MWMS' ``reduce`` rejects a tuple, and ``reduce_per_replica`` reduces
    the scalar logs with ``axis=0`` ("Invalid reduction dimension 0 for input
    with 0 dimensions"). So this runs what ``fit`` runs per batch,
    ``strategy.run(model.train_step, (batch,))`` in a ``tf.function`` over the
    distributed dataset, without the broken log reduction.
    """
    import tensorflow as tf

    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        model.fit(dataset, epochs=epochs, verbose=0, shuffle=False)
        return
    step = mwms_step_function(strategy, model)
    for _ in range(epochs):
        for batch in strategy.experimental_distribute_dataset(dataset):
            step(batch)


def mwms_step_function(strategy, model):
    """A cached ``tf.function`` running one ``train_step`` on every replica.

    Traced without AutoGraph, as Keras' own ``fit`` traces its step
    (``one_step_on_data`` is ``do_not_convert``): ``train_step`` and the
    package run as written, as under ``fit``, and no process spends seconds
    converting their source.
    """
    import tensorflow as tf

    if getattr(model, "_mwms_step", None) is None:
        with strategy.scope():
            model.optimizer.build(model.trainable_variables)

        @tf.function(jit_compile=bool(model.jit_compile), autograph=False)
        def step(batch):
            strategy.run(model.train_step, args=(batch,))

        model._mwms_step = step
    return model._mwms_step


def _nan_case(case, strategy, x, y, initial, facts):
    """A NaN in one sample of replica 1's first micro-batch (replica 0's
    gradients stay finite): the whole first cycle must be dropped on every
    replica, the second applied. Reference: plain Keras on the second big
    batch only, from the initial weights."""
    import numpy as np

    from tests import utils

    x = x.copy()
    x[MICRO + 1, 0] = np.nan  # global micro-batch 0 = replica 0's 4, replica 1's 4
    reference = build_reference(case)
    reference.fit(
        _dataset(x[BIG : 2 * BIG], y[BIG : 2 * BIG], BIG),
        epochs=1,
        verbose=0,
        shuffle=False,
    )
    with strategy.scope():
        model = build_accumulating(case)
    fit_under(strategy, model, _dataset(x[: 2 * BIG], y[: 2 * BIG], GLOBAL_MICRO))
    facts["iterations"] = _iterations(model)
    facts["ref_iterations"] = _iterations(reference)
    facts["replicas_identical"] = _identical_on_replicas(strategy, model)
    return _packed(initial, reference, utils.weights(model)), facts


def _denominators_case(case, strategy):
    """BERT-like pretraining (``tests/keras3/test_denominators.py``' model): a token
    head averaged over the masked positions (``mean_with_sample_weight``,
    per-token weights) beside a sequence head averaged over the sequences.
    Each replica's micro-batch holds its own number of masked tokens, so the
    part's total (as the leader's) must be summed over replicas and the cycle
    before it divides. Also trains plain Keras under the strategy on the
    global big batch, where every replica divides by its own masked count,
    to show that per-replica normalisation is measurably off."""
    import keras
    import numpy as np
    import tensorflow as tf

    from gradient_accumulator import GradientAccumulateModel
    from tests import utils
    from tests.keras3.test_denominators import _corpus, _losses, _pretraining

    corpora = [_corpus(seed) for seed in (0, 1)]  # 2 x 32 sequences
    x = np.concatenate([c[0] for c in corpora])
    y = {k: np.concatenate([c[1][k] for c in corpora]) for k in ("mlm", "nsp")}
    masked = np.concatenate([c[2] for c in corpora])
    assert len(x) == N, len(x)
    sw = {"mlm": masked, "nsp": np.ones(N, "float32")}
    layers = _pretraining()

    def dataset(batch):
        return tf.data.Dataset.from_tensor_slices((x, y, sw)).batch(batch)

    def plain():
        model = keras.Model(*layers())
        model.compile(
            optimizer=_inner_optimizer(case), loss=_losses()(), jit_compile=False
        )
        return model

    reference = utils.seeded(plain)
    initial = utils.weights(reference)
    reference.fit(dataset(BIG), epochs=EPOCHS, verbose=0, shuffle=False)
    facts = {"ref_iterations": _iterations(reference)}

    with strategy.scope():
        per_replica = utils.seeded(plain)
    per_replica.fit(dataset(BIG), epochs=EPOCHS, verbose=0, shuffle=False)
    facts["plain_mirrored_gap"] = utils.max_abs_diff(
        utils.weights(per_replica), utils.weights(reference)
    )

    def accumulating():
        inputs, outputs = layers()
        model = GradientAccumulateModel(
            accum_steps=K, flush_at_end=False, inputs=inputs, outputs=outputs
        )
        model.compile(
            optimizer=_inner_optimizer(case), loss=_losses()(), jit_compile=False
        )
        return model

    with strategy.scope():
        model = utils.seeded(accumulating)
    fit_under(strategy, model, dataset(GLOBAL_MICRO), epochs=EPOCHS)
    facts["iterations"] = _iterations(model)
    facts["parts"] = len(utils.accumulator(model).parts)
    facts["replicas_identical"] = _identical_on_replicas(strategy, model)
    return _packed(initial, reference, utils.weights(model)), facts


def _local(strategy, variable):
    return strategy.experimental_local_results(variable.value)


def _plain_under(strategy, case, jit=True):
    import keras

    from tests import utils

    def build():
        inputs, outputs = _layers(case)
        model = keras.Model(inputs, outputs)
        model.compile(
            optimizer=_inner_optimizer(case), loss=utils.sparse_ce(), jit_compile=jit
        )
        return model

    with strategy.scope():
        return utils.seeded(build)


def _fit_error(fit) -> str | None:
    """Runs ``fit``; returns None, or the error's last line if it fails."""
    import tensorflow as tf

    try:
        fit()
    except (tf.errors.OpError, ValueError, TypeError) as error:
        # The cause is the line naming the device or op; drop the traceback.
        lines = [
            line.strip()
            for line in str(error).splitlines()
            if line.strip() and not line.startswith("  File")
        ]
        return f"{type(error).__name__}: {' '.join(lines)[-3000:]}"
    return None


def _initial_grad_norm(model, x, y) -> float:
    """Global norm of the first big batch's gradient at the initial weights."""
    import tensorflow as tf

    from tests import utils

    with tf.GradientTape() as tape:
        loss = utils.sparse_ce()(y[:BIG], model(x[:BIG], training=True))
    grads = tape.gradient(loss, model.trainable_weights)
    grads = [tf.convert_to_tensor(g) for g in grads if g is not None]
    return float(tf.linalg.global_norm(grads).numpy())


def _resume(strategy, model, rest, facts, how: str):
    """Records the accumulation state ``model`` was restored with (under
    ``how``), finishes the run on ``rest``; returns its weights."""
    from tests import utils

    state = utils.accumulator(model)
    facts[f"{how}_micro_step_restored"] = int(state.micro_step.numpy())
    facts[f"{how}_micro_step_per_replica"] = _per_replica(strategy, state.micro_step)
    facts[f"{how}_weight_sum_restored"] = float(state.weight_sum.numpy())
    fit_under(strategy, model, rest)
    facts[f"{how}_iterations"] = _iterations(model)
    return utils.weights(model)


def _checkpoint_case(case, strategy, x, y, out: Path, facts):
    """Saves mid-cycle under the strategy (tf.train.Checkpoint and .keras),
    restores into a fresh strategy-scoped model and finishes the run.

    The uninterrupted run, which the resumed ones must reach, is the saved
    model itself going on in memory after the save (the test checks it
    against the big batch): the same weights a separate straight run would
    reach if ending ``fit`` mid-cycle loses nothing, and that is checked too,
    by the same comparison. One strategy-scoped model fewer to trace."""
    import keras
    import tensorflow as tf

    from tests import utils

    ds = _dataset(x, y, GLOBAL_MICRO)
    steps = N // GLOBAL_MICRO * EPOCHS  # 16 micro-steps = 4 updates
    cut = K + K // 2 + 1  # 7: mid-way through the second cycle
    with strategy.scope():
        first = build_accumulating(case)
    fit_under(strategy, first, ds.repeat(EPOCHS).take(cut))
    accumulator = utils.accumulator(first)
    facts["micro_step_at_save"] = int(accumulator.micro_step.numpy())
    facts["micro_step_per_replica_at_save"] = _per_replica(
        strategy, accumulator.micro_step
    )
    facts["weight_sum_at_save"] = float(accumulator.weight_sum.numpy())
    # Each replica's own partial sum: they differ, which is what a mirrored
    # (single-value) save would lose.
    local = strategy.experimental_local_results(accumulator.grad_sums[-1].value)
    facts["replica_partials_differ"] = bool(
        len(local) < 2 or float(tf.reduce_max(tf.abs(local[0] - local[1]))) > 0
    )
    facts["iterations_at_save"] = _iterations(first)
    prefix = tf.train.Checkpoint(model=first, optimizer=first.optimizer).write(
        str(out / f"{case}-ckpt" / "ckpt")
    )
    keras_path = out / f"{case}.keras"
    first.save(keras_path)

    rest = ds.repeat(EPOCHS).skip(cut)
    # The uninterrupted run: the saved model, on in memory.
    straight = first
    fit_under(strategy, straight, rest)
    resumed = {}
    with strategy.scope():
        fresh = build_accumulating(case)
        # Create the optimizer's and the accumulator's variables before
        # restoring, as a resumed training script would.
        fresh.optimizer.build(fresh.trainable_variables)
        if not utils.accumulator(fresh).built:
            utils.accumulator(fresh).build(fresh.trainable_variables)
        status = tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).read(
            prefix
        )
        status.assert_existing_objects_matched()
    resumed["ckpt"] = _resume(strategy, fresh, rest, facts, "ckpt")

    with strategy.scope():
        loaded = keras.models.load_model(keras_path)
    resumed["keras"] = _resume(strategy, loaded, rest, facts, "keras")

    # The same checkpoint resumed on one device (no strategy): it holds the
    # replicas' sum, and one replica on the global micro-batch continues it.
    single = build_accumulating(case)
    single.optimizer.build(single.trainable_variables)
    if not utils.accumulator(single).built:
        utils.accumulator(single).build(single.trainable_variables)
    tf.train.Checkpoint(model=single, optimizer=single.optimizer).read(
        prefix
    ).assert_existing_objects_matched()
    single.fit(rest, epochs=1, verbose=0, shuffle=False)
    resumed["single"] = utils.weights(single)
    facts["single_iterations"] = _iterations(single)
    facts["iterations"] = _iterations(straight)
    facts["steps"] = steps
    return utils.weights(straight), resumed


def _per_replica(strategy, variable) -> list[int]:
    """The micro-step counter as every replica holds it."""
    return [int(v.numpy()) for v in strategy.experimental_local_results(variable.value)]


# --------------------------------------------------------------- counting
COLLECTIVE_OPS = ("CollectiveReduce", "CollectiveReduceV2", "CollectiveReduceV3")


def collective_counts(model, strategy, dataset) -> dict:
    """All-reduce ops in the traced train function, by where they sit.

    Walks the graph of the ``tf.function`` that ``fit`` runs (the
    ``multi_step_on_iterator`` Keras builds) and every function it calls.
    Returns ``{"update": a, "accumulate": b, "other": c}``: ``a``/``b``
    count all-reduces reachable from the two branches of the conditional
    that holds all-reduces in one branch only (the engine's
    update-or-accumulate ``tf.cond``), ``c`` those outside it (Keras'
    ``fit`` reduces its logged metrics every step under MWMS).
    Only meaningful under MWMS, where every cross-replica sum is a collective
    op; MirroredStrategy on CPU sums local copies with AddN instead.
    """
    import tensorflow as tf

    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        function = mwms_step_function(strategy, model)
        batch = next(iter(strategy.experimental_distribute_dataset(dataset)))
        concrete = function.get_concrete_function(batch)
    else:
        import inspect

        function = inspect.getclosurevars(model.train_function).nonlocals[
            "multi_step_on_iterator"
        ]
        iterator = iter(strategy.experimental_distribute_dataset(dataset))
        concrete = function.get_concrete_function(iterator)
    return split_collectives(concrete.graph.as_graph_def())


def split_collectives(graph_def) -> dict:
    library = {f.signature.name: f for f in graph_def.library.function}
    memo: dict[str, int] = {}

    def calls(node):
        names = []
        for attr in node.attr.values():
            if attr.HasField("func"):
                names.append(attr.func.name)
            names.extend(f.name for f in attr.list.func)
        return [n for n in names if n in library]

    def total(nodes) -> int:
        count = 0
        for node in nodes:
            count += node.op in COLLECTIVE_OPS
            count += sum(function_total(name) for name in calls(node))
        return count

    def function_total(name) -> int:
        if name not in memo:
            memo[name] = 0  # recursion guard
            memo[name] = total(library[name].node_def)
        return memo[name]

    # The engine's conditional: an If whose branches differ in all-reduces.
    found = []

    def search(nodes, outside: int):
        for node in nodes:
            if node.op in ("If", "StatelessIf"):
                then = function_total(node.attr["then_branch"].func.name)
                other = function_total(node.attr["else_branch"].func.name)
                if then != other:
                    found.append((then, other))
                    continue
            for name in calls(node):
                search(library[name].node_def, outside)

    search(graph_def.node, 0)
    grand = total(graph_def.node)
    update = sum(t for t, _ in found)
    accumulate = sum(e for _, e in found)
    return {
        "update": update,
        "accumulate": accumulate,
        "other": grand - update - accumulate,
        "conditionals": len(found),
    }


if __name__ == "__main__":
    sys.exit(main())
