"""Lower bounds on a linear minimum ``min_{s in C} <grad, s>``: the verdict maths behind the
Frank-Wolfe gap, owned by the certificate (:mod:`mergeqp.certificate`).

A constraint set's oracle (``ConstraintSet.linear_minimum``) returns a :class:`LinearMinimum`:
its minimiser ``s``, the value there, and the evidence it has for a bound (the set says it is
exact; HiGHS's multipliers; a CVXPY solve's status). :func:`lower_bound` turns the evidence
into a :class:`Bound` that says which bound it is (``bound_method``) and, when no bound can be
proven, says why instead of falling back to the primal value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

#: reduced costs this small (relative to max |grad|) on unbounded variables count as zero
#: in the HiGHS dual bound (they are round-off on basic variables)
RC_TOL = 1e-9
#: margin charged below a CVXPY (Clarabel) primal value, relative to ``1 + |value|``: ten times
#: the duality-gap tolerance the LP is solved to (1e-10), or 1e-6 for an ``inaccurate`` solve
SOLVER_MARGIN = 1e-9
SOLVER_MARGIN_INACCURATE = 1e-6

BOUND_EXACT = "exact (closed form)"
BOUND_DUAL = "dual (HiGHS)"
BOUND_USER = "user set (clarabel primal minus a labelled margin)"
BOUND_NONE = "none"


@dataclass(frozen=True)
class LPDuals:
    """What a HiGHS LP ``min cost'z`` over ``A_ub z <= b_ub, A_eq z = b_eq, lb <= z <= ub``
    returned: its multipliers ``y_ub`` (``<= 0`` for a bound) and ``y_eq`` (``None`` when HiGHS
    gave none) and its vertex ``z``. ``cost`` is the scaled objective (``max |grad| = 1``)."""

    cost: np.ndarray
    form: Any  # a LinearForm (A_ub, b_ub, A_eq, b_eq, lb, ub) over z
    y_ub: np.ndarray | None
    y_eq: np.ndarray | None
    z: np.ndarray


@dataclass(frozen=True)
class LinearMinimum:
    """A set's answer to ``min_{s in C} <grad, s>`` (``grad`` of the shape of ``d``).

    ``value``: ``<grad, s>`` at the minimiser ``s`` (``-inf`` with ``s = None`` when the set is
    unbounded along ``-grad``); ``method``: how it was computed (``closed form``, ``LP (HiGHS
    dual bound)``, ``LP (CVXPY/Clarabel)``); ``exact``: ``value`` is the exact minimum (closed
    forms). Evidence for a bound otherwise: ``lp`` (HiGHS multipliers) or ``solver_status``
    (a CVXPY solve, whose value on the scaled objective is ``scaled_primal``); ``scale`` is the
    factor the LP's objective was divided by."""

    value: float
    s: np.ndarray | None
    method: str
    exact: bool = False
    lp: LPDuals | None = None
    solver_status: str | None = None
    scale: float = 1.0
    scaled_primal: float = 0.0


@dataclass(frozen=True)
class Bound:
    """A lower bound ``value`` on the linear minimum (``None``: none proven, ``reason`` says
    why) and the rule that gave it (``method``)."""

    value: float | None
    method: str
    reason: str = ""


#: rounds of :func:`implied_bounds` (each row bounds its variables from the others' bounds)
IMPLIED_ROUNDS = 4
#: an implied bound is loosened by this fraction of the sizes it is computed from (float64 rounding)
IMPLIED_MARGIN = 1e-9


def implied_bounds(form: Any, rounds: int = IMPLIED_ROUNDS) -> tuple[np.ndarray, np.ndarray]:
    """Bounds ``(lo, hi)`` that every point of ``{A_ub z <= b_ub, A_eq z = b_eq, lb <= z <= ub}``
    satisfies: ``lb`` / ``ub`` tightened by activity bounds, row by row (``a_i z_i <= b - sum_{j != i}
    min a_j z_j`` when the others' least activity is finite), for a few rounds. Valid inequalities
    of the feasible set, so a Lagrangian bound may charge reduced costs at them (a variable with no
    bound of its own that the rows bound: a simplex's coefficient, an L1 ball's auxiliary). Each is
    loosened by :data:`IMPLIED_MARGIN` of the sizes it comes from; where they cross (an empty set)
    the form's own bounds are returned."""
    lb = np.asarray(form.lb, dtype=np.float64).copy()
    ub = np.asarray(form.ub, dtype=np.float64).copy()
    n = lb.size
    systems = [(form.A_ub.tocoo(), np.asarray(form.b_ub, dtype=np.float64))]
    if form.A_eq.shape[0]:
        A_eq, b_eq = form.A_eq.tocoo(), np.asarray(form.b_eq, dtype=np.float64)
        systems += [(A_eq, b_eq), (-A_eq, -b_eq)]
    for _ in range(rounds):
        changed = False
        for A, b in systems:
            keep = A.data != 0
            r, c, a = A.row[keep], A.col[keep], A.data[keep]
            if a.size == 0:
                continue
            m = A.shape[0]
            with np.errstate(invalid="ignore"):
                least = np.where(a > 0, a * lb[c], a * ub[c])  # each entry's least a_j z_j (-inf if none)
            open_ = ~np.isfinite(least)
            least = np.where(open_, 0.0, least)
            n_open = np.bincount(r, weights=open_.astype(np.float64), minlength=m)
            total = np.bincount(r, weights=least, minlength=m)
            size = np.bincount(r, weights=np.abs(least), minlength=m) + np.abs(b)
            ok = (n_open[r] - open_) == 0
            slack = b[r] - (total[r] - least) + IMPLIED_MARGIN * size[r] + np.finfo(float).tiny
            with np.errstate(over="ignore"):
                bound = slack / a
            pos, neg = ok & (a > 0) & np.isfinite(bound), ok & (a < 0) & np.isfinite(bound)
            new_hi = np.full(n, np.inf)
            np.minimum.at(new_hi, c[pos], bound[pos])
            new_lo = np.full(n, -np.inf)
            np.maximum.at(new_lo, c[neg], bound[neg])
            tighter_hi, tighter_lo = new_hi < ub, new_lo > lb
            if np.any(tighter_hi) or np.any(tighter_lo):
                ub, lb, changed = np.minimum(ub, new_hi), np.maximum(lb, new_lo), True
        if not changed:
            break
    if np.any(lb > ub):
        return np.asarray(form.lb, dtype=np.float64), np.asarray(form.ub, dtype=np.float64)
    return lb, ub


