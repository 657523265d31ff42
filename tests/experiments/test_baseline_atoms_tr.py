"""Trust regions in the ``rows+baselines`` atoms started from a baseline (never worse than the
start on the true calibration error: a hypothesis property on random small ReLU networks), the
ridge toward an arbitrary point, and k-fold selection of a regularisation weight."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from mergeqp.constraints import Box
from mergeqp.errors import ValidationError
from mergeqp.experiments.kfold import contiguous_folds, kfold_calibration, select_by_kfold
from mergeqp.experiments.trust_region import (
    TrustRegionConfig,
    calibration_error,
    calibration_targets,
    trust_region_merge,
)
from mergeqp.stats import RowsBaselinesParametrisation, apply_merge


def _family(seed: int, K: int, scale: float):
    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3)).to(torch.float64)
    g = torch.Generator().manual_seed(seed + 1)
    fts = []
    for _ in range(K):
        m = copy.deepcopy(base)
        with torch.no_grad():
            m[2].weight.add_(scale * torch.randn(m[2].weight.shape, generator=g, dtype=torch.float64))
            m[2].bias.add_(scale * torch.randn(m[2].bias.shape, generator=g, dtype=torch.float64))
        fts.append(m)
    cal = [torch.randn(8, 5, generator=g, dtype=torch.float64) + k for k in range(K)]
    return base, fts, cal


def _atoms(fts, seed: int) -> RowsBaselinesParametrisation:
    """Two 'baselines': the mean residual scaled by 0.7 and a random perturbation of it."""
    rng = np.random.default_rng(seed)
    deltas = [torch.cat([m[2].weight, m[2].bias[:, None]], dim=1).detach().numpy() for m in fts]
    mean = np.mean(deltas, axis=0)
    return RowsBaselinesParametrisation({"scaled": 0.7 * mean, "noisy": mean + 0.3 * rng.normal(size=mean.shape)})


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), K=st.integers(2, 3), scale=st.floats(0.1, 1.0), ridge=st.sampled_from([0.0, 1.0]))
def test_trust_region_from_a_baseline_is_never_worse_than_it(seed, K, scale, ridge):
    base, fts, cal = _family(seed, K, scale)
    param = _atoms(fts, seed)
    start = param.baseline_point("noisy", K)
    result = trust_region_merge(base, fts, "2", cal, parametrisation=param, d0=start,
                                config=TrustRegionConfig(max_qps=3, ridge=ridge), ridge_center=start,
                                solver="active_set", progress=False)
    targets = calibration_targets(fts, cal)
    true_start = calibration_error(apply_merge(base, fts, "2", start, param), cal, targets)
    true_end = calibration_error(apply_merge(base, fts, "2", result.d, param), cal, targets)
    assert result.start_objective == pytest.approx(true_start, rel=1e-10)
    # the ridge term is >= 0 and 0 at the start: the true error alone is no larger either
    assert true_end <= true_start * (1 + 1e-10)
    assert result.objective == pytest.approx(
        true_end + ridge * float(np.sum((result.d - start) ** 2)), rel=1e-10)
    assert Box(0.0, 1.0).violation(result.d) <= 1e-9


def test_kfold_splits_and_selection():
    cal = [torch.arange(9, dtype=torch.float64).reshape(9, 1), torch.arange(10, 16, dtype=torch.float64).reshape(6, 1)]
    splits = kfold_calibration(cal, 3, seed=4)
    assert len(splits) == 3
    for t in range(2):  # the held-out parts partition each task; fit = the rest
        held = torch.cat([h[t] for _, h in splits]).ravel().tolist()
        assert sorted(held) == sorted(cal[t].ravel().tolist())
        for fit, h in splits:
            assert sorted(fit[t].ravel().tolist() + h[t].ravel().tolist()) == sorted(cal[t].ravel().tolist())
    again = kfold_calibration(cal, 3, seed=4)
    assert all(torch.equal(a[1][0], b[1][0]) for a, b in zip(splits, again, strict=True))

    # score = squared distance of the held-out mean from the value: the mean of the data wins
    def score(fit, held, value):
        return float(sum(((h - value) ** 2).sum() for h in held))

    sel = select_by_kfold(cal, [0.0, 7.0, 100.0], score, folds=3, seed=4, parameter="centre")
    assert sel.chosen == 7.0 and len(sel.fold_errors) == 3 and all(len(e) == 3 for e in sel.fold_errors)
    assert sel.mean_errors[1] == min(sel.mean_errors)
    assert sel.n_heldout == ((3, 2), (3, 2), (3, 2))
    assert sel.to_dict()["parameter"] == "centre"
    with pytest.raises(ValidationError, match="folds >= 2"):
        kfold_calibration(cal, 1)
    with pytest.raises(ValidationError, match="fewer than the 7 folds"):
        kfold_calibration(cal, 7)
    with pytest.raises(ValidationError, match="non-empty list"):
        select_by_kfold(cal, [], score)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 40), st.integers(2, 9))
def test_contiguous_folds_are_numpys_array_split_and_autos_folds(n, folds):
    """The experiments' folds of calibration texts (stop 79) are ``method: auto``'s folds of batches, over items."""
    from mergeqp.run.auto import AutoStartParams, batch_splits

    parts = contiguous_folds(n, folds)
    k = min(n, folds)
    assert [held for _, held in parts] == [list(a) for a in np.array_split(np.arange(n), k)]
    for fit, held in parts:
        assert held and fit and sorted(fit + held) == list(range(n)) and not set(fit) & set(held)
    assert sorted(j for _, held in parts for j in held) == list(range(n))  # each item held out once
    if n >= folds:  # the same cut as auto's over n batches
        assert parts == batch_splits(n, AutoStartParams(folds=folds))


def test_contiguous_folds_refuse_what_cannot_be_cross_validated():
    for n, folds in ((1, 4), (0, 2), (True, 2), (5, 1), (5, True), (5, 2.0)):
        with pytest.raises(ValidationError, match="k-fold selection needs"):
            contiguous_folds(n, folds)


def test_default_start_and_ridge_are_the_soup_of_rows_baselines():
    """(stop 48 review) With ``rows+baselines`` the documented defaults "the soup" were ``1/K`` on every
    atom: the start was the soup plus the mean baseline residual, and a strong ridge "toward the soup"
    pulled the baseline atoms to 1/K. Both are now the soup (rows 1/K, baseline atoms 0), also in the
    held-out choice of the ridge."""
    K = 3
    base, fts, cal = _family(4, K, 0.5)
    param = _atoms(fts, 4)
    targets = calibration_targets(fts, cal)
    soup_model = copy.deepcopy(base)
    with torch.no_grad():
        for name in ("weight", "bias"):
            getattr(soup_model[2], name).copy_(sum(getattr(m[2], name) for m in fts) / K)
    soup_error = calibration_error(soup_model, cal, targets)
    first = trust_region_merge(base, fts, "2", cal, parametrisation=param, config=TrustRegionConfig(max_qps=1),
                               solver="active_set", progress=False)
    assert first.start_objective == pytest.approx(soup_error, rel=1e-10)
    soup = param.task_vector_point(K, 4, 7, 1.0 / K)  # layer 2: 4 rows of 6 inputs + bias
    for kwargs in ({"config": TrustRegionConfig(ridge=1e6, max_qps=3)},
                   {"config": TrustRegionConfig(max_qps=3), "ridge_candidates": [1e6], "holdout_fraction": 0.25}):
        result = trust_region_merge(base, fts, "2", cal, parametrisation=param, d0=soup, solver="active_set",
                                    progress=False, **kwargs)
        np.testing.assert_allclose(result.d, soup, atol=1e-4)
