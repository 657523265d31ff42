"""(stop 47) A researcher's review of the Python API: each case was a silent wrong answer, an
uncertified answer another solver certifies, a raw traceback or a message that blamed the wrong
thing; each test fails on the code before the fix."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import mergeqp
from mergeqp import MergeQP
from mergeqp.constraints import ConstraintSet, SetStructure
from mergeqp.errors import BadDataError, UnsupportedError, ValidationError


def _problem(n: int = 6, shape: tuple[int, int] = (2, 3)) -> MergeQP:
    return MergeQP(np.eye(n), -np.ones(n), shape=shape)


# ---------------------------------------------------------------- silent wrong answers
@pytest.mark.parametrize("constraints", [{"simplex": 2}, {"box": (0, 0.1)}])
def test_a_dict_of_constraints_is_refused_not_read_as_its_keys(constraints) -> None:
    """It was solved over `simplex` / `box:0,1` (the keys' defaults), certified."""
    with pytest.raises(ValidationError, match="values would be dropped"):
        mergeqp.solve(_problem(), constraints)


def _layers_model():
    import torch

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 6))
    fts = [copy.deepcopy(base) for _ in range(2)]
    for ft in fts:
        with torch.no_grad():
            ft[0].weight.add_(0.1 * torch.randn_like(ft[0].weight))
            ft[2].weight.add_(0.1 * torch.randn_like(ft[2].weight))
    cal = [[torch.randn(16, 8)], [torch.randn(16, 8)]]
    return base, fts, cal


def test_a_solution_is_not_applied_to_another_layer_of_the_same_shape() -> None:
    """Layers '0' and '2' both have 6 rows: the QP of '2' was applied to '0' without a word."""
    import torch

    base, fts, cal = _layers_model()
    stats = mergeqp.collect_statistics(base, fts, "2", cal, progress=False)
    sol = mergeqp.solve(stats.problem("rows"), "box:0,1")
    assert sol.layer == "2" and sol.to_dict()["layer"] == "2"
    with pytest.raises(ValidationError, match="built for layer '2', not '0'"):
        mergeqp.apply_merge(base, fts, "0", sol)
    merged = mergeqp.apply_merge(base, fts, "2", sol)  # its own layer: as before
    assert not torch.equal(merged[2].weight, base[2].weight) and torch.equal(merged[0].weight, base[0].weight)
    mergeqp.apply_merge(base, fts, "0", sol.d)  # the bare coefficients: the user's choice


# ---------------------------------------------------------------- scale
@pytest.mark.parametrize("scale", [1e-8, 1e-12])
@pytest.mark.parametrize("solver", ["auto", "clarabel", "cvxpy_clarabel"])
def test_a_tiny_objective_is_certified_as_at_unit_scale(scale: float, solver: str) -> None:
    """H, g, c times 1e-10 (the same minimiser; fine-tunes with small residuals give such J):
    `auto` picked clarabel, whose absolute gap tolerance (1e-10) is no test at that size, and
    returned an uncertified point 0.058 from the minimiser; dense_ipm certified it."""
    rng = np.random.default_rng(7)
    K, r, m = 3, 8, 5
    n = K * r
    A = rng.standard_normal((3 * n, n))
    b = rng.standard_normal(3 * n)
    sets = [mergeqp.Box(0, 1), mergeqp.SignConsensus.from_deltas(rng.standard_normal((K, r, m)), "rows")]
    ref = mergeqp.solve(MergeQP(2 * A.T @ A, 2 * A.T @ b, c=float(b @ b), shape=(K, r)), sets, solver="dense_ipm")
    small = MergeQP(scale * 2 * A.T @ A, scale * 2 * A.T @ b, c=scale * float(b @ b), shape=(K, r))
    sol = mergeqp.solve(small, sets, solver=solver)
    assert sol.certificate.certified(), sol.certificate.explain()
    assert np.abs(sol.d - ref.d).max() < 1e-4


def test_osqp_drops_a_far_warm_start_it_calls_non_convex() -> None:
    """x0 = 1e300 everywhere: 'osqp: failed with status problem non convex' on a convex problem. On a set
    with a projection the start is projected first (stop 73), so the drop is needed only on the others."""
    sol = mergeqp.solve(_problem(), "box:0,1", solver="osqp", x0=np.full((2, 3), 1e300))
    assert sol.certificate.certified() and "warm_start" not in sol.info
    sign = mergeqp.Box(0, 1) & mergeqp.SignConsensus.from_deltas(np.random.default_rng(0).standard_normal((2, 3, 4)),
                                                                  "rows")
    assert not sign.has_projection
    sol = mergeqp.solve(_problem(), sign, solver="osqp", x0=np.full((2, 3), 1e300))
    assert sol.certificate.certified() and "dropped" in sol.info["warm_start"]


