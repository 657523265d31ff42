"""Clarabel (interior point) called directly on the sparse standard form (no CVXPY).

Defaults we set, all overridable as solver options: ``tol_gap_abs = tol_gap_rel = 1e-10``
and ``tol_feas = 1e-10`` (Clarabel's own are 1e-8), ``max_iter = 200`` (Clarabel's default),
``direct_solve_method = "faer"`` (a supernodal factorisation, measured 5x faster than the
default ``qdldl`` on a dense H), ``presolve_enable = True`` (default), ``verbose = False``,
``time_limit = inf``. Constraints ``A z + s = b`` with ``s`` in the zero cone (equalities) and
the non-negative cone (inequalities and finite bounds).
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import scipy.sparse as sp

from ..constraints import ConstraintSet
from ..errors import InfeasibleError, SolverError
from ..problem import MergeQP
from ..solution import SolveStatus
from . import base
from .base import SCALE_UP_ONLY, RawResult, unit_scaled
from .standard_form import StandardFormSolver, standard_form
from .unbounded import unbounded_claim

_SETTINGS = ("tol_gap_abs", "tol_gap_rel", "tol_feas", "max_iter", "direct_solve_method",
             "presolve_enable", "verbose", "time_limit")


class ClarabelSolver(StandardFormSolver):
    """Clarabel on ``A z + s = b``, ``s`` in zero x non-negative cones; L1 via auxiliaries."""

    name = "clarabel"
    package = "clarabel"
    defaults = {"tol_gap_abs": 1e-10, "tol_gap_rel": 1e-10, "tol_feas": 1e-10, "max_iter": 200,
                "direct_solve_method": "faer", "presolve_enable": True, "verbose": False,
                "time_limit": math.inf}
    positive = ("tol_gap_abs", "tol_gap_rel", "tol_feas", "max_iter", "time_limit")
    choices = {"direct_solve_method": ("faer", "qdldl", "auto")}

    def auto_fallback(self, problem: MergeQP, constraints: ConstraintSet) -> float | None:
        """``auto``'s fallback after ``dense_ipm`` from its ``auto_min_n`` (before it below), up to
        :data:`~mergeqp.solvers.base.AUTO_FALLBACK_MAX_N` variables (beyond, its sparse KKT matrix
        of a dense H takes minutes)."""
        return 1.0 if problem.n <= base.AUTO_FALLBACK_MAX_N else None

    def solve(self, problem: MergeQP, constraints: ConstraintSet, x0: np.ndarray | None = None,
              **options: Any) -> RawResult:
        import clarabel  # optional dependency: checked by available()

        opts = self.check_options(options)
        t0 = time.perf_counter()
        scaled, factor = unit_scaled(problem, band=SCALE_UP_ONLY)
        qp = standard_form(scaled, constraints)
        A = sp.vstack([qp.A_eq, qp.A_in]).tocsc()
        b = np.concatenate([qp.b_eq, qp.b_in])
        cones = []
        if qp.b_eq.size:
            cones.append(clarabel.ZeroConeT(int(qp.b_eq.size)))
        if qp.b_in.size:
            cones.append(clarabel.NonnegativeConeT(int(qp.b_in.size)))
        settings = clarabel.DefaultSettings()
        for key in _SETTINGS:
            setattr(settings, key, opts[key])
        try:
            solver = clarabel.DefaultSolver(qp.P, qp.q, A, b, cones, settings)
        except Exception as exc:
            raise SolverError(f"clarabel: setup failed: {exc}") from exc
        setup = time.perf_counter() - t0
        sol = solver.solve()
        status = str(sol.status)
        info = {"clarabel_status": status, "settings": dict(opts)}
        if factor != 1.0:
            info["objective_scaled_by"] = factor
        if status in ("PrimalInfeasible", "AlmostPrimalInfeasible"):
            raise InfeasibleError(f"clarabel: the constraint set {constraints.spec} is infeasible ({status})")
        if status in ("DualInfeasible", "AlmostDualInfeasible"):
            # Clarabel returns its certificate of dual infeasibility (a direction) in x
            direction = np.asarray(sol.x, dtype=np.float64)[: qp.n] if sol.x is not None else None
            raise unbounded_claim(problem, constraints, "clarabel", status, direction)
        x = np.asarray(sol.x, dtype=np.float64)[: qp.n]
        if x.size != qp.n or not np.all(np.isfinite(x)):
            raise SolverError(f"clarabel: no solution ({status})")
        if status == "InsufficientProgress" and float(np.max(np.abs(x), initial=0.0)) > 1e12 * (
                1.0 + float(np.max(np.abs(qp.q), initial=0.0))):
            raise SolverError(f"clarabel: no progress and a diverged iterate (|d|_inf = "
                              f"{float(np.max(np.abs(x))):.3g}; {status}); try solver='active_set'")
        if status == "Solved":
            st = SolveStatus.OPTIMAL
        elif status in ("AlmostSolved", "InsufficientProgress"):
            st = SolveStatus.INACCURATE
        elif status in ("MaxIterations", "MaxTime"):
            st = SolveStatus.MAX_ITERATIONS
        else:
            raise SolverError(f"clarabel: failed with status {status}")
        return RawResult(problem.unflat(x), st, int(sol.iterations), info, setup_seconds=setup)
