"""Bad input to the solvers, and the ``auto`` dispatch."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from mergeqp.constraints import Box, L1Ball, SignConsensus, Simplex, UserConstraints
from mergeqp.errors import (
    InfeasibleError,
    SolverError,
    UnboundedError,
    UnknownNameError,
    UnsupportedError,
    ValidationError,
)
from mergeqp.problem import MergeQP
from mergeqp.solution import SolveStatus
from mergeqp.solvers.base import RawResult
from mergeqp.solvers.registry import SOLVERS, choose_solver, solve


@pytest.fixture()
def problem(random_psd_problem) -> MergeQP:
    return random_psd_problem(np.random.default_rng(0), 3, 4, 12)


def matvec_only(p: MergeQP) -> MergeQP:
    H = np.array(p.H)
    return MergeQP(None, p.g, p.c, shape=p.shape, hessian_matvec=lambda x: H @ x)


def test_unknown_solver_lists_valid_names(problem: MergeQP) -> None:
    with pytest.raises(UnknownNameError) as info:
        solve(problem, Box(0, 1), solver="gurobi")
    msg = str(info.value)
    assert "gurobi" in msg
    for name in ("auto", "active_set", "clarabel", "osqp", "cvxpy_clarabel", "torch_fista", "torch_adam"):
        assert name in msg


@pytest.mark.parametrize("solver", list(SOLVERS))
def test_unknown_option_lists_valid_options(problem: MergeQP, solver: str) -> None:
    cset = None if solver == "closed_form" else Box(0, 1)
    with pytest.raises(ValidationError, match="unrecognised solver option.*bogus") as info:
        solve(problem, cset, solver=solver, bogus=1)
    for opt in SOLVERS[solver].defaults:
        assert opt in str(info.value)


@pytest.mark.parametrize("solver", ["auto", "active_set", "clarabel", "osqp", "cvxpy_osqp", "torch_fista", "torch_adam"])
def test_infeasible_sets_raise(problem: MergeQP, solver: str) -> None:
    with pytest.raises(InfeasibleError, match="empty|infeasible"):
        solve(problem, [Box(0.0, 0.1), Simplex()], solver=solver)
    with pytest.raises(InfeasibleError):
        solve(problem, Box(1.0, 0.0), solver=solver)


def test_unsupported_sets_give_clear_errors(problem: MergeQP) -> None:
    user = UserConstraints(lambda v: [v >= 0, v <= 1], label="my-box")
    with pytest.raises(UnsupportedError, match="active_set.*user|my-box"):
        solve(problem, user, solver="active_set")
    with pytest.raises(UnsupportedError, match="projection"):
        solve(problem, user, solver="torch_fista")
    with pytest.raises(UnsupportedError, match="not polyhedral"):
        solve(problem, user, solver="clarabel")
    with pytest.raises(UnsupportedError, match="unconstrained"):
        solve(problem, Box(0, 1), solver="closed_form")
    with pytest.raises(UnsupportedError, match="explicit H"):
        solve(matvec_only(problem), Box(0, 1), solver="active_set")
    with pytest.raises(UnsupportedError, match="explicit H"):
        solve(matvec_only(problem), Box(0, 1), solver="cvxpy_clarabel")


def test_bad_torch_options(problem: MergeQP) -> None:
    with pytest.raises(ValidationError, match="dtype"):
        solve(problem, Box(0, 1), solver="torch_fista", dtype="float16")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ValidationError, match="CUDA is not available"):
            solve(problem, Box(0, 1), solver="torch_fista", device="cuda")
    with pytest.raises(ValidationError, match="init"):
        solve(problem, Box(0, 1), solver="torch_adam", init="random")
    with pytest.raises(ValidationError, match="lr"):
        solve(problem, Box(0, 1), solver="torch_adam", lr=-1.0)


def test_auto_dispatch(problem: MergeQP) -> None:
    from mergeqp.constraints import as_constraint_set

    assert choose_solver(problem, as_constraint_set(None)).name == "closed_form"
    for cset in (Box(0, 1), Simplex(), L1Ball(2.0), Box(0, 1) & Simplex()):
        assert choose_solver(problem, cset).name == "active_set"
    assert choose_solver(matvec_only(problem), Box(0, 1)).name == "torch_fista"
    G = sp.random(20, problem.n, density=0.3, random_state=1)
    sign = SignConsensus(G, problem.shape)
    assert choose_solver(problem, Box(0, 1) & sign).name == "clarabel"  # small: dense_ipm from n = 128
    user = UserConstraints(lambda v: v <= 1)
    assert choose_solver(problem, Box(0, 1) & user).name == "cvxpy_clarabel"
    with pytest.raises(UnsupportedError, match="no registered solver"):
        choose_solver(matvec_only(problem), user)


def test_auto_size_threshold_declines_active_set(problem: MergeQP, monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond ``auto_max_n`` active_set is kept while its work arrays (2 H) fit in the memory
    available, and passed over for torch_fista when they do not or the memory is unknown."""
    from mergeqp.solvers import base as solver_base

    monkeypatch.setattr(type(SOLVERS["active_set"]), "auto_max_n", 5)
    need = 2 * 8 * problem.n ** 2
    monkeypatch.setattr(solver_base, "available_memory_bytes", lambda: need + 1)
    assert choose_solver(problem, Box(0, 1)).name == "active_set"
    monkeypatch.setattr(solver_base, "available_memory_bytes", lambda: need - 1)
    assert choose_solver(problem, Box(0, 1)).name == "torch_fista"
    why = SOLVERS["active_set"].auto_declines(problem, Box(0, 1))
    assert "work arrays need up to" in why and "torch_fista" in why
    monkeypatch.setattr(solver_base, "available_memory_bytes", lambda: None)
    assert "available: unknown" in SOLVERS["active_set"].auto_declines(problem, Box(0, 1))


