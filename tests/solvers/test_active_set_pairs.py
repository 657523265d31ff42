"""The active-set solver's reduction of sums of two coordinates to a box (solvers/active_set_pairs.py):
the reduced QP is the same function of the same points (checked against ``P'HP`` formed densely and
against the whole problem's J and gradient at random points), the set is the same set, and solves
through it agree with the solve without it and with Clarabel, on per-atom simplices of two models,
capped ones, other totals, dead atoms and warm starts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mergeqp.constraints import Box, GlobalSimplex, L1Ball, Simplex, intersect
from mergeqp.constraints.kernels import SetStructure, project_structure
from mergeqp.errors import ValidationError
from mergeqp.matrix_cache import matrix_values
from mergeqp.problem import MergeQP
from mergeqp.solvers import active_set as A
from mergeqp.solvers import active_set_pairs as PR
from mergeqp.solvers.instance_families import draw
from mergeqp.solvers.registry import solve


def psd(rng: np.random.Generator, n: int, rank: int | None = None) -> np.ndarray:
    B = rng.standard_normal((n, rank or n + 3))
    H = B @ B.T / n
    return 0.5 * (H + H.T)  # exactly symmetric, whatever the BLAS


def structure(problem: MergeQP, cset) -> SetStructure:
    st_ = A.set_structure(cset, problem.shape)
    assert isinstance(st_, SetStructure)
    return st_


def dense_p(paired: PR.Paired) -> tuple[np.ndarray, np.ndarray]:
    """``P`` (``(n, m)``) and ``q`` of ``x = q + P s``, written out."""
    m = paired.m
    P = np.zeros((2 * m, m))
    P[paired.a, np.arange(m)] = 1.0
    P[paired.b, np.arange(m)] = -1.0
    q = np.zeros(2 * m)
    q[paired.b] = paired.totals
    return P, q


@pytest.mark.parametrize("perm", [False, True])
def test_the_reduced_qp_is_the_same_function_on_the_same_set(perm: bool) -> None:
    rng = np.random.default_rng(3)
    m = 9
    n = 2 * m
    H = psd(rng, n)
    g = rng.standard_normal(n)
    lo, hi = np.full(n, -0.3), np.full(n, 1.4)
    group = np.concatenate([np.arange(m), np.arange(m)])
    if perm:  # pairs that are not the two contiguous halves: the blocked gather
        group = rng.permutation(group)
    totals = rng.uniform(0.5, 2.0, m)
    st_ = SetStructure(lo, hi, group, totals)
    paired = PR.pair_box(H, g, 0.7, st_)
    assert paired is not None and paired.m == m
    P, q = dense_p(paired)
    Hs = paired.problem.H
    np.testing.assert_array_equal(Hs, Hs.T)  # exactly symmetric
    np.testing.assert_allclose(Hs, P.T @ H @ P, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(group[paired.a], group[paired.b])
    assert np.all(paired.a < paired.b)
    box = paired.structure
    assert box.bounds_only
    np.testing.assert_allclose(box.lo, np.maximum(-0.3, totals - 1.4))
    np.testing.assert_allclose(box.hi, np.minimum(1.4, totals + 0.3))
    for _ in range(5):
        s = rng.uniform(box.lo, box.hi)
        x = paired.expand(s)
        np.testing.assert_allclose(x, q + P @ s, rtol=0, atol=1e-15)
        # x is in the set: its projection is itself
        np.testing.assert_allclose(project_structure(st_, x), x, atol=1e-12)
        J_x = 0.5 * x @ H @ x + g @ x + 0.7
        J_s = 0.5 * s @ Hs @ s + paired.problem.g @ s + paired.problem.c
        assert J_s == pytest.approx(J_x, rel=1e-12, abs=1e-12)
        np.testing.assert_allclose(Hs @ s + paired.problem.g, P.T @ (H @ x + g), rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(paired.start(x), s, atol=1e-14)
    # a point of the whole set outside it maps into the box
    far = paired.start(np.full(n, 5.0))
    assert np.all(far >= box.lo) and np.all(far <= box.hi)


def test_sets_that_are_not_pairs_are_left_alone() -> None:
    rng = np.random.default_rng(0)
    for K, cset in ((3, Simplex()), (2, Box(0.0, 1.0)), (2, L1Ball(1.0)), (1, Simplex())):
        problem = MergeQP(psd(rng, 4 * K), rng.standard_normal(4 * K), 0.0, shape=(K, 4))
        assert PR.pair_box(problem.H, problem.g, 0.0, structure(problem, cset)) is None, cset.spec
    # a global simplex of two coordinates is one pair
    problem = MergeQP(psd(rng, 2), rng.standard_normal(2), 0.0, shape=(2, 1))
    assert PR.pair_box(problem.H, problem.g, 0.0, structure(problem, GlobalSimplex())) is not None
    # a pair without a lower bound (a user's sum: an unbounded box) and an empty pair: the engine's
    n, H, g = 4, psd(rng, 4), rng.standard_normal(4)
    group, totals = np.array([0, 1, 0, 1]), np.ones(2)
    assert PR.pair_box(H, g, 0.0, SetStructure(np.full(n, -np.inf), np.full(n, np.inf), group, totals)) is None
    assert PR.pair_box(H, g, 0.0, SetStructure(np.full(n, 0.0), np.full(n, 0.4), group, totals)) is None


def _solves(problem: MergeQP, cset, **kw):
    on = solve(problem, cset, solver="active_set", **kw)
    off = solve(problem, cset, solver="active_set", pairs="off", **kw)
    ref = solve(problem, cset, solver="clarabel")
    return on, off, ref


@pytest.mark.parametrize(("cset", "total"), [(Simplex(), 1.0), (Simplex(2.0), 2.0),
                                             (intersect([Box(0.0, 0.7), Simplex()]), 1.0),
                                             (intersect([Box(-0.5, 1.0), Simplex(0.5)]), 0.5)],
                         ids=["simplex", "simplex-2", "capped", "half"])
def test_solves_through_the_box_agree_with_the_whole_problem(cset, total: float) -> None:
    rng = np.random.default_rng(11)
    m = 40
    for rank in (None, 25):  # definite; singular (rank 25 of 80: flat directions, proximal levels)
        problem = MergeQP(psd(rng, 2 * m, rank), rng.standard_normal(2 * m) * 2.0, 1.0, shape=(2, m))
        on, off, ref = _solves(problem, cset)
        assert on.info["paired"] == m and "paired" not in off.info
        assert on.certificate.certified(1e-9) and off.certificate.certified(1e-9)
        scale = max(1.0, abs(ref.objective))
        assert on.objective == pytest.approx(off.objective, abs=1e-9 * scale)
        assert on.objective <= ref.objective + 1e-7 * scale
        np.testing.assert_allclose(on.d.sum(axis=0), total, atol=1e-12)
        assert np.all(on.d >= 0.0)


def test_dead_atoms_and_a_warm_start_go_through_both_reductions() -> None:
    rng = np.random.default_rng(5)
    m = 30
    n = 2 * m
    B = rng.standard_normal((n, n + 2))
    dead_atoms = np.array([2, 7, 19])
    B[np.concatenate([dead_atoms, dead_atoms + m])] = 0.0
    g = rng.standard_normal(n)
    problem = MergeQP(B @ B.T / n, g, 0.0, shape=(2, m))
    cold = solve(problem, Simplex(), solver="active_set")
    assert cold.info["decoupled"] == 6 and cold.info["paired"] == m - 3
    assert cold.certificate.certified(1e-9)
    ref = solve(problem, Simplex(), solver="clarabel")
    assert cold.objective <= ref.objective + 1e-8 * max(1.0, abs(ref.objective))
    # a dead atom of a linear term goes to the vertex its g prefers (the presolve's LP)
    for a in dead_atoms:
        k = int(np.argmin(g[[a, a + m]]))
        assert cold.d[k, a] == 1.0
    warm = solve(problem.with_linear_term(g + 0.01 * rng.standard_normal(n)), Simplex(), solver="active_set",
                 x0=cold.d, start_face="point")
    assert warm.info["paired"] == m - 3 and warm.certificate.certified(1e-9)


def test_sequences_on_one_h_share_the_reduced_matrix() -> None:
    inst = draw("simplex:K=2", 0, 256)
    problem = inst.problem
    first = solve(problem, inst.constraints, solver="active_set")
    shared = matrix_values(problem.H)
    assert shared is not None and PR.PAIRS_KEY in shared
    Hs = shared[PR.PAIRS_KEY][2]
    assert not Hs.flags.writeable
    again = solve(problem.with_linear_term(problem.g * 1.01), inst.constraints, solver="active_set", x0=first.d)
    assert shared[PR.PAIRS_KEY][2] is Hs
    assert again.certificate.certified(1e-9) and first.info["paired"] == 128


def test_the_option_is_checked_by_name() -> None:
    problem = MergeQP(np.eye(4), np.ones(4), 0.0, shape=(2, 2))
    with pytest.raises(ValidationError, match="pairs='sometimes'"):
        solve(problem, Simplex(), solver="active_set", pairs="sometimes")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), m=st.integers(1, 24), rank_share=st.sampled_from([None, 0.3, 0.8]),
       cap=st.sampled_from([None, 0.6, 1.5]), total=st.sampled_from([1.0, 0.5, 3.0]))
def test_property_pairs_match_clarabel(seed: int, m: int, rank_share, cap, total: float) -> None:
    """Random per-atom simplices of two models (capped or not, any total; definite or singular H):
    the solve through the box is certified, in the set, and no worse than Clarabel's."""
    rng = np.random.default_rng(seed)
    n = 2 * m
    rank = None if rank_share is None else max(1, int(rank_share * n))
    problem = MergeQP(psd(rng, n, rank), rng.standard_normal(n) * rng.choice([0.1, 1.0, 10.0]), 0.0,
                      shape=(2, m))
    cset = Simplex(total) if cap is None or 2 * cap < total else intersect([Box(0.0, cap), Simplex(total)])
    sol = solve(problem, cset, solver="active_set")
    assert sol.info["paired"] == m
    assert sol.certificate.certified(1e-8) or sol.certificate.at_rounding_floor
    np.testing.assert_allclose(sol.d.sum(axis=0), total, atol=1e-12 * max(1.0, total))
    assert np.all(sol.d >= -1e-15)
    ref = solve(problem, cset, solver="clarabel")
    assert sol.objective <= ref.objective + 1e-7 * max(1.0, abs(ref.objective))


