"""The logic of ``PruningStepPerUpdate``, TensorFlow Model Optimization's
``UpdatePruningStep`` for accumulation: written against the flavour's hooks
(TF-MOT builds on tf-keras, whose flavour gives its names); the public
callback is a thin tf-keras class over it."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from gradient_accumulator.hosts.flavour import Flavour


class PruningStepLogic:
    """``PruningStepPerUpdate``: see the host class for the docs."""

    # The flavour of its Keras: each Keras' public class sets it.
    _flavour: Flavour

    def __init__(self):
        super().__init__()
        flavour = self._flavour
        if flavour.update_pruning_step is None:
            raise ImportError(
                "PruningStepPerUpdate is for tf-keras (TF_USE_LEGACY_KERAS=1), "
                "as TensorFlow Model Optimization is."
            )
        # TF-MOT's own callback does what it does (the step from -1 to 0 at
        # train begin, the weights masked at every epoch's end); this one
        # only sets the step before every batch. Imports TF-MOT.
        self._delegate = flavour.update_pruning_step()
        self._steps: list[Any] = []
        self._sync = None
        self._last_batch: int | None = None

    def set_model(self, model) -> None:
        super().set_model(model)
        self._delegate.set_model(model)

    def set_params(self, params) -> None:
        super().set_params(params)
        self._delegate.set_params(params)

    def on_train_begin(self, logs=None):
        self._delegate.on_train_begin(logs)
        flavour = self._flavour
        self._steps = [
            flavour.model_optimization(layer)[1]
            for layer in flavour.prunable_layers(self._delegate)
        ]
        steps = self._steps

        @tf.function(autograph=False)
        def sync(iterations):
            for step in steps:
                step.assign(tf.cast(iterations, step.dtype))

        self._sync = sync if steps else None

    def on_epoch_begin(self, epoch, logs=None):
        self._last_batch = None

    def on_train_batch_begin(self, batch, logs=None):
        if self._last_batch is not None and batch != self._last_batch + 1:
            # Keras calls back once per execution of several steps: the
            # steps between two calls would each advance the step.
            raise ValueError(
                "PruningStepPerUpdate needs a callback before every batch: "
                "compile the model with steps_per_execution=1 (Keras called "
                f"it at batch {self._last_batch}, then at batch {batch})."
            )
        self._last_batch = batch
        # The wrapper adds one to its step in every training call, then
        # updates its masks when its schedule fires at that step. Set before
        # every batch to the updates applied so far, the step of every
        # micro-batch of a cycle becomes what the big batch's one call makes
        # it (as UpdatePruningStep's 0 at the start of a fresh optimizer).
        # The masks a cycle's micro-batches recompute are the same: the
        # weights do not change within a cycle (the first call's masking
        # only zeroes weights its mask already drops, which keeps the same
        # top magnitudes). A device-side assign: no host read per batch; and
        # no state of its own, so a resumed run (mid-cycle too) stays right.
        if self._sync is not None:
            self._sync(self.model.optimizer.iterations)

    def on_epoch_end(self, epoch, logs=None):
        self._delegate.on_epoch_end(epoch, logs)
