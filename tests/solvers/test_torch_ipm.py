"""torch_ipm (dense_ipm's interior point with its dense work in PyTorch): its backend against the
host's (the same Newton solves), the whole solver against dense_ipm and Clarabel on every kind of
polyhedral set, its options and errors, ``auto``'s choice, and CUDA against the CPU where a GPU is."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mergeqp.constraints import Box, L1Ball, Simplex, SignConsensus
from mergeqp.errors import ValidationError
from mergeqp.solvers.dense_ipm import DenseIpmSolver, _Ipm
from mergeqp.solvers.instance_families import draw
from mergeqp.solvers.ipm_linalg import HostLinalg, TorchLinalg
from mergeqp.solvers.registry import choose_solver, get_solver, solve
from mergeqp.solvers.torch_ipm import AUTO_MIN_N, AUTO_MIN_N_STARTED, device_bytes
from tests.solvers.test_dense_ipm import _sets as dense_ipm_sets
from tests.solvers.test_dense_ipm import problems as dense_ipm_cases


def _sign_sets(n: int, seed: int = 0) -> tuple:
    inst = draw("sign", seed, n)
    sign = [m for m in inst.constraints.members() if m.name == "sign"][0]
    r = inst.problem.shape[1]
    return inst.problem, {
        "box&sign": inst.constraints,  # bounds and per-atom sign rows
        "simplex&sign": Simplex(1.0) & sign,  # per-atom sums eliminated before the iteration
        "l1&sign": L1Ball(r / 4) & sign,  # the ball's auxiliaries eliminated from each Newton system
        "box&l1&sign": Box(0.0, 1.0) & L1Ball(r / 4) & sign,
    }


@pytest.mark.parametrize("kind", ["box&sign", "simplex&sign", "l1&sign", "box&l1&sign"])
def test_newton_solves_match_the_hosts(kind: str) -> None:
    """The torch backend (on the CPU) factorises the same normal matrix as the host's LAPACK
    one: float64 solves agree to 1e-9, the float32 ones (scaled, refined) to the refinement's
    accuracy, for a vector and a matrix right-hand side, at weights over 12 decades."""
    problem, sets = _sign_sets(192)
    opts = DenseIpmSolver().check_options({})
    host = _Ipm(problem, sets[kind], opts)
    dev = _Ipm(problem, sets[kind], opts, lambda H: TorchLinalg(H, "cpu"))
    assert isinstance(host.la, HostLinalg) and isinstance(dev.la, TorchLinalg)
    rng = np.random.default_rng(1)
    w = 10.0 ** rng.uniform(-4, 8, host.F.m)
    r = rng.standard_normal(host.F.N)
    R = rng.standard_normal((host.F.N, 3))
    x = rng.standard_normal(host.F.N)
    np.testing.assert_allclose(dev.hmul(x), host.hmul(x), rtol=1e-12, atol=1e-12 * np.max(np.abs(host.hmul(x))))
    for low, tol in ((False, 1e-9), (True, 1e-5)):
        a, b = dev.factorise(w, low), host.factorise(w, low)
        assert dev.factorisations == host.factorisations
        for rhs in (r, R):
            ya, yb = a(rhs), b(rhs)
            assert ya.shape == yb.shape and ya.dtype == np.float64
            np.testing.assert_allclose(ya, yb, rtol=tol, atol=tol * np.max(np.abs(yb)))


def test_reduced_hessian_on_the_device_matches_the_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eliminating one variable per row (``z_owner += coef z_keep``): the torch backend forms
    ``T'HT`` on its device in blocks and keeps it as its H; the same matrix as the host's, and
    the explicit product with a dense T."""
    from mergeqp.solvers import ipm_linalg
    from mergeqp.solvers.ipm_linalg import reduced_hessian

    rng = np.random.default_rng(5)
    N = 40
    B = rng.standard_normal((N, N))
    H = B @ B.T
    piv = np.arange(0, N, 4)  # one pivot per atom of 4
    keep = np.setdiff1d(np.arange(N), piv)
    owner = piv[keep // 4]
    coef = rng.standard_normal(keep.size)
    T = np.zeros((N, keep.size))
    T[keep, np.arange(keep.size)] = 1.0
    T[owner, np.arange(keep.size)] = coef
    host = reduced_hessian(H, keep, owner, coef)
    np.testing.assert_allclose(host, T.T @ H @ T, rtol=1e-12, atol=1e-12 * np.max(np.abs(host)))
    la = TorchLinalg(H, "cpu")
    monkeypatch.setattr(ipm_linalg, "DEVICE_BLOCK", 7)  # several blocks, the last one short
    assert la.reduce_hessian(keep, owner, coef) is None  # kept on the device
    dev = la.host_hessian()
    np.testing.assert_allclose(dev, host, rtol=1e-12, atol=1e-12 * np.max(np.abs(host)))
    assert np.array_equal(dev, dev.T)
    y = rng.standard_normal(keep.size)
    np.testing.assert_allclose(la.hmul(y), host @ y, rtol=1e-10)


@pytest.mark.parametrize("kind", ["box&sign", "simplex&sign", "l1&sign", "box&l1&sign"])
def test_same_answer_as_dense_ipm_and_clarabel(kind: str, rel_diff) -> None:
    problem, sets = _sign_sets(256, seed=2)
    ref = solve(problem, sets[kind], solver="clarabel")
    host = solve(problem, sets[kind], solver="dense_ipm")
    dev = solve(problem, sets[kind], solver="torch_ipm", device="cpu")  # bounded: no crossover by default
    crossed = solve(problem, sets[kind], solver="torch_ipm", device="cpu", crossover=True)
    assert dev.info["device"] == "cpu" and "device" not in host.info
    assert dev.info["crossover"] == [] and dev.info["crossover_face_solves"] == 0
    for sol in (dev, crossed):
        assert sol.certificate.certified(1e-9)
        assert rel_diff(sol.objective, host.objective) <= 1e-9
        assert sol.objective <= ref.objective + 1e-8 * abs(ref.objective)
    # with the crossover, the same iteration as dense_ipm's (only its rounding differs)
    assert abs(crossed.iterations - host.iterations) <= 1
    assert crossed.info["crossover"][-1].startswith("certified")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 3), st.integers(2, 8), st.integers(0, 2**31 - 1), st.sampled_from(["box", "simplex", "l1"]))
