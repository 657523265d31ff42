"""Sums of two coordinates: the active-set solver's reduction of a simplex of two models to a box
(:mod:`.active_set`).

Where every sum group of the set has exactly two coordinates (the per-atom simplex of a merge of
two models, with or without bounds: ``x_a + x_b = T``, ``lo <= x <= hi``), one coordinate of each
pair is the other's complement. With ``x_a = s`` and ``x_b = T - s`` the set becomes the box

    ``max(lo_a, T - hi_b) <= s <= min(hi_a, T - lo_b)``

in half as many unknowns, and ``J(q + P s)`` (``P`` has ``+1`` at ``a`` and ``-1`` at ``b`` in each
column, ``q = T`` at ``b``) is the QP with

    ``H_s = H_aa + H_bb - (H_ab + H_ba)``,  ``g_s = (H q + g)_a - (H q + g)_b``,  ``c_s = J(q)``.

The engine then solves a box QP of ``m = n / 2`` unknowns (and its low-rank path takes it as a box,
through the dual on bounds) instead of a simplex of ``n`` unknowns, whose faces need the null-space
gathers of ``Z'HZ`` (the same free pairs' matrix, gathered again at every face) and products with
all of H. ``H_s`` costs one pass over H (``H_s`` is formed as ``(H_aa + H_bb) - (H_ab + H_ba)``, so
that it is exactly symmetric); a ridge stays a ridge (``P'P = 2 I``) and a rank stays at most what it
was. Memory: ``H_s`` is a quarter of H (formed in blocks of rows, nothing else of its size) and the
engine's float32 copy is then of ``H_s`` (an eighth of H) instead of H (a half): within ``auto``'s
reserve of 2 H at every size, so there is no size limit (measured at n = 12288, H 1.2 GB, peak
beyond H: 0.64 GB against 1.10 GB without the reduction on ``simplex:K=2``; 0.35 / 0.79 GB against
0.11 / 0.40 GB on ``simplex_lowrank:K=2`` / ``simplex_singular:K=2``, where the low-rank path had
taken the simplex without a copy of H).

Exact: every feasible ``x`` is ``q + P s`` for one ``s`` of the box and ``J`` is the same function,
so the Frank-Wolfe gaps are equal too (``P' grad_x = grad_s``); the certificate, computed on the
whole problem, checks the expanded point.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..constraints.kernels import SetStructure
from ..matrix_cache import matrix_values
from .active_set_presolve import ReducedQP

__all__ = ["Paired", "pair_box", "pair_matrix", "pairs_apply", "PAIRS_KEY", "PAIRS_SHARE_MAX_N"]

#: ``H_s`` kept with the values of H (:mod:`mergeqp.matrix_cache`), so that the solves of a sequence
#: on one H array (a warm-started sequence, a sweep over ``g``) share it and the engine's own values
#: cached with it (its float32 copy and last face factor)
PAIRS_KEY = "active_set.pairs"
#: ... up to this many variables (``H_s`` is a quarter of H: 34 MB at n = 4096)
PAIRS_SHARE_MAX_N = 4096
#: rows of ``H_s`` formed per block (bounds the temporary rows of H that are gathered)
_BLOCK = 256


@dataclass(frozen=True)
class Paired:
    """The reduction's result: the pairs ``a`` / ``b`` (``(m,)`` indices into the problem it was
    made from), their totals ``T``, the box problem and its box structure."""

    a: np.ndarray
    b: np.ndarray
    totals: np.ndarray
    problem: ReducedQP
    structure: SetStructure

    @property
    def m(self) -> int:
        return int(self.a.size)

    def expand(self, s: np.ndarray) -> np.ndarray:
        """The whole point ``x``: ``x_a = s``, ``x_b = T - s``."""
        s = np.asarray(s, dtype=np.float64).ravel()
        x = np.empty(2 * self.m)
        x[self.a] = s
        x[self.b] = self.totals - s
        return x

    def start(self, x: np.ndarray) -> np.ndarray:
        """The box point of a start ``x`` of the whole problem (a warm start): its ``a`` values,
        clipped to the box."""
        s = np.asarray(x, dtype=np.float64).ravel()[self.a]
        return np.clip(s, self.structure.lo, self.structure.hi)


def _pairs(st: SetStructure) -> tuple[np.ndarray, np.ndarray] | None:
    """``(a, b)``: the two coordinates of each sum group (``a < b``), or ``None`` unless every
    coordinate is in a group of exactly two."""
    if st.group is None or st.totals is None or st.center is not None:
        return None
    G = st.totals.size
    if G == 0 or st.group.size != 2 * G:
        return None
    if not bool(np.all(np.bincount(st.group, minlength=G) == 2)):
        return None
    order = np.argsort(st.group, kind="stable").reshape(G, 2)  # (each group's two, in index order)
    return np.ascontiguousarray(order[:, 0]), np.ascontiguousarray(order[:, 1])


def _pair_box_bounds(st: SetStructure) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """``(a, b, T, lo, hi)``: the pairs, their totals and the box of ``s = x_a``, or ``None`` where the
    set is not pairs or a pair's box is empty or unbounded (see :func:`pair_box`)."""
    found = _pairs(st)
    if found is None:
        return None
    a, b = found
    assert st.totals is not None and st.group is not None
    T = np.asarray(st.totals, dtype=np.float64)[st.group[a]]
    lo = np.maximum(st.lo[a], T - st.hi[b])
    hi = np.minimum(st.hi[a], T - st.lo[b])
    if not (bool(np.all(lo <= hi)) and bool(np.all(np.isfinite(lo))) and bool(np.all(np.isfinite(hi)))):
        return None  # (an unbounded pair stays with the engine, whose unboundedness checks see the sums)
    return a, b, T, lo, hi


