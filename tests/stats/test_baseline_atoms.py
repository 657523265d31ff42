"""``rows+baselines``: rows atoms plus the baselines' merged residuals (every baseline feasible)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeqp import solve
from mergeqp.constraints import Box
from mergeqp.errors import ValidationError
from mergeqp.problem import MergeQP
from mergeqp.stats import PARAMETRISATIONS, RowsBaselinesParametrisation, apply_merge, collect_statistics
from mergeqp.stats.parametrisation import as_parametrisation


def _residuals(rng, r, m1, names=("regmean", "ties")):
    return {n: rng.normal(size=(r, m1)) for n in names}


@pytest.fixture(scope="module")
def linear_case(finetuned_copies, linear_net):
    base = linear_net((6, 5, 4, 3), seed=1)
    fts = finetuned_copies(base, 3, scale=0.3, seed=2)
    gen = torch.Generator().manual_seed(5)
    cal = [torch.randn(n, 6, generator=gen, dtype=torch.float64) for n in (11, 7, 9)]
    param = RowsBaselinesParametrisation(_residuals(np.random.default_rng(0), 4, 6))
    stats = collect_statistics(base, fts, "1", cal, parametrisations=["rows", param], keep_samples=True,
                               batch_size=4, progress=False)
    return base, fts, cal, stats, param


def test_objective_equals_true_error_and_every_source_agrees(true_error, linear_case):
    base, fts, cal, stats, param = linear_case
    problem = stats.problem(param)
    assert problem.shape == (3, 4 + 2)
    rng = np.random.default_rng(1)
    for _ in range(3):
        d = rng.normal(size=problem.shape)
        merged = apply_merge(base, fts, "1", d, param)
        assert problem.objective(d) == pytest.approx(true_error(merged, fts, cal), rel=1e-10)
    sources = stats.sources(param)
    assert {"collected", "samples", "shared"} <= set(sources)
    ref = stats.problem(param, source="collected")
    for source in ("samples", "shared"):
        other = stats.problem(param, source=source)
        np.testing.assert_allclose(other.H, ref.H, rtol=1e-10, atol=1e-10 * np.abs(ref.H).max())
        np.testing.assert_allclose(other.g, ref.g, rtol=1e-10, atol=1e-10 * np.abs(ref.g).max())


def test_rows_block_is_the_rows_problem(linear_case):
    _, _, _, stats, param = linear_case
    rows, both = stats.problem("rows"), stats.problem(param)
    K, r, n = 3, stats.r, param.n_atoms(stats.r, stats.m1)
    idx = np.array([k * n + i for k in range(K) for i in range(r)])
    np.testing.assert_allclose(both.H[np.ix_(idx, idx)], rows.H, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(both.g[idx], rows.g, rtol=1e-10, atol=1e-12)


def test_baseline_point_is_the_baseline_merge(linear_case):
    base, fts, _, stats, param = linear_case
    W0 = torch.cat([base[1].weight, base[1].bias[:, None]], dim=1).detach().numpy()
    for j, name in enumerate(param.baselines):
        d = param.baseline_point(name, 3)
        np.testing.assert_allclose(W0 + param.update(d, np.asarray(stats.deltas)), W0 + param.residuals[j],
                                   atol=1e-12)
    with pytest.raises(ValidationError, match="unknown baseline 'fisher'.*valid: regmean, ties"):
        param.baseline_point("fisher", 3)


def test_tangents_are_the_atoms_applied_to_inputs():
    rng = np.random.default_rng(2)
    r, m1 = 4, 3
    param = RowsBaselinesParametrisation(_residuals(rng, r, m1))
    delta = rng.normal(size=(r, m1))
    Z = rng.normal(size=(5, 2, m1))
    tang = param.tangents(torch.from_numpy(Z), torch.from_numpy(delta)).numpy()
    assert tang.shape == (r + 2, 5, 2, r)
    for a in range(r + 2):
        d = np.zeros((1, r + 2))
        d[0, a] = 1.0
        B = param.update(d, delta[None])
        np.testing.assert_allclose(tang[a], Z @ B.T, atol=1e-12)


def test_registry_entry_and_errors():
    entry = PARAMETRISATIONS["rows+baselines"]
    assert entry.built_per_layer and entry.config_options == ("baselines",)
    with pytest.raises(ValidationError, match="built for each layer"):
        as_parametrisation("rows+baselines")
    with pytest.raises(ValueError, match="needs 'baselines'"):
        entry.check_config({"baselines": []}, ["baselines"])
    with pytest.raises(ValidationError, match="non-empty mapping"):
        RowsBaselinesParametrisation({})
    with pytest.raises(ValidationError, match="one \\(r, m1\\) matrix"):
        RowsBaselinesParametrisation({"a": np.zeros((2, 3)), "b": np.zeros((3, 3))})
    with pytest.raises(ValidationError, match="NaN or inf"):
        RowsBaselinesParametrisation({"a": np.full((2, 3), np.nan)})
    with pytest.raises(ValidationError, match="\\(2, 3\\) but the merge layer"):
        RowsBaselinesParametrisation({"a": np.zeros((2, 3))}).check(4, 3)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), K=st.integers(1, 3), r=st.integers(1, 4), m1=st.integers(1, 4),
       J=st.integers(1, 3))
def test_certified_optimum_is_never_worse_than_any_baseline(seed, K, r, m1, J):
    """On random small problems (shared Jacobian, so H and g follow from the Gram matrix, L'L and
    C), the certified box [0, 1] optimum is at or below every baseline's linearised objective."""
    rng = np.random.default_rng(seed)
    c = rng.integers(1, 4)
    deltas = rng.normal(size=(K, r, m1))
    Zs = rng.normal(size=(6, m1))
    L = rng.normal(size=(c, r))
    b = rng.normal(size=(6, c))
    gram = Zs.T @ Zs
    cross = np.einsum("ci,jc,jm->im", L, b, Zs)  # sum_j (L' b_j) z_j'
    param = RowsBaselinesParametrisation({f"b{j}": rng.normal(size=(r, m1)) for j in range(J)})
    H = param.shared_hessian(deltas, gram, L.T @ L)
    g = param.gradient(deltas, cross)
    problem = MergeQP(H=H, g=g, c=float(np.sum(b ** 2)), shape=(K, r + J))
    for j, name in enumerate(param.baselines):  # J(baseline point) is the baseline's own squared error
        U = param.residuals[j]
        direct = float(np.sum((Zs @ U.T @ L.T + b) ** 2))
        assert problem.objective(param.baseline_point(name, K)) == pytest.approx(direct, rel=1e-9, abs=1e-9)
    sol = solve(problem, Box(0.0, 1.0))
    assert sol.certificate.certified()
    tol = 1e-7 * max(1.0, abs(problem.c))
    for name in param.baselines:
        assert sol.objective <= problem.objective(param.baseline_point(name, K)) + tol


