"""Bad registrations in every public registry are refused with a clear error naming the
rule (never a raw TypeError later, never an entry no spelling can reach), and a user's
constraint parser that fails or returns the wrong thing is named with its spec."""

from __future__ import annotations

import dataclasses

import pytest

import mergeqp as mq
from mergeqp.constraints import CONSTRAINT_SETS, Box
from mergeqp.errors import ConfigError, MergeQPError, ValidationError
from mergeqp.merge.modes import MERGE_MODES, SequentialMode
from mergeqp.merge.registry import MERGE_METHODS
from mergeqp.stats.bases import BASES
from mergeqp.stats.parametrisation import RowsParametrisation


def _box_parser(args, spec, context):
    return Box(0, 1)


class _Named(RowsParametrisation):
    def __init__(self, name):
        self.name = name


class _Mode(SequentialMode):
    def __init__(self, name):
        self.name = name


@pytest.mark.parametrize(("register", "match"), [
    (lambda: mq.register_constraint("box", _box_parser), "'box' is already registered"),
    (lambda: mq.register_constraint("a:b", _box_parser), "without ':'"),
    (lambda: mq.register_constraint(3, _box_parser), "must be a non-empty string, got 3"),
    (lambda: mq.register_constraint("MyCap", _box_parser), "must be lower-case"),
    (lambda: mq.register_constraint("cap_", "not a function"), "parser .* must be callable"),
    (lambda: mq.register_parametrisation(_Named("a:b")), "without ':'"),
    (lambda: mq.register_parametrisation(_Named("rows")), "'rows' is already registered"),
    (lambda: mq.register_basis("a b", lambda *a, **k: None), "or spaces"),
    (lambda: mq.register_basis("my_basis", 5), "builder .* must be callable, got int"),
    (lambda: mq.register_merge_method(dataclasses.replace(MERGE_METHODS["ties"], name="a:b")), "without ':'"),
    (lambda: mq.register_merge_method(dataclasses.replace(MERGE_METHODS["ties"], name="")), "non-empty string"),
    (lambda: mq.register_merge_method(dataclasses.replace(MERGE_METHODS["ties"], name="m2", run=3)), "must be callable"),
    (lambda: mq.register_merge_mode(_Mode("a:b")), "without ':'"),
    (lambda: mq.register_merge_mode(_Mode("single")), "'single' is already registered"),
    (lambda: mq.register_solver("osqp"), "expects a QPSolver instance, got str"),
    (lambda: mq.register_solver(mq.SOLVERS["osqp"]), "'osqp' is already registered"),
], ids=["constraint-dup", "constraint-colon", "constraint-int", "constraint-case", "constraint-parser",
        "param-colon", "param-dup", "basis-space", "basis-builder", "method-colon", "method-empty",
        "method-run", "mode-colon", "mode-dup", "solver-type", "solver-dup"])
def test_a_bad_registration_is_refused_and_says_why(register, match) -> None:
    before = {id(r): dict(r) for r in (CONSTRAINT_SETS, MERGE_METHODS, MERGE_MODES, BASES, mq.SOLVERS)}
    with pytest.raises((ValidationError, ConfigError), match=match):
        register()
    assert {id(r): dict(r) for r in (CONSTRAINT_SETS, MERGE_METHODS, MERGE_MODES, BASES, mq.SOLVERS)} == before


def test_a_user_parser_that_fails_is_named_with_its_spec() -> None:
    mq.register_constraint("broken_cap", lambda args, spec, context: 1 / 0)
    mq.register_constraint("wrong_cap", lambda args, spec, context: 42)
    try:
        with pytest.raises(ValidationError, match=r"constraint 'broken_cap:1': .* raised ZeroDivisionError"):
            mq.parse_constraints(["box:0,1", "broken_cap:1"])
        with pytest.raises(ValidationError, match=r"returned int, not a ConstraintSet"):
            mq.parse_constraints(["wrong_cap"])
        with pytest.raises(MergeQPError, match=r"valid constraint sets: .*\(did you mean 'broken_cap'\?\)"):
            mq.parse_constraints(["broken_capp"])
    finally:
        CONSTRAINT_SETS.pop("broken_cap")
        CONSTRAINT_SETS.pop("wrong_cap")


