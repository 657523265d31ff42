"""The PyTorch solvers: matrix-vector-only H, float32, exact projections, devices."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeqp.constraints import Box, GlobalSimplex, L1Ball, Simplex
from mergeqp.problem import MergeQP
from mergeqp.solvers.registry import solve
from mergeqp.solvers.torch_projections import torch_projection


def matvec_copy(p: MergeQP, counter: list[int] | None = None) -> MergeQP:
    H = np.array(p.H)

    def mv(x: np.ndarray) -> np.ndarray:
        if counter is not None:
            counter[0] += 1
        return H @ x

    return MergeQP(None, p.g, p.c, shape=p.shape, hessian_matvec=mv)


@pytest.mark.parametrize("spec", ["box:0,1", "simplex", "box:0,1 & simplex"])
def test_fista_with_matvec_only_hessian(load_case, rel_diff, spec: str) -> None:
    problem, cset, ref = load_case("tiny96", spec)
    calls = [0]
    mv = matvec_copy(problem, calls)
    sol = solve(mv, cset, solver="torch_fista", device="cpu", dtype="float64", tol=1e-9)
    assert calls[0] > 10  # H was only ever used through the callback
    assert sol.info["matvec_only"] is True
    assert rel_diff(sol.objective, ref["objective"]) <= 1e-6
    assert sol.certificate.certified(1e-6), sol.certificate.explain()


def test_auto_uses_fista_for_matvec_only(load_case, rel_diff) -> None:
    problem, cset, ref = load_case("singular192", "box:0,1")
    sol = solve(matvec_copy(problem), cset, solver="auto")
    assert sol.solver == "torch_fista"
    assert rel_diff(sol.objective, ref["objective"]) <= 1e-6


def test_float32_paths(load_case, rel_diff) -> None:
    problem, cset, ref = load_case("mnist640", "box:0,1")
    sol = solve(problem, cset, solver="torch_fista", device="cpu", dtype="float32", tol=1e-6, max_iter=5000)
    assert sol.info["dtype"] == "float32"
    assert sol.certificate.feasible  # final projection in float64
    assert rel_diff(sol.objective, ref["objective"]) <= 1e-5
    # the active-set solver's mixed precision (float32 factor, float64 refinement) is exact
    exact = solve(problem, cset, solver="active_set", precision="mixed")
    assert rel_diff(exact.objective, ref["objective"]) <= 1e-12
    assert exact.certificate.certified(1e-10)
    adam = solve(problem, cset, solver="torch_adam", device="cpu", dtype="float32")
    assert adam.certificate.feasible


sets = st.sampled_from(["box", "nonneg", "simplex", "global", "capped", "l1", "l1c", "boxl1", "capped_global"])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 9), sets, st.integers(0, 2**31 - 1), st.sampled_from(["float64", "float32"]))
def test_torch_projection_matches_numpy(K: int, m: int, which: str, seed: int, dtype: str) -> None:
    rng = np.random.default_rng(seed)
    shape = (K, m)
    cset = {
        "box": Box(-0.3, 0.8), "nonneg": Box(0, np.inf), "simplex": Simplex(), "global": GlobalSimplex(2.0),
        "capped": Box(0, 1.0 if K == 1 else 0.6) & Simplex(), "l1": L1Ball(1.5),
        "l1c": L1Ball(0.7, rng.uniform(-1, 1, shape)), "boxl1": Box(-1, 1) & L1Ball(1.2),
        "capped_global": Box(0, max(0.4, 1.0 / (K * m))) & GlobalSimplex(1.0),
    }[which]
    v = rng.standard_normal(shape) * 3
    proj = torch_projection(cset, shape, torch.device("cpu"), getattr(torch, dtype))
    got = proj(torch.as_tensor(v.ravel(), dtype=getattr(torch, dtype))).double().numpy().reshape(shape)
    want = cset.project(v)
    tol = 1e-10 if dtype == "float64" else 1e-5
    assert np.max(np.abs(got - want)) <= tol * (1 + np.max(np.abs(v)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_fista_on_cuda(load_case, rel_diff) -> None:  # pragma: no cover - needs a GPU
    problem, cset, ref = load_case("mnist640", "simplex")
    for dtype, tol in (("float64", 1e-6), ("float32", 1e-4)):
        sol = solve(problem, cset, solver="torch_fista", device="cuda", dtype=dtype, tol=tol / 10)
        assert sol.info["device"].startswith("cuda")
        assert rel_diff(sol.objective, ref["objective"]) <= tol


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_progress_gradient_where_h_is_held(random_psd_problem, dtype: str) -> None:
    """The progress check's gradient comes from H where the solver holds it (float64 only):
    equal to the host's ``H x + g`` up to summation order, and the gap from it equals the
    host's; float32 (too coarse for the check) and matvec-only problems leave it to the host."""
    from mergeqp.solvers.torch_solvers import _progress, _TorchQP

    rng = np.random.default_rng(5)
    problem = random_psd_problem(rng, 3, 7, 4)
    cset = Box(0.0, 1.0)
    qp = _TorchQP(problem, cset, torch.device("cpu"), getattr(torch, dtype))
    x = rng.uniform(0, 1, problem.n)
    got = qp.float64_gradient(x)
    if dtype == "float32":
        assert got is None
        return
    want = problem.gradient(x.reshape(problem.shape)).ravel()
    assert got is not None and got.dtype == np.float64
    assert np.max(np.abs(got - want)) <= 1e-12 * (1 + np.max(np.abs(want)))
    J0, gap0, size0 = _progress(problem, cset, x, 1.0)
    J1, gap1, size1 = _progress(problem, cset, x, 1.0, got)
    assert abs(J1 - J0) <= 1e-12 * size0 and abs(gap1 - gap0) <= 1e-11 * size0 and size1 == pytest.approx(size0)
    H = problem.H
    matvec_only = MergeQP(None, problem.g, problem.c, shape=problem.shape, hessian_matvec=lambda v: H @ v)
    assert _TorchQP(matvec_only, cset, torch.device("cpu"), torch.float64).float64_gradient(x) is None


