"""The active-set solver's path for a ridge plus a low-rank H (solvers/active_set_low_rank.py): the
detection finds ``H = sigma I + U U'`` exactly where it holds and declines elsewhere; the dual (boxes)
and the proximal face active set (sums) are checked against the same solve without the path, against
Clarabel and ``dense_ipm``, and by the certificate; the path never writes into the caller's start."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mergeqp.constraints import Box, GlobalSimplex, L1Ball, Simplex, intersect
from mergeqp.errors import ValidationError
from mergeqp.problem import MergeQP
from mergeqp.solvers import active_set as A
from mergeqp.solvers import active_set_low_rank as LR
from mergeqp.solvers.instance_families import draw
from mergeqp.solvers.registry import solve


def ridge_low_rank_matrix(rng: np.random.Generator, n: int, r: int, cond: float) -> tuple[np.ndarray, float]:
    """``sigma I + B B'`` with ``B`` ``(n, r)`` of decaying singular values, ``sigma = lambda_max / cond``,
    read-only (as a problem keeps it)."""
    B = rng.standard_normal((n, r)) * (1.0 / (1.0 + np.arange(r)))[None, :] / np.sqrt(r)
    top = float(np.linalg.norm(B, 2)) ** 2
    sigma = top / cond
    H = B @ B.T
    H[np.diag_indices(n)] += sigma
    H.flags.writeable = False
    return H, sigma


def planted_box(rng: np.random.Generator, H: np.ndarray, K: int) -> MergeQP:
    """A merge QP on ``[0, 1]`` whose optimum has about half its coordinates at a bound."""
    n = H.shape[0]
    d = rng.uniform(0.05, 0.95, n)
    at = rng.random(n) < 0.5
    upper = rng.random(n) < 0.5
    d[at] = np.where(upper[at], 1.0, 0.0)
    lam = np.where(at, np.where(upper, -1.0, 1.0) * 10.0 ** rng.uniform(-4, 0, n), 0.0) * float(np.mean(np.diag(H)))
    return MergeQP(H, lam - H @ d, 1.0, shape=(K, n // K))


def test_detection_recovers_sigma_and_the_factor() -> None:
    rng = np.random.default_rng(0)
    H, sigma = ridge_low_rank_matrix(rng, 1200, 40, 1e8)
    lr = LR.ridge_low_rank(H)
    assert lr is not None
    assert lr.rank == 40
    assert lr.sigma == pytest.approx(sigma, rel=1e-6)
    err = H - lr.sigma * np.eye(1200) - lr.U @ lr.U.T
    assert float(np.max(np.abs(err))) <= LR.RESIDUAL * sigma
    assert lr.residual <= 1200 * LR.RESIDUAL * sigma
    assert LR.ridge_low_rank(H) is lr  # kept with the read-only H's values


def test_detection_finds_a_low_rank_h_without_a_ridge() -> None:
    """``H = B B'`` (no ridge): ``sigma = 0`` and the factor to the rounding of H."""
    rng = np.random.default_rng(1)
    B = rng.standard_normal((1200, 40))
    H = B @ B.T
    lr = LR.ridge_low_rank(H)
    assert lr is not None
    assert lr.sigma == 0.0 and lr.rank == 40
    top = float(np.max(np.diag(H)))
    assert float(np.max(np.abs(H - lr.U @ lr.U.T))) <= LR.NO_RIDGE_RESIDUAL * top


@pytest.mark.parametrize("case", ["full_rank", "no_ridge_rank_too_high", "rank_too_high", "uneven_diagonal",
                                  "tiny_spectrum_tail"])
def test_detection_declines_what_is_not_a_ridge_plus_low_rank(case: str) -> None:
    rng = np.random.default_rng(1)
    n = 1200
    if case == "full_rank":
        B = rng.standard_normal((n, n + 50))
        H = B @ B.T / n
    elif case == "no_ridge_rank_too_high":
        B = rng.standard_normal((n, 300))  # 300 > n / 12 = 100
        H = B @ B.T
    elif case == "tiny_spectrum_tail":  # rank 40 plus 500 directions at 1e-9 of the top: not low rank
        B = rng.standard_normal((n, 40))
        C = rng.standard_normal((n, 500))
        H = B @ B.T + 1e-9 * float(np.linalg.norm(B, 2)) ** 2 * (C @ C.T) / float(np.linalg.norm(C, 2)) ** 2
    elif case == "rank_too_high":
        H, _ = ridge_low_rank_matrix(rng, n, 300, 1e6)  # 300 > n / 12 = 100
    else:
        H, _ = ridge_low_rank_matrix(rng, n, 40, 1e6)
        H = H + np.diag(rng.uniform(0.0, 1e-3, n))  # a per-coordinate ridge: no cluster
    assert LR.ridge_low_rank(H) is None


