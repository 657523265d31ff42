"""An interior point on ``sigma I + U U'`` for the active-set solver's start (:mod:`.active_set`), where
H is a weak ridge (or none) plus a low-rank matrix of medium rank.

Where ``H = sigma I + U U' + E`` with ``r`` between the path's rank limit (``n / 8``,
:mod:`.active_set_low_rank`) and ``n / 4``, and a ridge weak enough that the faces are
ill-conditioned (``sigma <=`` :data:`IPM_RIDGE` of the top eigenvalue, cond >= 1e7), the primal
active-set engine crawls through its proximal levels (38 factorisations on ``box_lowrank`` at
n = 640), and the path's dual loses on natural instances at these ranks (docs/solvers.md, stops 64 and
68). An interior point does not care how the faces are conditioned, and with H in that form each of
its Newton systems ``(D + U U') dx = b`` (``D`` the ridge plus the bounds' weights ``z / s``, a
diagonal) is solved by the Woodbury identity: one ``r x r`` Gram matrix ``I + U'D^-1 U`` (a BLAS
``syrk``, ``n r^2`` flops) and its Cholesky factor, instead of a Cholesky of an ``n x n`` matrix.

- **Candidates** (:func:`ipm_gate`, at no cost): a bounded set of bounds and sum groups (finite
  boxes, per-atom, global and capped simplices; one-sided bounds, whose optimum can lie far from the
  iteration's start, only late, since stop 72; not L1 balls), from n = :data:`IPM_MIN_N`, where the
  sampled principal block that the path's detection already took (:func:`~.active_set_low_rank.ridge_low_rank`, whose
  ``notes`` hand over its extreme eigenvalues) is ill-conditioned (smallest over largest eigenvalue
  at most :data:`SAMPLE_RATIO`: the block of a well-conditioned H, e.g. every built-in family with
  ``cond <= 1e6``, shows 1e-5 or more). **Late candidates** (stop 71; on sum groups too since stop 72):
  where that block is well-conditioned, the pre-test waits until the engine's faces' work reached
  :data:`LATE_WORK` (one) Cholesky factorisations of H, and the head start after it is the interior
  point's whole estimated work (``active_set.LATE_SHARE``), and ranks up to n / 3
  (:data:`LATE_RANK_SHARE`) are taken: a block of n / 6 rows is full rank where H's rank lies above
  n / 6, so it cannot tell such an H from a full-rank one, and on interpolating boxes of that kind
  (J* ~ 0, most coordinates free) the engine alone took ~35 faces of nearly all coordinates (4-9x
  ``dense_ipm``; on per-atom simplices ~40 faces, 6-10x, stop 72). A late candidate's engine counts its
  faces' work by the order of the matrices they factorise (on per-atom simplices one coordinate per
  atom fewer than the free ones: ``active_set._Engine.face_order``), so that on planted simplices, whose
  faces are cheap, it finishes within that work as before. Solves that end before that work pay
  nothing; where the engine's last face is within ``active_set.LATE_NEAR`` of its own test, the
  interior point is not run (it is about to finish). An
  early candidate on bounds alone whose pre-test or detection declines at n / 4 is tried again on this
  schedule, up to n / 3, where the problem then looks interpolating (``active_set.INTERPOLATING``).
- **The engine's head start** (``active_set._with_interior_point``): the engine runs first, until its
  faces' work (``n_F^3 / 3`` and the products per face) exceeds ``IPM_HEAD_START`` (0.1) of the
  interior point's estimated work (:func:`ipm_work`), at first for the smallest rank above the path's
  limit. Where the optimum's free set is small (most coordinates at a bound, one global sum) it
  finishes there: such QPs cost 2-13x the engine alone with the interior point first (a QA review).
  Faces of many free coordinates spend the head start within one or two faces.
- **Pre-test** (:func:`ipm_candidate`), only once that first head start is spent (it cost 2-5 ms on
  solves of a few ms, a QA review): LAPACK's pivoted Cholesky of a larger sampled block, stopped at
  :data:`PRETEST` of a lower bound on H's top eigenvalue, counts a rank above the path's limit and
  within ``n / 4``; the head start then grows to that rank's share of the work.
- **Detection** (:func:`ipm_low_rank`), only after the grown head start is spent too (where the
  pre-test or the detection declines, the engine goes on as if it had no budget, losing no work):
  :func:`~.active_set_low_rank.ridge_low_rank` looks for the factor at the limit ``n / 4``, with a
  ridge of at most :data:`IPM_RIDGE` of H's top eigenvalue, or none (since stop 70: a Woodbury solve
  divides by ``D``, which is then the bounds' weights alone, positive at every interior iterate where
  every coordinate has a finite bound; they tend to 0 on the free coordinates, as a ridge's share of
  ``D`` does at 1e-9 of the top, and the iteration converged alike on interpolating and singular
  H, measured). A ridge that the path takes as none (below ``SIGMA_MIN`` of the top) is kept in the
  model (``RidgeLowRank.with_weak_ridge``).
- **The iteration** (:func:`solve_low_rank_ipm`): Mehrotra's predictor-corrector on the bounds
  (finite ones only) and the sum groups' equations (per-atom or global simplices: the identity is
  applied to the whole Newton system, whose part without ``U U'`` the disjoint groups make solvable
  in ``O(n)``; :class:`_Woodbury`), on ``J / scale`` (``scale = max(max |g|, max diag H)``), residuals
  from the true H (one product per iteration), Newton systems on ``sigma I + U U'``, refined once
  against that model. It stops where the complementarity relative to ``|J|`` and the residuals are
  below ``tol``, at float64's rounding of the scaled problem, or where its absolute progress stops
  (has not halved in :data:`STALL` iterations, since stop 72).

Its point goes to the engine, which returns it at once where it meets the engine's stopping test
(the certificate's gap) and otherwise continues from it: the interior point changes how fast, never
what is certified. L1 balls are left to the path and the engine.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import scipy.linalg as sla
from scipy import sparse

from ..cholesky import cho_solve
from ..constraints.kernels import SetStructure
from ..matrix_cache import matrix_values
from .base import power_top_eigenvalue
from .ipm_linalg import max_step
from .active_set_low_rank import EPS, RidgeLowRank, rank_limit, ridge_low_rank, sampled_rank

__all__ = ["ipm_candidate", "ipm_gate", "ipm_may_apply", "ipm_low_rank", "ipm_work", "solve_low_rank_ipm",
           "IPM_RANK_SHARE", "IPM_RIDGE", "IPM_MIN_N", "LATE_WORK", "LATE_RANK_SHARE"]

#: the largest rank taken, as a share of n (above the path's limit, ``n / 8``)
IPM_RANK_SHARE = 1.0 / 4.0
#: the largest ridge taken, relative to H's top eigenvalue (cond >= 1e7: below it the engine's faces are
#: well enough conditioned; on a first grid the interior point was slower on 7 of 10 cells at cond
#: 1e4-1e6, stop 69)
IPM_RIDGE = 1e-7
#: the path's sampled block must have a smallest / largest eigenvalue at most this for the pre-test to run
#: after the engine's first head start; above it only after :data:`LATE_WORK`
SAMPLE_RATIO = 1e-5
#: where the sampled block is well-conditioned, the pre-test waits until the engine's faces' work
#: (``active_set.face_work``) reached this many times the flops of one Cholesky of H (``n^3 / 3``)
LATE_WORK = 1.0
#: ... and the largest rank it takes is this share of n (interpolating boxes of rank n / 3: the engine alone
#: 2.1 s, with the interior point 0.7-0.9 s, ``dense_ipm`` 0.5 s, n = 1536, stop 71)
LATE_RANK_SHARE = 1.0 / 3.0
#: the pre-test's pivoted Cholesky stops where the remaining diagonal falls below this share of a lower
#: bound on H's top eigenvalue (the ridge's Schur complement is several times the ridge, itself up to
#: 1e-7 of the top eigenvalue); at 1e-4 it stopped below the rank of H's without a ridge whose
#: spectrum decays (``box_singular``, n = 3072: 564 of 800), and their declining cost an eigenvalue
#: decomposition of 1,024 rows (70 ms, 0.2x one Cholesky of H)
PRETEST = 1e-6
#: smaller problems are left to the engine
IPM_MIN_N = 256
#: the fraction of the step to the boundary taken
STEP_FRACTION = 0.99
#: iterations at most
MAX_ITER = 60
#: the iteration ends where its progress (absolute complementarity and residuals) gained nothing in this
#: many iterations
STALL = 4
#: ... where a gain is a progress below this share of the last gain's once the progress is at most
#: :data:`STALL_SMALL` (since stop 72; before, and above it, any new best: at the rounding floor of
#: interpolating boxes the best crept down by a few percent per iteration, and 20 of the iteration's 33
#: iterations went by after it had reached 1e-14)
STALL_GAIN = 0.5
#: ... (above it any new best is a gain: on a wide capped simplex the progress fell by 30% over the first
#: 4 iterations and then converged, a QA review, stop 72)
STALL_SMALL = 1e-10
#: ... or where that progress is at float64's rounding of the scaled problem
PROGRESS_FLOOR = 1e-15
IPM_KEY = "active_set.low_rank_ipm"


def ipm_gate(H: np.ndarray, st: SetStructure, notes: dict[str, Any]) -> str | None:
    """When the interior point's pre-test (:func:`ipm_candidate`) may run: ``"early"`` where the path's
    sampled block is ill-conditioned (smallest over largest eigenvalue at most :data:`SAMPLE_RATIO`; the
    engine's first head start), ``"late"`` where it is not (only once the engine's faces' work reached
    :data:`LATE_WORK` times one Cholesky of H: a block of n / 6 rows is full rank where H's rank lies
    between n / 6 and n / 4, so it cannot tell such an H, stop 71; on a set with one-sided bounds, e.g.
    ``nonneg``, only this, since stop 72: there the iteration's start can be far from an optimum of the
    problem's own size, and as an early candidate it took 38-48 iterations where the engine needed 5 faces,
    a QA review, stop 69), ``None`` where the interior point does not apply: a coordinate has no finite
    bound, the set has an L1 ball, n is below :data:`IPM_MIN_N`, no block was sampled (``notes``: what the
    path's detection found in the block it sampled, :func:`~.active_set_low_rank.ridge_low_rank`'s
    ``sample_ratio`` and ``sample_top``), or ``n / 4`` is within the path's limit. Costs nothing."""
    n = int(H.shape[0])
    if st.center is not None or n < IPM_MIN_N:
        return None
    one_sided = not st.bounded  # (then late only, where every coordinate has a finite bound)
    if one_sided and not bool(np.all(np.isfinite(st.lo) | np.isfinite(st.hi))):
        return None
    ratio, top_eig = notes.get("sample_ratio"), notes.get("sample_top")
    if ratio is None or top_eig is None or not int(n * IPM_RANK_SHARE) > rank_limit(n, st):
        return None  # (LATE_RANK_SHARE is larger: a late candidate's limit is above the path's too)
    # (a ratio at or below SIGMA_MIN, a ridge too weak for the path or none, is a candidate since stop 70:
    # the interior point keeps a weak ridge in its model, and without one the bounds' weights are D)
    if ratio <= SAMPLE_RATIO and not one_sided:
        return "early"
    # late: on sum groups too since stop 72 (before, on planted per-atom simplices of rank n / 5 to n / 4
    # the interior point ran where the engine was about to finish: 2.1-2.7x the engine alone, stop 71;
    # the late engine now counts the order of what its faces factorise, and finishes first there)
    return "late"


