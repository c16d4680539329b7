"""``AccumBatchNormalization``, written once for Keras 3 and tf-keras: batch
normalisation whose moving statistics are those of the big batch.

Each micro-batch is normalised with its own moments, as the Keras' layer
does; the micro-batches' moments are pooled (Chan's parallel merge, in
float32: ``core.batch_statistics``) in an engine and, once per cycle, the
moving statistics are updated as the Keras' layer would update them on the
concatenated big batch. Each Keras' ``batch_norm`` module mixes
:class:`AccumBatchNorm` into its ``BatchNormalization`` and names its
flavour; what differs between the Kerases (their moments, their update
formula, tf-keras' fused kernel) comes from it.
"""

from __future__ import annotations

import tensorflow as tf

from gradient_accumulator.core.batch_statistics import (
    big_batch_moments,
    counts,
    micro_batch_sums,
)
from gradient_accumulator.core.engine import Engine
from gradient_accumulator.core.links import Binding
from gradient_accumulator.core.settings import Settings
from gradient_accumulator.core.validation import check_batch_norm_arguments
from gradient_accumulator.hosts.flavour import Flavour

# Keras' BatchNormalization config keys for batch renormalisation, which this
# layer does not implement (its moving statistics are not averages of batch
# statistics, so pooling does not define them).
_RENORM_KEYS = ("renorm", "renorm_clipping", "renorm_momentum")


