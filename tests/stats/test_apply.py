"""Applying a QP point to models and state dicts; known merges as points of the QP."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from mergeqp.errors import ValidationError
from mergeqp.stats import (
    apply_merge,
    apply_merge_state_dict,
    collect_statistics,
    random_basis,
    row_dare_point,
)


@pytest.fixture(scope="module")
def case(finetuned_copies, linear_net):
    base = linear_net((5, 6, 4, 3), seed=0)
    fts = finetuned_copies(base, 3, scale=0.3, layer="1", seed=1)
    cal = [torch.randn(8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
           for k in range(3)]
    stats = collect_statistics(base, fts, "1", cal, progress=False)
    return base, fts, cal, stats


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("spec", ["rows", "scalar", "columns", "basis"])
def test_apply_merge_sets_only_the_layer_and_leaves_inputs(case, spec):
    base, fts, _, stats = case
    param = random_basis(stats.r, 2, seed=3) if spec == "basis" else spec
    before = [_snapshot(m) for m in (base, *fts)]
    d = np.random.default_rng(0).normal(size=(3, stats.n_atoms(param)))
    merged = apply_merge(base, fts, "1", d, param)
    assert all(_same(s, _snapshot(m)) for s, m in zip(before, (base, *fts)))
    assert merged is not base
    W, b = stats.merged_weights(d, param)
    np.testing.assert_allclose(merged[1].weight.detach().numpy(), W, rtol=0, atol=1e-15)
    np.testing.assert_allclose(merged[1].bias.detach().numpy(), b, rtol=0, atol=1e-15)
    for key, value in base.state_dict().items():
        if not key.startswith("1."):
            assert torch.equal(merged.state_dict()[key], value)
    via_stats = stats.apply(base, d, param)
    assert _same(_snapshot(via_stats), _snapshot(merged))
    sd = apply_merge_state_dict(base.state_dict(), [f.state_dict() for f in fts], "1", d, param)
    assert _same(sd, _snapshot(merged))
    assert all(_same(s, _snapshot(m)) for s, m in zip(before, (base, *fts)))


def test_known_merges_are_points_of_the_qp(true_error, case):
    base, fts, cal, stats = case
    W_ft = np.stack([np.concatenate([f[1].weight.detach().numpy(), f[1].bias.detach().numpy()[:, None]], 1)
                     for f in fts])
    W0 = stats.base_weight
    for spec in ("rows", "scalar", "columns"):
        points = stats.merge_points(spec, lam=0.7)
        W, b = stats.merged_weights(points["soup"], spec)
        np.testing.assert_allclose(np.concatenate([W, b[:, None]], 1), W_ft.mean(0), atol=1e-12)
        W, b = stats.merged_weights(points["task_arithmetic"], spec)
        np.testing.assert_allclose(np.concatenate([W, b[:, None]], 1),
                                   W0 + 0.7 * (W_ft - W0).sum(0), atol=1e-12)
        problem = stats.problem(spec)
        for name, d in points.items():
            merged = apply_merge(base, fts, "1", d, spec)
            assert problem.objective(d) == pytest.approx(true_error(merged, fts, cal), rel=1e-10), name
    assert "row_dare" in stats.merge_points("rows") and "row_dare" not in stats.merge_points("scalar")


def test_row_dare_point():
    d = row_dare_point(4, 1000, p=0.3, seed=5, lam=2.0)
    assert d.shape == (4, 1000)
    values = np.unique(d)
    assert values.shape == (2,) and values[0] == 0.0 and values[1] == pytest.approx(2.0 / 0.7)
    assert abs((d > 0).mean() - 0.7) < 0.03
    np.testing.assert_array_equal(d, row_dare_point(4, 1000, p=0.3, seed=5, lam=2.0))
    assert not np.array_equal(d, row_dare_point(4, 1000, p=0.3, seed=6, lam=2.0))
    with pytest.raises(ValidationError, match="drop probability"):
        row_dare_point(2, 3, p=1.0)


def test_apply_errors(case):
    base, fts, _, stats = case
    with pytest.raises(ValidationError, match=r"d must have shape \(3, 4\)"):
        apply_merge(base, fts, "1", np.zeros((2, 4)))
    with pytest.raises(ValidationError, match="nn.Linear layers are: 0, 1, 2"):
        apply_merge(base, fts, "nope", np.zeros((3, 4)))
    other = copy.deepcopy(base)
    with torch.no_grad():
        other[1].weight.add_(1.0)
    with pytest.raises(ValidationError, match="does not hold the base weights"):
        stats.apply(other, np.zeros((3, 4)))
    with pytest.raises(ValidationError, match="no tensor 'nope.weight'"):
        apply_merge_state_dict(base.state_dict(), [f.state_dict() for f in fts], "nope", np.zeros((3, 4)))


def test_a_solution_is_applied_in_its_own_parametrisation(finetuned_copies, linear_net):
    """A layer with as many rows as augmented inputs (here 4 x (3 + 1)): a columns solution has the
    rows' shape. Given as the Solution, it is read as columns; read as rows it is refused, where
    its bare array would silently merge other atoms (a different model, a higher objective)."""
    import mergeqp

    base = linear_net((3, 4, 2), seed=0)
    fts = finetuned_copies(base, 3, scale=0.3, layer="0", seed=1)
    cal = [torch.randn(16, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    stats = collect_statistics(base, fts, "0", cal, parametrisations=["columns", "rows"], keep_samples=True,
                               progress=False)
    assert stats.r == stats.m1 == 4
    sol = mergeqp.solve(stats.problem("columns"), "box:0,1")
    assert sol.parametrisation == {"name": "columns"} and sol.to_dict()["parametrisation"] == {"name": "columns"}
    right = apply_merge(base, fts, "0", sol.d, "columns")
    for merged in (apply_merge(base, fts, "0", sol), stats.apply(base, sol)):
        assert torch.allclose(merged.state_dict()["0.weight"], right.state_dict()["0.weight"])
    sd = apply_merge_state_dict(base.state_dict(), [m.state_dict() for m in fts], "0", sol)
    assert torch.allclose(sd["0.weight"], right.state_dict()["0.weight"])
    with pytest.raises(ValidationError, match="posed in the parametrisation 'columns', but 'rows'"):
        apply_merge(base, fts, "0", sol, "rows")
    with pytest.raises(ValidationError, match="'columns', but 'rows'"):
        stats.apply(base, sol, "rows")
    wrong = apply_merge(base, fts, "0", sol.d)  # the bare array: rows, as documented
    assert not torch.allclose(wrong.state_dict()["0.weight"], right.state_dict()["0.weight"])
    # a basis cannot be rebuilt from its name: the solution asks for it, and checks the one given
    basis = stats.parametrisation("svd:2")
    sol_b = mergeqp.solve(stats.problem(basis), "box:0,1")
    with pytest.raises(ValidationError, match="cannot be rebuilt from its name"):
        stats.apply(base, sol_b)
    assert torch.allclose(stats.apply(base, sol_b, basis).state_dict()["0.weight"],
                          stats.apply(base, sol_b.d, basis).state_dict()["0.weight"])
    # a problem built without a parametrisation in its metadata: rows, as before
    bare = mergeqp.MergeQP(stats.problem("rows").H, stats.problem("rows").g, c=1.0, shape=(3, 4))
    sol_r = mergeqp.solve(bare, "box:0,1")
    assert sol_r.parametrisation is None
    assert torch.equal(apply_merge(base, fts, "0", sol_r).state_dict()["0.weight"],
                       apply_merge(base, fts, "0", sol_r.d, "rows").state_dict()["0.weight"])


@pytest.mark.parametrize("kwargs, what", [({"lam": float("nan")}, "lam must be finite"),
                                           ({"lam": float("inf")}, "lam must be finite"),
                                           ({"lam": "half"}, "lam must be a number"),
                                           ({"dare_p": float("nan")}, "dare_p must be finite")])
def test_merge_points_refuse_non_finite_weights(kwargs, what):
    from mergeqp.stats.apply import merge_points
    from mergeqp.stats.parametrisation import as_parametrisation

    with pytest.raises(ValidationError, match=what):
        merge_points(as_parametrisation("rows"), 2, 3, 4, **kwargs)
    points = merge_points(as_parametrisation("rows"), 2, 3, 4, lam=0.25)
    assert np.all(points["task_arithmetic"] == 0.25) and np.all(points["soup"] == 0.5)