def pairs_apply(st: SetStructure) -> bool:
    """Whether :func:`pair_box` reduces a problem on the set ``st`` (for ``auto``'s memory rule:
    the reduced solve holds a quarter of H and its float32 copy instead of a float32 copy of H)."""
    return _pair_box_bounds(st) is not None


def pair_matrix(H: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``H_s = (H_aa + H_bb) - (H_ab + H_ba)`` (``(m, m)``, exactly symmetric when H is: both sums
    are of the same two numbers at ``(j, k)`` and ``(k, j)``), in blocks of :data:`_BLOCK` rows, so that
    beyond ``H_s`` only a block's rows are held; contiguous halves (the per-atom simplex of two models:
    ``a = 0..m-1``, ``b = m..2m-1``) are read as slices."""
    m = a.size
    halves = bool(np.array_equal(a, np.arange(m)) and np.array_equal(b, np.arange(m, 2 * m)))
    out = np.empty((m, m))
    for lo in range(0, m, _BLOCK):
        hi = min(lo + _BLOCK, m)
        if halves:
            rows_a, rows_b = H[lo:hi], H[m + lo:m + hi]
            same = rows_a[:, :m] + rows_b[:, m:]
            cross = rows_a[:, m:] + rows_b[:, :m]
        else:
            rows_a, rows_b = np.take(H, a[lo:hi], axis=0), np.take(H, b[lo:hi], axis=0)
            same = np.take(rows_a, a, axis=1)
            same += np.take(rows_b, b, axis=1)
            cross = np.take(rows_a, b, axis=1)
            cross += np.take(rows_b, a, axis=1)
        np.subtract(same, cross, out=out[lo:hi])
    return out


def pair_box(H: np.ndarray, g: np.ndarray, c: float, st: SetStructure) -> Paired | None:
    """The box QP of a set whose sum groups all have two coordinates (see the module doc), or
    ``None`` where the set is not one (a group of one or of three or more, a ball, bounds only), or
    where a pair's box is empty (an infeasible set) or unbounded (a user's sum without a lower
    bound): those stay with the engine."""
    n = g.shape[0]
    found = _pair_box_bounds(st)
    if found is None:
        return None
    a, b, T, lo, hi = found
    shared = matrix_values(H) if n <= PAIRS_SHARE_MAX_N else None
    cached = None if shared is None else shared.get(PAIRS_KEY)
    if cached is not None and np.array_equal(cached[0], a) and np.array_equal(cached[1], b):
        Hs = cached[2]
    else:
        Hs = pair_matrix(H, a, b)
        if shared is not None:  # read-only: the engine's own values are then cached with it too
            Hs.setflags(write=False)
            shared[PAIRS_KEY] = (a, b, Hs)
    q = np.zeros(n)
    q[b] = T
    Hq = H @ q
    grad_q = Hq + g
    gs = np.ascontiguousarray(grad_q[a] - grad_q[b])
    cs = float(0.5 * (q @ Hq) + g @ q + c)
    m = a.size
    box = SetStructure(np.ascontiguousarray(lo), np.ascontiguousarray(hi))
    # (shape (2, m): the engine's default start 1/K is then 1/2, the middle of a pair summing to 1)
    return Paired(a, b, T, ReducedQP(Hs, gs, cs, (2, m)), box)

