"""Why a layer cannot match big-batch training: the causes ``verify``
(``hosts/equivalence.py``) names in its report, written once for Keras 3
and tf-keras (TensorFlow Model Optimization's layers exist only under
tf-keras; the flavour tells them)."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from gradient_accumulator.hosts.flavour import Flavour

BATCH_NORM = (
    "the forward pass normalises with each micro-batch's "
    "statistics, and the moving statistics update once per micro-batch.\n"
    "    Fix: use gradient_accumulator.AccumBatchNormalization in its place\n"
    "    (replace_batchnorm_layers(model) converts a model): it updates the\n"
    "    moving statistics once per update, with the big batch's. Training\n"
    "    still normalises per micro-batch (docs/batch-norm.md); for exact\n"
    "    gradients use LayerNormalization or GroupNormalization."
)
ACCUM_BATCH_NORM = (
    "the forward pass normalises with each micro-batch's statistics "
    "(AccumBatchNormalization makes the moving statistics the big batch's, not "
    "the gradients); LayerNormalization or GroupNormalization are exact"
)
RANDOM = "randomness: it draws random numbers per call, so one big batch and {k} "
RANDOM += "micro-batches draw different ones"
STATEFUL = "non-trainable state updated per call ({k} times per update, not once)"
HIDDEN = (
    "state that get_weights() leaves out ({names}) changed during training: "
    "it advances per call ({k} times per update, not once)"
)
PRUNING = (
    "TensorFlow Model Optimization's pruning step advanced per micro-batch "
    "(to {ours}; the big batch's: {big}), so its pruning schedule runs {k} "
    "times too fast (masks updated at other steps, with other sparsities).\n"
    "    Fix: train with gradient_accumulator.PruningStepPerUpdate() in place\n"
    "    of UpdatePruningStep(): it sets the step to the optimizer updates\n"
    "    applied, and the masks and weights are the big batch's."
)
QUANTIZATION = (
    "quantization-aware training (TensorFlow Model Optimization): its "
    "quantizers' ranges move per forward pass ({k} times per update, as "
    "BatchNormalization's moving statistics) and each micro-batch is "
    "quantized with its own ranges, not the big batch's: not exact"
)
IN_BATCH = (
    "in-batch negatives: its output has the batch's size on axis 1 (each "
    "sample scored against the batch's own candidates), so each micro-batch "
    "sees only its own {m} candidates, not the big batch's {big}: not exact "
    "(the loss couples the samples of a batch)"
)


def own_causes(
    flavour: Flavour, layer: Any, stateful: set[int], accum_steps: int
) -> list[str]:
    """Reasons why ``layer`` (or a layer nested in it) cannot match."""
    causes = []
    for sub in flavour.sublayers(layer):
        prefix = "" if sub is layer else f"nested {sub.name} ({type(sub).__name__}): "
        optimization = flavour.model_optimization(sub)
        if optimization is not None:
            if optimization[0] == "quantization":
                causes.append(prefix + QUANTIZATION.format(k=accum_steps))
            # A pruning wrapper's cause is its step: see state_causes.
        elif isinstance(sub, flavour.public("AccumBatchNormalization")):
            causes.append(prefix + ACCUM_BATCH_NORM)
        elif isinstance(sub, flavour.batch_norms):
            causes.append(prefix + BATCH_NORM)
        elif flavour.draws_random(sub):
            causes.append(prefix + RANDOM.format(k=accum_steps))
        elif any(id(w) in stateful for w in sub.non_trainable_weights):
            causes.append(prefix + STATEFUL.format(k=accum_steps))
    return causes


def state_causes(
    flavour: Flavour,
    reference: Any,
    accumulated: Any,
    hidden_names: list[str],
    accum_steps: int,
) -> list[str]:
    """Reasons found in the state a layer keeps outside its weights, once
    both runs trained: a TensorFlow Model Optimization pruning wrapper's step
    that differs between the runs; else the names of such state that
    changed (which a TF-MOT layer's own cause explains)."""
    causes, optimized = [], False
    pairs = zip(flavour.sublayers(reference), flavour.sublayers(accumulated))
    for big_layer, ours_layer in pairs:
        found = flavour.model_optimization(big_layer)
        if found is None:
            continue
        optimized = True
        if found[0] != "pruning":
            continue
        big = int(found[1].numpy())
        ours = int(flavour.model_optimization(ours_layer)[1].numpy())
        if ours != big:
            prefix = (
                ""
                if big_layer is reference
                else f"nested {big_layer.name} ({type(big_layer).__name__}): "
            )
            causes.append(prefix + PRUNING.format(ours=ours, big=big, k=accum_steps))
    if hidden_names and not optimized:
        causes.append(HIDDEN.format(names=", ".join(hidden_names), k=accum_steps))
    return causes


def in_batch_layer(flavour: Flavour, model: Any, x: Any) -> str | None:
    """The name of the first layer of ``model`` whose output has the batch's
    size on axis 1 (scores of each sample against the batch's own samples,
    as retrieval models with in-batch negatives compute), or None. Told
    from the output shapes traced for two batch sizes, so a sequence axis
    (the same length for both) never counts; nothing runs."""
    names, tensors = [], []
    for layer in model.layers:
        if isinstance(layer, flavour.keras.layers.InputLayer):
            continue
        try:
            outputs = tf.nest.flatten(layer.output)
        except (AttributeError, ValueError, RuntimeError):
            continue  # a layer called more than once has no one output
        names += [layer.name] * len(outputs)
        tensors += outputs
    if not tensors:
        return None
    try:
        probe = flavour.keras.Model(model.inputs, tensors)
        shapes = [_traced_shapes(probe, x, n) for n in (2, 3)]
    except Exception:
        # A diagnosis only: a model the probe cannot trace names no cause.
        return None
    for name, two, three in zip(names, *shapes):
        if len(two) >= 2 and (two[1], three[1]) == (2, 3):
            return name
    return None


def _traced_shapes(probe: Any, x: Any, size: int) -> list[tuple]:
    """The static shapes of ``probe``'s outputs, traced (not run) in
    inference for a batch of ``size`` samples shaped as ``x``'s."""
    specs = tf.nest.map_structure(
        lambda a: tf.TensorSpec((size, *np.shape(a)[1:]), np.asarray(a).dtype), x
    )
    function = tf.function(lambda inputs: probe(inputs, training=False))
    outputs = function.get_concrete_function(specs).structured_outputs
    return [tuple(t.shape) for t in tf.nest.flatten(outputs)]
