"""The dense interior-point solver against Clarabel (a second, independent solver) on polyhedral
sets that the active-set engine does not take, its options, and its errors."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mergeqp.constraints import Box, GlobalSimplex, L1Ball, Simplex, SignConsensus
from mergeqp.errors import SolverError, UnboundedError, ValidationError
from mergeqp.problem import MergeQP
from mergeqp.solution import SolveStatus
from mergeqp.solvers.dense_ipm import DenseIpmSolver
from mergeqp.solvers.instance_families import draw
from mergeqp.solvers.registry import SOLVERS, choose_solver, solve


def _sign(K: int, m: int, rng: np.random.Generator, cols: int = 3, density: float = 1.0) -> SignConsensus:
    return SignConsensus.from_deltas(rng.standard_normal((K, m, cols)), "rows", density=density)


def _sets(K: int, m: int, rng: np.random.Generator) -> list:
    return [
        Box(0.0, 1.0) & _sign(K, m, rng),
        Box(0.0, 1.0) & _sign(K, m, rng, cols=1),
        Box(0.0, 1.0) & _sign(K, m, rng, cols=6, density=0.5),
        Simplex() & _sign(K, m, rng),
        Box(0.0, np.inf) & _sign(K, m, rng),
        Box(-1.0, 1.0) & L1Ball(0.4 * K * m, 0.0) & _sign(K, m, rng),
        Box(0.0, 1.0) & GlobalSimplex(0.5 * m) & _sign(K, m, rng),
        Box(0.0, 1.0 if K == 1 else 0.7) & Simplex(),
        Box(0.2, 0.2) & _sign(K, m, rng),  # every coefficient fixed (lo == hi): equalities only
        # equality rows that overlap (eliminated per atom, the rest kept as equalities): a
        # redundant global sum, and a few coefficients fixed inside the per-atom sums
        Box(0.0, 1.0) & Simplex() & GlobalSimplex(float(m)) & _sign(K, m, rng),
        Box(*_fixed_some(K, m, rng)) & Simplex() & _sign(K, m, rng),
        # eliminated sums and the L1 ball's auxiliaries together (centred at the soup: feasible)
        Simplex() & L1Ball(0.6 * m, 1.0 / K) & _sign(K, m, rng),
    ]


def _fixed_some(K: int, m: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Bounds ``[0, 1]`` with about a third of the coefficients fixed at the soup's ``1 / K``
    (lo == hi), so that the soup stays feasible with the simplex and sign consensus."""
    fixed = rng.random((K, m)) < 0.33
    return np.where(fixed, 1.0 / K, 0.0), np.where(fixed, 1.0 / K, 1.0)


problems = st.tuples(
    st.integers(1, 3),  # K
    st.integers(1, 6),  # atoms
    st.floats(0.0, 1.0),  # rank fraction (0 -> zero H: an LP)
    st.integers(0, 2**31 - 1),  # seed
    st.integers(0, 11),  # constraint set
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems)
# (hypothesis's find, stop 61: coefficients fixed inside per-atom sums with sign rows; E M^-1 E' formed
# from the float32 factor of M was not positive definite and the solve raised instead of forming it
# again from a float64 factor)
@example((3, 3, 0.5, 25, 10))
@example((2, 4, 0.375, 4605, 4))
def test_dense_ipm_agrees_with_clarabel_and_certifies(random_psd_problem, rel_diff, params) -> None:
    K, m, frac, seed, which = params
    rng = np.random.default_rng(seed)
    problem = random_psd_problem(rng, K, m, round(frac * K * m))
    cset = _sets(K, m, rng)[which]
    ref = solve(problem, cset, solver="clarabel", rel_tol=1e-7)
    sol = solve(problem, cset, solver="dense_ipm", rel_tol=1e-7)
    assert sol.certificate.feasible, sol.certificate.explain()
    if ref.certificate.certified(1e-7):  # (on an unbounded set with J* = 0 neither may certify)
        assert sol.certificate.certified(1e-7) or sol.certificate.at_rounding_floor, sol.certificate.explain()
    # (or within the float64 rounding of J at Clarabel's point: hypothesis found, stop 66, on
    # box:0,inf & sign with J >= 0 and J* = 0, Clarabel's J = -2.3e-6 at |d| ~ 1e5 along a flat
    # direction of H, where J's products are ~1e11; dense_ipm's J = -1e-14 at |d| ~ 6)
    assert (rel_diff(sol.objective, ref.objective) <= 1e-6
            or abs(sol.objective - ref.objective) <= 1e3 * np.finfo(float).eps * _terms(problem, ref.d)), \
        (sol.objective, ref.objective)