# ---------------------------------------------------------------- raw tracebacks
def test_a_set_intersects_with_a_spec_and_refuses_none() -> None:
    """`Box(0, 1) & "simplex"` was AttributeError: 'str' object has no attribute 'members'."""
    assert (mergeqp.Box(0, 1) & "simplex").spec == "box:0,1 & simplex"
    assert ("simplex" & mergeqp.Box(0, 1)).spec == "simplex & box:0,1"
    with pytest.raises(ValidationError, match="with None"):
        mergeqp.Box(0, 1) & None
    with pytest.raises(ValidationError, match="got int"):
        mergeqp.Box(0, 1) & 3


def test_certify_checks_its_problem_and_point() -> None:
    with pytest.raises(ValidationError, match="problem must be a MergeQP, got NoneType"):
        mergeqp.certify(None, "box:0,1", np.zeros((2, 3)))
    with pytest.raises(ValidationError, match="got None"):
        mergeqp.certify(_problem(), "box:0,1", None)


@pytest.mark.parametrize("solver", [["osqp", "clarabel"], {"osqp"}, None])
def test_a_solver_must_be_one_name(solver) -> None:
    """A list was TypeError: unhashable type: 'list'."""
    with pytest.raises(ValidationError, match="one solver's name"):
        mergeqp.solve(_problem(), "box:0,1", solver=solver)


def test_tolerances_that_are_not_numbers_are_named() -> None:
    problem = _problem()
    with pytest.raises(ValidationError, match="abs_tol must be a finite number >= 0, got 'x'"):
        mergeqp.solve(problem, "box:0,1", abs_tol="x")
    with pytest.raises(ValidationError, match="rel_tol must be a finite number"):
        mergeqp.certify(problem, "box:0,1", np.zeros((2, 3)), rel_tol="x")
    cert = mergeqp.certify(problem, "box:0,1", np.ones((2, 3)))
    with pytest.raises(ValidationError, match="rel_tol must be a finite number"):
        cert.certified("x")
    assert mergeqp.solve(problem, "box:0,1", rel_tol="1e-6").certified  # a number in a string still reads


@pytest.mark.parametrize("value, message", [(np.nan, "must be finite"), (np.ones(3), "takes one number"),
                                            ("x", "got a string")])
def test_constant_point_takes_one_finite_number(value, message) -> None:
    """NaN gave an all-NaN point; an array a raw TypeError; a string a bare ValueError."""
    with pytest.raises(ValidationError, match=message):
        _problem().constant_point(value)


def test_none_is_named_as_none_not_as_nan() -> None:
    with pytest.raises(ValidationError, match="got None"):
        MergeQP(np.eye(2), np.ones(2), c=None)
    with pytest.raises(ValidationError, match="box lower bound .* got None"):
        mergeqp.Box(None, 1)


class _WrongStructure(ConstraintSet):
    name = spec = "structwrong"
    bounded = True

    def violation(self, d):
        return float(max(0, -np.min(d), np.max(d) - 1))

    def structure(self, shape):
        return SetStructure(np.zeros(3), np.ones(3))


def test_a_user_structure_of_the_wrong_length_is_named() -> None:
    """numpy's 'cannot reshape array of size 3 into shape (2,3)' from the feasibility check."""
    with pytest.raises(ValidationError, match=r"structwrong: its structure\(\(2, 3\)\): lo has shape \(3,\), "
                                              r"expected \(6,\)"):
        mergeqp.solve(_problem(), _WrongStructure())


def _blocks_param(name: str, n_atoms=None, nan: bool = False):
    from mergeqp.stats.parametrisation import RowsParametrisation

    class Param(RowsParametrisation):
        def n_atoms(self, r, m1):
            return super().n_atoms(r, m1) if n_atoms is None else n_atoms

        def design(self, L, R, Z, deltas):
            A = super().design(L, R, Z, deltas)
            return A * float("nan") if nan else A

    Param.name = name
    return Param()


