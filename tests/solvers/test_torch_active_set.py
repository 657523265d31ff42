"""torch_active_set (PDAS for boxes in PyTorch): against the stored optima of the committed
instances, against active_set on random (also singular) problems and drawn instance families,
its errors and options, warm starts, ``auto``'s choice, and CUDA against the CPU where a GPU is."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mergeqp.constraints import Box, Simplex
from mergeqp.errors import UnsupportedError, ValidationError
from mergeqp.problem import MergeQP
from mergeqp.solvers.instance_families import draw
from mergeqp.solvers.registry import choose_solver, get_solver, solve
from mergeqp.solvers.torch_active_set import AUTO_MIN_N, AUTO_MIN_N_STARTED


@pytest.mark.parametrize("name, spec", [("mnist_real640", "box:0,1"), ("singular192", "box:0,1"),
                                        ("mnist640", "box:-1,2"), ("tiny96", "box:0,1"), ("k1_100", "box:0,1")])
def test_reaches_the_stored_optimum(load_case, rel_diff, name: str, spec: str) -> None:
    """The committed instances, the real singular MNIST QP (84 zero rows, rank 553) included:
    certified at 1e-8 and equal to the stored optimum (itself agreed by three solvers)."""
    problem, cset, ref = load_case(name, spec)
    sol = solve(problem, cset, solver="torch_active_set", device="cpu")
    assert sol.certificate.certified(), sol.certificate
    assert sol.status.value == "optimal"
    assert rel_diff(sol.objective, ref["objective"]) <= 1e-9
    assert sol.info["device"] == "cpu"


@pytest.mark.parametrize("family", ["box", "box_ill", "box_singular", "box_natural"])
def test_instance_families_match_their_planted_optimum(family: str) -> None:
    inst = draw(family, 3, n=384)
    sol = solve(inst.problem, inst.constraints, solver="torch_active_set", device="cpu")
    ref = solve(inst.problem, inst.constraints, solver="active_set")
    assert sol.certificate.certified()
    assert abs(sol.objective - ref.objective) <= 1e-9 * max(abs(ref.objective), 1.0)
    if inst.objective is not None:  # planted: the optimum is known in closed form
        assert abs(sol.objective - inst.objective) <= 1e-8 * max(abs(inst.objective), 1.0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(K=st.integers(1, 4), m=st.integers(2, 20), rank_frac=st.floats(0.2, 1.0), seed=st.integers(0, 2**31 - 1),
       lo=st.floats(-1.0, 0.0), width=st.floats(0.1, 2.0), scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_matches_active_set_on_random_problems(random_psd_problem, K, m, rank_frac, seed, lo, width, scale) -> None:
    """Random merge-like QPs, singular when the rank is below K m, any finite box: the point
    certifies, or (interpolating problems, J* ~ 0, where the relative target lies below float64
    rounding) its gap is at the certificate's own rounding floor, and its J equals active_set's
    (an independent implementation) to 1e-9 of the certificate's scale or within rounding."""
    rng = np.random.default_rng(seed)
    problem = random_psd_problem(rng, K, m, max(1, int(rank_frac * K * m)), scale)
    cset = Box(lo, lo + width)
    sol = solve(problem, cset, solver="torch_active_set", device="cpu")
    ref = solve(problem, cset, solver="active_set")
    assert sol.certificate.certified() or sol.certificate.at_rounding_floor, (sol.certificate, sol.info)
    # J to 1e-9 of the certificates' scale, or within both points' float64 rounding of J
    tol = 1e-9 * max(sol.certificate.scale, ref.certificate.scale) + sol.certificate.rounding + ref.certificate.rounding
    assert sol.objective <= ref.objective + tol, (sol.objective, ref.objective)
    assert ref.objective <= sol.objective + tol + ref.certificate.fw_gap


def test_interpolating_problem_ends_at_the_floor_without_cycling(random_psd_problem) -> None:
    """J* ~ 0 at scale 1e3, rank 8 of 42, box [0, 0.1] (found by hypothesis): the plain solve on
    the proximal point's face fails there, and the solver once went back and forth between that
    jump and the proximal point until max_iter. It must stop at the rounding floor, soon."""
    problem = random_psd_problem(np.random.default_rng(2_147_483_647), 3, 14, 8, 1000.0)
    sol = solve(problem, Box(0.0, 0.1), solver="torch_active_set", device="cpu")
    assert sol.status.value == "optimal" and sol.iterations < 100, (sol.status, sol.iterations)
    assert sol.certificate.certified() or sol.certificate.at_rounding_floor


def test_zero_rows_and_a_duplicated_model_go_through_the_ridge(rel_diff) -> None:
    """Dead units (zero rows and columns of H, g = 0 there) and a model identical to another
    make face blocks singular: ridged face solves, and still the certified optimum."""
    rng = np.random.default_rng(7)
    K, m, N = 3, 24, 30
    A = rng.standard_normal((N, K * m))
    A[:, m:2 * m] = A[:, :m]  # model 2 = model 1
    dead = rng.choice(m, 5, replace=False)
    for k in range(K):
        A[:, k * m + dead] = 0.0
    b = rng.standard_normal(N)
    problem = MergeQP(2 * A.T @ A, 2 * A.T @ b, float(b @ b), shape=(K, m))
    sol = solve(problem, Box(0, 1), solver="torch_active_set", device="cpu")
    ref = solve(problem, Box(0, 1), solver="clarabel")
    assert sol.certificate.certified()
    assert sol.objective <= ref.objective + 1e-9 * max(abs(ref.objective), 1.0)
    assert rel_diff(sol.objective, ref.objective) <= 1e-7


