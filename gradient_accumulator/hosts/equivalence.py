"""What ``verify`` does, written once for Keras 3 and tf-keras: train a model
two ways from the same initial weights on the same samples in the same order
(plain Keras with the big batch, ``micro_batch_size * accum_steps``, and the
model wrapper with the micro-batch) and compare every variable, layer by
layer. The report it returns is ``hosts/verify_report.py``'s."""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from gradient_accumulator._which_keras import other_keras
from gradient_accumulator.core.validation import (
    check_accum_steps,
    check_bool,
    check_positive_float,
)
from gradient_accumulator.hosts import causes as known
from gradient_accumulator.hosts.flavour import Flavour
from gradient_accumulator.hosts.optimizer import OptimizerHost
from gradient_accumulator.hosts.verify_report import (
    UNEXPLAINED,
    LayerCheck,
    VariableCheck,
    VerifyReport,
)

__all__ = ["Options", "check_model_fn", "run"]

_DOWNSTREAM = "follows from {causes}"


@dataclass(frozen=True)
class Options:
    """The checked keyword arguments of ``verify``, with their defaults."""

    micro_batch_size: int = 8
    accum_steps: int = 4
    optimizer: Any = None
    loss: Any = None
    steps: int = 3
    tolerance: float = 1e-4
    seed: int = 0
    callbacks: Any = None
    gradient_cache: bool = False

    def __post_init__(self):
        set_checked = functools.partial(object.__setattr__, self)
        check_bool("gradient_cache", self.gradient_cache)
        for name in ("micro_batch_size", "accum_steps", "steps"):
            set_checked(name, check_accum_steps(getattr(self, name), name))
        set_checked("tolerance", check_positive_float("tolerance", self.tolerance))
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"`seed` must be an integer. Received: seed={seed!r}.")
        if self.callbacks is not None and not callable(self.callbacks):
            raise TypeError(
                "`callbacks` must be None or a function returning a new list of "
                "callbacks (called once per run: a callback belongs to one "
                f"model). Received: callbacks={self.callbacks!r}."
            )


def check_model_fn(flavour: Flavour, model_fn) -> None:
    """Refuses a ``model_fn`` that is not a function building a model (a
    model itself, most often), saying how to pass one."""
    if isinstance(model_fn, flavour.keras.Model) or not callable(model_fn):
        # A model is callable too, but on inputs: say what was passed.
        given = (
            f"a {type(model_fn).__name__} instance ({model_fn.name!r})"
            if isinstance(model_fn, flavour.keras.Model)
            else f"model_fn={model_fn!r}"
        )
        raise TypeError(
            f"`model_fn` must be a function that builds and returns a new "
            f"{flavour.name}.Model (verify calls it twice, for two models "
            f"with the same architecture). Received {given}. For a model you "
            f"have, pass `lambda: {flavour.name}.models.clone_model(model)` "
            "(and `loss=`, `optimizer=` if it is compiled)."
        )