class AccumBatchNorm:
    """Mixin for a Keras' ``BatchNormalization``: see the public classes."""

    # The flavour of its Keras: each Keras' public class sets it.
    _flavour: Flavour

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
        axis, options = self._flavour.batch_norm_options(
            self, axis, synchronized, kwargs
        )
        # Standalone, omitting accum_steps means one call per cycle: exactly
        # Keras' layer. A model it follows overrides the cycle anyway.
        settings = Settings(accum_steps=1 if accum_steps is None else accum_steps)
        check_batch_norm_arguments(axis, momentum, epsilon, center, scale, kwargs)
        # Keras' own arguments (all but accum_steps) pass on as given.
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
            **options,
            **kwargs,
        )
        self._requested_accum_steps = accum_steps
        self._feature_axis = int(axis)
        self._accumulator = self._flavour.layer_engine(self, settings)

    # ----------------------------------------------------------------- config
    @property
    def accum_steps(self) -> int | None:
        """Micro-batches per cycle as given (``None``: the model's)."""
        return self._requested_accum_steps

    def get_config(self) -> dict:
        config = super().get_config()
        for key in _RENORM_KEYS:
            config.pop(key, None)
        config["axis"] = self._feature_axis  # tf-keras' is a list once built
        config["accum_steps"] = self._requested_accum_steps
        return config

    def build(self, input_shape) -> None:
        super().build(input_shape)
        flavour = self._flavour
        self._built_rank = rank = len(input_shape)
        self._unbiased = flavour.unbiased_variance(self, rank)
        flavour.batch_norm_built(self, rank)
        # The shift of the pooled sums: the last cycle's exact big-batch mean
        # (the moving mean's initial value before the first cycle). The same
        # on every replica and constant within a cycle, and, unlike the moving
        # mean, which lags by ~1/(1 - momentum) cycles, close to the current
        # mean: summing x - s instead of x avoids the cancellation of
        # E[x^2] - E[x]^2 when |mean| >> std.
        self.accumulation_shift = self.add_weight(
            shape=self.moving_mean.shape,
            name="accumulation_shift",
            initializer=flavour.own_initializer(self.moving_mean_initializer),
            trainable=False,
            **flavour.fixed_weight,
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
    def follow_model(self, leader: Engine, accum_steps: int, link: bool = True) -> None:
        """Makes the moving statistics follow ``leader``'s cycle.

        Called by ``GradientAccumulateModel`` with its accumulator and cycle
        length whenever it makes a train function; ``link=False`` (the
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
        training = bool(self._flavour.training_flag(training)) and self.trainable
        # tf-keras' channels-last layer also takes inputs of another rank
        # (as 0.5.x did), which its own call does not.
        if not training and len(inputs.shape) == self._built_rank:
            return super().call(inputs, training=False, mask=mask)
        if mask is not None and len(mask.shape) != len(inputs.shape) - 1:
            raise ValueError(
                "The mask provided should be one dimension less than the "
                f"inputs. Received: mask.shape={mask.shape}, "
                f"inputs.shape={inputs.shape}"
            )
        # As Keras' layer: statistics and normalisation in (at least) float32.
        wide = inputs.dtype in (tf.float32, tf.float64)
        compute = inputs.dtype if wide else tf.float32
        x = tf.cast(inputs, compute)
        axes, shape = self._axes(x)
        if training:
            (mean, variance), own = self._flavour.batch_norm_moments(
                self, x, mask, axes
            )
            self._accumulate_statistics(x, mask, *own, axes)
        else:
            mean, variance = self.moving_mean, self.moving_variance

        def channels(value):
            # Keras' own broadcast of a per-channel vector.
            return None if value is None else tf.reshape(tf.cast(value, compute), shape)

        outputs = tf.nn.batch_normalization(
            x,
            channels(mean),
            channels(variance),
            channels(self.beta if self.center else None),
            channels(self.gamma if self.scale else None),
            self.epsilon,
        )
        return tf.cast(outputs, self.compute_dtype)

    def _axes(self, inputs) -> tuple[list[int], list[int]]:
        """The reduction axes of ``inputs`` and the shape that broadcasts a
        per-channel vector against it."""
        rank = len(inputs.shape)
        channel = self._feature_axis % rank
        shape = [1] * rank
        shape[channel] = self.moving_mean.shape[0]
        return [a for a in range(rank) if a != channel], shape

    def _accumulate_statistics(self, inputs, mask, mean, variance, axes) -> None:
        """Adds this replica's micro-batch to the cycle's pooled statistics
        (``batch_statistics``), shifted by the last big batch's mean."""
        channels = self.moving_mean.shape[0]
        mean = tf.reshape(tf.cast(mean, tf.float32), [channels])
        variance = tf.reshape(tf.cast(variance, tf.float32), [channels])
        shift = tf.cast(self.accumulation_shift, tf.float32)
        # Counts may differ per channel (masks on a non-last axis), so they
        # travel as a third sum, and the engine's divisor cancels out: the
        # number of calls, or 1 per cycle where the unbiased variance needs
        # the big batch's size itself.
        if self._flavour.counts_calls:
            count = 1.0
        else:
            replicas = tf.distribute.get_strategy().num_replicas_in_sync
            count = tf.cast(self._accumulator.opens_cycle(), tf.float32) / replicas
        self._accumulator.step(
            micro_batch_sums(
                mean, variance, counts(inputs, axes, channels, mask), shift
            ),
            [self.moving_mean, self.moving_variance, self.accumulation_shift],
            apply_fn=self._apply_statistics,
            count=count,
        )

    def _apply_statistics(self, means) -> None:
        """Updates the moving statistics from the cycle's pooled sums, as the
        Keras' layer updates them with a batch's moments.

        ``means`` are the sums of :meth:`_accumulate_statistics` over the
        whole effective batch (all micro-batches, all replicas), each divided
        by the same number.
        """
        mean, variance = big_batch_moments(
            means, tf.cast(self.accumulation_shift, tf.float32)
        )
        if self._unbiased:
            size = means[2]
            variance *= tf.math.divide_no_nan(size, tf.maximum(size - 1.0, 0.0))
        for variable, value in (
            (self.moving_mean, mean),
            (self.moving_variance, variance),
        ):
            value = tf.cast(value, variable.dtype)
            self._flavour.moving_average(variable, value, self.momentum)
        self.accumulation_shift.assign(tf.cast(mean, self.accumulation_shift.dtype))