def test_a_users_solver_that_answers_wrongly_is_named_not_trusted() -> None:
    """What a registered solver hands back is checked: a RawResult with d of the problem's shape
    (a transposed point was reshaped silently), real numbers; a supports() that raises or answers
    True/False is a reason (auto passes over it); an unboundedness claim is checked in float64; an
    option its defaults do not declare is refused even when the solver never checks."""
    import numpy as np

    from mergeqp.errors import SolverError, UnsupportedError
    from mergeqp.problem import MergeQP
    from mergeqp.solution import SolveStatus
    from mergeqp.solvers.base import QPSolver, RawResult
    from mergeqp.solvers.registry import SOLVERS

    rng = np.random.default_rng(0)
    A = rng.standard_normal((20, 12))
    problem = MergeQP(A.T @ A, rng.standard_normal(12), 0.0, shape=(3, 4))

    def make(name, answer, supports=lambda self, p, c: None):
        cls = type(name, (QPSolver,), {"name": name, "supports": supports,
                                       "solve": lambda self, p, c, x0=None, **o: answer(p)})
        mq.register_solver(cls())
        return name

    def unbounded(_p):
        raise mq.UnboundedError("J falls forever (trust me)")

    try:
        cases = {
            make("reg_test_long", lambda p: RawResult(np.zeros(p.n + 1), SolveStatus.OPTIMAL)): r"shape \(13,\)",
            make("reg_test_transposed", lambda p: RawResult(np.zeros((4, 3)), SolveStatus.OPTIMAL)): r"shape \(4, 3\)",
            make("reg_test_array", lambda p: np.zeros(p.shape)): "returned ndarray, not a RawResult",
            make("reg_test_complex", lambda p: RawResult(np.zeros(p.shape, complex), SolveStatus.OPTIMAL)): "complex",
            make("reg_test_unbounded", unbounded): "but the set box:0,1 is bounded",
        }
        for name, message in cases.items():
            with pytest.raises(SolverError, match=message):
                mq.solve(problem, "box:0,1", solver=name)
        raising = make("reg_test_supports", lambda p: RawResult(np.zeros(p.shape), SolveStatus.OPTIMAL),
                       supports=lambda self, p, c: p.no_such_attribute)
        with pytest.raises(UnsupportedError, match=r"its supports\(\) raised AttributeError"):
            mq.solve(problem, "box:0,1", solver=raising)
        assert mq.solve(problem, "box:0,1").certificate.certified()  # auto passes over it
        yes = make("reg_test_true", lambda p: RawResult(np.zeros(p.shape), SolveStatus.OPTIMAL),
                   supports=lambda self, p, c: True)
        with pytest.raises(UnsupportedError, match=r"returned True; it must return None"):
            mq.solve(problem, "box:0,1", solver=yes)
        quiet = make("reg_test_options", lambda p: RawResult(np.zeros(p.shape), SolveStatus.OPTIMAL))
        with pytest.raises(ValidationError, match=r"unrecognised solver option\(s\) \['typo'\]"):
            mq.solve(problem, "box:0,1", solver=quiet, typo=1)
    finally:
        for name in [n for n in SOLVERS if n.startswith("reg_test_")]:
            del SOLVERS[name]


