"""Which saved gradient sum belongs to which variable: file keys named by
the host (see ``Binding.names``), and the matching of a file against the
state when it loads (by name; files of earlier releases by position).
"""

from __future__ import annotations

import re

import numpy as np

# The saved state's scalar entries: (key in a file, attribute).
COUNTERS = (
    ("micro_step", "micro_step"),
    ("accum_steps", "accum_steps_variable"),
    ("next_accum_steps", "next_accum_steps"),
    ("weight_sum", "weight_sum"),
    ("sample_sum", "sample_sum"),
    ("overflows", "overflows"),
    ("empty", "empty"),
    ("last_grad_norm", "last_grad_norm"),
    ("last_batch", "last_batch"),
)
CYCLE_STATE = frozenset(name for name, _ in COUNTERS)
# What a file for other variables still gives: the schedule and the logs.
SETTINGS_STATE = frozenset(("next_accum_steps", "last_grad_norm", "last_batch"))
_SUM_PREFIX = "grad_sum:"
# A part's entries (an extra denominator's sums, see Engine.part): its own
# keys behind "part<index>:".
_PART_KEY = re.compile(r"part(\d+):(.*)")
_LEGACY_SUM = re.compile(r"grad_sum_(\d+)")


def paths(variables) -> list[str]:
    # Raw tf.Variables have no Keras path.
    return [getattr(v, "path", None) or v.name.split(":")[0] for v in variables]


def weight_names(weights, variables) -> list[str]:
    """Each of ``variables``' place in a model's ``weights`` (Keras' order,
    the one ``get_weights`` and weight files use, so the same in another
    instance of the model, where paths of auto-named layers are not); a
    variable not among them by its path."""
    index = {id(w): i for i, w in enumerate(weights)}
    return [
        f"weights[{index[id(v)]}]" if id(v) in index else paths([v])[0]
        for v in variables
    ]


def sum_keys(names) -> tuple[str, ...]:
    """A file key per gradient sum, from its variable's name (``/`` is a
    group separator in H5 files, so it becomes ``|``), numbered on a repeat."""
    keys, seen = [], {}
    for name in names:
        key = _SUM_PREFIX + name.replace("/", "|")
        seen[key] = seen.get(key, 0) + 1
        keys.append(key if seen[key] == 1 else f"{key}#{seen[key]}")
    return tuple(keys)


def stored_sums(store, saved: set, keys: list[str]) -> dict | None:
    """The file's gradient sums by this state's keys, or None if the file's
    sums are of other variables. Files written before sums were keyed by
    path (``grad_sum_<i>``) are matched by position."""
    by_path = {k for k in saved if k.startswith(_SUM_PREFIX)}
    legacy = sorted(
        (int(m.group(1)), k) for k in saved if (m := _LEGACY_SUM.fullmatch(k))
    )
    if by_path:
        return {k: store[k] for k in keys} if by_path == set(keys) else None
    if [i for i, _ in legacy] == list(range(len(keys))):
        return {key: store[old] for key, (_, old) in zip(keys, legacy)}
    return None


def read(store, shapes: dict) -> tuple[dict | None, dict, int]:
    """What a file gives a state whose gradient sums have ``shapes`` (by
    key): the sums by key, or None when the file's are of other variables;
    the scalar entries to load, by attribute (of a file for other
    variables, only the schedule and the logs); how many pending
    micro-batches that leaves behind."""
    saved = set(store.keys())
    sums = stored_sums(store, saved, list(shapes))
    fits = sums is not None and all(
        tuple(np.shape(sums[key])) == tuple(shape) for key, shape in shapes.items()
    )
    kept = CYCLE_STATE if fits else SETTINGS_STATE
    counters = {
        attribute: store[name]
        for name, attribute in COUNTERS
        if name in kept and name in saved
    }
    pending = int(np.asarray(store["micro_step"])) if "micro_step" in saved else 0
    return (sums if fits else None), counters, 0 if fits else pending


def part_key(index: int, key: str) -> str:
    """The file key of a part's entry ``key``."""
    return f"part{index}:{key}"


def split_parts(store) -> tuple[dict, dict[int, dict]]:
    """A file's own entries, and its parts' by part index (each with the
    part's own keys)."""
    own, parts = {}, {}
    keys = list(store.keys())  # Keras' H5 stores are not iterable
    for key in keys:
        match = _PART_KEY.fullmatch(key)
        if match is None:
            own[key] = store[key]
        else:
            parts.setdefault(int(match.group(1)), {})[match.group(2)] = store[key]
    return own, parts
