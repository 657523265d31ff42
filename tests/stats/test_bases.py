"""Bases, Theorem 4.1, the optimal basis (Corollary 4.2) and the relaxed lower bound."""

from __future__ import annotations

import cvxpy as cp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeqp.errors import UnknownNameError, ValidationError
from mergeqp.stats import (
    BASES,
    Basis,
    collect_statistics,
    make_basis,
    optimal_basis,
    random_basis,
)


@pytest.fixture(scope="session")
def linear_stats(finetuned_copies, linear_net):
    """Layer "1" (7 -> 6) with an exactly linear downstream L = W_3 (4 x 6): shared L."""

    def _linear_stats(seed: int, dims=(6, 7, 6, 4), n=(9, 8, 7), keep=True):
        base = linear_net(dims, seed=seed)
        fts = finetuned_copies(base, len(n), scale=0.4, seed=seed + 1)
        gen = torch.Generator().manual_seed(seed + 2)
        cal = [torch.randn(k, dims[0], generator=gen, dtype=torch.float64) for k in n]
        stats = collect_statistics(base, fts, "1", cal, keep_samples=keep, progress=False)
        L = base[2].weight.detach().numpy()
        return stats, L

    return _linear_stats


@pytest.fixture(scope="session")
def relu_stats(finetuned_copies):
    def _relu_stats(seed: int = 0):
        torch.manual_seed(seed)
        base = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 7),
                                   torch.nn.ReLU(), torch.nn.Linear(7, 5)).double()
        fts = finetuned_copies(base, 3, scale=0.3, seed=seed + 1)
        gen = torch.Generator().manual_seed(seed + 2)
        cal = [torch.randn(10, 6, generator=gen, dtype=torch.float64) for _ in range(3)]
        return collect_statistics(base, fts, "2", cal, keep_samples=True, progress=False)

    return _relu_stats


def _relaxed_by_least_squares(stats, Q):
    """Theorem 4.1's relaxed problem solved directly: each sample corrected independently
    inside span{L_j (I_T (x) Q)}."""
    total = 0.0
    for chunk in stats.samples:
        for Lj, bj in zip(chunk.jacobian, chunk.residual):
            M = np.einsum("ctr,rp->ctp", Lj, Q).reshape(Lj.shape[0], -1)
            v, *_ = np.linalg.lstsq(M, -bj, rcond=None)
            total += float(np.sum((bj + M @ v) ** 2))
    return total


def _unconstrained_min(problem):
    return problem.c - 0.5 * float(problem.g @ np.linalg.pinv(problem.H, rcond=1e-12, hermitian=True) @ problem.g)


def test_theorem_4_1_trace_formula_shared_L(linear_stats):
    stats, L = linear_stats(0)
    assert stats.jacobian_shared
    b = stats.residuals()
    S = b.T @ b
    np.testing.assert_allclose(stats.S(), S, rtol=1e-12, atol=1e-12)
    for Q in (random_basis(stats.r, 2, seed=1).Q, np.eye(stats.r)[:, :3]):
        U = np.linalg.svd(L @ Q, full_matrices=False)[0]
        P = U @ U.T
        by_trace = np.trace(S) - np.trace(S @ P)
        direct = _relaxed_by_least_squares(stats, Q)
        assert direct == pytest.approx(by_trace, rel=1e-10)
        for method in ("shared", "per_sample", "mean_jacobian"):
            assert stats.relaxed_bound(Q, method=method) == pytest.approx(by_trace, rel=1e-10)
        report = stats.energy_report(Q)
        assert report.fraction == pytest.approx(np.trace(S @ P) / np.trace(S), rel=1e-10)


def test_theorem_4_1_per_sample_form_with_varying_L(relu_stats):
    stats = relu_stats(3)
    assert not stats.jacobian_shared
    Q = random_basis(stats.r, 3, seed=4).Q
    report = stats.energy_report(Q)
    assert report.method == "per_sample"
    assert report.relaxed_bound == pytest.approx(_relaxed_by_least_squares(stats, Q), rel=1e-10)


def test_one_sample_qp_attains_the_relaxed_bound(linear_stats):
    """With one sample, tied coefficients cost nothing: the QP minimum is tr(S) - tr(S P)."""
    stats, _ = linear_stats(5, n=(1,))
    for p in (1, 2, 4):
        basis = random_basis(stats.r, p, seed=p)
        problem = stats.problem(basis)
        assert _unconstrained_min(problem) == pytest.approx(stats.relaxed_bound(basis), rel=1e-8)


