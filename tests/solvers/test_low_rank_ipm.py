"""The interior point on ``sigma I + U U'`` (solvers/low_rank_ipm.py) that starts ``active_set`` where H is a
weak ridge plus a low-rank matrix of medium rank: when it is taken and when not, its point against
``dense_ipm`` and Clarabel on boxes (two-sided and one-sided) and per-atom simplices, the engine returning
it at once, and a hypothesis property against the engine alone."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mergeqp.constraints import Box, L1Ball, Simplex
from mergeqp.constraints.kernels import SetStructure
from mergeqp.matrix_cache import forget_matrix
from mergeqp.problem import MergeQP
from mergeqp.solvers import active_set as A
from mergeqp.solvers import low_rank_ipm as M
from mergeqp.solvers.registry import solve


def weak_ridge_matrix(rng: np.random.Generator, n: int, r: int, cond: float) -> tuple[np.ndarray, float]:
    """``sigma I + B B'`` with ``B`` ``(n, r)`` of decaying singular values and ``sigma = lambda_max / cond``,
    read-only (as a problem keeps it)."""
    B = rng.standard_normal((n, r)) * (1.0 / (1.0 + np.arange(r)))[None, :] / np.sqrt(r)
    sigma = float(np.linalg.norm(B, 2)) ** 2 / cond
    H = B @ B.T
    H[np.diag_indices(n)] += sigma
    H.flags.writeable = False
    return H, sigma


def planted(rng: np.random.Generator, H: np.ndarray, K: int, kind: str) -> tuple[MergeQP, object]:
    """A QP whose optimum has about half its coordinates at a bound, on ``[0, 1]`` (``box``), ``x >= 0``
    (``nonneg``) or the per-atom simplex (``simplex``), with multipliers over four decades."""
    n = H.shape[0]
    scale = float(np.mean(np.diag(H)))
    if kind == "simplex":
        m = n // K
        d = rng.dirichlet(np.ones(K), size=m).T  # (K, m)
        zero = rng.random((K, m)) < 0.5
        zero[0] = False  # at least one positive per atom
        d = np.where(zero, 0.0, d)
        d /= d.sum(axis=0, keepdims=True)
        x = d.ravel()
        lam = np.where(zero.ravel(), 10.0 ** rng.uniform(-4, 0, n), 0.0) * scale
        nu = rng.standard_normal(m) * scale
        g = lam - H @ x - np.tile(nu, K)
        return MergeQP(H, g, 1.0, shape=(K, m)), Simplex(1.0)
    x = rng.uniform(0.05, 0.95, n)
    at = rng.random(n) < 0.5
    upper = (rng.random(n) < 0.5) & (kind == "box")
    x[at] = np.where(upper[at], 1.0, 0.0)
    lam = np.where(at, np.where(upper, -1.0, 1.0) * 10.0 ** rng.uniform(-4, 0, n), 0.0) * scale
    cset = Box(0.0, 1.0) if kind == "box" else Box(0.0, np.inf)
    return MergeQP(H, lam - H @ x, 1.0, shape=(K, n // K)), cset


def took(sol) -> bool:
    """Whether the interior point's point was what the engine went on from."""
    return sol.info.get("low_rank", {}).get("taken") is True


def no_face_after(sol) -> bool:
    """The engine needed no face after the interior point (its faces were all in its head start)."""
    return sol.info["face_iterations"] == sol.info["low_rank"]["head_start_faces"]


@pytest.mark.parametrize("kind", ["box", "simplex"])
def test_a_weak_ridge_at_medium_rank_takes_the_interior_point_and_certifies(kind: str) -> None:
    """Rank 200 at n = 1200 (above the path's n / 8 = 150, within n / 4), cond 1e9, half the optimum's
    coordinates free: the engine's head start is spent, and it goes on from the interior point, whose
    point meets its test (no face solve after it), with the optimum of ``dense_ipm`` and of the engine
    alone (``low_rank: off``)."""
    rng = np.random.default_rng(3)
    H, _ = weak_ridge_matrix(rng, 1200, 200, 1e9)
    problem, cset = planted(rng, H, 4, kind)
    sol = solve(problem, cset, solver="active_set")
    info = sol.info["low_rank"]
    assert info["method"] == "interior point" and info["rank"] == 200 and took(sol) and no_face_after(sol)
    assert sol.certificate.certified(1e-8)
    ref = solve(problem, cset, solver="dense_ipm")
    assert sol.objective == pytest.approx(ref.objective, rel=1e-9, abs=1e-10)
    plain = solve(problem, cset, solver="active_set", low_rank="off")
    assert plain.objective == pytest.approx(sol.objective, rel=1e-9, abs=1e-10)


