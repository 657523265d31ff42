"""The captured-energy diagnostic of the first-order statistics: ``sum_j ||P_{range A_j} b_j||^2``
is computed from the smaller Gram (``c x c`` or ``n x n``); both branches against least squares."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeqp.merge.firstorder import _captured


def _reference(A: torch.Tensor, b: torch.Tensor) -> float:
    """Least squares with the diagnostic's own rank cut: its Gram eigenvalues below 1e-10 of the
    largest are singular values below 1e-5 of the largest (a product of two random 10 x 10
    matrices can have such: lstsq's default cut kept them, and the two disagreed by 1.5%)."""
    total = 0.0
    for Aj, bj in zip(A.numpy(), b.numpy()):
        x = np.linalg.lstsq(Aj, bj, rcond=1e-5)[0]
        total += float(np.sum((Aj @ x) ** 2))
    return total


@settings(max_examples=30, deadline=None)
@given(B=st.integers(1, 3), c=st.integers(1, 12), n=st.integers(1, 12), rank=st.integers(1, 12),
       seed=st.integers(0, 2**16))
def test_captured_energy_matches_least_squares(B: int, c: int, n: int, rank: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    r = min(rank, c, n)
    A = torch.randn(B, c, r, generator=g, dtype=torch.float64) @ torch.randn(B, r, n, generator=g, dtype=torch.float64)
    b = torch.randn(B, c, generator=g, dtype=torch.float64)
    got = _captured(A, b)
    assert got == pytest.approx(_reference(A, b), rel=1e-8, abs=1e-10)
    assert got <= float((b * b).sum()) * (1 + 1e-12)


@pytest.mark.parametrize("c,n", [(4, 9), (9, 4)])
def test_both_branches_agree_on_the_transposed_problem(c: int, n: int) -> None:
    """A full-row-rank A (c <= n) captures all of b; a tall A captures only its column space."""
    g = torch.Generator().manual_seed(1)
    A = torch.randn(2, c, n, generator=g, dtype=torch.float64)
    b = torch.randn(2, c, generator=g, dtype=torch.float64)
    got = _captured(A, b)
    if c <= n:
        assert got == pytest.approx(float((b * b).sum()), rel=1e-10)
    else:
        assert got < float((b * b).sum())
    assert got == pytest.approx(_reference(A, b), rel=1e-9)
