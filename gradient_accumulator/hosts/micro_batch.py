"""One micro-batch's forward and backward pass in the model wrapper, written
once for Keras 3 and tf-keras: the loss Keras computes, its denominators,
the :class:`~gradient_accumulator.core.loss_plan.LossPlan` applied to it,
and the gradients the engine takes. Shared by the streaming ``train_step``
(one micro-batch per step) and the in-step loop (one per slice)."""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from gradient_accumulator.core._tf_compat import keras_mask, with_keras_mask
from gradient_accumulator.core.arithmetic import overwritten
from gradient_accumulator.core.loss_plan import LossPlan, loss_plan
from gradient_accumulator.core.split_gradients import (
    MicroGradients,
    group_weight,
    split_gradients,
)
from gradient_accumulator.core.weighting import at, denominators
from gradient_accumulator.hosts import loss_scale
from gradient_accumulator.hosts.gradient_cache import (
    add_in_place,
    adds_in_place,
    cached_forward,
)


class MicroBatchPass(NamedTuple):
    """What one micro-batch's forward and backward pass produced."""

    grads: list
    variables: list
    y_pred: object
    loss: tf.Tensor
    weight: tf.Tensor  # folded into the differentiated loss
    count: tf.Tensor  # its share of the denominator
    sums: bool  # its loss is a plain sum (one group, not divided)
    samples: tf.Tensor
    grad_weight: tf.Tensor | None  # what the engine weighs grads by, or None
    # Each extra denominator's (grads, weight, count), see Engine.part.
    parts: list
    # A bool tensor: the backward pass overflowed and was redone (or None).
    overflowed: tf.Tensor | None
    # gradient_cache, when its slices' gradients went straight into the
    # accumulator's sums (see hosts.gradient_cache.add_in_place): which
    # variables got one; ``grads`` is then empty. None: ``grads`` holds them.
    added: list[bool] | None = None


def micro_batch_pass(
    model, x, y, sample_weight, opens_step=None, step_samples=None
) -> MicroBatchPass:
    """Forward pass, loss, weight and gradients of one micro-batch of
    ``model`` (a ``ModelHost``). ``opens_step``: for an in-step slice,
    whether it is its step's first (a bool tensor, see :func:`groups_of`);
    ``step_samples``: for a slice, the samples of its whole step."""
    flavour = model._flavour
    # gradient_cache: the whole batch's outputs from slices (one forward
    # pass, before the tape), the loss on them, the weights' gradients from
    # the slices again (as many backward passes as the cached tape is asked).
    cache = None
    if model._accumulation_settings.gradient_cache:
        cache = cached_forward(model, x)
    # Several denominators take more than one backward pass of the tape
    # (the loss terms are known once the first compute_loss built them),
    # and so may an overflow under a loss scale (the plan's retry_scale).
    persistent = (
        cache is not None
        or loss_scale.scaler_of(flavour, model.optimizer) is not None
        or len(flavour.loss_terms(model)) != 1
    )
    with tf.GradientTape(persistent=persistent) as tape:
        samples = batch_size(x)
        if cache is None:
            y_pred = flavour.forward(model, x)
        else:
            y_pred, x, y, sample_weight = cache.loss_inputs(tape, x, y, sample_weight)
        _build_state(model)
        outputs = y_pred if flavour.guards_empty_masks else _dividable(y_pred)
        loss = flavour.compute_loss(model, x, y, outputs, sample_weight)
        own = not flavour.loss_terms(model)
        # A model's own loss follows Keras' convention under a strategy, as
        # Keras' losses do and plain Keras needs: a mean is this replica's
        # share (divided by the replica count), a sum is whole. It is then
        # weighed exactly as a compiled term of that reduction.
        loss = flavour.whole_loss(loss)
        data = (x, y, sample_weight)
        plan = _plan(model, data, y_pred, loss, own, opens_step, step_samples)
        if plan.drops_penalty is not None:
            penalty = tf.add_n([tf.cast(p, loss.dtype) for p in model.losses])
            penalty = flavour.whole_loss(penalty)
            drop = tf.cast(plan.drops_penalty, loss.dtype) * penalty
            if plan.penalty_divisor != 1:
                drop = drop / plan.penalty_divisor
            loss = loss - drop
        objective = loss * tf.cast(plan.loss_weight, loss.dtype)
        objective = flavour.scale_loss(model.optimizer, objective)
    variables = model.trainable_variables
    groups = plan.groups
    added = None
    if cache is not None and adds_in_place(plan, variables):
        found = MicroGradients([], group_weight(groups[0], plan.unscale))
        added = add_in_place(
            model, cache, tape, objective, found.weight, groups[0].count, samples
        )
    else:
        found = split_gradients(
            tape if cache is None else cache.tape(tape),
            objective,
            variables,
            groups,
            outputs=_term_outputs(model, y_pred) if len(groups) > 1 else (),
            unscale=plan.unscale,
            retry_scale=plan.retry_scale,
        )
    return MicroBatchPass(
        grads=found.grads,
        variables=variables,
        y_pred=y_pred,
        loss=loss,
        weight=groups[0].weight,
        count=groups[0].count,
        sums=len(groups) == 1 and groups[0].sums,
        samples=samples,
        grad_weight=found.weight,
        parts=found.parts,
        overflowed=found.overflowed,
        added=added,
    )