@pytest.mark.parametrize("seed", [0, 2, 3])
def test_fista_stops_at_roundoff_when_the_optimum_is_zero(random_psd_problem, seed: int) -> None:
    """J* = 0 (rank-2 H, the interpolating point inside the box): the relative target
    ``tol * 1e-8 size`` lies below float64 roundoff; FISTA must stop there, not run to
    ``max_iter``, and the point must still certify at the default tolerance."""

    problem = random_psd_problem(np.random.default_rng(seed), 3, 5, 2)
    sol = solve(problem, Box(0.0, 1.0), solver="torch_fista", dtype="float64", device="cpu",
                tol=1e-10, max_iter=20000)
    assert sol.status.value == "optimal" and sol.iterations < 2000, (sol.status, sol.iterations)
    assert sol.info["stopped_at_roundoff"] is True
    assert abs(sol.objective) <= 1e-12
    assert sol.certificate.certified()


def test_an_overflowing_iterate_is_the_solvers_not_the_sets():
    """(stop 46 review) At a scale of 1e300 torch_fista's iterate overflowed, and the built-in set
    was blamed: "constraint set nonneg: its project(d) returned NaN or inf"."""
    import mergeqp as mq
    from mergeqp.errors import SolverError

    rng = np.random.default_rng(5)
    A, b = rng.standard_normal((12, 6)), rng.standard_normal(12)
    # (since stop 67 the power iteration's norms do not overflow at 2e300, and the solve certifies
    # there, at active_set's J; at 1e307 the iterate itself overflows)
    p = mq.MergeQP(2e300 * A.T @ A, 2e300 * A.T @ b, c=1e300 * float(b @ b), shape=(2, 3))
    sol = mq.solve(p, "nonneg", solver="torch_fista")
    assert sol.certificate.certified()
    assert sol.objective == pytest.approx(mq.solve(p, "nonneg", solver="active_set").objective, rel=1e-9)
    with np.errstate(over="ignore", invalid="ignore"):
        p = mq.MergeQP(1e307 * A.T @ A, 1e307 * A.T @ b, c=0.5e307 * float(b @ b), shape=(2, 3))
        with pytest.raises(SolverError, match=r"iterate overflowed to NaN or inf before its projection onto nonneg"):
            mq.solve(p, "nonneg", solver="torch_fista")


def test_a_bad_dtype_option_names_the_solver_and_option():
    import mergeqp as mq
    from mergeqp.errors import ValidationError

    p = mq.MergeQP(np.eye(3), np.ones(3), shape=(1, 3))
    for solver in ("torch_fista", "torch_adam"):
        with pytest.raises(ValidationError, match=rf"^{solver}: option dtype='float16' must be one of float32, float64"):
            mq.solve(p, "box:0,1", solver=solver, dtype="float16")


@pytest.mark.parametrize("scale", [1e-170, 1.0, 1e150])
def test_fista_step_is_right_at_any_scale(scale: float) -> None:
    """The power iteration's norms factor out the largest entry: at H ~ 1e-170 the squares
    underflowed, lambda_max came back 0, the step was 1 (1e170 times too short) and the solver
    returned its start after all its iterations (a review's find, stop 67)."""
    rng = np.random.default_rng(2)
    A = rng.normal(size=(8, 15))
    p = MergeQP(A.T @ A * scale, rng.normal(size=15) * scale, 0.0, shape=(3, 5))
    sol = solve(p, Box(0.0, 1.0), solver="torch_fista")
    lam = float(np.linalg.eigvalsh(A.T @ A)[-1]) * scale
    assert lam * (1.0 - 1e-6) <= sol.info["lipschitz"] <= 1.1 * lam  # (1.05 lambda_max: the step's margin)
    assert sol.certificate.certified(1e-8)
