"""Argument checks shared by the public constructors."""

from __future__ import annotations

import numbers
import warnings

# Largest accepted ``accum_steps``: the cycle counters are integer tensors,
# and 2**31 - 1 fits every integer dtype they may use (int32 or int64), where
# e.g. 2**63 does not even convert to a tensor.
MAX_ACCUM_STEPS = 2**31 - 1


def check_accum_steps(accum_steps, name: str = "accum_steps") -> int:
    """Returns ``accum_steps`` as an ``int`` in ``[1, MAX_ACCUM_STEPS]`` or
    raises a clear error."""
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, numbers.Integral):
        raise TypeError(
            f"`{name}` must be an integer >= 1 (the number of micro-batches per "
            f"optimizer update). Received: {name}={accum_steps!r} "
            f"of type {type(accum_steps).__name__}."
        )
    if accum_steps < 1:
        raise ValueError(
            f"`{name}` must be an integer >= 1 (the number of micro-batches per "
            f"optimizer update). Received: {name}={accum_steps!r}."
        )
    if accum_steps > MAX_ACCUM_STEPS:
        raise ValueError(
            f"`{name}` must be at most {MAX_ACCUM_STEPS} (2**31 - 1, so that "
            f"step counters fit in an integer tensor): accepted range is 1 to "
            f"{MAX_ACCUM_STEPS}. Received: {name}={accum_steps!r}."
        )
    return int(accum_steps)


