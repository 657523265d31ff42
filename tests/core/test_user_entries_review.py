"""A researcher's own entries, reviewed at stop 43: what a user registers is checked when it is
registered (its callables' signatures, its option and parameter types), a user's set whose
declared forms are wrong is named (not the solver that reads them), ``auto`` never keeps an
infeasible point while a registered solver that takes the set can do better, a user's merge
method that raises is named, and an unknown name points at importing one's own module."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import scipy.sparse as sp

import mergeqp as mq
from mergeqp.constraints import CONSTRAINT_SETS, ConstraintSet, LinearForm
from mergeqp.errors import (
    OWN_ENTRY_HINT,
    ConfigError,
    MergeMethodError,
    SolverError,
    UnknownNameError,
    ValidationError,
)
from mergeqp.merge.method import MethodParams, tensorwise_run
from mergeqp.merge.modes import MERGE_MODES, MergeMode, SingleMode
from mergeqp.merge.registry import MERGE_METHODS
from mergeqp.problem import MergeQP
from mergeqp.solution import SolveStatus
from mergeqp.solvers.base import QPSolver, RawResult
from mergeqp.solvers.registry import SOLVERS
from mergeqp.stats.bases import BASES
from mergeqp.stats.parametrisation import PARAMETRISATIONS, RowsParametrisation


def _problem(seed: int = 0) -> MergeQP:
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((30, 12))
    return MergeQP(A.T @ A, rng.standard_normal(12), 0.0, shape=(3, 4))


def _solver(name, answer, supports=lambda self, p, c: None, defaults=None):
    attrs = {"name": name, "supports": supports, "solve": lambda self, p, c, x0=None, **o: answer(p, c)}
    if defaults is not None:
        attrs["defaults"] = defaults
    return type(name, (QPSolver,), attrs)()


@pytest.fixture()
def cleanup():
    registries = (SOLVERS, CONSTRAINT_SETS, MERGE_METHODS, MERGE_MODES, BASES, PARAMETRISATIONS)
    before = [dict(r) for r in registries]
    yield
    for reg, old in zip(registries, before):
        for name in [n for n in reg if n not in old]:
            del reg[name]


class _Mode(SingleMode):
    def __init__(self, name, **attrs):
        self.name = name
        for k, v in attrs.items():
            setattr(self, k, v)


class _NoRun(MergeMode):
    name = "rev_norun"


class _P(MethodParams):
    scale: float = 1.0


@pytest.mark.parametrize(("register", "match"), [
    (lambda: mq.register_merge_mode(_NoRun()), r"does not override run\(ctx, sites\)"),
    (lambda: mq.register_merge_mode(_Mode("rev_opts", options=dict)), "options must be None or a pydantic BaseModel"),
    (lambda: mq.register_merge_method(dataclasses.replace(MERGE_METHODS["ties"], name="rev_dict", params=dict)),
     "params must be a subclass of mergeqp.merge.method.MethodParams"),
    (lambda: mq.register_merge_method(dataclasses.replace(
        MERGE_METHODS["ties"], name="rev_raw", params=_P, run=lambda name, base, fts, params, state: base)),
     r"run\(inputs, names, params\) cannot be called as documented .*signature is \(name, base, fts"),
    (lambda: mq.register_solver(_solver("rev_list", lambda p, c: None, defaults=["tol"])),
     "defaults must be a mapping"),
    (lambda: mq.register_solver(_solver("rev_a,b", lambda p, c: None)), "contains a comma"),
    (lambda: mq.register_basis("rev_basis", lambda stats, p: None), "cannot be called as documented"),
    (lambda: mq.register_constraint("rev_onearg", lambda args: None), "cannot be called as documented"),
], ids=["mode-no-run", "mode-options-dict", "method-params-dict", "method-run-signature", "solver-defaults-list",
        "solver-comma", "basis-signature", "parser-signature"])
def test_an_entry_that_would_fail_later_is_refused_when_registered(register, match, cleanup) -> None:
    before = {id(r): dict(r) for r in (SOLVERS, CONSTRAINT_SETS, MERGE_METHODS, MERGE_MODES, BASES)}
    with pytest.raises((ValidationError, ConfigError), match=match):
        register()
    assert {id(r): dict(r) for r in (SOLVERS, CONSTRAINT_SETS, MERGE_METHODS, MERGE_MODES, BASES)} == before


def test_a_parametrisation_may_not_take_a_basis_name(cleanup) -> None:
    named = RowsParametrisation()
    named.name = "svd"
    with pytest.raises(ValidationError, match="'svd' is a basis name"):
        mq.register_parametrisation(named)
    assert "svd" not in PARAMETRISATIONS


def test_auto_tries_a_registered_solver_when_its_choice_is_infeasible(cleanup) -> None:
    """A set only a user's solver can take (declared by an exact LMO): a garbage solver registered
    first returns d = 7; auto goes on to the registered solver that takes the set instead of keeping
    the infeasible point (clarabel / osqp cannot take the set), and says what it tried."""
    class _LmoBox(ConstraintSet):
        name = "rev_lmobox"
        polyhedral = True

        def violation(self, d):
            return float(max(0.0, -np.min(d), np.max(d) - 1.0))

        def linear_minimum(self, grad):
            return _box_lmo(grad)

        def lmo_method(self):
            return "exact"

    def _box_lmo(grad):
        from mergeqp.lower_bounds import LinearMinimum

        v = np.where(np.asarray(grad) > 0, 0.0, 1.0)
        return LinearMinimum(float(np.sum(grad * v)), v, "closed form", exact=True)

    def frank_wolfe(p, c):
        x = np.full(p.shape, 0.5)
        for k in range(20000):
            grad = p.gradient(x)
            s = c.linear_minimum(grad).s.reshape(p.shape)
            x = x + 2.0 / (k + 2.0) * (s - x)
        return RawResult(x, SolveStatus.OPTIMAL, 20000)

    problem = _problem()
    mq.register_solver(_solver("rev_garbage", lambda p, c: RawResult(np.full(p.shape, 7.0), SolveStatus.OPTIMAL)))
    mq.register_solver(_solver("rev_fw", frank_wolfe))
    sol = mq.solve(problem, _LmoBox())
    assert sol.solver == "rev_fw" and sol.certificate.feasible, sol.info.get("auto_tried")
    assert [t["solver"] for t in sol.info["auto_tried"]][:1] == ["rev_garbage"]
    assert any("rev_fw" in n for n in sol.certificate.notes)


def test_a_status_given_as_its_value_is_read_and_another_is_named(cleanup) -> None:
    problem = _problem()
    mq.register_solver(_solver("rev_text", lambda p, c: RawResult(np.full(p.shape, 0.5), "max_iterations")))
    mq.register_solver(_solver("rev_bad_status", lambda p, c: RawResult(np.full(p.shape, 0.5), "done")))
    assert mq.solve(problem, "box:0,1", solver="rev_text").status is SolveStatus.MAX_ITERATIONS
    with pytest.raises(SolverError, match=r"solver 'rev_bad_status' returned status 'done'.*SolveStatus.OPTIMAL"):
        mq.solve(problem, "box:0,1", solver="rev_bad_status")


def test_a_solvers_extras_are_checked_when_received_and_written_as_json(cleanup) -> None:
    """Stop 74 review: a user's solver's ``info`` holding a set made ``to_dict`` (and ``solve --out``,
    exit 70) fail naming neither; ``iterations="many"`` and ``info=None`` failed later in ``to_dict``."""
    import json

    problem = _problem()
    half = np.full(problem.shape, 0.5)
    mq.register_solver(_solver("rev_set_info", lambda p, c: RawResult(
        half, SolveStatus.OPTIMAL, info={"history": {2, 1}, "where": object(), "ok": np.float32(1.5)})))
    sol = mq.solve(problem, "box:0,1", solver="rev_set_info")
    written = json.loads(json.dumps(sol.to_dict()))
    assert written["info"]["history"] == [1, 2] and written["info"]["ok"] == 1.5
    assert written["info"]["where"].startswith("<object object")
    for name, raw, match in [
            ("rev_many", RawResult(half, SolveStatus.OPTIMAL, iterations="many"), r"iterations='many'.*whole number"),
            ("rev_neg", RawResult(half, SolveStatus.OPTIMAL, iterations=-1), r"iterations=-1"),
            ("rev_none_info", RawResult(half, SolveStatus.OPTIMAL, info=None), r"info of type NoneType.*must be a dict"),
            ("rev_key", RawResult(half, SolveStatus.OPTIMAL, info={1: "a"}), r"info with the non-string key 1")]:
        mq.register_solver(_solver(name, lambda p, c, raw=raw: raw))
        with pytest.raises(SolverError, match=rf"solver '{name}' returned {match}"):
            mq.solve(problem, "box:0,1", solver=name)
    mq.register_solver(_solver("rev_float_it", lambda p, c: RawResult(half, SolveStatus.OPTIMAL, iterations=np.float64(7))))
    assert mq.solve(problem, "box:0,1", solver="rev_float_it").to_dict()["iterations"] == 7


def test_a_users_basis_builder_is_checked_when_called_and_may_not_take_a_parametrisation_name(cleanup) -> None:
    """Stop 74 review: a builder returning p + 1 directions was taken silently, one that raised surfaced
    its raw ZeroDivisionError, and a basis could be named ``rows`` (then "rows:2" read as it)."""
    from mergeqp.stats import Basis
    from mergeqp.stats.bases import SiteResiduals, make_basis

    stats = SiteResiduals(6, np.random.default_rng(0).standard_normal((2, 6, 3)))
    mq.register_basis("rev_wide", lambda st, p, *, seed=0, task_weights=None: Basis(np.eye(st.r)[:, :p + 1], name="w"))
    mq.register_basis("rev_boom", lambda st, p, *, seed=0, task_weights=None: 1 / 0)
    mq.register_basis("rev_none", lambda st, p, *, seed=0, task_weights=None: None)
    mq.register_basis("rev_fine", lambda st, p, *, seed=0, task_weights=None: Basis(np.eye(st.r)[:, :p], name="f"))
    with pytest.raises(ValidationError, match=r"basis 'rev_wide' \(p = 2\): its builder returned a Basis of shape "
                                              r"\(6, 3\), not a Basis of shape \(6, 2\)"):
        make_basis("rev_wide", stats, 2)
    with pytest.raises(ValidationError, match=r"basis 'rev_boom' \(p = 2\): its builder failed: ZeroDivisionError"):
        make_basis("rev_boom", stats, 2)
    with pytest.raises(ValidationError, match=r"returned NoneType, not a Basis"):
        make_basis("rev_none", stats, 2)
    assert make_basis("rev_fine", stats, 2).Q.shape == (6, 2)
    with pytest.raises(ValidationError, match="basis name 'rows' is a parametrisation name"):
        mq.register_basis("rows", lambda st, p, *, seed=0, task_weights=None: None)


def test_small_finds_of_the_stop_74_review(cleanup) -> None:
    """'auto' is reserved (not "already registered"); reasons()/explain() name a bad rel_tol as
    certified() does (a bare ValueError from float())."""
    with pytest.raises(ValidationError, match="solver name 'auto' is reserved"):
        mq.register_solver(_solver("auto", lambda p, c: None))
    cert = mq.solve(_problem(), "box:0,1").certificate
    for call in (cert.reasons, cert.explain, cert.certified):
        with pytest.raises(ValidationError, match="rel_tol"):
            call("x")


class _WrongForm(ConstraintSet):
    name = "rev_wrongform"
    polyhedral = True

    def violation(self, d):
        return 0.0

    def linear_form(self, shape):
        n = shape[0] * shape[1] - 1
        return LinearForm(n, sp.csr_matrix((0, n)), np.zeros(0), sp.csr_matrix((0, n)), np.zeros(0),
                          np.zeros(n), np.ones(n))


class _RaisingForm(ConstraintSet):
    name = "rev_raising"
    polyhedral = True

    def violation(self, d):
        return 0.0

    def linear_form(self, shape):
        raise KeyError("rows")


class _WrongProjection(ConstraintSet):
    name = "rev_wrongproj"
    has_projection = True

    def violation(self, d):
        return float(max(0.0, -np.min(d), np.max(d) - 1.0))

    def project(self, d):
        return np.clip(d, 0, 1).ravel()[:-1]


class _ClaimsProjection(ConstraintSet):
    name = "rev_claims"
    has_projection = True

    def violation(self, d):
        return float(max(0.0, -np.min(d), np.max(d) - 1.0))


class _NanViolation(ConstraintSet):
    name = "rev_nan"

    def violation(self, d):
        return float("nan")

    def cvxpy(self, var):
        return [var >= 0, var <= 1]


@pytest.mark.parametrize(("cset", "solver", "match"), [
    (_WrongForm(), "clarabel", r"constraint set rev_wrongform: its linear_form\(\(3, 4\)\) is over n = 11 variables, "
                               "but d has 12"),
    (_WrongProjection(), "torch_fista", r"constraint set rev_wrongproj: its project\(d\) returned shape \(11,\)"),
    (_ClaimsProjection(), "auto", r"rev_claims: has_projection is True but it defines neither project\(d\) nor "
                                  r"structure\(shape\)"),
    (_NanViolation(), "auto", r"constraint set rev_nan: its violation\(d\) returned NaN"),
    (_RaisingForm(), "dense_ipm", r"constraint set rev_raising: its linear_form\(\(3, 4\)\) raised KeyError: 'rows'"),
    (_RaisingForm(), "auto", r"^constraint set rev_raising: its linear_form\(\(3, 4\)\) raised KeyError"),
], ids=["linear-form", "projection-shape", "projection-missing", "violation-nan", "form-raises", "form-raises-auto"])
def test_a_users_set_with_a_wrong_form_is_named_not_its_solver(cset, solver, match) -> None:
    pytest.importorskip("torch")
    with pytest.raises(ValidationError, match=match):
        mq.solve(_problem(), cset, solver=solver)


def test_a_users_merge_method_that_raises_is_named(cleanup) -> None:
    torch = pytest.importorskip("torch")

    def merge_one(name, base, finetuned, params, state):
        raise ValueError(f"{len(finetuned)} models, but weights for 2")

    mq.register_merge_method(mq.MergeMethod(name="rev_wavg", summary="x", reference="x", params=_P,
                                            run=tensorwise_run(merge_one, "rev_wavg")))
    sd = {"w": torch.zeros(2, 2)}
    with pytest.raises(MergeMethodError, match=r"merge method 'rev_wavg' failed: ValueError: 3 models, but "):
        mq.merge_state_dicts("rev_wavg", sd, [sd, sd, sd])
    mq.register_merge_method(mq.MergeMethod(name="rev_list", summary="x", reference="x", params=_P,
                                            run=lambda inputs, names, params: [1]))
    with pytest.raises(MergeMethodError, match="returned list, not a dict of tensors"):
        mq.merge_state_dicts("rev_list", sd, [sd, sd])


def test_an_unknown_name_without_a_close_one_points_at_importing_ones_module() -> None:
    with pytest.raises(UnknownNameError) as info:
        mq.solve(_problem(), "box:0,1", solver="quantum_annealer")
    assert OWN_ENTRY_HINT in str(info.value)
    with pytest.raises(UnknownNameError) as close:
        mq.solve(_problem(), "box:0,1", solver="clarabell")
    assert "did you mean 'clarabel'" in str(close.value) and OWN_ENTRY_HINT not in str(close.value)
    from mergeqp.solvers.instance_families import get_family

    with pytest.raises(UnknownNameError, match="valid instance families: "):
        get_family("no_such_family")


def test_import_plugins_names_the_module_of_a_clash_and_imports_a_file_once(tmp_path, monkeypatch, cleanup) -> None:
    from mergeqp.plugins import import_plugins

    (tmp_path / "rev_plugin_one.py").write_text(
        "import mergeqp\nfrom mergeqp.constraints import Box\n"
        "mergeqp.register_constraint('rev_plugcap', lambda a, s, c: Box(0, 0.5))\n")
    (tmp_path / "rev_plugin_two.py").write_text(
        "import mergeqp\nfrom mergeqp.constraints import Box\n"
        "mergeqp.register_constraint('rev_plugcap', lambda a, s, c: Box(0, 0.7))\n")
    monkeypatch.chdir(tmp_path)
    import_plugins(["rev_plugin_one.py", "rev_plugin_one", str(tmp_path / "rev_plugin_one.py")])  # one file, once
    assert mq.parse_constraint("rev_plugcap").spec.startswith("box")
    with pytest.raises(ConfigError, match=r"^--import rev_plugin_two.py: constraint set 'rev_plugcap' is already "
                                          r"registered \(by mergeqp itself or by a module imported before"):
        import_plugins(["rev_plugin_two.py"])
    with pytest.raises(ConfigError, match=r"^imports: missing.py: no such file"):
        import_plugins(["missing.py"], label="imports:", root=os.fspath(tmp_path))


def test_cvxpy_problem_is_the_qp_and_names_what_it_cannot_express() -> None:
    cp = pytest.importorskip("cvxpy")
    problem = _problem(3)
    prob, d = mq.cvxpy_problem(problem, "box:0,1 & simplex")
    assert d.shape == problem.shape
    prob.solve(solver=cp.CLARABEL)
    ours = mq.solve(problem, "box:0,1 & simplex")
    assert abs(prob.value - ours.objective) <= 1e-7 * max(1.0, abs(ours.objective))
    assert mq.certify(problem, "box:0,1 & simplex", d.value, rel_tol=1e-6).certified()
    with pytest.raises(ValidationError, match="declares no CVXPY form"):
        mq.cvxpy_problem(problem, _WrongProjection())
    matvec_only = MergeQP(None, problem.g, 0.0, shape=problem.shape, hessian_matvec=lambda x: problem.H @ x)
    with pytest.raises(ValidationError, match="needs an explicit H"):
        mq.cvxpy_problem(matvec_only)


class _RaisingViolation(ConstraintSet):
    name = "rev_raiseviol"

    def violation(self, d):
        raise IndexError("oops in violation")

    def cvxpy(self, var):
        return [var >= 0, var <= 1]


class _TransposedProjection(_WrongProjection):
    name = "rev_transproj"

    def project(self, d):
        return np.clip(d, 0, 1).T.copy()


def test_second_review_a_raising_violation_and_a_transposed_projection_name_the_set() -> None:
    pytest.importorskip("torch")
    with pytest.raises(ValidationError, match=r"rev_raiseviol: its violation\(d\) raised IndexError: oops"):
        mq.solve(_problem(), _RaisingViolation())
    with pytest.raises(ValidationError, match=r"rev_transproj: its project\(d\) returned shape \(4, 3\)"):
        mq.solve(_problem(), _TransposedProjection(), solver="torch_fista")


def test_a_failed_plugin_import_runs_again_once_fixed_and_config_modules_are_found_beside_it(
        tmp_path, monkeypatch, cleanup) -> None:
    from mergeqp.plugins import import_plugins

    plugin = tmp_path / "rev_flaky.py"
    plugin.write_text("import mergeqp\nfrom mergeqp.constraints import Box\n"
                      "mergeqp.register_constraint('rev_flaky_a', lambda a, s, c: Box(0, 1))\nraise RuntimeError('half done')\n")
    with pytest.raises(ConfigError, match="RuntimeError: half done"):
        import_plugins([str(plugin)])
    del CONSTRAINT_SETS["rev_flaky_a"]  # what the failed run registered (the user fixes the file)
    plugin.write_text("import mergeqp\nfrom mergeqp.constraints import Box\n"
                      "mergeqp.register_constraint('rev_flaky_a', lambda a, s, c: Box(0, 1))\n"
                      "mergeqp.register_constraint('rev_flaky_b', lambda a, s, c: Box(0, 1))\n")
    import_plugins([str(plugin)])  # runs again: a failed import is not an import
    assert {"rev_flaky_a", "rev_flaky_b"} <= set(CONSTRAINT_SETS)
    beside = tmp_path / "cfgdir"
    beside.mkdir()
    (beside / "rev_beside_mod.py").write_text(
        "import mergeqp\nfrom mergeqp.constraints import Box\n"
        "mergeqp.register_constraint('rev_beside', lambda a, s, c: Box(0, 1))\n")
    monkeypatch.chdir("/")
    import_plugins(["rev_beside_mod"], label="imports:", root=str(beside))
    assert "rev_beside" in CONSTRAINT_SETS


class _SignedViolation(ConstraintSet):
    """[0, 0.6] whose violation is a signed margin: negative inside the set."""
    name = "rev_signed"

    def violation(self, d):
        return float(max(np.max(d) - 0.6, -np.min(d)))

    def cvxpy(self, var):
        return [var >= 0, var <= 0.6]


def test_a_users_signed_violation_reads_as_zero_inside_the_set() -> None:
    pytest.importorskip("cvxpy")
    sol = mq.solve(_problem(), _SignedViolation(), solver="auto")
    ref = mq.solve(_problem(), "box:0,0.6", solver="active_set")
    assert sol.certificate.certified(1e-6) and sol.certificate.infeasibility == 0.0  # (a CVXPY-form set: its LP margin)
    assert sol.objective == pytest.approx(ref.objective, rel=1e-7, abs=1e-9)


class _RaisingCvxpy(ConstraintSet):
    name = "rev_raisecvx"

    def violation(self, d):
        return float(max(0.0, -np.min(d), np.max(d) - 1.0))

    def cvxpy(self, var):
        raise RuntimeError("boom in my cvxpy")


class _OneConstraintCvxpy(_RaisingCvxpy):
    name = "rev_onecvx"

    def cvxpy(self, var):
        return var >= 0  # not a list


class _NoSpec(_RaisingCvxpy):
    @property
    def spec(self):
        return None


@pytest.mark.parametrize("solver", ["auto", "cvxpy_clarabel"])
def test_fourth_review_a_users_cvxpy_form_or_spec_that_fails_is_named(solver) -> None:
    """(stop 46) A set whose cvxpy(var) raised escaped as that RuntimeError from the feasibility
    check's LP setup; a spec that is not a string as a TypeError from the first message joined."""
    pytest.importorskip("cvxpy")
    with pytest.raises(ValidationError, match=r"^constraint set rev_raisecvx: its cvxpy\(var\) raised RuntimeError: "
                                              r"boom in my cvxpy"):
        mq.solve(_problem(), _RaisingCvxpy() & mq.constraints.Box(0.0, 2.0), solver=solver)
    with pytest.raises(ValidationError, match=r"rev_onecvx: its cvxpy\(var\) must return a list of CVXPY "
                                              r"constraints, got Inequality"):
        mq.solve(_problem(), _OneConstraintCvxpy(), solver=solver)
    with pytest.raises(ValidationError, match=r"constraint set _NoSpec: its spec must be a non-empty string.*got None"):
        mq.solve(_problem(), _NoSpec(), solver=solver)


def test_a_plugin_file_imports_the_modules_beside_it(tmp_path, monkeypatch, cleanup) -> None:
    """(stop 51 review) a plugin file in another folder could not import a helper module next to it unless
    the command ran from that folder (``python FILE`` puts the file's folder on sys.path)."""
    from mergeqp.plugins import import_plugins

    (tmp_path / "plug").mkdir()
    (tmp_path / "plug" / "rev_helper_beside.py").write_text("UPPER = 0.25\n")
    (tmp_path / "plug" / "rev_uses_helper.py").write_text(
        "import mergeqp\nfrom mergeqp.constraints import Box\nfrom rev_helper_beside import UPPER\n"
        "mergeqp.register_constraint('rev_beside', lambda a, s, c: Box(0, UPPER))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    import_plugins(["plug/rev_uses_helper.py"])
    assert "0.25" in mq.parse_constraint("rev_beside").spec