def test_the_iteration_alone_reaches_the_reference_on_a_small_problem() -> None:
    """:func:`solve_low_rank_ipm` on its own (n = 300, rank 60, per-atom simplex and box): feasible to
    rounding, J within 1e-9 of Clarabel's, complementarity and residuals below its tolerance."""
    rng = np.random.default_rng(5)
    H, sigma = weak_ridge_matrix(rng, 300, 60, 1e8)
    for kind in ("box", "simplex"):
        problem, cset = planted(rng, H, 3, kind)
        structure = A.set_structure(cset, problem.shape)
        from mergeqp.solvers.active_set_low_rank import ridge_low_rank

        lr = ridge_low_rank(H, max_rank=75)
        assert lr is not None and lr.sigma == pytest.approx(sigma, rel=1e-6)
        x, info = M.solve_low_rank_ipm(H, problem.g, structure, lr, c=problem.c)
        assert x is not None and info["merit"] <= 1e-10
        assert cset.violation(x.reshape(problem.shape)) <= 1e-9
        J = float(0.5 * x @ H @ x + problem.g @ x + problem.c)
        ref = solve(problem, cset, solver="clarabel")
        assert J == pytest.approx(ref.objective, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("case", ["path_rank", "rank_too_high", "strong_ridge", "l1_ball", "small", "unbounded"])
def test_the_interior_point_is_taken_only_for_a_weak_ridge_at_medium_rank(case: str) -> None:
    """Declined where the path takes the rank (<= n / 8), above n / 4, with a ridge above 1e-7 of the top
    eigenvalue (cond 1e5: the engine's faces are well enough conditioned), on an L1 ball, below n = 256;
    on a set that is not bounded (``x >= 0``) not an early candidate (since stop 72 a late one: the engine
    of this planted QP finishes within its late head start); the answer is certified either way. (Without a
    ridge it is taken since stop 70: the test below.)"""
    rng = np.random.default_rng(7)
    n, r, cond, K = 1200, 200, 1e9, 4
    if case == "path_rank":
        r = 120
    elif case == "rank_too_high":
        r = 400
    elif case == "strong_ridge":
        cond = 1e5
    elif case == "small":
        n, r = 240, 40
    H, _ = weak_ridge_matrix(rng, n, r, cond)
    problem, cset = planted(rng, H, K, "nonneg" if case == "unbounded" else "box")
    if case == "l1_ball":
        cset = L1Ball(float(n) / 8)
    notes: dict = {}
    A.ridge_low_rank(H, max_rank=A.rank_limit(n, A.set_structure(cset, problem.shape)), notes=notes)
    if case == "unbounded":
        assert M.ipm_gate(H, A.set_structure(cset, problem.shape), notes) == "late"
    else:
        assert M.ipm_low_rank(H, A.set_structure(cset, problem.shape), notes) is None
    sol = solve(problem, cset, solver="active_set")
    assert not took(sol)
    assert sol.certificate.certified(1e-8) or sol.certificate.at_rounding_floor


def test_a_well_conditioned_sample_costs_no_pre_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the block the path's detection sampled is well conditioned (smallest over largest eigenvalue
    above 1e-5), the pre-test's pivoted Cholesky is not run while the engine's work is below one Cholesky
    of H (the late gate, stop 71): full-rank H, the usual case, pays nothing for the interior point, and
    nothing is recorded of it."""
    rng = np.random.default_rng(9)
    B = rng.standard_normal((800, 800)) / np.sqrt(800)
    H = B @ B.T + 0.1 * np.eye(800)
    H.flags.writeable = False
    problem = MergeQP(H, rng.standard_normal(800), 0.0, shape=(4, 200))
    called = []
    real = M.sla.lapack.dpstrf
    monkeypatch.setattr(M.sla.lapack, "dpstrf", lambda *a, **k: called.append(1) or real(*a, **k))
    sol = solve(problem, Box(0.0, 1.0), solver="active_set")
    assert called == [] and "low_rank" not in sol.info
    assert sol.certificate.certified(1e-8)


def test_a_warm_start_that_meets_the_test_is_returned_before_any_face() -> None:
    """The engine tests a warm start before its CG faces, which a point strictly inside the bounds (an
    interior point's) starts since its face is all free: a point that meets the test comes back as it
    is, with no face solve and no CG face (before stop 69 the CG face ran and its work was discarded)."""
    rng = np.random.default_rng(11)
    H, _ = weak_ridge_matrix(rng, 600, 40, 1e4)
    problem, cset = planted(rng, H, 3, "box")
    first = solve(problem, cset, solver="active_set", low_rank="off")
    inside = np.clip(first.d, 1e-13, 1.0 - 1e-13)
    again = solve(problem, cset, solver="active_set", low_rank="off", x0=inside, start_face="point")
    assert again.info["face_iterations"] == 0 and again.info["cg_faces"] == 0
    assert np.array_equal(again.d, inside) and again.certificate.certified(1e-8)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), K=st.sampled_from([2, 3, 4]), share=st.floats(0.13, 0.25),
       log_cond=st.floats(7.5, 10.0), kind=st.sampled_from(["box", "nonneg", "simplex"]))
def test_the_interior_point_start_matches_the_engine_alone(seed: int, K: int, share: float, log_cond: float,
                                                           kind: str) -> None:
    """Random weak-ridge, medium-rank QPs at n = 288-384: whichever start ``active_set`` takes, its answer
    is certified and equals the engine's alone (``low_rank: off``) to the certificate's tolerance."""
    rng = np.random.default_rng(seed)
    m = int(rng.integers(72, 97))
    n = K * m
    H, _ = weak_ridge_matrix(rng, n, max(2, int(share * n)), 10.0 ** log_cond)
    problem, cset = planted(rng, H, K, kind)
    sol = solve(problem, cset, solver="active_set")
    plain = solve(problem, cset, solver="active_set", low_rank="off")
    for s in (sol, plain):
        assert s.certificate.certified(1e-8) or s.certificate.at_rounding_floor
    slack = sol.certificate.fw_gap + plain.certificate.fw_gap + 1e-10 * max(1.0, abs(plain.objective))
    assert abs(sol.objective - plain.objective) <= slack


@pytest.mark.parametrize("kind", ["box", "simplex"])
def test_the_iteration_does_not_depend_on_the_problems_scale(kind: str) -> None:
    """The interior point runs on ``J / scale``: the same QP times 1e-8, 1 and 1e8 takes the same
    iterations and is certified without a face solve (unscaled, times 1e8 it took twice the iterations on
    a box and stalled on a simplex, whose engine then took 44 faces)."""
    rng = np.random.default_rng(13)
    H, _ = weak_ridge_matrix(rng, 800, 140, 1e9)
    problem, cset = planted(rng, H, 4, kind)
    runs = []
    for factor in (1e-8, 1.0, 1e8):
        Hs = np.array(H) * factor
        Hs.flags.writeable = False
        sol = solve(MergeQP(Hs, problem.g * factor, problem.c * factor, shape=problem.shape), cset, solver="active_set")
        assert took(sol) and no_face_after(sol)
        assert sol.certificate.certified(1e-8)
        runs.append((sol.info["low_rank"]["iterations"], sol.objective / factor))
    assert len({it for it, _ in runs}) == 1
    assert runs[0][1] == pytest.approx(runs[1][1], rel=1e-9) and runs[2][1] == pytest.approx(runs[1][1], rel=1e-9)


@pytest.mark.parametrize("kind", ["capped", "global"])
def test_sum_groups_without_the_column_layout_agree_with_dense_ipm(kind: str) -> None:
    """A capped per-atom simplex (``[0, 0.6]`` and sums of 1: the groups' general path, not the columns'
    reshape) and a global simplex (one group of every coordinate): the interior point's point has
    ``dense_ipm``'s J, and ``active_set`` (which takes it on the capped simplex; on the global one, whose
    optimum has few free coordinates, it may finish within its head start) is certified there."""
    from mergeqp.constraints import GlobalSimplex, intersect
    from mergeqp.solvers.active_set_low_rank import ridge_low_rank

    rng = np.random.default_rng(17)
    H, _ = weak_ridge_matrix(rng, 900, 160, 1e9)
    K = 3
    cset = intersect([Box(0.0, 0.6), Simplex(1.0)]) if kind == "capped" else GlobalSimplex(40.0)
    problem = MergeQP(H, rng.standard_normal(900) * float(np.mean(np.diag(H))), 0.0, shape=(K, 300))
    ref = solve(problem, cset, solver="dense_ipm")
    lr = ridge_low_rank(H, max_rank=225)
    x, _ = M.solve_low_rank_ipm(H, problem.g, A.set_structure(cset, problem.shape), lr, c=problem.c)
    assert x is not None and cset.violation(x.reshape(problem.shape)) <= 1e-9
    assert float(0.5 * x @ H @ x + problem.g @ x) == pytest.approx(ref.objective, rel=1e-8, abs=1e-9)
    sol = solve(problem, cset, solver="active_set")
    assert took(sol) or kind == "global"
    assert sol.certificate.certified(1e-8)
    assert sol.objective == pytest.approx(ref.objective, rel=1e-9, abs=1e-10)


def test_the_decision_kept_with_h_is_per_set() -> None:
    """The decision kept with a read-only H depends on the set's rank limit: rank 130 of n = 1200 is the
    path's on a box (limit 150) and the interior point's on a per-atom simplex of 2 (limit 100), in either
    order of the two solves on the same H."""
    rng = np.random.default_rng(19)
    H, _ = weak_ridge_matrix(rng, 1200, 130, 1e9)
    box, box_set = planted(rng, H, 2, "box")
    simplex, simplex_set = planted(rng, H, 2, "simplex")
    for order in ((box, box_set), (simplex, simplex_set)), ((simplex, simplex_set), (box, box_set)):
        forget_matrix(H)
        methods = {}
        for problem, cset in order:
            sol = solve(problem, cset, solver="active_set", pairs="off")
            assert sol.certificate.certified(1e-8)
            methods[cset.spec] = sol.info["low_rank"].get("method")
        assert methods[simplex_set.spec] == "interior point" and methods[box_set.spec] != "interior point"


def test_the_engine_finishes_within_its_head_start_where_few_coordinates_are_free(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A weak-ridge, medium-rank QP whose optimum has few free coordinates (a global simplex of total 1
    over 800 coordinates, random g): the engine, run first, finishes within its head start, and the
    interior point is never run (a QA review, stop 69: run first, it cost 7-13x the engine alone)."""
    from mergeqp.constraints import GlobalSimplex

    rng = np.random.default_rng(23)
    H, _ = weak_ridge_matrix(rng, 800, 140, 1e9)
    problem = MergeQP(H, rng.standard_normal(800) * 0.01, 0.0, shape=(4, 200))

    def never(*args, **kwargs):
        raise AssertionError("the interior point or its pre-test ran")

    # (the pre-test, a pivoted Cholesky of n / 3 sampled rows, runs only once the first head start is spent)
    monkeypatch.setattr(A, "solve_low_rank_ipm", never)
    monkeypatch.setattr(A, "ipm_candidate", never)
    sol = solve(problem, GlobalSimplex(1.0), solver="active_set")
    info = sol.info["low_rank"]
    assert info["method"] == "interior point" and info["taken"] is False and "rank_counted" not in info
    assert info["note"] == "the engine finished within its head start"
    assert sol.certificate.certified(1e-8)


