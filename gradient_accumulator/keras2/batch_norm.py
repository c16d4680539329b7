"""``AccumBatchNormalization`` for tf-keras: batch normalisation whose moving
statistics are those of the big batch (see the Keras 3 layer)."""

from __future__ import annotations

import tensorflow as tf
import tf_keras

from gradient_accumulator.core.batch_statistics import (
    big_batch_moments,
    counts,
    micro_batch_sums,
)
from gradient_accumulator.core.engine import Engine
from gradient_accumulator.core.links import Binding
from gradient_accumulator.core.validation import (
    check_batch_norm_arguments,
)


class _LayerEngine(Engine):
    """An engine whose variables are its layer's (non-trainable) weights, so
    the layer saves and restores them with its own."""

    def __init__(self, layer, accum_steps: int):
        super().__init__(accum_steps, name="accumulator")
        self._layer = layer

    def _make_variable(self, name, shape, dtype, initializer, **kwargs):
        if not isinstance(initializer, str):
            initializer = tf_keras.initializers.Constant(initializer)
        return self._layer.add_weight(
            name=name,
            shape=shape,
            dtype=dtype,
            initializer=initializer,
            trainable=False,
            experimental_autocast=False,
            synchronization=getattr(
                tf.VariableSynchronization,
                kwargs.get("synchronization", "auto").upper(),
            ),
            aggregation=getattr(
                tf.VariableAggregation, kwargs.get("aggregation", "none").upper()
            ),
        )


