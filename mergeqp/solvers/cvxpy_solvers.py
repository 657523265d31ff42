"""OSQP and Clarabel through CVXPY: any constraint set, including sign consensus and user
CVXPY constraints.

The objective is written ``1/2 quad_form(x, psd_wrap(H)) + g'x + c`` on ``x = vec(d)``
(row-major), never ``sum_squares`` of a stacked data matrix (measured 70x slower);
``psd_wrap`` skips CVXPY's own eigenvalue check (H was validated by :class:`MergeQP`).

Every solver setting is passed explicitly, because CVXPY otherwise substitutes its own
defaults (for OSQP it sets ``eps_abs = eps_rel = 1e-5``, ``max_iter = 10000`` and turns
polishing on). Our defaults: ``cvxpy_clarabel``: ``tol_gap_abs = tol_gap_rel = tol_feas =
1e-10``, ``max_iter = 200``, ``direct_solve_method = "faer"``; ``cvxpy_osqp``: ``eps_abs =
eps_rel = 1e-9``, ``max_iter = 100000``, ``polishing = True``. All overridable as options.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..constraints import ConstraintSet, as_constraint_set, cvxpy_reason
from ..constraints.lp import cvxpy_constraints, solve_quietly
from ..errors import InfeasibleError, SolverError, ValidationError
from ..problem import MergeQP
from ..solution import SolveStatus
from .base import SCALE_UP_ONLY, QPSolver, RawResult, unit_scaled
from .unbounded import unbounded_claim


def cvxpy_problem(problem: MergeQP, constraints: Any = None) -> tuple[Any, Any]:
    """The merge QP as a CVXPY problem: ``(cp.Problem, d)`` with ``d`` a ``cp.Variable`` of shape
    ``(K, n_atoms)``, the objective ``1/2 vec(d)'H vec(d) + g'vec(d) + c`` (row-major ``vec``, as
    ``MergeQP``) and the constraints of ``constraints`` (anything :func:`mergeqp.solve` takes: a set,
    a spec string, a callable of user CVXPY constraints, a list). To study a variant, build on it,
    e.g. ``cp.Problem(cp.Minimize(prob.objective.expr + lam * cp.norm1(d - ref)), prob.constraints)``; the certificate
    (:func:`mergeqp.certify`) proves optimality for the QP itself, not for a variant's objective.
    Needs an explicit H and a set with a CVXPY form (:class:`ValidationError` naming what is
    missing)."""
    import cvxpy as cp  # optional heavy dependency, imported on first use

    if not isinstance(problem, MergeQP):
        raise ValidationError(f"problem must be a MergeQP, got {type(problem).__name__}")
    if problem.H is None:
        raise ValidationError("cvxpy_problem needs an explicit H (CVXPY cannot use a matrix-vector callback)")
    cset = as_constraint_set(constraints)
    cset.validate(problem.shape)
    why = cvxpy_reason(cset)
    if why is not None:
        raise ValidationError(f"cvxpy_problem: {why}")
    var = cp.Variable(problem.shape, name="d")
    x = cp.vec(var, order="C")
    objective = 0.5 * cp.quad_form(x, cp.psd_wrap(problem.H)) + problem.g @ x + problem.c
    return cp.Problem(cp.Minimize(objective), cvxpy_constraints([cset], var)), var


class _CvxpySolver(QPSolver):
    """Shared CVXPY modelling; subclasses name the backend and its settings."""

    backend = ""

    def available(self) -> str | None:
        try:
            import cvxpy as cp  # optional heavy dependency: checked by available()
        except ImportError:
            return "cvxpy is not installed (pip install cvxpy)"
        if self.backend not in cp.installed_solvers():
            return f"CVXPY does not find the {self.backend} solver (pip install {self.backend.lower()})"
        return None

    def supports(self, problem: MergeQP, constraints: ConstraintSet) -> str | None:
        if problem.H is None:
            return "needs an explicit H (CVXPY cannot use a matrix-vector callback)"
        return cvxpy_reason(constraints)

    def solve(self, problem: MergeQP, constraints: ConstraintSet, x0: np.ndarray | None = None,
              **options: Any) -> RawResult:
        import cvxpy as cp  # optional heavy dependency: checked by available()

        opts = self.check_options(options)
        t0 = time.perf_counter()
        scaled, factor = unit_scaled(problem, band=SCALE_UP_ONLY)
        prob, var = cvxpy_problem(scaled, constraints)
        if x0 is not None:
            var.value = np.asarray(x0, dtype=np.float64).reshape(problem.shape)
        setup = time.perf_counter() - t0
        try:
            solve_quietly(prob, solver=getattr(cp, self.backend), warm_start=x0 is not None, **opts)
        except cp.error.DCPError as exc:
            raise ValidationError(f"{self.name}: the constraints are not convex (DCP): {exc}") from exc
        except cp.error.SolverError as exc:
            raise SolverError(f"{self.name}: {self.backend} failed: {exc}") from exc
        status = prob.status
        info = {"cvxpy_status": status, "backend": self.backend, "settings": dict(opts),
                "compilation_seconds": float(prob.compilation_time or 0.0)}
        if factor != 1.0:
            info["objective_scaled_by"] = factor
        if status in (cp.INFEASIBLE, cp.INFEASIBLE_INACCURATE):
            raise InfeasibleError(f"{self.name}: the constraint set {constraints.spec} is infeasible ({status})")
        if status in (cp.UNBOUNDED, cp.UNBOUNDED_INACCURATE):
            raise unbounded_claim(problem, constraints, self.name, str(status))
        if var.value is None:
            raise SolverError(f"{self.name}: {self.backend} returned no solution (status {status})")
        st = {cp.OPTIMAL: SolveStatus.OPTIMAL, cp.OPTIMAL_INACCURATE: SolveStatus.INACCURATE,
              cp.USER_LIMIT: SolveStatus.MAX_ITERATIONS}.get(status, SolveStatus.INACCURATE)
        iters = int(getattr(prob.solver_stats, "num_iters", 0) or 0)
        comp = float(prob.compilation_time or 0.0)
        return RawResult(np.asarray(var.value, dtype=np.float64), st, iters, info, setup_seconds=setup + comp)


class CvxpyClarabelSolver(_CvxpySolver):
    """Clarabel through CVXPY: any set, a user's CVXPY constraints too."""

    name = "cvxpy_clarabel"
    backend = "CLARABEL"
    defaults = {"tol_gap_abs": 1e-10, "tol_gap_rel": 1e-10, "tol_feas": 1e-10, "max_iter": 200,
                "direct_solve_method": "faer", "verbose": False}
    positive = ("tol_gap_abs", "tol_gap_rel", "tol_feas", "max_iter")
    choices = {"direct_solve_method": ("faer", "qdldl", "auto")}


class CvxpyOSQPSolver(_CvxpySolver):
    """OSQP through CVXPY: sets with linear constraints, a user's CVXPY constraints too."""

    name = "cvxpy_osqp"
    backend = "OSQP"

    def supports(self, problem: MergeQP, constraints: ConstraintSet) -> str | None:
        why = super().supports(problem, constraints)
        if why is not None or constraints.polyhedral or all(m.polyhedral for m in constraints.members()):
            return why
        import cvxpy as cp  # optional heavy dependency (this solver is never chosen without it)

        try:  # OSQP solves QPs: linear constraints only (a Euclidean ball needs a second-order cone)
            linear = cp.Problem(cp.Minimize(0), cvxpy_constraints([constraints], cp.Variable(problem.shape))).is_qp()
        except Exception:  # noqa: BLE001 - a user's cvxpy(): let the solve report it
            return None
        return None if linear else (f"{constraints.spec} needs more than linear constraints (a cone); OSQP solves "
                                    f"QPs: use cvxpy_clarabel")
    defaults = {"eps_abs": 1e-9, "eps_rel": 1e-9, "max_iter": 100000, "polishing": True,
                "verbose": False}
    positive = ("eps_abs", "eps_rel", "max_iter")
