"""What a second loss denominator costs: BERT-style MLM + NSP.

One model (embedding, a dense trunk, a token head and a sequence head),
trained by ``GradientAccumulateModel`` three ways on the same data:

* ``one denominator``: both heads averaged over the samples (one gradient
  sum per cycle, the cheapest case);
* ``two denominators``: the token head averaged over its masked positions
  (``reduction="mean_with_sample_weight"``, per-token weights), the
  sequence head over the sequences (a second sum, ``Engine.part``);
* ``keras big batch``: plain Keras on the concatenated batch, for scale.

It prints the accumulation state's size (float32 elements of gradient
sums) and the median time of a ``fit`` epoch over ``--rounds`` interleaved
rounds, each as a ratio to the one-denominator case, and the distance of
the two-denominator run's weights to the big batch's (exactness, for
context). Times are wall-clock on this machine's CPU.

Run:
    python benchmarks/denominators.py            # vocabulary 1000, 4096 sequences
    python benchmarks/denominators.py --quick    # small and fast: a smoke test
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import keras
import numpy as np

from gradient_accumulator import GradientAccumulateModel

VARIANTS = ("one denominator", "two denominators", "keras big batch")


def layers(vocab: int, length: int, width: int):
    tokens = keras.Input((length,), dtype="int32")
    h = keras.layers.Embedding(vocab, width)(tokens)
    h = keras.layers.Dense(width, activation="tanh")(h)
    h = keras.layers.Dense(width, activation="tanh")(h)
    mlm = keras.layers.Dense(vocab, name="mlm")(h)
    nsp = keras.layers.Dense(2, name="nsp")(keras.layers.GlobalAveragePooling1D()(h))
    return tokens, {"mlm": mlm, "nsp": nsp}


def corpus(n: int, vocab: int, length: int):
    rng = np.random.default_rng(0)
    x = rng.integers(1, vocab, size=(n, length)).astype("int32")
    fraction = rng.uniform(0.05, 0.6, size=n)
    masked = (rng.uniform(size=(n, length)) < fraction[:, None]).astype("float32")
    masked[np.arange(n), rng.integers(0, length, size=n)] = 1.0
    y = {
        "mlm": rng.integers(0, vocab, size=(n, length)),
        "nsp": rng.integers(0, 2, size=n),
    }
    return x, y, {"mlm": masked, "nsp": np.ones(n, "float32")}


def losses(variant: str) -> dict:
    ce = keras.losses.SparseCategoricalCrossentropy
    if variant == "one denominator":
        return {"mlm": ce(from_logits=True), "nsp": ce(from_logits=True)}
    return {
        "mlm": ce(from_logits=True, reduction="mean_with_sample_weight"),
        "nsp": ce(from_logits=True),
    }


def build(variant: str, args) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs, outputs = layers(args.vocab, args.length, args.width)
    if variant == "keras big batch":
        model = keras.Model(inputs, outputs)
    else:
        model = GradientAccumulateModel(
            args.accum_steps, inputs=inputs, outputs=outputs
        )
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=losses(variant))
    return model


def epoch(model, variant: str, data, args) -> float:
    x, y, sample_weight = data
    batch = args.micro * (args.accum_steps if variant == "keras big batch" else 1)
    start = time.perf_counter()
    model.fit(
        x, y, sample_weight=sample_weight, batch_size=batch, shuffle=False, verbose=0
    )
    return time.perf_counter() - start


def state_elements(model) -> int:
    if not isinstance(model, GradientAccumulateModel):
        return 0
    engine = model._accumulator
    sums = [*engine.grad_sums, *(b for p in engine.parts for b in p.grad_sums)]
    return sum(int(np.prod(b.shape)) for b in sums)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--accum-steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.vocab, args.length, args.width, args.samples, args.rounds = (
            32,
            10,
            8,
            128,
            1,
        )
    data = corpus(args.samples, args.vocab, args.length)
    models = {v: build(v, args) for v in VARIANTS}
    for variant, model in models.items():
        epoch(model, variant, data, args)  # trace
    times = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant, model in models.items():
            times[variant].append(epoch(model, variant, data, args))

    fresh = {v: build(v, args) for v in ("two denominators", "keras big batch")}
    for variant, model in fresh.items():
        epoch(model, variant, data, args)
    gap = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(
            fresh["two denominators"].get_weights(),
            fresh["keras big batch"].get_weights(),
        )
    )

    base_time = statistics.median(times["one denominator"])
    base_state = state_elements(models["one denominator"])
    weights = models["one denominator"].count_params()
    print(
        f"MLM + NSP: vocabulary {args.vocab}, length {args.length}, width "
        f"{args.width}, {args.samples} sequences, micro-batch {args.micro}, "
        f"accum_steps {args.accum_steps}, {args.rounds} rounds; {weights} weights"
    )
    print("| variant | state (float32) | state / one | epoch s | time / one |")
    print("|---|---|---|---|---|")
    for variant in VARIANTS:
        median = statistics.median(times[variant])
        state = state_elements(models[variant])
        print(
            f"| {variant} | {state} | {state / base_state:.3f}x | {median:.3f} "
            f"| {median / base_time:.3f}x |"
        )
    print(f"two denominators vs keras big batch, one epoch: max |dw| = {gap:.2e}")


if __name__ == "__main__":
    main()