def _competitors(stats, L, p, seed):
    comp = {name: make_basis(name, stats, p, seed=seed) for name in ("standard", "svd", "random")}
    comp["standard_first"] = Basis(np.eye(stats.r)[:, :p])
    # the back-projected eigenvectors (top-p of L'SL): not optimal in general
    w, V = np.linalg.eigh(L.T @ stats.S() @ L)
    comp["back_projected"] = Basis(V[:, np.argsort(w)[::-1][:p]])
    return comp


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), p=st.integers(1, 6))
def test_optimal_basis_captures_most_energy_shared_L(linear_stats, seed, p):
    stats, L = linear_stats(seed, keep=False)
    opt = optimal_basis(stats, p)
    e_opt = stats.energy_report(opt)
    assert e_opt.method == "shared"
    # Ky Fan: the top-min(p, rank L) eigenvalues of S restricted to range(L)
    U = np.linalg.svd(L, full_matrices=False)[0]
    evals = np.sort(np.linalg.eigvalsh(U.T @ stats.S() @ U))[::-1]
    assert e_opt.captured == pytest.approx(evals[:p].sum(), rel=1e-9, abs=1e-12)
    for name, basis in _competitors(stats, L, p, seed).items():
        assert e_opt.captured >= stats.energy_report(basis).captured - 1e-9 * e_opt.total, name
        assert stats.suboptimality_gap(basis, opt) >= -1e-9 * e_opt.total


def test_optimal_span_is_top_eigenspace_when_L_is_invertible(linear_stats):
    stats, L = linear_stats(11, dims=(5, 6, 4, 4))  # L = W_3 is 4 x 4, invertible
    S = stats.S()
    w, V = np.linalg.eigh(S)
    for p in (1, 2, 3):
        Up = V[:, np.argsort(w)[::-1][:p]]
        U = np.linalg.svd(L @ optimal_basis(stats, p).Q, full_matrices=False)[0]
        np.testing.assert_allclose(U @ U.T, Up @ Up.T, atol=1e-8)


@pytest.mark.parametrize("name", ["optimal", "standard", "svd", "random"])
def test_relaxed_bound_never_exceeds_the_solved_qp(linear_stats, relu_stats, name):
    stats, _ = linear_stats(21)
    relu = relu_stats(22)
    for s in (stats, relu):
        for p in (1, 3, s.r):
            basis = make_basis(name, s, p, seed=p)
            bound = s.relaxed_bound(basis)
            problem = s.problem(basis)
            unconstrained = _unconstrained_min(problem)
            x = cp.Variable(problem.n)
            objective = 0.5 * cp.quad_form(x, cp.psd_wrap(problem.H)) + problem.g @ x + problem.c
            box = cp.Problem(cp.Minimize(objective), [x >= 0, x <= 1])
            box.solve(solver=cp.CLARABEL)
            tol = 1e-9 * s.total_energy()
            assert bound <= unconstrained + tol
            assert unconstrained <= box.value + 1e-6 * s.total_energy()
            assert bound <= problem.objective(np.clip(x.value, 0, 1)) + tol


def test_suboptimality_gap_and_mean_jacobian_recorded(linear_stats, relu_stats):
    stats = relu_stats(30)
    opt = optimal_basis(stats, 3)
    assert opt.info["jacobian"] == "calibration-mean" and "note" in opt.info
    assert stats.suboptimality_gap(opt, opt) == pytest.approx(0.0, abs=1e-12)
    std = make_basis("standard", stats, 3)
    gap = stats.suboptimality_gap(std, opt, method="mean_jacobian")
    assert gap == pytest.approx(stats.relaxed_bound(std, method="mean_jacobian")
                                - stats.relaxed_bound(opt, method="mean_jacobian"), rel=1e-10, abs=1e-12)
    assert gap >= -1e-12  # optimal for the mean Jacobian
    shared, _ = linear_stats(31)
    assert optimal_basis(shared, 2).info["jacobian"] == "shared"


def test_basis_specs_and_registry(linear_stats):
    stats, _ = linear_stats(40, keep=False)
    assert set(BASES) >= {"standard", "svd", "random", "optimal"}
    a = stats.parametrisation("random:3:7")
    b = random_basis(stats.r, 3, seed=7)
    np.testing.assert_array_equal(a.basis.Q, b.Q)
    np.testing.assert_array_equal(random_basis(stats.r, 3, seed=7).Q, b.Q)
    assert not np.allclose(random_basis(stats.r, 3, seed=8).Q, b.Q)
    for spec in ("optimal:2", "svd:2", "standard:2"):
        basis = stats.parametrisation(spec).basis
        np.testing.assert_allclose(basis.Q.T @ basis.Q, np.eye(2), atol=1e-12)
        assert stats.problem(spec).shape == (stats.K, 2)  # built from the shared statistics
    with pytest.raises(UnknownNameError, match="valid basis names: optimal, random, standard, svd"):
        make_basis("nope", stats, 2)
    with pytest.raises(ValidationError, match="p must be an integer in"):
        make_basis("optimal", stats, 0)
    with pytest.raises(ValidationError, match="p must be an integer in"):
        make_basis("random", stats, stats.r + 1)
    with pytest.raises(ValidationError, match="not orthonormal"):
        Basis(np.ones((stats.r, 2)))
    with pytest.raises(ValidationError, match="rows but the merge layer"):
        stats.problem(Basis(np.eye(stats.r + 1)[:, :2]))
