"""Constraint sets: projections vs. a CVXPY projection QP, LMOs vs. LPs, violations, linear
forms, intersections, feasibility checks, the registry, sign consensus and user constraints."""

from __future__ import annotations

import cvxpy as cp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog

from mergeqp.constraints import (
    CONSTRAINT_SETS,
    Box,
    GlobalSimplex,
    Intersection,
    L1Ball,
    SignConsensus,
    Simplex,
    Unconstrained,
    UserConstraints,
    as_constraint_set,
    check_feasible,
    parse_constraint,
    parse_constraints,
    register_constraint,
)
from mergeqp.errors import InfeasibleError, UnknownNameError, ValidationError

SHAPE = (3, 4)


def per_entry_box() -> Box:
    lo = np.array([[0.0, -1.0, -np.inf, 0.2]] * 3)
    hi = np.array([[1.0, 0.5, 0.3, np.inf]] * 3)
    return Box(lo, hi)


#: sets with a closed-form projection, each paired with a name for the test id
PROJECTABLE = {
    "box01": lambda: Box(0, 1),
    "box_entries": per_entry_box,
    "nonneg": lambda: Box(0, np.inf),
    "simplex": lambda: Simplex(),
    "simplex2": lambda: Simplex(2.0),
    "global_simplex": lambda: GlobalSimplex(1.5),
    "l1": lambda: L1Ball(1.3),
    "l1_center": lambda: L1Ball(0.7, center=np.linspace(-0.5, 0.5, 12).reshape(SHAPE)),
    "box&simplex": lambda: Box(0, 0.6) & Simplex(),
    "box&simplex_neg": lambda: Box(-1, 0.8) & Simplex(),
    "box&global": lambda: Box(0, 0.3) & GlobalSimplex(2.0),
    "box&l1": lambda: Box(-0.2, 0.9) & L1Ball(1.0, center=0.1),
    "box&box": lambda: Box(0, 1) & Box(-0.5, 0.7),
    "none": lambda: Unconstrained(),
}

#: bounded sets whose LMO is exact in closed form
BOUNDED = {k: v for k, v in PROJECTABLE.items() if k not in ("nonneg", "none", "box_entries")}


# ---------------------------------------------------------------------- projections
@pytest.mark.parametrize("name", sorted(PROJECTABLE))
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 100_000), scale=st.sampled_from([0.1, 1.0, 5.0]))
def test_projection_equals_cvxpy_projection_qp(cvxpy_project, name: str, seed: int, scale: float) -> None:
    cset = PROJECTABLE[name]()
    assert cset.has_projection
    v = scale * np.random.default_rng(seed).normal(size=SHAPE)
    ours = cset.project(v)
    ref = cvxpy_project(cset, v)
    assert cset.violation(ours) <= 1e-10 * max(1.0, np.max(np.abs(ours)))
    # ours is at least as close as the reference (the projection is the unique minimiser), up
    # to the reference's own infeasibility (CVXPY's points violate the set by ~1e-10, which
    # moves the squared distance by about 2 |ref - v| viol)
    viol = cset.violation(ref)
    ref_dist = float(np.linalg.norm(ref - v))
    slack = 2 * ref_dist * viol + viol**2 + 1e-9
    assert np.sum((ours - v) ** 2) <= ref_dist**2 + slack
    # and the reference is as far from ours as its own excess distance allows: ||x - v||^2 is
    # 1-strongly convex, so ||ref - p||^2 <= ||ref - v||^2 - ||p - v||^2 at the projection p (a
    # fixed atol failed on a CLARABEL point 6.5e-6 inside a bound, status optimal_inaccurate)
    assert np.sum((ours - ref) ** 2) <= ref_dist**2 - np.sum((ours - v) ** 2) + slack
    # idempotent
    np.testing.assert_allclose(cset.project(ours), ours, atol=1e-12)


def test_box_l1_with_centre_outside_the_box_has_no_closed_form() -> None:
    cset = Box(0, 1) & L1Ball(1.0, center=-0.5)
    with pytest.raises(NotImplementedError):
        cset.project(np.zeros(SHAPE))


