"""Fixtures of the numerical-core tests (problem, constraint sets, certificate): independent
CVXPY projections and linear minimisations, and random feasible points."""

from __future__ import annotations

from collections.abc import Callable

import cvxpy as cp
import numpy as np
import pytest

from mergeqp.constraints import ConstraintSet


@pytest.fixture(scope="session")
def cvxpy_project(clarabel_tight) -> Callable[[ConstraintSet, np.ndarray], np.ndarray]:
    """``cvxpy_project(cset, v)``: the Euclidean projection of ``v`` onto ``cset`` (same shape as
    ``v``) as a CVXPY QP."""

    def _cvxpy_project(cset: ConstraintSet, v: np.ndarray) -> np.ndarray:
        var = cp.Variable(v.shape)
        prob = cp.Problem(cp.Minimize(cp.sum_squares(var - v)), cset.cvxpy(var))
        prob.solve(solver=cp.CLARABEL, **clarabel_tight)
        assert prob.status in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE), prob.status
        return np.asarray(var.value, dtype=np.float64)

    return _cvxpy_project


@pytest.fixture(scope="session")
def cvxpy_lmo(clarabel_tight) -> Callable[[ConstraintSet, np.ndarray], float]:
    """``cvxpy_lmo(cset, grad)``: ``min_{s in C} <grad, s>`` as a CVXPY LP (``-inf`` if
    unbounded); the objective is scaled to ``max |grad| = 1`` for the solver's absolute
    tolerances."""

    def _cvxpy_lmo(cset: ConstraintSet, grad: np.ndarray) -> float:
        scale = float(np.max(np.abs(grad))) or 1.0
        var = cp.Variable(grad.shape)
        prob = cp.Problem(cp.Minimize(cp.sum(cp.multiply(grad / scale, var))), cset.cvxpy(var))
        prob.solve(solver=cp.CLARABEL, **clarabel_tight)
        if prob.status in (cp.UNBOUNDED, cp.UNBOUNDED_INACCURATE):
            return -np.inf
        assert prob.status in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE), prob.status
        return float(prob.value) * scale

    return _cvxpy_lmo


@pytest.fixture(scope="session")
def random_feasible_point() -> Callable[..., np.ndarray]:
    """``random_feasible_point(cset, shape, rng, vertices=4)``: a random point (of ``shape``) of a
    bounded set: a random convex combination of LMO vertices for random directions (feasible for
    any convex set, closed form or not)."""

    def _random_feasible_point(cset: ConstraintSet, shape: tuple[int, int], rng: np.random.Generator,
                               vertices: int = 4) -> np.ndarray:
        pts = []
        for _ in range(vertices):
            _, s = cset.support(rng.normal(size=shape))
            assert s is not None
            pts.append(s)
        w = rng.dirichlet(np.ones(vertices))
        return np.tensordot(w, np.stack(pts), axes=1)

    return _random_feasible_point
