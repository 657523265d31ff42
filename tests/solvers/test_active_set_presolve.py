"""The active-set solver's presolve (solvers/active_set_presolve.py): coordinates with zero rows of H
are fixed where the set says their optimal value (bounds by the sign of g, dead sum groups by their
exact linear minimiser, an L1 ball's centre where g = 0), the rest solved as before; checked against
the same solve without the presolve, against Clarabel, and coordinate by coordinate."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mergeqp.constraints import Box, GlobalSimplex, L1Ball, Simplex, intersect
from mergeqp.errors import UnboundedError
from mergeqp.matrix_cache import matrix_values
from mergeqp.problem import MergeQP
from mergeqp.solvers import active_set as A
from mergeqp.solvers import active_set_presolve as P
from mergeqp.solvers.instance_families import draw
from mergeqp.solvers.registry import solve


def dead_problem(rng: np.random.Generator, K: int, m: int, dead: np.ndarray, g_dead: np.ndarray | float = 0.0,
                 rank: int | None = None) -> MergeQP:
    """A PSD merge QP of shape (K, m) whose coordinates ``dead`` (flat) have zero rows of H, with
    ``g`` there set to ``g_dead``."""
    n = K * m
    B = rng.standard_normal((n, rank or n + 4))
    B[dead] = 0.0
    g = rng.standard_normal(n) * 3.0
    g[dead] = g_dead
    return MergeQP(B @ B.T / n, g, 1.0, shape=(K, m))


def _without_presolve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(A, "decouple", lambda *a, **k: None)


def test_box_fixes_each_dead_coordinate_by_the_sign_of_g(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    dead = np.array([1, 4, 7, 10, 13])
    problem = dead_problem(rng, 3, 6, dead, g_dead=np.array([2.0, -1.5, 0.0, 0.0, 3.0]))
    assert np.all(problem.H[dead] == 0)
    sol = solve(problem, Box(-0.5, 2.0), solver="active_set")
    x = sol.d.ravel()
    assert sol.info["decoupled"] == 5
    np.testing.assert_array_equal(x[dead], [-0.5, 2.0, 1 / 3, 1 / 3, -0.5])  # lo, hi, the start 1/K, lo
    assert sol.certificate.certified(1e-9)
    clarabel = solve(problem, Box(-0.5, 2.0), solver="clarabel")
    assert sol.objective <= clarabel.objective + 1e-7 * max(1.0, abs(clarabel.objective))
    _without_presolve(monkeypatch)
    plain = solve(problem, Box(-0.5, 2.0), solver="active_set")
    assert "decoupled" not in plain.info
    assert sol.objective == pytest.approx(plain.objective, rel=1e-10, abs=1e-10)


def test_a_warm_start_keeps_its_values_where_every_value_is_optimal() -> None:
    rng = np.random.default_rng(1)
    dead = np.array([0, 5, 9])
    problem = dead_problem(rng, 2, 6, dead)
    x0 = np.full(12, 0.25)
    x0[dead] = [0.9, 1.7, -3.0]  # the last two outside the box: clipped onto it
    sol = solve(problem, Box(0.0, 1.0), solver="active_set", x0=x0)
    np.testing.assert_array_equal(sol.d.ravel()[dead], [0.9, 1.0, 0.0])
    assert sol.certificate.certified(1e-9)


def test_the_warm_start_is_left_as_it_was() -> None:
    """(a review's find) A feasible x0 came back from the projection as itself, and the dead groups'
    minimisers were written into it: the caller's array (an earlier solution's d) changed, and a
    read-only x0 failed."""
    rng = np.random.default_rng(2)
    K, m = 3, 4
    problem = dead_problem(rng, K, m, np.array([0, 4, 8]), g_dead=np.array([1.0, -2.0, 0.5]))
    x0 = np.full((K, m), 1 / K)
    sol = solve(problem, Simplex(), solver="active_set", x0=x0)
    np.testing.assert_array_equal(x0, np.full((K, m), 1 / K))
    np.testing.assert_array_equal(sol.d[:, 0], [0.0, 1.0, 0.0])
    x0.setflags(write=False)
    again = solve(problem, Simplex(), solver="active_set", x0=x0)
    assert again.solver == "active_set" and again.objective == pytest.approx(sol.objective, rel=1e-12)
    first = sol.d.copy()
    solve(problem.with_linear_term(-problem.g), Simplex(), solver="active_set", x0=sol.d)
    np.testing.assert_array_equal(sol.d, first)


def test_dead_simplex_groups_take_their_linear_minimiser_or_the_start() -> None:
    rng = np.random.default_rng(2)
    K, m = 3, 8
    atoms_dead = [1, 4]
    partly = [(0, 6)]  # one model's coordinate of atom 6: the group stays in the engine
    dead = np.array([k * m + a for a in atoms_dead for k in range(K)] + [k * m + a for k, a in partly])
    g_dead = np.zeros(dead.size)
    g_dead[:K] = [0.5, -2.0, 1.0]  # atom 1: an LP, its minimum at model 1
    problem = dead_problem(rng, K, m, dead, g_dead=g_dead)
    sol = solve(problem, Simplex(1.0), solver="active_set")
    d = sol.d
    assert sol.info["decoupled"] == 2 * K
    np.testing.assert_array_equal(d[:, 1], [0.0, 1.0, 0.0])
    np.testing.assert_array_equal(d[:, 4], np.full(K, 1 / K))  # g = 0: every point optimal, the start kept
    assert sol.certificate.certified(1e-9)
    clarabel = solve(problem, Simplex(1.0), solver="clarabel")
    assert sol.objective <= clarabel.objective + 1e-7 * max(1.0, abs(clarabel.objective))


def test_an_l1_ball_puts_dead_coordinates_without_g_at_its_centre() -> None:
    rng = np.random.default_rng(3)
    dead = np.array([2, 3, 11])
    problem = dead_problem(rng, 2, 7, dead, g_dead=np.array([0.0, 0.0, 1.0]))
    cset = L1Ball(1.5, center=0.2)
    sol = solve(problem, cset, solver="active_set")
    assert sol.info["decoupled"] == 2  # the one with g != 0 stays in the engine
    np.testing.assert_array_equal(sol.d.ravel()[[2, 3]], [0.2, 0.2])
    assert sol.certificate.certified(1e-9)


def test_a_dead_coordinate_with_nothing_to_stop_it_is_still_unbounded() -> None:
    rng = np.random.default_rng(4)
    problem = dead_problem(rng, 2, 5, np.array([3]), g_dead=-1.0)
    with pytest.raises(UnboundedError, match="unbounded"):
        solve(problem, Box(0.0, np.inf), solver="active_set")


def test_nothing_is_taken_out_without_zero_rows_or_above_the_size_limit() -> None:
    rng = np.random.default_rng(5)
    problem = dead_problem(rng, 2, 5, np.array([], dtype=int))
    st_ = A.set_structure(Box(0, 1), problem.shape)
    assert P.decouple(problem.H, problem.g, problem.c, problem.shape, st_, None) is None
    near = np.array(problem.H)
    near[0, 0] = 0.0  # a zero diagonal in a row that is not zero (not PSD; never taken out)
    assert P.decouple(near, problem.g, problem.c, problem.shape, st_, None) is None
    dead = dead_problem(rng, 2, 5, np.array([0]))
    old = P.PRESOLVE_MAX_N
    try:
        P.PRESOLVE_MAX_N = 9
        assert P.decouple(dead.H, dead.g, dead.c, dead.shape, st_, None) is None
    finally:
        P.PRESOLVE_MAX_N = old
    everything = MergeQP(np.zeros((4, 4)), np.array([1.0, -1.0, 0.0, 2.0]), shape=(2, 2))
    st4 = A.set_structure(Box(0, 1), everything.shape)
    assert P.decouple(everything.H, everything.g, everything.c, everything.shape, st4, None) is None
    sol = solve(everything, Box(0, 1), solver="active_set")  # nothing left for the engine: solved as before
    np.testing.assert_allclose(sol.d.ravel()[[0, 1, 3]], [0.0, 1.0, 0.0], atol=1e-9)


def test_solves_on_one_H_share_the_reduced_matrix() -> None:
    rng = np.random.default_rng(6)
    problem = dead_problem(rng, 3, 10, np.array([2, 12, 22]))
    st_ = A.set_structure(Box(0, 1), problem.shape)
    first = P.decouple(problem.H, problem.g, problem.c, problem.shape, st_, None)
    second = P.decouple(problem.H, -problem.g, problem.c, problem.shape, st_, None)
    assert first is not None and second is not None
    assert first.problem.H is second.problem.H
    assert matrix_values(problem.H)[P.REDUCED_KEY][1] is first.problem.H
    np.testing.assert_array_equal(first.problem.H, problem.H[np.ix_(first.keep, first.keep)])
    old = P.REDUCED_SHARE_MAX_N
    try:  # above the sharing size each solve makes its own copy (none kept while H lives)
        P.REDUCED_SHARE_MAX_N = 29
        big = dead_problem(rng, 3, 10, np.array([2, 12, 22]))
        one = P.decouple(big.H, big.g, big.c, big.shape, st_, None)
        two = P.decouple(big.H, big.g, big.c, big.shape, st_, None)
        assert one is not None and two is not None and one.problem.H is not two.problem.H
        assert P.REDUCED_KEY not in (matrix_values(big.H) or {})
        assert one.problem.H.flags.writeable and matrix_values(one.problem.H) is None  # no cache entry
    finally:
        P.REDUCED_SHARE_MAX_N = old
    # c carries the fixed coordinates' linear terms: J of the expansion is the reduced J
    y = rng.random(first.keep.size)
    x = first.expand(y)
    reduced = 0.5 * y @ first.problem.H @ y + first.problem.g @ y + first.problem.c
    assert problem.objective(x.reshape(problem.shape)) == pytest.approx(reduced, rel=1e-12)


SETS = {
    "box": lambda K, m: Box(0.0, 1.0),
    "box_wide": lambda K, m: Box(-1.0, 2.0),
    "simplex": lambda K, m: Simplex(1.0),
    "box&simplex": lambda K, m: intersect([Box(0.0, 0.8), Simplex(1.0)]),
    "l1": lambda K, m: L1Ball(0.3 * K * m),
    "box&l1": lambda K, m: intersect([Box(-1.0, 1.0), L1Ball(0.2 * K * m)]),
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# (an L1 ball whose face solve ran along a dead coordinate's linear term to 7e9: its projection missed
# the ball by 1.9e-7 until far points were projected twice, constraints/kernels.py)
@example(K=2, m=3, kind="l1", dead_frac=0.5, whole=True, linear=True, low_rank=False, seed=2)
@given(K=st.integers(2, 4), m=st.integers(3, 12), kind=st.sampled_from(sorted(SETS)),
       dead_frac=st.floats(0.05, 0.6), whole=st.booleans(), linear=st.booleans(), low_rank=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_the_presolve_finds_the_same_optimum(K, m, kind, dead_frac, whole, linear, low_rank, seed) -> None:
    """Dead coordinates (whole atoms or scattered, with or without a linear term, on a definite or
    rank-deficient H): certified, and J equal to the solve without the presolve."""
    rng = np.random.default_rng(seed)
    n = K * m
    if whole:
        atoms = np.flatnonzero(rng.random(m) < dead_frac)
        dead = np.array([k * m + a for a in atoms for k in range(K)], dtype=int)
    else:
        dead = np.flatnonzero(rng.random(n) < dead_frac)
    g_dead = rng.standard_normal(dead.size) if linear else 0.0
    problem = dead_problem(rng, K, m, dead, g_dead=g_dead, rank=max(1, n // 3) if low_rank else None)
    cset = SETS[kind](K, m)
    sol = solve(problem, cset, solver="active_set")
    assert sol.certificate.certified(1e-8), sol.certificate.explain()
    original = A.decouple
    try:
        A.decouple = lambda *a, **k: None
        plain = solve(problem, cset, solver="active_set")
    finally:
        A.decouple = original
    scale = max(1.0, abs(plain.objective), float(np.abs(problem.g).sum()))
    assert abs(sol.objective - plain.objective) <= 1e-8 * scale


def test_the_dead_families_have_the_zero_rows_they_say() -> None:
    for name in ("box_dead", "simplex_dead"):
        inst = draw(name, 0, 96)
        H = inst.problem.H
        zero = np.all(H == 0, axis=1)
        assert zero.sum() == round(0.15 * 24) * 4  # 15% of the 24 atoms, in each of the 4 models
        assert np.all(inst.problem.g[zero] == 0)
        sol = solve(inst.problem, inst.constraints, solver="active_set")
        assert sol.info["decoupled"] == zero.sum()
        assert sol.certificate.certified(1e-8)
    assert not np.any(np.all(draw("box_singular", 0, 96).problem.H == 0, axis=1))


@pytest.mark.parametrize("cset", [L1Ball(2.0), GlobalSimplex(1.0)], ids=["l1", "global_simplex"])
def test_a_face_solve_that_runs_off_along_a_linear_term_lands_on_the_set(cset) -> None:
    """(a review's find, older than the presolve) Dead coordinates with g != 0 on one L1 ball or one
    global sum: a face solve runs along the zero-curvature direction to ~1e10 and the projection of
    that point lost the set's scale to its own (J = -1.1e61, "optimal"); far points are now projected
    twice (constraints/kernels.py), and the solve is certified like Clarabel's."""
    K, m = 3, 6
    rng = np.random.default_rng(1)
    B = rng.standard_normal((K * m, K * m))
    B[[0, 4, 7, 11, 17]] = 0.0
    problem = MergeQP(B @ B.T, rng.standard_normal(K * m), 0.0, shape=(K, m))
    sol = solve(problem, cset, solver="active_set")
    assert sol.certificate.certified(1e-8), sol.certificate.explain()
    clarabel = solve(problem, cset, solver="clarabel")
    assert sol.objective == pytest.approx(clarabel.objective, rel=1e-7, abs=1e-7)


def test_a_sum_structure_without_lower_bounds_is_left_to_the_engine() -> None:
    """A user's structure may declare sums over coordinates without lower bounds (the built-in simplices
    have them): its dead groups' linear programs could be unbounded, so the presolve takes nothing out."""
    from mergeqp.constraints.kernels import SetStructure

    rng = np.random.default_rng(8)
    problem = dead_problem(rng, 2, 3, np.array([0, 3]), g_dead=np.array([1.0, -1.0]))
    n = 6
    st_ = SetStructure(np.full(n, -np.inf), np.full(n, np.inf), np.tile(np.arange(3), 2), np.ones(3))
    assert P.decouple(problem.H, problem.g, problem.c, problem.shape, st_, None) is None