def test_the_sample_bounds_the_rank_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampled block shows a rank only below 3/4 of its rows: with 64 rows a rank of 60 is not
    seen (declined, as a rank above 288 was at any n with the 384 rows of stops 62-63), with the
    default (4/3 of the limit, here 201 rows) it is found."""
    rng = np.random.default_rng(4)
    H, sigma = ridge_low_rank_matrix(rng, 1200, 60, 1e8)
    monkeypatch.setattr(LR, "SAMPLE", 64)
    assert LR.ridge_low_rank(np.array(H)) is None
    monkeypatch.undo()
    lr = LR.ridge_low_rank(np.array(H))
    assert lr is not None and lr.rank == 60 and lr.sigma == pytest.approx(sigma, rel=1e-6)


def test_active_set_takes_the_dual_path_on_a_box_and_agrees_with_the_engine_alone() -> None:
    rng = np.random.default_rng(2)
    H, _ = ridge_low_rank_matrix(rng, 1200, 50, 1e8)
    problem = planted_box(rng, H, 4)
    sol = solve(problem, Box(0.0, 1.0), solver="active_set")
    assert sol.certificate.certified(1e-8)
    info = sol.info["low_rank"]
    assert info["rank"] == 50 and info["newton_steps"] >= 1 and info["face_converged"]
    plain = solve(problem, Box(0.0, 1.0), solver="active_set", low_rank="off")
    assert "low_rank" not in plain.info
    assert sol.objective == pytest.approx(plain.objective, rel=1e-9, abs=1e-12)
    clarabel = solve(problem, Box(0.0, 1.0), solver="clarabel")
    assert sol.objective <= clarabel.objective + 1e-7 * max(1.0, abs(clarabel.objective))


@pytest.mark.parametrize(("K", "kind", "taken"), [(4, "box", True), (2, "l1", True), (8, "simplex", True),
                                                  (2, "simplex", False), (3, "simplex", False)])
def test_the_rank_limit_is_an_eighth_of_the_sets_dimension(K: int, kind: str, taken: bool) -> None:
    """Rank 120 at n = 1200 lies between n / 12 (100) and n / 8 (150): taken on a box and an L1 ball
    (dimension n), on a per-atom simplex of 8 coefficients (dimension 7n / 8, limit 131), not on one of
    2 or 3 (dimension n / 2 or 2n / 3: the limit stays n / 12), which the interior point on the same
    factor takes instead (its rank is within n / 4 and its ridge weak, stop 69). Either way the same
    optimum as the engine alone, certified."""
    rng = np.random.default_rng(21)
    H, _ = ridge_low_rank_matrix(rng, 1200, 120, 1e8)
    problem = planted_box(rng, H, K)
    cset = {"box": Box(0.0, 1.0), "l1": L1Ball(300.0), "simplex": Simplex(1.0)}[kind]
    groups = 1200 // K if kind == "simplex" else 0
    assert LR.rank_limit(1200, A.set_structure(cset, (K, 1200 // K))) == max(100, (1200 - groups) // 8)
    sol = solve(problem, cset, solver="active_set")
    assert sol.info["low_rank"]["rank"] == 120
    assert (sol.info["low_rank"].get("method") == "interior point") == (not taken)
    assert sol.certificate.certified(1e-8)
    plain = solve(problem, cset, solver="active_set", low_rank="off")
    assert sol.objective == pytest.approx(plain.objective, rel=1e-9, abs=1e-10)


def test_a_box_whose_dual_fails_falls_back_to_the_proximal_faces(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a ridge, where the dual reaches no optimum (made to here: every stage fails, and so does
    the face active set that follows it, its first call), the proximal faces solve the box instead
    of the engine from scratch, and the point is certified."""
    rng = np.random.default_rng(23)
    H, _ = ridge_low_rank_matrix(rng, 1200, 60, 1e8)
    problem = planted_box(rng, H, 4)
    face_pdas, calls = LR._face_pdas, []

    def failing_stage(lr, g, st, rho, xc, nu, tol, jac):
        return xc, nu, LR.STAGE_STEPS, False

    def first_face_fails(lr, g, st, x, book=None, gram=None):
        calls.append(1)
        return (None, LR.PDAS_STEPS) if len(calls) == 1 else face_pdas(lr, g, st, x, book, gram)

    monkeypatch.setattr(LR, "_stage", failing_stage)
    monkeypatch.setattr(LR, "_face_pdas", first_face_fails)
    sol = solve(problem, Box(0.0, 1.0), solver="active_set")
    info = sol.info["low_rank"]
    assert info["method"] == "dual, then proximal faces" and not info["dual_settled"]
    assert info["face_converged"] and "failed" not in info
    assert sol.certificate.certified(1e-8)
    assert sol.info["factorisations"] == 0  # the engine returned at the path's point
    plain = solve(problem, Box(0.0, 1.0), solver="active_set", low_rank="off")
    assert sol.objective == pytest.approx(plain.objective, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("cset", [Simplex(1.0), GlobalSimplex(300.0)], ids=["simplex", "global_simplex"])
def test_sum_groups_take_the_proximal_face_path(cset) -> None:
    """On a simplex the path is the face active set on proximal problems (Woodbury faces), and it ends
    at the engine's own optimum, certified."""
    rng = np.random.default_rng(8)
    H, _ = ridge_low_rank_matrix(rng, 1200, 40, 1e6)
    problem = planted_box(rng, H, 4)
    sol = solve(problem, cset, solver="active_set")
    info = sol.info["low_rank"]
    assert info["method"] == "proximal faces" and info["face_converged"] and info["stages"] >= 2
    assert sol.certificate.certified(1e-8)
    plain = solve(problem, cset, solver="active_set", low_rank="off")
    assert "low_rank" not in plain.info
    assert sol.objective == pytest.approx(plain.objective, rel=1e-9, abs=1e-10)


@pytest.mark.parametrize("direct", [False, True], ids=["woodbury", "own coordinates"])
@pytest.mark.parametrize("sums", [False, True], ids=["box", "per-atom sums"])
def test_a_face_solve_is_the_face_kkt_solution(sums: bool, direct: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``_affine_face_point`` (Woodbury; or, stop 75, the face's own ``|F| x |F|`` system, which it takes
    for faces of at most ``SMALL_FACE_SHARE`` of the rank free coordinates) against the dense KKT system
    of the same face."""
    from mergeqp.constraints.kernels import SetStructure

    monkeypatch.setattr(LR, "SMALL_FACE_SHARE", 1e9 if direct else 0.0)

    rng = np.random.default_rng(6)
    K, m, r = 3, 30, 5
    n = K * m
    U = rng.standard_normal((n, r))
    lr = LR.RidgeLowRank(U, 0.05, 0.0)
    H = 0.05 * np.eye(n) + U @ U.T
    g = rng.standard_normal(n)
    if sums:
        st_ = SetStructure(np.zeros(n), np.full(n, np.inf), group=np.tile(np.arange(m), K), totals=np.ones(m))
    else:
        st_ = SetStructure(np.full(n, -1.0), np.full(n, 2.0))
    free = rng.random(n) < 0.6
    if sums:
        free.reshape(K, m)[0] = True  # every group keeps a free coordinate
    at_hi = ~free & (rng.random(n) < 0.5) & np.isfinite(st_.hi)
    fixed = np.where(at_hi, st_.hi, st_.lo)
    fixed[free] = 0.0
    eq = (st_.group, np.ones(n), st_.totals) if sums else None
    x = LR._affine_face_point(lr, g, free, fixed, eq)
    assert x is not None
    F, N = np.flatnonzero(free), np.flatnonzero(~free)
    xN = np.where(at_hi, st_.hi, st_.lo)[N]
    np.testing.assert_array_equal(x[N], xN)
    A = (np.tile(np.arange(m), K)[F][None, :] == np.arange(m)[:, None]).astype(float) if sums else np.zeros((0, F.size))
    b = np.ones(m) - np.bincount(np.tile(np.arange(m), K)[N], xN, minlength=m) if sums else np.zeros(0)
    kkt = np.block([[H[np.ix_(F, F)], A.T], [A, np.zeros((A.shape[0], A.shape[0]))]])
    rhs = np.concatenate([-(g[F] + H[np.ix_(F, N)] @ xN), b])
    ref = np.linalg.solve(kkt, rhs)[: F.size]
    np.testing.assert_allclose(x[F], ref, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("cset", [Box(0.0, 1.0), Simplex(1.0)], ids=["box", "simplex"])
def test_the_face_active_set_reaches_the_optimum_of_the_structured_problem(cset) -> None:
    """From the start's face, ``_face_pdas`` ends at the optimum of ``sigma I + U U'`` (exact here),
    the point Clarabel finds."""
    rng = np.random.default_rng(7)
    H, _ = ridge_low_rank_matrix(rng, 240, 8, 1e5)
    problem = planted_box(rng, H, 4)
    lr = LR.ridge_low_rank(H)
    assert lr is not None
    st_ = A.set_structure(cset, problem.shape)
    x0 = A.project_structure(st_, np.full(problem.n, 0.25))
    x, steps = LR._face_pdas(lr, problem.g, st_, x0)
    assert x is not None and 1 <= steps <= LR.PDAS_STEPS
    ref = solve(problem, cset, solver="clarabel")
    assert problem.objective(x.reshape(problem.shape)) == pytest.approx(ref.objective, rel=1e-7, abs=1e-9)


def test_a_box_solve_ends_without_a_factorisation() -> None:
    """On a box the dual's polished point meets the engine's stopping test: no face is factorised."""
    rng = np.random.default_rng(3)
    H, _ = ridge_low_rank_matrix(rng, 1536, 60, 1e8)
    problem = planted_box(rng, H, 3)
    sol = solve(problem, Box(0.0, 1.0), solver="active_set")
    assert sol.info["factorisations"] == 0 and sol.info["face_iterations"] == 0
    assert sol.certificate.certified(1e-8)


def test_a_stage_that_does_not_settle_is_tried_again_with_a_smaller_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage reported unsettled (the second, forced here) is tried again from the last settled stage at
    a rho the square root of the step down below it, and the solve still ends certified at the engine's
    optimum."""
    rng = np.random.default_rng(9)
    H, _ = ridge_low_rank_matrix(rng, 1200, 40, 1e8)
    problem = planted_box(rng, H, 4)
    reference = solve(problem, Box(0.0, 1.0), solver="active_set", low_rank="off")
    real_stage, rhos = LR._stage, []

    def stage(lr, g, st_, rho, xc, nu, tol, jac):  # type: ignore[no-untyped-def]
        rhos.append(rho)
        x, nu, steps, ok = real_stage(lr, g, st_, rho, xc, nu, tol, jac)
        return x, nu, steps, ok and len(rhos) != 2

    monkeypatch.setattr(LR, "_stage", stage)
    sol = solve(problem, Box(0.0, 1.0), solver="active_set")
    assert sol.info["low_rank"]["stage_retries"] == 1
    assert rhos[2] == pytest.approx(rhos[0] / np.sqrt(LR.DECREASE))
    assert sol.certificate.certified(1e-8)
    assert sol.objective == pytest.approx(reference.objective, rel=1e-9, abs=1e-12)


def test_the_warm_start_is_read_not_written() -> None:
    rng = np.random.default_rng(4)
    H, _ = ridge_low_rank_matrix(rng, 1200, 30, 1e7)
    problem = planted_box(rng, H, 4)
    x0 = np.full(problem.shape, 0.3)
    x0.flags.writeable = False
    keep = x0.copy()
    sol = solve(problem, Box(0.0, 1.0), solver="active_set", x0=x0)
    np.testing.assert_array_equal(x0, keep)
    assert "low_rank" in sol.info and sol.certificate.certified(1e-8)


def test_the_option_is_checked_by_name() -> None:
    rng = np.random.default_rng(5)
    H, _ = ridge_low_rank_matrix(rng, 64, 4, 1e4)
    problem = planted_box(rng, H, 2)
    with pytest.raises(ValidationError, match="low_rank"):
        solve(problem, Box(0.0, 1.0), solver="active_set", low_rank="yes")


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), K=st.sampled_from([2, 3, 4]), m=st.integers(20, 60),
       r=st.integers(1, 12), cond=st.sampled_from([1e3, 1e6, 1e9, np.inf]),
       kind=st.sampled_from(["box", "wide_box", "half_line", "pinned_box", "simplex", "global_simplex",
                             "capped_simplex", "l1", "box_l1"]),
       interpolating=st.booleans())