def test_sign_consensus_and_user_constraints_agree_across_solvers(problem: MergeQP) -> None:
    rng = np.random.default_rng(3)
    deltas = rng.standard_normal((3, 4, 5))
    sign = SignConsensus.from_deltas(deltas, "rows")
    cset = Box(0, 1) & sign
    objs = [solve(problem, cset, solver=s).objective for s in ("clarabel", "osqp", "cvxpy_clarabel", "cvxpy_osqp")]
    assert max(objs) - min(objs) <= 1e-6 * max(1.0, abs(min(objs)))
    user = Box(0, 1) & UserConstraints(lambda v: [v[0, :] + v[1, :] <= 1.2])
    a = solve(problem, user, solver="cvxpy_clarabel")
    b = solve(problem, user, solver="cvxpy_osqp")
    assert abs(a.objective - b.objective) <= 1e-6 * max(1.0, abs(a.objective))
    assert np.all(a.d[0] + a.d[1] <= 1.2 + 1e-7)


# ---------------------------------------------------------------------- auto's fallback
def _broken_active_set(monkeypatch, mode: str) -> None:
    """Make the registered active_set return the soup (not optimal) or raise."""
    from mergeqp.solution import SolveStatus
    from mergeqp.solvers.base import RawResult

    def fake(problem, constraints, x0=None, **options):
        if mode == "raise":
            raise SolverError("solver 'active_set' failed: injected")
        K, m = problem.shape
        return RawResult(np.full((K, m), 1.0 / K), SolveStatus.INACCURATE, 1, {"injected": True})

    monkeypatch.setattr(SOLVERS["active_set"], "solve", fake)


@pytest.mark.parametrize("mode", ["wrong point", "raise"])
def test_auto_falls_back_when_its_choice_does_not_certify(random_psd_problem, monkeypatch, mode: str) -> None:
    problem = random_psd_problem(np.random.default_rng(0), 3, 6, 18)
    reference = solve(problem, Box(0.0, 1.0), solver="clarabel")
    _broken_active_set(monkeypatch, mode)
    sol = solve(problem, Box(0.0, 1.0))
    assert sol.solver == "clarabel" and sol.certificate.certified()
    assert sol.objective == pytest.approx(reference.objective, rel=1e-9)
    tried = sol.info["auto_tried"]
    assert [t["solver"] for t in tried] == ["active_set", "clarabel"]
    assert ("error" in tried[0]) == (mode == "raise")
    assert any("auto: active_set" in n and "kept clarabel" in n for n in sol.certificate.notes)
    # an explicit solver, or options meant for auto's choice, get no fallback
    if mode == "raise":
        with pytest.raises(SolverError, match="injected"):
            solve(problem, Box(0.0, 1.0), solver="active_set")
    else:
        assert not solve(problem, Box(0.0, 1.0), solver="active_set").certificate.certified()
        assert solve(problem, Box(0.0, 1.0), tol=1e-10).solver == "active_set"


def test_auto_keeps_a_point_at_the_rounding_floor_without_fallback(monkeypatch) -> None:
    """J* = 0 on a badly scaled problem: the float64 gap cannot reach rel_tol * scale; the
    certificate says the point is at the rounding floor and auto (above its floor-fallback size,
    lowered here to below this n = 24) does not try other solvers."""
    from mergeqp.solvers import base

    monkeypatch.setattr(base, "AUTO_FLOOR_FALLBACK_MAX_N", 16)
    rng = np.random.default_rng(1)
    K, m = 2, 12
    A = rng.standard_normal((6, K * m)) * 1e3
    x_star = rng.uniform(0.2, 0.8, K * m)  # inside the box: J* = 0 there
    b = -A @ x_star
    problem = MergeQP(2 * A.T @ A, 2 * A.T @ b, float(b @ b), shape=(K, m))
    sol = solve(problem, Box(0.0, 1.0))
    cert = sol.certificate
    assert abs(sol.objective) <= 1e-6
    assert cert.certified() or cert.at_rounding_floor, cert.explain()
    assert "auto_tried" not in sol.info
    wrong = np.clip(sol.d + 0.05, 0.0, 1.0)
    from mergeqp.certificate import certify

    bad = certify(problem, Box(0.0, 1.0), wrong)
    assert not bad.certified() and not bad.at_rounding_floor
    assert not any("rounding floor" in r for r in bad.reasons())


