"""The KL (softmax Gauss-Newton) output metric of :mod:`mergeqp.lm`: its linear map ``F`` against
the metric ``M = diag(p) - p p'`` and the exact KL divergence, and its place among the restrictions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from mergeqp.errors import ValidationError  # noqa: E402
from mergeqp.lm import OutputSpec, kl_whiten  # noqa: E402


@given(seed=st.integers(0, 2**31 - 1), V=st.integers(2, 40), spread=st.floats(0.1, 8.0))
def test_whitened_distance_is_the_softmax_hessian_metric(seed, V, spread):
    """``||F x - F y||^2 == (x - y)' (diag(p) - p p') (x - y)`` with ``p = softmax(y)``."""
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.normal(size=V) * spread)
    y = torch.from_numpy(rng.normal(size=V) * spread)
    p = torch.softmax(y, dim=-1)
    M = torch.diag(p) - torch.outer(p, p)
    lhs = float(((kl_whiten(x, p) - kl_whiten(y, p)) ** 2).sum())
    rhs = float((x - y) @ M @ (x - y))
    assert lhs == pytest.approx(rhs, rel=1e-9, abs=1e-12)
    assert rhs >= -1e-12  # M is positive semidefinite


def test_half_whitened_distance_approaches_the_exact_kl():
    """``1/2 ||F x - F y||^2 / KL(softmax(y) || softmax(x)) -> 1`` as ``x -> y``."""
    rng = np.random.default_rng(3)
    y = torch.from_numpy(rng.normal(size=50) * 2.0)
    u = torch.from_numpy(rng.normal(size=50))
    p = torch.softmax(y, dim=-1)
    errors = []
    for eps in (1e-1, 1e-2, 1e-3):
        x = y + eps * u
        kl = float((p * (torch.log_softmax(y, -1) - torch.log_softmax(x, -1))).sum())
        quad = 0.5 * float(((kl_whiten(x, p) - kl_whiten(y, p)) ** 2).sum())
        errors.append(abs(quad / kl - 1.0))
    assert errors[-1] < 1e-2
    assert errors[0] > errors[1] > errors[2]  # the third-order remainder shrinks with eps


def test_kl_metric_with_restrictions_and_masks():
    """``topk``: gather, then whiten with the target's renormalised top-k distribution;
    ``projection``: whiten, then project; masked positions are 0; ``probs`` is required."""
    rng = np.random.default_rng(0)
    y = torch.from_numpy(rng.normal(size=(2, 3, 12)))
    x = torch.from_numpy(rng.normal(size=(2, 3, 12)))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    full = OutputSpec(metric="kl")
    p = full.target_probs(y)
    assert torch.allclose(p.sum(-1), torch.ones(2, 3, dtype=torch.float64))
    out = full.select(x, mask, None, p)
    assert torch.equal(out[0, 2], torch.zeros(12, dtype=torch.float64))
    assert torch.allclose(out[1], kl_whiten(x[1], p[1]))

    top = OutputSpec(restrict="topk", k=4, metric="kl")
    index = top.topk_index(y)
    pk = top.target_probs(y, index)
    yk = y.gather(-1, index)
    assert torch.allclose(pk, p.gather(-1, index) / p.gather(-1, index).sum(-1, keepdim=True))
    assert torch.allclose(top.select(x, None, index, pk), kl_whiten(x.gather(-1, index), pk))
    assert torch.allclose(top.select(y, None, index, pk), kl_whiten(yk, pk))

    proj = OutputSpec(restrict="projection", k=5, seed=2, metric="kl")
    P = proj.projection(12, torch.float64, "cpu")
    assert torch.allclose(proj.select(x, None, None, p), kl_whiten(x, p) @ P)

    with pytest.raises(ValidationError, match="needs the target's distribution"):
        full.select(x, mask)
    with pytest.raises(ValidationError, match="valid: euclidean, kl"):
        OutputSpec(metric="fisher")
    # the default metric is the plain restricted output, untouched
    assert torch.equal(OutputSpec().select(x), x)