# ---------------------------------------------------------------------- LMO / support
@pytest.mark.parametrize("name", sorted(BOUNDED))
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 100_000))
def test_support_equals_an_lp(cvxpy_lmo, name: str, seed: int) -> None:
    cset = BOUNDED[name]()
    grad = np.random.default_rng(seed).normal(size=SHAPE)
    value, s = cset.support(grad)
    assert s is not None and s.shape == SHAPE
    assert cset.violation(s) <= 1e-12
    assert value == pytest.approx(float(np.sum(grad * s)), rel=1e-12, abs=1e-12)
    ref = cvxpy_lmo(cset, grad)
    assert value == pytest.approx(ref, rel=1e-7, abs=1e-7)
    form = cset.linear_form(SHAPE)
    if form is not None:  # and against HiGHS on the linear form
        res = linprog(grad.ravel(), A_ub=form.A_ub if form.A_ub.shape[0] else None,
                      b_ub=form.b_ub if form.b_ub.size else None,
                      A_eq=form.A_eq if form.A_eq.shape[0] else None,
                      b_eq=form.b_eq if form.b_eq.size else None,
                      bounds=np.column_stack([form.lb, form.ub]), method="highs")
        assert res.status == 0
        assert value == pytest.approx(res.fun, rel=1e-9, abs=1e-9)


def test_support_of_unbounded_sets_is_minus_infinity() -> None:
    grad = np.ones(SHAPE)
    grad[0, 0] = -1.0
    assert Box(0, np.inf).support(grad)[0] == -np.inf
    assert Unconstrained().support(grad)[0] == -np.inf
    assert Unconstrained().support(np.zeros(SHAPE))[0] == 0.0
    # a zero gradient on the unbounded side does not make the box's LMO unbounded
    grad[0, 0] = 0.0
    value, s = Box(0, np.inf).support(grad)
    assert value == 0.0 and s is not None


def test_lp_support_gives_a_lower_bound_for_polyhedral_intersections(cvxpy_lmo) -> None:
    rng = np.random.default_rng(0)
    deltas = rng.normal(size=(3, 4, 5)) + 0.2
    sign = SignConsensus.from_deltas(deltas, "rows")
    for cset in (Box(0, 1) & sign, Simplex() & sign, Box(0, 1) & Simplex() & GlobalSimplex(4.0)):
        assert cset.lmo_method.startswith("LP (HiGHS")
        for _ in range(5):
            grad = rng.normal(size=(3, 4)) * 10.0 ** rng.integers(-6, 4)
            value, s = cset.support(grad)
            ref = cvxpy_lmo(cset, grad)
            assert value <= ref + 1e-9 * abs(ref) + 1e-15  # a valid lower bound ...
            assert value == pytest.approx(ref, rel=1e-7, abs=1e-9 * np.max(np.abs(grad)))  # ... and tight
            assert cset.violation(s) <= 1e-9


def test_l1_intersection_with_simplex_uses_the_lifted_highs_lp(cvxpy_lmo) -> None:
    """The L1 ball enters the HiGHS LP through auxiliary variables; its dual bound agrees with
    an independent CVXPY LP and never exceeds it."""
    cset = Simplex() & L1Ball(3.0, center=0.3)
    assert cset.lmo_method.startswith("LP (HiGHS")
    grad = np.random.default_rng(2).normal(size=SHAPE)
    value, _ = cset.support(grad)
    ref = cvxpy_lmo(cset, grad)
    assert value <= ref + 1e-12 and value == pytest.approx(ref, rel=1e-7)


# ---------------------------------------------------------------------- violation, linear forms, cvxpy
def test_box_violation_is_the_largest_excursion() -> None:
    d = np.zeros(SHAPE)
    d[1, 2] = 1.3
    d[0, 0] = -0.4
    assert Box(0, 1).violation(d) == pytest.approx(0.4)
    assert Simplex().violation(np.full(SHAPE, 1 / 3)) == pytest.approx(0.0, abs=1e-15)
    assert Simplex().violation(np.full(SHAPE, 0.5)) == pytest.approx(0.5)
    assert GlobalSimplex().violation(np.full(SHAPE, 1 / 12)) == pytest.approx(0.0, abs=1e-15)
    assert L1Ball(1.0, 0.5).violation(np.full(SHAPE, 0.6)) == pytest.approx(0.2)