def test_a_sets_diagnostics_of_the_wrong_shape_are_named() -> None:
    """violation() must be one number (an array is named with the set); a projection of the wrong
    shape only skips the informative projected-gradient residual."""
    import numpy as np

    from mergeqp.problem import MergeQP

    class Odd(mq.ConstraintSet):
        name = "odd_test"
        has_projection = True

        def __init__(self, array_violation: bool) -> None:
            self.array_violation = array_violation

        @property
        def spec(self) -> str:
            return "odd_test"

        def project(self, d):
            return np.clip(d, 0.0, 1.0).ravel()  # flat: the wrong shape

        def support(self, grad):
            s = np.where(grad < 0, 1.0, 0.0)
            return float(np.sum(grad * s)), s

        def violation(self, d):
            v = np.maximum(np.maximum(-d, d - 1.0), 0.0)
            return v if self.array_violation else float(np.max(v))

    rng = np.random.default_rng(1)
    A = rng.standard_normal((20, 12))
    problem = MergeQP(A.T @ A, rng.standard_normal(12), 0.0, shape=(3, 4))
    with pytest.raises(ValidationError, match=r"odd_test: its violation\(d\) returned ndarray of shape \(3, 4\)"):
        mq.certify(problem, Odd(True), np.zeros((3, 4)))
    sol = mq.solve(problem, Odd(False), solver="torch_fista")
    assert sol.certificate.kkt_residual is None
    assert any("project returned shape (12,)" in n for n in sol.certificate.notes)


def test_reserved_method_names_and_a_set_that_vouches_for_crossed_bounds() -> None:
    """``qp`` / ``auto`` select the QP in a merge config: a method under that name could never be
    reached; a set declaring bounds that cross is empty even if it claims known_nonempty."""
    import numpy as np

    from mergeqp.constraints import SetStructure
    from mergeqp.merge.method import MethodParams

    for name in ("qp", "auto"):
        with pytest.raises(ConfigError, match=f"'{name}' is reserved"):
            mq.register_merge_method(mq.MergeMethod(name=name, summary="x", reference="t", params=MethodParams,
                                                    run=lambda inputs, names, params: {}))

    class Vouching(mq.ConstraintSet):
        name = "vouching_test"
        known_nonempty = True

        @property
        def spec(self) -> str:
            return "vouching_test"

        def structure(self, shape):
            n = shape[0] * shape[1]
            return SetStructure(np.full(n, 1.0), np.full(n, 0.0))

        def violation(self, d):
            return 1.0

    with pytest.raises(mq.InfeasibleError, match="vouching_test is empty"):
        mq.solve(mq.MergeQP(np.eye(4), np.zeros(4), 0.0, shape=(2, 2)), Vouching())


def test_cvxpy_osqp_declines_a_set_that_needs_a_cone() -> None:
    """OSQP solves QPs: a user set whose CVXPY form is a second-order cone is declined with a reason
    (it failed inside OSQP); cvxpy_clarabel solves it."""
    import cvxpy as cp
    import numpy as np

    from mergeqp.solvers.registry import SOLVERS, declines

    class Ball(mq.ConstraintSet):
        name = "ball_test"

        @property
        def spec(self) -> str:
            return "ball_test"

        @property
        def bounded(self) -> bool:
            return True

        def violation(self, d):
            return max(float(np.linalg.norm(d)) - 1.0, 0.0)

        def cvxpy(self, var):
            return [cp.norm(cp.vec(var, order="C"), 2) <= 1.0]

    problem = mq.MergeQP(np.eye(4), -np.ones(4), 0.0, shape=(2, 2))
    assert "needs more than linear constraints" in declines(SOLVERS["cvxpy_osqp"], problem, Ball())
    assert declines(SOLVERS["cvxpy_osqp"], problem, Box(0, 1)) is None
    sol = mq.solve(problem, Ball(), solver="cvxpy_clarabel")
    assert np.allclose(sol.d, 0.5, atol=1e-6)


