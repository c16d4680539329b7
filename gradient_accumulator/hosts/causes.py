"""Why a layer cannot match big-batch training: the causes ``verify``
(``hosts/equivalence.py``) names in its report, written once for Keras 3
and tf-keras (TensorFlow Model Optimization's layers exist only under
tf-keras; the flavour tells them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from gradient_accumulator.hosts.batch_norm import AccumBatchNorm
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
    "with accum_steps (the loss couples the samples of a batch). Exact: "
    "GradientAccumulateModel(micro_batch_size={m}, gradient_cache=True) fed "
    "batches of {big} (check it: verify(..., gradient_cache=True); see "
    "docs/gradient-cache.md)"
)

SPARSE_ROWS = (
    "sparse rows: the big batch's {optimizer} takes this layer's sparse "
    "gradient (IndexedSlices) row by row, and {repeated} of the {rows} rows "
    "one big batch gathers occur more than once (a padding or frequent "
    "token): {optimizer} updates with each occurrence apart (Adam's second "
    "moment: the sum of their squares, not the square of their sum), while "
    "accumulation sums the micro-batches' gradients first and applies them "
    "dense. The accumulated run is the mathematically dense one: it equals "
    "the big batch with its gradient made dense (SGD, with or without "
    'momentum, gives both the same). See docs/verify.md, "Sparse rows"'
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
        elif isinstance(sub, AccumBatchNorm):
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
    except (ValueError, TypeError, NotImplementedError, tf.errors.OpError):
        # A diagnosis only: outputs that make no model (a disconnected graph,
        # a layer's own input) or a model that cannot be traced for other
        # batch sizes (a fixed batch dimension) name no cause. Any other
        # error is a fault and is raised.
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


def sparse_rows_causes(
    flavour: Flavour, model: Any, x: Any, new_optimizer: Callable[[], Any]
) -> dict[str, str]:
    """``{layer name: cause}`` for the layers of ``model`` with a sparse
    gradient whose rows repeat in the big batch ``x``, when an optimizer
    from ``new_optimizer`` does not take repeated rows as their sum."""
    repeated = repeated_sparse_rows(model, x)
    if not repeated or sums_repeated_rows(flavour, new_optimizer):
        return {}
    causes, name = {}, type(new_optimizer()).__name__
    for layer in model.layers:
        found = [repeated.get(id(tf_variable(w))) for w in layer.trainable_weights]
        found = [counts for counts in found if counts is not None]
        if found:
            causes[layer.name] = SPARSE_ROWS.format(
                optimizer=name,
                repeated=found[0][0],
                rows=found[0][1],
            )
    return causes


def repeated_sparse_rows(model: Any, x: Any) -> dict[int, tuple[int, int]]:
    """``{id(variable): (repeated, rows)}`` for each trainable variable of
    ``model`` whose gradient on the batch ``x`` is sparse (an
    ``IndexedSlices``, as an embedding's) and holds a row more than once
    with a non-zero value (a masked token's rows are zero: they change
    nothing). Runs ``model`` once in inference, with the sum of its float
    outputs as the loss: which rows a gradient holds does not depend on the
    loss."""
    variables = model.trainable_variables
    if len(model.inputs) == 1 and not isinstance(x, list | tuple | dict):
        x = [x]  # the structure the model was built with (no Keras warning)
    with tf.GradientTape() as tape:
        outputs = tf.nest.flatten(model(x, training=False))
        sums = [tf.reduce_sum(o) for o in outputs if o.dtype.is_floating]
        total = tf.add_n([tf.cast(t, tf.float32) for t in sums]) if sums else None
    if total is None:
        return {}  # no output a gradient flows to
    found = {}
    for variable, gradient in zip(variables, tape.gradient(total, variables)):
        if not isinstance(gradient, tf.IndexedSlices):
            continue
        values = gradient.values.numpy().reshape(len(gradient.indices), -1)
        indices = gradient.indices.numpy()[np.any(values != 0, axis=1)]
        rows, counts = np.unique(indices, return_counts=True)
        if np.any(counts > 1):
            found[id(tf_variable(variable))] = (int(np.sum(counts > 1)), len(rows))
    return found


def sums_repeated_rows(flavour: Flavour, new_optimizer: Callable[[], Any]) -> bool:
    """Whether an optimizer from ``new_optimizer`` applies a sparse gradient
    that holds a row twice as it applies the dense sum of the two (SGD does;
    Keras 3's Adam and any norm clipping do not; tf-keras' optimizers add
    repeated rows up first). Told by applying both, once, to two zeroed
    embedding tables."""
    tables = []
    for gradient in (
        tf.IndexedSlices(tf.ones((2, 1)), tf.constant([0, 0]), tf.constant([2, 1])),
        tf.constant([[2.0], [0.0]]),
    ):
        layer = flavour.keras.layers.Embedding(2, 1, embeddings_initializer="zeros")
        layer.build((None,))
        new_optimizer().apply_gradients([(gradient, layer.embeddings)])
        tables.append(np.asarray(layer.embeddings)[0])
    return bool(np.allclose(*tables, rtol=1e-6, atol=0.0))


def tf_variable(variable: Any) -> Any:
    """The TensorFlow variable behind a Keras 3 variable (tf-keras' are)."""
    return variable if isinstance(variable, tf.Variable) else variable.value