def ipm_may_apply(H: np.ndarray, st: SetStructure, notes: dict[str, Any]) -> bool:
    """Whether the interior point may apply before its pre-test (:func:`ipm_gate` is not ``None``)."""
    return ipm_gate(H, st, notes) is not None


def _max_rank(n: int, st: SetStructure, gate: str | None, late: bool) -> int:
    """The largest rank the pre-test counts and the detection takes: ``n / 4``, ``n / 3``
    (:data:`LATE_RANK_SHARE`) for a late candidate (``gate``) or, with ``late``, on a set of bounds alone."""
    return int(n * (LATE_RANK_SHARE if gate == "late" or (late and st.group is None) else IPM_RANK_SHARE))


def ipm_candidate(H: np.ndarray, st: SetStructure, notes: dict[str, Any], *, seed: int = 0,
                  late: bool = False) -> int | None:
    """The rank that the pre-test counts (see the module doc) where the interior point may apply
    (:func:`ipm_may_apply`), else ``None`` (also for a count within the path's limit or above ``n /
    4``; ``n / 3`` for a late candidate, or with ``late`` on a set of bounds alone: an early candidate
    whose first count declined, ``active_set._head_start``). Kept with the values of a read-only H."""
    gate = ipm_gate(H, st, notes)
    if gate is None:
        return None
    n = int(H.shape[0])
    top_eig = notes["sample_top"]
    limit = rank_limit(n, st)
    max_rank = _max_rank(n, st, gate, late)
    shared = matrix_values(H)
    key = (IPM_KEY + ".pre_test", max_rank, limit, seed)  # (the limit depends on the set)
    if shared is not None and key in shared:
        return shared[key]
    # relative to a lower bound on H's top eigenvalue (the largest diagonal entry of the block, and the
    # top eigenvalue of the path's smaller block, ten times the former on some H); a few pivots above
    # H's rank where the ridge's Schur complement is several times it on some rows
    rank = sampled_rank(H, max_rank, seed, PRETEST, top_at_least=float(top_eig))
    found = rank if rank is not None and rank > limit else None
    if shared is not None:
        shared[key] = found
    return found


