"""The model wrapper's ``gradient_cache``: one ``fit`` batch's forward and
backward pass run in ``micro_batch_size`` slices (``core/gradient_cache.py``)
around one loss over the whole batch's outputs, written once for both
Kerases. The second forward pass draws the first pass's random numbers
again; what cannot be exact is refused with the reason."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import tensorflow as tf

from gradient_accumulator.core._tf_compat import keras_mask, with_keras_mask
from gradient_accumulator.core.arithmetic import overwritten
from gradient_accumulator.core.gradient_cache import (
    CachedTape,
    add_slices,
    backward_slices,
    forward_slices,
)
from gradient_accumulator.core.loss_plan import LossPlan
from gradient_accumulator.hosts import loss_scale
from gradient_accumulator.hosts.batch_norm import AccumBatchNorm

_WHY = (
    "`gradient_cache=True` computes the loss once on the whole batch's outputs "
    "and runs each slice forward twice"
)


@dataclasses.dataclass(frozen=True)
class CachedForward:
    """The first pass over a batch: its outputs, and what the second pass,
    which back-propagates gradients with respect to them into the weights,
    runs."""

    outputs: object
    variables: list
    forward: Callable[[object], object]  # the model on a slice's rows
    x: object  # the batch
    size: int  # rows a slice
    replay: Callable[[], None]  # the random state back to the first pass's
    gathers: bool  # "global": every replica's outputs and data, gathered

    def loss_inputs(self, tape: tf.GradientTape, x, y, sample_weight) -> tuple:
        """``(y_pred, x, y, sample_weight)`` the loss is computed from, under
        ``tape``, which watches this replica's outputs; gathered over the
        replicas (in replica order, as the global batch was split) when
        ``gathers``: each replica's loss is then the global batch's."""
        flat = tf.nest.flatten(self.outputs)
        tape.watch(flat)
        context = tf.distribute.get_replica_context()
        if not self.gathers or context is None or context.num_replicas_in_sync == 1:
            return self.outputs, x, y, sample_weight

        def gather(t):
            return None if t is None else context.all_gather(t, axis=0)

        whole = [
            gather(t)
            if keras_mask(t) is None
            else with_keras_mask(gather(t), gather(keras_mask(t)))
            for t in flat
        ]
        data = (tf.nest.map_structure(gather, d) for d in (x, y, sample_weight))
        return (tf.nest.pack_sequence_as(self.outputs, whole), *data)

    def tape(self, tape: tf.GradientTape) -> CachedTape:
        """``tape`` (persistent, watching the outputs, on which the loss was
        computed) as the tape of one pass over the whole batch."""
        flat = tf.nest.flatten(self.outputs)
        return CachedTape(tape, flat, self.variables, self._backward)

    def add_gradients(
        self, tape: tf.GradientTape, objective: tf.Tensor, add: Callable
    ) -> list[bool]:
        """The gradient of ``objective`` with respect to ``variables`` that
        :meth:`tape` gives, handed to ``add(grads, whole)`` in parts instead:
        the tape's own (a penalty that reads the weights directly) with
        ``whole`` True, then each slice's with ``whole`` False, so that no sum
        as large as the weights is kept beside the accumulator's. Returns
        which variables got a gradient."""
        flat = tf.nest.flatten(self.outputs)
        found = tape.gradient(objective, [*flat, *self.variables])
        seeds, direct = found[: len(flat)], found[len(flat) :]
        add(direct, True)
        present = [g is not None for g in direct]
        if all(s is None for s in seeds):
            return present
        self.replay()
        through = add_slices(
            self.forward,
            self.x,
            seeds,
            self.size,
            self.variables,
            lambda grads: add(grads, False),
        )
        return [a or b for a, b in zip(present, through)]

    def _backward(self, seeds: list) -> list:
        self.replay()
        return backward_slices(self.forward, self.x, seeds, self.size, self.variables)


def cached_forward(model, x) -> CachedForward:
    """The first pass of ``model`` (a ``ModelHost`` with ``gradient_cache``)
    over the batch ``x``, slice by slice, outside any tape."""
    flavour = model._flavour
    size = model._accumulation_settings.micro_batch_size
    refuse_batch_statistics(model)
    states = flavour.random_states(model)
    if states is None:
        refuse_random_draws(model)
        states = []
    # Read before the first pass draws: the second pass starts from here.
    saved = [tf.identity(state.value) for state in states]

    def forward(rows):
        return flavour.forward(model, rows)

    def replay() -> None:
        for state, value in zip(states, saved):
            state.assign(value)

    outputs = forward_slices(forward, x, size)
    refuse_call_losses(model)
    gathers = model._accumulation_settings.gradient_cache == "global"
    if gathers and loss_scale.scaler_of(flavour, model.optimizer) is not None:
        raise ValueError(
            f'{_WHY}; gradient_cache="global" also gathers every replica\'s '
            "outputs, whose backward pass is a collective, but under a loss "
            "scale (mixed_float16) an overflowing slice is redone inside a "
            "loop that only some replicas may run: not supported. Use "
            "gradient_cache=True (per-replica negatives) or float32."
        )
    variables = model.trainable_variables
    return CachedForward(outputs, variables, forward, x, size, replay, gathers)


def adds_in_place(plan: LossPlan, variables) -> bool:
    """Whether the cached gradients can go straight into the accumulator's
    sums, slice by slice (:func:`add_in_place`): one loss denominator, no
    backward pass redone at a smaller loss scale, no overwritten (float8)
    variable. Otherwise the slices are summed first (``CachedForward.tape``)
    and the sum goes the way of any micro-batch's gradients."""
    return (
        len(plan.groups) == 1
        and plan.retry_scale is None
        and not any(overwritten(v) for v in variables)
    )