def run(
    flavour: Flavour,
    wrapper: type,
    model_fn: Callable[[], Any],
    x: Any,
    y: Any,
    checked: Options,
) -> VerifyReport:
    """``verify(model_fn, x, y, ...)`` for ``flavour``'s Keras, whose
    ``GradientAccumulateModel`` is ``wrapper``, with its checked keyword
    arguments (see ``hosts/public.py``)."""
    big = checked.micro_batch_size * checked.accum_steps
    needed = big * checked.steps
    x = _take(x, "x", needed)
    y = _take(y, "y", needed)

    flavour.keras.utils.set_random_seed(int(checked.seed))
    source = _build(flavour, model_fn)
    optimizer = _optimizer_spec(flavour, checked.optimizer, source)
    loss = _loss_spec(checked.loss, source)
    # Both runs are plain functional models over the same graph, so their
    # layers line up one to one (a Sequential model hides its InputLayer; a
    # GradientAccumulateModel from model_fn would accumulate in the reference).
    reference = flavour.keras.Model(source.inputs, source.outputs)
    flavour.keras.utils.set_random_seed(int(checked.seed))
    template = _build(flavour, model_fn)
    _check_independent(source, template)
    # gradient_cache: each fit batch is the big batch, in micro-batch slices.
    cache = checked.gradient_cache
    settings = {"micro_batch_size": checked.micro_batch_size, "gradient_cache": True}
    accumulated = wrapper(
        **(settings if cache else {"accum_steps": checked.accum_steps}),
        inputs=template.inputs,
        outputs=template.outputs,
    )
    _check_same_architecture(reference, accumulated)
    for src, dst in zip(reference.layers, accumulated.layers):
        dst.set_weights(src.get_weights())

    initial = [[np.array(w) for w in layer.get_weights()] for layer in reference.layers]
    hidden = [_hidden_state(flavour, layer) for layer in reference.layers]
    reference.compile(optimizer=_new_optimizer(flavour, optimizer), loss=loss)
    accumulated.compile(optimizer=_new_optimizer(flavour, optimizer), loss=loss)
    _train(reference, x, y, big, checked, "plain, big batch")
    _train(
        accumulated,
        x,
        y,
        big if cache else checked.micro_batch_size,
        checked,
        "accumulated",
    )
    found_after = []
    for big_layer, ours_layer, found in zip(
        reference.layers, accumulated.layers, hidden
    ):
        changed = [name for name, variable, start in found if _changed(variable, start)]
        found_after.append(
            known.state_causes(
                flavour, big_layer, ours_layer, changed, checked.accum_steps
            )
        )
    in_batch = known.in_batch_layer(flavour, reference, x)
    sparse = known.sparse_rows_causes(
        flavour,
        reference,
        _take(x, "x", big),
        lambda: _new_optimizer(flavour, optimizer),
    )
    for layer, causes in zip(reference.layers, found_after):
        if layer.name == in_batch and not cache:
            causes.append(known.IN_BATCH.format(m=checked.micro_batch_size, big=big))
        if layer.name in sparse:
            causes.append(sparse[layer.name])
    return _report(flavour, reference, accumulated, initial, checked, found_after)


def _train(model: Any, x: Any, y: Any, batch_size: int, options, run: str) -> None:
    callbacks = None if options.callbacks is None else list(options.callbacks())
    try:
        model.fit(
            x,
            y,
            batch_size=batch_size,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )
    except Exception as error:
        hint = (
            " verify trains with `fit` and the callbacks that `callbacks()` "
            "returns (none given): a layer that needs a callback while "
            "training (TensorFlow Model Optimization's pruning wrapper needs "
            "PruningStepPerUpdate) needs `callbacks=lambda: [...]`."
            if callbacks is None
            else ""
        )
        raise RuntimeError(
            f"verify: training the {run} run (batch_size={batch_size}) "
            f"failed: {type(error).__name__}: {error}{hint}"
        ) from error


# ------------------------------------------------------------------ helpers
def _take(data: Any, name: str, needed: int) -> Any:
    """The first ``needed`` samples of every array in ``data``."""
    leaves = tf.nest.flatten(data)
    if not leaves:
        raise ValueError(f"`{name}` holds no arrays. Received: {name}={data!r}.")
    try:
        arrays = [np.asarray(a) for a in leaves]
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"`{name}` must be an array or a list/dict of arrays: {e}"
        ) from None
    sizes = {a.shape[0] if a.ndim else 0 for a in arrays}
    if len(sizes) != 1:
        raise ValueError(
            f"`{name}`: all arrays must have the same number of samples. "
            f"Received sizes {sorted(sizes)}."
        )
    (size,) = sizes
    if size < needed:
        raise ValueError(
            f"`{name}` has {size} samples; micro_batch_size * accum_steps * "
            f"steps = {needed} are needed."
        )
    return tf.nest.pack_sequence_as(data, [a[:needed] for a in arrays])


def _build(flavour: Flavour, model_fn: Callable[[], Any]) -> Any:
    model = model_fn()
    if not isinstance(model, flavour.keras.Model):
        raise TypeError(
            f"`model_fn` must return a {flavour.name}.Model. Received: "
            f"{type(model).__name__}. "
            + other_keras(model, flavour.name, "The model it returned")
        )
    if not getattr(model, "inputs", None) or not getattr(model, "outputs", None):
        raise ValueError(
            "`model_fn` must return a functional or Sequential model with "
            f"symbolic inputs (built from {flavour.name}.Input): verify "
            "rebuilds it as GradientAccumulateModel(inputs=model.inputs, "
            "outputs=model.outputs). Subclassed models have none."
        )
    return model