def ipm_low_rank(H: np.ndarray, st: SetStructure, notes: dict[str, Any], *,
                 seed: int = 0, late: bool = False) -> RidgeLowRank | None:
    """``H = sigma I + U U'`` for :func:`solve_low_rank_ipm` (see the module doc), or ``None``: no
    candidate (:func:`ipm_candidate`), no such factor within ``n / 4`` (``n / 3`` for a late candidate)
    or within the path's limit (the path takes those), a ridge above :data:`IPM_RIDGE` of H's top eigenvalue (the larger of the
    sample's and a power estimate of ``U U'``'s: a sample of n / 6 rows sees a tenth of it on some H).
    ``sigma`` is 0 where H has no ridge, the weak ridge where the detection took one as none.
    Kept with the values of a read-only H."""
    if ipm_candidate(H, st, notes, seed=seed, late=late) is None:
        return None
    n = int(H.shape[0])
    limit = rank_limit(n, st)
    max_rank = _max_rank(n, st, ipm_gate(H, st, notes), late)
    shared = matrix_values(H)
    key = (IPM_KEY, max_rank, limit, seed)
    if shared is not None and key in shared:
        return shared[key]
    found = None
    lr = ridge_low_rank(H, max_rank=max_rank, seed=seed)
    if lr is not None and lr.sigma == 0 and lr.weak > 0:
        lr = lr.with_weak_ridge()  # (a ridge too weak for the path's algebra is kept in the model here)
    if lr is not None and lr.rank > limit \
            and lr.sigma <= IPM_RIDGE * max(float(notes["sample_top"]), _top_eigenvalue(lr.U, seed)):
        found = lr
    if shared is not None:
        shared[key] = found
    return found


