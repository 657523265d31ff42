"""OSQP called directly on the sparse standard form (no CVXPY).

Defaults we set (and why), all overridable as solver options: ``eps_abs = eps_rel = 1e-9``
(OSQP's own 1e-3 leaves bound violations of ~5e-4 on merge QPs), ``polishing = True`` (an
active-set refinement step that makes the answer exact when it succeeds), ``max_iter =
100000``, ``adaptive_rho = True`` (OSQP's default), ``scaling = 10`` (default),
``verbose = False``, ``time_limit = 1e10`` s (none). OSQP factorises a sparse KKT matrix holding
the dense H, which is slow for large n (see docs/solvers.md).
"""

from __future__ import annotations

import contextlib
import io
import time
from typing import Any

import numpy as np

from ..constraints import ConstraintSet
from ..errors import InfeasibleError, Interrupted, MergeQPError, SolverError
from ..problem import MergeQP
from ..solution import SolveStatus
from . import base
from .base import SCALE_UP_ONLY, RawResult, unit_scaled
from .standard_form import StandardFormSolver, standard_form
from .unbounded import unbounded_claim


class OSQPSolver(StandardFormSolver):
    """OSQP (ADMM) on ``l <= A z <= u``; L1 balls through auxiliary variables."""

    name = "osqp"
    package = "osqp"
    defaults = {"eps_abs": 1e-9, "eps_rel": 1e-9, "polishing": True, "max_iter": 100000,
                "adaptive_rho": True, "scaling": 10, "verbose": False, "time_limit": 1e10}
    positive = ("eps_abs", "eps_rel", "max_iter", "time_limit")
    nonnegative = ("scaling",)

    def auto_fallback(self, problem: MergeQP, constraints: ConstraintSet) -> float | None:
        """``auto``'s last built-in fallback (after ``clarabel`` and ``dense_ipm``), up to
        :data:`~mergeqp.solvers.base.AUTO_FALLBACK_MAX_N` variables."""
        return 3.0 if problem.n <= base.AUTO_FALLBACK_MAX_N else None

    def solve(self, problem: MergeQP, constraints: ConstraintSet, x0: np.ndarray | None = None,
              **options: Any) -> RawResult:
        opts = self.check_options(options)
        t0 = time.perf_counter()
        scaled, factor = unit_scaled(problem, band=SCALE_UP_ONLY)
        qp = standard_form(scaled, constraints)
        form_seconds = time.perf_counter() - t0
        res, setup, printed = self._run(qp, opts, _projected_start(problem, constraints, x0))
        dropped = None
        if "non convex" in str(res.info.status).lower() and x0 is not None:
            # OSQP's convexity test fails on iterates that overflow from a far warm start (|x0| ~ 1e300): H is
            # PSD (MergeQP checked it), so the warm start is dropped and the problem solved cold
            dropped = f"dropped: OSQP reported {res.info.status!r} from it"
            res, setup, printed = self._run(qp, opts, None)
        status = str(res.info.status).lower()
        if "interrupted" in status:  # OSQP catches Ctrl-C itself and returns: the run was stopped, not failed
            raise Interrupted("stopped by signal SIGINT (OSQP returned 'interrupted')")
        info = {"osqp_status": res.info.status, "iterations": int(res.info.iter),
                "polish_status": int(getattr(res.info, "status_polish", 0)),
                "settings": dict(opts)}
        if printed.getvalue():
            info["osqp_output"] = printed.getvalue().strip()
        if dropped is not None:
            info["warm_start"] = dropped
        if factor != 1.0:
            info["objective_scaled_by"] = factor
        if "primal infeasible" in status:
            raise InfeasibleError(f"osqp: the constraint set {constraints.spec} is infeasible ({res.info.status})")
        if "dual infeasible" in status:
            cert = getattr(res, "dual_inf_cert", None)
            direction = None if cert is None else np.asarray(cert, dtype=np.float64)[: qp.n]
            raise unbounded_claim(problem, constraints, "osqp", str(res.info.status), direction)
        if res.x is None or not np.all(np.isfinite(res.x[: qp.n])):
            raise SolverError(f"osqp: no solution ({res.info.status})")
        if status == "solved":
            st = SolveStatus.OPTIMAL
        elif "inaccurate" in status:
            st = SolveStatus.INACCURATE
        elif "maximum iterations" in status or "time limit" in status:
            st = SolveStatus.MAX_ITERATIONS
        elif "non convex" in status:
            raise SolverError(f"osqp: failed with status {res.info.status!r}, although H is positive semidefinite "
                              f"(checked when the problem was built): OSQP's own test failed in floating point at "
                              f"this scale; try solver='clarabel' or 'active_set', or rescale H and g")
        else:
            raise SolverError(f"osqp: failed with status {res.info.status!r}")
        return RawResult(problem.unflat(res.x[: qp.n]), st, int(res.info.iter), info,
                         setup_seconds=form_seconds + setup)

    @staticmethod
    def _run(qp: Any, opts: dict[str, Any], x0: np.ndarray | None) -> tuple[Any, float, io.StringIO]:
        """Set OSQP up on ``qp`` (warm-started at ``x0`` when given) and solve: ``(result, setup
        seconds, what it printed)``."""
        import osqp  # optional dependency: checked by available()

        t0 = time.perf_counter()
        A, lo, hi = qp.osqp_form()
        solver = osqp.OSQP()
        said = io.StringIO()  # OSQP prints why it rejects settings (e.g. max_iter 0) to stdout
        try:
            with contextlib.redirect_stdout(said):
                solver.setup(P=qp.P, q=qp.q, A=A, l=lo, u=hi, **opts)
                if x0 is not None:
                    z0 = np.zeros(qp.n_total)
                    z0[: qp.n] = np.asarray(x0, dtype=np.float64).ravel()
                    solver.warm_start(x=z0)
        except Exception as exc:
            detail = " ".join(said.getvalue().split())
            raise SolverError(f"osqp: setup failed: {exc}" + (f" ({detail})" if detail else "")) from exc
        setup = time.perf_counter() - t0
        printed = io.StringIO()
        # OSQP prints some messages ("Polishing not needed ...") even with verbose False
        with contextlib.redirect_stdout(printed) if not opts["verbose"] else contextlib.nullcontext():
            res = solver.solve(raise_error=False)
        return res, setup, printed


def _projected_start(problem: MergeQP, constraints: ConstraintSet, x0: np.ndarray | None) -> np.ndarray | None:
    """``x0`` projected onto the set where it has a projection (OSQP's ADMM from a start far outside
    the set, e.g. 1e15 on a box, ran all its iterations and returned a point infeasible by 0.1-11, a QA
    review); ``None`` for a start that is not finite."""
    if x0 is None:
        return None
    x = np.asarray(x0, dtype=np.float64).reshape(problem.shape)
    if not np.all(np.isfinite(x)):
        return None
    if constraints.has_projection:
        try:
            y = np.asarray(constraints.project(x), dtype=np.float64)
        except (NotImplementedError, MergeQPError):
            return x
        if y.shape == x.shape and np.all(np.isfinite(y)):
            return y
    return x
