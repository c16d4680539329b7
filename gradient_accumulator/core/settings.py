"""The accumulation settings, in one record, checked once.

Every public constructor (``GradientAccumulateModel`` and
``GradientAccumulateOptimizer`` for Keras 3 and for tf-keras,
:func:`~gradient_accumulator.accumulate`, the loader of saved models)
builds one :class:`Settings`, which checks its arguments, and hands it on:
the engine takes it as it is. Each default is written here once (public
signatures refer to it, e.g. ``clip_factor: float = Settings.clip_factor``);
a model setting added here is checked, saved in the model's config and read
back by the loader.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import tensorflow as tf

from gradient_accumulator.core.agc import CLIP_FACTOR, EPS
from gradient_accumulator.core.validation import (
    PARTIAL_CYCLE,
    check_accum_steps,
    check_bool,
    check_choice,
    check_engine_settings,
    check_gradient_cache,
    check_loss_denominator,
    check_micro_batch_size,
    warn_unneeded,
)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Checked accumulation settings (see
    :class:`~gradient_accumulator.GradientAccumulateModel` for each). The
    engine reads ``accum_steps``, ``use_agc``, ``clip_factor``, ``eps`` and
    ``skip_update_fn``; the rest are the model wrappers'."""

    accum_steps: int = 1
    use_agc: bool = False
    clip_factor: float = CLIP_FACTOR
    eps: float = EPS
    micro_batch_size: int | None = None
    # In-step slices run twice, the loss once on the whole batch's outputs
    # (core/gradient_cache.py): exact for losses that couple the batch;
    # "global": on every replica's outputs, gathered.
    gradient_cache: bool | str = False
    # "auto": each epoch that is a pass over the data ends its last cycle
    # short, as plain Keras' last batch; epochs cut from a stream by
    # steps_per_epoch carry it on (hosts/partial_cycles.py).
    partial_cycle: str = "auto"
    flush_at_end: bool = True
    progress_logs: bool = False
    # A function: not saved in files (see SAVED).
    skip_update_fn: Callable[[list, list], tf.Tensor] | None = None
    # What a model's own compute_loss divides a batch by: "samples", "sum"
    # or f(x, y, sample_weight); None: not declared (counted as "samples").
    loss_denominator: str | Callable | None = None

    def __post_init__(self):
        set_checked = functools.partial(object.__setattr__, self)
        check_engine_settings(
            self.use_agc, self.clip_factor, self.eps, self.skip_update_fn
        )
        set_checked("accum_steps", check_accum_steps(self.accum_steps))
        set_checked("micro_batch_size", check_micro_batch_size(self.micro_batch_size))
        check_gradient_cache(self.gradient_cache, self.micro_batch_size)
        check_choice("partial_cycle", self.partial_cycle, PARTIAL_CYCLE)
        check_bool("flush_at_end", self.flush_at_end)
        check_bool("progress_logs", self.progress_logs)
        check_loss_denominator(self.loss_denominator)

    def saved(self, serialize: Callable | None = None) -> dict:
        """The settings a model's config holds; ``serialize``: how a function
        among them is saved (Keras' ``serialize_keras_object``, as for a
        custom loss function), else it is kept as it is."""
        saved = {name: getattr(self, name) for name in SAVED}
        if serialize is not None and callable(saved["loss_denominator"]):
            saved["loss_denominator"] = serialize(saved["loss_denominator"])
        return saved


# The settings saved in a model's config, in order.
SAVED = tuple(
    f.name for f in dataclasses.fields(Settings) if f.name != "skip_update_fn"
)


def warn_05_model_arguments(
    mixed_precision: bool, experimental_distributed_support: bool
) -> None:
    """Warns about the model wrapper's 0.5.x arguments that are no longer
    needed (accepted and ignored), naming the line that built the model
    (two frames up)."""
    warn_unneeded(
        "mixed_precision",
        mixed_precision,
        False,
        "loss scaling is detected from the optimizer that compile() builds.",
        stacklevel=4,
    )
    warn_unneeded(
        "experimental_distributed_support",
        experimental_distributed_support,
        False,
        "tf.distribute strategies are always supported.",
        stacklevel=4,
    )