def test_the_two_model_family_takes_the_box_and_reaches_its_planted_optimum() -> None:
    """``simplex_pair`` (a merge of two fine-tunes: per-atom simplex of two models, rank c N = 400 plus
    a weak ridge at n = 3072) keeps the case in the benchmark; drawn smaller here, it goes through the
    box and ends at its planted optimum, as the engine on the whole simplex does."""
    inst = draw("simplex_pair", 1, 768)
    assert inst.problem.shape == (2, 384) and inst.d_star is not None
    sol = solve(inst.problem, inst.constraints, solver="active_set")
    assert sol.info["paired"] == 384 and sol.certificate.certified(1e-9)
    assert sol.objective == pytest.approx(inst.objective, rel=1e-9)
    np.testing.assert_allclose(sol.d, inst.d_star, atol=1e-6)
    off = solve(inst.problem, inst.constraints, solver="active_set", pairs="off")
    assert "paired" not in off.info and off.objective == pytest.approx(sol.objective, rel=1e-10)


@pytest.mark.parametrize("scattered", [False, True])
def test_the_pair_matrix_over_several_blocks_of_rows(scattered: bool) -> None:
    """``pair_matrix`` forms ``H_s`` in blocks of rows: with more pairs than one block holds it is
    still ``P'HP`` and exactly symmetric, for the two halves (slices) and for scattered pairs."""
    rng = np.random.default_rng(9)
    m = PR._BLOCK + 44
    n = 2 * m
    H = psd(rng, n, 40)
    idx = rng.permutation(n) if scattered else np.arange(n)
    a, b = np.sort(idx[:m]), np.sort(idx[m:])
    if not scattered:
        assert np.array_equal(a, np.arange(m)) and np.array_equal(b, np.arange(m, n))
    Hs = PR.pair_matrix(H, a, b)
    P = np.zeros((n, m))
    P[a, np.arange(m)] = 1.0
    P[b, np.arange(m)] = -1.0
    np.testing.assert_array_equal(Hs, Hs.T)
    np.testing.assert_allclose(Hs, P.T @ H @ P, rtol=1e-12, atol=1e-12)


