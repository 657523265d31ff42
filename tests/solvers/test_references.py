"""Every solver x every built-in constraint set against the certified references in problems/."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mergeqp.errors import InfeasibleError
from mergeqp.solvers.reference_problems import (
    constraint_from_spec,
    load_reference_problem,
    load_references,
    reference_path,
)
from mergeqp.solvers.registry import SOLVERS, solve
from tests.solvers.reference_cases import COMMITTED, EXACT_SOLVERS, reference_cases

CASES = reference_cases()


@pytest.mark.parametrize("solver", list(EXACT_SOLVERS))
@pytest.mark.parametrize(("name", "spec"), CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_exact_solver_matches_reference_and_certifies(load_case, rel_diff, solver: str, name: str, spec: str) -> None:
    problem, cset, ref = load_case(name, spec)
    why = SOLVERS[solver].supports(problem, cset)
    if why is not None:
        pytest.skip(f"{solver} does not support {spec}: {why}")
    sol = solve(problem, cset, solver=solver, **EXACT_SOLVERS[solver])
    assert sol.solver == solver
    assert sol.d.shape == problem.shape
    assert sol.certificate is not None
    assert sol.certificate.certified(1e-6), sol.certificate.explain()
    assert rel_diff(sol.objective, ref["objective"]) <= 1e-6, (sol.objective, ref["objective"])
    # the certificate's lower bound never exceeds the reference optimum (up to rounding)
    assert sol.certificate.lower_bound <= ref["objective"] + 1e-9 * abs(ref["objective"])


@pytest.mark.parametrize(("name", "spec"), CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_paper_adam_is_feasible_and_never_beats_the_optimum(load_case, name: str, spec: str) -> None:
    problem, cset, ref = load_case(name, spec)
    if SOLVERS["torch_adam"].supports(problem, cset) is not None:
        pytest.skip("no projection for this set")
    sol = solve(problem, cset, solver="torch_adam", device="cpu")
    assert sol.certificate.feasible
    assert sol.objective >= ref["objective"] - 1e-9 * abs(ref["objective"])
    assert sol.iterations == 500


def test_paper_adam_reaches_the_box_optimum_on_mnist640(load_case, rel_diff) -> None:
    problem, cset, ref = load_case("mnist640", "box:0,1")
    sol = solve(problem, cset, solver="torch_adam", device="cpu")
    assert rel_diff(sol.objective, ref["objective"]) <= 1e-4


@pytest.mark.parametrize("name", COMMITTED)
def test_reference_files_are_consistent(rel_diff, name: str) -> None:
    """Stored d reproduces the stored objective, is certified, and an independent solver agrees."""
    refs = load_references(name)
    problem = load_reference_problem(name, generate=False)
    root = reference_path(name).parent
    assert refs["n"] == problem.n and tuple(refs["shape"]) == problem.shape
    for spec, ref in refs["optima"].items():
        d = np.load(root / ref["d_file"])
        assert d.shape == problem.shape
        assert abs(problem.objective(d) - ref["objective"]) <= 1e-12 * max(1.0, abs(ref["objective"]))
        cert = solve.__globals__["certify"](problem, constraint_from_spec(spec), d)
        assert cert.certified(1e-8), (spec, cert.explain())
        others = [v for k, v in ref["cross_check"].items() if k != ref["solver"] and "objective" in v]
        assert others, f"{name} {spec}: no independent cross-check"
        assert min(rel_diff(v["objective"], ref["objective"]) for v in others) <= 1e-8


@pytest.mark.parametrize("solver", ["active_set", "clarabel", "osqp", "cvxpy_clarabel", "torch_fista"])
def test_infeasible_reference_raises(solver: str) -> None:
    refs = load_references("tiny96")
    assert refs["infeasible"], "tiny96 stores infeasible constraint sets"
    problem = load_reference_problem("tiny96", generate=False)
    for bad in refs["infeasible"]:
        with pytest.raises(InfeasibleError, match="empty|infeasible"):
            solve(problem, constraint_from_spec(bad["constraints"]), solver=solver)


@pytest.mark.parametrize("solver", ["clarabel", "osqp", "cvxpy_clarabel", "cvxpy_osqp"])
def test_solver_reports_infeasibility_itself(solver: str) -> None:
    """With the up-front feasibility check off, the solver's own status becomes InfeasibleError."""
    problem = load_reference_problem("tiny96", generate=False)
    with pytest.raises(InfeasibleError, match=solver):
        solve(problem, constraint_from_spec("box:0,0.2 & simplex"), solver=solver, check_feasibility=False)


def test_committed_instances_are_in_git_sized_files() -> None:
    root = reference_path("tiny96").parent
    for name in COMMITTED:
        data = json.loads(Path(reference_path(name)).read_text())
        assert data["committed"] is True
        assert (root / data["file"]).stat().st_size < 4_000_000
