"""Batch normalisation whose moving statistics are those of the big batch.

:class:`AccumBatchNormalization` normalises each micro-batch exactly as
``keras.layers.BatchNormalization`` does, but instead of updating the moving
mean and variance on every call it pools the micro-batches' moments (merged
as in Chan's parallel algorithm, in float32) in an :class:`Accumulator` and,
once per cycle, updates the moving statistics as Keras' layer would on the
concatenated big batch. :func:`~gradient_accumulator.replace_batchnorm_layers`
converts a model.
"""

from __future__ import annotations

import functools

import keras
import tensorflow as tf
from keras import ops

from gradient_accumulator._keras_compat import (
    batch_norm_moments,
    batch_norm_reduction_axes,
    clone_initializer,
    track_variable,
)
from gradient_accumulator.core.batch_statistics import (
    big_batch_moments,
    counts,
    micro_batch_sums,
)
from gradient_accumulator.core.links import Binding
from gradient_accumulator.core.validation import (
    check_batch_norm_arguments,
    check_bool,
)
from gradient_accumulator.tracked_engine import Accumulator

# Keras' BatchNormalization config keys for batch renormalisation, which this
# layer does not implement (its moving statistics are not averages of batch
# statistics, so pooling does not define them).
_RENORM_KEYS = ("renorm", "renorm_clipping", "renorm_momentum")