def test_a_parametrisation_whose_update_has_the_wrong_shape_is_named() -> None:
    """update(d, deltas) must be the layer's (r, m1): a transposed answer failed deep inside a merge
    (or broadcast), now it is named with the parametrisation."""
    import numpy as np

    from mergeqp.stats.apply import merged_layer_weight

    class Transposed(RowsParametrisation):
        name = "transposed_test"

        def update(self, d, deltas):
            return super().update(d, deltas).T

    rng = np.random.default_rng(0)
    base, deltas = rng.standard_normal((3, 5)), rng.standard_normal((2, 3, 5))
    d = np.full((2, 3), 0.5)
    assert merged_layer_weight(base, deltas, d, RowsParametrisation()).shape == (3, 5)
    with pytest.raises(ValidationError, match=r"'transposed_test': update\(d, deltas\) returned shape \(5, 3\), "
                                              r"expected \(3, 5\)"):
        merged_layer_weight(base, deltas, d, Transposed())


def test_family_sizes_and_domain_loaders_are_checked_when_registered() -> None:
    from mergeqp.solvers.instance_families import InstanceFamily

    with pytest.raises(ValidationError, match="K must be an integer >= 1, got 1.5"):
        InstanceFamily("half_test", 1.5, 10, "box", 0.5)
    pytest.importorskip("torch")
    from mergeqp.experiments.lm import register_domain

    with pytest.raises(ValidationError, match="the loader must be callable"):
        register_domain("loader_test", 5)


def test_a_parametrisations_design_and_tangents_are_checked_for_shape() -> None:
    """A user's tangents() one atom short or design() with the models and atoms swapped failed deep
    inside torch (a size mismatch); both are named with the parametrisation."""
    torch = pytest.importorskip("torch")
    from mergeqp.stats.parametrisation import checked_design, checked_tangents

    class Short(RowsParametrisation):
        name = "short_test"

        def tangents(self, Z, delta):
            return super().tangents(Z, delta)[:-1]

        def design(self, L, R, Z, deltas):
            return super().design(L, R, Z, deltas).transpose(2, 3)

    Z, delta = torch.randn(2, 5, 4), torch.randn(3, 4)  # (B, T, m1), (r, m1)
    assert tuple(checked_tangents(RowsParametrisation(), Z, delta).shape) == (3, 2, 5, 3)
    with pytest.raises(ValidationError, match=r"'short_test': tangents\(Z, delta\) returned shape \(2, 2, 5, 3\), "
                                              r"expected \(3, 2, 5, 3\)"):
        checked_tangents(Short(), Z, delta)
    L, deltas = torch.randn(2, 6, 5, 3), torch.randn(2, 3, 4)  # (B, c, T, r), (K, r, m1)
    R = torch.einsum("btm,krm->bktr", Z, deltas)
    assert tuple(checked_design(RowsParametrisation(), L, R, Z, deltas).shape) == (2, 6, 2, 3)
    with pytest.raises(ValidationError, match=r"design\(L, R, Z, deltas\) returned shape \(2, 6, 3, 2\)"):
        checked_design(Short(), L, R, Z, deltas)


def test_a_parametrisations_answers_of_another_dtype_are_cast_or_named() -> None:
    """A user's design() in float32 for float64 statistics failed inside torch's products (one line
    of dtype mismatch); it is now cast to the statistics' dtype, and an integer answer is named."""
    torch = pytest.importorskip("torch")
    from mergeqp.stats.parametrisation import checked_design, checked_tangents

    class Single(RowsParametrisation):
        name = "single_test"

        def design(self, L, R, Z, deltas):
            return super().design(L, R, Z, deltas).float().numpy()  # float32, and numpy

        def tangents(self, Z, delta):
            return super().tangents(Z, delta).round().long()

    Z = torch.randn(2, 5, 4, dtype=torch.float64)
    L, deltas = torch.randn(2, 6, 5, 3, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64)
    R = torch.einsum("btm,krm->bktr", Z, deltas)
    got = checked_design(Single(), L, R, Z, deltas)
    assert got.dtype == torch.float64 and torch.allclose(got, RowsParametrisation().design(L, R, Z, deltas), atol=1e-5)
    with pytest.raises(ValidationError, match=r"'single_test': tangents\(Z, delta\) returned torch.int64, not a "
                                              r"floating-point"):
        checked_tangents(Single(), Z, deltas[0])
