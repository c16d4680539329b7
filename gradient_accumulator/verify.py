"""``verify``: does accumulation reproduce big-batch training on *your* model?

Trains the model two ways from the same initial weights on the same samples in
the same order — plain Keras with the big batch
(``micro_batch_size * accum_steps``) and ``GradientAccumulateModel`` with the
micro-batch — and compares every variable, layer by layer
(``gradient_accumulator.hosts.equivalence`` does it for both Kerases).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from gradient_accumulator.flavour import FLAVOUR
from gradient_accumulator.hosts import equivalence
from gradient_accumulator.hosts.equivalence import (
    LayerCheck,
    VariableCheck,
    VerifyReport,
)

__all__ = ["LayerCheck", "VariableCheck", "VerifyReport", "verify"]


def verify(
    model_fn: Callable[[], keras.Model],
    x: Any,
    y: Any,
    *,
    micro_batch_size: int = 8,
    accum_steps: int = 4,
    optimizer: str | keras.optimizers.Optimizer | None = None,
    loss: Any = None,
    steps: int = 3,
    tolerance: float = 1e-4,
    seed: int = 0,
    callbacks: Callable[[], list] | None = None,
) -> VerifyReport:
    """Checks that ``GradientAccumulateModel`` trains ``model_fn()``'s model
    exactly like plain Keras on the big batch.

    From the same initial weights and on the same samples in the same order,
    trains plain Keras with ``batch_size = micro_batch_size * accum_steps`` and
    ``GradientAccumulateModel(accum_steps=accum_steps)`` with
    ``batch_size = micro_batch_size``, for ``steps`` optimizer updates each,
    then compares every variable of every layer. Layers known to break
    equivalence are named with the reason: ``BatchNormalization`` (micro-batch
    statistics), layers that draw random numbers (``Dropout``, noise,
    augmentation) and layers whose non-trainable state changes per call.

    Calls ``keras.utils.set_random_seed(seed)`` before building each model.
    Differences are smallest with
    ``tf.config.experimental.enable_op_determinism()``.

    Args:
        model_fn: builds a new functional or ``Sequential`` ``keras.Model``,
            compiled or not, with the same architecture on every call; called
            twice. Both runs use ``keras.Model(m.inputs, m.outputs)`` of its
            model, so a ``GradientAccumulateModel`` is also accepted.
        x: inputs, as ``fit`` takes them (an array, or a list or dict of
            arrays) with at least ``micro_batch_size * accum_steps * steps``
            samples; the first ones are used.
        y: targets, like ``x``.
        micro_batch_size: samples per micro-batch, an ``int >= 1``.
        accum_steps: micro-batches per update, an ``int >= 1``.
        optimizer: a Keras optimizer name or instance (copied from its config
            for each run), without accumulation; default: the compiled
            model's optimizer (the wrapped one for a
            ``GradientAccumulateOptimizer``), else ``"sgd"``.
        loss: anything ``compile(loss=...)`` takes; default: the compiled
            model's loss. Required if ``model_fn`` does not compile.
        steps: optimizer updates per run, an ``int >= 1``.
        tolerance: largest absolute difference per variable that passes
            (``> 0``).
        seed: random seed for the initial weights.
        callbacks: None, or a function returning a new list of callbacks
            for each run's ``fit`` (for layers that need one while training,
            such as TensorFlow Model Optimization's ``UpdatePruningStep``).

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is the verdict and
        ``print(report)`` shows the table.

    Raises:
        TypeError: an argument has the wrong type (``model_fn`` a model
            instead of a function that builds one).
        RuntimeError: a training run failed (the message names the run).
        ValueError: an argument is out of range, there are too few samples,
            or ``model_fn`` builds a model without symbolic inputs
            (subclassed).
    """
    options = {
        "micro_batch_size": micro_batch_size,
        "accum_steps": accum_steps,
        "optimizer": optimizer,
        "loss": loss,
        "steps": steps,
        "tolerance": tolerance,
        "seed": seed,
        "callbacks": callbacks,
    }
    return equivalence.run(FLAVOUR, model_fn, x, y, options)