def _check_independent(first: Any, second: Any) -> None:
    """Refuses two builds that share variables: both runs would train the
    same layers (and compare them with themselves)."""
    held = {id(known.tf_variable(w)) for w in first.weights}
    shared = [w for w in second.weights if id(known.tf_variable(w)) in held]
    if second is first or shared:
        given = (
            "the same model twice (as `lambda: model` returns)"
            if second is first
            else f"two models sharing {len(shared)} variable(s) (as models "
            "built over one model's layers are)"
        )
        raise ValueError(
            "`model_fn` must build a new model on every call: verify trains "
            "two models from the same initial weights, and a model (or layer) "
            f"returned again would train in both runs. Received {given}. "
            "Write a function that creates new "
            "layers (`def build(): inputs = keras.Input(...); ...; return "
            "keras.Model(inputs, outputs)`), or for a model you have pass "
            "`lambda: keras.models.clone_model(model)`."
        )


def _optimizer_spec(flavour: Flavour, optimizer: Any, model: Any) -> Any:
    accumulating = OptimizerHost
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None)
        if optimizer is None:
            return "sgd"
        if isinstance(optimizer, accumulating):
            return optimizer.inner_optimizer
    if isinstance(optimizer, accumulating):
        raise TypeError(
            "`optimizer` must be the optimizer without accumulation: verify "
            "compares it with and without GradientAccumulateModel. Received: "
            f"optimizer={optimizer!r}."
        )
    if isinstance(optimizer, (str, *flavour.optimizers)):
        return optimizer
    raise TypeError(
        "`optimizer` must be a Keras optimizer name or instance. "
        f"Received: optimizer={optimizer!r}."
    )


def _new_optimizer(flavour: Flavour, spec: Any) -> Any:
    """A fresh optimizer per run: the two runs must not share its state."""
    if isinstance(spec, str):
        return flavour.keras.optimizers.get(spec)
    return flavour.copy_optimizer(spec)


def _loss_spec(loss: Any, model: Any) -> Any:
    if loss is None:
        loss = getattr(model, "loss", None)
        if loss is None:
            raise ValueError(
                "`loss` is required when `model_fn` returns an uncompiled "
                "model. Received: loss=None."
            )
    return loss


def _check_same_architecture(a: Any, b: Any) -> None:
    shapes_a = [[tuple(w.shape) for w in x.weights] for x in a.layers]
    shapes_b = [[tuple(w.shape) for w in x.weights] for x in b.layers]
    if shapes_a != shapes_b:
        raise ValueError(
            "`model_fn` must build the same architecture on every call: the "
            "two models it returned have different layers or weight shapes."
        )


def _hidden_state(flavour: Flavour, layer: Any) -> list[tuple[str, Any, np.ndarray]]:
    """``(name, variable, value now)`` of every TensorFlow variable that
    ``layer`` or a layer nested in it holds outside its weights (TensorFlow
    Model Optimization's pruning wrapper keeps its step and masks so)."""
    layers = flavour.sublayers(layer)
    # A layer may hold variables in `weights` that `get_weights()` leaves
    # out (the pruning wrapper: its own after the wrapped layer's).
    held = [
        (w, i < len(sub.get_weights()))
        for sub in layers
        for i, w in enumerate(sub.weights)
    ]
    weights_ids = {id(known.tf_variable(w)) for w, covered in held if covered}
    seen = {id(sub) for sub in layers}
    found: dict[int, tuple[str, Any]] = {}
    for variable, covered in held:
        if not covered and id(known.tf_variable(variable)) not in weights_ids:
            found[id(known.tf_variable(variable))] = (
                _short_name(variable),
                known.tf_variable(variable),
            )

    def visit(value: Any, name: str, depth: int) -> None:
        if id(value) in seen or depth > 3:
            return
        seen.add(id(value))
        if isinstance(value, tf.Variable):
            if id(value) not in weights_ids:
                found.setdefault(id(value), (_short_name(value), value))
            return
        if isinstance(value, str | bytes | numbers.Number | np.ndarray | tf.Tensor):
            return
        if hasattr(value, "weights") and hasattr(value, "call"):
            return  # another layer: its own weights, walked if nested
        if isinstance(value, dict):
            items = list(value.items())
        elif isinstance(value, list | tuple):
            items = list(enumerate(value))
        elif hasattr(value, "__dict__"):
            items = list(vars(value).items())
        else:
            return
        for key, item in items:
            visit(item, f"{name}.{key}", depth + 1)

    for sub in layers:
        for key, item in vars(sub).items():
            if not key.startswith(("_inbound", "_outbound")):
                visit(item, key, 0)
    return [(name, v, np.array(v.numpy())) for name, v in found.values()]


