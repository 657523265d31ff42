"""Bad input to the solvers, and the ``auto`` dispatch."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from _solver_helpers import random_psd_problem

from mergeqp.constraints import Box, L1Ball, SignConsensus, Simplex, UserConstraints
from mergeqp.errors import (
    InfeasibleError,
    UnknownNameError,
    UnsupportedError,
    ValidationError,
)
from mergeqp.problem import MergeQP
from mergeqp.solvers.registry import SOLVERS, choose_solver, solve


@pytest.fixture()
def problem() -> MergeQP:
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
    assert choose_solver(problem, Box(0, 1) & sign).name == "clarabel"
    user = UserConstraints(lambda v: v <= 1)
    assert choose_solver(problem, Box(0, 1) & user).name == "cvxpy_clarabel"
    with pytest.raises(UnsupportedError, match="no registered solver"):
        choose_solver(matvec_only(problem), user)


def test_auto_size_threshold_declines_active_set(problem: MergeQP, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(type(SOLVERS["active_set"]), "auto_max_n", 5)
    assert choose_solver(problem, Box(0, 1)).name == "torch_fista"


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