def test_the_problem_knows_its_soup_and_regularises_toward_it(linear_case, tmp_path):
    """``problem.soup_point()`` of a rows+baselines QP is the soup (rows 1/K, baseline atoms 0), not
    ``1/K`` on every atom (= soup + the mean baseline residual); ``regularised(mu)`` pulls toward it,
    and a saved problem keeps it. Rows and offset problems keep ``1/K`` (absolute coordinates)."""
    base, fts, _, stats, param = linear_case
    problem = stats.problem(param)
    soup = problem.soup_point()
    np.testing.assert_array_equal(soup[:, :4], np.full((3, 4), 1 / 3))
    np.testing.assert_array_equal(soup[:, 4:], 0.0)
    soup_weight = sum(f[1].weight for f in fts) / 3  # the soup of the layer, by hand
    merged = apply_merge(base, fts, "1", soup, param)
    torch.testing.assert_close(merged[1].weight, soup_weight.detach(), rtol=0, atol=1e-12)
    strong = solve(problem.regularised(1e8), Box(-10, 10))  # the ridge's minimiser is the soup
    np.testing.assert_allclose(strong.d, soup, atol=1e-5)
    problem.save_npz(str(tmp_path / "p.npz"))
    from mergeqp.problem import load_problem_file
    again, _ = load_problem_file(str(tmp_path / "p.npz"))
    np.testing.assert_array_equal(again.soup_point(), soup)
    assert stats.problem("rows").soup is None
    np.testing.assert_array_equal(stats.problem("rows").soup_point(), np.full((3, 4), 1 / 3))
    with pytest.raises(ValidationError, match=r"soup must have shape \(3, 6\)"):
        MergeQP(problem.H, problem.g, shape=problem.shape, soup=np.zeros(5))
    with pytest.raises(ValidationError, match="soup"):
        MergeQP(problem.H, problem.g, shape=problem.shape, soup=np.full(18, np.nan))