def _terms(problem, d) -> float:
    """The scale of J's float64 rounding at ``d``: ``|c| + |d|'|H||d| / 2 + |g|'|d|`` (products of
    magnitudes: along a flat direction of H, ``d'Hd`` is small while its rounding is not)."""
    x = np.abs(np.asarray(d, dtype=float).ravel())
    return abs(problem.c) + 0.5 * float(x @ (np.abs(problem.H) @ x)) + float(np.abs(problem.g) @ x)


@pytest.mark.parametrize("options", [{}, {"precision": "float64"}, {"precision": "mixed"}, {"crossover": False},
                                     {"correctors": 0},
                                     {"crossover_from": 1.0, "crossover_face_solves": 40}])
def test_sign_family_every_option_reaches_the_same_certified_optimum(options: dict) -> None:
    inst = draw("sign", 1, 192)
    ref = solve(inst.problem, inst.constraints, solver="clarabel", rel_tol=1e-9)
    sol = solve(inst.problem, inst.constraints, solver="dense_ipm", rel_tol=1e-9, **options)
    assert sol.certificate.certified(1e-9), sol.certificate.explain()
    assert abs(sol.objective - ref.objective) <= 1e-9 * abs(ref.objective)
    if options.get("precision") == "float64":
        assert sol.info["factorisations"]["float32"] == 0
    elif not options:
        assert sol.info["factorisations"]["float32"] > 0  # far from the optimum: float32


def test_crossover_lands_exactly_on_the_face() -> None:
    """A certified crossover returns the face's minimiser: coefficients exactly at their bounds
    (an interior point only approaches them)."""
    inst = draw("sign", 0, 192)
    on = solve(inst.problem, inst.constraints, solver="dense_ipm", rel_tol=1e-9)
    off = solve(inst.problem, inst.constraints, solver="dense_ipm", rel_tol=1e-9, crossover=False)
    assert on.info["crossover"][-1].startswith("certified")
    assert off.info["crossover"] == []
    assert np.count_nonzero((on.d == 0.0) | (on.d == 1.0)) > np.count_nonzero((off.d == 0.0) | (off.d == 1.0))
    assert on.certificate.fw_gap <= off.certificate.fw_gap


@pytest.mark.parametrize("which", [3, 6, 7, 8, 9, 10])
def test_eliminated_equalities_give_the_same_problem(random_psd_problem, which: int) -> None:
    """The reduced form of the equality rows' elimination is the same QP: for any ``y``, the
    lifted point meets every equality row, and its objective and inequality rows (bounds
    included) are those of the reduced form at ``y``."""
    from mergeqp.solvers.dense_ipm import _eliminate, _form

    rng = np.random.default_rng(which)
    K, m = 3, 5
    problem = random_psd_problem(rng, K, m, 9)
    cset = _sets(K, m, rng)[which]
    full = _form(problem, cset)
    red, elim = _eliminate(full)
    if which == 8:  # every coefficient fixed: nothing is left to solve for, the plain form stays
        assert elim is None and red is full
        return
    taken = elim.taken
    assert taken.size >= 1 and red.N == full.N - taken.size
    kept = np.setdiff1d(np.arange(full.E.shape[0]), taken)
    assert red.E.shape[0] == kept.size
    if which == 9:  # the global sum overlaps the per-atom ones: it stays an equality row
        assert kept.size == 1
    for _ in range(3):
        y = rng.standard_normal(red.N)
        z = elim.T @ y + elim.t0
        res = full.E @ z - full.f
        np.testing.assert_allclose(res[taken], 0.0, atol=1e-12)
        np.testing.assert_allclose(res[kept], red.E @ y - red.f, atol=1e-12)
        J_full = 0.5 * z @ full.Hmul(z) + full.q @ z + full.c0
        J_red = 0.5 * y @ red.Hmul(y) + red.q @ y + red.c0
        assert abs(J_full - J_red) <= 1e-10 * (1 + abs(J_full))
        viol_full = np.max(full.Cx(z) - full.d(), initial=-np.inf)
        viol_red = np.max(red.Cx(y) - red.d(), initial=-np.inf)
        assert abs(viol_full - viol_red) <= 1e-12 * (1 + abs(viol_full))
    np.testing.assert_array_equal(red.H, red.H.T)


