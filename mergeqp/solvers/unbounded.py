"""Checking a claim that ``J`` is unbounded below, before reporting it as a proof.

Sparse solvers detect unboundedness ("dual infeasibility") with tolerances, and a pseudo-inverse
drops tiny eigenvalues: on a badly conditioned but bounded problem both can claim unboundedness
wrongly (``H = diag(1e8, 1e-8)`` has a finite minimum). A claim becomes an
:class:`~mergeqp.errors.UnboundedError` only when it survives these float64 checks; otherwise
it is a :class:`~mergeqp.errors.SolverError` (so ``auto`` falls back to another solver):

- the constraint set is not known to be bounded (its ``bounded`` capability: a box with finite
  bounds, a simplex, an L1 ball, or an intersection with one of them, is bounded: J has a
  minimum there);
- with a direction ``v`` (the solver's certificate, or the part of ``-g`` outside the numerical
  range of H): the ray stays in the set (its ``recession_violation`` is at most
  :data:`RAY_IN_SET_TOL` for ``|v|_inf = 1``), ``g'v < 0``, ``v'Hv <= FLAT * max diag H`` and the decrease of J along the ray,
  ``(g'v)^2 / (2 v'Hv)`` (infinite when ``v'Hv <= 0``), above :data:`RAY_RATIO` times the
  problem's natural scale ``|c| + |g|^2 / max diag H``: a minimum that far out is beyond float64;
- without a direction (CVXPY reports only a status): J is not bounded below on all of ``R^n``
  (:func:`bounded_below_everywhere`, explicit H).

:func:`unbounded_after_solve` runs the same checks on a ray of its own after a solve that no bound
could certify: a solver that reports no unboundedness (it stopped at a far point, or its own
direction was refuted) does not turn a provably unbounded problem into an uncertified "answer".
A slope along a computed flat direction at most ``1e-8`` of ``|g|`` is not called unbounded (it may
be the rounding of statistics; the certificate then says it cannot bound the gap); along a
coefficient whose row and column of H are exactly zero (a dead unit) any nonzero slope is.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..constraints import ConstraintSet, SetStructure
from ..errors import MergeQPError, SolverError, UnboundedError
from ..problem import MergeQP, stable_norm
from .unconstrained import unconstrained_minimiser

#: a ray counts as flat when its curvature is at most this fraction of the largest diagonal of H
FLAT = 1e-10
#: ... and J falls along it by more than this multiple of the problem's natural scale
RAY_RATIO = 1e12


def known_bounded(cset: ConstraintSet) -> bool:
    """Whether ``cset`` is certainly bounded (its ``bounded`` capability)."""
    return cset.bounded


#: a ray stays in the set when its recession-cone violation is at most this (|v|_inf = 1)
RAY_IN_SET_TOL = 1e-6


def _top_diag(problem: MergeQP) -> float:
    diag = np.diag(problem.H) if problem.H is not None else problem.diagonal()
    return float(np.max(np.abs(diag), initial=0.0))


def descent_ray(problem: MergeQP, v: Any) -> str | None:
    """Why ``J`` decreases without bound (to float64 precision) along ``v``; ``None`` if it
    does not (see the module docstring)."""
    v = np.asarray(v, dtype=np.float64).ravel()
    nv = float(np.linalg.norm(v))
    if v.size != problem.n or not math.isfinite(nv) or nv == 0:
        return None
    v = v / nv
    gv = float(problem.g @ v)
    if not gv < -1e-8 * max(stable_norm(problem.g), np.finfo(float).tiny):
        return None
    curv = float(v @ problem.matvec(v))
    top = _top_diag(problem)
    if curv > FLAT * max(top, np.finfo(float).tiny):
        return None
    # (as ratios before squaring: g'g and gv^2 overflowed at a scale of 1e200, and the ray was refused)
    natural = abs(problem.c) + ((stable_norm(problem.g) / math.sqrt(top)) ** 2 if top > 0 else 0.0)
    drop = math.inf if curv <= 0 else (gv / math.sqrt(2.0 * curv)) ** 2
    if drop <= RAY_RATIO * max(natural, np.finfo(float).tiny):
        return None
    return (f"J decreases without bound along a direction v (|v| = 1) with v'Hv = {curv:.2g} "
            f"and g'v = {gv:.3g} < 0")


def bounded_below_everywhere(problem: MergeQP) -> bool:
    """Whether J is bounded below on all of ``R^n`` (then on any set), to float64 precision:
    ``g`` lies in the numerical range of an explicit H, or the part of ``-g`` outside it is not
    a ray of unbounded descent (:func:`descent_ray`). ``False`` when unknown (matvec-only H)."""
    if problem.H is None:
        return False
    found = unconstrained_minimiser(problem.H, problem.g)
    if found.outside <= 1e-8 or found.ray is None:
        return True
    return descent_ray(problem, found.ray) is None


def unbounded_claim(problem: MergeQP, cset: ConstraintSet, solver: str, status: str,
                    direction: Any = None) -> SolverError:
    """The error to raise for ``solver``'s claim (``status``) that J is unbounded below on
    ``cset``: an :class:`UnboundedError` when verified, else a :class:`SolverError`."""
    def refuted(why: str) -> SolverError:
        others = " or ".join(f"'{name}'" for name in ("active_set", "clarabel", "osqp") if name != solver)
        return SolverError(
            f"{solver}: reported the problem as unbounded below ({status}), but {why}; the "
            f"problem is probably badly conditioned: try solver={others}, or rescale H and g"
        )

    if known_bounded(cset):
        return refuted(f"the set {cset.spec} is bounded, so J has a minimum on it")
    if direction is not None:
        v = np.asarray(direction, dtype=np.float64).ravel()
        top = float(np.max(np.abs(v), initial=0.0))
        if v.size == problem.n and top > 0 and math.isfinite(top):
            off = cset.recession_violation((v / top).reshape(problem.shape))
            if off is None:
                return refuted(f"the set {cset.spec} declares no recession-cone test, so the ray "
                               f"cannot be shown to stay in it")
            if off > RAY_IN_SET_TOL:
                return refuted(f"its direction leaves the set {cset.spec} (recession-cone violation "
                               f"{off:.2g})")
        why = descent_ray(problem, direction)
        if why is None:
            own = unbounded_after_solve(problem, cset, solver, f"{status}: its own direction was not one")
            if own is not None:
                return own
            error = refuted("its direction of unboundedness is not one of unbounded descent")
            error.ray_searched = True  # type: ignore[attr-defined]  # auto's fallback need not search again
            return error
        return verified_claim(
            UnboundedError(f"{solver}: the problem is unbounded below on {cset.spec}: {why} ({status})"))
    if bounded_below_everywhere(problem):
        return refuted("J is bounded below even without constraints (g lies in the numerical "
                       "range of H, or J has a finite minimum along the part outside it)")
    return verified_claim(UnboundedError(f"{solver}: the problem is unbounded below on {cset.spec} ({status})"))


#: :func:`unbounded_after_solve` looks for a ray (an eigendecomposition of H) up to this many variables
RAY_SEARCH_MAX_N = 4096
#: ... and takes it as staying in the set when its recession-cone violation (``|v|_inf = 1``) is at most
#: this: rounding only (a solver's own ray gets :data:`RAY_IN_SET_TOL`; against a user's row scaled by
#: 1e-6 that let a ray leaving the set by 1e-6 through, and a bounded problem was called unbounded)
OWN_RAY_IN_SET_TOL = 1e-12


def into_recession_cone(st: SetStructure, v: np.ndarray) -> np.ndarray:
    """``v`` (flat) with its moves against the bounds of ``st`` removed: 0 where both bounds are
    finite, no decrease where only the lower one is, no increase where only the upper one is
    (the recession cone of the box ``lo <= x <= hi``)."""
    lo_f, hi_f = np.isfinite(st.lo), np.isfinite(st.hi)
    v = np.where(lo_f & hi_f, 0.0, v)
    v = np.where(lo_f & ~hi_f, np.maximum(v, 0.0), v)
    return np.where(hi_f & ~lo_f, np.minimum(v, 0.0), v)


def unbounded_after_solve(problem: MergeQP, cset: ConstraintSet, solver: str,
                          context: str = "its point could not be certified") -> UnboundedError | None:
    """A verified :class:`UnboundedError` when J provably falls without bound on ``cset`` along the
    part of ``-g`` outside the numerical range of H (:func:`unconstrained_minimiser`'s ray), as it
    is or put in the recession cone of the set's bounds: the ray stays in the set
    (``recession_violation`` at most :data:`OWN_RAY_IN_SET_TOL`) and :func:`descent_ray` holds. ``None``
    otherwise, and for a set known to be bounded, a matrix-free H or more than
    :data:`RAY_SEARCH_MAX_N` variables. For a solve whose answer no bound certified (stop 55: an
    unbounded ``nonneg`` QP came back as active_set's uncertified point at |d| 5e4, and
    ``dense_ipm`` called one "optimal" at |d| 2.7e8)."""
    if problem.H is None or known_bounded(cset):
        return None
    dead = _dead_coordinate_ray(problem, cset, solver, context)
    if dead is not None or problem.n > RAY_SEARCH_MAX_N:
        return dead
    found = unconstrained_minimiser(problem.H, problem.g)
    if found.ray is None and found.kernel is None:
        return None
    rays = [] if found.ray is None else [found.ray]
    try:
        st = cset.structure(problem.shape) if cset.members() else SetStructure.free(problem.n)
    except MergeQPError:
        st = None
    if st is not None and st.bounds_only and np.shape(st.lo) == (problem.n,):
        if found.ray is not None:
            rays.append(into_recession_cone(st, found.ray))
        if found.kernel is not None and found.kernel.shape[1]:
            searched = _kernel_ray(problem.g, found.kernel, st)
            if searched is not None:
                rays.append(searched)
    for v in rays:
        top = float(np.max(np.abs(v), initial=0.0))
        if not (top > 0 and math.isfinite(top)):
            continue
        why = descent_ray(problem, v)
        if why is None:
            continue
        try:
            off = cset.recession_violation((v / top).reshape(problem.shape))
        except MergeQPError:
            off = None
        if off is not None and off <= OWN_RAY_IN_SET_TOL:
            return verified_claim(UnboundedError(
                f"{solver}: the problem is unbounded below {_on(cset)}: {why} ({context}; the ray was "
                f"found from H and g)"))
    return None


def _kernel_ray(g: np.ndarray, kernel: np.ndarray, st: SetStructure) -> np.ndarray | None:
    """The direction of steepest descent of ``g`` inside the numerical kernel of H (``kernel``,
    orthonormal columns) and the recession cone of the bounds ``st``: an LP over the kernel's
    coordinates ``y`` in ``[-1, 1]`` (HiGHS), put exactly into the cone afterwards; ``None`` when
    ``g`` does not fall along any such direction. For a ray that neither ``-g``'s own kernel part nor
    its clipped version is (an adversarial review's: H of rank 40 of 100 on ``nonneg``, whose
    unbounded QP came back as an uncertified point with status optimal); :func:`descent_ray` judges it."""
    from scipy.optimize import linprog  # (scipy is a dependency; only this rare path needs the LP)

    lo_f, hi_f = np.isfinite(st.lo), np.isfinite(st.hi)
    both, lower, upper = lo_f & hi_f, lo_f & ~hi_f, hi_f & ~lo_f
    A_ub = np.vstack([-kernel[lower], kernel[upper]])
    A_eq = kernel[both]
    cost = kernel.T @ g
    try:
        res = linprog(cost, A_ub=A_ub if A_ub.shape[0] else None, b_ub=np.zeros(A_ub.shape[0]) if A_ub.shape[0] else None,
                      A_eq=A_eq if A_eq.shape[0] else None, b_eq=np.zeros(A_eq.shape[0]) if A_eq.shape[0] else None,
                      bounds=[(-1.0, 1.0)] * kernel.shape[1], method="highs")
    except ValueError:
        return None
    if res.status != 0 or res.x is None or not res.fun < 0:
        return None
    return into_recession_cone(st, kernel @ res.x)


def _on(cset: ConstraintSet) -> str:
    return f"on {cset.spec}" if cset.members() else "without constraints"


def _dead_coordinate_ray(problem: MergeQP, cset: ConstraintSet, solver: str, context: str) -> UnboundedError | None:
    """Exact unboundedness along a coefficient whose row and column of H are zero (a dead unit)
    while its ``g`` is not: J is exactly linear along it, so any slope is real (no rounding to
    excuse, unlike a computed null space), and the ray in the descent direction stays in the set
    exactly (its recession-cone violation 0: a user's row scaled by 1e-6 against it, inside
    :data:`RAY_IN_SET_TOL`, turned a bounded problem into an UnboundedError in a review)."""
    assert problem.H is not None
    H, g = problem.H, problem.g
    for j in np.flatnonzero((np.diag(H) == 0) & (g != 0))[:64]:
        if np.any(H[:, j] != 0) or np.any(H[j] != 0):
            continue
        v = np.zeros(problem.n)
        v[j] = -math.copysign(1.0, float(g[j]))
        try:
            off = cset.recession_violation(v.reshape(problem.shape))
        except MergeQPError:
            off = None
        if off is not None and off <= 0.0:  # exactly a ray of the set, as J is exactly linear along it
            k, a = divmod(int(j), problem.shape[1])
            way = "grows" if v[j] > 0 else "falls"
            return verified_claim(UnboundedError(
                f"{solver}: the problem is unbounded below {_on(cset)}: coefficient [{k}, {a}] has no "
                f"curvature (its row and column of H are zero) and a slope g = {float(g[j]):.3g}, so J falls "
                f"without bound as it {way} ({context})"))
    return None


def verified_claim(error: UnboundedError) -> UnboundedError:
    """``error`` marked as checked by :func:`unbounded_claim` (the registry checks a claim that is not)."""
    error.verified = True  # type: ignore[attr-defined]
    return error
