"""Shared helpers for the solver tests: reference instances, random PSD problems, and an
independent CVXPY solve."""

from __future__ import annotations

import numpy as np

from mergeqp.problem import MergeQP
from mergeqp.solvers.reference_problems import (
    REFERENCE_SPECS,
    constraint_from_spec,
    load_reference_problem,
    load_references,
)

COMMITTED = [n for n, s in REFERENCE_SPECS.items() if s.committed]

#: exact solvers and the options the tests use (torch_fista in float64 to a tight gap)
EXACT_SOLVERS = {
    "active_set": {},
    "clarabel": {},
    "osqp": {},
    "cvxpy_clarabel": {},
    "cvxpy_osqp": {},
    "torch_fista": {"dtype": "float64", "tol": 1e-9, "device": "cpu", "max_iter": 50000},
}


def reference_cases(full_on: tuple[str, ...] = ("tiny96", "singular192", "k1_100"),
                    light: tuple[str, ...] = ("box:0,1", "simplex")) -> list[tuple[str, str]]:
    """(instance, constraint spec) pairs: every stored spec on the small instances, the
    ``light`` ones on the others (mnist640)."""
    cases = []
    for name in COMMITTED:
        refs = load_references(name)
        for spec in refs["optima"]:
            if name in full_on or spec in light:
                cases.append((name, spec))
    return cases


def load_case(name: str, spec: str):
    problem = load_reference_problem(name, generate=False)
    ref = load_references(name)["optima"][spec]
    return problem, constraint_from_spec(spec), ref


def random_psd_problem(rng: np.random.Generator, K: int, m: int, rank: int, scale: float = 1.0) -> MergeQP:
    """A random merge-like QP ``sum_j ||A_j d + b_j||^2`` with ``rank(H) <= rank`` (singular when
    ``rank < K m``); ``g`` lies in ``range(H)`` so the problem is bounded on every set."""
    n = K * m
    A = rng.standard_normal((max(rank, 1), n)) * scale
    if rank == 0:
        A[:] = 0.0
    b = rng.standard_normal(A.shape[0])
    H = 2.0 * A.T @ A
    g = 2.0 * A.T @ b
    return MergeQP(H, g, float(b @ b), shape=(K, m))


def cvxpy_reference(problem: MergeQP, cset) -> float:
    """An independent optimum: CVXPY with Clarabel at tight tolerances (objective only)."""
    import cvxpy as cp

    var = cp.Variable(problem.shape)
    x = cp.vec(var, order="C")
    obj = 0.5 * cp.quad_form(x, cp.psd_wrap(problem.H)) + problem.g @ x + problem.c
    prob = cp.Problem(cp.Minimize(obj), cset.cvxpy(var))
    prob.solve(solver=cp.CLARABEL, tol_gap_abs=1e-11, tol_gap_rel=1e-11, tol_feas=1e-11)
    assert prob.status in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE), prob.status
    return float(prob.value)


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1.0)