@pytest.mark.parametrize("declines", ["pre-test", "detection"])
def test_a_declined_test_lets_the_engine_go_on_as_if_it_had_no_budget(declines: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the pre-test or the detection declines once the head start is spent, the engine goes on from
    where it is, without a restart: the same faces and point as the engine alone (``low_rank: off``);
    ``head_start_faces`` counts the faces before the test (since stop 71; the whole solve's before)."""
    rng = np.random.default_rng(3)
    H, _ = weak_ridge_matrix(rng, 1200, 200, 1e9)
    problem, cset = planted(rng, H, 4, "box")
    alone = solve(problem, cset, solver="active_set", low_rank="off")
    if declines == "pre-test":
        monkeypatch.setattr(A, "ipm_candidate", lambda *args, **kwargs: None)
    else:
        monkeypatch.setattr(A, "ipm_low_rank", lambda *args, **kwargs: None)
    monkeypatch.setattr(A, "solve_low_rank_ipm", lambda *args, **kwargs: pytest.fail("the interior point ran"))
    forget_matrix(H)
    sol = solve(problem, cset, solver="active_set")
    info = sol.info["low_rank"]
    assert info["taken"] is False and info["note"].endswith("the engine goes on")
    assert ("rank_counted" in info) == (declines == "detection")
    assert sol.info["face_iterations"] == alone.info["face_iterations"]
    assert 0 <= info["head_start_faces"] < sol.info["face_iterations"]
    assert np.array_equal(sol.d, alone.d) and sol.certificate.certified(1e-8)


def test_a_warm_start_at_the_optimum_skips_the_detections(monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm start that meets the stopping test is returned before the low-rank detections run (a QA
    review, stop 69: 16 ms where the engine's test takes 1 ms)."""
    rng = np.random.default_rng(29)
    H, _ = weak_ridge_matrix(rng, 640, 120, 1e8)
    problem, cset = planted(rng, H, 4, "box")
    first = solve(problem, cset, solver="active_set")
    assert first.certificate.certified(1e-8)

    def never(*args, **kwargs):
        raise AssertionError("a detection ran")

    monkeypatch.setattr(A, "ridge_low_rank", never)
    again = solve(problem, cset, solver="active_set", x0=first.d)
    assert again.info["low_rank"] == {"warm_start_kept": True} and again.info["face_iterations"] == 0
    assert np.array_equal(again.d, first.d)


def test_a_warm_started_solve_leaves_the_interior_point_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm start that does not meet the test (the last QP's optimum, g moved by 1%) goes to the engine
    from that start: the interior point cannot use it, and in such sequences it ran at every step, 1.2-1.4x
    the engine (a QA review, stop 69). Cold, the same QP takes the interior point's branch."""
    rng = np.random.default_rng(31)
    H, _ = weak_ridge_matrix(rng, 900, 160, 1e9)
    problem, cset = planted(rng, H, 3, "box")
    first = solve(problem, cset, solver="active_set")
    assert first.info["low_rank"]["method"] == "interior point"
    moved = problem.with_linear_term(problem.g + 0.01 * float(np.std(problem.g)) * rng.standard_normal(900))
    again = solve(moved, cset, solver="active_set", x0=first.d)
    assert "low_rank" not in again.info and again.certificate.certified(1e-8)
    cold = solve(moved, cset, solver="active_set", low_rank="off")
    assert again.objective == pytest.approx(cold.objective, rel=1e-9, abs=1e-10)


@pytest.mark.parametrize("ridge", ["none", "too weak for the path"])
@pytest.mark.parametrize("kind", ["box", "simplex"])
def test_without_a_usable_ridge_the_interior_point_is_taken_and_certifies(kind: str, ridge: str) -> None:
    """H = B B' of rank 200 (box; 140 on the per-atom simplex, whose path limit is 112) at n = 1200 with no
    ridge, or with one at 1e-13 of the top (below ``SIGMA_MIN``: the detection takes it as none, and the
    interior point keeps it in its model): candidates since stop 70 (before, the engine alone wandered
    through 29-77 faces on such planted QPs, some ending uncertified); the engine goes on from the
    interior point's point and certifies at ``dense_ipm``'s J."""
    rng = np.random.default_rng(41)
    n, r = 1200, (200 if kind == "box" else 140)
    if ridge == "none":
        B = rng.standard_normal((n, r)) * np.exp(-np.linspace(0.0, 4.0, r))
        H = B @ B.T
        H.flags.writeable = False
    else:
        H, _ = weak_ridge_matrix(rng, n, r, 1e13)
    problem, cset = planted(rng, H, 4, kind)
    structure = A.set_structure(cset, problem.shape)
    notes: dict = {}
    A.ridge_low_rank(H, max_rank=A.rank_limit(n, structure), notes=notes)
    lr = M.ipm_low_rank(H, structure, notes)
    assert lr is not None and lr.rank == r
    assert (lr.sigma == 0) if ridge == "none" else (0 < lr.sigma <= 1e-12 * float(notes["sample_top"]))
    forget_matrix(H)
    sol = solve(problem, cset, solver="active_set")
    assert took(sol) and sol.certificate.certified(1e-8)
    ref = solve(problem, cset, solver="dense_ipm")
    assert sol.objective == pytest.approx(ref.objective, rel=1e-8, abs=1e-9)


def test_without_a_ridge_a_coordinate_without_a_finite_bound_declines_the_iteration() -> None:
    """With ``sigma = 0`` the Newton systems' ``D`` is the bounds' weights alone: a coordinate with neither
    bound finite would make it 0, so the iteration returns no point (the engine then goes on)."""
    rng = np.random.default_rng(43)
    n, r = 400, 70
    B = rng.standard_normal((n, r))
    lr = A.RidgeLowRank(np.asfortranarray(B), 0.0, 0.0)
    lo = np.zeros(n)
    lo[5] = -np.inf
    hi = np.ones(n)
    hi[5] = np.inf
    x, _ = M.solve_low_rank_ipm(B @ B.T, rng.standard_normal(n), SetStructure(lo=lo, hi=hi), lr)
    assert x is None
    hi[5] = 1.0  # (one finite bound is enough)
    x, _ = M.solve_low_rank_ipm(B @ B.T, rng.standard_normal(n), SetStructure(lo=lo, hi=hi), lr)
    assert x is not None


@pytest.mark.parametrize("declines", [False, True])
def test_no_engine_outlives_its_solve(declines: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The head start's callback holds no reference to the engine: a cycle through it kept every engine
    of the branch, with its H and factors, alive until the garbage collector's next cycle (found by the
    matrix cache's own test, whose entries then went with the collector instead of with their array)."""
    import gc

    rng = np.random.default_rng(3)
    H, _ = weak_ridge_matrix(rng, 1200, 200, 1e9)
    problem, cset = planted(rng, H, 4, "box")
    if declines:
        monkeypatch.setattr(A, "ipm_candidate", lambda *args, **kwargs: None)
    gc.collect()
    gc.disable()
    try:
        sol = solve(problem, cset, solver="active_set")
        assert sol.info["low_rank"]["method"] == "interior point"
        assert not [o for o in gc.get_objects() if isinstance(o, A._Engine)]
    finally:
        gc.enable()


def flat_interpolating_box(n: int, r: int, seed: int) -> MergeQP:
    """``H = U U'`` without a ridge, ``U`` Gaussian with column scales falling by ``e^-3`` over the rank
    ``r`` (a spectrum too flat for the path's block of ``n / 6`` rows to see the rank, where ``r > n / 6``),
    and ``g = -H t`` for a target ``t`` partly outside ``[0, 1]``: an interpolating box (J* ~ 0 on a flat
    set of optima), the class where the engine alone wandered through ~35 faces of most coordinates free."""
    rng = np.random.default_rng(seed)
    U = rng.standard_normal((n, r)) * np.exp(-3.0 * np.arange(r) / r)
    H = U @ U.T
    H.flags.writeable = False
    t = rng.uniform(-0.3, 1.3, n)
    return MergeQP(H, -(H @ t), float(0.5 * t @ H @ t), shape=(4, n // 4))


def test_the_gate_is_early_late_or_none() -> None:
    """:func:`ipm_gate`: ``early`` where the path's sampled block is ill-conditioned (a weak ridge), ``late``
    where it is well conditioned (a rank above the block's n / 6 rows) on a set of bounds or, since stop 72,
    on a per-atom simplex (whose engine then counts the order of what its faces factorise), ``None`` on an
    L1 ball."""
    rng = np.random.default_rng(13)
    weak, _ = weak_ridge_matrix(rng, 1200, 200, 1e9)
    flat = flat_interpolating_box(1200, 240, 0).H
    shape = (4, 300)
    for H, cset, expected in [(weak, Box(0.0, 1.0), "early"), (flat, Box(0.0, 1.0), "late"),
                              (flat, Simplex(1.0), "late"), (flat, L1Ball(10.0), None)]:
        structure = A.set_structure(cset, shape)
        notes: dict = {}
        A.ridge_low_rank(H, max_rank=A.rank_limit(1200, structure), notes=notes)
        assert M.ipm_gate(H, structure, notes) == expected, (cset, notes)
        assert M.ipm_may_apply(H, structure, notes) == (expected is not None)


@pytest.mark.parametrize(("n", "r", "seed"), [(768, 154, 0), (768, 192, 2), (768, 256, 3)])
def test_a_late_candidate_takes_the_interior_point_after_one_cholesky_of_work(
        n: int, r: int, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """On an interpolating box whose rank (n / 5, n / 4, n / 3) the path's sample cannot see, the engine's work
    passes one Cholesky of H, the pre-test counts the rank, the interior point is taken, and the engine
    (head start and after) needs 5-15 faces where alone it took about 35 (both end at the certificate's rounding
    floor: J* ~ 0, so a gap relative to J is out of reach); the J reached is no higher than the engine
    alone's, beyond rounding. Without the late gate (``LATE_WORK`` infinite) the old behaviour: no test."""
    problem = flat_interpolating_box(n, r, seed)
    cset = Box(0.0, 1.0)
    sol = solve(problem, cset, solver="active_set")
    info = sol.info["low_rank"]
    assert info["late"] and took(sol) and info["rank"] == r
    assert sol.certificate.certified(1e-8) or sol.certificate.at_rounding_floor
    monkeypatch.setattr(A, "LATE_WORK", float("inf"))
    forget_matrix(problem.H)
    alone = solve(problem, cset, solver="active_set")
    assert "low_rank" not in alone.info
    assert sol.info["face_iterations"] * 2 < alone.info["face_iterations"]
    size = float(abs(problem.c)) + 1.0
    assert sol.objective <= alone.objective + 1e-12 * size


def test_a_late_candidate_near_its_own_test_does_not_run_the_interior_point(monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted box (half the optimum's coordinates at a bound, J* far from 0) whose flat rank n / 4 the
    path's sample cannot see: the engine passes the late head start while a few faces from its end (the
    relative gap of its last face ~1e-8, within ``LATE_NEAR``), so the interior point is not run (it would
    cost its whole work for no face saved: 1.5-1.75x in a QA review), and the solve is the engine alone's,
    face for face. With ``LATE_NEAR`` 0 the interior point runs, at the same certified J."""
    rng = np.random.default_rng(701)
    n, r = 1536, 384
    U = rng.standard_normal((n, r)) * np.exp(-np.arange(r) / r) / np.sqrt(n)
    top = float(np.linalg.norm(U, 2)) ** 2
    H = U @ U.T + 1e-9 * top * np.eye(n)
    H = 0.5 * (H + H.T)
    H.flags.writeable = False
    x = rng.uniform(0.0, 1.0, n)
    at, upper = rng.random(n) < 0.5, rng.random(n) < 0.5
    x[at & upper], x[at & ~upper] = 1.0, 0.0
    weight = np.maximum(np.diag(H), 1e-3 * top / n)
    lam = np.where(at, np.where(upper, -1.0, 1.0) * rng.uniform(0.1, 1.0, n) * weight, 0.0)
    problem, cset = MergeQP(H, lam - H @ x, 0.0, shape=(8, n // 8)), Box(0.0, 1.0)
    monkeypatch.setattr(A, "solve_low_rank_ipm", lambda *args, **kwargs: pytest.fail("the interior point ran"))
    sol = solve(problem, cset, solver="active_set")
    info = sol.info["low_rank"]
    assert info["late"] and not info["taken"] and f"within {A.LATE_NEAR:g}" in info["note"]
    alone = solve(problem, cset, solver="active_set", low_rank="off")
    assert sol.info["face_iterations"] == alone.info["face_iterations"] and np.array_equal(sol.d, alone.d)
    assert sol.certificate.certified(1e-8)
    monkeypatch.undo()
    monkeypatch.setattr(A, "LATE_NEAR", 0.0)
    forget_matrix(H)
    ran = solve(problem, cset, solver="active_set")
    assert took(ran) and ran.certificate.certified(1e-8)
    assert ran.objective == pytest.approx(sol.objective, rel=1e-9, abs=1e-10)


def decaying_box(n: int, r: int, seed: int, interpolating: bool) -> MergeQP:
    """``H = U U'`` with singular values falling by ``e^-10`` over the rank ``r``: the path's sample of
    n / 6 rows is ill-conditioned (an early candidate) and the pre-test counts about 0.2 n of a rank of
    0.3 n, where the detection at n / 4 finds no factor. Interpolating (``g = -H t``, no ridge) or planted
    (half the optimum at a bound, a ridge of 1e-9 of the top)."""
    rng = np.random.default_rng(seed)
    U = rng.standard_normal((n, r)) * np.exp(-10.0 * np.arange(r) / r) / np.sqrt(n)
    top = float(np.linalg.norm(U, 2)) ** 2
    H = U @ U.T + (0.0 if interpolating else 1e-9 * top) * np.eye(n)
    H.flags.writeable = False
    if interpolating:
        t = rng.uniform(-0.3, 1.3, n)
        return MergeQP(H, -(H @ t), float(0.5 * t @ H @ t), shape=(4, n // 4))
    x = rng.uniform(0.0, 1.0, n)
    at, upper = rng.random(n) < 0.5, rng.random(n) < 0.5
    x[at & upper], x[at & ~upper] = 1.0, 0.0
    weight = np.maximum(np.diag(H), 1e-3 * top / n)
    lam = np.where(at, np.where(upper, -1.0, 1.0) * rng.uniform(0.1, 1.0, n) * weight, 0.0)
    return MergeQP(H, lam - H @ x, 0.0, shape=(4, n // 4))


@pytest.mark.parametrize("interpolating", [True, False])
def test_an_early_candidate_declined_at_n_over_4_is_tried_again_late_where_interpolating(
        interpolating: bool) -> None:
    """An early candidate on a box whose detection declines at n / 4 (a decaying spectrum of rank 0.3 n)
    is tried again on the late schedule, up to n / 3 (a QA review, stop 71: such interpolating boxes took
    2.5-2.8x ``dense_ipm``, neither gate taking them). Interpolating: the interior point at rank 0.3 n is
    taken, in under a third of the engine alone's faces, at a J no higher (beyond rounding) and certified or
    at the floor. Planted (J far from 0 at the late head start): declined with a note, and the solve is
    the engine alone's, face for face."""
    problem = decaying_box(1024, 307, 12, interpolating)
    cset = Box(0.0, 1.0)
    sol = solve(problem, cset, solver="active_set")
    info = sol.info["low_rank"]
    assert info["late"] and info["converted"]
    alone = solve(problem, cset, solver="active_set", low_rank="off")
    if interpolating:
        assert took(sol) and info["rank"] == 307
        assert sol.info["face_iterations"] * 3 < alone.info["face_iterations"]
        assert sol.objective <= alone.objective + 1e-12 * (abs(problem.c) + 1.0)
        assert sol.certificate.certified() or sol.certificate.at_rounding_floor
    else:
        assert not took(sol) and "not interpolating" in info["note"]
        assert sol.info["face_iterations"] == alone.info["face_iterations"] and np.array_equal(sol.d, alone.d)
        assert sol.certificate.certified(1e-8)


def test_the_iteration_ends_once_its_progress_stops_halving(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the rounding floor of an interpolating box (J* ~ 0) the best progress crept down by a few percent
    per iteration and each such step counted as a new best, so the iteration ran on for up to twice as
    long as it needed (n = 1024, rank n / 5: 33 iterations where 19 reach the same floor). Since stop 72 only
    a progress below ``STALL_GAIN`` of the last gain's counts: the iteration stops within ``STALL`` of its
    last halving, in fewer iterations than with any new best counting, at a progress at float64's
    rounding of the scaled problem and the same J to rounding."""
    problem = flat_interpolating_box(1024, 205, 4)
    structure = A.set_structure(Box(0.0, 1.0), problem.shape)
    lr = A.ridge_low_rank(problem.H, max_rank=1024 // 3)
    assert lr is not None and lr.rank == 205
    x, info = M.solve_low_rank_ipm(problem.H, problem.g, structure, lr, c=problem.c)
    monkeypatch.setattr(M, "STALL_GAIN", 1.0)  # the rule before: any new best
    x_old, old = M.solve_low_rank_ipm(problem.H, problem.g, structure, lr, c=problem.c)
    assert x is not None and x_old is not None
    assert info["iterations"] < old["iterations"]
    assert info["progress"] <= 1e-14 and info["iterations"] - info["best_iteration"] <= M.STALL
    size = abs(problem.c) + 1.0
    J, J_old = (float(0.5 * v @ problem.H @ v + problem.g @ v + problem.c) for v in (x, x_old))
    assert abs(J - J_old) <= 1e-10 * size


def flat_simplex(n: int, K: int, r: int, seed: int, interpolating: bool) -> MergeQP:
    """``H = U U'`` of :func:`flat_interpolating_box` on a per-atom simplex of ``K`` models: with ``g = -H t``
    for a target ``t`` whose atoms sum to 1 with a few negative entries (``interpolating``: J* ~ 0, nearly
    every coordinate free at the optimum), or for ``t`` uniform in [-0.3, 1.3] (atoms summing to ~K / 2:
    about half the coordinates at 0 at the optimum, the planted kind of stop 71)."""
    rng = np.random.default_rng(seed)
    U = rng.standard_normal((n, r)) * np.exp(-3.0 * np.arange(r) / r)
    H = U @ U.T
    H.flags.writeable = False
    if interpolating:
        t = rng.uniform(-0.1, 0.6, (K, n // K))
        t = (t / t.sum(axis=0, keepdims=True)).ravel()
    else:
        t = rng.uniform(-0.3, 1.3, n)
    return MergeQP(H, -(H @ t), float(0.5 * t @ H @ t), shape=(K, n // K))


@pytest.mark.parametrize("interpolating", [True, False])
def test_a_late_candidate_on_a_simplex_takes_the_interior_point_where_the_engine_wanders(interpolating: bool) -> None:
    """Stop 72: on a per-atom simplex whose flat rank n / 5 the path's sample cannot see, interpolating (the
    optimum's face nearly every coordinate), the late interior point is taken, in under a third of the
    engine alone's faces (which wandered through ~40 faces of nearly all coordinates, 4-7x the interior
    point with its head start at n = 1536), at a J no higher beyond rounding, certified or at the floor.
    Planted with about half the coordinates at 0 (cheap faces, counted by the order of what they factorise):
    the engine finishes within the late schedule's head start, so no interior point runs, and the solve is
    the engine alone's, face for face."""
    problem = flat_simplex(768, 4, 154, 21, interpolating)
    cset = Simplex(1.0)
    sol = solve(problem, cset, solver="active_set")
    alone = solve(problem, cset, solver="active_set", low_rank="off")
    if interpolating:
        info = sol.info["low_rank"]
        assert info["late"] and took(sol) and info["rank"] == 154
        assert sol.info["face_iterations"] * 3 < alone.info["face_iterations"]
        assert sol.objective <= alone.objective + 1e-12 * (abs(problem.c) + 1.0)
        assert sol.certificate.certified() or sol.certificate.at_rounding_floor
    else:
        assert not took(sol)
        assert sol.info["face_iterations"] == alone.info["face_iterations"] and np.array_equal(sol.d, alone.d)
        assert sol.certificate.certified(1e-8)


def test_a_late_candidate_counts_the_order_of_the_matrix_its_faces_factorise() -> None:
    """A late candidate's engine counts a face of a per-atom simplex by the order of the matrix its face
    solve factorises, the free coordinates less one per atom that has any (its pivot), not by the free
    coordinates (on four models that over-counted the flops by (4/3)^3 or more, and the interior point ran
    where the engine was about to finish alone: ``simplex_singular`` n = 3072 seed 1, 0.99 -> 1.74 s); on a
    box the two are the same. Off by default (the early head start was measured with the free count)."""
    from mergeqp.solvers.active_set_faces import FREE, LO, _Face

    problem = flat_simplex(48, 4, 10, 0, True)
    engine = A._Engine(problem, Simplex(1.0), A.set_structure(Simplex(1.0), problem.shape),
                       dict(A.ActiveSetSolver.defaults))
    assert engine.count_order is False
    group = np.asarray(engine.st.group)
    status = np.full(48, LO, dtype=np.int8)
    status[:12] = FREE  # the first model's 12 coordinates: 12 atoms with one free coordinate each
    assert engine.face_order(_Face(status, None, False)) == 0
    status[group == 0] = FREE  # and every coordinate of atom 0
    free = int(np.count_nonzero(status == FREE))
    assert engine.face_order(_Face(status, None, False)) == free - 12
    box = A._Engine(problem, Box(0.0, 1.0), A.set_structure(Box(0.0, 1.0), problem.shape),
                    dict(A.ActiveSetSolver.defaults))
    assert box.face_order(_Face(status, None, False)) == free


def test_a_slow_start_is_not_a_stall(monkeypatch: pytest.MonkeyPatch) -> None:
    """The halving rule applies only once the progress is small (``STALL_SMALL``): on a wide capped simplex
    (``box:0,30 & simplex:100``, random g) the progress fell by 30% over the first 4 iterations and then
    converged, and halving required from the start ended the iteration at its 4th iterate, progress 2e4 (a
    QA review, stop 72). Now it converges as with any new best counting, to the same iterate."""
    from mergeqp.constraints import intersect

    rng = np.random.default_rng(11)
    n, r = 1024, 250
    U = rng.standard_normal((n, r)) * np.exp(-3.0 * np.arange(r) / r)
    H = U @ U.T
    H.flags.writeable = False
    lr = A.ridge_low_rank(H, max_rank=340)
    structure = A.set_structure(intersect([Box(0.0, 30.0), Simplex(100.0)]), (4, n // 4))
    g = rng.standard_normal(n) * float(np.mean(np.diag(H)))
    x, info = M.solve_low_rank_ipm(H, g, structure, lr)
    assert x is not None and info["progress"] <= 1e-6 and info["iterations"] > 10
    monkeypatch.setattr(M, "STALL_GAIN", 1.0)
    x_any, any_best = M.solve_low_rank_ipm(H, g, structure, lr)
    assert info["iterations"] == any_best["iterations"] and np.array_equal(x, x_any)


def test_a_one_sided_set_is_a_late_candidate_only() -> None:
    """Since stop 72 a set with one-sided bounds (``nonneg``) whose coordinates all have a finite bound is a
    late candidate (never an early one: from its start, one unit inside the bounds, the iteration took 38-48
    iterations where the engine needed 5 faces, stop 69). On an interpolating ``nonneg`` QP of flat rank
    n / 5 the engine alone wandered through ~36 faces; with the interior point after its head start, a few,
    at a J no higher beyond rounding, certified or at the floor. A set with a coordinate free of bounds is
    no candidate."""
    from mergeqp.constraints import as_constraint_set

    n, r = 768, 154
    rng = np.random.default_rng(0)
    U = rng.standard_normal((n, r)) * np.exp(-3.0 * np.arange(r) / r)
    H = U @ U.T
    H.flags.writeable = False
    t = rng.uniform(-0.5, 1.5, n)
    problem = MergeQP(H, -(H @ t), float(0.5 * t @ H @ t), shape=(4, n // 4))
    cset = as_constraint_set("nonneg")
    structure = A.set_structure(cset, problem.shape)
    notes: dict = {}
    A.ridge_low_rank(H, max_rank=A.rank_limit(n, structure), notes=notes)
    assert M.ipm_gate(H, structure, notes) == "late"
    free = SetStructure(np.where(np.arange(n) < n // 2, 0.0, -np.inf), np.full(n, np.inf), None, None, None, None)
    assert M.ipm_gate(H, free, notes) is None
    sol = solve(problem, cset, solver="active_set")
    alone = solve(problem, cset, solver="active_set", low_rank="off")
    assert took(sol) and sol.info["low_rank"]["late"]
    assert sol.info["face_iterations"] * 3 < alone.info["face_iterations"]
    assert sol.objective <= alone.objective + 1e-12 * (abs(problem.c) + 1.0)
    assert sol.certificate.certified() or sol.certificate.at_rounding_floor
