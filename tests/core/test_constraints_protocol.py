"""Constraint sets written outside the package (the worked example of docs/constraints.md) work
with every solver whose needs they meet and with the certificate; solvers that lack a
capability say which. Also: the certificate's bounds are labelled and never fall back
silently, and an unboundedness claim needs a ray that stays in the set."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

import mergeqp as mq
from mergeqp.certificate import certify
from mergeqp.constraints import Box, ConstraintSet, SetStructure, Simplex, capabilities
from mergeqp.errors import SolverError, UnboundedError, UnsupportedError, ValidationError
from mergeqp.lower_bounds import LinearMinimum, LPDuals, lower_bound
from mergeqp.problem import MergeQP
from mergeqp.solvers.unbounded import unbounded_claim


DOC = Path(__file__).resolve().parents[2] / "docs" / "constraints.md"


def _user_sets() -> dict[str, object]:
    """Run the doc's example block in a fresh namespace (a user's script) and return it."""
    text = DOC.read_text()
    block = re.search(r"<!-- example: user-sets -->\s*```python\n(.*?)```", text, re.S)
    assert block is not None, "docs/constraints.md lost its user-sets example"
    namespace: dict[str, object] = {"__name__": "user_script"}
    exec(compile(block.group(1), str(DOC), "exec"), namespace)  # noqa: S102 -- the doc's own example
    return namespace


USER = _user_sets()


def _ball() -> ConstraintSet:
    return USER["EuclideanBall"](0.3, 1.2)  # type: ignore[operator]


def _budget() -> ConstraintSet:
    return USER["PerModelBudget"]([1.5, 2.0, 2.5])  # type: ignore[operator]


@pytest.mark.parametrize(("make", "solvers"), [
    (_ball, ["auto", "torch_fista", "cvxpy_clarabel"]),
    (_budget, ["auto", "clarabel", "osqp", "cvxpy_clarabel", "cvxpy_osqp"]),
    (lambda: _budget() & Box(0.1, 1.0), ["auto", "clarabel", "osqp", "cvxpy_clarabel"]),
], ids=["ball", "budget", "budget&box"])
def test_a_users_set_is_solved_and_certified_by_every_capable_solver(cvxpy_solve, random_problem, make, solvers) -> None:
    cset = make()
    assert any(type(m).__module__ == "user_script" for m in cset.members())
    problem = random_problem(np.random.default_rng(11), K=3, m=4)
    ref, _ = cvxpy_solve(problem, cset)
    for name in solvers:
        sol = mq.solve(problem, cset, solver=name)
        assert sol.certificate is not None and sol.certificate.certified(), (name, sol.certificate.explain())
        assert sol.objective == pytest.approx(ref, rel=1e-6, abs=1e-8), name
        assert cset.violation(sol.d) <= 1e-7


def test_the_certificate_of_a_users_set_uses_its_declared_oracle(random_problem) -> None:
    problem = random_problem(np.random.default_rng(12), K=3, m=4)
    ball = _ball()
    cert = mq.solve(problem, ball, solver="cvxpy_clarabel").certificate
    assert cert is not None
    assert cert.bound_method == "exact (closed form)" and cert.kkt_residual is not None
    cert = mq.solve(problem, _budget(), solver="clarabel").certificate
    assert cert is not None
    assert cert.bound_method == "dual (HiGHS)" and cert.gap_method.startswith("frank-wolfe, LP (HiGHS")


@pytest.mark.parametrize(("make", "solver", "missing"), [
    (_ball, "active_set", "separable structure"),
    (_ball, "clarabel", "neither linear_form nor auxiliary_form"),
    (_ball, "osqp", "neither linear_form nor auxiliary_form"),
    (_ball, "closed_form", "only the unconstrained problem"),
    (_budget, "active_set", "separable structure"),
    (_budget, "torch_fista", "closed-form projection"),
], ids=["ball-active_set", "ball-clarabel", "ball-osqp", "ball-closed_form", "budget-active_set", "budget-torch"])
def test_a_solver_missing_a_capability_names_it(random_problem, make, solver, missing) -> None:
    problem = random_problem(np.random.default_rng(13), K=3, m=4)
    with pytest.raises(UnsupportedError, match=re.escape(missing)):
        mq.solve(problem, make(), solver=solver)


def test_capabilities_lists_what_a_set_declares() -> None:
    shape = (3, 4)
    assert {"projection", "lmo", "bounded", "cvxpy"} <= capabilities(_ball(), shape)
    assert "polyhedral" not in capabilities(_ball(), shape) and "structure" not in capabilities(_ball(), shape)
    assert {"polyhedral", "lmo", "bounded", "cvxpy", "recession"} <= capabilities(_budget(), shape)
    assert {"projection", "structure", "polyhedral", "lmo", "cvxpy"} <= capabilities(Box(0, 1) & Simplex(), shape)


def test_a_set_without_cvxpy_form_is_declined_by_the_cvxpy_solvers(random_problem) -> None:
    class Bare(ConstraintSet):
        name = "bare"
        has_projection = True

        def violation(self, d):
            return 0.0

        def project(self, d):
            return np.asarray(d, dtype=np.float64)

    problem = random_problem(np.random.default_rng(14), K=2, m=2)
    with pytest.raises(UnsupportedError, match=r"declares no CVXPY form"):
        mq.solve(problem, Bare(), solver="cvxpy_clarabel")


# ---------------------------------------------------------------------- verdicts
class _NoMultipliers(ConstraintSet):
    """Box(0, 1) whose oracle answers like an LP that returned no usable multipliers."""

    name = "no_multipliers"

    def violation(self, d):
        return Box(0, 1).violation(d)

    def linear_minimum(self, grad):
        s = np.where(grad > 0, 0.0, 1.0)
        value = float(np.sum(grad * s))
        return LinearMinimum(value, s, "LP (HiGHS dual bound)",
                             lp=LPDuals(grad.ravel(), None, None, None, s.ravel()))


def test_no_proven_bound_is_never_certified_and_says_why(random_problem) -> None:
    problem = random_problem(np.random.default_rng(15), K=2, m=3)
    d = mq.solve(problem, Box(0, 1)).d
    good = certify(problem, Box(0, 1), d)
    assert good.certified() and good.bound_method == "exact (closed form)"
    cert = certify(problem, _NoMultipliers(), d)
    assert not cert.certified()
    assert cert.fw_gap == math.inf and "unavailable" in cert.bound_method
    assert any("no usable multipliers" in n for n in cert.notes)
    assert cert.to_dict()["certified"] is False and cert.to_dict()["bound_method"] == cert.bound_method


def test_user_constraint_bounds_are_computed_and_labelled_by_the_certificate() -> None:
    lm = LinearMinimum(-2.0, np.zeros((1, 2)), "LP (CVXPY/Clarabel)", solver_status="optimal",
                       scale=4.0, scaled_primal=-0.5)
    bound = lower_bound(lm)
    assert bound.value == pytest.approx((-0.5 - 1e-9 * 1.5) * 4.0, rel=1e-15)
    assert bound.method.startswith("user set (clarabel primal minus a labelled margin)")
    inaccurate = lower_bound(LinearMinimum(-2.0, np.zeros((1, 2)), "LP (CVXPY/Clarabel)",
                                           solver_status="optimal_inaccurate", scale=4.0, scaled_primal=-0.5))
    assert inaccurate.value is not None and bound.value is not None and inaccurate.value < bound.value


def test_an_unbounded_claim_needs_a_ray_that_stays_in_the_set() -> None:
    flat = MergeQP(np.diag([1.0, 0.0]), np.array([0.0, 1.0]), shape=(1, 2))  # J -> -inf along -e2
    down = np.array([0.0, -1.0])
    assert isinstance(unbounded_claim(flat, Box(-np.inf, np.inf), "osqp", "dual infeasible", down), UnboundedError)
    err = unbounded_claim(flat, Box(0, np.inf), "osqp", "dual infeasible", down)  # -e2 leaves d >= 0
    assert type(err) is SolverError and "leaves the set" in str(err)

    class NoCone(ConstraintSet):  # unbounded, and no way to test its recession cone
        name = "nocone"

        def violation(self, d):
            return 0.0

    err = unbounded_claim(flat, NoCone(), "osqp", "dual infeasible", down)
    assert type(err) is SolverError and "recession-cone" in str(err)


def test_a_set_with_a_projection_but_no_oracle_is_solved_but_not_certified(random_problem) -> None:
    """torch_fista needs only the projection; the certificate needs an oracle and says so."""

    class ProjectionOnly(ConstraintSet):
        name = "projection_only"
        has_projection = True

        def violation(self, d):
            return Box(0, 1).violation(d)

        def project(self, d):
            return np.clip(d, 0.0, 1.0)

    problem = random_problem(np.random.default_rng(16), K=2, m=3)
    sol = mq.solve(problem, ProjectionOnly(), solver="torch_fista")
    assert sol.objective == pytest.approx(mq.solve(problem, Box(0, 1)).objective, rel=1e-7)
    cert = sol.certificate
    assert cert is not None and not cert.certified() and cert.fw_gap == math.inf
    assert any("declares no linear minimisation oracle" in n for n in cert.notes)
    assert cert.bound_method.endswith("(unavailable)")


# ---------------------------------------------------------------------- partial protocols (review)
_LO, _HI = -0.2, 0.5


class _BoxViolation(ConstraintSet):
    """``_LO <= d <= _HI``, declared through one capability by each subclass below."""

    def violation(self, d):
        return float(max(np.max(_LO - d), np.max(d - _HI), 0.0))


class _StructureOnly(_BoxViolation):
    name = "structure_only"

    def structure(self, shape):
        n = shape[0] * shape[1]
        return SetStructure(np.full(n, _LO), np.full(n, _HI))


class _CvxpyOnly(_BoxViolation):
    name = "cvxpy_only"

    def cvxpy(self, var):
        return [var >= _LO, var <= _HI]


def test_a_set_with_only_a_cvxpy_form_is_certified_through_a_cvxpy_lp(cvxpy_solve, random_problem) -> None:
    """Its default oracle is the CVXPY LP (as for callable user constraints), so every solver
    that can solve it also certifies it, alone or intersected with a built-in set."""
    problem = random_problem(np.random.default_rng(21), K=3, m=4, offset=0.8)
    assert "lmo" in capabilities(_CvxpyOnly(), problem.shape)
    for cset in (_CvxpyOnly(), Box(0, 1) & _CvxpyOnly()):
        ref, _ = cvxpy_solve(problem, cset)
        for name in ("auto", "cvxpy_clarabel", "cvxpy_osqp"):
            sol = mq.solve(problem, cset, solver=name)
            assert sol.certificate is not None and sol.certificate.certified(), (name, sol.certificate.explain())
            assert sol.certificate.bound_method.startswith("user set")
            assert sol.objective == pytest.approx(ref, rel=1e-6, abs=1e-8)


def test_an_intersection_with_a_structure_only_set_keeps_the_exact_oracle(random_problem) -> None:
    """A user set declaring only ``structure(shape)`` (no projection flag) combines with a box:
    the intersection's oracle is the kernels' closed form, so the answer is certified."""
    problem = random_problem(np.random.default_rng(22), K=3, m=4, offset=0.8)
    ref = mq.solve(problem, Box(0.0, _HI), solver="active_set").objective
    for name in ("auto", "active_set", "clarabel", "osqp"):
        sol = mq.solve(problem, Box(0, 1) & _StructureOnly(), solver=name)
        cert = sol.certificate
        assert cert is not None and cert.certified(), (name, cert.explain())
        assert cert.bound_method == "exact (closed form)"
        assert sol.objective == pytest.approx(ref, rel=1e-6, abs=1e-8)


class _OracleAnswer(_BoxViolation):
    """A box whose oracle answers in the form given to it (a user's slip)."""

    name = "oracle_answer"

    def __init__(self, form):
        self.form = form

    def linear_minimum(self, grad):
        s = np.where(grad > 0, _LO, _HI)
        return self.form(float(np.sum(grad * s)), s)


def test_the_certificate_checks_the_form_of_a_users_oracle_answer(random_problem) -> None:
    problem = random_problem(np.random.default_rng(23), K=3, m=4, offset=0.8)
    d = mq.solve(problem, Box(_LO, _HI), solver="active_set").d
    flat = certify(problem, _OracleAnswer(lambda v, s: LinearMinimum(v, s.ravel(), "closed form", exact=True)), d)
    assert flat.certified() and flat.bound_method == "exact (closed form)"  # a flat minimiser is reshaped
    with pytest.raises(ValidationError, match=r"oracle_answer: linear_minimum\(grad\) returned a minimiser of shape \(11,\)"):
        certify(problem, _OracleAnswer(lambda v, s: LinearMinimum(v, s.ravel()[:-1], "closed form", exact=True)), d)
    with pytest.raises(ValidationError, match=r"must return a mergeqp.lower_bounds.LinearMinimum, got tuple"):
        certify(problem, _OracleAnswer(lambda v, s: (v, s)), d)


@pytest.mark.parametrize("spec", ["simplex & l1:3.5", "box:-1,1 & global_simplex & l1:2", "box:0,1 & l1:0.5",
                                  "nonneg & l1:1"])
def test_an_intersection_with_an_l1_ball_declares_its_auxiliary_form(spec) -> None:
    """Stop 74 review: ``simplex & l1`` and ``box & l1`` declared neither ``linear_form`` nor
    ``auxiliary_form`` (capabilities without ``polyhedral``), so a user's solver following the protocol
    declined them; now the intersection's auxiliary form, whose LP minimum equals the set's own oracle."""
    import scipy.sparse as sp
    from scipy.optimize import linprog

    from mergeqp.constraints import capabilities, parse_constraint

    shape = (2, 3)
    cs = parse_constraint(spec)
    assert "polyhedral" in capabilities(cs, shape)
    aux = cs.auxiliary_form(shape)
    assert aux is not None and aux.A_x.shape == (aux.b.size, 6) and aux.A_t.shape == (aux.b.size, aux.n_aux)
    A = sp.hstack([aux.A_x, aux.A_t]).tocsr()
    rng = np.random.default_rng(0)
    for _ in range(5):
        g = rng.standard_normal(6)
        lp = linprog(np.concatenate([g, np.zeros(aux.n_aux)]), A_ub=A, b_ub=aux.b,
                     bounds=[(None, None)] * 6 + [(lb, None) for lb in aux.t_lb], method="highs")
        assert lp.status == 0
        assert lp.fun == pytest.approx(cs.linear_minimum(g.reshape(shape)).value, rel=1e-9, abs=1e-9)
        assert cs.violation(lp.x[:6].reshape(shape)) <= 1e-9
    assert parse_constraint("box:0,1 & simplex").auxiliary_form(shape) is None  # (its linear_form describes it)
