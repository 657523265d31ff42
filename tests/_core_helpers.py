"""Shared helpers for the numerical-core tests (problem, constraints, certificate, CLI):
random merge QPs and independent CVXPY references."""

from __future__ import annotations

from typing import Any

import cvxpy as cp
import numpy as np

from mergeqp.constraints import ConstraintSet, as_constraint_set
from mergeqp.problem import MergeQP

#: tight Clarabel settings for reference solves
CLARABEL_TIGHT = {"tol_gap_abs": 1e-11, "tol_gap_rel": 1e-11, "tol_feas": 1e-11}


def random_problem(rng: np.random.Generator, K: int = 3, m: int = 4, rank: int | None = None,
                   offset: float = 0.0, c: float | None = None) -> MergeQP:
    """A merge QP like the paper's: ``H = A'A`` (rank ``rank``, default full), ``g = -A'y``
    with targets ``y`` chosen so that the unconstrained optimum sits around ``offset``
    (plus noise, so that ``J* > 0``), ``c = |y|^2 / 2`` so that ``J(d) = |A d - y|^2 / 2``."""
    n = K * m
    rows = max(n + 3, 8)
    A = rng.normal(size=(rows, n)) / np.sqrt(rows)
    if rank is not None:  # rank-deficient: more samples than the rank of H
        A = rng.normal(size=(rows, rank)) @ rng.normal(size=(rank, n)) / np.sqrt(rows * rank)
    y = A @ (offset + rng.normal(size=n)) + 0.1 * rng.normal(size=rows)
    H = A.T @ A
    g = -A.T @ y
    return MergeQP(H, g, c=0.5 * float(y @ y) if c is None else c, shape=(K, m))


def cvxpy_solve(problem: MergeQP, constraints: Any) -> tuple[float, np.ndarray]:
    """``(J*, d*)`` from an independent CVXPY + Clarabel solve (``quad_form`` on H)."""
    cset = as_constraint_set(constraints)
    var = cp.Variable(problem.shape)
    x = cp.vec(var, order="C")
    H = cp.psd_wrap(problem.H)
    obj = 0.5 * cp.quad_form(x, H) + problem.g @ x + problem.c
    prob = cp.Problem(cp.Minimize(obj), cset.cvxpy(var))
    prob.solve(solver=cp.CLARABEL, **CLARABEL_TIGHT)
    assert prob.status in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE), prob.status
    d = np.asarray(var.value, dtype=np.float64)
    return problem.objective(d), d


def cvxpy_project(cset: ConstraintSet, v: np.ndarray) -> np.ndarray:
    """Euclidean projection of ``v`` onto ``cset`` as a CVXPY QP."""
    var = cp.Variable(v.shape)
    prob = cp.Problem(cp.Minimize(cp.sum_squares(var - v)), cset.cvxpy(var))
    prob.solve(solver=cp.CLARABEL, **CLARABEL_TIGHT)
    assert prob.status in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE), prob.status
    return np.asarray(var.value, dtype=np.float64)


def cvxpy_lmo(cset: ConstraintSet, grad: np.ndarray) -> float:
    """``min_{s in C} <grad, s>`` as a CVXPY LP (``-inf`` if unbounded); the objective is
    scaled to ``max |grad| = 1`` for the solver's absolute tolerances."""
    scale = float(np.max(np.abs(grad))) or 1.0
    var = cp.Variable(grad.shape)
    prob = cp.Problem(cp.Minimize(cp.sum(cp.multiply(grad / scale, var))), cset.cvxpy(var))
    prob.solve(solver=cp.CLARABEL, **CLARABEL_TIGHT)
    if prob.status in (cp.UNBOUNDED, cp.UNBOUNDED_INACCURATE):
        return -np.inf
    assert prob.status in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE), prob.status
    return float(prob.value) * scale


def random_feasible_point(cset: ConstraintSet, shape: tuple[int, int], rng: np.random.Generator,
                          vertices: int = 4) -> np.ndarray:
    """A random point of a bounded set: a random convex combination of LMO vertices for
    random directions (feasible for any convex set, closed form or not)."""
    pts = []
    for _ in range(vertices):
        _, s = cset.support(rng.normal(size=shape))
        assert s is not None
        pts.append(s)
    w = rng.dirichlet(np.ones(vertices))
    return np.tensordot(w, np.stack(pts), axes=1)