@pytest.mark.parametrize("name", ["box01", "box_entries", "simplex", "global_simplex", "box&simplex", "box&box"])
def test_linear_form_and_cvxpy_form_agree_with_violation(name: str) -> None:
    cset = PROJECTABLE[name]()
    form = cset.linear_form(SHAPE)
    rng = np.random.default_rng(5)
    points = [cset.project(rng.normal(size=SHAPE)) for _ in range(5)] + [rng.normal(size=SHAPE) for _ in range(5)]
    for d in points:
        x = d.ravel()
        lin_ok = (np.all(form.A_ub @ x <= form.b_ub + 1e-9) and np.allclose(form.A_eq @ x, form.b_eq, atol=1e-9)
                  and np.all(x >= form.lb - 1e-9) and np.all(x <= form.ub + 1e-9))
        var = cp.Variable(SHAPE)
        var.value = d
        cvx_ok = all(np.all(np.asarray(c.violation()) <= 1e-9) for c in cset.cvxpy(var))
        assert lin_ok == cvx_ok == (cset.violation(d) <= 1e-9)


# ---------------------------------------------------------------------- intersections and parsing
def test_intersections_flatten_and_spell_themselves() -> None:
    a = Box(0, 1) & Simplex()
    b = a & L1Ball(2.0)
    assert isinstance(b, Intersection) and len(b.members()) == 3
    assert b.spec == "box:0,1 & simplex & l1:2"
    assert as_constraint_set([Box(0, 1), None, Unconstrained()]).spec == "box:0,1"
    assert isinstance(as_constraint_set([]), Unconstrained)
    assert isinstance(as_constraint_set(lambda v: [v >= 0]), UserConstraints)
    round_trip = parse_constraint(b.spec)
    assert round_trip.spec == b.spec
    assert parse_constraints(["box:0,1", "simplex"]).spec == "box:0,1 & simplex"
    with pytest.raises(ValidationError, match="must be a ConstraintSet"):
        as_constraint_set(3)


@pytest.mark.parametrize(
    "spec, expect",
    [("box:0,1", "box:0,1"), ("box", "box:0,1"), ("BOX:-1,2", "box:-1,2"), ("simplex", "simplex"),
     ("simplex:2", "simplex:2"), ("global_simplex", "global_simplex"), ("l1:2", "l1:2"),
     ("l1:2,0.5", "l1:2,0.5"), ("nonneg", "nonneg"), ("none", "none"), (" box:0, 1 ", "box:0,1")],
)
def test_parse_constraint(spec: str, expect: str) -> None:
    assert parse_constraint(spec).spec == expect


