"""Worker ``--index I`` of a two-worker ``MultiWorkerMirroredStrategy`` on
127.0.0.1 (``--ports P0,P1``), for ``tests/keras2/test_multi_worker.py``.

Run from the repository root as ``python -m tests.keras2.mwms_worker``, with
tf-keras (``TF_USE_LEGACY_KERAS=1``, set here before TensorFlow loads) on
the CPU, one replica per worker. Every case trains with ``model.fit`` (graph
mode) under the strategy:

* ``CASES``: a wrapper (the model, or the optimizer around a tf-keras
  optimizer, current or legacy) on global micro-batches of ``MICRO`` per
  worker, ``K`` per update;
* ``plain_<kind>``: plain tf-keras under the strategy on the global big batch
  ``K * MICRO * 2`` (its all-reduces are the count to compare with);
* ``single_<kind>``: the reference, plain tf-keras on one device (no
  strategy) on the same big batch.

Each worker writes ``DIR/w<I>/<case>.npz`` (initial and final weights, as
``tests/dist_utils.load`` reads them) and ``<case>.json`` (optimizer
updates, and the CollectiveReduce* ops of the traced train function, split
as ``tests/dist_worker.split_collectives`` splits them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from pathlib import Path

WORKERS = 2
MICRO = 4  # per-worker micro-batch
K = 4  # accumulation steps
BIG = K * MICRO * WORKERS  # the global big batch: 32
N = 64  # samples: 2 updates per epoch
EPOCHS = 2
COLLECTIVE_TIMEOUT = 60  # s: a worker whose peer died fails instead of hanging

# (wrapper, inner optimizer of ``utils.MOMENTUM_AND_ADAM``): each wrapper
# with a current and a legacy one. Plain tf-keras runs with all four.
CASES = (
    ("model", "sgd_momentum"),
    ("model", "legacy_adam"),
    ("optimizer", "adam"),
    ("optimizer", "legacy_sgd_momentum"),
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--ports", required=True)
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def setup(args) -> None:
    """Environment of this worker; must run before TensorFlow loads."""
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
    os.environ["TF_CONFIG"] = json.dumps(
        {
            "cluster": {"worker": [f"127.0.0.1:{p}" for p in args.ports.split(",")]},
            "task": {"type": "worker", "index": args.index},
        }
    )


def dataset(x, y, batch: int):
    """``(x, y)`` in global batches of ``batch``, in order, split between
    the workers batch by batch (every global batch feeds both workers)."""
    import tensorflow as tf

    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    return data.with_options(options)


def train(strategy, case: str, kind: str, x, y) -> tuple[dict, dict]:
    """Builds, compiles and fits one case; returns (arrays, facts)."""
    from gradient_accumulator import (
        GradientAccumulateModel,
        GradientAccumulateOptimizer,
    )
    from tests.dist_worker import _pack
    from tests.keras2 import utils

    with _scope(strategy):
        if case == "model":
            model = utils.seeded(lambda: utils.accumulating_model(accum_steps=K))
            assert isinstance(model, GradientAccumulateModel)
            optimizer = utils.MOMENTUM_AND_ADAM[kind]()
        else:
            model = utils.seeded(utils.plain_model)
            optimizer = utils.MOMENTUM_AND_ADAM[kind]()
            if case == "optimizer":
                optimizer = GradientAccumulateOptimizer(optimizer, accum_steps=K)
        initial = utils.weights(model)
        model.compile(optimizer=optimizer, loss=utils.sparse_ce())
    batch = BIG if case in ("plain", "single") else MICRO * WORKERS
    model.fit(dataset(x, y, batch), epochs=EPOCHS, verbose=0, shuffle=False)
    facts = {"iterations": int(model.optimizer.iterations.numpy())}
    if strategy is not None:
        facts["traces"] = [
            collectives(concrete)
            for concrete in model.train_function._list_all_concrete_functions()
        ]
        facts["params"] = int(model.count_params())
    return {**_pack("init", initial), **_pack("ours", utils.weights(model))}, facts


def collectives(concrete) -> dict:
    """The CollectiveReduce* ops of a traced train function: where they sit
    (``split_collectives``), and the element counts of those in the
    function's own body ("top") and in the functions it calls ("nested")."""
    from tests.dist_worker import COLLECTIVE_OPS, split_collectives

    graph = concrete.graph.as_graph_def(add_shapes=True)
    sizes: dict[str, list[int]] = {"top": [], "nested": []}

    def note(where, nodes):
        for node in nodes:
            if node.op in COLLECTIVE_OPS:
                (shape,) = node.attr["_output_shapes"].list.shape
                sizes[where].append(math.prod(d.size for d in shape.dim))

    note("top", graph.node)
    for function in graph.library.function:
        note("nested", function.node_def)
    return {"split": split_collectives(graph), "sizes": sizes}


def _scope(strategy):
    """``strategy``'s scope; no strategy (the default one) if None."""
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def main(argv=None) -> None:
    args = parse_args(argv)
    setup(args)

    import numpy as np
    import tensorflow as tf

    from tests.keras2 import utils

    assert tf.keras.__name__.startswith("tf_keras"), tf.keras.__name__
    tf.config.experimental.enable_op_determinism()
    # No tf.data autotuning (see tests/death_worker.py): deleting a
    # distributed dataset's per-device iterator waits for its tuning thread.
    tf.data.experimental.enable_debug_mode()
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            timeout_seconds=COLLECTIVE_TIMEOUT
        )
    )
    assert strategy.num_replicas_in_sync == WORKERS, strategy.num_replicas_in_sync
    out = Path(args.out) / f"w{args.index}"
    out.mkdir(parents=True, exist_ok=True)
    x, y = utils.classification_data(N)
    runs = [(wrapper, kind, strategy) for wrapper, kind in CASES]
    runs += [("plain", kind, strategy) for kind in utils.MOMENTUM_AND_ADAM]
    if args.index == 0:  # the reference needs no peer
        runs += [("single", kind, None) for kind in utils.MOMENTUM_AND_ADAM]
    for case, kind, where in runs:
        arrays, facts = train(where, case, kind, x, y)
        np.savez(out / f"{case}_{kind}.npz", **arrays)
        (out / f"{case}_{kind}.json").write_text(json.dumps(facts))
        print(f"{case}_{kind} done", flush=True)
    # TensorFlow's collective runtime can abort in its destructors at
    # interpreter exit after all work is written: skip the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