#: the iterations :func:`ipm_work` counts (the measured 12-22, stop 69)
WORK_ITERATIONS = 16


def ipm_work(n: int, rank: int) -> float:
    """The interior point's estimated flops on ``n`` unknowns and rank ``rank``: :data:`WORK_ITERATIONS`
    iterations of a Gram matrix (``n r^2``), a product with H and the solves."""
    return WORK_ITERATIONS * (n * rank * rank + 2.0 * n * n + 8.0 * n * rank)


def _top_eigenvalue(U: np.ndarray, seed: int, steps: int = 8) -> float:
    """An estimate from below of ``U U'``'s largest eigenvalue (that of ``U'U``): a few power steps
    (``O(n r)`` each)."""
    v = np.random.default_rng([seed, U.shape[1]]).standard_normal(U.shape[1])
    return power_top_eigenvalue(lambda w: U.T @ (U @ w), v, steps)


class _Groups:
    """The sum groups' equations ``A x = t`` (one row of ones per group, disjoint): products by
    ``bincount`` and indexing (by a reshape in the columns' layout), a sparse copy for the one matrix
    product per iteration (none in the columns' layout)."""

    def __init__(self, group: np.ndarray, totals: np.ndarray, columns: int | None = None):
        """``columns``: ``K`` where the groups are the columns of the ``(K, groups)`` row-major view
        (:attr:`~mergeqp.constraints.kernels.SetStructure.simplex_columns`: sums by a reshape)."""
        self.group = np.asarray(group, dtype=np.int64)
        self.totals = np.asarray(totals, dtype=np.float64)
        self.count = int(self.totals.size)
        self.columns = columns
        n = self.group.size
        self.matrix = None if columns is not None else sparse.csr_matrix(
            (np.ones(n), (self.group, np.arange(n))), shape=(self.count, n))

    def sums(self, v: np.ndarray) -> np.ndarray:
        """``A v`` for a vector."""
        if self.columns is not None:
            return v.reshape(self.columns, self.count).sum(axis=0)
        return np.bincount(self.group, weights=v, minlength=self.count)

    def sums_of_rows(self, V: np.ndarray) -> np.ndarray:
        """``A V`` for an ``(n, r)`` matrix."""
        if self.matrix is None:
            return V.reshape(self.columns, self.count, V.shape[1]).sum(axis=0)
        return np.asarray(self.matrix @ V)

    def spread(self, y: np.ndarray) -> np.ndarray:
        """``A' y``."""
        if self.columns is not None:
            return np.tile(y, self.columns)
        return y[self.group]


