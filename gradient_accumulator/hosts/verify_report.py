"""What ``verify`` returns: a :class:`VerifyReport` of one
:class:`LayerCheck` per top-level layer, each of one :class:`VariableCheck`
per variable, with the verdict and the table ``print`` shows."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["UNEXPLAINED", "LayerCheck", "VariableCheck", "VerifyReport"]

# A layer's reason when no known cause explains its difference.
UNEXPLAINED = (
    "no known cause in this layer: a loss or layer that couples the samples "
    "of a batch (verify(..., gradient_cache=True) checks the setting that "
    "makes such a loss exact), or float32 round-off (raise `tolerance`)"
)


@dataclass(frozen=True)
class VariableCheck:
    """One variable: how far the two trainings ended apart."""

    name: str
    shape: tuple[int, ...]
    trainable: bool
    max_abs_diff: float
    """``max |w_accumulated - w_big_batch|`` after training."""
    moved: float
    """``max |w_big_batch - w_initial|``: how much training changed it."""
    ok: bool


@dataclass(frozen=True)
class LayerCheck:
    """One top-level layer of the model."""

    name: str
    class_name: str
    variables: list[VariableCheck]
    ok: bool
    reason: str | None
    """Why the layer breaks equivalence (``None`` when ``ok``)."""
    breaks_equivalence: bool
    """True if the cause lies in this layer (or a layer nested in it), False
    if its variables differ only because another layer's do."""

    @property
    def max_abs_diff(self) -> float | None:
        """Largest difference over the layer's variables (``None``: no
        variables)."""
        return max((v.max_abs_diff for v in self.variables), default=None)


@dataclass(frozen=True)
class VerifyReport:
    """The result of :func:`verify`; ``str(report)`` is a readable table."""

    layers: list[LayerCheck]
    tolerance: float
    micro_batch_size: int
    accum_steps: int
    steps: int
    moved: float
    """Largest change of any trainable variable during big-batch training: a
    comparison of weights that training did not move proves nothing."""
    notes: list[str] = field(default_factory=list)

    @property
    def max_abs_diff(self) -> float:
        """Largest difference over all variables."""
        return max(
            (v.max_abs_diff for layer in self.layers for v in layer.variables),
            default=0.0,
        )

    @property
    def ok(self) -> bool:
        """True if every variable agrees within ``tolerance`` and training
        moved the weights by more than ``tolerance``."""
        return self.moved > self.tolerance and all(x.ok for x in self.layers)

    @property
    def failing_layers(self) -> list[LayerCheck]:
        """Layers whose variables differ or that break equivalence."""
        return [x for x in self.layers if not x.ok]

    @property
    def causes(self) -> list[LayerCheck]:
        """Failing layers that break equivalence themselves."""
        return [x for x in self.failing_layers if x.breaks_equivalence]

    def __str__(self) -> str:
        big = self.micro_batch_size * self.accum_steps
        head = (
            f"big batch {big} vs accumulated {self.micro_batch_size} x "
            f"{self.accum_steps}, {self.steps} update(s); tolerance "
            f"{self.tolerance:g}"
        )
        rows = [("layer", "variable", "max |diff|", "moved", "ok")]
        for layer in self.layers:
            label = f"{layer.name} ({layer.class_name})"
            if not layer.variables:
                rows.append((label, "-", "-", "-", _mark(layer.ok)))
            for i, v in enumerate(layer.variables):
                rows.append(
                    (
                        label if i == 0 else "",
                        v.name + ("" if v.trainable else " (non-trainable)"),
                        f"{v.max_abs_diff:.2e}",
                        f"{v.moved:.2e}",
                        _mark(v.ok),
                    )
                )
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = [head, ""]
        for j, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.append("")
        if self.causes:
            lines.append("Breaks equivalence:")
            lines.extend(
                f"  {x.name} ({x.class_name}): {x.reason}" for x in self.causes
            )
        followers = [
            x
            for x in self.failing_layers
            if not x.breaks_equivalence and x.reason != UNEXPLAINED
        ]
        if followers:
            names = ", ".join(x.name for x in followers)
            lines.append(f"Differ as a consequence: {names}.")
        lines.extend(
            f"{x.name} ({x.class_name}): {x.reason}"
            for x in self.failing_layers
            if x.reason == UNEXPLAINED
        )
        lines.extend(self.notes)
        verdict = "OK" if self.ok else "FAIL"
        lines.append(
            f"{verdict}: max |w_accumulated - w_big_batch| = "
            f"{self.max_abs_diff:.2e}, training moved the weights by up to "
            f"{self.moved:.2e}."
        )
        return "\n".join(lines)


def _mark(ok: bool) -> str:
    return "yes" if ok else "NO"