def test_dual_path_matches_the_reference_on_small_problems(monkeypatch: pytest.MonkeyPatch, seed: int, K: int, m: int,
                                                           r: int, cond: float, kind: str, interpolating: bool) -> None:
    """With the size gate lowered, every solve through the path (the dual on boxes: finite, wide,
    one-sided, with coinciding bounds; the proximal faces on per-atom, global and capped simplices, an
    L1 ball and a box with an L1 ball; with a ridge and without one, ``cond = inf``, where an
    interpolating ``g = -H x*``, ``x*`` on the set, makes ``J* = 0``) is certified (or, at ``J* = 0``,
    at its rounding floor) and has ``dense_ipm``'s objective. (The engine alone is not the
    reference: on seed 20, K = 2, m = 20, r = 1, cond 1e3, per-atom simplex it ends INACCURATE after
    39 faces, a gap of 0.8%.)"""
    monkeypatch.setattr(A, "LOW_RANK_MIN_N", 1)
    monkeypatch.setattr(A, "NO_RIDGE_MIN_N", 1)
    monkeypatch.setattr(LR, "SAMPLE", 48)
    rng = np.random.default_rng(seed)
    n = K * m
    if kind == "half_line":  # its optimum lies at |g| / sigma: at cond 1e9 (x ~ 1e8) no solver certifies it
        cond = min(cond, 1e4)
    H, _ = ridge_low_rank_matrix(rng, n, r, cond)
    interpolating = interpolating and not np.isfinite(cond)
    g, c = rng.standard_normal(n) * float(np.mean(np.diag(H))) * 3.0, 1.0
    pinned = rng.random((K, m)) < 0.1  # coordinates whose bounds coincide
    cset = {"box": Box(0.0, 1.0), "wide_box": Box(-5.0, 5.0), "half_line": Box(0.0, np.inf),
            "pinned_box": Box(np.where(pinned, 0.5, 0.0), np.where(pinned, 0.5, 1.0)),
            "simplex": Simplex(1.0), "global_simplex": GlobalSimplex(float(m)),
            "capped_simplex": intersect([Box(0.0, 0.6), Simplex(1.0)]),
            "l1": L1Ball(0.2 * n), "box_l1": intersect([Box(-1.0, 1.0), L1Ball(0.1 * n)])}[kind]
    if interpolating:
        x_star = cset.project(rng.uniform(-1.0, 1.0, (K, m))).ravel()
        g, c = -(H @ x_star), 0.5 * float(x_star @ (H @ x_star))
    problem = MergeQP(H, g, c, shape=(K, m))

    def optimal(sol) -> bool:
        return bool(sol.certificate.certified(1e-8) or (interpolating and sol.certificate.at_rounding_floor))

    reference = solve(problem, cset, solver="dense_ipm")
    assert optimal(reference)
    sol = solve(problem, cset, solver="active_set")
    groups = {"simplex": m, "capped_simplex": m, "global_simplex": 1}.get(kind, 0)
    n_set = n
    if "paired" in sol.info:  # sums of two coordinates: the engine's set is a box of n / 2 (stop 65)
        assert groups == n / 2
        n_set, groups = n // 2, 0
    # the rank limit: an eighth of the set's dimension, at least n / 12; else the engine alone, except
    # on an L1 ball alone with a weak ridge or none, up to n / 4 (stop 67; there the pre-test's count
    # of the sampled block's rank may run a few above r, so near n / 4 either is right)
    base_limit = max(n_set / 12, (n_set - groups) / 8)
    weak = not np.isfinite(cond) or float(np.min(np.linalg.eigvalsh(H))) <= LR.WEAK_RIDGE * float(np.max(np.diag(H)))
    if r <= base_limit:
        assert "low_rank" in sol.info
    elif kind == "l1" and weak and r <= n / 4:
        assert "low_rank" not in sol.info or sol.info["low_rank"]["rank"] == r
    else:
        assert "low_rank" not in sol.info
    assert optimal(sol)
    scale = float(np.abs(g).sum()) + abs(c)
    assert sol.objective == pytest.approx(reference.objective, rel=1e-8, abs=1e-9 * scale)


