"""Fixtures of the solver tests: the stored reference instances, random PSD problems, and an
independent CVXPY solve."""

from __future__ import annotations

from collections.abc import Callable

import cvxpy as cp
import numpy as np
import pytest

from mergeqp.problem import MergeQP
from mergeqp.solvers.reference_problems import constraint_from_spec, load_reference_problem, load_references


@pytest.fixture(scope="session")
def load_case() -> Callable[[str, str], tuple]:
    """``load_case(name, spec) -> (problem, constraint set, reference dict)`` of a committed
    instance of ``problems/`` (reference keys: ``objective``, ``d_file``, ``solver``, ...)."""

    def _load_case(name: str, spec: str):
        problem = load_reference_problem(name, generate=False)
        ref = load_references(name)["optima"][spec]
        return problem, constraint_from_spec(spec), ref

    return _load_case


@pytest.fixture(scope="session")
def random_psd_problem() -> Callable[..., MergeQP]:
    """``random_psd_problem(rng, K, m, rank, scale=1.0)``: a random merge-like QP
    ``sum_j ||A_j d + b_j||^2`` of shape ``(K, m)`` with ``rank(H) <= rank`` (singular when
    ``rank < K m``); ``g`` lies in ``range(H)`` so the problem is bounded on every set."""

    def _random_psd_problem(rng: np.random.Generator, K: int, m: int, rank: int, scale: float = 1.0) -> MergeQP:
        n = K * m
        A = rng.standard_normal((max(rank, 1), n)) * scale
        if rank == 0:
            A[:] = 0.0
        b = rng.standard_normal(A.shape[0])
        H = 2.0 * A.T @ A
        g = 2.0 * A.T @ b
        return MergeQP(H, g, float(b @ b), shape=(K, m))

    return _random_psd_problem


@pytest.fixture(scope="session")
def cvxpy_reference(clarabel_tight) -> Callable[[MergeQP, object], float]:
    """``cvxpy_reference(problem, cset)``: an independent optimum ``J*``, CVXPY with Clarabel at
    tight tolerances (objective only)."""

    def _cvxpy_reference(problem: MergeQP, cset) -> float:
        # the tight tolerances can be out of reach where J* ~ 0 (hypothesis found rank-7 problems of 15
        # and 18 coefficients over nonneg, J* = 5e-11, where Clarabel stopped at its iteration limit or
        # failed): then Clarabel's own tolerances, then OSQP's, each on a problem built afresh
        attempts = ((cp.CLARABEL, clarabel_tight), (cp.CLARABEL, {}),
                    (cp.OSQP, {"eps_abs": 1e-10, "eps_rel": 1e-10, "max_iter": 200_000}))
        status = None
        for solver, options in attempts:
            var = cp.Variable(problem.shape)
            x = cp.vec(var, order="C")
            obj = 0.5 * cp.quad_form(x, cp.psd_wrap(problem.H)) + problem.g @ x + problem.c
            prob = cp.Problem(cp.Minimize(obj), cset.cvxpy(var))
            try:
                prob.solve(solver=solver, **options)
            except cp.SolverError:
                continue
            status = prob.status
            if status in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE):
                return float(prob.value)
        raise AssertionError(f"no reference solve finished (last status {status})")

    return _cvxpy_reference


@pytest.fixture(scope="session")
def rel_diff() -> Callable[[float, float], float]:
    """``rel_diff(a, b) = |a - b| / max(|b|, 1)`` (the relative difference to a reference ``b``)."""

    def _rel_diff(a: float, b: float) -> float:
        return abs(a - b) / max(abs(b), 1.0)

    return _rel_diff
