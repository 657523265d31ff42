"""Choosing the tensors a merge method touches, by exact name or glob pattern.

A pattern selects a tensor when it equals the tensor's name or matches it as an ``fnmatch``
glob (``*`` also crosses dots), or when it equals / matches the tensor's *module* name (the
name without its last component): ``"model.layers.1.mlp.down_proj"`` selects both
``model.layers.1.mlp.down_proj.weight`` and ``.bias``. Matching is case-sensitive.

A pattern (in ``include`` or ``exclude``) that matches no tensor is an error listing some of the
available names: a misspelt pattern must not silently merge nothing.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

from ..errors import ConfigError, listing


def matches(name: str, pattern: str) -> bool:
    """Whether ``pattern`` selects the tensor ``name`` (see the module docstring)."""
    if name == pattern or fnmatch.fnmatchcase(name, pattern):
        return True
    module = name.rsplit(".", 1)[0] if "." in name else None
    return module is not None and (module == pattern or fnmatch.fnmatchcase(module, pattern))


def _as_patterns(patterns: str | Iterable[str] | None, what: str) -> tuple[str, ...] | None:
    if patterns is None:
        return None
    if isinstance(patterns, str):
        return (patterns,)
    out = tuple(patterns)
    if not out and what == "include":
        raise ConfigError("include is empty, so it selects no tensor; omit it (None) to merge every "
                          "floating-point tensor")
    for p in out:
        if not isinstance(p, str) or not p:
            raise ConfigError(f"{what} patterns must be non-empty strings, got {p!r}")
    return out


def select_tensors(
    names: Sequence[str],
    include: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
    *,
    eligible: Iterable[str] | None = None,
) -> list[str]:
    """Names (in the order of ``names``) selected by ``include`` minus ``exclude``.

    ``include=None`` selects every name. ``eligible`` (default: all) restricts the result, e.g.
    to floating-point tensors; patterns are still checked against all ``names``, so a pattern
    naming only an integer buffer is not an error (the buffer is simply not merged).
    Raises :class:`ConfigError` for a pattern that matches nothing.
    """
    inc = _as_patterns(include, "include")
    exc = _as_patterns(exclude, "exclude") or ()
    all_names = list(names)

    def hits(pattern: str, what: str) -> set[str]:
        found = {n for n in all_names if matches(n, pattern)}
        if not found:
            raise ConfigError(
                f"{what} pattern {pattern!r} matches no tensor; the tensors are: {listing(all_names)}"
            )
        return found

    chosen = set(all_names) if inc is None else set().union(*(hits(p, "include") for p in inc))
    for pattern in exc:
        chosen -= hits(pattern, "exclude")
    allowed = None if eligible is None else set(eligible)
    return [n for n in all_names if n in chosen and (allowed is None or n in allowed)]
