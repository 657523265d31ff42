"""Values that depend only on a Hessian ``H``, kept while that very array lives.

A sequence of related QPs (a trust region's rejected steps, a sweep over ``g`` or over the
constraint set) often solves and certifies several problems that hold the *same* ``H`` array.
Factorisations and copies of ``H`` (the certificate's Cholesky / eigendecomposition, the
active-set solver's float32 copy and its last face factor) are then computed once.

Keying: the entry belongs to one array object (a weak reference: the values go when the array
goes, nothing keeps ``H`` alive) and is used only while that array is read-only (``MergeQP``
makes its ``H`` read-only after validating it, so its contents cannot change behind the
cache) and still has the fingerprint recorded with it (shape, dtype, data address and a
strided sample of its entries). A writable array is never cached. Two arrays with equal
contents are two entries: the cache never compares contents, so it cannot mistake one matrix
for another.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

__all__ = ["matrix_values", "forget_matrix"]

#: matrices whose values are kept at once (the oldest goes first)
CAPACITY = 4
#: entries in the strided sample of the fingerprint
_SAMPLE = 64


def _fingerprint(H: np.ndarray) -> tuple[Any, ...]:
    flat = H.reshape(-1)
    step = max(1, flat.size // _SAMPLE)
    sample = flat[::step][:_SAMPLE]
    return (H.shape, H.dtype.str, H.__array_interface__["data"][0], H.strides, sample.tobytes())


class _Entry:
    __slots__ = ("ref", "fingerprint", "values")

    def __init__(self, H: np.ndarray, on_death: Any):
        self.ref = weakref.ref(H, on_death)
        self.fingerprint = _fingerprint(H)
        self.values: dict[str, Any] = {}


_entries: list[_Entry] = []


def _drop_dead(ref: weakref.ref) -> None:
    _entries[:] = [e for e in _entries if e.ref is not ref]


def matrix_values(H: np.ndarray | None) -> dict[str, Any] | None:
    """The dictionary of cached values of the array ``H`` (``(n, n)``; created empty on first
    use), or ``None`` when ``H`` may not be cached (``None``, or writable). Callers store only
    values computed from ``H`` alone, under names of their own, and must not keep a reference
    to ``H`` itself in them (that would keep it alive)."""
    if H is None or not isinstance(H, np.ndarray) or H.flags.writeable:
        return None
    for entry in _entries:
        if entry.ref() is H:
            if entry.fingerprint == _fingerprint(H):
                return entry.values
            _entries.remove(entry)  # (cannot happen to a read-only array; never trust it)
            break
    entry = _Entry(H, _drop_dead)
    _entries.append(entry)
    del _entries[:-CAPACITY]
    return entry.values


def forget_matrix(H: np.ndarray | None) -> None:
    """Drop every cached value of the array ``H`` (benchmarks time cold solves)."""
    _entries[:] = [e for e in _entries if e.ref() is not H]
