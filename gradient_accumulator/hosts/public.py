"""The public functions ``accumulate``, ``replace_batchnorm_layers`` and
``verify``, written once: each Keras' module (``accumulate.py``,
``convert.py``, ``verify.py`` and their ``keras2/`` twins) gets its function
from a factory here, given its flavour, so both Kerases' signatures are one.

A factory's function carries its module's ``__module__``, its name and a
docstring naming that Keras (``{keras}`` below, the flavour's package name;
``{package}``, the module's package), so ``help()``, ``inspect.signature`` and
the ``>>>`` examples read as if it were written in that module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gradient_accumulator.core.settings import Settings
from gradient_accumulator.hosts import equivalence, in_place, replace_layers
from gradient_accumulator.hosts.equivalence import Options
from gradient_accumulator.hosts.flavour import Flavour
from gradient_accumulator.hosts.model import check_in_step
from gradient_accumulator.hosts.verify_report import VerifyReport

# Stand-ins in the functions' annotations (strings): _public names this Keras'
# classes in their place, as inspect.signature shows them.
Model = Optimizer = Any

_ACCUMULATE_DOC = """Makes ``model`` accumulate gradients, in place, keeping its class.

    ``model`` trains exactly as a :class:`GradientAccumulateModel` with the
    same arguments would (see there for each argument in full): one
    optimizer update per ``accum_steps`` micro-batches, each weighted by the
    loss denominator {keras} uses for it. It stays an instance of its own
    class (a keras-hub task's ``generate``, preprocessor and ``compile``
    defaults keep working), its weights lists are unchanged, and ``.keras``
    files round-trip it, accumulation settings and pending state included.
    :func:`stop_accumulating` gives it its class back.

    Call it before or after ``compile`` (a compiled model retraces its
    step). A model whose class overrides ``train_step`` is refused: its step
    is its own, and the accumulating step would replace it.

    Args:
        model: a {keras} model instance (functional, ``Sequential``,
            subclassed, keras-hub task, loaded from a file).
        accum_steps: micro-batches per optimizer update, an ``int >= 1``.
        micro_batch_size: ``None``, or slice each ``fit`` batch into this
            many samples inside the step (in-step micro-batching{in_step}).
        gradient_cache: with ``micro_batch_size``, run the slices forward,
            compute the loss once on the whole batch's outputs, then run each
            slice again to back-propagate it: exact for losses that couple
            the batch (in-batch negatives, contrastive, triplet). ``True``:
            each replica's batch is one coupled batch; ``"global"``: every
            replica's outputs are gathered before the loss.
        partial_cycle: ``"auto"`` (the big batch's epochs: flush an
            incomplete cycle at the end of a pass over the data, carry it
            across epochs cut by ``steps_per_epoch``), ``"carry"``,
            ``"flush"`` or ``"drop"`` it at each epoch end.
        flush_at_end: flush a carried partial cycle when ``fit`` ends.
        skip_update_fn: optional ``fn(grads, variables) -> bool tensor``;
            True skips the cycle. Not saved in ``.keras`` files.
        progress_logs: add ``update``, ``grad_norm`` and ``effective_batch``
            to every step's logs.
        use_agc: adaptive gradient clipping of the accumulated gradient.
        clip_factor: its clipping factor (``> 0``).
        eps: its epsilon (``> 0``).
        loss_denominator: what the model's own ``compute_loss`` divides a
            batch by, when it is compiled without a loss: ``"samples"``,
            ``"sum"`` or a function ``f(x, y, sample_weight)`` (``None``:
            ``"samples"``, with a warning if ``compute_loss`` is overridden).

    Returns:
        ``model`` itself.

    Example:

    >>> import numpy as np, {keras}
    >>> from {package} import accumulate, stop_accumulating
    >>> model = {keras}.Sequential([{keras}.Input((4,)), {keras}.layers.Dense(1)])
    >>> model = accumulate(model, accum_steps=4)
    >>> isinstance(model, {keras}.Sequential)
    True
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> _ = model.fit(np.ones((32, 4)), np.ones((32, 1)), batch_size=8, verbose=0)
    >>> int(model.optimizer.iterations)  # 4 micro-batches of 8 -> one update
    1
    >>> type(stop_accumulating(model)) is {keras}.Sequential
    True
    """

_REPLACE_DOC = """\
Returns a copy of ``model`` with every ``BatchNormalization`` accumulating.

    Every ``{keras}.layers.BatchNormalization`` (in nested functional and
    ``Sequential`` models too) becomes an :class:`AccumBatchNormalization`
    with the same configuration, gamma, beta, moving mean and moving
    variance; every other layer is copied with its weights. In inference the
    returned model predicts exactly what ``model`` predicts. ``model`` itself
    is left untouched (no layer or variable is shared).

    Args:
        model: a functional or ``Sequential`` ``{keras}.Model`` (a
            :class:`GradientAccumulateModel` stays one, with its settings).
            Subclassed models cannot be rebuilt layer by layer: use
            :class:`AccumBatchNormalization` in their code instead.
        accum_steps: given to every new layer; ``None`` (the default) takes it
            from the :class:`GradientAccumulateModel` the layers end up in.
        position: only ``"replace"``, accepted for 0.5.x compatibility.

    Returns:
        The converted model, compiled like ``model`` if ``model`` was.
        Subclasses of ``BatchNormalization`` are copied unchanged.

    Raises:
        ValueError: a ``BatchNormalization`` uses an option that
            :class:`AccumBatchNormalization` lacks ({unsupported}).

    Example:

    >>> import {keras}
    >>> from {package} import replace_batchnorm_layers
    >>> model = {keras}.Sequential(
    ...     [{keras}.Input((4,)), {keras}.layers.BatchNormalization()]
    ... )
    >>> type(replace_batchnorm_layers(model).layers[0]).__name__
    'AccumBatchNormalization'
    """

_VERIFY_DOC = """Checks that ``GradientAccumulateModel`` trains ``model_fn()``'s model
    exactly like plain {keras} on the big batch.

    From the same initial weights and on the same samples in the same order,
    trains plain {keras} with ``batch_size = micro_batch_size * accum_steps``
    and ``GradientAccumulateModel(accum_steps=accum_steps)`` with
    ``batch_size = micro_batch_size``, for ``steps`` optimizer updates each,
    then compares every variable of every layer. Layers known to break
    equivalence are named with the reason: ``BatchNormalization`` (micro-batch
    statistics), layers that draw random numbers (``Dropout``, noise,
    augmentation) and layers whose non-trainable state changes per call.

    Calls ``{keras}.utils.set_random_seed(seed)`` before building each model.
    Differences are smallest with
    ``tf.config.experimental.enable_op_determinism()``.

    Args:
        model_fn: builds a new functional or ``Sequential`` ``{keras}.Model``,
            compiled or not, with the same architecture on every call; called
            twice. Both runs use ``{keras}.Model(m.inputs, m.outputs)`` of its
            model, so a ``GradientAccumulateModel`` is also accepted.
        x: inputs, as ``fit`` takes them (an array, or a list or dict of
            arrays) with at least ``micro_batch_size * accum_steps * steps``
            samples; the first ones are used.
        y: targets, like ``x``.
        micro_batch_size: samples per micro-batch, an ``int >= 1``.
        accum_steps: micro-batches per update, an ``int >= 1``.
        optimizer: {optimizers}
            (copied from its config for each run), without accumulation;
            default: the compiled model's optimizer (the wrapped one for a
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
        gradient_cache: check ``GradientAccumulateModel(micro_batch_size=
            micro_batch_size, gradient_cache=True)`` fed batches of
            ``micro_batch_size * accum_steps`` instead (for a loss that
            couples the batch's samples; see ``docs/gradient-cache.md``).

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

    Example:

    >>> import numpy as np, {keras}
    >>> from {package} import verify
    >>> def model_fn():
    ...     inputs = {keras}.Input((4,))
    ...     return {keras}.Model(inputs, {keras}.layers.Dense(2)(inputs))
    >>> x, y = np.ones((32, 4), "float32"), np.zeros((32, 2), "float32")
    >>> report = verify(model_fn, x, y, micro_batch_size=4, accum_steps=2, loss="mse")
    >>> report.ok
    True
    """

# What each Keras' verify accepts as `optimizer`, in its docstring.
_OPTIMIZERS = {
    "keras": "a Keras optimizer name or instance",
    "tf_keras": "a tf-keras optimizer name or instance, current or legacy "
    "(``tf_keras.optimizers.legacy``)",
}


def accumulate(flavour: Flavour, module: str, wrapper: type) -> Callable:
    """``module``'s ``accumulate`` for ``flavour``'s Keras, whose
    ``GradientAccumulateModel`` is ``wrapper``: its settings, by keyword."""

    def accumulate(
        model: Model,
        accum_steps: int = Settings.accum_steps,
        *,
        micro_batch_size: int | None = Settings.micro_batch_size,
        gradient_cache: bool | str = Settings.gradient_cache,
        partial_cycle: str = Settings.partial_cycle,
        flush_at_end: bool = Settings.flush_at_end,
        skip_update_fn: Callable[[list, list], Any] | None = None,
        progress_logs: bool = Settings.progress_logs,
        use_agc: bool = Settings.use_agc,
        clip_factor: float = Settings.clip_factor,
        eps: float = Settings.eps,
        loss_denominator: str | Callable | None = Settings.loss_denominator,
    ) -> Model:
        check_in_step(flavour, "accumulate", micro_batch_size, gradient_cache)

        def settings() -> Settings:
            return Settings(
                accum_steps=accum_steps,
                micro_batch_size=micro_batch_size,
                gradient_cache=gradient_cache,
                partial_cycle=partial_cycle,
                flush_at_end=flush_at_end,
                skip_update_fn=skip_update_fn,
                progress_logs=progress_logs,
                use_agc=use_agc,
                clip_factor=clip_factor,
                eps=eps,
                loss_denominator=loss_denominator,
            )

        return in_place.start(flavour, wrapper, model, settings)

    return _public(accumulate, flavour, module, _ACCUMULATE_DOC, "")


def replace_batchnorm_layers(
    flavour: Flavour, module: str, accum_batch_norm: type, wrapper: type
) -> Callable:
    """``module``'s ``replace_batchnorm_layers`` for ``flavour``'s Keras,
    whose ``AccumBatchNormalization`` and ``GradientAccumulateModel`` are
    ``accum_batch_norm`` and ``wrapper``."""

    def replace_batchnorm_layers(
        model: Model, accum_steps: int | None = None, position: str = "replace"
    ) -> Model:
        return replace_layers.replace(
            flavour, accum_batch_norm, wrapper, model, accum_steps, position
        )

    unsupported = ", ".join(f"``{o}``" for o in flavour.batch_norm_unsupported)
    return _public(replace_batchnorm_layers, flavour, module, _REPLACE_DOC, unsupported)


def verify(flavour: Flavour, module: str, wrapper: type) -> Callable:
    """``module``'s ``verify`` for ``flavour``'s Keras, whose
    ``GradientAccumulateModel`` is ``wrapper``."""

    def verify(
        model_fn: Callable[[], Model],
        x: Any,
        y: Any,
        *,
        micro_batch_size: int = Options.micro_batch_size,
        accum_steps: int = Options.accum_steps,
        optimizer: str | Optimizer | None = Options.optimizer,
        loss: Any = Options.loss,
        steps: int = Options.steps,
        tolerance: float = Options.tolerance,
        seed: int = Options.seed,
        callbacks: Callable[[], list] | None = Options.callbacks,
        gradient_cache: bool = Options.gradient_cache,
    ) -> VerifyReport:
        equivalence.check_model_fn(flavour, model_fn)
        options = Options(
            micro_batch_size=micro_batch_size,
            accum_steps=accum_steps,
            optimizer=optimizer,
            loss=loss,
            steps=steps,
            tolerance=tolerance,
            seed=seed,
            callbacks=callbacks,
            gradient_cache=gradient_cache,
        )
        return equivalence.run(flavour, wrapper, model_fn, x, y, options)

    return _public(verify, flavour, module, _VERIFY_DOC, "")


def _public(
    function: Callable, flavour: Flavour, module: str, doc: str, unsupported: str
) -> Callable:
    keras = flavour.name
    function.__module__ = module
    function.__qualname__ = function.__name__
    function.__doc__ = doc.format(
        keras=keras,
        package=module.rpartition(".")[0],
        unsupported=unsupported,
        in_step=""
        if flavour.in_step
        else f"; with {keras} only with ``gradient_cache``",
        optimizers=_OPTIMIZERS.get(keras, f"a {keras} optimizer name or instance"),
    )
    # The annotations are strings (postponed); name this Keras' classes in them.
    function.__annotations__ = {
        name: annotation.replace("Model", f"{keras}.Model").replace(
            "Optimizer", f"{keras}.optimizers.Optimizer"
        )
        for name, annotation in function.__annotations__.items()
    }
    return function