def dual_bound(cost: np.ndarray, form: Any, y_ub: np.ndarray, y_eq: np.ndarray, z: np.ndarray) -> float | None:
    """``y_ub'b_ub + y_eq'b_eq + sum_i min_{lb_i <= z_i <= ub_i} r_i z_i`` with ``y_ub <= 0``
    (clipped) and reduced costs ``r = cost - A_ub'y_ub - A_eq'y_eq``: weak duality makes it a
    lower bound on the LP minimum for any such multipliers. ``None`` when the multipliers do not
    prove a bound (a reduced cost above :data:`RC_TOL` times the size of what it is computed from,
    ``|cost_i| + |A_i|_1`` capped at 1, on a variable with no bound on that side). The bounds are
    the form's own tightened by what its rows imply (:func:`implied_bounds`): before stop 55 a
    reduced cost of -1e-10 on a simplex coefficient at 0 (no upper bound of its own, 1 by its row)
    was charged at the vertex, and the bound stood 1.3e-16 above the LP minimum, which certified a
    point 1.9e-9 of J above J* at any tolerance."""
    y_ub = np.minimum(np.asarray(y_ub, dtype=np.float64), 0.0)
    y_eq = np.asarray(y_eq, dtype=np.float64)
    r = cost.copy()
    if y_ub.size:
        r -= form.A_ub.T @ y_ub
    if y_eq.size:
        r -= form.A_eq.T @ y_eq
    bound = float(form.b_ub @ y_ub + form.b_eq @ y_eq)
    pos, neg = r > 0, r < 0
    lo, hi = implied_bounds(form)
    lower = np.where(pos, lo, np.where(neg, hi, 0.0))
    unbounded = (pos | neg) & ~np.isfinite(lower)
    # a reduced cost is round-off only relative to what it is computed from: its cost and A_i'y, whose
    # multipliers carry the LP's absolute error (so the column's size counts, not |y|). A variable
    # on a ray no row touches has r_i = cost_i exactly: a cost 1e-10 of the largest there is a real
    # slope, which RC_TOL alone excused (a cone was then certified 40 above J*)
    sizes = np.abs(cost)
    for A, y in ((form.A_ub, y_ub), (form.A_eq, y_eq)):
        if y.size:
            sizes = sizes + np.asarray(abs(A).sum(axis=0)).ravel()
    if np.any(unbounded & (np.abs(r) > RC_TOL * np.minimum(sizes, 1.0))):
        return None
    # round-off reduced costs on unbounded (basic) variables: charge them at the vertex
    term = np.where(unbounded, r * z, r * np.where(np.isfinite(lower), lower, 0.0))
    return bound + float(np.sum(term))


def lower_bound(lm: LinearMinimum) -> Bound:
    """The certificate's lower bound on ``min_{s in C} <grad, s>`` from a set's answer."""
    if math.isnan(lm.value):
        return Bound(None, BOUND_NONE, f"the oracle ({lm.method}) gave no value")
    if not math.isfinite(lm.value):
        return Bound(lm.value, BOUND_EXACT if lm.exact else lm.method)
    if lm.exact:
        return Bound(lm.value, BOUND_EXACT)
    if lm.lp is not None:
        lp = lm.lp
        if lp.y_ub is None or lp.y_eq is None:
            return Bound(None, BOUND_DUAL, "HiGHS returned no usable multipliers, so no dual bound is proven")
        value = dual_bound(lp.cost, lp.form, lp.y_ub, lp.y_eq, lp.z)
        if value is None:
            return Bound(None, BOUND_DUAL, "HiGHS's multipliers leave a reduced cost on an unbounded "
                                           "variable, so they prove no bound")
        primal = float(lp.cost @ lp.z)
        return Bound(min(primal, value) * lm.scale if lm.scale > 0 else 0.0, BOUND_DUAL)
    if lm.solver_status is not None:
        if not lm.solver_status.startswith("optimal"):
            # (a solve stopped at its iteration limit, "user_limit", still fills in a point: its value proves
            # nothing; it was charged the margin of a converged solve, a review of stop 74)
            return Bound(None, BOUND_USER, f"the CVXPY LP ended {lm.solver_status!r}, not solved: no bound proven")
        primal = lm.scaled_primal
        rel = SOLVER_MARGIN_INACCURATE if "inaccurate" in lm.solver_status else SOLVER_MARGIN
        margin = rel * (1.0 + abs(primal))
        return Bound((primal - margin) * lm.scale if lm.scale > 0 else 0.0,
                     f"{BOUND_USER} {rel:g} ({lm.solver_status})")
    return Bound(None, BOUND_NONE, f"the oracle ({lm.method}) gave no evidence for a lower bound")
