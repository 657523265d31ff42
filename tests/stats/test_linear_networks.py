"""Exactly linear networks: the QP objective is the true squared output error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mergeqp.stats import Basis, apply_merge, collect_statistics, random_basis
from tests.stats.tiny_models import LinearSequence

PARAMS = ["rows", "scalar", "columns", "basis"]


def _param(spec, r, seed=3):
    if spec == "basis":
        return random_basis(r, max(1, r - 1), seed=seed)
    return spec


@pytest.fixture(scope="module")
def linear_case(finetuned_copies, linear_net):
    base = linear_net((6, 5, 4, 3), seed=1)
    fts = finetuned_copies(base, 3, scale=0.3, seed=2)  # every layer differs: targets exact too
    gen = torch.Generator().manual_seed(5)
    cal = [torch.randn(n, 6, generator=gen, dtype=torch.float64) for n in (11, 7, 9)]
    stats = collect_statistics(base, fts, "1", cal, parametrisations=["rows", "scalar", "columns"],
                               keep_samples=True, batch_size=4, progress=False)
    return base, fts, cal, stats


@pytest.mark.parametrize("spec", PARAMS)
def test_objective_equals_true_error(true_error, linear_case, spec):
    base, fts, cal, stats = linear_case
    param = _param(spec, stats.r)
    problem = stats.problem(param)
    rng = np.random.default_rng(0)
    for _ in range(3):
        d = rng.normal(size=problem.shape)
        merged = apply_merge(base, fts, "1", d, param)
        truth = true_error(merged, fts, cal)
        assert problem.objective(d) == pytest.approx(truth, rel=1e-10)
    assert problem.c == pytest.approx(true_error(base, fts, cal), rel=1e-12)


@pytest.mark.parametrize("spec", PARAMS)
def test_every_source_gives_the_same_problem(linear_case, spec):
    _, _, _, stats = linear_case
    param = _param(spec, stats.r)
    sources = stats.sources(param)
    assert "samples" in sources and "shared" in sources
    assert stats.jacobian_shared
    weights = [0.5, 2.0, 1.0]
    ref = stats.problem(param, task_weights=weights, source=sources[0])
    for source in sources[1:]:
        other = stats.problem(param, task_weights=weights, source=source)
        np.testing.assert_allclose(other.H, ref.H, rtol=1e-10, atol=1e-10 * np.abs(ref.H).max())
        np.testing.assert_allclose(other.g, ref.g, rtol=1e-10, atol=1e-10 * np.abs(ref.g).max())
        assert other.c == pytest.approx(ref.c, rel=1e-12)


def test_task_weights_weight_each_task_error(true_error, linear_case):
    base, fts, cal, stats = linear_case
    w = np.array([0.2, 3.0, 1.5])
    problem = stats.problem("rows", task_weights=w)
    d = np.random.default_rng(1).normal(size=problem.shape)
    merged = apply_merge(base, fts, "1", d)
    per_task = [true_error(merged, [ft], [x]) for ft, x in zip(fts, cal)]
    assert problem.objective(d) == pytest.approx(float(w @ per_task), rel=1e-10)
    mean = stats.problem("rows", task_weights="mean")
    expected = sum(e / x.shape[0] for e, x in zip(per_task, cal))
    assert mean.objective(d) == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize("spec", ["rows", "scalar", "basis"])
def test_unconstrained_optimum_is_least_squares(linear_case, spec):
    """Independent reference: the design matrix from merged-model outputs at unit vectors."""
    base, fts, cal, stats = linear_case
    param = _param(spec, stats.r)
    problem = stats.problem(param)
    n = problem.n
    X = torch.cat(cal)
    Y = torch.cat([ft(x) for ft, x in zip(fts, cal)]).detach()
    with torch.no_grad():
        h0 = base(X)
        columns = []
        for a in range(n):
            e = np.zeros(n)
            e[a] = 1.0
            columns.append((apply_merge(base, fts, "1", e, param)(X) - h0).reshape(-1).numpy())
    A = np.stack(columns, axis=1)
    b = (h0 - Y).reshape(-1).numpy()
    d_ls, *_ = np.linalg.lstsq(A, -b, rcond=None)
    assert np.linalg.matrix_rank(A) == n  # unique optimum
    d_qp = np.linalg.solve(problem.H, -problem.g)
    np.testing.assert_allclose(d_qp, d_ls, rtol=1e-7, atol=1e-9)
    assert problem.objective(d_qp) == pytest.approx(float(np.sum((A @ d_ls + b) ** 2)), rel=1e-10)
    import mergeqp

    sol = mergeqp.solve(problem)
    np.testing.assert_allclose(sol.d.reshape(-1), d_ls, rtol=1e-6, atol=1e-8)


def test_sequence_model_is_exact_and_mixes_positions(finetuned_copies, true_error):
    base = LinearSequence(T=3, seed=4)
    fts = finetuned_copies(base, 2, scale=0.2, seed=6)
    gen = torch.Generator().manual_seed(8)
    cal = [torch.randn(5, 3, 4, generator=gen, dtype=torch.float32).double() for _ in range(2)]
    base, fts = base.double(), [f.double() for f in fts]
    stats = collect_statistics(base, fts, "merge", cal, keep_samples=True, batch_size=2,
                               progress=False)
    assert stats.positions == 3
    L = stats.mean_jacobian()  # (c*T, T, r): output at position s depends on u at position t
    assert np.abs(L[0, 2]).max() > 1e-3
    rng = np.random.default_rng(2)
    for spec in ["rows", "scalar", "columns", random_basis(3, 2, seed=1)]:
        for source in stats.sources(spec):
            problem = stats.problem(spec, source=source)
            d = rng.normal(size=problem.shape)
            truth = true_error(apply_merge(base, fts, "merge", d, spec), fts, cal)
            assert problem.objective(d) == pytest.approx(truth, rel=1e-10)


def test_long_output_uses_exact_qr_reduction(finetuned_copies, linear_net, true_error):
    """c = 7 outputs > r = 2: the streamed H uses the QR-reduced Jacobian and must still agree."""
    base = linear_net((4, 3, 2, 7), seed=9)
    fts = finetuned_copies(base, 2, scale=0.3, seed=10)
    cal = [torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
           for k in range(2)]
    stats = collect_statistics(base, fts, "1", cal, keep_samples=True, progress=False)
    a = stats.problem("rows", source="collected")
    b = stats.problem("rows", source="samples")
    np.testing.assert_allclose(a.H, b.H, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(a.g, b.g, rtol=1e-10, atol=1e-12)
    d = np.random.default_rng(3).normal(size=a.shape)
    assert a.objective(d) == pytest.approx(true_error(apply_merge(base, fts, "1", d), fts, cal), rel=1e-10)


def test_offset_linearisation_at_a_merged_point(linear_case):
    """Statistics collected at reference + update(d0) give the same QP in absolute d."""
    base, fts, cal, stats = linear_case
    d0 = np.random.default_rng(4).uniform(size=(3, stats.r))
    current = apply_merge(base, fts, "1", d0)
    moved = collect_statistics(current, fts, "1", cal, reference_model=base, progress=False)
    p_ref = stats.problem("rows")
    p_off = moved.problem("rows", offset=d0)
    np.testing.assert_allclose(p_off.H, p_ref.H, rtol=1e-9, atol=1e-9 * np.abs(p_ref.H).max())
    np.testing.assert_allclose(p_off.g, p_ref.g, rtol=1e-9, atol=1e-9 * np.abs(p_ref.g).max())
    assert p_off.c == pytest.approx(p_ref.c, rel=1e-9)
    with pytest.raises(Exception, match="offset does not match"):
        moved.problem("rows", offset=np.zeros((3, stats.r)))


def test_basis_identity_equals_rows(linear_case):
    _, _, _, stats = linear_case
    rows = stats.problem("rows")
    ident = stats.problem(Basis(np.eye(stats.r)), source="samples")
    np.testing.assert_allclose(ident.H, rows.H, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ident.g, rows.g, rtol=1e-10, atol=1e-12)