class _Woodbury:
    """Solves the Newton system ``[M A'; A 0] [dx; dy] = [b; c]`` at one iterate, ``M = diag(D) + U U'``
    and ``A`` the sum groups' rows (or none), by the Woodbury identity on the whole system: ``K0 = [D A';
    A 0]`` is solved in ``O(n)`` (the groups are disjoint: its Schur complement ``A D^-1 A'`` is
    diagonal), and ``U U'`` is a rank-``r`` update of it with the ``r x r`` capacitance ``I + U'PU``,
    ``P = D^-1 - D^-1 A'(A D^-1 A')^-1 A D^-1`` (positive semidefinite: ``>= I``). No ``groups x groups``
    matrix is formed (an explicit Schur complement ``A M^-1 A'`` cost 2.5x the box's iteration at
    n = 3072 with 768 groups)."""

    def __init__(self, U: np.ndarray, D: np.ndarray, groups: _Groups | None):
        """``U`` Fortran-ordered (``syrk`` reads it so without a copy)."""
        r = U.shape[1]
        self.U, self.D = U, D
        root = 1.0 / np.sqrt(D)
        W = np.multiply(U, root[:, None], order="F")
        C = sla.blas.dsyrk(1.0, W, trans=1, lower=True)  # W'W = U'D^-1 U, lower triangle
        self.groups = groups
        self.s0: np.ndarray | None = None
        if groups is not None:
            self.s0 = groups.sums(1.0 / D)  # A D^-1 A'
            Vg = groups.sums_of_rows(W * root[:, None])  # A D^-1 U
            Vs = np.asfortranarray(Vg / np.sqrt(self.s0)[:, None])
            C = sla.blas.dsyrk(-1.0, Vs, beta=1.0, c=C, trans=1, lower=True, overwrite_c=True)
        C[np.diag_indices(r)] += 1.0
        self.fac = sla.cho_factor(C, lower=True, check_finite=False)

    def _k0(self, p: np.ndarray, q: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """``K0^-1 [p; q]`` (``q`` ``None``: 0)."""
        if self.groups is None or self.s0 is None:
            return p / self.D, None
        rhs = self.groups.sums(p / self.D)
        y = (rhs if q is None else rhs - q) / self.s0
        return (p - self.groups.spread(y)) / self.D, y

    def _solve(self, b: np.ndarray, c: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        x0, y0 = self._k0(b, c)
        t = cho_solve(self.fac, self.U.T @ x0)
        x1, y1 = self._k0(self.U @ t, None)
        return x0 - x1, (None if y0 is None or y1 is None else y0 - y1)

    def model(self, x: np.ndarray) -> np.ndarray:
        """``M x``."""
        return self.D * x + self.U @ (self.U.T @ x)

    def solve(self, b: np.ndarray, c: np.ndarray | None,
              refine: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
        """``[M A'; A 0] [dx; dy] = [b; c]`` (``dy`` ``None`` without groups), refined once against the
        model (``refine``)."""
        dx, dy = self._solve(b, c)
        if not refine:
            return dx, dy
        res_b = b - self.model(dx)
        res_c = None
        if dy is not None and self.groups is not None and c is not None:
            res_b -= self.groups.spread(dy)
            res_c = c - self.groups.sums(dx)
        ex, ey = self._solve(res_b, res_c)
        return dx + ex, (None if dy is None or ey is None else dy + ey)


def solve_low_rank_ipm(H: np.ndarray, g: np.ndarray, st: SetStructure, lr: RidgeLowRank, *, c: float = 0.0,
                       tol: float = 1e-11, max_iter: int = MAX_ITER) -> tuple[np.ndarray | None, dict[str, Any]]:
    """The best iterate (by the largest of the complementarity and the dual and primal residuals, the
    problem scaled to size 1; it stops where the complementarity relative to ``|J|``, ``J = x'Hx / 2 +
    g'x + c``, and the residuals are below ``tol``) of the interior point on bounds and sum groups (see
    the module doc) and what it did; ``None`` where the set is not one of those (an L1 ball), has no finite bound, or
    the iteration broke down at its first iterate."""
    n = int(g.size)
    info: dict[str, Any] = {"method": "interior point", "rank": lr.rank}
    if st.center is not None:
        return None, info
    lo, hi = np.asarray(st.lo, dtype=np.float64), np.asarray(st.hi, dtype=np.float64)
    L, Uix = np.flatnonzero(np.isfinite(lo)), np.flatnonzero(np.isfinite(hi))
    m = L.size + Uix.size
    if m == 0 or (lr.sigma <= 0 and not bool(np.all(np.isfinite(lo) | np.isfinite(hi)))):
        return None, info  # (without a ridge D is the bounds' weights alone: every coordinate needs one)
    A = None if st.group is None or st.totals is None else _Groups(st.group, st.totals, st.simplex_columns)
    # start: mid-box where both bounds are finite, one unit inside a single bound (in a sum group: the
    # group's equal share of what its total leaves above the lower bounds)
    x = np.zeros(n)
    both = np.isfinite(lo) & np.isfinite(hi)
    x[both] = 0.5 * (lo[both] + hi[both])
    only_lo = np.isfinite(lo) & ~both
    only_hi = np.isfinite(hi) & ~both
    room = np.ones(n)  # how far inside a single bound
    if A is not None:
        # inside a lower bound by an equal share of what its group's total leaves above the lower
        # bounds, so that a per-atom simplex starts on its sums
        left = A.totals - A.sums(np.where(np.isfinite(lo), lo, 0.0))
        share = A.spread(left / np.maximum(A.sums(np.ones(n)), 1.0))
        room = np.where(share > 0, share, 1.0)
    x[only_lo] = lo[only_lo] + room[only_lo]
    x[only_hi] = hi[only_hi] - room[only_hi]
    sl, su = x[L] - lo[L], hi[Uix] - x[Uix]
    if np.any(sl <= 0) or np.any(su <= 0):
        return None, info  # (lo == hi somewhere: the engine's case)
    zl, zu = np.ones(L.size), np.ones(Uix.size)
    y = np.zeros(0 if A is None else A.count)
    # the iteration runs on J / scale (the same minimiser), scale = max(max |g|, max diag H): its start
    # (multipliers 1) is then of the problem's size; unscaled, a problem times 1e8 took twice the
    # iterations on a box and stalled on a simplex
    diag_top = lr.sigma + float(np.max(np.einsum("ij,ij->i", lr.U, lr.U)))  # max diag of sigma I + U U'
    scale = max(float(np.max(np.abs(g), initial=0.0)), diag_top)
    scale = scale if math.isfinite(scale) and scale > 0 else 1.0
    g, c = g / scale, c / scale
    sigma = lr.sigma / scale
    U = np.asfortranarray(lr.U / math.sqrt(scale))
    gscale = 1.0 + float(np.max(np.abs(g), initial=0.0))
    bscale = 1.0 + float(np.max(np.abs(np.concatenate([lo[L], hi[Uix]])), initial=0.0))
    # the relative gap's scale never falls below this (as dense_ipm's SCALE_FLOOR): where J* ~ 0 (an
    # interpolating problem) the gap relative to |J| stalled while it fell, and the iteration ended at its
    # 7th iterate (synthetic-g boxes at n = 288, a QA review)
    floor = max(1e-8 * (abs(c) + float(np.max(np.abs(g), initial=0.0)) + diag_top / scale), EPS)
    best = (math.inf, x, 0)
    best_merit = math.inf
    gained = (math.inf, 0)  # the progress and iteration of the last gain by STALL_GAIN
    it = 0
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for it in range(max_iter + 1):
            Hx = (H @ x) / scale
            rd = Hx + g
            rd[L] -= zl
            rd[Uix] += zu
            if A is not None:
                rd += A.spread(y)
            re = None if A is None else A.sums(x) - A.totals
            J = float(0.5 * x @ Hx + g @ x) + c
            terms = abs(c) + abs(0.5 * float(x @ Hx)) + abs(float(g @ x))
            size = max(abs(J), 1e-8 * terms, floor)
            gap = float(sl @ zl + su @ zu)
            err_d = float(np.max(np.abs(rd))) / (gscale + float(np.max(np.abs(Hx))))
            err_p = 0.0 if re is None else float(np.max(np.abs(re), initial=0.0)) / bscale
            merit = max(gap / size, err_d, err_p)
            # progress in absolute terms (the scaled problem's g and H are of size 1): where J* ~ 0 the
            # relative gap rose while the iteration converged (J fell faster than the gap), and choosing
            # the best iterate by it ended the iteration at its 7th (a QA review: synthetic-g boxes, n = 288)
            progress = max(gap / (1.0 + abs(c)), err_d, err_p)
            if not (math.isfinite(merit) and math.isfinite(progress)):
                break
            if progress < best[0]:
                best = (progress, x, it)
                best_merit = merit
            if progress < (STALL_GAIN if progress <= STALL_SMALL else 1.0) * gained[0]:
                gained = (progress, it)
            if merit <= tol or progress <= PROGRESS_FLOOR or it == max_iter or (it - gained[1] >= STALL):
                break
            mu = gap / m
            w = np.full(n, sigma)
            w[L] += zl / sl
            w[Uix] += zu / su
            try:
                wb = _Woodbury(U, w, A)
            except (np.linalg.LinAlgError, ValueError):
                info["note"] = "a Newton system could not be factorised"
                break

            def newton(rcl: np.ndarray, rcu: np.ndarray, refine: bool = True) -> tuple[np.ndarray, ...]:
                b = -rd.copy()
                b[L] -= rcl / sl
                b[Uix] += rcu / su
                dx, dy = wb.solve(b, None if re is None else -re, refine)
                dzl = (-rcl - zl * dx[L]) / sl
                dzu = (-rcu + zu * dx[Uix]) / su
                return dx, dy, dzl, dzu

            dx, dy, dzl, dzu = newton(sl * zl, su * zu, refine=False)  # (the predictor only sets sigma)
            a = min(1.0, max_step(sl, dx[L]), max_step(su, -dx[Uix]), max_step(zl, dzl), max_step(zu, dzu))
            mu_aff = float((sl + a * dx[L]) @ (zl + a * dzl) + (su - a * dx[Uix]) @ (zu + a * dzu)) / m
            sig = (mu_aff / mu) ** 3 if mu > 0 else 0.0
            dx, dy, dzl, dzu = newton(sl * zl + dx[L] * dzl - sig * mu, su * zu - dx[Uix] * dzu - sig * mu)

            if not all(bool(np.all(np.isfinite(v))) for v in (dx, dzl, dzu)):
                info["note"] = "a Newton direction was not finite"
                break
            a = min(1.0, STEP_FRACTION * min(max_step(sl, dx[L]), max_step(su, -dx[Uix]),
                                             max_step(zl, dzl), max_step(zu, dzu)))
            x = x + a * dx
            if dy is not None:
                y = y + a * dy
            zl, zu = zl + a * dzl, zu + a * dzu
            sl, su = x[L] - lo[L], hi[Uix] - x[Uix]
    progress, x, at = best
    info.update(iterations=it, merit=best_merit, progress=progress, best_iteration=at, objective_scaled_by=scale)
    if not math.isfinite(progress):
        return None, info
    return np.clip(x, lo, hi), info