def test_warm_start_at_the_optimum_needs_no_face_solve(load_case) -> None:
    problem, cset, _ = load_case("mnist640", "box:-1,2")
    cold = solve(problem, cset, solver="torch_active_set", device="cpu")
    warm = solve(problem, cset, solver="torch_active_set", device="cpu", x0=cold.d)
    assert warm.certificate.certified() and warm.iterations <= 1 < cold.iterations


def test_refuses_what_it_does_not_handle(load_case) -> None:
    problem, _, _ = load_case("tiny96", "box:0,1")
    solver = get_solver("torch_active_set")
    assert "boxes only" in solver.supports(problem, Simplex())
    assert "finite bounds" in solver.supports(problem, Box(0, np.inf))
    matvec_only = MergeQP(None, problem.g, problem.c, shape=problem.shape, hessian_matvec=lambda v: problem.H @ v)
    assert "explicit H" in solver.supports(matvec_only, Box(0, 1))
    with pytest.raises(UnsupportedError, match="torch_active_set"):
        solve(problem, Simplex(), solver="torch_active_set")
    with pytest.raises(ValidationError, match="prox_decrease"):
        solve(problem, Box(0, 1), solver="torch_active_set", prox_decrease=1.0)
    with pytest.raises(ValidationError, match="valid options"):
        solve(problem, Box(0, 1), solver="torch_active_set", warm_steps=3)
    if not torch.cuda.is_available():
        with pytest.raises(ValidationError, match="CUDA is not available"):
            solve(problem, Box(0, 1), solver="torch_active_set", device="cuda")


def test_auto_keeps_active_set_below_its_size_and_without_cuda(load_case) -> None:
    problem, cset, _ = load_case("mnist640", "box:-1,2")
    assert choose_solver(problem, cset).name == "active_set"
    solver = get_solver("torch_active_set")
    why = solver.auto_declines(problem, cset)
    assert why is not None and "1536" in why  # below its measured size, without importing torch
    if not torch.cuda.is_available():  # a large box on a machine without CUDA: active_set's
        assert "CUDA" in solver.auto_declines(SimpleNamespace(n=AUTO_MIN_N), cset)


@pytest.mark.parametrize("n, started, chosen", [
    (AUTO_MIN_N_STARTED - 1, True, False),  # below every measured size
    (AUTO_MIN_N_STARTED, True, True),  # CUDA already in use by this process (a merge on cuda)
    (AUTO_MIN_N_STARTED, False, False),  # starting CUDA for one solve of this size does not pay
    (AUTO_MIN_N - 1, False, False),
    (AUTO_MIN_N, False, True),  # large enough to pay for the start
])
def test_auto_size_thresholds_on_a_cuda_machine(monkeypatch, n, started, chosen) -> None:
    """``auto``'s cost model on a (simulated) CUDA machine with room for H: from
    AUTO_MIN_N_STARTED variables once this process has started CUDA, from AUTO_MIN_N otherwise;
    too little free memory declines at any size."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: started)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (10**12, 10**12))
    solver = get_solver("torch_active_set")
    why = solver.auto_declines(SimpleNamespace(n=n), Box(0, 1))
    assert (why is None) == chosen, why
    if not chosen and n >= AUTO_MIN_N_STARTED:
        assert "not started CUDA" in why
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (10**6, 10**12))
    assert "GB free" in solver.auto_declines(SimpleNamespace(n=max(n, AUTO_MIN_N)), Box(0, 1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_matches_cpu(load_case, rel_diff) -> None:  # pragma: no cover - needs a GPU
    problem, cset, ref = load_case("mnist_real640", "box:0,1")
    gpu = solve(problem, cset, solver="torch_active_set", device="cuda")
    assert gpu.info["device"].startswith("cuda") and gpu.certificate.certified()
    assert rel_diff(gpu.objective, ref["objective"]) <= 1e-9


def test_out_of_device_memory_is_a_clear_solver_error(load_case, monkeypatch) -> None:
    """An allocation that fails on the device (simulated: the CPU has no such limit) stops with
    a SolverError that says how much the problem needs and what to use instead, not torch's
    traceback."""
    from mergeqp.errors import SolverError
    from mergeqp.solvers import torch_active_set

    def no_memory(self, status, x):  # noqa: ANN001 - the face solve's signature
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    monkeypatch.setattr(torch_active_set._BoxPDAS, "face_solve", no_memory)
    problem, cset, _ = load_case("mnist640", "box:-1,2")
    with pytest.raises(SolverError, match=r"out of memory on cpu: n = 640 needs up to .* GB.*active_set"):
        solve(problem, cset, solver="torch_active_set", device="cpu", cg_start=0)


def test_refusals_name_what_it_takes_and_what_to_use() -> None:
    """A review of stop 75: on sign consensus it gave active_set's wording (the sets *that* solver takes)."""
    from mergeqp.solvers.instance_families import draw
    from mergeqp.solvers.registry import get_solver

    solver = get_solver("torch_active_set")
    sign, simplex = draw("sign", 0, n=48), draw("simplex", 0, n=48)
    assert solver.supports(sign.problem, sign.constraints) == \
        "handles boxes only, not box:0,1 & sign (use dense_ipm or torch_ipm)"
    assert solver.supports(simplex.problem, simplex.constraints) == "handles boxes only, not simplex (use active_set)"