def test_auto_reserves_less_memory_for_a_set_of_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond ``auto_max_n`` ``auto`` keeps active_set while its work arrays fit: 2 H in general,
    1 H on a set of pairs (a box of n / 2: ``H_s`` and its float32 copy instead of a float32 H)."""
    from mergeqp.solvers import base as solver_base
    from mergeqp.solvers.registry import SOLVERS, choose_solver

    monkeypatch.setattr(type(SOLVERS["active_set"]), "auto_max_n", 5)
    rng = np.random.default_rng(2)
    pair = MergeQP(psd(rng, 12), rng.standard_normal(12), 0.0, shape=(2, 6))
    three = MergeQP(psd(rng, 12), rng.standard_normal(12), 0.0, shape=(3, 4))
    one_h = 8 * 12 ** 2
    monkeypatch.setattr(solver_base, "available_memory_bytes", lambda: 1.5 * one_h)
    assert choose_solver(pair, Simplex()).name == "active_set"
    assert choose_solver(three, Simplex()).name == "torch_fista"
    assert choose_solver(pair, Box(0.0, 1.0)).name == "torch_fista"  # a box of n: its 2 H
    monkeypatch.setattr(solver_base, "available_memory_bytes", lambda: 0.5 * one_h)
    assert "work arrays need up to" in SOLVERS["active_set"].auto_declines(pair, Simplex())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), m=st.integers(1, 20), pinned=st.booleans())
def test_property_pairs_with_bounds_of_their_own(seed: int, m: int, pinned: bool) -> None:
    """Per-coordinate bounds (a box of arrays intersected with the per-atom simplex of two models),
    some pairs pinned to one point (``lo = hi`` on one side): the pair's box is computed per pair, and
    the solve through it is certified, in the set, and no worse than Clarabel's."""
    rng = np.random.default_rng(seed)
    n = 2 * m
    lo = rng.uniform(0.0, 0.4, (2, m))
    hi = lo + rng.uniform(0.0, 1.2, (2, m))
    if pinned:
        hi[0, : max(1, m // 3)] = lo[0, : max(1, m // 3)]
    hi[1] = np.maximum(hi[1], 1.0 - hi[0] + 0.01)  # every pair feasible: lo_a + lo_b <= 1 <= hi_a + hi_b
    cset = intersect([Box(lo, hi), Simplex()])
    problem = MergeQP(psd(rng, n, max(1, n // 2)), rng.standard_normal(n), 0.0, shape=(2, m))
    sol = solve(problem, cset, solver="active_set")
    assert sol.info["paired"] == m
    assert sol.certificate.certified(1e-8) or sol.certificate.at_rounding_floor
    assert np.all(sol.d >= lo - 1e-12) and np.all(sol.d <= hi + 1e-12)
    np.testing.assert_allclose(sol.d.sum(axis=0), 1.0, atol=1e-12)
    ref = solve(problem, cset, solver="clarabel")
    assert sol.objective <= ref.objective + 1e-7 * max(1.0, abs(ref.objective))