def _short_name(variable: Any) -> str:
    return variable.name.split("/")[-1].split(":")[0]


def _changed(variable: Any, start: np.ndarray) -> bool:
    return not np.array_equal(np.asarray(variable.numpy()), start)


def _compare(
    flavour: Flavour,
    reference: Any,
    accumulated: Any,
    initial: Sequence[Sequence[np.ndarray]],
    tolerance: float,
) -> tuple[list[list[VariableCheck]], float, set[int]]:
    """Every variable's check, layer by layer; how far training moved the
    trainable ones; the ids of the non-trainable ones it changed."""
    stateful = set()
    checks: list[list[VariableCheck]] = []
    moved = 0.0
    for layer, other, start in zip(reference.layers, accumulated.layers, initial):
        variables = []
        for var, w0, w_acc in zip(layer.weights, start, other.get_weights()):
            # float64: AccumBatchNormalization also holds a boolean flag.
            w_big = np.asarray(var, dtype=np.float64)
            change = _max_abs(w_big - np.asarray(w0, dtype=np.float64))
            diff = _max_abs(np.asarray(w_acc, dtype=np.float64) - w_big)
            if var.trainable:
                moved = max(moved, change)
            elif change > 0:
                stateful.add(id(var))
            variables.append(
                VariableCheck(
                    name=flavour.variable_name(var),
                    shape=tuple(var.shape),
                    trainable=bool(var.trainable),
                    max_abs_diff=diff,
                    moved=change,
                    ok=bool(diff <= tolerance),  # False for NaN
                )
            )
        checks.append(variables)
    return checks, moved, stateful


def _report(
    flavour: Flavour,
    reference: Any,
    accumulated: Any,
    initial: Sequence[Sequence[np.ndarray]],
    options: Options,
    found_after: Sequence[Sequence[str]],
) -> VerifyReport:
    tolerance, accum_steps = options.tolerance, options.accum_steps
    checks, moved, stateful = _compare(
        flavour, reference, accumulated, initial, tolerance
    )
    differs = any(not v.ok for vs in checks for v in vs)
    own = [
        known.own_causes(flavour, x, stateful, accum_steps) + list(after)
        for x, after in zip(reference.layers, found_after)
    ]
    culprits = [layer.name for layer, causes in zip(reference.layers, own) if causes]
    layers = []
    for layer, variables, causes in zip(reference.layers, checks, own):
        if isinstance(layer, flavour.keras.layers.InputLayer):
            continue
        # A layer without variables fails when it explains a failure.
        ok = all(v.ok for v in variables) if variables else not (differs and causes)
        if ok:
            reason = None
        elif causes:
            reason = "; ".join(causes)
        elif culprits:
            reason = _DOWNSTREAM.format(causes=", ".join(culprits))
        else:
            reason = UNEXPLAINED
        layers.append(
            LayerCheck(
                name=layer.name,
                class_name=type(layer).__name__,
                variables=variables,
                ok=ok,
                reason=reason,
                breaks_equivalence=bool(causes) and not ok,
            )
        )
    notes = []
    if moved <= tolerance:
        notes.append(
            f"Training moved no trainable weight by more than the tolerance "
            f"({moved:.2e} <= {tolerance:g}): the comparison proves nothing; "
            "raise `steps` or the learning rate."
        )
    return VerifyReport(
        layers=layers,
        tolerance=tolerance,
        micro_batch_size=options.micro_batch_size,
        accum_steps=accum_steps,
        steps=options.steps,
        moved=moved,
        notes=notes,
    )


def _max_abs(a: np.ndarray) -> float:
    return float(np.max(np.abs(a))) if a.size else 0.0