def _interpolating(seed: int, K: int = 3, m: int = 5, rank: int = 6) -> MergeQP:
    """J = |A d - b|^2 with fewer rows than unknowns: J* ~ 0 on sets that hold a solution of A d = b."""
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((rank, K * m))
    b = rng.standard_normal(rank)
    return MergeQP(2 * A.T @ A, 2 * A.T @ b, c=float(b @ b), shape=(K, m))


@pytest.mark.parametrize(("seed", "spec"), [(2, "nonneg"), (64, "box:-1,2"), (65, "box:-1,inf")])
def test_auto_tries_its_fallbacks_after_a_floor_point_on_a_small_problem(seed, spec) -> None:
    """A review's reproducers (stop 74): on small interpolating QPs ``active_set`` stopped at its
    rounding floor uncertified and ``auto`` kept that point (``mergeqp solve`` exit 1), though
    ``dense_ipm``'s point certifies; up to ``AUTO_FLOOR_FALLBACK_MAX_N`` the fallbacks are tried."""
    problem = _interpolating(seed)
    first = solve(problem, spec, solver="active_set")
    assert not first.certified and first.certificate.at_rounding_floor  # (what auto starts from)
    sol = solve(problem, spec)
    assert sol.certified, sol.certificate.explain()
    assert sol.info["auto_tried"][0]["solver"] == "active_set"
    assert abs(sol.objective) <= 1e-9


def test_auto_prefers_a_certified_fallback_to_a_smaller_gap_at_the_floor() -> None:
    """Among the points it tried, ``auto`` kept the smallest gap among those "settled", and a point at
    the rounding floor (not certified) counted as settled: Clarabel's uncertified point (gap 2.7e-21)
    was kept over OSQP's certified one (2.3e-19) on an interpolating QP (stop 74; here n = 48)."""
    problem = _interpolating(14, K=3, m=16, rank=2)
    sol = solve(problem, "box:-1,inf")
    tried = sol.info["auto_tried"]
    certified = [t for t in tried if t.get("certified")]
    assert certified, tried  # (some fallback certifies here)
    assert sol.certified and sol.solver in {t["solver"] for t in certified}
    # the case the rule is for: an uncertified point with a smaller gap than the kept one was tried
    assert any(not t.get("certified") and t.get("fw_gap", np.inf) < sol.certificate.fw_gap for t in tried)


def test_auto_ranks_its_points_at_abs_tol_too() -> None:
    """A review of stop 74: the ranking (and `auto_tried`'s flags) looked at rel_tol only, so with
    `abs_tol` a point certified at it lost to an uncertified smaller gap."""
    import dataclasses

    from mergeqp.solvers.registry import _rank

    problem = _interpolating(1)
    sol = solve(problem, "nonneg", solver="dense_ipm")
    scale = sol.certificate.scale
    near = dataclasses.replace(sol, certificate=dataclasses.replace(sol.certificate, fw_gap=1e-3 * scale))
    far = dataclasses.replace(sol, certificate=dataclasses.replace(sol.certificate, fw_gap=1e-2 * scale))
    assert _rank(near, 1e-6) < _rank(far, 1e-6)  # (neither certifies at rel_tol: the smaller gap first)
    certified_far = dataclasses.replace(far, certificate=dataclasses.replace(far.certificate, fw_gap=2e-2 * scale))
    uncertified_near = dataclasses.replace(near, certificate=dataclasses.replace(near.certificate, rounding=1e3 * scale))
    abs_tol = 0.05 * scale
    assert certified_far.certificate.certified(1e-6, abs_tol)
    assert not uncertified_near.certificate.certified(1e-6, abs_tol)  # (its rounding is beyond float64)
    assert _rank(certified_far, 1e-6, abs_tol) < _rank(uncertified_near, 1e-6, abs_tol)


# ---------------------------------------------------------------------- unbounded problems
@pytest.mark.parametrize("H", [np.zeros((4, 4)), np.diag([1.0, 1.0, 0.0, 0.0])], ids=["zero H", "singular H"])
@pytest.mark.parametrize("solver", ["active_set", "clarabel", "osqp", "torch_fista", "auto"])
def test_unbounded_below_on_an_unbounded_box_is_an_unbounded_error(H, solver, monkeypatch) -> None:
    """J = -sum d (+ 1/2 |d_0|^2) over d >= 0 has no minimum: every exact solver says so with
    UnboundedError; auto does not try other solvers after such a proof."""
    from mergeqp.errors import UnboundedError

    problem = MergeQP(H, -np.ones(4), shape=(2, 2))
    if solver == "auto":
        def never(*args, **kwargs):
            raise AssertionError("auto must not fall back after a proof of unboundedness")

        monkeypatch.setattr(SOLVERS["clarabel"], "solve", never)
        monkeypatch.setattr(SOLVERS["osqp"], "solve", never)
    with pytest.raises(UnboundedError, match="unbounded below on nonneg"):
        solve(problem, "nonneg", solver=solver)


def test_a_far_but_finite_optimum_is_not_called_unbounded() -> None:
    """H = diag(1, 1e-12), g = (0, -1) on d >= 0: the optimum d = (0, 1e12) is far away but
    finite (the ray's minimiser), so active_set returns it."""
    problem = MergeQP(np.diag([1.0, 1e-12]), np.array([0.0, -1.0]), shape=(1, 2))
    sol = solve(problem, "nonneg", solver="active_set", certify_result=False)
    assert sol.d[0, 1] == pytest.approx(1e12, rel=1e-6) and abs(sol.d[0, 0]) <= 1e-6