@pytest.mark.parametrize("param, error, message", [
    (_blocks_param("s47_negative_atoms", n_atoms=-1), ValidationError, r"n_atoms\(6, 7\) must be a whole number >= 1"),
    (_blocks_param("s47_nan_design", nan=True), BadDataError, "design.* returned NaN or inf"),
])
def test_a_user_parametrisation_that_answers_badly_is_named(param, error, message) -> None:
    """n_atoms -1 was torch's 'zeros: Dimension size must be non-negative'; a NaN design only
    'g contains 6 non-finite value(s)'."""
    base, fts, cal = _layers_model()
    with pytest.raises(error, match=message):
        mergeqp.collect_statistics(base, fts, "2", cal, progress=False, parametrisations=[param]).problem(param)


class _FloatOracle(ConstraintSet):
    name = spec = "lmowrongtype"
    bounded = True
    has_projection = True

    def violation(self, d):
        return float(max(0, -np.min(d), np.max(d) - 1))

    def project(self, d):
        return np.clip(d, 0, 1)

    def linear_minimum(self, grad):
        return 0.0


def test_a_user_oracle_of_the_wrong_type_is_blamed_on_the_set_not_the_solver() -> None:
    """solve said "solver 'torch_fista' failed: AttributeError: 'float' object has no attribute 'value'"."""
    with pytest.raises(ValidationError, match="lmowrongtype: linear_minimum"):
        mergeqp.solve(_problem(), _FloatOracle())


class _RaisingOracle(_FloatOracle):
    name = spec = "lmoraises"

    def linear_minimum(self, grad):
        raise KeyError("boom-lmo")


def test_a_user_oracle_that_raises_is_named_by_certify() -> None:
    """(stop 55 review) certify let the user's KeyError('boom-lmo') through as it was; its
    violation() was already named."""
    with pytest.raises(ValidationError, match=r"lmoraises: its linear_minimum\(grad\) raised KeyError: 'boom-lmo'"):
        mergeqp.certify(_problem(), _RaisingOracle(), np.full((2, 3), 0.5))


# ---------------------------------------------------------------- what the output says
def test_a_trimmed_sign_set_keeps_its_density_in_its_spec() -> None:
    """Both printed `sign`, though they are different sets with different optima."""
    rng = np.random.default_rng(0)
    deltas = rng.standard_normal((2, 3, 4))
    assert mergeqp.SignConsensus.from_deltas(deltas, "rows").spec == "sign"
    trimmed = mergeqp.SignConsensus.from_deltas(deltas, "rows", density=0.3)
    assert trimmed.spec == "sign:0.3"
    A = rng.standard_normal((20, 6))
    sol = mergeqp.solve(MergeQP(2 * A.T @ A, -np.ones(6), shape=(2, 3)), [mergeqp.Box(-1, 1), trimmed])
    assert sol.constraints == "box:-1,1 & sign:0.3" and "sign:0.3" in sol.certificate.explain()


def test_h_and_a_matvec_together_are_refused() -> None:
    """The callback was silently ignored (even one returning 3 H x)."""
    with pytest.raises(ValidationError, match="not both"):
        MergeQP(np.eye(2), np.ones(2), hessian_matvec=lambda x: 3 * x)


class _Ball(ConstraintSet):
    name = spec = "ball_s47"
    bounded = True

    def violation(self, d):
        return float(max(0.0, np.linalg.norm(d) - 1))

    def cvxpy(self, var):
        import cvxpy as cp

        return [cp.norm(cp.vec(var, order="C")) <= 1]


def test_the_hint_for_a_set_without_a_polyhedral_form_names_a_solver_that_takes_it() -> None:
    """It said 'use cvxpy_clarabel or cvxpy_osqp'; cvxpy_osqp refuses a cone."""
    with pytest.raises(UnsupportedError) as info:
        mergeqp.solve(_problem(), _Ball(), solver="dense_ipm")
    assert "use cvxpy_clarabel)" in str(info.value) and "cvxpy_osqp" not in str(info.value)
    sol = mergeqp.solve(_problem(), _Ball(), solver="cvxpy_clarabel")
    assert sol.certificate.feasible


@pytest.mark.parametrize("text, message", [("{not json", "not valid JSON"), ("[1, 2]", "must be a JSON object")])
def test_a_problem_file_with_damaged_metadata_is_refused(tmp_path, text: str, message: str) -> None:
    """It loaded with empty metadata (no layer, no parametrisation for apply_merge), silently;
    docs/core.md says a malformed file is a ValidationError naming the file."""
    path = tmp_path / "p.npz"
    np.savez(path, H=np.eye(2), g=np.ones(2), c=np.array(0.0), shape=np.array([1, 2]), metadata=np.array(text))
    with pytest.raises(ValidationError, match=message):
        MergeQP.load_npz(str(path))