def interpolating_qp(rng: np.random.Generator, K: int, m: int, r: int, x_star: np.ndarray) -> MergeQP:
    """``J = 1/2 (x - x*)'H(x - x*)`` with ``H = B B'`` of rank ``r`` (no ridge): ``J* = 0`` at every
    ``x`` with ``B'x = B'x*`` (a merge QP whose fine-tunes the calibration data cannot tell apart)."""
    B = rng.standard_normal((K * m, r)) / np.sqrt(r)
    H = B @ B.T
    H.flags.writeable = False
    return MergeQP(H, -(H @ x_star), 0.5 * float(x_star @ (H @ x_star)), shape=(K, m))


@pytest.mark.parametrize("cset", [Box(0.0, 1.0), Simplex(1.0), L1Ball(300.0)], ids=["box", "simplex", "l1"])
def test_an_interpolating_problem_without_a_ridge_ends_at_the_floor_without_a_face_solve(cset) -> None:
    """J* = 0, H of rank 30 and no ridge: the path's point, polished, is optimal to float64 precision
    (the engine accepts it at once: no face iteration), where the engine alone wanders (stop 58)."""
    rng = np.random.default_rng(11)
    K, m = 4, 300
    x_star = rng.dirichlet(np.ones(K), size=m).T.ravel() if isinstance(cset, Simplex) else rng.uniform(0.0, 1.0, K * m)
    if isinstance(cset, L1Ball):
        x_star = x_star * (200.0 / float(np.abs(x_star).sum()))
    problem = interpolating_qp(rng, K, m, 30, x_star)
    sol = solve(problem, cset, solver="active_set")
    info = sol.info["low_rank"]
    assert info["sigma"] == 0.0 and info["rank"] == 30
    assert sol.info["face_iterations"] == 0
    cert = sol.certificate
    assert cert.feasible and (cert.certified(1e-8) or cert.at_rounding_floor)
    assert abs(sol.objective) <= 1e-9 * float(problem.c)


@pytest.mark.parametrize("cset", [Box(0.0, 1.0), Simplex(1.0)], ids=["box", "simplex"])
def test_a_low_rank_problem_without_a_ridge_agrees_with_dense_ipm(cset) -> None:
    """J* > 0 (g not reachable on the set), H of rank 40 and no ridge: the path's point is certified
    with ``dense_ipm``'s objective."""
    rng = np.random.default_rng(12)
    K, m = 4, 300
    B = rng.standard_normal((K * m, 40)) / np.sqrt(40)
    H = B @ B.T
    H.flags.writeable = False
    problem = MergeQP(H, B @ (3.0 * rng.standard_normal(40)), 5.0, shape=(K, m))
    sol = solve(problem, cset, solver="active_set")
    assert sol.info["low_rank"]["sigma"] == 0.0
    assert sol.certificate.certified(1e-8)
    ref = solve(problem, cset, solver="dense_ipm")
    assert sol.objective == pytest.approx(ref.objective, rel=1e-8, abs=1e-9)


@pytest.mark.parametrize("ridge", [False, True], ids=["no ridge", "ridge"])
def test_below_256_only_h_without_a_ridge_takes_the_path(ridge: bool) -> None:
    """At n = 120 (the defaults: ``NO_RIDGE_MIN_N`` 64, ``LOW_RANK_MIN_N`` 256) an interpolating box
    without a ridge takes the path and ends at the floor; with a ridge the engine solves alone."""
    rng = np.random.default_rng(15)
    K, m, r = 2, 60, 6
    x_star = rng.uniform(0.0, 1.0, K * m)
    problem = interpolating_qp(rng, K, m, r, x_star)
    if ridge:
        H = np.array(problem.H)
        H[np.diag_indices_from(H)] += 1e-6 * float(np.max(np.diag(H)))
        H.flags.writeable = False
        problem = MergeQP(H, problem.g, problem.c, shape=(K, m))
    sol = solve(problem, Box(0.0, 1.0), solver="active_set")
    assert ("low_rank" in sol.info) == (not ridge)
    cert = sol.certificate
    assert cert.feasible and (cert.certified(1e-8) or cert.at_rounding_floor)


def test_interpolation_is_told_by_a_gradient_that_vanishes_everywhere() -> None:
    """``J* = 0`` (``g = -U U' x*``): the gradient vanishes at ``x*`` and at any ``x`` with the same
    ``U'x``; a ``g`` with a component outside ``U``'s range leaves a gradient at every point."""
    rng = np.random.default_rng(14)
    U = rng.standard_normal((200, 10))
    lr = LR.RidgeLowRank(U, 0.0, 0.0)
    x_star = rng.uniform(0.0, 1.0, 200)
    g = -(U @ (U.T @ x_star))
    null_move = rng.standard_normal(200)
    null_move -= U @ np.linalg.lstsq(U, null_move, rcond=None)[0]  # orthogonal to U's columns
    assert LR._interpolating(lr, g, x_star)
    assert LR._interpolating(lr, g, x_star + 0.1 * null_move)
    assert not LR._interpolating(lr, g, x_star + 1e-3 * U[:, 0])
    assert not LR._interpolating(lr, g + 1e-3 * float(np.abs(g).max()) * null_move / float(np.abs(null_move).max()), x_star)


