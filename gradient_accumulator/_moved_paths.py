"""Support for the import paths of gradient-accumulator 0.5.x."""

from __future__ import annotations

import warnings


def warn_moved(old_module: str, new_path: str) -> None:
    """Warns, once per import of ``old_module``, that its names now live at
    ``new_path``. Called at module level of the old module: ``stacklevel``
    skips this function and that module (import machinery frames are skipped
    by Python), so the warning names the line that imported it."""
    warnings.warn(
        f"`{old_module}` is a 0.5.x import path kept for compatibility; import "
        f"the same names from {new_path} instead.",
        DeprecationWarning,
        stacklevel=3,
    )