def test_torch_fista_does_not_call_a_far_but_finite_optimum_unbounded() -> None:
    """(stop 47: torch_fista tests its diverging iterates for a ray) the same far optimum: its
    iterates run far out along the flat direction, but J has a minimum there, so no UnboundedError."""
    problem = MergeQP(np.diag([1.0, 1e-12]), np.array([0.0, -1.0]), shape=(1, 2))
    sol = solve(problem, "nonneg", solver="torch_fista", max_iter=3000, certify_result=False)
    assert sol.d[0, 1] > 1e3 and sol.status.value == "max_iterations"


def test_badly_conditioned_bounded_problem_is_not_called_unbounded() -> None:
    """H = diag(1e8, 1e-8): the pseudo-inverse's cut drops the small eigenvalue, but J has a
    finite minimum (-0.500000005) along it: closed_form and auto return it, certified."""
    problem = MergeQP(np.diag([1e8, 1e-8]), np.array([1.0, 1e-4]))
    for name in ("closed_form", "auto"):
        sol = solve(problem, None, solver=name)
        assert sol.objective == pytest.approx(-0.500000005, rel=1e-12)
        assert sol.certificate.certified(), sol.certificate.explain()


def test_unboundedness_claims_are_verified() -> None:
    """A sparse solver's 'dual infeasible' status is a proof only when it survives float64
    checks: refuted on a bounded set, on a J bounded below, or along a direction of finite
    descent; confirmed along an exactly flat descent ray."""
    from mergeqp.constraints import Box, Unconstrained
    from mergeqp.errors import SolverError, UnboundedError
    from mergeqp.solvers.unbounded import unbounded_claim

    bounded_below = MergeQP(np.diag([1e8, 1e-8]), np.array([1.0, 1e-4]))
    flat = MergeQP(np.diag([1.0, 0.0]), np.array([0.0, 1.0]))
    err = unbounded_claim(bounded_below, Unconstrained(), "osqp", "dual infeasible")
    assert type(err) is SolverError and "bounded below even without constraints" in str(err)
    err = unbounded_claim(bounded_below, Unconstrained(), "osqp", "dual infeasible", np.array([0.0, -1.0]))
    assert type(err) is SolverError and "not one of unbounded descent" in str(err)
    err = unbounded_claim(flat, Box(-1, 1), "clarabel", "DualInfeasible")
    assert type(err) is SolverError and "is bounded" in str(err)
    assert isinstance(unbounded_claim(flat, Unconstrained(), "cvxpy_osqp", "unbounded"), UnboundedError)
    err = unbounded_claim(flat, Unconstrained(), "osqp", "dual infeasible", np.array([0.0, -3.0]))
    assert isinstance(err, UnboundedError) and "v'Hv = 0" in str(err)


@pytest.mark.parametrize("solver", ["auto", "active_set", "dense_ipm", "osqp", "clarabel", "torch_fista"])
@pytest.mark.parametrize("slope", [-1e-10, -1e-14])
def test_an_unbounded_problem_no_solver_reports_is_still_an_unbounded_error(solver, slope) -> None:
    """J = 1 + d0^2/2 + slope d1 on d >= 0 falls without bound along d1 (H's second row and column
    are zero). Before stop 55 no solver proved it: active_set stopped at d1 ~ 5e4 (status
    max_iterations or even optimal), clarabel's own ray was refuted, and solve() returned the
    uncertified point; now a ray found from H and g settles it (exactly flat, in the set)."""
    from mergeqp.errors import UnboundedError

    problem = MergeQP(np.diag([1.0, 0.0]), np.array([0.0, slope]), c=1.0)
    with pytest.raises(UnboundedError, match="unbounded below on nonneg"):
        solve(problem, "nonneg", solver=solver)


@pytest.mark.parametrize("solver", ["auto", "active_set", "dense_ipm", "clarabel"])
def test_an_unbounded_ray_inside_the_cone_but_not_along_g_is_found(solver) -> None:
    """(adversarial review of stop 55) H's kernel is spanned by k1 = (1, 1, 0, 0) and k2 = (0, 0, 1, -1)
    (exactly), g = (-1, -1, 5, -5): the part of -g in the kernel, (1, 1, -5, 5), leaves nonneg, and put
    into the cone, (1, 1, 0, 5), leaves the kernel; but J falls along k1 (g'k1 = -2) inside nonneg. The
    steepest descent inside kernel and cone (an LP over the kernel's coordinates) finds it."""
    from mergeqp.errors import UnboundedError

    H = np.array([[1.0, -1.0, 0.0, 0.0], [-1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]])
    problem = MergeQP(H, np.array([-1.0, -1.0, 5.0, -5.0]), c=1.0)
    with pytest.raises(UnboundedError, match="unbounded below on nonneg"):
        solve(problem, "nonneg", solver=solver)


