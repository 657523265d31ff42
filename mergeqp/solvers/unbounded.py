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
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..constraints import ConstraintSet
from ..errors import SolverError, UnboundedError
from ..problem import MergeQP
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
    if not gv < -1e-8 * max(float(np.linalg.norm(problem.g)), np.finfo(float).tiny):
        return None
    curv = float(v @ problem.matvec(v))
    top = _top_diag(problem)
    if curv > FLAT * max(top, np.finfo(float).tiny):
        return None
    natural = abs(problem.c) + (float(problem.g @ problem.g) / top if top > 0 else 0.0)
    drop = math.inf if curv <= 0 else gv * gv / (2.0 * curv)
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
            return refuted("its direction of unboundedness is not one of unbounded descent")
        return verified_claim(
            UnboundedError(f"{solver}: the problem is unbounded below on {cset.spec}: {why} ({status})"))
    if bounded_below_everywhere(problem):
        return refuted("J is bounded below even without constraints (g lies in the numerical "
                       "range of H, or J has a finite minimum along the part outside it)")
    return verified_claim(UnboundedError(f"{solver}: the problem is unbounded below on {cset.spec} ({status})"))


def verified_claim(error: UnboundedError) -> UnboundedError:
    """``error`` marked as checked by :func:`unbounded_claim` (the registry checks a claim that is not)."""
    error.verified = True  # type: ignore[attr-defined]
    return error