def test_the_weighted_null_projection_keeps_the_equations_and_is_symmetric_in_its_weights() -> None:
    rng = np.random.default_rng(13)
    n, G = 40, 5
    group = rng.integers(0, G, n)
    a = rng.choice([-1.0, 1.0], n)
    F = np.sort(rng.choice(n, 30, replace=False))
    w = rng.uniform(0.01, 2.0, F.size)
    null = LR._weighted_null(F, (group, a, np.ones(G)), w)
    V = rng.standard_normal((F.size, 3))
    A = np.zeros((G, F.size))
    A[group[F], np.arange(F.size)] = a[F]
    assert np.allclose(A @ null(V), 0.0, atol=1e-12)  # A N = 0
    NW = null(np.diag(w))
    assert np.allclose(NW, NW.T, atol=1e-12)  # N W symmetric: N W u is a weighted least-norm direction
    assert np.allclose(null(null(V)), null(V), atol=1e-12)  # a projection


def test_without_a_ridge_the_last_proximal_stage_repeats_while_its_face_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    """``l1_midrank`` seed 0 (an L1 ball, rank 336, no ridge): the first last stage's face is not the
    optimum's, and the engine had to go on from the polished point (faces factorised); repeating that
    stage, centred at its point, until its face holds leaves the engine nothing to do. The same
    optimum both ways."""
    inst = draw("l1_midrank", 0)
    sol = solve(inst.problem, inst.constraints, solver="active_set")
    assert sol.certificate.certified(1e-8) and sol.info["factorisations"] == 0
    monkeypatch.setattr(LR, "NO_RIDGE_REPEATS", 0)
    once = solve(inst.problem, inst.constraints, solver="active_set")
    assert once.info["low_rank"]["stages"] < sol.info["low_rank"]["stages"]
    assert once.info["factorisations"] > 0 and once.certificate.certified(1e-8)
    assert sol.objective == pytest.approx(once.objective, rel=1e-10)


@pytest.mark.parametrize(("name", "method", "n"), [("box_lowrank", "dual", 1536), ("simplex_lowrank", "proximal faces", 1536),
                                              ("box_midrank", "dual", 3072), ("l1_midrank", "proximal faces", 3072)])
