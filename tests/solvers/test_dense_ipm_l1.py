"""dense_ipm's Schur complement of the L1 ball's auxiliaries (stop 66): the sparse rows' part formed
without subtracting, the ball's sum row rotated onto the first coordinates, a float32 factor
checked by its first solve. References: the lifted normal matrix, the dense products, Clarabel."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mergeqp import solve
from mergeqp.constraints import Box, L1Ball, SignConsensus
from mergeqp.problem import MergeQP
from mergeqp.solvers import dense_ipm
from mergeqp.solvers.dense_ipm import DenseIpmSolver, _householder, _Ipm
from mergeqp.solvers.instance_families import draw
from mergeqp.solvers.ipm_linalg import HostLinalg, TorchLinalg, add_sym2


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_householder_takes_z_to_r_and_rotate_is_q_m_q(n: int, d: int, seed: int) -> None:
    """``Q = I - Vh T Vh'`` is orthogonal, ``Q'Z = [R; 0]``, and both backends' ``rotate`` give
    ``Q'MQ`` (float64), for any ``d <= n`` (one column of Z may vanish)."""
    d = min(d, n)
    rng = np.random.default_rng(seed)
    Z = rng.standard_normal((n, d)) * 10.0 ** rng.uniform(-3, 3, d)
    if d > 1:
        Z[:, -1] = 0.0
    Vh, T, R = _householder(Z)
    Q = np.eye(n) - Vh @ T @ Vh.T
    np.testing.assert_allclose(Q.T @ Q, np.eye(n), atol=1e-13)
    np.testing.assert_allclose(Q.T @ Z, np.vstack([R, np.zeros((n - d, d))]), atol=1e-12 * np.max(np.abs(Z)))
    B = rng.standard_normal((n, n))
    M = B @ B.T
    for la in (HostLinalg(M), TorchLinalg(M, "cpu")):
        S = la.base(np.float64, n)
        la.rotate(S, Vh, T)
        S = np.asarray(S.cpu().numpy() if hasattr(S, "cpu") else S)
        np.testing.assert_allclose(S, Q.T @ M @ Q, atol=1e-12 * np.max(np.abs(M)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_add_sym2_updates_in_place(dtype) -> None:
    """``S += U V' + V U'`` by BLAS rank-one updates, in place, equals the dense products."""
    rng = np.random.default_rng(4)
    B = rng.standard_normal((30, 30))
    S = np.ascontiguousarray((B @ B.T).astype(dtype))
    U, V = rng.standard_normal((30, 2)), rng.standard_normal((30, 2))
    expect = S + (U @ V.T + V @ U.T).astype(dtype)
    before = S.__array_interface__["data"][0]
    add_sym2(S, U, V)
    assert S.__array_interface__["data"][0] == before
    tol = 1e-5 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(S, expect, rtol=tol, atol=tol * np.max(np.abs(expect)))


def _l1_ipm(n: int = 96, seed: int = 0) -> _Ipm:
    inst = draw("sign", seed, n)
    sign = [m for m in inst.constraints.members() if m.name == "sign"][0]
    return _Ipm(inst.problem, Box(-1.0, 1.0) & L1Ball(5.0) & sign, DenseIpmSolver().check_options({}))


def test_sparse_part_is_the_subtracted_schur_complement() -> None:
    """Lagrange's identity: the sparse rows' part ``A_x'W A_x - G D^-1 G'`` formed as a sum of
    positive terms equals the subtracted one where the subtraction is benign (weights 1e-2 to 1e2)."""
    ipm = _l1_ipm()
    ax = ipm.aux
    assert ax is not None and ax.pair_r.size == ipm.F.n_aux  # two rows per auxiliary: one pair each
    rng = np.random.default_rng(0)
    w = 10.0 ** rng.uniform(-2, 2, ipm.F.m)
    D, G, _, _, ws, dw, sparse, _ = ipm._aux_parts(w)
    direct = (ax.Ax_s.T @ np.diag(ws) @ ax.Ax_s - G @ np.diag(1.0 / D) @ G.T)
    np.testing.assert_allclose(sparse.toarray(), np.asarray(direct), rtol=1e-10,
                               atol=1e-12 * np.max(np.abs(direct)))
    assert np.all(sparse.toarray().diagonal() >= 0)


@pytest.mark.parametrize("low", [False, True])
def test_rotated_schur_complement_solves_the_lifted_normal_equations(low: bool, monkeypatch) -> None:
    """With the ball's sum row rotated onto the first coordinate (S scaled first), the Newton
    solves are solves of the lifted normal matrix: normwise backward error at float64's rounding,
    for a vector and a matrix right-hand side, also where the sum row's weight is 1e10 and both
    sides of the ball at 20 coordinates 1e8 (near an optimum). (The forward accuracy this buys on
    a weak ridge is tested end to end below: the old formula's backward error was as small.)"""
    ipm = _l1_ipm()
    monkeypatch.setattr(dense_ipm._AuxBlock, "detect", classmethod(lambda cls, F: None))
    plain = _l1_ipm()
    assert plain.aux is None and ipm.aux is not None
    rng = np.random.default_rng(2)
    w = 10.0 ** rng.uniform(-3, 3, ipm.F.m)
    w[ipm.aux.dense_rows] = 1e10
    w[ipm.aux.sparse_rows[:20]] = 1e8
    M = plain.normal_matrix(w, np.float64)
    solve_M = ipm.factorise(w, low)
    for r in (rng.standard_normal(ipm.F.N), rng.standard_normal((ipm.F.N, 3))):
        y = solve_M(r)
        assert y.shape == r.shape
        backward = np.max(np.abs(M @ y - r)) / (np.max(np.abs(M) @ np.abs(y)) + np.max(np.abs(r)))
        assert backward <= 1e-14, backward


def test_a_weak_ridge_l1_ball_certifies() -> None:
    """(stop 66) An L1 ball with H of rank 120 plus a ridge at 1e-8 of its largest eigenvalue,
    n = 512: dense_ipm ran 100 iterations to a relative gap of 4e-7, uncertified (Clarabel: 3e-8,
    uncertified); it now certifies, at active_set's objective."""
    inst = draw("l1:K=2:c=4:N=30:cond=1e8:planted=true:at_bounds=0.76:dead=0.0", 547, n=512)
    sol = solve(inst.problem, inst.constraints, solver="dense_ipm")
    assert sol.certificate.certified(1e-8), sol.certificate.explain()
    assert sol.iterations < 40
    ref = solve(inst.problem, inst.constraints, solver="active_set")
    assert abs(sol.objective - ref.objective) <= 1e-9 * abs(ref.objective)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 3), st.integers(2, 8), st.integers(0, 2**31 - 1))
