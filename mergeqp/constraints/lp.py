"""Linear minimisation by LPs over sets without a closed form, and the one lifted polyhedral
form shared with the QP solvers' standard form.

- :func:`lifted_form`: the intersection of polyhedral sets as one :class:`LinearForm` over
  ``z = (x, t_1, ...)``, ``x`` the flat ``d`` and ``t_i`` each set's auxiliary variables
  (``ConstraintSet.auxiliary_form``, e.g. the L1 ball's ``|x - c| <= t``);
- :func:`highs_minimum`: ``min <grad, s>`` over it by HiGHS, with HiGHS's multipliers as the
  evidence for the certificate's dual bound (:mod:`mergeqp.lower_bounds`);
- :func:`cvxpy_minimum`: the same over any sets with a CVXPY form (user constraints), with the
  solver's status as the evidence for the certificate's labelled bound;
- :func:`cvxpy_distance`: the infinity-norm distance of ``d`` to such a set.

The sets are used only through their capabilities (``linear_form``, ``auxiliary_form``,
``cvxpy``, ``spec``), so this module imports no set class.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

from ..errors import InfeasibleError, MergeQPError, UnsupportedError, ValidationError, first_line
from ..lower_bounds import LinearMinimum, LPDuals, dual_bound
from .forms import AuxiliaryForm, LinearForm, checked_linear_form

LMO_HIGHS = "LP (HiGHS dual bound)"
LMO_CVXPY = "LP (CVXPY/Clarabel)"


def polyhedral_parts(sets: Sequence[Any], shape: tuple[int, int]) -> tuple[LinearForm, list[AuxiliaryForm]] | None:
    """The sets' plain linear forms intersected (over the flat ``d``, n entries) and, in order,
    the auxiliary forms of those that declare one; ``None`` when a set has neither."""
    form = LinearForm.empty(shape[0] * shape[1])
    lifted: list[AuxiliaryForm] = []
    for s in sets:
        aux = s.auxiliary_form(shape)
        if aux is not None:
            lifted.append(aux)
            continue
        f = checked_linear_form(s, shape)
        if f is None:
            return None
        form = form & f
    return form, lifted


def lifted_form(sets: Sequence[Any], shape: tuple[int, int], aux_bounds: bool = True) -> LinearForm | None:
    """The intersection as one linear form over ``z = (x, t_1, ..., t_b)`` (``x`` flat ``d``, n
    entries, then each set's auxiliary block), or ``None`` when a set is not polyhedral.
    ``aux_bounds``: add the (implied) lower bounds of the auxiliary variables as bounds."""
    n = shape[0] * shape[1]
    parts = polyhedral_parts(sets, shape)
    if parts is None:
        return None
    plain, lifted = parts
    N = n + sum(a.n_aux for a in lifted)

    def pad(f: LinearForm) -> LinearForm:
        extra = N - n
        if not extra:
            return f
        return LinearForm(N, sp.hstack([f.A_ub, sp.csr_matrix((f.A_ub.shape[0], extra))]).tocsr(), f.b_ub,
                          sp.hstack([f.A_eq, sp.csr_matrix((f.A_eq.shape[0], extra))]).tocsr(), f.b_eq,
                          np.concatenate([f.lb, np.full(extra, 0.0 if aux_bounds else -np.inf)]),
                          np.concatenate([f.ub, np.full(extra, np.inf)]))

    form = pad(plain)
    off = n
    for a in lifted:
        before = sp.csr_matrix((a.A_x.shape[0], off - n))
        after = sp.csr_matrix((a.A_x.shape[0], N - off - a.n_aux))
        A = sp.hstack([a.A_x, before, a.A_t, after]).tocsr()
        lb = np.full(N, -np.inf)
        if aux_bounds:
            lb[off:off + a.n_aux] = a.t_lb
        form = form & LinearForm(N, A, a.b, sp.csr_matrix((0, N)), np.zeros(0), lb, np.full(N, np.inf))
        off += a.n_aux
    return form


def _label(sets: Sequence[Any]) -> str:
    return " & ".join(s.spec for s in sets) or "R^n"


def highs_minimum(sets: Iterable[Any], grad: np.ndarray) -> LinearMinimum:
    """``min <grad, s>`` over a polyhedral intersection by HiGHS (dual simplex), the objective
    scaled to ``max |grad| = 1``; the answer carries HiGHS's vertex and multipliers."""
    sets = list(sets)
    label = _label(sets)
    shape = grad.shape
    n = shape[0] * shape[1]
    form = lifted_form(sets, shape)
    if form is None:
        raise UnsupportedError(f"{label} is not polyhedral: no HiGHS LP over it")
    if np.any(form.lb > form.ub):
        raise InfeasibleError(f"the constraint set {label} is empty: its bounds cross")
    gflat = np.asarray(grad, dtype=np.float64).ravel()
    gscale = float(np.max(np.abs(gflat))) if gflat.size else 0.0
    cost = np.zeros(form.n)
    if gscale > 0:
        cost[:n] = gflat / gscale
    A_ub = form.A_ub if form.A_ub.shape[0] else None
    A_eq = form.A_eq if form.A_eq.shape[0] else None
    kwargs: dict[str, Any] = {"A_ub": A_ub, "b_ub": form.b_ub if A_ub is not None else None,
                              "A_eq": A_eq, "b_eq": form.b_eq if A_eq is not None else None,
                              "bounds": np.column_stack([form.lb, form.ub])}
    try:
        res = linprog(cost, method="highs-ds", options={"primal_feasibility_tolerance": 1e-10,
                                                        "dual_feasibility_tolerance": 1e-10}, **kwargs)
        if res.status == 4:  # numerical difficulties: retry with the default HiGHS choice
            res = linprog(cost, method="highs", **kwargs)
    except ValueError as exc:
        raise UnsupportedError(f"linear minimisation over {label} failed: {exc}") from None
    if res.status == 3:
        return LinearMinimum(-math.inf, None, LMO_HIGHS)
    if res.status == 2:
        raise InfeasibleError(f"the constraint set {label} is empty (no d satisfies all of them; "
                              f"the HiGHS LP over it is infeasible)")
    if res.status != 0 or res.x is None:
        raise UnsupportedError(f"linear minimisation over {label} failed: {res.message}")
    z = np.asarray(res.x, dtype=np.float64)
    y_ub, y_eq = _multipliers(form, res)
    s = z[:n].reshape(shape)
    primal = float(cost @ z)
    return LinearMinimum(primal * gscale if gscale > 0 else 0.0, s, LMO_HIGHS,
                         lp=LPDuals(cost, form, y_ub, y_eq, z), scale=gscale)


def _multipliers(form: LinearForm, res: Any) -> tuple[np.ndarray | None, np.ndarray | None]:
    """HiGHS's ``(y_ub, y_eq)`` for ``form`` (``y_ub`` clipped to ``<= 0``), or ``None`` each
    when they are missing, mis-shaped or not finite."""
    try:
        y_ub = (np.minimum(np.atleast_1d(np.asarray(res.ineqlin.marginals, dtype=np.float64)), 0.0)
                if form.A_ub.shape[0] else np.zeros(0))
        y_eq = np.atleast_1d(np.asarray(res.eqlin.marginals, dtype=np.float64)) if form.A_eq.shape[0] else np.zeros(0)
    except (AttributeError, TypeError, ValueError):
        return None, None
    if y_ub.shape != (form.A_ub.shape[0],) or y_eq.shape != (form.A_eq.shape[0],) \
            or not (np.all(np.isfinite(y_ub)) and np.all(np.isfinite(y_eq))):
        return None, None
    return y_ub, y_eq


def _highs_dual_bound(cost: np.ndarray, form: LinearForm, res: Any, x: np.ndarray) -> float | None:
    """The weak-duality bound (:func:`~mergeqp.lower_bounds.dual_bound`) from a HiGHS result's
    multipliers; ``None`` when they prove none."""
    y_ub, y_eq = _multipliers(form, res)
    if y_ub is None or y_eq is None:
        return None
    return dual_bound(cost, form, y_ub, y_eq, x)


def cvxpy_constraints(sets: Iterable[Any], var: Any) -> list[Any]:
    """Every set's CVXPY constraints on ``var``, in order. A user's set whose ``cvxpy(var)`` raises
    or answers something other than a list is a :class:`ValidationError` naming the set (not a
    traceback from deep inside a solver's setup); mergeqp's own errors pass through."""
    out: list[Any] = []
    for s in sets:
        try:
            cons = s.cvxpy(var)
        except MergeQPError:
            raise
        except Exception as exc:  # noqa: BLE001 - a user's set: name it, one line
            raise ValidationError(f"constraint set {s.spec}: its cvxpy(var) raised {type(exc).__name__}: "
                                  f"{first_line(exc, 200)}") from exc
        if not isinstance(cons, (list, tuple)):
            raise ValidationError(f"constraint set {s.spec}: its cvxpy(var) must return a list of CVXPY "
                                  f"constraints, got {type(cons).__name__}")
        out.extend(cons)
    return out


def _cvxpy_problem(sets: Sequence[Any], shape: tuple[int, int], cost: np.ndarray) -> tuple[Any, Any]:
    import cvxpy as cp  # optional heavy dependency: only sets without a closed form or LP need it

    var = cp.Variable(shape)
    cons = cvxpy_constraints(sets, var)
    return cp.Problem(cp.Minimize(cp.sum(cp.multiply(cost, var))), cons), var


def solve_quietly(prob: Any, **kwargs: Any) -> None:
    """``prob.solve(**kwargs)`` without CVXPY's "Solution may be inaccurate" warning: every caller
    reads ``prob.status`` (an ``*_inaccurate`` status widens the certificate's margin or marks
    the solve inaccurate in its result), so the warning would only repeat it on stderr."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Solution may be inaccurate", category=UserWarning)
        prob.solve(**kwargs)


def _solve_cvxpy(prob: Any, label: str) -> bool:
    """Solve ``prob`` by Clarabel at 1e-10; ``False`` where that failed and Clarabel's default
    tolerances (~1e-8) gave the answer (its status then says less than "solved to 1e-10")."""
    import cvxpy as cp  # optional heavy dependency (see _cvxpy_problem)

    try:
        solve_quietly(prob, solver=cp.CLARABEL, tol_gap_abs=1e-10, tol_gap_rel=1e-10, tol_feas=1e-10)
        return True
    except cp.error.SolverError:
        try:
            solve_quietly(prob, solver=cp.CLARABEL)
            return False
        except cp.error.SolverError as exc:
            raise UnsupportedError(f"the CVXPY LP over {label} failed: {exc}") from None
    except cp.error.DCPError as exc:
        raise ValidationError(f"the constraints {label} are not convex (DCP): {exc}") from None


def cvxpy_minimum(sets: Iterable[Any], grad: np.ndarray) -> LinearMinimum:
    """``min <grad, s>`` over any intersection with CVXPY forms (user sets included), as a
    CVXPY LP (Clarabel, tolerances 1e-10); the answer carries the primal value and the solve's
    status, from which the certificate computes its labelled bound."""
    import cvxpy as cp  # optional heavy dependency (see _cvxpy_problem)

    sets = list(sets)
    label = _label(sets)
    gscale = float(np.max(np.abs(grad))) if grad.size else 0.0
    cost = grad / gscale if gscale > 0 else np.zeros_like(grad)
    prob, var = _cvxpy_problem(sets, grad.shape, cost)
    tight = _solve_cvxpy(prob, label)
    if prob.status in (cp.UNBOUNDED, cp.UNBOUNDED_INACCURATE):
        return LinearMinimum(-math.inf, None, LMO_CVXPY)
    if prob.status in (cp.INFEASIBLE, cp.INFEASIBLE_INACCURATE):
        raise InfeasibleError(f"the constraint set {label} is empty (no d satisfies all of them; "
                              f"the CVXPY problem over it is infeasible)")
    if var.value is None:
        raise UnsupportedError(f"the CVXPY LP over {label} ended with status {prob.status}")
    s = np.asarray(var.value, dtype=np.float64)
    primal = float(np.sum(cost * s))
    # a solve at Clarabel's default tolerances is charged as an inaccurate one (its "optimal" was charged
    # 1e-9, the margin of a 1e-10 solve: a review, stop 74)
    status = str(prob.status) if tight else f"{prob.status} at Clarabel's default tolerances, inaccurate"
    return LinearMinimum(primal * gscale if gscale > 0 else 0.0, s, LMO_CVXPY,
                         solver_status=status, scale=gscale, scaled_primal=primal)


def cvxpy_distance(sets: Iterable[Any], d: np.ndarray) -> float:
    """``min_{x in C} ||x - d||_inf`` by a CVXPY solve (for sets with auxiliary variables)."""
    import cvxpy as cp  # optional heavy dependency (see _cvxpy_problem)

    sets = list(sets)
    label = _label(sets)
    var = cp.Variable(d.shape)
    t = cp.Variable(nonneg=True)
    cons = cvxpy_constraints(sets, var) + [var - d <= t, d - var <= t]
    prob = cp.Problem(cp.Minimize(t), cons)
    _solve_cvxpy(prob, label)
    if prob.status in (cp.INFEASIBLE, cp.INFEASIBLE_INACCURATE):
        raise InfeasibleError(f"the constraint set {label} is empty")
    if t.value is None:
        raise UnsupportedError(f"measuring the violation of {label} failed (status {prob.status})")
    return max(float(t.value), 0.0)


def lp_minimum(sets: Sequence[Any], grad: np.ndarray) -> LinearMinimum:
    """HiGHS when every set is polyhedral, else CVXPY."""
    if all(s.polyhedral for s in sets):
        return highs_minimum(sets, grad)
    return cvxpy_minimum(sets, grad)


def lp_method(sets: Sequence[Any]) -> str:
    """The label of :func:`lp_minimum`'s method for these sets."""
    return LMO_HIGHS if all(s.polyhedral for s in sets) else LMO_CVXPY