def _term_outputs(model, y_pred) -> list:
    """The model output each compiled loss term reads."""
    structure = model._flavour.term_outputs(y_pred)
    return [at(structure, t.path) for t in model._flavour.loss_terms(model)]


def end_micro_step(model, micro: MicroBatchPass):
    """Hands ``micro`` to ``model``'s accumulator, which applies and resets
    at the end of a cycle: its gradients, or, when they are in the sums
    already (``micro.added``), the end of its micro-step."""
    flavour, accumulator = model._flavour, model._accumulator
    on_apply, on_skip = loss_scale.scale_hooks(flavour, model.optimizer)
    apply_fn = model._apply_fn(micro.variables)
    if micro.added is not None:
        # The state changes wait for the micro-batch (see end_micro_step).
        after = [micro.loss]
        accumulator.end_micro_step(
            micro.variables, micro.added, apply_fn, on_apply, on_skip, after=after
        )
        return
    accumulator.step(
        micro.grads,
        micro.variables,
        apply_fn=apply_fn,
        weight=micro.grad_weight,
        count=micro.count,
        samples=micro.samples,
        on_apply=on_apply,
        on_skip=on_skip,
        overflowed=micro.overflowed,
    )


def _build_state(model) -> None:
    """Builds the engine's and the optimizer's variables the first time a
    step is traced (a subclassed model creates its variables in the forward
    pass, just before)."""
    flavour = model._flavour
    if not model._accumulator.built:
        with tf.init_scope(), flavour.state_scope(model):
            model._accumulator.build(model.trainable_variables)
    if flavour.builds_optimizer and not model.optimizer.built:
        # Without a strategy Keras builds the optimizer at its first
        # apply, but the loss scale is read (below) before that.
        with tf.init_scope():
            model.optimizer.build(model.trainable_variables)


def computes_own_loss(model) -> bool:
    """Whether ``model``'s class overrides Keras' ``compute_loss``."""
    return type(model).compute_loss is not model._flavour.keras.Model.compute_loss


def _plan(model, data, y_pred, loss, own, opens_step, step_samples) -> LossPlan:
    """The micro-batch's :class:`LossPlan`, from its Keras' conventions
    (``data``: its ``(x, y, sample_weight)``; ``own``: its loss has no
    compiled term)."""
    flavour = model._flavour
    x = data[0]
    part = None
    if step_samples is not None:
        samples = tf.cast(batch_size(x), tf.float32)
        part = samples / tf.cast(step_samples, tf.float32)
    return loss_plan(
        groups_of(model, data, y_pred, opens_step),
        scale=loss_scale.loss_scale(flavour, model.optimizer),
        overwrites=any(overwritten(v) for v in model.trainable_variables),
        cycle_length=model._accumulator.cycle_length,
        part=part,
        penalty=bool(model.losses) and loss.shape.rank == 0,
        replicas=flavour.replicas(model),
        means_divided=flavour.means_divided,
        own=own,
    )


def groups_of(model, data, y_pred, opens_step=None):
    """The micro-batch's loss terms by denominator, with its weight and
    count in each (see ``weighting.denominators``; ``data``: its ``(x, y,
    sample_weight)``). A micro-batch opens its cycle if the cycle is still
    empty and, for an in-step slice, if it is its step's first
    (``opens_step``, a bool tensor): later slices of the step do not
    advance the counter."""
    flavour = model._flavour
    x, y, sample_weight = data
    terms = flavour.loss_terms(model)
    declared = model._accumulation_settings.loss_denominator
    if terms and declared is not None:
        raise ValueError(
            f"`loss_denominator={declared!r}` declares what a model's own "
            "`compute_loss` divides by, but this model has a compiled loss, "
            "whose reduction gives the denominator. Leave `loss_denominator` "
            "unset, or compile without a loss."
        )
    if callable(declared):
        declared = declared(x, y, sample_weight)

    def opens():
        opens = model._accumulator.opens_cycle()
        if opens_step is not None:
            opens = tf.logical_and(opens, opens_step)
        return opens

    return denominators(
        terms,
        flavour.term_outputs(y_pred),
        # Only the "mean_with_sample_weight" reduction reads them.
        sample_weight if flavour.merge_mask is not None else None,
        batch_size(x),
        opens,
        merge_mask=flavour.merge_mask,
        own=declared,
    )


def _dividable(y_pred):
    """``y_pred`` with every mask that holds no unmasked entry replaced by
    ones.

    tf-keras' masked mean divides by the number of unmasked entries without
    guarding 0 (Keras 3 guards it), so a micro-batch of padding alone has a
    NaN loss, and weight 0 times NaN is NaN: the finite check would then
    drop its whole cycle. Its weight and count (:func:`groups_of`) come
    from the real mask, 0, so the finite mean taken instead adds nothing,
    as the padding adds nothing to the big batch's mean.
    """

    def dividable(output):
        mask = keras_mask(output)
        if mask is None:
            return output
        some = tf.reduce_any(tf.cast(mask, tf.bool))
        return with_keras_mask(output, tf.where(some, mask, tf.ones_like(mask)))

    return tf.nest.map_structure(dividable, y_pred)


def first(x):
    """The first tensor of the structure ``x``."""
    return next(t for t in tf.nest.flatten(x) if t is not None)


def batch_size(x):
    """The number of samples of ``x`` (a tensor)."""
    return tf.shape(first(x))[0]
