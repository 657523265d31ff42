"""The active-set engine's polish of an interpolating problem's point (``J* ~ 0``; stop 66):
Newton steps on the face with the explicit H, taken where the engine stops short of the
certificate's floor. References: the certificate, dense_ipm."""

from __future__ import annotations

import numpy as np
import pytest

from mergeqp.certificate import certify
from mergeqp.constraints import Box, L1Ball
from mergeqp.constraints.base import members_structure
from mergeqp.problem import MergeQP
from mergeqp.solvers import active_set_low_rank as LR
from mergeqp.solvers.instance_families import draw
from mergeqp.solvers.registry import solve


def _interpolating(rng: np.random.Generator, n: int, rank: int, d_star: np.ndarray) -> MergeQP:
    """``J = |A d - b|^2`` with ``b = A d*``: ``J* = 0`` at ``d*`` (and along ``null(A)``)."""
    A = rng.standard_normal((rank, n))
    b = A @ d_star
    return MergeQP(2.0 * A.T @ A, -2.0 * A.T @ b, float(b @ b), shape=(1, n))


def _face_of(st, y):
    lo, hi = st.lo, st.hi
    free = np.flatnonzero((y > lo) & (y < hi))
    return free, None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_polish_brings_a_near_optimal_point_to_the_floor(seed: int) -> None:
    """A point 1e-6 off the optimum of an interpolating box QP (H of rank 10 of 40, d* inside the
    box with 10 coordinates at a bound): its gap is far above the certificate's floor; the polish
    reaches the floor, on the set, without raising J."""
    rng = np.random.default_rng(seed)
    n = 40
    d_star = rng.uniform(0.2, 0.8, n)
    d_star[:10] = 0.0
    problem = _interpolating(rng, n, 10, d_star)
    cset = Box(0.0, 1.0)
    st = members_structure(cset.members(), problem.shape)
    x = np.clip(d_star + 1e-6 * rng.standard_normal(n), 0.0, 1.0)
    x[:10] = 0.0
    before = certify(problem, cset, problem.unflat(x), rel_tol=1e-8)
    assert not before.at_rounding_floor
    H, g = np.asarray(problem.H), problem.g
    y = LR.polish_at_zero(H, g, st, x, lambda z: _face_of(st, z))
    assert y is not None and np.all(y >= 0.0) and np.all(y <= 1.0)
    after = certify(problem, cset, problem.unflat(y), rel_tol=1e-8)
    assert after.at_rounding_floor or after.certified(), after.explain()
    assert after.fw_gap < 1e-3 * before.fw_gap
    assert problem.objective(problem.unflat(y)) <= problem.objective(problem.unflat(x)) + 1e-12


def test_polish_declines_a_face_too_large(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step is an eigendecomposition of the free block: beyond ``POLISH_MAX_FREE`` free
    coordinates it is not taken (``None``)."""
    rng = np.random.default_rng(3)
    problem = _interpolating(rng, 12, 4, rng.uniform(0.2, 0.8, 12))
    st = members_structure(Box(0.0, 1.0).members(), problem.shape)
    monkeypatch.setattr(LR, "POLISH_MAX_FREE", 11)
    x = np.full(12, 0.5)
    assert LR.polish_at_zero(np.asarray(problem.H), problem.g, st, x, lambda z: _face_of(st, z)) is None


def test_an_interpolating_l1_ball_is_certified_by_active_set_itself() -> None:
    """(stop 65's break, mended at stop 66) An interpolating L1 ball (n = 768, rank 120 of 692 after
    76 dead coordinates, no ridge: declined by the low-rank path): the engine reached J ~ 1e-15 but
    wandered at gaps 1e3-1e4 times the certificate's floor and returned INACCURATE, and ``auto``
    fell back to dense_ipm. Polished, it ends at the floor: optimal, and ``auto`` keeps it, at
    dense_ipm's J to rounding."""
    inst = draw("l1:K=2:c=4:N=30:cond=inf:planted=false:at_bounds=0.6:dead=0.1", 910, n=768)
    sol = solve(inst.problem, inst.constraints, solver="active_set")
    assert sol.status.value == "optimal"
    assert sol.certificate.certified() or sol.certificate.at_rounding_floor, sol.certificate.explain()
    auto = solve(inst.problem, inst.constraints)
    assert auto.solver == "active_set" and "auto_tried" not in auto.info
    ref = solve(inst.problem, inst.constraints, solver="dense_ipm")
    assert abs(sol.objective - ref.objective) <= 1e-12 * max(1.0, abs(inst.problem.c))
    assert isinstance(inst.constraints, L1Ball)