@pytest.mark.parametrize(
    "spec, error, match",
    [
        ("boxx:0,1", UnknownNameError, r"unknown constraint set 'boxx'; valid constraint sets: box, global_simplex, l1, none, nonneg, sign, simplex"),
        ("", UnknownNameError, r"unknown constraint set ''"),
        ("box:1", ValidationError, r"box takes two bounds"),
        ("box:0,1,2", ValidationError, r"expected 0 to 2 number"),
        ("box:a,b", ValidationError, r"arguments must be numbers"),
        ("box:1,0", InfeasibleError, r"box is empty: lower bound 1 > upper bound 0"),
        ("l1", ValidationError, r"needs a radius"),
        ("l1:-1", InfeasibleError, r"radius -1 < 0"),
        ("simplex:-1", InfeasibleError, r"total -1 < 0"),
        ("sign", ValidationError, r"'sign' needs the residual tensors"),
        ("box:0,1 & ", ValidationError, r"empty part around '&'"),
        ("nonneg:3", ValidationError, r"expected 0 number"),
    ],
)
def test_parse_errors(spec: str, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        parse_constraint(spec)


def test_registry_is_explicit() -> None:
    assert set(CONSTRAINT_SETS) >= {"box", "simplex", "global_simplex", "l1", "nonneg", "sign", "none"}
    with pytest.raises(ValidationError, match="already registered"):
        register_constraint("box", lambda args, spec, ctx: Box())
    with pytest.raises(ValidationError, match="must be non-empty"):
        register_constraint("a:b", lambda args, spec, ctx: Box())


def test_bad_constructor_arguments() -> None:
    with pytest.raises(ValidationError, match="NaN"):
        Box(np.nan, 1)
    with pytest.raises(ValidationError, match="do not broadcast"):
        Box(np.zeros(3), np.ones(4))
    with pytest.raises(ValidationError, match="box lower bound must be a number"):
        Box("x", 1)
    with pytest.raises(ValidationError, match=r"box upper bound has shape \(5,\).*\(3, 4\)"):
        Box(0, np.ones(5)).validate(SHAPE)
    with pytest.raises(ValidationError, match="total must be finite"):
        Simplex(np.inf)
    with pytest.raises(ValidationError, match="center contains NaN"):
        L1Ball(1.0, center=np.nan)


# ---------------------------------------------------------------------- feasibility
@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Box(np.zeros(SHAPE), np.where(np.arange(12).reshape(SHAPE) == 5, -1.0, 1.0)),
         r"box is empty: lower bound 0 > upper bound -1 at d\[1, 1\]"),
        (lambda: Box(0, 1) & Box(2, 3), r"box:0,1 & box:2,3 is empty: at d\[0, 0\] the bounds give \[2, 1\]"),
        (lambda: Box(0, 0.2) & Simplex(), r"box:0,0.2 & simplex is empty: at atom 0 the box allows sums in \[0, 0.6\] but the simplex needs 1"),
        (lambda: Box(0.5, 1) & Simplex(), r"box:0.5,1 & simplex is empty: at atom 0 the box allows sums in \[1.5, 3\]"),
        (lambda: Box(-1, -0.5) & Simplex(), r"box:-1,-0.5 & simplex is empty: the box's upper bound -0.5 < 0"),
        (lambda: Box(0, 0.01) & GlobalSimplex(), r"box:0,0.01 & global_simplex is empty: at the whole d"),
        (lambda: Box(2, 3) & L1Ball(1.0), r"box:2,3 & l1:1 is empty: the box is at L1 distance 24"),
        (lambda: Simplex() & Simplex(2.0), r"simplex & simplex:2 is empty"),
        (lambda: Simplex() & GlobalSimplex(), r"simplex & global_simplex is empty"),
        (lambda: Simplex() & L1Ball(0.5), r"simplex & l1:0.5 is empty"),
        (lambda: Box(0, 1) & UserConstraints(lambda v: [cp.sum(v) >= 20], label="sum>=20"),
         r"box:0,1 & sum>=20 is empty"),
        (lambda: UserConstraints(lambda v: [v >= 1, v <= 0], label="crossed"), r"crossed is empty"),
    ],
)
def test_infeasible_combinations_name_the_sets(make, match: str) -> None:
    with pytest.raises(InfeasibleError, match=match):
        check_feasible(make(), SHAPE)


@pytest.mark.parametrize(
    "make",
    [lambda: Box(0, 1) & Simplex(), lambda: Box(0, 1 / 3) & Simplex(), lambda: Simplex() & L1Ball(4.0),
     lambda: Box(0, 1) & Box(1, 2), lambda: Box(0, 1) & UserConstraints(lambda v: [cp.sum(v) == 3]),
     lambda: Unconstrained(), lambda: Box(-1, 1) & L1Ball(0.0, 0.5)],
)
def test_feasible_combinations_pass(make) -> None:
    check_feasible(make(), SHAPE)