def test_the_low_rank_families_are_a_ridge_plus_rank_c_n(name: str, method: str, n: int) -> None:
    """The benchmark's cells for this path: ``box_lowrank`` / ``simplex_lowrank`` (rank 100) and
    ``box_midrank`` / ``l1_midrank`` (rank 336 at n = 3072: above n / 12, within n / 8, stop 64's
    limit): the detection finds rank ``c N`` (and the ridge, or none); the boxes are solved through
    the dual, the simplex and the L1 ball by the proximal faces, certified, at the planted optimum."""
    inst = draw(name, 0, n)
    fam = inst.family
    assert (fam.c * fam.N > n // 12) == ("midrank" in name)
    lr = LR.ridge_low_rank(inst.problem.H)
    assert lr is not None and lr.rank == fam.c * fam.N
    sol = solve(inst.problem, inst.constraints, solver="active_set")
    assert sol.info["low_rank"]["rank"] == fam.c * fam.N
    assert sol.info["low_rank"]["method"] == method
    assert sol.certificate.certified(1e-8)
    assert sol.objective == pytest.approx(inst.objective, rel=1e-8)


@pytest.mark.parametrize("sigma", [1e-12, 0.0])
def test_a_level_that_fails_again_ends_the_proximal_stages(sigma: float) -> None:
    """Stop 65: the schedule backs up after a failed stage, and a level of rho that fails a second
    time ends it (before, it alternated between the settled level and the failed one below until
    PROX_FAILS ran out). A scripted stage: levels 0, 1, 2 settle, 3 fails, 2 settles, 3 fails again."""
    n = 6
    lr = LR.RidgeLowRank(np.ones((n, 1)), sigma, 0.0)
    calls: list[float] = []
    point = np.full(n, 0.5)

    def stage(lr_s: LR.RidgeLowRank, h: np.ndarray, x: np.ndarray) -> tuple[np.ndarray | None, int]:
        calls.append(lr_s.sigma - sigma)
        return (None, 3) if len(calls) in (4, 6, 8, 10) else (point.copy(), 2)

    x, info = LR._proximal_stages(lr, np.zeros(n), point, 1.0, stage)
    assert info["stages"] == 6 and info["stage_failures"] == 2 and len(calls) == 6
    rho = [1e-2 / LR.PROX_DECREASE ** k for k in (0, 1, 2, 3, 2, 3)]
    np.testing.assert_allclose(calls, rho, rtol=1e-12)
    if sigma > 0:
        assert x is None and info["failed"]
    else:  # without a ridge the last settled stage's point is the path's result
        np.testing.assert_array_equal(x, point)


def flat_low_rank(rng: np.random.Generator, n: int, r: int, cond: float) -> np.ndarray:
    """``sigma I + B B'`` with ``B`` ``(n, r)`` i.i.d. (no ridge where ``cond`` is infinite),
    ``sigma = lambda_max / cond``, read-only."""
    B = rng.standard_normal((n, r)) / np.sqrt(r)
    H = B @ B.T
    if np.isfinite(cond):
        H[np.diag_indices(n)] += float(np.linalg.norm(B, 2)) ** 2 / cond
    H.flags.writeable = False
    return H


def planted_ball(rng: np.random.Generator, H: np.ndarray, K: int) -> tuple[MergeQP, L1Ball]:
    """A merge QP on an L1 ball whose optimum has about 60% of its coordinates at the centre (0)."""
    n = H.shape[0]
    d = rng.uniform(0.05, 1.0, n) * rng.choice([-1.0, 1.0], n)
    d[rng.random(n) < 0.6] = 0.0
    nu = float(np.mean(np.diag(H)))
    lam = np.where(d != 0, -nu * np.sign(d), nu * rng.uniform(-0.9, 0.9, n))
    return MergeQP(H, lam - H @ d, 1.0, shape=(K, n // K)), L1Ball(float(np.sum(np.abs(d))))


@pytest.mark.parametrize("rank", [240])
@pytest.mark.parametrize("cond", [1e9, np.inf])
def test_an_l1_ball_with_a_weak_ridge_takes_the_path_up_to_a_quarter_of_n(cond: float, rank: int) -> None:
    """Rank 240 at n = 1200 lies between n / 8 (150) and n / 4 (300): on an L1 ball alone with a weak
    ridge (or none) the path takes it (stop 67), and reaches the engine's optimum, certified. (Stop 75
    took it to 0.4 n and went back: a review's balls of that rank were slower and some ended uncertified.)"""
    rng = np.random.default_rng(67)
    H = flat_low_rank(rng, 1200, rank, cond)
    problem, ball = planted_ball(rng, H, 4)
    st = A.set_structure(ball, problem.shape)
    assert LR.rank_limit(1200, st) == 150
    lr = LR.ball_low_rank(H, st)
    assert lr is not None and lr.rank == rank
    assert (lr.sigma == 0.0) == (not np.isfinite(cond))
    assert LR.ball_low_rank(H, st) is lr  # kept with the read-only H's values
    sol = solve(problem, ball, solver="active_set")
    assert sol.info["low_rank"]["rank"] == rank
    assert sol.certificate.certified(1e-8)
    plain = solve(problem, ball, solver="active_set", low_rank="off")
    assert "low_rank" not in plain.info
    assert sol.objective == pytest.approx(plain.objective, rel=1e-9, abs=1e-10)
    clarabel = solve(problem, ball, solver="clarabel")
    assert sol.objective <= clarabel.objective + 1e-7 * max(1.0, abs(clarabel.objective))


@pytest.mark.parametrize("case", ["strong_ridge", "ball_and_box", "box", "rank_too_high", "full_rank"])
def test_the_wider_limit_is_only_for_an_l1_ball_with_a_weak_ridge(case: str) -> None:
    """The pre-test declines a ridge above ``WEAK_RIDGE`` (there the engine was as fast), a ball
    with a box and a box (where the path lost as often as it won), a rank above n / 4 and a
    full-rank H; the solve then runs without the path, as before. (The box, whose flat spectrum the
    path's sample cannot see, is a late candidate of the interior point since stop 71: its pre-test runs
    once the engine's work passes one Cholesky of H, and here the engine finishes within the head start
    that follows.)"""
    rng = np.random.default_rng(68)
    n, rank, cond = 1200, 240, 1e9
    if case == "strong_ridge":
        cond = 1e5
    elif case == "rank_too_high":
        rank = 360
    H = flat_low_rank(rng, n, n + 50 if case == "full_rank" else rank, cond)
    problem, ball = planted_ball(rng, H, 4)
    cset = {"ball_and_box": intersect([ball, Box(-0.5, 0.5)]), "box": Box(-1.0, 1.0)}.get(case, ball)
    st = A.set_structure(cset, problem.shape)
    assert LR.ball_low_rank(H, st) is None
    sol = solve(problem, cset, solver="active_set")
    if case == "box":
        assert sol.info["low_rank"]["late"] and not sol.info["low_rank"]["taken"]
    else:
        assert "low_rank" not in sol.info
    assert sol.certificate.certified(1e-8)


def test_the_pre_test_counts_the_rank_above_the_weak_ridge() -> None:
    """LAPACK's pivoted Cholesky of the sampled block stops at the weak ridge's level: about rank 240
    of a block of 401 rows (4/3 of the limit 300, plus one) with cond 1e9 (a few more pivots: its
    trailing diagonal after 240 steps is the ridge's Schur complement, up to ~1e-7 of the largest on
    some rows where sigma is ~1e-8 of it), so within the limit; the whole block with cond 1e5."""
    import scipy.linalg as sla
    rng = np.random.default_rng(69)
    for cond, expected in ((1e9, 240), (1e5, None)):
        H = flat_low_rank(rng, 1200, 240, cond)
        idx = LR._sample(1200, LR.SAMPLE, 300, 0)
        assert idx is not None and idx.size == 401
        S = np.array(H[np.ix_(idx, idx)])
        _, _, rank, info = sla.lapack.dpstrf(S, tol=LR.WEAK_RIDGE * float(np.max(np.diag(S))))
        if expected:
            assert info == 1 and expected <= rank <= 0.75 * idx.size
        else:
            assert (rank, info) == (401, 0)


def test_the_free_rows_gram_follows_the_faces() -> None:
    """``_FreeGram`` after any sequence of masks (a few rows changed, none, most of them) is the
    Gram matrix of the current free rows, to the rounding of a fresh sum; it recomputes once its
    updates reach its rows."""
    rng = np.random.default_rng(70)
    U = rng.standard_normal((400, 30))
    gram = LR._FreeGram(U)
    free = rng.random(400) < 0.5
    for step in range(40):
        flips = rng.choice(400, size=int(rng.choice([0, 3, 20, 300])), replace=False)
        free = free.copy()
        free[flips] = ~free[flips]
        G = gram(free)
        fresh = U[free].T @ U[free]
        assert np.allclose(G, fresh, rtol=0.0, atol=1e-12 * float(np.max(np.abs(fresh))))
        assert gram.updates <= max(int(np.count_nonzero(free)), 1)


@pytest.mark.parametrize("kind", ["ball", "sums", "none"])
def test_a_face_point_from_the_kept_gram_is_the_fresh_one(kind: str) -> None:
    """The Woodbury face solve with the Gram matrix kept across faces gives the point of a fresh
    one (the equations' correction ``B'(AA')^-1 B`` in place of forming ``V'V``), and both solve the
    face's KKT system."""
    rng = np.random.default_rng(71)
    n, r, sigma = 300, 40, 1e-3
    U = rng.standard_normal((n, r)) / np.sqrt(r)
    lr = LR.RidgeLowRank(U, sigma, 0.0)
    h = rng.standard_normal(n)
    gram = LR._FreeGram(U)
    for _ in range(3):
        x = rng.uniform(0.1, 1.0, n) * rng.choice([-1.0, 1.0], n) * (rng.random(n) < 0.6)
        free = x != 0
        if kind == "ball":
            a = np.where(x >= 0, 1.0, -1.0)
            eq = (np.zeros(n, dtype=np.intp), a, np.array([float(np.sum(np.abs(x)))]))
        elif kind == "sums":
            group = np.arange(n) % 30
            eq = (group, np.ones(n), np.bincount(group, x, minlength=30))
        else:
            eq = None
        kept = LR._affine_face_point(lr, h, free, x, eq, gram)
        fresh = LR._affine_face_point(lr, h, free, x, eq)
        assert kept is not None and fresh is not None
        assert np.allclose(kept, fresh, rtol=0.0, atol=1e-9 * float(np.max(np.abs(fresh))))
        F = np.flatnonzero(free)
        grad = sigma * kept + U @ (U.T @ kept) + h
        if eq is None:
            assert float(np.max(np.abs(grad[F]))) <= 1e-9 * float(np.max(np.abs(h)))
        else:  # the gradient on the face is a combination of the equations' rows
            group, a, totals = eq
            Gf = group[F]
            mult = np.bincount(Gf, a[F] * grad[F]) / np.maximum(np.bincount(Gf, a[F] ** 2), 1e-300)
            assert float(np.max(np.abs(grad[F] - a[F] * mult[Gf]))) <= 1e-9 * float(np.max(np.abs(h)))
            assert np.allclose(np.bincount(Gf, a[F] * kept[F], minlength=totals.size)
                               + np.bincount(group[~free], (a * kept)[~free], minlength=totals.size), totals)


@pytest.mark.parametrize("cond", [1e11, 1e12, 1e13])
def test_a_ridge_too_weak_to_use_is_taken_as_none(cond: float) -> None:
    """A ridge below ``SIGMA_MIN`` of the sample's top eigenvalue but above the rounding cluster
    (cond 1e11-1e13) was neither a ridge nor the null space's cluster, and the detection declined
    (stop 67: such an interpolating box at n = 768 ended INACCURATE in the engine, and ``auto`` went
    on to ``dense_ipm``). It joins the cluster and is taken out of the factor: H is low rank without
    a ridge (the ridge left in the residual), and the solve through the path is certified at
    ``dense_ipm``'s J."""
    rng = np.random.default_rng(72)
    H = flat_low_rank(rng, 1200, 100, cond)
    lr = LR.ridge_low_rank(H)
    assert lr is not None and lr.sigma == 0.0 and lr.rank == 100
    assert lr.residual <= 3.0 * 1200 * float(np.linalg.eigvalsh(H)[0])  # the weak ridge, n sigma
    problem = planted_box(rng, H, 4)
    sol = solve(problem, Box(0.0, 1.0), solver="active_set")
    assert sol.info["low_rank"]["rank"] == 100
    assert sol.certificate.certified(1e-8)
    ipm = solve(problem, Box(0.0, 1.0), solver="dense_ipm")
    assert sol.objective == pytest.approx(ipm.objective, rel=1e-8, abs=1e-12)


@pytest.mark.parametrize("cond", [1e11, 1e12, float("inf")])
def test_the_weak_ridge_taken_as_none_is_kept_to_retry_with(cond: float) -> None:
    """The detection takes a ridge below ``SIGMA_MIN`` as none and keeps it (``weak``: the sample's
    smallest eigenvalue, here the ridge itself) for the retry; without a ridge (cond inf) there is
    none to keep (the sample's smallest eigenvalue is rounding)."""
    rng = np.random.default_rng(73)
    H = flat_low_rank(rng, 1200, 100, cond)
    lr = LR.ridge_low_rank(H)
    assert lr is not None and lr.sigma == 0.0 and lr.rank == 100
    if np.isfinite(cond):
        true_sigma = float(np.linalg.eigvalsh(H)[0])
        assert lr.weak == pytest.approx(true_sigma, rel=1e-3)
        ridged = lr.with_weak_ridge()
        assert ridged is not None and ridged.sigma == lr.weak and ridged.rank == 100
        assert np.shares_memory(ridged.U, lr.U)  # the same factor: H - weak I = U U'
        # the residual left is the factor's own, without the n weak that the no-ridge view counted
        assert 0.0 <= ridged.residual <= 1e-3 * lr.residual
    else:
        assert lr.weak == 0.0 and lr.with_weak_ridge() is None


def test_an_interpolating_box_with_a_weak_ridge_is_solved_with_the_ridge(monkeypatch: pytest.MonkeyPatch) -> None:
    """An interpolating box (the synthetic merge QP's own g, rank c N = 100 of n = 1536, cond 1e12):
    the path without the weak ridge ends on the flat set of optima of ``U U'``, where the ridge is
    what decides ``J* ~ 5e-10``, and the engine's faces there are ill-conditioned at the ridge's
    level: until stop 68 it wandered until its wait ran out (INACCURATE, ~0.6 s, and ``auto`` paid
    for ``dense_ipm`` on top). The path again with the ridge as its ridge certifies it (0.08 s)."""
    inst = draw("box_free:set_type=box:K=4:c=2:N=50:cond=1e12:at_bounds=0.5:planted=false", seed=3002, n=1536)
    sol = solve(inst.problem, inst.constraints, solver="active_set")
    assert sol.info["low_rank"]["sigma"] == 0.0
    assert sol.info["low_rank"]["weak_ridge"]["used"]
    # certified at the default 1e-6 and at the gap's rounding floor (J* ~ 5e-10 against terms of ~100:
    # 1e-8 of the certificate's scale lies below the float64 rounding of the gap)
    assert sol.certificate.certified() and sol.certificate.at_rounding_floor
    # the same solve without the retry (the behaviour before stop 68) does not certify it
    monkeypatch.setattr(A, "weak_ridge_decides", lambda lr, st, g, x: False)
    again = draw("box_free:set_type=box:K=4:c=2:N=50:cond=1e12:at_bounds=0.5:planted=false", seed=3002, n=1536)
    old = solve(again.problem, again.constraints, solver="active_set")
    assert "weak_ridge" not in old.info["low_rank"]
    assert not old.certificate.certified() and not old.certificate.at_rounding_floor
    # (since stop 75 the engine that failed from the path's point runs again from its own start, which
    # here ends within J's rounding of the certified point, ~1e-14 against terms of ~100, still uncertified)
    assert "from_own_start" in old.info and sol.objective <= old.objective + 1e-13


def test_a_point_at_the_floor_alone_is_retried_with_the_weak_ridge(monkeypatch: pytest.MonkeyPatch) -> None:
    """At cond 3e12 (n = 1800) the path without the ridge meets the engine's test only at the
    gap's rounding floor, with J = 8.7e-11 where ``dense_ipm`` certifies 6.7e-11 (a QA review, stop
    68): the rounding estimate is loose there, and the ridge still decides 30% of J. The retry runs
    unless the gap is within ``tol``, and its point is kept where its gap is or its J is lower:
    certified, at the lower J."""
    spec = "box_free:set_type=box:K=6:c=10:N=12:cond=3e12:at_bounds=0.7:planted=false"
    inst = draw(spec, seed=511, n=1800)
    sol = solve(inst.problem, inst.constraints, solver="active_set")
    assert sol.info["low_rank"]["weak_ridge"]["used"]
    assert sol.certificate.certified()
    monkeypatch.setattr(A, "weak_ridge_decides", lambda lr, st, g, x: False)
    again = draw(spec, seed=511, n=1800)
    old = solve(again.problem, again.constraints, solver="active_set")
    assert old.certificate.at_rounding_floor and not old.certificate.certified()
    assert sol.objective < 0.9 * old.objective
    # the certified gap bounds how far the new point can be from J*: the old one lies beyond it
    assert old.objective - sol.objective > sol.certificate.fw_gap


def test_the_retry_waits_for_an_interpolating_point() -> None:
    """The retry runs only on bounds, where the gradient of ``U U'`` vanishes at the path's point (or
    the path reached none): on a planted box (multipliers at its bounds, ``J*`` far from 0) the weak ridge
    moves J by far less than the tolerance, and the engine finishes from the path's point."""
    rng = np.random.default_rng(74)
    H = flat_low_rank(rng, 1200, 100, 1e12)
    lr = LR.ridge_low_rank(H)
    assert lr is not None and lr.weak > 0
    problem = planted_box(rng, H, 4)
    box = A.set_structure(Box(0.0, 1.0), problem.shape)
    x = np.clip(rng.uniform(-0.2, 1.2, 1200), 0.0, 1.0)
    assert not LR.weak_ridge_decides(lr, box, problem.g, x)
    assert LR.weak_ridge_decides(lr, box, problem.g, None)
    interpolating = -(lr.U @ (lr.U.T @ x))  # g = -U U' x: the gradient of U U' vanishes at x
    assert LR.weak_ridge_decides(lr, box, interpolating, x)
    # bounds alone: not on sums or an L1 ball (measured not to help there)
    for cset in (Simplex(), L1Ball(1.0)):
        assert not LR.weak_ridge_decides(lr, A.set_structure(cset, problem.shape), interpolating, x)
    sol = solve(problem, Box(0.0, 1.0), solver="active_set")
    assert "weak_ridge" not in sol.info["low_rank"] and sol.certificate.certified(1e-8)


def test_a_warm_start_at_a_better_point_than_the_paths_is_kept() -> None:
    """A QA review (stop 68): on a low-rank box with a weak ridge below the kept level and dead rows,
    the path from ``1/K`` ends at the rounding floor on a flat set of optima with J 300x above the
    optimum that ``dense_ipm`` certifies, and a warm start at that certified point came back as the
    cold answer (the path ignores ``x0``). A warm start that meets the stopping test at a lower J
    than the path's point is now kept: the engine returns it at once."""
    rng = np.random.default_rng(3)
    n, r = 852, 90
    U = rng.standard_normal((n, r)) * np.logspace(0, -rng.uniform(0, 3), r)
    H = U @ U.T
    H[np.diag_indices(n)] += 1e-13 * np.linalg.norm(U, 2) ** 2
    dead = rng.choice(n, n // 10, replace=False)
    H[dead] = 0.0
    H[:, dead] = 0.0
    H.flags.writeable = False
    lo = rng.uniform(-1.0, 0.5, n)
    hi = lo + rng.uniform(0.01, 2.0, n)
    inside = rng.uniform(lo, hi) + 0.05 * rng.standard_normal(n)
    problem = MergeQP(H, -H @ inside, 0.5 * inside @ H @ inside, shape=(1, n))
    box = Box(lo[None], hi[None])
    cold = solve(problem, box, solver="active_set")
    ref = solve(problem, box, solver="dense_ipm")
    assert ref.certificate.certified() and ref.objective < 0.1 * cold.objective
    warm = solve(problem, box, solver="active_set", x0=ref.d)
    assert warm.info["low_rank"]["warm_start_kept"]
    assert warm.certificate.certified() and warm.objective <= ref.objective + ref.certificate.fw_gap
    assert warm.info["face_iterations"] == 0
    # a warm start worse than the path's point is not kept: the cold answer
    worse = solve(problem, box, solver="active_set", x0=np.clip(ref.d + 0.3, lo[None], hi[None]))
    assert "warm_start_kept" not in worse.info["low_rank"]
    assert worse.objective == pytest.approx(cold.objective, rel=1e-12)


def test_the_polishs_triangular_and_cholesky_solves_decline_near_singular_matrices() -> None:
    """(stop 75) The no-ridge polish's triangular solve and Cholesky, which replace its SVD and
    eigendecomposition where the matrices are well conditioned: the same answers there, ``None`` (the
    truncated decompositions then) where a singular value falls below the truncation."""
    rng = np.random.default_rng(75)
    Q, R = np.linalg.qr(rng.standard_normal((80, 40)))  # (tall, as the polish's V: well conditioned)
    b = rng.standard_normal(40)
    np.testing.assert_allclose(LR._triangular_if_definite(R, b), np.linalg.solve(R, b), rtol=1e-10, atol=1e-12)
    near = R.copy()
    near[-1, -1] = 1e-12 * abs(R[0, 0])
    assert LR._triangular_if_definite(near, b) is None
    M = R.T @ R
    np.testing.assert_allclose(LR._cholesky_if_definite(M, b), np.linalg.solve(M, b), rtol=1e-9, atol=1e-12)
    V = rng.standard_normal((40, 40))
    graded = (V * np.logspace(0, -12, 40)) @ V.T  # eigenvalues down to ~1e-12 of the largest
    assert LR._cholesky_if_definite(graded, b) is None
    assert LR._cholesky_if_definite(-M, b) is None  # (not definite: Cholesky fails)


def test_where_the_engine_fails_from_the_paths_point_it_runs_from_its_own_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """(a review of stop 75) On L1 balls with a ridge of 1e-11 of the top (taken as none) and J* near 0 the
    engine, started at the path's point, stopped uncertified at twice the optimum where from its own
    start it certified: where the run from the path's point ends short of the engine's test, the engine
    runs again from its own start and the better point is kept. Here the first run is made to fail."""
    rng = np.random.default_rng(67)
    H = flat_low_rank(rng, 1200, 240, 1e9)
    problem, ball = planted_ball(rng, H, 4)
    real_run = A._Engine.run
    calls = []

    def run(self, x0):
        calls.append(self.opts["start_face"])
        x, status, it, info = real_run(self, x0)
        if len(calls) == 1:  # the run from the path's point: cut short, as on the review's balls
            return x, A.SolveStatus.INACCURATE, it, info
        return x, status, it, info

    monkeypatch.setattr(A._Engine, "run", run)
    sol = solve(problem, ball, solver="active_set")
    assert calls == ["point", "gradient"]  # the path's face, then the engine's own first face
    runs = sol.info["from_own_start"]
    assert runs["after_path_start"]["status"] == "inaccurate" and runs["kept"] == "own_start"
    assert runs["own_start"]["status"] == "optimal"
    assert sol.info["low_rank"]["rank"] == 240 and sol.certificate.certified(1e-8)