def test_simplex_and_sign_solve_the_reduced_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    """``simplex & sign``: the per-atom sums are eliminated (no Schur complement of them), and the
    certified optimum is the one found with them kept as equality rows."""
    from mergeqp.solvers import dense_ipm

    inst = draw("sign", 0, 192)
    sign = [s for s in inst.constraints.members() if s.name == "sign"][0]
    cset = Simplex() & sign
    on = solve(inst.problem, cset, solver="dense_ipm", rel_tol=1e-9)
    assert on.info["equalities_eliminated"] == inst.problem.shape[1]
    monkeypatch.setattr(dense_ipm, "ELIMINATE_MAX_SUPPORT", 0)
    off = solve(inst.problem, cset, solver="dense_ipm", rel_tol=1e-9)
    assert "equalities_eliminated" not in off.info
    assert on.certificate.certified(1e-9) and off.certificate.certified(1e-9)
    assert abs(on.objective - off.objective) <= 1e-9 * abs(off.objective)
    np.testing.assert_allclose(on.d.sum(axis=0), 1.0, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("aux_block", [True, False])
def test_l1_ball_reaches_the_planted_optimum(seed: int, aux_block: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The L1 ball (auxiliary variables, a zero block of H): the crossover lands on the planted
    optimum and certifies (before the auxiliaries' elimination it ran out of iterations
    uncertified on this family at n = 1536), also through the lifted normal matrix."""
    from mergeqp.solvers import dense_ipm

    if not aux_block:
        monkeypatch.setattr(dense_ipm._AuxBlock, "detect", classmethod(lambda cls, F: None))
    inst = draw("l1", seed, 240)
    sol = solve(inst.problem, inst.constraints, solver="dense_ipm", rel_tol=1e-9)
    assert sol.certificate.certified(1e-9), sol.certificate.explain()
    assert sol.info["crossover"][-1].startswith("certified")
    assert abs(sol.objective - inst.objective) <= 1e-9 * abs(inst.objective)


def test_auxiliary_block_elimination_solves_the_normal_equations(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Schur complement of the auxiliaries' block gives the same Newton solves as the lifted
    normal matrix, for vectors and matrices, in float64 and in float32 with its refinement."""
    from mergeqp.solvers import dense_ipm

    rng = np.random.default_rng(3)
    inst = draw("sign", 0, 96)
    sign = [m for m in inst.constraints.members() if m.name == "sign"][0]
    cset = Box(-1.0, 1.0) & L1Ball(5.0) & sign
    opts = DenseIpmSolver().check_options({})
    with_aux = dense_ipm._Ipm(inst.problem, cset, opts)
    assert with_aux.aux is not None and with_aux.aux.dense_rows.size == 1  # the ball's sum row
    monkeypatch.setattr(dense_ipm._AuxBlock, "detect", classmethod(lambda cls, F: None))
    plain = dense_ipm._Ipm(inst.problem, cset, opts)
    assert plain.aux is None
    w = 10.0 ** rng.uniform(-3, 3, plain.F.m)
    r = rng.standard_normal(plain.F.N)
    R = rng.standard_normal((plain.F.N, 3))
    for low, tol in ((False, 1e-8), (True, 1e-5)):
        a, b = with_aux.factorise(w, low), plain.factorise(w, low)
        for rhs in (r, R):
            np.testing.assert_allclose(a(rhs), b(rhs), rtol=tol, atol=tol * np.max(np.abs(b(rhs))))


def test_rows_on_one_free_variable_are_grouped() -> None:
    from mergeqp.solvers.dense_ipm import _single_variable_rows

    # rows 0, 1: variable 0 at 2 (consistent twins); 2: on two variables; 3, 4: variable 1 at 1
    # and at 3 (inconsistent: left out); 5: an equality row (beyond m)
    AF = sp.csr_matrix(np.array([[1.0, 0, 0], [-2.0, 0, 0], [1.0, 1.0, 0], [0, 1.0, 0], [0, -1.0, 0],
                                 [0, 0, 1.0]]))
    rhs = np.array([2.0, -4.0, 0.0, 1.0, -3.0, 5.0])
    rows, a, group, var, val = _single_variable_rows(AF, rhs, 5)
    np.testing.assert_array_equal(rows, [0, 1])
    np.testing.assert_array_equal(a, [1.0, -2.0])
    np.testing.assert_array_equal(group, [0, 0])
    np.testing.assert_array_equal(var, [0])
    np.testing.assert_array_equal(val, [2.0])
    assert _single_variable_rows(AF[[2]], rhs[[2]], 1) is None


def test_definite_solve_meets_dependent_rows() -> None:
    """A singular but consistent Schur complement (two equal rows): the ridge and iterated
    Tikhonov meet the rows to rounding and give the least-norm split."""
    from mergeqp.solvers.dense_ipm import _definite_solve

    rng = np.random.default_rng(0)
    A = rng.standard_normal((4, 6))
    A = np.vstack([A, A[1]])  # row 4 repeats row 1
    S = A @ A.T
    target = rng.standard_normal(5)
    target[4] = target[1]
    rhs = S @ np.linalg.lstsq(S, target, rcond=None)[0]
    y = _definite_solve(S, rhs)
    assert y is not None
    np.testing.assert_allclose(S @ y, rhs, atol=1e-9 * np.max(np.abs(rhs)))
    assert abs(y[1] - y[4]) <= 1e-6 * np.max(np.abs(y))  # least norm: the twins share equally
    assert _definite_solve(np.zeros((2, 2)), np.ones(2)) is None


def test_auto_takes_dense_ipm_for_sign_consensus_from_its_size(random_psd_problem) -> None:
    inst = draw("sign", 0, DenseIpmSolver.auto_min_n)
    assert choose_solver(inst.problem, inst.constraints).name == "dense_ipm"
    sol = solve(inst.problem, inst.constraints)
    assert sol.solver == "dense_ipm" and sol.certificate.certified()
    small = random_psd_problem(np.random.default_rng(0), 3, 5, 15)  # n = 15: Clarabel's fixed costs are lower
    cset = Box(0.0, 1.0) & _sign(3, 5, np.random.default_rng(1))
    assert choose_solver(small, cset).name == "clarabel"
    assert "clarabel was measured faster" in SOLVERS["dense_ipm"].auto_declines(small, cset)


def test_auto_declines_beyond_its_memory(random_psd_problem, monkeypatch: pytest.MonkeyPatch) -> None:
    from mergeqp.solvers import base as solver_base

    problem = random_psd_problem(np.random.default_rng(0), 2, 4, 8)
    cset = Box(0.0, 1.0) & _sign(2, 4, np.random.default_rng(1))
    monkeypatch.setattr(DenseIpmSolver, "auto_min_n", 1)
    monkeypatch.setattr(DenseIpmSolver, "auto_max_n", 4)
    monkeypatch.setattr(solver_base, "available_memory_bytes", lambda: 1.0)
    assert "work arrays need" in SOLVERS["dense_ipm"].auto_declines(problem, cset)
    assert choose_solver(problem, cset).name == "clarabel"
    monkeypatch.setattr(solver_base, "available_memory_bytes", lambda: 1e12)
    assert choose_solver(problem, cset).name == "dense_ipm"


def test_options_are_checked() -> None:
    s = DenseIpmSolver()
    with pytest.raises(ValidationError, match="precision"):
        s.check_options({"precision": "half"})
    with pytest.raises(ValidationError, match="tol"):
        s.check_options({"tol": -1.0})
    with pytest.raises(ValidationError, match="threads"):
        s.check_options({"threads": "many"})
    with pytest.raises(ValidationError, match="unrecognised"):
        s.check_options({"warm_steps": 3})


def test_empty_set_is_said_not_returned(random_psd_problem) -> None:
    problem = random_psd_problem(np.random.default_rng(0), 3, 4, 12)
    with pytest.raises(SolverError, match="may be empty"):
        DenseIpmSolver().solve(problem, Box(2.0, 3.0) & Simplex(1.0), max_iter=30)
    # an iteration limit the caller lowered while the infeasibility still fell: the best iterate,
    # said to be stopped there (not blamed on the set)
    capped = DenseIpmSolver().solve(problem, Box(0.0, 1.0) & Simplex(1.0), max_iter=3)
    assert capped.status == SolveStatus.MAX_ITERATIONS and "stopped at max_iter = 3" in capped.info["note"]
    with pytest.raises(SolverError, match="is empty"):
        DenseIpmSolver().solve(problem, Box(0.5, 1.0) & Box(0.0, 0.4))


def test_unbounded_problem_is_named() -> None:
    rng = np.random.default_rng(0)
    K, m = 2, 3
    problem = MergeQP(np.zeros((K * m, K * m)), -np.ones(K * m), 0.0, shape=(K, m))
    with pytest.raises(UnboundedError):
        DenseIpmSolver().solve(problem, _sign(K, m, rng))


def test_centrality_correctors_shorten_the_iteration() -> None:
    """Gondzio's correctors (one more solve each) take fewer iterations to the same optimum."""
    with_c, without = 0, 0
    for seed in range(3):
        inst = draw("sign", seed, 192)
        a = solve(inst.problem, inst.constraints, solver="dense_ipm", crossover=False)
        b = solve(inst.problem, inst.constraints, solver="dense_ipm", crossover=False, correctors=0)
        assert abs(a.objective - b.objective) <= 1e-9 * abs(b.objective)
        with_c, without = with_c + a.iterations, without + b.iterations
    assert with_c < without


def test_a_crossover_certificate_is_not_solved_twice() -> None:
    """The crossover certifies its point and the registry certifies it again: within one
    ``solve`` the set's linear minimum at that very gradient is computed once; outside a solve,
    and for another set object, every certificate computes its own."""
    from mergeqp.certificate import certify, reuse_linear_minimum

    inst = draw("sign", 0, 192)
    cset = inst.constraints
    calls = []
    original = cset.linear_minimum

    def counted(grad):
        calls.append(1)
        return original(grad)

    cset.linear_minimum = counted
    sol = solve(inst.problem, cset, solver="dense_ipm", rel_tol=1e-9)
    assert sol.info["crossover"][-1].startswith("certified") and sol.certificate.certified(1e-9)
    assert len(calls) == 1
    calls.clear()
    certify(inst.problem, cset, sol.d)
    certify(inst.problem, cset, sol.d)
    assert len(calls) == 2  # outside a solve: nothing is reused
    calls.clear()
    with reuse_linear_minimum():
        certify(inst.problem, cset, sol.d)
        certify(inst.problem, cset, sol.d)
        assert len(calls) == 1
        other = Box(0.0, 1.0) & [m for m in cset.members() if m.name == "sign"][0]
        a = certify(inst.problem, other, sol.d)  # another set object: its own LP
        b = certify(inst.problem, cset, sol.d + 1e-3)  # another point: its own LP
        assert len(calls) == 2 and a.certified(1e-9) and not b.feasible


def test_degenerate_parts_of_a_face_are_counted_per_component() -> None:
    """``_degenerate``: an L1 coordinate at the ball's centre (its two rows and the auxiliary's
    bound ``t >= 0``: three constraints on two variables) is degenerate; a coordinate with one of
    its rows active is not; the ball's sum row (on every auxiliary) links nothing."""
    from mergeqp.solvers.dense_ipm import _Ipm

    rng = np.random.default_rng(0)
    A = rng.standard_normal((6, 10))
    P = MergeQP(A.T @ A + np.eye(10), rng.standard_normal(10), 0.0, shape=(2, 5))
    ipm = _Ipm(P, L1Ball(2.0), dict(DenseIpmSolver.defaults))
    F = ipm.F
    n = 10
    assert F.A.shape[0] == 2 * n + 1 and F.L.size == n and F.U.size == 0  # x - t <= 0, -x - t <= 0, 1't <= r
    act_A = np.zeros(F.A.shape[0], dtype=bool)
    act_A[[0, n + 0]] = True  # coordinate 0 at the centre: both rows
    act_A[1] = True  # coordinate 1: x_1 = t_1
    act_A[2 * n] = True  # the ball's sum row
    at_L = np.zeros(n, dtype=bool)
    at_L[0] = True  # t_0 >= 0
    gA, gU, gL = ipm._degenerate(act_A, np.zeros(0, dtype=bool), at_L)
    assert gA[0] and gA[n] and gL[0]
    assert not gA[1] and not gA[2 * n]
    assert gA.sum() == 2 and gL.sum() == 1 and gU.size == 0
    # with t_0's bound inactive coordinate 0 has two constraints on two variables: not degenerate
    gA, _, gL = ipm._degenerate(act_A, np.zeros(0, dtype=bool), np.zeros(n, dtype=bool))
    assert not gA.any() and not gL.any()


@pytest.mark.parametrize("seed", [1, 2])
def test_crossover_certifies_a_degenerate_face(seed: int) -> None:
    """The L1 ball with sign consensus: many coordinates end at the ball's centre, where the
    face's multipliers are not unique and some come out with the wrong sign. The crossover
    offers that feasible face minimiser to the certificate instead of dropping those
    constraints (before, the corrections wandered off and the interior point ran on); the
    optimum is Clarabel's."""
    inst = draw("sign", seed, 96)
    K, r = inst.problem.shape
    cset = L1Ball(r / 4) & inst.constraints.members()[1]
    sol = solve(inst.problem, cset, solver="dense_ipm", rel_tol=1e-9)
    ref = solve(inst.problem, cset, solver="clarabel", rel_tol=1e-9)
    assert sol.info["crossover"] == ["certified (degenerate face)"]
    assert sol.certificate.certified(1e-9)
    assert sol.objective <= ref.objective + 1e-9 * abs(ref.objective)


def test_float32_normal_matrix_is_factorised_scaled_to_a_unit_diagonal() -> None:
    """Weights of nearly active constraints spread over 18 decades: unscaled, the float32
    factor's smallest pivot is below the float32 test (the factorisation went to float64); scaled
    to a unit diagonal it passes, solves ``M y = r`` to ~1e-3, and one refinement step against
    the float64 M (``factorise``) brings that far lower."""
    import scipy.linalg as sla

    from mergeqp.solvers.dense_ipm import _Ipm

    inst = draw("sign", 0, 96)
    ipm = _Ipm(inst.problem, inst.constraints, dict(DenseIpmSolver.defaults))
    rng = np.random.default_rng(0)
    w = 10.0 ** rng.uniform(-6, 12, ipm.F.m)
    M = ipm.normal_matrix(w, np.float64)
    top = max(float(np.max(np.diag(M))), ipm.eta)
    unscaled = sla.cho_factor(M.astype(np.float32), check_finite=False)[0]
    assert float(np.min(np.abs(np.diag(unscaled)))) ** 2 <= 1e-6 * top  # the old test sent it to float64
    r = rng.standard_normal(ipm.F.N)
    exact = np.linalg.solve(M, r)
    solve = ipm._cholesky(w, np.float32)
    assert solve is not None
    first = np.linalg.norm(solve(r) - exact) / np.linalg.norm(exact)
    assert first < 1e-2
    refined = ipm.factorise(w, low=True)
    assert ipm.factorisations == {"float32": 1, "float64": 0}
    assert np.linalg.norm(refined(r) - exact) / np.linalg.norm(exact) < 0.1 * first


def test_nullspace_face_solve_matches_the_kkt_system() -> None:
    """The null-space face solve (rows in small groups of variables: per-atom rows) against the
    dense KKT system: the same minimiser, rows met, stationarity ``H x + c + A' nu = 0`` with its
    multipliers, for groups of several shapes, a dependent row (the minimum-norm multipliers
    then), variables on no row; and ``None`` where it does not apply: a row on too many
    variables, rows that cannot all be met, H singular on the face."""
    from mergeqp.solvers import dense_ipm
    from mergeqp.solvers.dense_ipm import _nullspace_face

    rng = np.random.default_rng(7)
    n = 60
    B = rng.standard_normal((n, n))
    H = B @ B.T + 0.1 * np.eye(n)
    c = rng.standard_normal(n)
    rows, cols, vals = [], [], []
    r = 0
    for start, width, count in ((0, 4, 2), (4, 3, 1), (7, 5, 3), (12, 4, 2), (30, 2, 1)):
        for _ in range(count):  # `count` rows on variables start .. start + width - 1
            rows += [r] * width
            cols += list(range(start, start + width))
            vals += list(rng.standard_normal(width))
            r += 1
    A = sp.csr_matrix((vals, (rows, cols)), shape=(r, n))
    A_dep = sp.vstack([A, 2.0 * A[0]]).tocsr()  # a dependent copy of row 0
    b = rng.standard_normal(r)
    b_dep = np.concatenate([b, [2.0 * b[0]]])
    for Am, bm in ((A, b), (A_dep, b_dep)):
        out = _nullspace_face(H, c, Am, bm, float(np.max(np.diag(H))))
        assert out is not None
        x, nu, rho = out
        assert rho == 0.0
        Ad = Am.toarray()
        K = np.block([[H, Ad.T], [Ad, np.zeros((Ad.shape[0],) * 2)]])
        ref = np.linalg.lstsq(K, np.concatenate([-c, bm]), rcond=None)[0][:n]
        np.testing.assert_allclose(x, ref, rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(Ad @ x, bm, atol=1e-10)
        np.testing.assert_allclose(H @ x + c + Ad.T @ nu, 0.0, atol=1e-9 * np.max(np.abs(c)))
    np.testing.assert_allclose(2.0 * nu[0], nu[-1])  # least norm: nu_0 a + nu_d 2a, nu_d = 2 nu_0
    N = dense_ipm.ELIMINATE_MAX_SUPPORT + 1  # a row on more variables than a group may have
    assert _nullspace_face(np.eye(N), np.ones(N), sp.csr_matrix(np.ones((1, N))), np.ones(1), 1.0) is None
    clash = sp.vstack([A, A[0]]).tocsr()
    assert _nullspace_face(H, c, clash, np.concatenate([b, [b[0] + 1.0]]), 1.0) is None  # rows disagree
    flat = np.zeros((n, n))
    flat[:4, :4] = np.eye(4)  # H zero on most free directions: the face minimiser nearest x_ref
    x_ref = rng.standard_normal(n)
    out = _nullspace_face(flat, np.zeros(n), A, b, 1.0, x_ref)
    assert out is not None and out[2] == dense_ipm.FACE_PROX
    np.testing.assert_allclose(A @ out[0], b, atol=1e-10)
    far = out[0][40:]  # variables on no row where H is zero: they stay at x_ref
    np.testing.assert_allclose(far, x_ref[40:], atol=1e-8)


def test_a_badly_scaled_objective_is_solved_as_J_over_its_scale(monkeypatch) -> None:
    """g of 1e14 against an H of order 10: without scaling the iterates never became feasible on
    box & sign; scaled to a unit scale it and an L1 ball certify."""
    from mergeqp.solvers import dense_ipm

    rng = np.random.default_rng(0)
    A = rng.standard_normal((40, 60))
    g = 1e14 * rng.standard_normal(60)
    problem = MergeQP(A.T @ A, g, 1.0, shape=(2, 30))
    sets = [L1Ball(1.0), Box(0.0, 1.0) & SignConsensus.from_deltas(np.abs(rng.standard_normal((2, 30, 3))), "rows")]
    for cset in sets:  # certified by the float64 certificate of the unscaled problem
        sol = solve(problem, cset, solver="dense_ipm")
        assert sol.certificate.certified()
        assert sol.info["objective_scaled_by"] == pytest.approx(1.0 / np.max(np.abs(g)))
    assert solve(problem, sets[0], solver="dense_ipm").objective == pytest.approx(
        solve(problem, sets[0], solver="active_set").objective, rel=1e-9)
    monkeypatch.setattr(dense_ipm, "OBJECTIVE_SCALE_BAND", (0.0, np.inf))  # the iteration as it was
    with pytest.raises(SolverError, match=r"badly scaled problem \(max \|g\| [0-9.]+e\+14"):
        solve(problem, sets[1], solver="dense_ipm")
    # inside the band nothing is scaled
    assert "objective_scaled_by" not in solve(MergeQP(A.T @ A, rng.standard_normal(60), 1.0, shape=(2, 30)),
                                              sets[0], solver="dense_ipm").info


@pytest.mark.parametrize("solver", ["dense_ipm", "torch_ipm"])
@pytest.mark.parametrize("spec", ["box:0,1", "nonneg", "box:0,1 & sign"])
def test_an_optimum_at_zero_with_j_star_zero_is_found(solver: str, spec: str) -> None:
    """J* = 0 at d = 0 with c = 0 (a reviewer's H = 2 I, g > 0): J and its terms vanish along the
    iterates, and the stopping rule's relative gap grew as they converged, so the start became the
    best iterate: "no feasible point" on box:0,1 (a set that is not empty), d = 1 on nonneg. Now the
    gap's scale has a floor from the problem's size and the iterates reach d = 0 (to float64)."""
    import mergeqp as mq

    for n in (1, 3):
        p = mq.MergeQP(2.0 * np.eye(n), np.ones(n), c=0.0, shape=(1, n))
        # sign consensus: the merged update of two parameters per coordinate may not point down
        cset = (Box(0.0, 1.0) & SignConsensus(np.vstack([np.eye(n), 0.5 * np.eye(n)]), (1, n))
                if spec.endswith("sign") else spec)
        sol = mq.solve(p, cset, solver=solver)
        assert float(np.max(np.abs(sol.d))) <= 1e-8 and sol.objective <= 1e-12, (n, sol.d)
        assert sol.certificate.feasible


def test_a_small_scale_is_raised_to_one_so_the_iteration_does_not_depend_on_it() -> None:
    """(stop 51 review) below scale 1 the unit start was far from the multipliers: a simplex & sign QP
    times 1e-6 took 16 iterations where it took 9 (and its crossover failed twice). Every scale below 1
    is now solved as J / scale: the same iterations at 1e-3 and 1e-6, and the same minimiser."""
    from mergeqp.solvers.instance_families import draw

    base = draw("box_singular", 0, 256).problem
    K, r = base.shape
    cset = Simplex(1.0) & SignConsensus.from_deltas(np.random.default_rng([K, r, 7]).standard_normal((K, r, 4)), "rows")
    sols = {f: solve(MergeQP(base.H * f, base.g * f, base.c * f, shape=base.shape), cset, solver="dense_ipm")
            for f in (1e-3, 1e-6)}
    assert all(s.certificate.certified(1e-8) for s in sols.values())
    assert sols[1e-3].iterations == sols[1e-6].iterations
    assert sols[1e-3].info["objective_scaled_by"] == pytest.approx(1e3 * sols[1e-6].info["objective_scaled_by"] / 1e6)
    np.testing.assert_allclose(sols[1e-3].d, sols[1e-6].d, atol=1e-7)


@pytest.mark.parametrize("solver", ["dense_ipm", "torch_ipm"])
@pytest.mark.parametrize("with_sign", [False, True])
def test_a_set_of_one_point_returns_it(solver: str, with_sign: bool) -> None:
    """A box with ``lo == hi`` everywhere is one point: the interior point had no interior to run in
    and, on H with a zero row at a small scale, ended "no feasible point" (a review's find, stop 67);
    now the point is returned without an iteration, certified as Clarabel certifies it."""
    H = np.diag([0.0, 3e-5])
    g = np.array([-1e-3, -6e-3])
    problem = MergeQP(H, g, 0.0, shape=(1, 2))
    point = np.array([[0.3, 0.2]])
    cset = Box(point, point)
    if with_sign:
        cset = cset & SignConsensus(np.array([[1.0, -1.0]]), (1, 2))  # d0 >= d1 holds at the point
    sol = solve(problem, cset, solver=solver)
    assert sol.status == SolveStatus.OPTIMAL and sol.info["ipm_iterations"] == 0
    np.testing.assert_array_equal(sol.d, point)
    assert sol.certificate.certified()
    assert sol.objective == pytest.approx(solve(problem, cset, solver="clarabel").objective, rel=1e-9)
