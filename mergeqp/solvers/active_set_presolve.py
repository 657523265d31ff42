"""Decoupled coordinates: the active-set solver's presolve (:mod:`.active_set`).

A coordinate ``i`` whose row of H is zero (a dead unit on the calibration data, a row that a
fine-tune left unchanged) enters ``J`` only through ``g_i x_i``. Left in the problem, it makes
every face on which it is free singular, and each such face is solved by a ridged factorisation
with iterative refinement instead of one Cholesky (on the real MNIST QP ``mnist_real640``, 84
zero rows of 640: half of the solve's time). Where its optimal value can be read off the set,
it is taken out and the engine solves the rest:

- bounds only: ``x_i = lo_i`` where ``g_i > 0``, ``hi_i`` where ``g_i < 0`` (a coordinate whose
  bound on that side is infinite stays: the engine reports the problem unbounded), and the start
  clipped to the bounds where ``g_i = 0`` (every value is optimal; the start, ``1/K`` or the
  caller's ``x0``, is where the solver would have left it);
- sum groups (simplices): a group whose coordinates all have zero rows is a linear program over
  its part of the set: the start projected onto it where its ``g`` is zero, else the exact
  linear minimiser (:func:`~mergeqp.constraints.kernels.lmo_structure`); groups with any live
  coordinate stay whole;
- an L1 ball: ``x_i = c_i`` (the centre) where ``g_i = 0``: it costs none of the radius and
  changes nothing else, so any feasible point can be moved there without raising J.

Exact: the optimum of the reduced problem with these values is an optimum of the whole (the
certificate, computed on the whole problem, checks it). Only exact zeros are taken out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..constraints.kernels import SetStructure, lmo_structure, project_structure
from ..matrix_cache import matrix_values

__all__ = ["Decoupled", "ReducedQP", "decouple", "PRESOLVE_MAX_N"]

#: above this size no presolve (the reduced copy of H would add up to H's memory to the solve's
#: work arrays, which ``auto``'s memory model does not count)
PRESOLVE_MAX_N = 8192
#: the reduced H, kept with the values of the whole H (:mod:`mergeqp.matrix_cache`) so that the
#: solves of a sequence on one H array share it, and with it the engine's own cached values (its
#: float32 copy and last face factor)
REDUCED_KEY = "active_set.decoupled"
#: ... up to this many variables (it stays while H does: 134 MB at most at n = 4096); above, each
#: solve makes its own copy and frees it at its end
REDUCED_SHARE_MAX_N = 4096


@dataclass(frozen=True)
class ReducedQP:
    """The problem the engine solves after the presolve: ``H`` ``(m, m)``, ``g`` ``(m,)``, ``c``
    (with the decoupled coordinates' ``g_i x_i`` added) and ``shape`` ``(K, m)``, of which the
    engine reads ``K`` for its default start ``1/K``."""

    H: np.ndarray
    g: np.ndarray
    c: float
    shape: tuple[int, int]

    @property
    def n(self) -> int:
        return int(self.g.shape[0])


@dataclass(frozen=True)
class Decoupled:
    """The presolve's result: ``keep`` (the indices the engine solves), ``fixed`` (``(n,)``: the
    values of the decoupled coordinates, the kept ones ignored), the reduced problem and its set."""

    keep: np.ndarray
    fixed: np.ndarray
    problem: ReducedQP
    structure: SetStructure

    @property
    def removed(self) -> int:
        return int(self.fixed.size - self.keep.size)

    def expand(self, x_kept: np.ndarray) -> np.ndarray:
        """The whole ``(n,)`` point: the engine's values on ``keep``, the fixed ones elsewhere."""
        x = self.fixed.copy()
        x[self.keep] = x_kept
        return x


def _restrict(st: SetStructure, idx: np.ndarray) -> SetStructure:
    """``st`` on the coordinates ``idx`` (whole groups only: their sums are kept)."""
    group = totals = None
    if st.group is not None:
        assert st.totals is not None
        ids, group = np.unique(st.group[idx], return_inverse=True)
        totals = st.totals[ids]
    center = None if st.center is None else st.center[idx]
    return SetStructure(st.lo[idx], st.hi[idx], group, totals, center, st.radius)


def decouple(H: np.ndarray, g: np.ndarray, c: float, shape: tuple[int, int], st: SetStructure,
             x0: np.ndarray | None) -> Decoupled | None:
    """Take the coordinates with zero rows of ``H`` out of the problem where their optimal values
    follow from the set (see the module doc); ``None`` when none can be (or above
    :data:`PRESOLVE_MAX_N`, or when nothing would be left). ``x0``: the solve's warm start
    (``None``: ``1/K``); projected onto the set, its values are kept where every value is optimal."""
    n = g.shape[0]
    if n > PRESOLVE_MAX_N:
        return None
    cand = np.flatnonzero(np.diagonal(H) == 0)
    if cand.size == 0:
        return None
    zero = np.zeros(n, dtype=bool)
    zero[cand[~np.any(np.take(H, cand, axis=0), axis=1)]] = True
    start = np.full(n, 1.0 / shape[0]) if x0 is None else np.asarray(x0, dtype=np.float64).ravel()
    fixed = np.array(project_structure(st, start), copy=True)  # (a feasible start comes back as itself)
    out = np.zeros(n, dtype=bool)  # decoupled and fixed
    if st.group is not None:
        assert st.totals is not None
        if not bool(np.all(np.isfinite(st.lo))):
            return None  # (a user's sum structure without lower bounds: its LPs may be unbounded)
        dead = np.bincount(st.group, weights=~zero, minlength=st.totals.size) == 0
        out = dead[st.group]
        if out.any():
            idx = np.flatnonzero(out)
            linear = np.zeros(st.totals.size, dtype=bool)
            linear[st.group[idx[g[idx] != 0]]] = True
            lp = np.flatnonzero(out & linear[st.group])
            if lp.size:  # an LP over those groups: its exact minimiser
                s = lmo_structure(_restrict(st, lp), g[lp])[1]
                assert s is not None  # (a sum group is bounded)
                fixed[lp] = s
    elif st.center is not None:
        out = zero & (g == 0)
        fixed[out] = st.center[out]
    else:
        side = np.where(g > 0, st.lo, np.where(g < 0, st.hi, fixed))  # (fixed: the start, clipped)
        out = zero & np.isfinite(side)
        fixed[out] = side[out]
    keep = np.flatnonzero(~out)
    if keep.size == n or keep.size == 0:
        return None
    shared = matrix_values(H) if n <= REDUCED_SHARE_MAX_N else None
    cached = None if shared is None else shared.get(REDUCED_KEY)
    if cached is not None and np.array_equal(cached[0], keep):
        H_kept = cached[1]
    else:
        H_kept = np.take(np.take(H, keep, axis=0), keep, axis=1)
        if shared is not None:  # read-only: the engine's own values are then cached with it too
            H_kept.setflags(write=False)
            shared[REDUCED_KEY] = (keep, H_kept)
        # (a copy that is not kept stays writable: the cache takes no entry for it, which would push
        # out H's own, e.g. the certificate's factorisation)
    rest = np.flatnonzero(out)
    reduced = ReducedQP(H_kept, np.ascontiguousarray(g[keep]), float(c + g[rest] @ fixed[rest]),
                        (shape[0], int(keep.size)))
    return Decoupled(keep, fixed, reduced, _restrict(st, keep))