@pytest.mark.parametrize("spec, where", [("nonneg", "on nonneg"), (None, "without constraints")])
def test_a_dead_coordinate_with_a_slope_is_unbounded_whatever_the_slope_size(spec, where) -> None:
    """A coefficient whose row and column of H are exactly zero makes J exactly linear along it:
    a slope of 1e-9 of max |g| (below the 1e-8 that a computed null direction needs) is still
    unboundedness, named by its coefficient; before stop 55 auto returned Clarabel's J = -5e12
    (nonneg) or the pseudo-inverse point (no constraints), both uncertified. A bounded set keeps its
    certified optimum."""
    from mergeqp.errors import UnboundedError

    rng = np.random.default_rng(0)
    K, m = 2, 20
    A = rng.standard_normal((3 * K * m, K * m))
    A[:, 7] = 0.0
    b = rng.standard_normal(3 * K * m)
    g = 2 * A.T @ b
    g[7] = -1e-9 * np.max(np.abs(g))
    problem = MergeQP(2 * A.T @ A, g, c=float(b @ b), shape=(K, m))
    with pytest.raises(UnboundedError, match=rf"unbounded below {where}: coefficient \[0, 7\] has no curvature"):
        solve(problem, spec)
    assert solve(problem, "box:0,inf & simplex").certified


def test_a_ray_that_leaves_the_set_by_a_scaled_row_is_not_taken_for_unboundedness() -> None:
    """(adversarial review of stop 55) J = d0^2/2 - d1 with d1 <= d0 written as the row
    1e-6 (-d0 + d1) <= 0 (a user's set), or sign consensus d0 - 1e-6 d1 >= 0: bounded below (J* = -0.5
    and -5e11). The ray e1 leaves the set by 1e-6 per unit, within the tolerance a solver's own
    claim gets; the search's own rays must stay in the set exactly (up to rounding), so dense_ipm's
    refuted claim stays a SolverError that auto falls back from, not an UnboundedError."""
    from mergeqp.constraints import ConstraintSet, LinearForm
    from mergeqp.errors import UnboundedError
    from mergeqp.solvers.unbounded import unbounded_after_solve

    class Scaled(ConstraintSet):
        name = "scaled_row"
        polyhedral = True
        known_nonempty = True

        @property
        def spec(self):
            return "scaled_row"

        def violation(self, d):
            x = np.ravel(d)
            return max(0.0, 1e-6 * (x[1] - x[0]))

        def linear_form(self, shape):
            e = LinearForm.empty(2)
            return LinearForm(2, sp.csr_matrix(np.array([[-1e-6, 1e-6]])), np.zeros(1), e.A_eq, e.b_eq, e.lb, e.ub)

    problem = MergeQP(np.diag([1.0, 0.0]), np.array([0.0, -1.0]), shape=(1, 2))
    for cset in (Scaled(), SignConsensus(np.array([[1.0, -1e-6]]), (1, 2))):
        assert unbounded_after_solve(problem, cset, "x") is None
        try:
            solve(problem, cset, solver="dense_ipm")
        except UnboundedError as exc:  # pragma: no cover - the failure this test guards against
            raise AssertionError(f"{cset.spec}: a bounded problem called unbounded: {exc}") from None
        except SolverError:
            pass
    assert solve(problem, Scaled()).objective == pytest.approx(-0.5, abs=1e-6)


