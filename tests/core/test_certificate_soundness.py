"""The certificate's bounds hold where an adversarial review (stop 43) found that they did not:
an H accepted as convex within ``psd_tol`` but indefinite, a gradient component in ``ker(H)``
above rounding on an unbounded set (J unbounded below), an eigenvalue below the pseudo-inverse's
cut of a definite H; and where they must still certify: a slightly inaccurate optimum of a singular
problem on ``nonneg`` (the bound multipliers absorb its kernel component). Each true optimum is
computed independently (closed forms)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mergeqp as mq
from mergeqp.certificate import ACTIVE_BOUND
from mergeqp.errors import ValidationError


def test_an_indefinite_h_within_psd_tol_is_charged_on_bounded_sets_and_never_certified_on_unbounded_ones():
    p = mq.MergeQP(np.diag([1.0, -0.9e-8]), np.array([-1.0, 0.0]), shape=(1, 2))
    assert p.curvature_floor == pytest.approx(-0.9e-8)
    d = np.array([[1.0, 0.0]])  # a saddle point: the gradient is zero there
    true_optimum = -0.5 - 0.5 * 0.9e-8 * 1e8  # d = (1, +-1e4) on the box
    cert = mq.certify(p, "box:-1e4,1e4", d)
    assert cert.fw_gap >= p.objective(d) - true_optimum and cert.lower_bound <= true_optimum
    assert not cert.certified() and any("negative eigenvalue" in n for n in cert.notes)
    for unbounded in ("none", "nonneg"):
        c = mq.certify(p, unbounded, d)
        assert math.isinf(c.fw_gap) and not c.certified()
    # a PSD H (also a singular one) has no floor, and its certificates are unchanged
    assert mq.MergeQP(np.diag([1.0, 0.0]), np.zeros(2), shape=(1, 2)).curvature_floor == 0.0
    assert p.regularised(1e-8).curvature_floor == 0.0


def test_an_indefinite_h_is_charged_over_the_box_of_an_intersection_with_sign_consensus():
    """Sign consensus declares no separable structure, so ``box:0,1 & sign`` had none either and the
    charge for H's negative curvature was infinite: every solver uncertified (a review's find, stop
    67). The intersection lies in the box: the charge is bounded by it, and the bound holds against
    the global minimum over a grid of the set (two coordinates)."""
    H = np.array([[2.0, 0.0], [0.0, -1e-9]])
    g = np.array([-1.0, 0.3])
    p = mq.MergeQP(H, g, shape=(2, 1))
    assert p.curvature_floor < 0
    sign = mq.SignConsensus(np.array([[1.0, -1.0]]), (2, 1))  # d0 >= d1
    cset = mq.Box(0.0, 1.0) & sign
    sol = mq.solve(p, cset, solver="clarabel")
    cert = sol.certificate
    assert math.isfinite(cert.fw_gap) and cert.certified(1e-6)
    assert any("negative eigenvalue" in n and "includes" in n for n in cert.notes)
    t = np.linspace(0.0, 1.0, 401)
    X0, X1 = np.meshgrid(t, t)
    inside = X0 >= X1
    Z = 0.5 * (2.0 * X0 ** 2 - 1e-9 * X1 ** 2) + g[0] * X0 + g[1] * X1
    assert sol.objective - cert.fw_gap <= float(np.min(Z[inside])) + 1e-12
    # a set with no bounded member still has no box: no bound is proven
    unbounded = mq.certify(p, mq.parse_constraints(["nonneg"]) & sign, sol.d)
    assert math.isinf(unbounded.fw_gap)


def test_a_kernel_component_of_the_gradient_above_rounding_is_never_called_round_off():
    """Two identical models: H v = 0 exactly for v = e0 - e1, and g.v = 6e-9 |g|: J falls without
    bound along -v. The old rule dropped components below 1e-8 of the scale and certified."""
    rng = np.random.default_rng(0)
    a = rng.normal(size=(20, 1))
    A = np.hstack([a, a])  # duplicated model
    y = rng.normal(size=20)
    g = -A.T @ y + np.array([3e-9, -3e-9]) * np.linalg.norm(A.T @ y)
    p = mq.MergeQP(A.T @ A, g, c=0.5 * float(y @ y), shape=(2, 1))
    d = np.linalg.lstsq(A.T @ A, -g, rcond=None)[0].reshape(2, 1)
    v = np.array([[1.0], [-1.0]])
    slope = float(g @ v.ravel())
    assert p.objective(d - np.sign(slope) * 1e12 * v) < p.objective(d) - 1.0  # truly unbounded below
    cert = mq.certify(p, "none", d)
    assert not cert.certified() and math.isinf(cert.fw_gap)


def test_an_eigenvalue_below_the_cut_of_a_definite_h_is_not_taken_as_zero():
    n = 10
    H = np.diag([1.0] * (n - 1) + [1e-15])
    g = np.concatenate([-np.ones(n - 1), [-np.sqrt(1e-17)]])
    p = mq.MergeQP(H, g, shape=(1, n))
    d = np.concatenate([np.ones(n - 1), [0.0]]).reshape(1, n)  # optimal but for the last coordinate
    true_gap = 0.5 * 1e-17 / 1e-15  # (g_n)^2 / (2 lambda_n) = 0.005
    for unbounded in ("none", "nonneg"):
        cert = mq.certify(p, unbounded, d)
        assert not cert.certified() or cert.fw_gap >= true_gap


def test_a_slightly_inaccurate_optimum_of_a_singular_problem_on_nonneg_still_certifies():
    """Rank 4 of 6 (H = A'A, g in range(H)), the optimum interior, the point off by ~1e-11 in its
    gradient: the multipliers max(grad, 0) leave a kernel component; moving them absorbs it."""
    rng = np.random.default_rng(1128)
    n, rows = 6, 9
    A = rng.normal(size=(rows, 4)) @ rng.normal(size=(4, n)) / np.sqrt(rows * 4)
    y = A @ (0.3 + rng.normal(size=n)) + 0.1 * rng.normal(size=rows)
    p = mq.MergeQP(A.T @ A, -A.T @ y, c=0.5 * float(y @ y), shape=(2, 3))
    exact = np.linalg.lstsq(A, y, rcond=None)[0]
    # an interior minimiser (the kernel of A shifts it into the positive orthant)
    _, _, Vt = np.linalg.svd(A)
    kernel = Vt[4:].T
    shift = np.linalg.lstsq(kernel, 20.0 - exact, rcond=None)[0]
    d = exact + kernel @ shift
    assert np.all(d > 1.0)
    noisy = d + 1e-11 * rng.normal(size=n)
    cert = mq.certify(p, "nonneg", noisy.reshape(2, 3), feas_tol=1e-8)
    true_gap = p.objective(noisy) - p.objective(d)
    assert cert.certified(), cert.explain()
    assert cert.fw_gap >= true_gap - 1e-12 * abs(p.objective(d))


def test_a_users_set_is_named_as_trusted_and_infinite_tolerances_are_refused():
    class Half(mq.ConstraintSet):
        name = "half_test"

        def violation(self, d):
            return float(max(0.0, -np.min(d), np.max(d) - 0.5))

        def cvxpy(self, var):
            return [var >= 0, var <= 0.5]

    p = mq.MergeQP(np.eye(3), -np.ones(3), shape=(3, 1))
    sol = mq.solve(p, Half())
    assert any("taken on trust from your own set(s) half_test" in n for n in sol.certificate.notes)
    assert not any("taken on trust" in n for n in mq.solve(p, "box:0,0.5").certificate.notes)
    with pytest.raises(ValidationError, match="must be finite"):
        sol.certificate.certified(rel_tol=math.inf)


@pytest.mark.parametrize("unbounded", ["none", "nonneg"])
def test_second_review_slopes_along_tiny_or_zero_curvature_are_refused(unbounded):
    """The re-attack (stop 43): a curvature 1e-30 (below the cut, H definite) with a slope 1.5e-10,
    whose true gap is 1e10; and an exact kernel direction with a slope 1e-5 of a gradient of size
    1e6, let through while a kept eigenvalue just above the cut widened the allowed angle. Only the
    gradient's own rounding is taken as zero now."""
    tiny = mq.MergeQP(np.diag([1.0, 1e-30, 1.0]), np.array([-1e4, -1.5e-10, -1.0]), shape=(1, 3))
    d = np.array([[1e4, 0.0, 1.0]])
    assert not mq.certify(tiny, unbounded, d).certified(1e-6)
    kernel = mq.MergeQP(np.diag([1.0, 1.78e-14, 0.0, 1.0]), np.array([-1e6, 0.0, -1e-5, -1.0]), shape=(1, 4))
    cert = mq.certify(kernel, unbounded, np.array([[1e6, 0.0, 0.0, 1.0]]))
    assert math.isinf(cert.fw_gap) and not cert.certified()


def test_above_the_eigenvalue_size_the_floor_is_bracketed_and_still_a_lower_bound(monkeypatch):
    from mergeqp import problem as problem_module

    monkeypatch.setattr(problem_module, "EIGH_FLOOR_MAX_N", 4)
    rng = np.random.default_rng(5)
    Q, _ = np.linalg.qr(rng.normal(size=(8, 8)))
    w = np.array([-3e-10, 1e-3, 0.1, 0.5, 1.0, 1.0, 2.0, 4.0])
    H = (Q * w) @ Q.T
    floor = mq.MergeQP(0.5 * (H + H.T), np.zeros(8), shape=(2, 4)).curvature_floor
    assert -3e-9 - 1e-15 <= floor <= -3e-10  # a valid floor (below lambda_min) within a factor of 10


def test_third_review_far_points_floor_units_and_saved_tolerance(tmp_path):
    """(1) A far point on an unbounded-below problem: the gradient's rounding grows with |d| and
    excused a slope of any size; the dual's range test is now on g less the multipliers, whose
    rounding does not. (2) A negative eigenvalue between 100 n eps max(diag H) and 100 n eps
    lambda_max was neither charged nor refused. (3) psd_tol survives save_npz / load_npz."""
    for spec, slope in (("none", 1e-3), ("box:0,inf", -1e-3)):  # J falls along the open side
        p = mq.MergeQP(np.diag([1.0, 0.0]), np.array([0.0, slope]), shape=(1, 2))
        cert = mq.certify(p, spec, np.array([[0.0, -np.sign(slope) * 1e12]]))
        assert not cert.certified() and math.isinf(cert.fw_gap)
    n = 200
    e = np.ones(n) / np.sqrt(n)
    u = np.zeros(n)
    u[0], u[1] = 1 / np.sqrt(2), -1 / np.sqrt(2)
    H = 200.0 * np.outer(e, e) - 2e-10 * np.outer(u, u)  # max diag 1, lambda_max 200, lambda_min -2e-10
    q = mq.MergeQP(0.5 * (H + H.T), np.zeros(n), c=1.0, shape=(1, n))
    assert q.curvature_floor <= -2e-10 * (1 - 1e-6)
    x = np.zeros(n)
    x[0], x[1] = 1e4, -1e4
    cert = mq.certify(q, "box:-1e4,1e4", np.zeros((1, n)))
    assert cert.lower_bound <= q.objective(x) and not cert.certified()
    loose = mq.MergeQP(np.diag([1.0, -5e-8]), np.zeros(2), shape=(1, 2), psd_tol=1e-7)
    loose.save_npz(str(tmp_path / "loose.npz"))
    again = mq.MergeQP.load_npz(str(tmp_path / "loose.npz"))
    assert again.psd_tol == 1e-7 and again.curvature_floor == pytest.approx(-5e-8)


def test_fourth_review_far_along_a_tiny_curvature_is_not_certified():
    """(stop 46) H = diag(1, 1e-16), g = 0: J* = 0 at d = 0, and d = (0, 1e10) has J = 5000. The
    eigenvalue 1e-16 is below the pseudo-inverse's cut, whose ``1/2 w'H^+w`` then dropped the
    curvature J(d) holds along it: the point was certified with a lower bound of 5000 on J* = 0,
    and solvers warm-started there (active_set, torch_fista, osqp) returned it as certified."""
    p = mq.MergeQP(np.diag([1.0, 1e-16]), np.zeros(2), shape=(1, 2))
    far = np.array([[0.0, 1e10]])
    cert = mq.certify(p, "none", far)
    assert p.objective(far) == pytest.approx(5000.0)
    assert not cert.certified() and cert.lower_bound <= 0.0 and cert.fw_gap >= 5000.0 * (1 - 1e-12)
    assert any("below its kernel cut" in n for n in cert.notes)
    for solver in ("active_set", "osqp"):
        sol = mq.solve(p, "none", solver=solver, x0=far)
        assert not sol.certificate.certified() or p.objective(sol.d) <= 1e-6, solver
    # the optimum itself still certifies
    assert mq.certify(p, "none", np.zeros((1, 2))).certified()


@given(st.integers(2, 6), st.floats(-20, -12), st.floats(0, 12), st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_a_certified_point_of_an_unconstrained_diagonal_qp_is_within_its_gap(n, log_tiny, log_reach, seed):
    """Diagonal H (exact eigenvalues, J* in closed form), one curvature tiny (1e-20..1e-12 of the
    largest, below the cut), the optimum moved a reach of 1..1e12 along it: whenever the point is
    certified, J(d) - J* is within its gap (to float64 rounding of J)."""
    rng = np.random.default_rng(seed)
    lam = rng.uniform(0.5, 2.0, size=n)
    lam[0] = 10.0 ** log_tiny
    g = rng.normal(size=n)
    g[0] = 0.0
    c = float(rng.normal())
    p = mq.MergeQP(np.diag(lam), g, c=c, shape=(1, n))
    optimum = -g / lam
    j_star = c - 0.5 * float(np.sum(g * g / lam))
    d = optimum.copy()
    d[0] = 10.0 ** log_reach
    cert = mq.certify(p, "none", d.reshape(1, n))
    true_gap = 0.5 * lam[0] * d[0] ** 2  # J(d) - J*, exactly
    assert cert.lower_bound <= j_star + 1e-9 * (1.0 + abs(j_star)) + cert.rounding
    if cert.certified():
        assert true_gap <= cert.allowed_gap() + 1e-9 * (1.0 + abs(j_star))


def test_a_point_whose_objective_overflows_says_so():
    """(stop 46 review) At |d| = 1e155 J(d) overflowed to NaN or inf and the certificate printed
    it as an objective without a word."""
    p = mq.MergeQP(np.eye(3), np.ones(3), shape=(1, 3))
    with np.errstate(all="ignore"):
        cert = mq.certify(p, "none", np.full((1, 3), 1e155))
    assert not cert.certified() and any("J(d) overflows float64 at |d|_inf = 1e+155" in n for n in cert.notes)


@pytest.mark.parametrize("d", [(0.0, 1e200), (1e200, 1e200), (1e155, 0.0)])
def test_a_far_point_is_certified_without_numpys_overflow_warnings(d):
    """(stop 55's review) The overflow is the certificate's own note, not three RuntimeWarnings."""
    p = mq.MergeQP(np.diag([1.0, 0.0]), np.array([0.0, -1.0]), shape=(1, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cert = mq.certify(p, "nonneg", np.array([d]))
    assert not cert.certified() and not math.isfinite(cert.fw_gap)


def test_a_far_point_whose_sums_give_inf_minus_inf_has_an_infinite_gap_and_no_warning():
    """(the adversarial review of stop 56) H = [[1, -1], [-1, 1]] at d = (1e300, 0): inf - inf gave
    numpy's 'invalid value' warnings and a NaN gap."""
    p = mq.MergeQP(np.array([[1.0, -1.0], [-1.0, 1.0]]), np.zeros(2), shape=(1, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cert = mq.certify(p, "nonneg", np.array([[1e300, 0.0]]))
    assert not cert.certified() and cert.fw_gap == math.inf and cert.lower_bound == -math.inf


def test_fifth_review_an_optimum_moved_along_a_duplicated_models_direction_still_certifies():
    """(stop 46) Model 1 duplicates model 0 (rows parametrisation, 4 models x 10 rows): J is the same
    along d[0] += t, d[1] -= t exactly, and the optimum moved along it is optimal. The first kernel
    charge (eigenvalue noise ~eps lambda_max times the reach squared) stopped certifying it at
    |d| ~ 4 (lambda_max 3e8); the charge is now the curvature computed from H, and only where it is
    above its own float64 rounding."""
    rng = np.random.default_rng(1)
    K, m = 4, 10
    X = rng.standard_normal((K, 2 * K * m + 10, m))
    X[1] = X[0]
    A = 1e3 * np.concatenate(list(X), axis=1)
    H = A.T @ A
    y = A @ rng.uniform(0.2, 1, K * m) + rng.standard_normal(A.shape[0])
    p = mq.MergeQP(0.5 * (H + H.T), -A.T @ y, c=0.5 * float(y @ y), shape=(K, m))
    sol = mq.solve(p, "none", rel_tol=1e-12)
    for t in (0.0, 1.0, 3.0, 10.0):
        moved = sol.d.copy()
        moved[0] += t
        moved[1] -= t
        # the same J exactly; its float64 evaluation at |d| ~ 10 with lambda_max 3e8 is off by ~1e-7
        assert p.objective(moved) == pytest.approx(sol.objective, rel=1e-7)
        assert mq.certify(p, "none", moved).certified(1e-8), t


def test_fifth_review_a_gap_below_its_own_rounding_far_out_proves_nothing():
    """(stop 46) H = 2 A'A of rank 2 in 4 unknowns: its two kernel eigenvalues come out as float64
    noise (1e-20 and 1e-13). A point 1e10 along the second had a tiny computed gap and was certified,
    though J(d) there cannot be computed to its own size (the gap's rounding is far above it);
    Clarabel stopped at |d| ~ 1e39 on box:-1,inf and was certified too. Now such a point is not
    certified and proves no lower bound."""
    rng = np.random.default_rng(1)
    A = rng.normal(size=(2, 4))
    p = mq.MergeQP(2.0 * A.T @ A, np.zeros(4), shape=(1, 4))
    w, V = np.linalg.eigh(np.asarray(p.H))
    for t in (1e10, 1e20):
        far = (t * V[:, 1]).reshape(1, 4)
        cert = mq.certify(p, "none", far)
        assert not cert.certified() and cert.lower_bound == -math.inf, t
        assert cert.beyond_float64 and any("float64 rounding" in r for r in cert.reasons()), cert.explain()
    assert mq.certify(p, "none", np.zeros((1, 4))).certified()


def test_fifth_review_a_slope_along_a_cone_is_not_excused_by_the_lp_tolerance():
    """(stop 46) Sign consensus d[0] >= 0 with d[1] free (a cone), g = (1e6, -9e-5): J falls along
    e1 to J* = -39.5 from J(0) = 1. HiGHS, on the cost scaled to max |grad| = 1, left that slope as a
    reduced cost of 9e-11, which the dual bound took for round-off (below 1e-9) and charged at its
    vertex: certified with a lower bound of 1. A reduced cost is now round-off only relative to the
    numbers it is computed from."""
    from mergeqp.constraints import SignConsensus, parse_constraint

    p = mq.MergeQP(np.diag([1.0, 1e-10]), np.array([1e6, -9e-5]), c=1.0, shape=(2, 1))
    cone = SignConsensus(np.array([[1.0, 0.0]]), (2, 1))
    j_star = 1.0 - 9e-5 ** 2 / (2 * 1e-10)
    for cset in (cone, [cone, parse_constraint("nonneg")]):
        cert = mq.certify(p, cset, np.zeros((2, 1)))
        assert not cert.certified(1e-8) and cert.lower_bound <= j_star
    best = np.array([[0.0], [9e-5 / 1e-10]])
    assert p.objective(best) == pytest.approx(j_star)


def test_a_wide_finite_box_around_an_interior_optimum_certifies():
    """(stop 52 review) box:-1e9,1e9 around an interior optimum: the Frank-Wolfe gap charged every
    gradient's rounding times 1e9 and left the optimum uncertified (box:-inf,inf certified it); the
    dual bound with multipliers on the active bounds only certifies it."""
    rng = np.random.default_rng(0)
    A = rng.standard_normal((30, 12))
    b = rng.standard_normal(30)
    p = mq.MergeQP(2 * A.T @ A, -2 * A.T @ b, float(b @ b), shape=(3, 4))
    d = np.linalg.solve(p.H, -p.g).reshape(3, 4)  # interior to every box below
    for spec in ("box:-1e9,1e9", "box:-1e12,1e12", "box:-1e9,5"):
        cert = mq.certify(p, spec, d)
        assert cert.certified(), (spec, cert.explain())
        assert cert.lower_bound <= p.objective(d) + 1e-12
    # one coordinate held on a bound it is pushed against: its multiplier is kept, and the bound is valid
    lo = d.copy().ravel()
    lo[0] += 0.5
    box = mq.constraints.Box(np.where(np.arange(12) == 0, lo, -1e9).reshape(3, 4), 1e9)
    exact = mq.solve(p, box, solver="clarabel")
    cert = mq.certify(p, box, exact.d)
    assert cert.certified() and cert.lower_bound <= exact.objective + 1e-9


@given(st.integers(0, 2**31 - 1), st.floats(3, 12), st.floats(0.0, 1.0))
@settings(max_examples=60, deadline=None)
def test_the_active_bound_dual_never_exceeds_the_optimum_on_a_wide_box(seed, log_width, off):
    """Random points (near, on or off the optimum) of a wide box: the proven lower bound is never above
    the optimum (the lower of two exact solvers' objectives at feasible points: Clarabel fails at these
    widths)."""
    rng = np.random.default_rng(seed)
    n = 8
    A = rng.standard_normal((3 * n, n))
    p = mq.MergeQP(2 * A.T @ A, rng.standard_normal(n) * 5, 1.0, shape=(2, 4))
    w = 10.0 ** log_width
    lo = -w * np.ones(n)
    lo[: n // 2] = rng.uniform(-1, 1, n // 2)  # half the lower bounds near the optimum's scale
    box = mq.constraints.Box(lo.reshape(2, 4), w)
    exact = min((mq.solve(p, box, solver=name) for name in ("active_set", "dense_ipm")), key=lambda sol: sol.objective)
    assert exact.certificate.feasible
    point = np.maximum(exact.d.ravel() + off * rng.standard_normal(n) * (rng.random(n) < 0.5), lo)
    # coordinates on their lower bound lifted within the distance the active-bound dual counts as active
    lifted = np.where(point <= lo, lo + 0.9 * ACTIVE_BOUND * (1 + np.abs(lo)), point)
    for d in (point, lifted):
        cert = mq.certify(p, box, d.reshape(2, 4))
        if cert.feasible and math.isfinite(cert.lower_bound):
            assert cert.lower_bound <= exact.objective + 1e-10 * max(1.0, abs(exact.objective))


@pytest.mark.parametrize("H, g, lo, point, optimum", [
    # a slope of 1e-15 along ker(H) is worth 1 on a box of half-width 1e15
    (np.diag([1.0, 0.0]), [1.0, 1e-15], -1e15, [-1.0, 0.0], 0.0),
    # a large multiplier on an active bound lets a kernel slope of 1e-3 pass as rounding: J* = -999999
    (np.diag([1.0, 1.0, 0.0]), [1e12, -1.0, 1e-3], [0.0, -1e9, -1e9], [0.0, 1.0, 0.0], -999999.0),
], ids=["kernel-slope", "kernel-slope-beside-a-large-multiplier"])
def test_review_the_active_bound_dual_never_excuses_a_kernel_slope(H, g, lo, point, optimum):
    """(stop 52 review, before the change was kept) The active-bound dual on a singular H took a kernel
    slope within its rounding allowance as zero, and certified J = 1 where J* = 0 (and 1 where J* =
    -999999): it leaves out the far bounds, along which that slope is worth slope x width. It is tried
    only for a definite H now; these points are not certified."""
    n = len(g)
    p = mq.MergeQP(H, np.array(g), 1.5 if n == 2 else 0.0, shape=(1, n))
    box = mq.constraints.Box(np.reshape(np.broadcast_to(lo, (n,)), (1, n)), 1e15 if n == 2 else 1e9)
    cert = mq.certify(p, box, np.array([point]))
    assert not cert.certified() and not cert.lower_bound > optimum
    for solver in ("dense_ipm", "clarabel"):
        sol = mq.solve(p, box, solver=solver)
        assert not sol.certificate.certified() or sol.objective <= optimum + 1e-6 * (1 + abs(optimum))


def test_review_a_tolerated_reduced_cost_on_a_simplex_coefficient_is_charged_at_its_implied_bound():
    """(stop 55) min over the simplex of (1, 1 - 1e-10, 2)'z is 1 - 1e-10. HiGHS's vertex e1 with
    y_eq = 1 leaves the reduced cost -1e-10 on z2, which has no upper bound of its own: the bound
    charged it at the vertex (z2 = 0) and stood at 1, above the minimum; a certificate then passed a
    point 1.9e-9 of J above J* at any tolerance. The row sum z1 + z2 + z3 = 1 bounds z2 by 1, where
    the reduced cost is now charged."""
    import scipy.sparse as sp

    from mergeqp.constraints import LinearForm
    from mergeqp.lower_bounds import dual_bound, implied_bounds

    n = 3
    base = LinearForm.empty(n)
    form = LinearForm(n, base.A_ub, base.b_ub, sp.csr_matrix(np.ones((1, n))), np.ones(1), np.zeros(n),
                      np.full(n, np.inf))
    lo, hi = implied_bounds(form)
    assert np.all(lo == 0) and np.allclose(hi, 1.0) and np.all(hi >= 1.0)
    cost = np.array([1.0, 1.0 - 1e-10, 2.0])
    bound = dual_bound(cost, form, np.zeros(0), np.ones(1), np.array([1.0, 0.0, 0.0]))
    assert bound is not None and bound <= 1.0 - 1e-10


@given(st.integers(0, 2**31 - 1))
@settings(max_examples=25, deadline=None)
def test_implied_bounds_hold_at_every_extreme_point_of_the_set(seed):
    """Every bound implied_bounds returns holds over the whole set: each variable's exact range (two
    LPs each, HiGHS) lies inside it, for intersections of box, simplex, L1 ball (auxiliaries) and
    sign consensus, the forms the certificate's LPs use."""
    from scipy.optimize import linprog

    from mergeqp.constraints import L1Ball, SignConsensus, Simplex, parse_constraint
    from mergeqp.constraints.lp import lifted_form
    from mergeqp.lower_bounds import implied_bounds

    rng = np.random.default_rng(seed)
    K, m = int(rng.integers(2, 4)), int(rng.integers(2, 5))
    choices = [Simplex(1.0), L1Ball(float(rng.uniform(0.5, 3.0))), parse_constraint("box:-1,2"),
               SignConsensus.from_deltas(rng.normal(size=(K, m, 3)) + 0.3, "rows")]
    picked = [choices[i] for i in sorted(rng.choice(4, size=int(rng.integers(1, 4)), replace=False))]
    form = lifted_form(picked, (K, m))
    lo, hi = implied_bounds(form)
    bounds = list(zip(form.lb, form.ub))
    for i in range(form.lb.size):
        for sign in (1.0, -1.0):
            c = np.zeros(form.lb.size)
            c[i] = sign
            res = linprog(c, A_ub=form.A_ub, b_ub=form.b_ub, A_eq=form.A_eq if form.A_eq.shape[0] else None,
                          b_eq=form.b_eq if form.A_eq.shape[0] else None, bounds=bounds, method="highs")
            if res.status == 2:  # empty
                return
            if res.status == 3:  # unbounded that way: no finite implied bound may claim otherwise
                assert (hi[i] if sign < 0 else -lo[i]) == np.inf
                continue
            assert res.status == 0
            value = res.x[i]
            assert lo[i] <= value + 1e-9 * (1 + abs(value)) and value <= hi[i] + 1e-9 * (1 + abs(value))


def test_certified_without_its_call_is_the_verdict_not_a_methods_truth():
    """``if cert.certified:`` (as ``solution.certified`` is written) was always true: a bound method."""
    p = mq.MergeQP(np.eye(2), -np.ones(2), shape=(1, 2))
    good = mq.solve(p, "box:0,1").certificate
    bad = mq.certify(p, "box:0,1", np.full((1, 2), 0.5))  # J = -0.75 against J* = -1, gap 0.5
    assert good.certified and good.certified() and good.certified(1e-12) and good.certified == True  # noqa: E712
    assert not bad.certified and not bad.certified() and bad.certified == False  # noqa: E712
    assert bad.certified(abs_tol=1.0)  # within an absolute tolerance of 1
    assert repr(bad.certified) == "False" and {good.certified: 1}[True] == 1
    # (the adversarial review) as a bool would be: counted, compared with 1, written to JSON, pickled
    import json
    import pickle

    assert sum([good.certified, bad.certified, good.certified]) == 2 and good.certified == 1
    assert json.loads(json.dumps({"c": good.certified}))["c"] == 1
    assert pickle.loads(pickle.dumps(good.certified)) is True


def _singular_nonneg(seed: int, n: int = 240, rank: int = 170) -> tuple[mq.MergeQP, np.ndarray]:
    """``H = A'A`` of rank ``rank`` < n, ``g`` from a target partly below 0 (about half the optimum's
    coordinates at the bound 0 of ``nonneg``), and its optimum by ``dense_ipm``, perturbed by ~1e-10 on
    its free coordinates (a solver's point a little off the optimum: the multipliers max(grad, 0) then
    leave a component of ``g`` less them in ``ker(H)`` above rounding)."""
    rng = np.random.default_rng(seed)
    A = rng.normal(size=(rank, n)) / np.sqrt(n)
    t = rng.normal(size=n)
    p = mq.MergeQP(A.T @ A, -(A.T @ (A @ t)), c=0.5 * float(np.sum((A @ t) ** 2)), shape=(4, n // 4))
    d = mq.solve(p, "nonneg", solver="dense_ipm").d.ravel()
    free = d > 0
    noisy = d.copy()
    noisy[free] += 1e-10 * rng.normal(size=int(free.sum()))
    return p, np.maximum(noisy, 0.0).reshape(p.shape)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_kernel_component_is_absorbed_at_the_bounds_without_the_lp(seed, monkeypatch):
    """Stop 72: the multipliers of the bounds the point sits on (free of cost) absorb the kernel component
    by least squares, and those of bounds it is off drop to 0, instead of a dense LP over every bound (15 s
    at n = 1536 on ``nonneg``). Without HiGHS (``linprog`` made to fail) the certificate still certifies,
    its lower bound is below the true optimum (``clarabel``'s) and within 1e-9 of the LP's."""
    import scipy.optimize

    import mergeqp.certificate as certificate

    p, d = _singular_nonneg(seed)
    ref = mq.solve(p, "nonneg", solver="clarabel")
    with monkeypatch.context() as m:  # the LP alone (the certificate before stop 72)
        m.setattr(certificate, "_absorb_at_bounds", lambda *args, **kwargs: None)
        with_lp = mq.certify(p, "nonneg", d)
    assert any("absorb the gradient's component in ker(H)" in n for n in with_lp.notes), with_lp.notes

    def no_lp(*args, **kwargs):
        raise AssertionError("the LP ran")

    monkeypatch.setattr(scipy.optimize, "linprog", no_lp)
    cert = mq.certify(p, "nonneg", d)
    assert cert.certified(1e-8), cert.explain()
    scale = abs(ref.objective) + 1.0
    assert cert.lower_bound <= ref.objective + 1e-12 * scale
    assert cert.lower_bound == pytest.approx(with_lp.lower_bound, abs=1e-9 * scale)


@pytest.mark.parametrize("seed", [2, 3])
def test_a_direct_absorption_that_would_loosen_the_gap_leaves_it_to_the_lp(seed, monkeypatch):
    """Duplicated models (exact kernel directions), ``nonneg``, a planted optimum perturbed by 1e-8 on its
    free coordinates: the least-norm move at the bounds cancels the kernel component but, where the bounds'
    rows of the kernel are ill-conditioned, grows ``1/2 w'H^+w`` far beyond what the LP's move adds (a QA
    review, stop 72: certified at 1e-13 before, 7e-4 with the direct move). What the direct move adds is
    checked against ``DIRECT_ALLOWANCE`` of J's size, and the LP answers instead: certified at 1e-8, as with
    the LP alone; accepting any direct move (an infinite allowance) leaves it uncertified."""
    import mergeqp.certificate as certificate

    rng = np.random.default_rng(seed)
    base, k = 48, 16
    C = rng.normal(size=(base, base)) / np.sqrt(base)
    mp = np.concatenate([np.arange(base), rng.choice(base, k, replace=False)])
    H = (C.T @ C)[np.ix_(mp, mp)].copy()  # k models' coordinates duplicated exactly
    n = base + k
    d = np.where(rng.random(n) < 0.5, 0.0, rng.uniform(0.5, 2.0, n))
    g = -H @ d + np.where(d == 0, rng.uniform(0.1, 1.0, n), 0.0)
    p = mq.MergeQP(H, g, shape=(4, n // 4))
    x = d.copy()
    x[d > 0] += 1e-8 * rng.normal(size=int(np.count_nonzero(d > 0)))
    x = np.maximum(x, 0.0).reshape(p.shape)
    assert p.objective(x) - p.objective(d.reshape(p.shape)) <= 1e-12
    cert = mq.certify(p, "nonneg", x)
    assert cert.certified(1e-8), cert.explain()
    monkeypatch.setattr(certificate, "DIRECT_ALLOWANCE", math.inf)
    assert not mq.certify(p, "nonneg", x).certified(1e-8)


def test_a_point_far_out_is_not_at_the_rounding_floor():
    """``at_rounding_floor`` ("optimal to float64 precision") never holds where that precision is above
    ``HONEST_GAP_FRACTION`` of the problem's natural scale. A QA review (stop 72) found ``active_set``
    ending a planted ``nonneg`` QP with a singular H (rank n / 5, no ridge) at a point 2.6e8 out along a
    direction H barely curves, J = -692 where J* = -759.8: gap 3e-8 against a rounding of 6e8 counted as
    the floor, and ``auto`` returned it without asking its fallbacks. Now the point is neither certified nor
    at the floor, and ``auto`` answers with a certified optimum (the planted J*)."""
    n, r = 384, 76
    rng = np.random.default_rng(7008)
    U = rng.standard_normal((n, r)) * np.exp(-3.0 * np.arange(r) / r)
    H = U @ U.T
    md = float(np.mean(np.diag(H)))
    d = np.where(rng.uniform(size=n) < 0.5, 0.0, rng.uniform(0.1, 1.5, n))
    mu = np.where(d == 0, md * rng.uniform(0.01, 0.5, n), 0.0)
    p = mq.MergeQP(H, -(H @ d) + mu, shape=(4, n // 4))
    J_star = p.objective(d.reshape(p.shape))
    far = mq.solve(p, "nonneg", solver="active_set")
    cert = far.certificate
    assert far.objective > J_star + 1.0 and cert.beyond_float64  # (the engine's point on this draw)
    assert not cert.at_rounding_floor and not cert.certified()
    sol = mq.solve(p, "nonneg")
    assert sol.certificate.certified()
    assert sol.objective == pytest.approx(J_star, rel=1e-8)


def _far_along_a_barely_curved_direction() -> tuple[mq.MergeQP, np.ndarray]:
    """Two duplicated models with a 2e-15 ridge (H definite; the only optimum d* = 1, J* = -10) and a
    point 6e6 out along the models' difference, where J is 0.72% above J* (a QA review, stop 73)."""
    m = 10
    eye = np.eye(m)
    H = np.block([[(1 + 2e-15) * eye, eye], [eye, (1 + 2e-15) * eye]])
    y = np.ones(2 * m)
    p = mq.MergeQP(H, -H @ y, -10.0 + 0.5 * y @ H @ y, shape=(2, m))
    d = np.ones((2, m))
    d[0, 0] += 6e6
    d[1, 0] -= 6e6
    return p, d


@pytest.mark.parametrize("cset", ["none", "box:-inf,inf"])
def test_a_gap_whose_rounding_is_material_does_not_certify(cset):
    """The curvature along the barely curved direction is below its own float64 rounding there, so the
    certificate charges it to ``rounding`` (57% of |J|); the gap came out 1.6e-30 and the point was
    certified at 1e-8 (and ``auto`` warm-started there returned it). A rounding above the allowed gap
    and above ``HONEST_GAP_FRACTION`` of the natural scale now refuses the certificate, the lower bound
    subtracts it, and ``auto`` falls back to a solver that finds d*."""
    p, d = _far_along_a_barely_curved_direction()
    cert = mq.certify(p, cset, d)
    assert cert.fw_gap < 1e-20 and cert.rounding_material and cert.rounding > 1e-8 * cert.scale
    assert not cert.certified(1e-8) and not cert.at_rounding_floor
    assert cert.lower_bound <= -10.0  # J - gap alone, -9.927, was above J*
    assert any("cannot be computed to that precision" in r for r in cert.reasons(1e-8))
    sol = mq.solve(p, cset, x0=d, rel_tol=1e-8)
    assert sol.certificate.certified(1e-8) and sol.objective == pytest.approx(-10.0, rel=1e-9)


def test_an_interpolating_optimum_whose_rounding_exceeds_the_tolerance_still_certifies():
    """The new rule leaves the optimum of an interpolating QP (J* ~ 0: the allowed gap, 1e-8 of a
    tiny J, is below the rounding, which is ~1e-13 of the natural scale) certified, as before."""
    rng = np.random.default_rng(5)
    A = rng.standard_normal((6, 16))
    t = rng.uniform(0.2, 0.8, 16)
    H = 2.0 * A.T @ A
    p = mq.MergeQP(H, -H @ t, float(t @ H @ t) / 2.0, shape=(2, 8))
    cert = mq.certify(p, "box:0,1", t.reshape(2, 8))
    assert cert.rounding > cert.allowed_gap(1e-8) and not cert.rounding_material
    assert cert.certified(1e-8), cert.explain()


def test_an_exactly_dead_coordinate_with_a_tiny_slope_is_unbounded_not_certified():
    """A coefficient whose row and column of H are exactly zero has slope g_i exactly: on ``nonneg``
    with g_i = -1e-14, J falls without bound along it. The kernel test excused the slope as within its
    rounding and every solver's point was certified (a QA review); now the certificate's gap is
    infinite there and ``solve`` reports the problem unbounded."""
    p = mq.MergeQP(np.diag([0.0, 1.0, 2.0, 3.0]), np.array([-1e-14, -1.0, -1.0, -1.0]), 0.0, shape=(1, 4))
    cert = mq.certify(p, "nonneg", np.array([[0.0, 1.0, 0.5, 1 / 3]]))
    assert cert.fw_gap == math.inf and not cert.certified()
    assert any("coefficient [0, 0] has no curvature" in n for n in cert.notes)
    for solver in ("auto", "active_set", "dense_ipm", "clarabel"):
        with pytest.raises(mq.UnboundedError, match=r"coefficient \[0, 0\]"):
            mq.solve(p, "nonneg", solver=solver)
    # a dead coordinate whose slope points at a finite bound is fine (its multiplier absorbs it)
    q = mq.MergeQP(np.diag([0.0, 1.0, 2.0, 3.0]), np.array([1e-14, -1.0, -1.0, -1.0]), 0.0, shape=(1, 4))
    assert mq.solve(q, "nonneg").certificate.certified()


def test_a_far_but_well_computed_optimum_still_certifies():
    """(stop 73, a second review of the rule above) ``problems/mnist_real640`` on ``box:-1e6,1e6``: its
    optimum lies inside (|d| = 170), the gap 0.015 is below the allowed 0.019, and the rounding estimate
    (1.6) is above it but ~1e-4 of |J|: not material, so it certifies as before (the first version of the
    rule, measured against the natural scale, refused it and ``auto`` ended uncertified)."""
    from pathlib import Path

    from mergeqp.problem import load_problem_file

    p, _ = load_problem_file(Path(__file__).resolve().parents[2] / "problems" / "mnist_real640.npz")
    cert = mq.solve(p, "box:-1e6,1e6", solver="active_set").certificate
    assert cert.rounding > cert.allowed_gap(1e-6) and not cert.rounding_material
    assert cert.certified(1e-6)
    assert mq.solve(p, "box:-1e6,1e6").certificate.certified(1e-6)