def add_in_place(
    model, cache: CachedForward, tape, objective, weight, count, samples
) -> list[bool]:
    """Adds the cached batch's gradients (see ``CachedForward.add_gradients``)
    to ``model``'s accumulator: ``weight`` on every part, ``count`` and
    ``samples`` once. Returns which variables got a gradient."""
    accumulator = model._accumulator
    variables = cache.variables
    # After the batch is read: Keras ends an epoch of unknown length by
    # calling the step on an exhausted iterator (see Engine.end_micro_step).
    with tf.control_dependencies([objective]):
        accumulator.open_sums(variables)

    def add(grads: list, whole: bool) -> None:
        accumulator.add(
            grads,
            variables,
            weight=weight,
            count=count if whole else 0.0,
            samples=samples if whole else None,
            empty=False,
        )

    return cache.add_gradients(tape, objective, add)


def refuse_batch_statistics(model) -> None:
    """BatchNormalization in training normalises each slice by the slice's
    own statistics: the outputs are not the whole batch's."""
    flavour = model._flavour
    kinds = (flavour.keras.layers.BatchNormalization, AccumBatchNorm)
    found = [
        layer.name
        for layer in flavour.sublayers(model)[1:]
        if isinstance(layer, kinds) and layer.trainable
    ]
    if found:
        raise ValueError(
            f"{_WHY}, but BatchNormalization layers {found} normalise each "
            "slice by its own mean and variance, not the whole batch's: the "
            "outputs, and so the gradient, would differ from the big batch's. "
            "Use LayerNormalization or GroupNormalization (per sample), freeze "
            "these layers (layer.trainable = False), or train without "
            "gradient_cache."
        )


def refuse_random_draws(model) -> None:
    """Layers whose random draws this Keras cannot replay."""
    flavour = model._flavour
    found = [
        layer.name
        for layer in flavour.sublayers(model)[1:]
        if flavour.draws_random(layer)
    ]
    if found:
        raise ValueError(
            f"{_WHY}, and both passes must draw the same random numbers, but "
            f"layers {found} draw theirs from {flavour.name}'s stateful random "
            "ops, which cannot be replayed: the second pass would use other "
            "masks and the gradient would not be the first pass's. Remove "
            "them (or set their rate to 0), or use Keras 3, whose seed "
            "generators gradient_cache replays."
        )


def refuse_call_losses(model) -> None:
    """Losses added inside the model's call read intermediate layers,
    which the loss over the outputs cannot differentiate."""
    if model._flavour.call_losses(model):
        raise ValueError(
            f"{_WHY}, so its gradient reaches the weights through the outputs "
            "only, but the model adds losses in its call (add_loss, or an "
            "activity_regularizer) that read intermediate layers. Compute "
            "such a loss from the model's outputs in compute_loss, or train "
            "without gradient_cache."
        )
