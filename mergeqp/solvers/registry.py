"""Solver registry (insertion order = preference order) and the ``solve`` entry point."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..certificate import DEFAULT_FEAS_TOL, DEFAULT_REL_TOL, certify
from ..constraints import ConstraintSet, as_constraint_set, check_feasible
from ..errors import (
    MergeQPError,
    SolverError,
    UnsupportedError,
    ValidationError,
    unknown,
)
from ..problem import MergeQP
from ..solution import Solution
from .active_set import ActiveSetSolver
from .base import QPSolver
from .clarabel_solver import ClarabelSolver
from .closed_form import ClosedFormSolver
from .cvxpy_solvers import CvxpyClarabelSolver, CvxpyOSQPSolver
from .osqp_solver import OSQPSolver
from .torch_solvers import TorchAdamSolver, TorchFISTASolver

SOLVERS: dict[str, QPSolver] = {}


def register_solver(solver: QPSolver) -> None:
    """Add a solver to the registry (explicitly; nothing registers on import side effects)."""
    if not solver.name:
        raise ValidationError("a solver needs a name")
    if solver.name in SOLVERS or solver.name == "auto":
        raise ValidationError(f"solver {solver.name!r} is already registered")
    SOLVERS[solver.name] = solver


def get_solver(name: str) -> QPSolver:
    if name not in SOLVERS:
        raise unknown("solver", name, ["auto", *SOLVERS])
    return SOLVERS[name]


def available_solvers() -> dict[str, str | None]:
    """Solver name -> ``None`` if usable here, else why not."""
    return {name: s.available() for name, s in SOLVERS.items()}


def choose_solver(problem: MergeQP, cset: ConstraintSet) -> QPSolver:
    """The ``auto`` dispatch: the first registered solver that is available, supports the
    problem and does not decline it for ``auto`` (registration order encodes the measured
    preference; the thresholds are in docs/solvers.md):

    unconstrained with explicit H -> ``closed_form``; box / simplex / L1 sets with explicit H
    and ``n <= ActiveSetSolver.auto_max_n`` -> ``active_set``; sets with a projection and a
    matrix-vector-only (or larger) H -> ``torch_fista``; other polyhedral sets (sign
    consensus) -> ``clarabel``; user CVXPY constraints -> ``cvxpy_clarabel``.
    ``torch_adam`` (the paper's heuristic) is never chosen automatically."""
    reasons = []
    for s in SOLVERS.values():
        why = s.available() or s.supports(problem, cset) or s.auto_declines(problem, cset)
        if why is None:
            return s
        reasons.append(f"{s.name}: {why}")
    raise UnsupportedError("no registered solver handles this problem:\n  " + "\n  ".join(reasons))


def solve(
    problem: MergeQP,
    constraints: Any = None,
    solver: str = "auto",
    *,
    x0: np.ndarray | None = None,
    certify_result: bool = True,
    rel_tol: float = DEFAULT_REL_TOL,
    feas_tol: float = DEFAULT_FEAS_TOL,
    check_feasibility: bool = True,
    **options: Any,
) -> Solution:
    """Solve ``min_{d in C} 1/2 d'Hd + g'd + c`` and certify the answer.

    ``constraints``: ``None``, a :class:`~mergeqp.constraints.ConstraintSet`, a spec string
    (``"box:0,1"``), a callable (user CVXPY constraints) or a list of these (intersection).
    ``solver``: a registry name or ``"auto"``. ``options`` go to the solver (unknown options
    are an error listing the valid ones). Raises :class:`~mergeqp.errors.InfeasibleError`
    for an empty constraint set, :class:`~mergeqp.errors.UnknownNameError` for a bad solver name.
    """
    if not isinstance(problem, MergeQP):
        raise ValidationError(f"problem must be a MergeQP, got {type(problem).__name__}")
    t0 = time.perf_counter()
    cset = as_constraint_set(constraints)
    if check_feasibility:
        check_feasible(cset, problem.shape)
    else:
        cset.validate(problem.shape)
    chosen = choose_solver(problem, cset) if solver == "auto" else get_solver(solver)
    if solver != "auto":
        why = chosen.available() or chosen.supports(problem, cset)
        if why is not None:
            raise UnsupportedError(f"solver {chosen.name!r} cannot solve this problem: {why}")
    if x0 is not None:
        x0 = problem.flat(x0).reshape(problem.shape)
    t1 = time.perf_counter()
    try:
        raw = chosen.solve(problem, cset, x0=x0, **options)
    except MergeQPError:
        raise
    except Exception as exc:
        raise SolverError(f"solver {chosen.name!r} failed: {type(exc).__name__}: {exc}") from exc
    t2 = time.perf_counter()
    d = np.asarray(raw.d, dtype=np.float64).reshape(problem.shape)
    if not np.all(np.isfinite(d)):
        raise SolverError(f"solver {chosen.name!r} returned non-finite coefficients")
    cert = certify(problem, cset, d, rel_tol=rel_tol, feas_tol=feas_tol) if certify_result else None
    t3 = time.perf_counter()
    return Solution(
        d=d, objective=problem.objective(d), status=raw.status, solver=chosen.name,
        iterations=raw.iterations, certificate=cert, constraints=cset.spec, info=raw.info,
        timings={"setup": t1 - t0 + raw.setup_seconds, "solve": t2 - t1 - raw.setup_seconds,
                 "certify": t3 - t2, "total": t3 - t0},
    )


register_solver(ClosedFormSolver())
register_solver(ActiveSetSolver())
register_solver(TorchFISTASolver())
register_solver(ClarabelSolver())
register_solver(CvxpyClarabelSolver())
register_solver(OSQPSolver())
register_solver(CvxpyOSQPSolver())
register_solver(TorchAdamSolver())