@tf_keras.saving.register_keras_serializable(package="gradient_accumulator")
class AccumBatchNormalization(tf_keras.layers.BatchNormalization):
    """``tf.keras.layers.BatchNormalization`` (tf-keras) for gradient
    accumulation.

    Each micro-batch is normalised with its own moments; the moving mean and
    variance are updated once per cycle of ``accum_steps`` micro-batches with
    the exact moments of the whole effective batch (every replica included),
    so that after a cycle they equal those of tf-keras' layer trained on the
    concatenated big batch. Inside a ``GradientAccumulateModel`` the layer
    follows the model's cycle and ``accum_steps`` may be omitted; elsewhere
    it counts its own training calls (``None`` then means 1: tf-keras'
    layer). As in 0.5.x, one channels-last layer (``axis=-1``) may be called
    on inputs of different ranks (after a ``Conv2D`` and after a ``Dense``).

    Args: as the Keras 3 ``AccumBatchNormalization``, without
    ``synchronized``.

    Example:

    >>> import tf_keras
    >>> from gradient_accumulator.keras2 import AccumBatchNormalization
    >>> layer = AccumBatchNormalization(accum_steps=4)
    >>> layer(tf_keras.Input((8,))).shape.as_list()
    [None, 8]
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
        **kwargs,
    ):
        if isinstance(axis, list | tuple) and len(axis) == 1:
            axis = axis[0]  # a built tf-keras BatchNormalization's config
        check_batch_norm_arguments(
            accum_steps, axis, momentum, epsilon, center, scale, kwargs
        )
        if kwargs.pop("synchronized", False):
            raise ValueError(
                "The tf-keras AccumBatchNormalization does not support "
                "`synchronized=True`. Received: synchronized=True."
            )
        # tf-keras' fused kernel (its default for rank-4/5 inputs) updates
        # the moving variance with the unbiased variance: so do we, there.
        self._fused_default = kwargs.pop("fused", None) is not False
        for unsupported in ("virtual_batch_size", "adjustment"):
            kwargs.pop(unsupported, None)
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
            fused=False,
            **kwargs,
        )
        self._requested_accum_steps = accum_steps
        self._feature_axis = int(axis)
        self._accumulator = _LayerEngine(
            self, 1 if accum_steps is None else accum_steps
        )

    @property
    def accum_steps(self) -> int | None:
        """Micro-batches per cycle as given (``None``: the model's)."""
        return self._requested_accum_steps

    def get_config(self) -> dict:
        config = super().get_config()
        for key in ("renorm", "renorm_clipping", "renorm_momentum"):
            config.pop(key, None)
        config["axis"] = self._feature_axis
        config["accum_steps"] = self._requested_accum_steps
        return config

    def build(self, input_shape) -> None:
        super().build(input_shape)
        self._built_rank = rank = len(input_shape)
        self._unbiased = (
            self._fused_default
            and rank in (4, 5)
            and self._feature_axis % rank in (1, rank - 1)
        )
        channels = self.moving_mean.shape[0]
        if self._feature_axis == -1:
            # Any rank, as 0.5.x allowed: only the channels are fixed.
            self.input_spec = tf_keras.layers.InputSpec(min_ndim=2, axes={-1: channels})
        # The shift of the pooled sums: the last cycle's big-batch mean.
        self.accumulation_shift = self.add_weight(
            name="accumulation_shift",
            shape=self.moving_mean.shape,
            initializer=self.moving_mean_initializer,
            trainable=False,
            experimental_autocast=False,
        )
        statistics = [self.moving_mean, self.moving_variance, self.accumulation_shift]
        self._accumulator.build(statistics)
        self._accumulator.bind(
            Binding(
                variables=lambda: statistics, apply_fn=lambda: self._apply_statistics
            )
        )

    def follow_model(self, leader: Engine, accum_steps: int, link: bool = True) -> None:
        """Makes the moving statistics follow ``leader``'s cycle (called by
        ``GradientAccumulateModel`` when it makes a train function)."""
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
    def _axes(self, inputs) -> tuple[list[int], list[int]]:
        """The reduction axes of ``inputs`` and the shape that broadcasts a
        per-channel vector against it."""
        rank = inputs.shape.rank
        channel = self._feature_axis % rank
        shape = [1] * rank
        shape[channel] = self.moving_mean.shape[0]
        return [a for a in range(rank) if a != channel], shape

    def call(self, inputs, training=None, mask=None):
        if training is None:
            training = tf_keras.backend.learning_phase()
        training = bool(tf.get_static_value(training)) and self.trainable
        if not training and inputs.shape.rank == self._built_rank:
            return super().call(inputs, training=False, mask=mask)
        compute = (
            tf.float32 if inputs.dtype in (tf.float16, tf.bfloat16) else inputs.dtype
        )
        x = tf.cast(inputs, compute)
        axes, shape = self._axes(x)

        def channel_vector(value):
            return None if value is None else tf.reshape(tf.cast(value, compute), shape)

        if training:
            if mask is None:
                mean, variance = tf.nn.moments(x, axes)
            else:
                weights = tf.cast(tf.expand_dims(mask, -1), compute)
                mean, variance = tf.nn.weighted_moments(x, axes, weights)
            self._accumulate_statistics(x, mask, mean, variance, axes)
        else:
            mean, variance = self.moving_mean, self.moving_variance
        outputs = tf.nn.batch_normalization(
            x,
            channel_vector(mean),
            channel_vector(variance),
            channel_vector(self.beta if self.center else None),
            channel_vector(self.gamma if self.scale else None),
            self.epsilon,
        )
        return tf.cast(outputs, self.compute_dtype)

    def _accumulate_statistics(self, inputs, mask, mean, variance, axes) -> None:
        channels = self.moving_mean.shape[0]
        mean = tf.reshape(tf.cast(mean, tf.float32), [channels])
        variance = tf.reshape(tf.cast(variance, tf.float32), [channels])
        shift = tf.cast(self.accumulation_shift, tf.float32)
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        opens = tf.cast(self._accumulator.opens_cycle(), tf.float32)
        self._accumulator.step(
            micro_batch_sums(
                mean, variance, counts(inputs, axes, channels, mask), shift
            ),
            [self.moving_mean, self.moving_variance, self.accumulation_shift],
            apply_fn=self._apply_statistics,
            # The counts travel as a third sum. The engine's divisor is 1 per
            # cycle, so the means it hands over are the sums themselves and
            # the third is the big batch's element count.
            count=opens / replicas,
        )

    def _apply_statistics(self, means) -> None:
        """Updates the moving statistics with the cycle's moments, as
        tf-keras' layer updates them with a batch's."""
        mean, variance = big_batch_moments(
            means, tf.cast(self.accumulation_shift, tf.float32)
        )
        if self._unbiased:
            size = means[2]
            variance *= tf.math.divide_no_nan(size, tf.maximum(size - 1.0, 0.0))
        decay = 1.0 - self.momentum
        for variable, value in (
            (self.moving_mean, mean),
            (self.moving_variance, variance),
        ):
            value = tf.cast(value, variable.dtype)
            variable.assign_sub((variable - value) * decay)
        self.accumulation_shift.assign(tf.cast(mean, self.accumulation_shift.dtype))