@keras.saving.register_keras_serializable(package="gradient_accumulator")
class AccumBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` for gradient accumulation.

    In training, each micro-batch is normalised with its own statistics, as
    Keras' layer does (accumulation cannot change that: the big batch is never
    in memory). The moving mean and variance, however, are updated once per
    cycle of ``accum_steps`` micro-batches, with the exact mean and (biased)
    variance of the whole effective batch, every replica included: after a
    cycle they equal those of ``keras.layers.BatchNormalization`` trained on
    the concatenated big batch. Inference is exactly Keras' layer.

    Inside a :class:`GradientAccumulateModel` the layer follows the model's
    cycle (one counter, one all-reduce per cycle) and ``accum_steps`` may be
    omitted. Elsewhere (a plain ``keras.Model``, e.g. with
    :class:`GradientAccumulateOptimizer`) the layer counts its own training
    calls; ``accum_steps=None`` then means 1, i.e. exactly Keras' layer.

    A cycle whose pooled statistics (or, inside a model, whose gradients)
    contain a NaN or an Inf leaves the moving statistics unchanged.

    Args:
        accum_steps: micro-batches per cycle (an ``int >= 1``), or ``None`` to
            take it from the enclosing :class:`GradientAccumulateModel`. An
            explicit value must equal the model's.
        axis: as for ``keras.layers.BatchNormalization``, and likewise
            ``momentum``, ``epsilon``, ``center``, ``scale``, the
            initializers, regularizers and constraints of gamma, beta and
            the moving statistics.
        synchronized: as for ``keras.layers.BatchNormalization``: under a
            ``tf.distribute`` strategy, also normalise the forward pass with
            the statistics of all replicas' micro-batches. The moving
            statistics always pool every replica, whatever this flag.
        **kwargs: base layer arguments (``name``, ``dtype``, ``trainable``).

    Example:

    >>> import keras
    >>> from gradient_accumulator import AccumBatchNormalization
    >>> from gradient_accumulator import GradientAccumulateModel
    >>> inputs = keras.Input((8,))
    >>> h = AccumBatchNormalization()(keras.layers.Dense(16)(inputs))
    >>> model = GradientAccumulateModel(4, inputs=inputs, outputs=h)
    """

    def __init__(
        self,
        accum_steps: int | None = None,
        axis: int = -1,
        momentum: float = 0.99,
        epsilon: float = 1e-3,
        center: bool = True,
        scale: bool = True,
        beta_initializer="zeros",
        gamma_initializer="ones",
        moving_mean_initializer="zeros",
        moving_variance_initializer="ones",
        beta_regularizer=None,
        gamma_regularizer=None,
        beta_constraint=None,
        gamma_constraint=None,
        synchronized: bool = False,
        **kwargs,
    ):
        check_batch_norm_arguments(
            accum_steps, axis, momentum, epsilon, center, scale, kwargs
        )
        check_bool("synchronized", synchronized)
        super().__init__(
            axis=axis,
            momentum=momentum,
            epsilon=epsilon,
            center=center,
            scale=scale,
            beta_initializer=beta_initializer,
            gamma_initializer=gamma_initializer,
            moving_mean_initializer=moving_mean_initializer,
            moving_variance_initializer=moving_variance_initializer,
            beta_regularizer=beta_regularizer,
            gamma_regularizer=gamma_regularizer,
            beta_constraint=beta_constraint,
            gamma_constraint=gamma_constraint,
            synchronized=synchronized,
            **kwargs,
        )
        self._requested_accum_steps = accum_steps
        # Standalone, omitting accum_steps means one call per cycle: exactly
        # Keras' layer. A model it follows overrides the cycle anyway.
        self._accumulator = Accumulator(
            1 if accum_steps is None else accum_steps,
            track=functools.partial(track_variable, self),
            name="accumulator",
        )

    # ----------------------------------------------------------------- config
    @property
    def accum_steps(self) -> int | None:
        """Micro-batches per cycle as given (``None``: the model's)."""
        return self._requested_accum_steps

    def get_config(self) -> dict:
        config = super().get_config()
        for key in _RENORM_KEYS:
            config.pop(key, None)
        config["accum_steps"] = self._requested_accum_steps
        return config

    def build(self, input_shape) -> None:
        super().build(input_shape)
        # The shift of the pooled sums: the last cycle's exact big-batch mean
        # (the moving mean's initial value before the first cycle). The same
        # on every replica and constant within a cycle, and, unlike the moving
        # mean, which lags by ~1/(1 - momentum) cycles, close to the current
        # mean: summing x - s instead of x avoids the cancellation of
        # E[x^2] - E[x]^2 when |mean| >> std.
        self.accumulation_shift = self.add_weight(
            shape=self.moving_mean.shape,
            name="accumulation_shift",
            initializer=clone_initializer(self.moving_mean_initializer),
            trainable=False,
            autocast=False,
        )
        # One per-channel buffer per sum of _accumulate_statistics, keyed by
        # (and shaped like) these variables.
        statistics = [self.moving_mean, self.moving_variance, self.accumulation_shift]
        self._accumulator.build(statistics)
        self._accumulator.bind(
            Binding(
                variables=lambda: statistics,
                apply_fn=lambda: self._apply_statistics,
            )
        )

    # -------------------------------------------------------------- the cycle
    def follow_model(
        self, leader: Accumulator, accum_steps: int, link: bool = True
    ) -> None:
        """Makes the moving statistics follow ``leader``'s cycle.

        Called by :class:`GradientAccumulateModel` with its accumulator and
        cycle length whenever it makes a train function; ``link=False`` (the
        model's plain-Keras fast path) only checks ``accum_steps``.
        """
        requested = self._requested_accum_steps
        if requested is not None and requested != accum_steps:
            raise ValueError(
                f"AccumBatchNormalization {self.name!r} was given "
                f"accum_steps={requested}, but the GradientAccumulateModel it "
                f"belongs to uses accum_steps={accum_steps}. Omit "
                "accum_steps (accum_steps=None) to take it from the model."
            )
        if link:
            self._accumulator.follow(leader)
        else:
            self._accumulator.unfollow()

    # ---------------------------------------------------------------- forward
    def call(self, inputs, training=None, mask=None):
        if not (training and self.trainable):
            return super().call(inputs, training=False, mask=mask)
        if mask is not None and len(mask.shape) != len(inputs.shape) - 1:
            raise ValueError(
                "The mask provided should be one dimension less than the "
                f"inputs. Received: mask.shape={mask.shape}, "
                f"inputs.shape={inputs.shape}"
            )
        # As Keras' layer: statistics and normalisation in (at least) float32.
        compute_dtype = keras.backend.result_type(inputs.dtype, "float32")
        inputs = ops.cast(inputs, compute_dtype)
        gamma = ops.cast(self.gamma, compute_dtype) if self.scale else None
        beta = ops.cast(self.beta, compute_dtype) if self.center else None
        mean, variance = batch_norm_moments(self, inputs, mask)
        self._accumulate_statistics(inputs, mask, mean, variance)
        outputs = ops.batch_normalization(
            x=inputs,
            mean=mean,
            variance=variance,
            axis=self.axis,
            offset=beta,
            scale=gamma,
            epsilon=self.epsilon,
        )
        return ops.cast(outputs, self.compute_dtype)

    def _accumulate_statistics(self, inputs, mask, mean, variance) -> None:
        """Adds this replica's micro-batch to the cycle's pooled statistics
        (``batch_statistics``), shifted by the last big batch's mean."""
        if self.synchronized and mask is None:
            # The forward pass used every replica's moments; the pool needs
            # this replica's own (the engine sums replicas at the cycle end).
            mean, variance = ops.moments(inputs, axes=batch_norm_reduction_axes(self))
        channels = self.moving_mean.shape[0]
        mean = tf.reshape(tf.cast(mean, tf.float32), [channels])
        variance = tf.reshape(tf.cast(variance, tf.float32), [channels])
        count = counts(inputs, batch_norm_reduction_axes(self), channels, mask)
        shift = tf.cast(self.accumulation_shift, tf.float32)
        self._accumulator.step(
            micro_batch_sums(mean, variance, count, shift),
            [self.moving_mean, self.moving_variance, self.accumulation_shift],
            apply_fn=self._apply_statistics,
            weight=None,
            # Counts may differ per channel (masks on a non-last axis), so
            # they travel as a third sum; the engine's scalar divisor, the
            # number of calls, cancels out.
            count=1.0,
        )

    def _apply_statistics(self, means) -> None:
        """Updates the moving statistics from the cycle's pooled sums.

        ``means`` are the sums of :meth:`_accumulate_statistics` over the
        whole effective batch (all micro-batches, all replicas), each divided
        by the same number.
        """
        mean, variance = big_batch_moments(
            means, tf.cast(self.accumulation_shift, tf.float32)
        )
        dtype = self.moving_mean.dtype
        moving_mean = ops.cast(self.moving_mean, dtype)
        moving_variance = ops.cast(self.moving_variance, dtype)
        mean = ops.cast(mean, dtype)
        variance = ops.cast(variance, dtype)
        # Keras' update, verbatim (not assign_moving_average's form).
        self.moving_mean.assign(
            moving_mean * self.momentum + mean * (1.0 - self.momentum)
        )
        self.moving_variance.assign(
            moving_variance * self.momentum + variance * (1.0 - self.momentum)
        )
        self.accumulation_shift.assign(ops.cast(mean, self.accumulation_shift.dtype))