@example(3, 7, 14678)
def test_rank_deficient_l1_and_sign_certify_without_crossover(K: int, m: int, seed: int) -> None:
    """Random problems with H of rank about half of n on an L1 ball & sign consensus (the kind
    that stalled before stop 66 and needed the crossover, or diverged in float32): the iteration
    alone certifies at the default 1e-6, at Clarabel's objective or below, and with its crossover at
    1e-8. (Stop 71: a random draw locally, ``K, m, seed = 3, 7, 14678``, J = -0.0144 with terms of ~130,
    ended the iteration at a relative gap of 9.9e-8 with a dual residual of 1e-10; the crossover
    certifies it at 9e-12. This test claimed 1e-8 without the crossover before.)"""
    rng = np.random.default_rng(seed)
    n = K * m
    B = rng.standard_normal((n, max(1, n // 2)))
    problem = MergeQP(B @ B.T, rng.standard_normal(n), 1.0, shape=(K, m))
    cset = L1Ball(0.5 * m) & SignConsensus.from_deltas(rng.standard_normal((K, m, 3)), "rows")
    sol = solve(problem, cset, solver="dense_ipm", crossover=False)
    ref = solve(problem, cset, solver="clarabel")
    assert sol.certificate.certified() or sol.certificate.at_rounding_floor, sol.certificate.explain()
    assert sol.objective <= ref.objective + 1e-7 * max(1.0, abs(ref.objective))
    full = solve(problem, cset, solver="dense_ipm")
    assert full.certificate.certified(1e-8) or full.certificate.at_rounding_floor, full.certificate.explain()


def test_a_float32_factor_whose_first_solve_is_poor_is_given_up(monkeypatch) -> None:
    """A float32 factor is checked by its first solve; one whose residual is above the guard is
    replaced by a float64 factorisation, and float32 is not tried again (here every float32 factor
    is refused by a guard of 0): the same certified point, every factorisation in float64 after
    the first."""
    inst = draw("sign", 0, 96)
    ref = solve(inst.problem, inst.constraints, solver="dense_ipm")
    monkeypatch.setattr(dense_ipm, "FLOAT32_GUARD", 0.0)
    sol = solve(inst.problem, inst.constraints, solver="dense_ipm")
    assert sol.info["float32_rejected"] == 1 and ref.info["float32_rejected"] == 0
    assert sol.info["factorisations"]["float32"] == 1
    assert sol.certificate.certified(1e-8)
    assert abs(sol.objective - ref.objective) <= 1e-9 * abs(ref.objective)


@pytest.mark.parametrize("balls, d", [(2, 2), (3, 3)])
def test_several_l1_balls_on_few_coordinates(balls: int, d: int) -> None:
    """Each L1 ball brings a sum row over its auxiliaries: two balls on n = 2 rotate two rows onto
    both coordinates; three (more rows than coordinates) add ``Z Z'`` as it is. Clarabel's J."""
    rng = np.random.default_rng(0)
    B = rng.standard_normal((2, 2))
    problem = MergeQP(B @ B.T, 3.0 * rng.standard_normal(2), 1.0, shape=(1, 2))
    cset = L1Ball(0.6) & L1Ball(0.5, 0.2)
    if balls == 3:
        cset = cset & L1Ball(0.7, -0.1)
    ipm = _Ipm(problem, cset, DenseIpmSolver().check_options({}))
    assert ipm.aux is not None and ipm.aux.dense_rows.size == d and ipm.aux.nx == 2
    assert (ipm._aux_parts(np.ones(ipm.F.m))[-1] is None) == (d > 2)
    sol = solve(problem, cset, solver="dense_ipm")
    ref = solve(problem, cset, solver="clarabel")
    assert sol.certificate.certified(1e-8)
    assert abs(sol.objective - ref.objective) <= 1e-8 * max(1.0, abs(ref.objective))