def test_a_slope_below_the_threshold_along_a_computed_null_direction_is_not_called_unbounded() -> None:
    """The documented limit: along a direction that is flat only in float64 (an eigenvector, not a
    zero column), a slope of 1e-9 of |g| may be rounding, so it is not called unbounded: the answer
    comes back uncertified and the certificate says it cannot bound the gap."""
    rng = np.random.default_rng(1)
    Q = np.linalg.qr(rng.standard_normal((6, 6)))[0]
    lam = np.array([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    H = (Q * lam) @ Q.T
    H = 0.5 * (H + H.T)
    g = Q @ np.array([-1e-9, 1.0, -1.0, 0.5, 0.2, 1.0])
    problem = MergeQP(H, g, c=1.0)
    assert np.count_nonzero(np.diag(H) == 0) == 0
    sol = solve(problem, None)
    assert not sol.certified


@pytest.mark.parametrize("options, message", [
    ({"max_iter": "many"}, "'max_iter' must be an integer"),
    ({"max_iter": True}, "'max_iter' must be an integer"),
    ({"eps_abs": "1e-3"}, "'eps_abs' must be a number"),
    ({"polishing": 1}, "'polishing' must be true or false"),
])
def test_solver_option_values_of_the_wrong_kind_are_named(options, message) -> None:
    from mergeqp.errors import ValidationError

    problem = MergeQP(np.eye(4), np.ones(4), shape=(2, 2))
    with pytest.raises(ValidationError, match=message):
        solve(problem, "box:0,1", solver="osqp", **options)


@pytest.mark.parametrize("solver, options", [
    ("clarabel", {"max_iter": -1}), ("clarabel", {"tol_feas": 0.0}), ("clarabel", {"time_limit": -5.0}),
    ("osqp", {"eps_abs": -1e-9}), ("osqp", {"max_iter": 0}), ("cvxpy_clarabel", {"tol_gap_rel": float("nan")}),
])
def test_solver_option_values_out_of_range_are_refused_before_the_library(solver, options) -> None:
    problem = MergeQP(np.eye(4), np.ones(4), shape=(2, 2))
    (key,) = options
    with pytest.raises(ValidationError, match=rf"{solver}: option {key}=.* is out of range: it must be > 0"):
        solve(problem, "box:0,1", solver=solver, **options)
    # inf stays a valid time limit
    inner = MergeQP(np.eye(4), -0.5 * np.ones(4), shape=(2, 2))  # J* = -1/2 at d = 1/2
    assert solve(inner, "box:0,1", solver="clarabel", time_limit=float("inf")).certificate.certified()


@pytest.mark.parametrize("solver, options, message", [
    ("clarabel", {"direct_solve_method": "bogus"}, r"clarabel: option direct_solve_method='bogus' is not one of "
                                                   r"'faer', 'qdldl', 'auto'"),
    ("cvxpy_clarabel", {"direct_solve_method": "cholmod"}, r"is not one of 'faer', 'qdldl', 'auto'"),
    ("osqp", {"scaling": -1}, r"osqp: option scaling=-1 is out of range: it must be >= 0"),
    ("closed_form", {"rcond": "x"}, r"closed_form: option rcond must be a number \(default None\), got 'x'"),
])
def test_library_options_are_checked_before_the_library_sees_them(solver, options, message) -> None:
    """A review's find (stop 67): these reached the library ("bad settings", a SolverError), or
    called a string "out of range"."""
    problem = MergeQP(np.eye(4), -0.5 * np.ones(4), shape=(2, 2))
    with pytest.raises(ValidationError, match=message):
        solve(problem, None if solver == "closed_form" else "box:0,1", solver=solver, **options)
    if solver == "clarabel":  # each listed value works
        for method in ("qdldl", "auto"):
            assert solve(problem, "box:0,1", solver=solver, direct_solve_method=method).certificate.certified()
    if solver == "osqp":
        assert solve(problem, "box:0,1", solver=solver, scaling=0).certificate.certified()


def _claims_empty(monkeypatch, name: str) -> None:
    def fake(problem, constraints, x0=None, **options):
        raise InfeasibleError(f"{name}: the constraint set {constraints.spec} is infeasible (injected)")

    monkeypatch.setattr(SOLVERS[name], "solve", fake)


def test_a_solvers_empty_set_claim_after_a_passed_check_is_its_numerics(problem, monkeypatch) -> None:
    """The set was shown non-empty before the solve: a solver's claim that it is empty is a
    SolverError (auto falls back from it), not an InfeasibleError; without the check it stands."""
    reference = solve(problem, Box(0.0, 1.0), solver="clarabel")
    _claims_empty(monkeypatch, "active_set")
    with pytest.raises(SolverError, match="shown non-empty before the solve.*active_set's numerics"):
        solve(problem, Box(0.0, 1.0), solver="active_set")
    with pytest.raises(InfeasibleError, match="injected"):
        solve(problem, Box(0.0, 1.0), solver="active_set", check_feasibility=False)
    sol = solve(problem, Box(0.0, 1.0))  # auto's first choice claims emptiness: the fallback answers
    assert sol.solver != "active_set" and sol.certificate.certified()
    assert sol.objective == pytest.approx(reference.objective, rel=1e-9)
    assert "infeasible (injected)" in sol.info["auto_tried"][0]["error"]


def test_warm_start_errors_name_the_warm_start(problem) -> None:
    with pytest.raises(ValidationError, match=r"x0 \(the warm start\) must have shape \(3, 4\)"):
        solve(problem, Box(0.0, 1.0), x0=np.zeros((4, 3)))
    with pytest.raises(Exception, match=r"x0 \(the warm start\)"):
        solve(problem, Box(0.0, 1.0), x0=np.full((3, 4), np.nan))


@pytest.mark.parametrize("cset", [Box(0.0, 1.0), "global_simplex"])
def test_osqp_starts_from_the_warm_start_projected_onto_the_set(problem, cset) -> None:
    """(stop 73, a QA review) OSQP warm-started at 1e15 on a box ran all 100,000 iterations and returned
    a point infeasible by 0.1-11; the start is now projected onto the set first."""
    pytest.importorskip("osqp")
    reference = solve(problem, cset, solver="clarabel")
    sol = solve(problem, cset, solver="osqp", x0=np.full(problem.shape, 1e15))
    assert sol.status == SolveStatus.OPTIMAL and sol.certificate.feasible
    assert sol.objective == pytest.approx(reference.objective, rel=1e-6, abs=1e-9)


def test_simplex_sum_mismatch_is_printed_with_enough_digits() -> None:
    with pytest.raises(InfeasibleError, match=r"allows sums in \[1, 1\] but the simplex needs 1.000001"):
        solve(MergeQP(np.eye(4), np.ones(4), shape=(2, 2)), Box(0.5, 0.5) & Simplex(1 + 1e-6))


def test_auto_falls_back_to_dense_ipm_when_clarabel_does_not_certify(monkeypatch) -> None:
    """(stop 47) auto's fallbacks were clarabel and osqp only: where Clarabel was auto's own choice
    (a small polyhedral set) and its point did not certify, only OSQP was left, which is the least
    accurate of the three; dense_ipm now comes between them."""
    from mergeqp.constraints import SignConsensus

    rng = np.random.default_rng(3)
    K, r = 3, 8
    A = rng.standard_normal((60, K * r))
    b = rng.standard_normal(60)
    problem = MergeQP(2 * A.T @ A, 2 * A.T @ b, float(b @ b), shape=(K, r))
    sets = [Box(0.0, 1.0), SignConsensus.from_deltas(rng.standard_normal((K, r, 5)), "rows")]
    reference = solve(problem, sets, solver="dense_ipm")

    def wrong(problem, constraints, x0=None, **options):
        return RawResult(np.full(problem.shape, 1.0 / K), SolveStatus.INACCURATE, 1, {})

    monkeypatch.setattr(SOLVERS["clarabel"], "solve", wrong)
    sol = solve(problem, sets)
    assert [t["solver"] for t in sol.info["auto_tried"]] == ["clarabel", "dense_ipm"]
    assert sol.solver == "dense_ipm" and sol.certificate.certified()
    assert sol.objective == pytest.approx(reference.objective, rel=1e-9)


def test_auto_falls_back_to_dense_ipm_first_from_n_128(random_psd_problem, monkeypatch) -> None:
    """(stop 51) Where auto's choice did not certify a problem of n >= 128, dense_ipm is tried before
    Clarabel (it certified 2-6x faster on the low-rank instances where active_set had stopped early);
    below 128 Clarabel stays first (test_auto_falls_back_when_its_choice_does_not_certify)."""
    problem = random_psd_problem(np.random.default_rng(1), 4, 40, 60)
    assert problem.n >= SOLVERS["dense_ipm"].auto_min_n
    reference = solve(problem, Box(0.0, 1.0), solver="clarabel")
    _broken_active_set(monkeypatch, "wrong point")
    sol = solve(problem, Box(0.0, 1.0))
    assert [t["solver"] for t in sol.info["auto_tried"]] == ["active_set", "dense_ipm"]
    assert sol.solver == "dense_ipm" and sol.certificate.certified()
    assert sol.objective == pytest.approx(reference.objective, rel=1e-9)


def test_above_the_fallback_size_auto_still_tries_dense_ipm(random_psd_problem, monkeypatch) -> None:
    """(stop 54) Above AUTO_FALLBACK_MAX_N (4096) auto returned its choice's uncertified point
    without trying anything (an interpolating box QP at n = 4608 that dense_ipm certifies in 11 s);
    up to AUTO_DENSE_FALLBACK_MAX_N it now tries dense_ipm alone (Clarabel and OSQP are minutes on
    a dense H that large); above that, nothing, as before. The sizes are lowered here."""
    from mergeqp.solvers import base

    problem = random_psd_problem(np.random.default_rng(2), 4, 40, 60)  # n = 160
    reference = solve(problem, Box(0.0, 1.0), solver="clarabel")
    _broken_active_set(monkeypatch, "wrong point")
    monkeypatch.setattr(base, "AUTO_FALLBACK_MAX_N", 100)
    monkeypatch.setattr(base, "AUTO_DENSE_FALLBACK_MAX_N", 200)
    sol = solve(problem, Box(0.0, 1.0))
    assert [t["solver"] for t in sol.info["auto_tried"]] == ["active_set", "dense_ipm"]
    assert sol.solver == "dense_ipm" and sol.certificate.certified()
    assert sol.objective == pytest.approx(reference.objective, rel=1e-9)
    monkeypatch.setattr(base, "AUTO_DENSE_FALLBACK_MAX_N", 150)
    sol = solve(problem, Box(0.0, 1.0))
    assert [t["solver"] for t in sol.info["auto_tried"]] == ["active_set"]
    assert sol.solver == "active_set" and not sol.certificate.certified()


@pytest.mark.parametrize("rank, expected", [
    (0.1, ["active_set", "user_fallback"]),        # before every built-in fallback
    (1.5, ["active_set", "clarabel"]),              # after clarabel, which settles first
    (None, ["active_set", "clarabel"]),             # not a fallback: a last resort, not reached
    ("raises", ["active_set", "clarabel"]),         # a user's auto_fallback that raises: not a fallback
    (10**400, ["active_set", "clarabel"]),          # beyond float's range (it raised OverflowError out of solve)
    (float("nan"), ["active_set", "clarabel"]),     # not a finite number: not a fallback
    (-5, ["active_set", "user_fallback"]),          # any finite number ranks
])
def test_a_users_solver_ranks_itself_among_autos_fallbacks(random_psd_problem, monkeypatch, rank, expected) -> None:
    """``auto``'s fallbacks are the solvers whose ``auto_fallback`` ranks them, not a list of names:
    a user's solver placed at 0.1 is tried first (even though it declines ``auto`` as a first
    choice), at 1.5 after ``clarabel``; without a rank it is a last resort."""
    from mergeqp.solvers import SOLVERS, register_solver
    from mergeqp.solvers.base import QPSolver

    class UserFallback(QPSolver):
        name = "user_fallback"

        def supports(self, problem, constraints):
            return None

        def auto_declines(self, problem, constraints):
            return "only a fallback"

        def auto_fallback(self, problem, constraints):
            if rank == "raises":
                raise RuntimeError("boom")
            return rank

        def solve(self, problem, constraints, x0=None, **options):
            return SOLVERS["clarabel"].solve(problem, constraints, x0)

    problem = random_psd_problem(np.random.default_rng(0), 3, 6, 18)  # n = 18: clarabel ranks before dense_ipm
    _broken_active_set(monkeypatch, "wrong point")
    register_solver(UserFallback())
    try:
        sol = solve(problem, Box(0.0, 1.0))
    finally:
        SOLVERS.pop("user_fallback", None)
    assert [t["solver"] for t in sol.info["auto_tried"]] == expected
    assert sol.solver == expected[-1] and sol.certificate.certified()


@pytest.mark.parametrize("fallbacks_fail", [False, True])
def test_autos_last_resort_is_asked_only_when_no_point_inside_the_set_was_found(
        random_psd_problem, monkeypatch, fallbacks_fail: bool) -> None:
    """(stop 66) ``auto`` asked every registered solver whether it was available before its first
    fallback ran, and CVXPY's check is an import (0.8 s of a 0.35 s fallback to dense_ipm on an
    n = 768 L1 QP, in a fresh process). The last-resort solvers (no rank) are now asked only where
    the ranked fallbacks found no point inside the set; then they run, in registration order."""
    from mergeqp.solvers import register_solver
    from mergeqp.solvers.base import QPSolver
    from mergeqp.solvers.clarabel_solver import ClarabelSolver

    asked: list[str] = []

    class LastResort(QPSolver):
        name = "user_last_resort"

        def available(self):
            asked.append("available")
            return None

        def supports(self, problem, constraints):
            return None

        def solve(self, problem, constraints, x0=None, **options):
            return ClarabelSolver().solve(problem, constraints, x0)  # (the registered one may be broken)

    def raises(problem, constraints, x0=None, **options):
        raise SolverError("injected")

    problem = random_psd_problem(np.random.default_rng(0), 3, 6, 18)
    _broken_active_set(monkeypatch, "raise")
    if fallbacks_fail:  # every registered solver fails
        for solver in SOLVERS.values():
            monkeypatch.setattr(solver, "solve", raises)
    register_solver(LastResort())
    try:
        sol = solve(problem, Box(0.0, 1.0))
    finally:
        SOLVERS.pop("user_last_resort", None)
    tried = [t["solver"] for t in sol.info["auto_tried"]]
    if fallbacks_fail:
        assert asked and tried[-1] == "user_last_resort" and sol.certificate.certified()
        assert {"dense_ipm", "clarabel"} <= set(tried)
    else:
        assert tried == ["active_set", "clarabel"] and asked == []


def test_auto_searches_for_a_ray_once_when_its_first_solvers_claim_was_refuted(monkeypatch) -> None:
    """A solver's unbounded claim that its own ray refutes already ran the search from H and g (an
    eigendecomposition); auto's fallback answer, still without a bound, is not searched again."""
    from mergeqp.solvers import registry, unbounded
    from mergeqp.solvers.unbounded import unbounded_claim

    rng = np.random.default_rng(1)
    Q = np.linalg.qr(rng.standard_normal((6, 6)))[0]
    H = (Q * np.array([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])) @ Q.T
    problem = MergeQP(0.5 * (H + H.T), Q @ np.array([-1e-9, 1.0, -1.0, 0.5, 0.2, 1.0]), c=1.0)
    calls = []
    search = unbounded.unbounded_after_solve

    def counted(*args, **kwargs):
        calls.append(args[2])
        return search(*args, **kwargs)

    def claims(problem, constraints, x0=None, **options):  # a direction along which J rises
        raise unbounded_claim(problem, constraints, "closed_form", "injected", np.ones(problem.n))

    monkeypatch.setattr(unbounded, "unbounded_after_solve", counted)
    monkeypatch.setattr(registry, "unbounded_after_solve", counted)
    monkeypatch.setattr(SOLVERS["closed_form"], "solve", claims)
    sol = solve(problem, None)  # auto picks closed_form here
    assert sol.solver != "closed_form" and not sol.certified  # the fallback's answer has no bound either
    assert len(calls) == 1, calls


@pytest.mark.parametrize("scale", [1.0, 1e200, 1e250, 1e-300])
@pytest.mark.parametrize("solver", ["active_set", "auto"])
def test_an_unbounded_problem_is_called_so_at_any_scale(scale: float, solver: str) -> None:
    """(stop 67 review) At 1e200 the descent ray's tests squared ``g`` (``g'g``, ``(g'v)^2``) and
    overflowed, and ``active_set`` returned OPTIMAL with an uncertified J of -1e213: the norms now
    factor out their largest entry, and the ratio is taken before squaring."""
    rng = np.random.default_rng(0)
    A, g = rng.normal(size=(8, 15)), rng.normal(size=15)
    with np.errstate(over="ignore"):
        problem = MergeQP(A.T @ A * scale, g * scale, 0.0, shape=(3, 5))
        with pytest.raises(UnboundedError, match="unbounded below"):
            solve(problem, None, solver=solver)