def test_sets_holding_zero_or_the_soup_need_no_lp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Polyhedral intersections that contain 0 or the soup (each possibly clipped to the bounds)
    are known non-empty without an LP; others still get the LP, which finds emptiness."""
    from mergeqp.constraints import feasibility

    calls = []
    real = feasibility.lp_minimum
    monkeypatch.setattr(feasibility, "lp_minimum", lambda sets, grad: calls.append(1) or real(sets, grad))
    sign = SignConsensus.from_deltas(np.random.default_rng(0).normal(size=(3, 4, 5)), "rows")
    for cset in (Box(0, 1) & L1Ball(2.0) & sign, Simplex() & sign, Simplex() & L1Ball(4.0, 1 / 3) & sign,
                 Box(0.2, 1) & sign):
        check_feasible(cset, SHAPE)
    assert calls == []
    check_feasible(Box(-1, 1) & L1Ball(0.0, 0.5) & sign, SHAPE)  # only d = 0.5: found by the LP
    assert calls == [1]
    with pytest.raises(InfeasibleError, match="is empty"):
        check_feasible(Simplex() & L1Ball(0.5) & sign, SHAPE)  # |d|_1 = 4 > 0.5 on the simplices
    assert calls == [1, 1]


# ---------------------------------------------------------------------- sign consensus
def merged_update(d: np.ndarray, deltas: np.ndarray, parametrisation: str) -> np.ndarray:
    """Brute force: the merged update ``sum_k d_k * delta_k`` in each parametrisation."""
    if parametrisation == "rows":
        return np.einsum("ki,kij->ij", d, deltas)
    if parametrisation == "columns":
        return np.einsum("kj,kij->ij", d, deltas)
    return np.einsum("k,kij->ij", d[:, 0], deltas)


@pytest.mark.parametrize("parametrisation", ["rows", "columns", "scalar"])
@pytest.mark.parametrize("K", [1, 2, 3, 4])
def test_sign_consensus_matches_brute_force(parametrisation: str, K: int) -> None:
    rng = np.random.default_rng(K)
    deltas = rng.normal(size=(K, 5, 6)) + 0.3 * rng.normal(size=(K, 1, 1))
    full = SignConsensus.from_deltas(deltas, parametrisation, reduce=False)
    reduced = SignConsensus.from_deltas(deltas, parametrisation)
    assert reduced.G.shape[0] <= full.G.shape[0]
    elected = np.sign(deltas.sum(axis=0))
    K_, n_atoms = reduced.shape
    assert K_ == K and n_atoms == {"rows": 5, "columns": 6, "scalar": 1}[parametrisation]
    # soup, zero and task arithmetic are feasible
    for d in (np.full(reduced.shape, 1 / K), np.zeros(reduced.shape), np.full(reduced.shape, 0.7)):
        assert reduced.violation(d) <= 1e-12 and full.violation(d) <= 1e-12
    agree = feasible = 0
    for _ in range(400):
        d = 1 / K + rng.choice([0.02, 0.1, 0.5]) * rng.normal(size=reduced.shape)
        brute = bool(np.all(elected * merged_update(d, deltas, parametrisation) >= 0))
        assert brute == (full.violation(d) <= 0) == (reduced.violation(d) <= 0)
        agree += 1
        feasible += brute
    assert 0 < feasible < agree  # both outcomes were exercised


def test_sign_consensus_violation_is_a_distance_in_d_units() -> None:
    deltas = np.zeros((2, 1, 1))
    deltas[:, 0, 0] = [3.0, 4.0]  # one parameter; constraint 3 d0 + 4 d1 >= 0
    sign = SignConsensus.from_deltas(deltas, "scalar")
    d = np.array([[-1.0], [0.0]])  # distance to the half-space: 3 / 5
    assert sign.violation(d) == pytest.approx(0.6)


def test_sign_consensus_density_keeps_the_soup_feasible() -> None:
    rng = np.random.default_rng(7)
    deltas = rng.normal(size=(3, 6, 8))
    dense = SignConsensus.from_deltas(deltas, "rows", reduce=False)
    sparse = SignConsensus.from_deltas(deltas, "rows", density=0.2, reduce=False)
    assert sparse.n_parameters < dense.n_parameters == 48
    assert sparse.violation(np.full((3, 6), 1 / 3)) <= 1e-12


def test_sign_consensus_errors() -> None:
    with pytest.raises(ValidationError, match=r"deltas must have shape \(K, r, m\)"):
        SignConsensus.from_deltas(np.zeros((2, 3)))
    with pytest.raises(ValidationError, match="deltas contain NaN"):
        SignConsensus.from_deltas(np.full((2, 2, 2), np.nan))
    with pytest.raises(ValidationError, match=r"sign consensus is defined for parametrisations whose atoms each "
                                              r"scale their own parameters .*'diagonal' gives no such map"):
        SignConsensus.from_deltas(np.ones((2, 2, 2)), "diagonal")
    with pytest.raises(ValidationError, match=r"parameter_atoms must be an \(2, 2\) array of atom indices"):
        SignConsensus.from_deltas(np.ones((2, 2, 2)), "mine", atoms=np.zeros((2, 3), dtype=int))
    with pytest.raises(ValidationError, match=r"density must lie in \(0, 1\]"):
        SignConsensus.from_deltas(np.ones((2, 2, 2)), density=0.0)
    sign = SignConsensus.from_deltas(np.ones((2, 2, 3)), "rows")
    with pytest.raises(ValidationError, match=r"built for d of shape \(2, 2\), the problem has \(2, 3\)"):
        sign.validate((2, 3))
    with pytest.raises(ValidationError, match="G has 5 columns"):
        SignConsensus(np.ones((2, 5)), (2, 2))


def test_sign_from_context_in_parse_constraint() -> None:
    deltas = np.random.default_rng(0).normal(size=(2, 3, 4))
    s = parse_constraint("sign", {"deltas": deltas, "parametrisation": "columns"})
    assert isinstance(s, SignConsensus) and s.shape == (2, 4)
    s = parse_constraint("sign:0.5", {"deltas": deltas})
    assert s.shape == (2, 3)


# ---------------------------------------------------------------------- user constraints
def test_user_constraints_violation_and_lmo() -> None:
    user = UserConstraints(lambda v: [cp.sum(v) == 1, v >= 0], label="sum1")
    assert user.violation(np.full(SHAPE, 1 / 12)) <= 1e-12
    assert user.violation(np.full(SHAPE, 0.5)) == pytest.approx(5.0)  # |12 * 0.5 - 1|
    grad = np.random.default_rng(1).normal(size=SHAPE)
    value, _ = user.support(grad)
    exact = GlobalSimplex().support(grad)[0]
    assert value <= exact + 1e-12 and value == pytest.approx(exact, rel=1e-7, abs=1e-8)
    assert user.lmo_method.startswith("LP (CVXPY")


def test_user_constraints_with_auxiliary_variables() -> None:
    def l2_ball(v):  # ||v||_2 <= t, t <= 1 with an auxiliary t
        t = cp.Variable()
        return [cp.norm(cp.vec(v, order="C"), 2) <= t, t <= 1]

    user = UserConstraints(l2_ball, label="l2")
    assert user.violation(np.full(SHAPE, 0.1)) == pytest.approx(0.0, abs=1e-7)
    d = np.zeros(SHAPE)
    d[0, 0] = 3.0  # infinity-norm distance to the unit ball: 2
    assert user.violation(d) == pytest.approx(2.0, abs=1e-6)


@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda v: v + 1, r"returned AddExpression at position 0, not a CVXPY constraint"),
        (lambda v: None, r"returned None"),
        (lambda v: [cp.square(cp.sum(v)) >= 1], r"is not convex \(DCP\)"),
        (lambda v: 1 / 0, r"raised ZeroDivisionError"),
    ],
)
def test_bad_user_constraints(fn, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        UserConstraints(fn).violation(np.zeros(SHAPE))
    with pytest.raises(ValidationError, match="callable"):
        UserConstraints(3)  # type: ignore[arg-type]


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 100_000))
def test_highs_dual_bound_is_a_lower_bound_for_any_multipliers(cvxpy_lmo, seed: int) -> None:
    """Weak duality: the bound built from arbitrary multipliers (y_ub <= 0, any y_eq) never
    exceeds the LP minimum, so a sloppy LP can only loosen the certificate, not break it."""
    from types import SimpleNamespace

    from mergeqp.constraints import LinearForm, _highs_dual_bound

    rng = np.random.default_rng(seed)
    deltas = rng.normal(size=(3, 4, 5)) + 0.2
    cset = Box(0, 1) & Simplex(1.0) & SignConsensus.from_deltas(deltas, "rows")
    form = LinearForm.empty(12)
    for s in cset.members():
        form = form & s.linear_form((3, 4))
    cost = rng.normal(size=12)
    true_min = cvxpy_lmo(cset, cost.reshape(3, 4))
    res = SimpleNamespace(ineqlin=SimpleNamespace(marginals=-np.abs(rng.normal(size=form.A_ub.shape[0]))),
                          eqlin=SimpleNamespace(marginals=rng.normal(size=form.A_eq.shape[0])))
    bound = _highs_dual_bound(cost, form, res, np.full(12, 1 / 3))
    assert bound <= true_min + 1e-9


def test_a_sign_set_without_inequalities_is_the_whole_space() -> None:
    """All residuals zero: no sign is elected, the set has no inequality and is treated as
    unconstrained (the unconstrained optimum is then certified, not given an infinite gap)."""
    import mergeqp as mq
    from mergeqp.constraints import SignConsensus, as_constraint_set

    S = SignConsensus.from_deltas(np.zeros((2, 3, 4)), "rows")
    assert S.G.shape[0] == 0
    assert as_constraint_set(S).spec == "none"
    assert as_constraint_set([S, mq.Box(0, 1)]).spec == "box:0,1"
    sol = mq.solve(mq.MergeQP(np.eye(6), np.ones(6), shape=(2, 3)), S)
    assert sol.certificate.certified()


@pytest.mark.parametrize("seed", range(4))
def test_sign_consensus_of_any_parameter_to_atom_map(seed) -> None:
    """(stop 49) ``sign`` was built for the names rows / columns / scalar only; a parametrisation
    that says which atom scales each parameter (``parameter_atoms``) gets it too. The rows' own map
    through the general path gives the very rows of the ``rows`` path; blocks of rows (a map no
    name has) give the set of the definition: ``s_p sum_k d[k, a(p)] delta_k[p] >= 0`` for every
    parameter ``p`` (the reduced rows keep exactly those points)."""
    rng = np.random.default_rng(seed)
    K, r, m = 3, 6, 4
    D = rng.normal(size=(K, r, m))
    rows_map = np.repeat(np.arange(r)[:, None], m, axis=1)
    a = SignConsensus.from_deltas(D, "rows")
    b = SignConsensus.from_deltas(D, "my_rows", atoms=rows_map)
    assert a.shape == b.shape and (a.G != b.G).nnz == 0
    blocks = rows_map // 2  # atoms scale pairs of rows
    sign = SignConsensus.from_deltas(D, "row_pairs", atoms=blocks)
    assert sign.shape == (K, 3)
    # the map may come as a function, called only where it is needed (a layer's map is r x m integers)
    called = []
    assert (SignConsensus.from_deltas(D, "rows", atoms=lambda: called.append(1)).G != a.G).nnz == 0 and not called
    assert (SignConsensus.from_deltas(D, "row_pairs", atoms=lambda: blocks).G != sign.G).nnz == 0
    s = np.sign(D.sum(axis=0))
    inside = []
    for i in range(400):  # near the soup's ray (feasible) and farther from it (mostly not)
        d = rng.uniform(0, 1) * np.ones((K, 3)) + [0.0, 0.01, 0.05, 0.5][i % 4] * rng.normal(size=(K, 3))
        merged = np.einsum("kp,kp->p", d[:, blocks.ravel()], D.reshape(K, -1)) * s.ravel()
        inside.append(bool(np.all(merged >= -1e-12)))
        assert (sign.violation(d) <= 1e-12) == inside[-1]
    assert 50 < sum(inside) < 350