def check_positive_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{name}` must be a positive number. Received: {name}={value!r}."
        )
    if not value > 0:
        raise ValueError(
            f"`{name}` must be a positive number. Received: {name}={value!r}."
        )
    return float(value)


PARTIAL_CYCLE = ("auto", "carry", "flush", "drop")
LOSS_DENOMINATORS = ("samples", "sum")


def check_loss_denominator(value):
    """Returns ``value`` if it is a ``loss_denominator`` (None, ``"samples"``,
    ``"sum"`` or a function) or raises a clear error."""
    if value is None or callable(value):
        return value
    accepted = (
        '"samples" (a mean over samples), "sum" (not divided), or a function '
        "f(x, y, sample_weight) returning what the loss divides a batch by"
    )
    if not isinstance(value, str):
        raise TypeError(
            f"`loss_denominator` must be {accepted}. Received: "
            f"loss_denominator={value!r} of type {type(value).__name__}."
        )
    if value not in LOSS_DENOMINATORS:
        raise ValueError(
            f"`loss_denominator` must be {accepted}. "
            f"Received: loss_denominator={value!r}."
        )
    return value


def check_choice(name: str, value, choices: tuple) -> str:
    """Returns ``value`` if it is one of ``choices`` or raises a clear error."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"`{name}` must be one of {choices}. Received: {name}={value!r}."
        )
    return value


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be True or False. Received: {name}={value!r}.")
    return value


def warn_unneeded(name: str, value, default, why: str, stacklevel: int = 3) -> None:
    """Accepts a 0.5.x keyword that is no longer needed, warning when set
    (``stacklevel``: as ``warnings.warn``'s, counted from the caller's
    caller)."""
    check_bool(name, value) if isinstance(default, bool) else None
    if value != default:
        warnings.warn(
            f"`{name}` is no longer needed and is ignored: {why}",
            DeprecationWarning,
            stacklevel=stacklevel,
        )


def take_05_keywords(kwargs: dict, use_agc, *, dtype: bool = False):
    """Takes the 0.5.x-only keywords out of ``kwargs`` and returns ``use_agc``.

    ``agc`` is 0.5.x's name of ``use_agc`` (its optimizer wrapper's, and its
    README's for the model); Keras would otherwise ignore it silently. With
    ``dtype=True`` (the optimizer wrapper) 0.5.x's ``dtype`` is accepted and
    ignored: accumulation buffers are always float32.
    """
    if "agc" in kwargs:
        agc = check_bool("agc", kwargs.pop("agc"))
        if use_agc and not agc:
            raise ValueError(
                "`agc` is 0.5.x's name of `use_agc`; give one of them. Received: "
                f"use_agc={use_agc!r}, agc={agc!r}."
            )
        warnings.warn(
            "`agc` is 0.5.x's name of `use_agc`: write `use_agc=...`.",
            DeprecationWarning,
            stacklevel=3,
        )
        use_agc = use_agc or agc
    if dtype and "dtype" in kwargs:
        kwargs.pop("dtype")
        warnings.warn(
            "`dtype` is no longer needed and is ignored: accumulation buffers "
            "are float32.",
            DeprecationWarning,
            stacklevel=3,
        )
    return use_agc


def check_micro_batch_size(micro_batch_size) -> int | None:
    """Returns ``micro_batch_size`` as ``None`` or an ``int >= 1``, or raises."""
    if micro_batch_size is None:
        return None
    if isinstance(micro_batch_size, bool) or not isinstance(
        micro_batch_size, numbers.Integral
    ):
        raise TypeError(
            "`micro_batch_size` must be None (no in-step micro-batching) or an "
            "integer >= 1 (samples per slice of each batch). Received: "
            f"micro_batch_size={micro_batch_size!r} of type "
            f"{type(micro_batch_size).__name__}."
        )
    if micro_batch_size < 1:
        raise ValueError(
            "`micro_batch_size` must be None (no in-step micro-batching) or an "
            "integer >= 1 (samples per slice of each batch). Received: "
            f"micro_batch_size={micro_batch_size!r}."
        )
    return int(micro_batch_size)


def check_gradient_cache(gradient_cache, micro_batch_size) -> None:
    """Raises unless ``gradient_cache`` is False, True or ``"global"``, set
    only with the ``micro_batch_size`` whose slices it caches."""
    if not (isinstance(gradient_cache, bool) or gradient_cache == "global"):
        kind = ValueError if isinstance(gradient_cache, str) else TypeError
        raise kind(
            "`gradient_cache` must be False, True (each replica's batch is one "
            'coupled batch) or "global" (every replica\'s outputs gathered '
            f"before the loss). Received: gradient_cache={gradient_cache!r}."
        )
    if gradient_cache and micro_batch_size is None:
        raise ValueError(
            f"`gradient_cache={gradient_cache!r}` runs each fit batch in slices of "
            "`micro_batch_size` samples and computes the loss once on the whole "
            "batch's outputs, but micro_batch_size is None. Set "
            "micro_batch_size to the slice size (an integer >= 1), or leave "
            "gradient_cache=False."
        )


CLIP_ARGS = ("clipnorm", "clipvalue", "global_clipnorm")


def _optimizer_chain(optimizer) -> list:
    """``optimizer`` and the optimizers it wraps (``inner_optimizer``, as in
    Keras' ``LossScaleOptimizer`` and ``GradientAccumulateOptimizer``)."""
    chain = []
    while optimizer is not None and not any(optimizer is o for o in chain):
        chain.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return chain


def _describe(optimizer) -> str:
    return f"{type(optimizer).__name__} {getattr(optimizer, 'name', '')!r}"


def check_clipping(inner, wrapper_args: dict) -> None:
    """Rejects conflicting gradient clipping, as Keras' optimizers do.

    ``wrapper_args`` are the clipping arguments given to the wrapper, which
    sets them on ``inner``: together with those already set on ``inner`` (or
    on an optimizer it wraps) at most one of ``clipnorm``, ``clipvalue`` and
    ``global_clipnorm`` may be set, and an argument set on both must agree.
    """
    given = {k: v for k, v in wrapper_args.items() if v is not None}
    found = {}  # argument -> (value, optimizer) set on the wrapped optimizers
    for optimizer in _optimizer_chain(inner):
        for key in CLIP_ARGS:
            value = getattr(optimizer, key, None)
            if value is not None and key not in found:
                found[key] = (value, optimizer)
    clashes = [k for k in given if k in found and found[k][0] != given[k]]
    if len(set(given) | set(found)) <= 1 and not clashes:
        return
    on_wrapper = ", ".join(f"{k}={v!r}" for k, v in given.items()) or "none"
    on_inner = (
        ", ".join(f"{k}={v!r} (on {_describe(o)})" for k, (v, o) in found.items())
        or "none"
    )
    raise ValueError(
        "Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be set, "
        "once: the wrapper passes its clipping arguments to the wrapped "
        "optimizer, which clips the accumulated gradient. Received: on "
        f"GradientAccumulateOptimizer {on_wrapper}; on the wrapped optimizer "
        f"{on_inner}."
    )


def check_single_accumulation(
    optimizer, wrapper: str, accum_steps: int | None = None, stacklevel: int = 3
) -> None:
    """Rejects an optimizer that accumulates gradients itself (Keras'
    ``gradient_accumulation_steps``) inside one of this package's wrappers,
    which would accumulate twice, and warns where it is one of this
    package's optimizer wrappers (``accum_steps``: the outer wrapper's).
    ``optimizer`` may also be a name (which never accumulates)."""
    for inner in _optimizer_chain(optimizer):
        steps = getattr(inner, "gradient_accumulation_steps", None)
        if steps:
            raise ValueError(
                f"{wrapper} cannot use an optimizer with Keras' own "
                f"`gradient_accumulation_steps` ({_describe(inner)} has "
                f"gradient_accumulation_steps={steps!r}): gradients would be "
                "accumulated twice, giving one update per accum_steps * "
                "gradient_accumulation_steps micro-batches. Leave "
                "`gradient_accumulation_steps` unset and give the whole cycle "
                "length as `accum_steps`."
            )
        own = getattr(inner, "accum_steps", None) if _accumulates(inner) else None
        if own is not None and accum_steps is not None:
            # Exact (a big batch of the product), but never what a user who
            # wrapped both meant; refusing would also stop files saved so
            # from loading.
            warnings.warn(
                f"{wrapper}(accum_steps={accum_steps}) is given a "
                f"GradientAccumulateOptimizer(accum_steps={own}): both "
                f"accumulate, so one update is applied every "
                f"{accum_steps * own} micro-batches. To update every "
                f"{accum_steps}, give {wrapper} the optimizer the "
                "GradientAccumulateOptimizer wraps (or use the "
                "GradientAccumulateOptimizer alone).",
                UserWarning,
                stacklevel=stacklevel,
            )


def _accumulates(optimizer) -> bool:
    """Whether ``optimizer`` is one of this package's optimizer wrappers."""
    return hasattr(optimizer, "_accumulator") and hasattr(optimizer, "accum_steps")


def check_engine_settings(use_agc, clip_factor, eps, skip_update_fn) -> tuple:
    """Returns the engine's own settings, checked, or raises a clear error."""
    check_bool("use_agc", use_agc)
    if skip_update_fn is not None and not callable(skip_update_fn):
        raise TypeError(
            "`skip_update_fn` must be None or a callable "
            "`fn(grads, variables) -> bool tensor`. "
            f"Received: skip_update_fn={skip_update_fn!r}."
        )
    return (
        use_agc,
        check_positive_float("clip_factor", clip_factor),
        check_positive_float("eps", eps),
        skip_update_fn,
    )


def check_range(name: str, value, accepted: str, low: float, high: float) -> None:
    """Rejects a non-number (TypeError) or one outside ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be {accepted}. Received: {name}={value!r}.")
    if not low <= value <= high:
        raise ValueError(f"`{name}` must be {accepted}. Received: {name}={value!r}.")


def take_no_renorm(kwargs: dict) -> None:
    """Takes Keras' batch-renormalisation keywords out of a batch-norm
    layer's ``kwargs``, refusing ``renorm=True``."""
    renorm = kwargs.pop("renorm", False)
    kwargs.pop("renorm_clipping", None)
    kwargs.pop("renorm_momentum", None)
    if renorm:
        raise ValueError(
            "AccumBatchNormalization does not support batch renormalisation "
            "(`renorm=True`). Received: renorm=True."
        )


REDUCTIONS = ("MEAN", "SUM")


def take_optimizer_arguments(
    inner, reduction, mixed_precision, use_agc, kwargs: dict
) -> tuple[str, bool]:
    """Checks an optimizer wrapper's arguments and sets the clipping given to
    it on ``inner`` (the optimizer it wraps, which clips the accumulated
    gradient). Returns ``(reduction, use_agc)``; takes 0.5.x's keywords
    (``agc``, ``dtype``) and the clipping out of ``kwargs``, and refuses any
    other keyword."""
    if not isinstance(reduction, str) or reduction.upper() not in REDUCTIONS:
        raise ValueError(
            f"`reduction` must be one of {REDUCTIONS}. "
            f"Received: reduction={reduction!r}."
        )
    # The warning names the line that built the wrapper (two frames up).
    warn_unneeded(
        "mixed_precision",
        mixed_precision,
        False,
        "loss scaling is detected from the optimizer.",
        stacklevel=4,
    )
    use_agc = take_05_keywords(kwargs, use_agc, dtype=True)
    clip_args = {k: kwargs.pop(k) for k in CLIP_ARGS if k in kwargs}
    check_clipping(inner, clip_args)
    if kwargs:
        raise TypeError(
            "GradientAccumulateOptimizer got unexpected keyword argument(s) "
            f"{sorted(kwargs)}. Set learning rate, weight decay and the like "
            "on the wrapped optimizer."
        )
    for key, value in clip_args.items():
        if value is not None:
            setattr(inner, key, value)
    return reduction.upper(), use_agc


def check_batch_norm_arguments(
    axis, momentum, epsilon, center, scale, kwargs: dict
) -> None:
    """Checks an ``AccumBatchNormalization``'s own arguments (either
    Keras' but ``accum_steps``, which ``Settings`` checks); takes the
    batch-renormalisation keywords out of ``kwargs``."""
    take_no_renorm(kwargs)
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise TypeError(
            "`axis` must be an integer (the features axis, e.g. -1 or 1). "
            f"Received: axis={axis!r}."
        )
    check_range("momentum", momentum, "a number in [0, 1]", 0.0, 1.0)
    check_range("epsilon", epsilon, "a number >= 0", 0.0, float("inf"))
    check_bool("center", center)
    check_bool("scale", scale)