def test_random_problems_certify(K: int, m: int, seed: int, kind: str) -> None:
    """Random rank-deficient problems (H of rank about half of n), a sign set with each of a box,
    a simplex or an L1 ball: certified, at Clarabel's objective or below."""
    rng = np.random.default_rng(seed)
    n = K * m
    B = rng.standard_normal((n, max(1, n // 2)))
    from mergeqp.problem import MergeQP

    problem = MergeQP(B @ B.T, rng.standard_normal(n), 1.0, shape=(K, m))
    sign = SignConsensus.from_deltas(rng.standard_normal((K, m, 3)), "rows")
    cset = {"box": Box(0.0, 1.0), "simplex": Simplex(1.0), "l1": L1Ball(0.5 * m)}[kind] & sign
    sol = solve(problem, cset, solver="torch_ipm", device="cpu")
    ref = solve(problem, cset, solver="clarabel")
    assert sol.certificate.certified(1e-8)
    assert sol.objective <= ref.objective + 1e-7 * max(1.0, abs(ref.objective))


def test_a_stalled_interior_point_on_a_bounded_set_crosses_over() -> None:
    """"auto" crosses over from a stalled iterate: on this L1 & sign problem (n = 18, H of rank 9)
    the iteration's dual residual stops short and the certificate's gap is above 1e-8 of |J| with
    the crossover off. (Stop 56's instance, H of rank 6 of 12, stalled the same way until stop 66,
    whose rotation of the ball's sum row in the Schur complement lets the iteration itself reach
    the tolerance there: kept below.)"""
    from mergeqp.problem import MergeQP

    rng = np.random.default_rng(824)
    K, m = int(rng.integers(1, 4)), int(rng.integers(2, 9))
    B = rng.standard_normal((K * m, K * m // 2))
    problem = MergeQP(B @ B.T, rng.standard_normal(K * m), 1.0, shape=(K, m))
    cset = L1Ball(0.5 * m) & SignConsensus.from_deltas(rng.standard_normal((K, m, 3)), "rows")
    sol = solve(problem, cset, solver="torch_ipm", device="cpu")
    assert sol.info["crossover"] and sol.info["crossover"][-1].startswith("certified")
    assert sol.certificate.certified(1e-12)
    off = solve(problem, cset, solver="torch_ipm", device="cpu", crossover=False)
    assert off.info["crossover"] == [] and not off.certificate.certified(1e-8)

    rng = np.random.default_rng(9922974)
    B = rng.standard_normal((12, 6))
    problem = MergeQP(B @ B.T, rng.standard_normal(12), 1.0, shape=(3, 4))
    cset = L1Ball(2.0) & SignConsensus.from_deltas(rng.standard_normal((3, 4, 3)), "rows")
    off = solve(problem, cset, solver="torch_ipm", device="cpu", crossover=False)
    assert off.info["crossover"] == [] and off.certificate.certified(1e-8)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dense_ipm_cases, st.sampled_from(["auto", True]))
def test_every_kind_of_set_matches_dense_ipm(random_psd_problem, rel_diff, params, crossover) -> None:
    """dense_ipm's random problems over its twelve kinds of set (sign rows with boxes, simplices,
    half-open boxes, the L1 ball, a global simplex kept as an equality by a Schur complement,
    every coefficient fixed, overlapping equality rows, eliminated sums with the ball's
    auxiliaries; H of any rank down to 0): the torch backend, with the crossover by default
    ("auto": off on bounded sets) or always on, reaches dense_ipm's objective and certifies where
    it does."""
    K, m, frac, seed, which = params
    rng = np.random.default_rng(seed)
    problem = random_psd_problem(rng, K, m, round(frac * K * m))
    cset = dense_ipm_sets(K, m, rng)[which]
    host = solve(problem, cset, solver="dense_ipm", rel_tol=1e-7)
    dev = solve(problem, cset, solver="torch_ipm", device="cpu", crossover=crossover, rel_tol=1e-7)
    assert dev.certificate.feasible, dev.certificate.explain()
    if host.certificate.certified(1e-7) and not _rounding_slope_on_an_unbounded_set(problem, cset, dev):
        assert dev.certificate.certified(1e-7) or dev.certificate.at_rounding_floor, dev.certificate.explain()
    assert rel_diff(dev.objective, host.objective) <= 1e-6, (dev.objective, host.objective)


def _rounding_slope_on_an_unbounded_set(problem, cset, sol) -> bool:
    """The certificate's documented float64 limit (docs/certificates.md): on an unbounded set, a
    gradient that is all rounding (each entry within 100 x :func:`gradient_rounding`) can slope
    down along a ray of the set by a rounding error, and the Frank-Wolfe gap is then infinite
    although the point is optimal to float64 (hypothesis found one: ``nonneg & sign``, J* = 0,
    ``grad = [-2e-16, 0, 6e-17, -4e-16]``, where dense_ipm's point had ``grad = [2e-16, 0, 0, 0]``)."""
    from mergeqp.certificate import _gradient_rounding  # the certificate's own floor

    if cset.bounded or math.isfinite(sol.certificate.fw_gap):
        return False
    x = sol.d.ravel()
    grad = problem.H @ x + problem.g
    return float(np.abs(grad).max(initial=0.0)) <= 100.0 * _gradient_rounding(problem, x, grad)


def test_crossover_auto_is_on_only_for_unbounded_sets(rel_diff) -> None:
    """On an unbounded set (sign consensus over ``d >= 0``) the Frank-Wolfe certificate cannot
    bound the gap of an interior point: ``crossover`` "auto" turns the crossover on there (and
    the answer certifies, as dense_ipm's), and leaves it off on a bounded set."""
    rng = np.random.default_rng(4)
    K, m = 3, 40
    B = rng.standard_normal((K * m, K * m // 2))
    from mergeqp.problem import MergeQP

    problem = MergeQP(B @ B.T + 1e-3 * np.eye(K * m), rng.standard_normal(K * m), 0.0, shape=(K, m))
    sign = SignConsensus.from_deltas(rng.standard_normal((K, m, 3)), "rows")
    unbounded = Box(0.0, np.inf) & sign
    sol = solve(problem, unbounded, solver="torch_ipm", device="cpu")
    assert not unbounded.bounded and sol.info["crossover_face_solves"] >= 1
    assert sol.certificate.certified(1e-8), sol.certificate.explain()
    assert rel_diff(sol.objective, solve(problem, unbounded, solver="dense_ipm").objective) <= 1e-9
    off = solve(problem, unbounded, solver="torch_ipm", device="cpu", crossover=False)
    assert off.info["crossover_face_solves"] == 0
    bounded = solve(problem, Box(0.0, 1.0) & sign, solver="torch_ipm", device="cpu")
    assert bounded.info["crossover_face_solves"] == 0 and bounded.certificate.certified(1e-8)
    with pytest.raises(ValidationError, match="crossover"):
        solve(problem, unbounded, solver="torch_ipm", crossover="yes")


def test_options_and_errors(load_case) -> None:
    problem, _, _ = load_case("tiny96", "box:0,1")
    sign = SignConsensus.from_deltas(np.random.default_rng(0).standard_normal((*problem.shape, 2)), "rows")
    with pytest.raises(ValidationError, match="valid options"):
        solve(problem, Box(0, 1) & sign, solver="torch_ipm", cg_start=3)
    with pytest.raises(ValidationError, match="unknown torch device"):
        solve(problem, Box(0, 1) & sign, solver="torch_ipm", device="tpu")
    with pytest.raises(ValidationError, match="precision"):
        solve(problem, Box(0, 1) & sign, solver="torch_ipm", precision="half")
    if not torch.cuda.is_available():
        with pytest.raises(ValidationError, match="CUDA is not available"):
            solve(problem, Box(0, 1) & sign, solver="torch_ipm", device="cuda")
    assert "explicit H" in get_solver("torch_ipm").supports(
        type(problem)(None, problem.g, problem.c, shape=problem.shape, hessian_matvec=lambda v: problem.H @ v),
        Box(0, 1) & sign)


def test_out_of_device_memory_is_a_solver_error_that_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    from mergeqp.errors import SolverError
    from mergeqp.solvers import ipm_linalg

    problem, sets = _sign_sets(64)

    def no_room(self, H, device):  # noqa: ANN001 - the constructor it replaces
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(ipm_linalg.TorchLinalg, "__init__", no_room)
    with pytest.raises(SolverError, match="out of memory.*n = 64.*device='cpu', or dense_ipm"):
        solve(problem, sets["box&sign"], solver="torch_ipm", device="cpu")


def test_auto_keeps_dense_ipm_below_its_size_and_without_cuda() -> None:
    problem, sets = _sign_sets(256)
    assert choose_solver(problem, sets["box&sign"]).name == "dense_ipm"
    solver = get_solver("torch_ipm")
    why = solver.auto_declines(problem, sets["box&sign"])
    assert why is not None and str(AUTO_MIN_N_STARTED) in why
    if not torch.cuda.is_available():
        assert "CUDA" in solver.auto_declines(SimpleNamespace(n=AUTO_MIN_N), sets["box&sign"])


@pytest.mark.parametrize("n, started, chosen", [
    (AUTO_MIN_N_STARTED - 1, True, False),
    (AUTO_MIN_N_STARTED, True, True),  # CUDA already in use by this process
    (AUTO_MIN_N_STARTED, False, False),  # starting CUDA for one solve of this size does not pay
    (AUTO_MIN_N, False, True),
])
def test_auto_size_thresholds_on_a_cuda_machine(monkeypatch, n: int, started: bool, chosen: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: started)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (10**13, 10**13))
    solver = get_solver("torch_ipm")
    why = solver.auto_declines(SimpleNamespace(n=n), Box(0, 1))
    assert (why is None) == chosen, why
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (device_bytes(n) - 1, 10**13))
    assert "GB free" in solver.auto_declines(SimpleNamespace(n=max(n, AUTO_MIN_N)), Box(0, 1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("kind", ["box&sign", "simplex&sign", "l1&sign", "box&l1&sign"])
def test_cuda_matches_cpu(kind: str, rel_diff) -> None:  # pragma: no cover - needs a GPU
    problem, sets = _sign_sets(768, seed=1)
    host = solve(problem, sets[kind], solver="dense_ipm")
    gpu = solve(problem, sets[kind], solver="torch_ipm", device="cuda")
    assert gpu.info["device"].startswith("cuda") and gpu.certificate.certified(1e-9)
    assert rel_diff(gpu.objective, host.objective) <= 1e-9
