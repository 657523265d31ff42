"""Streaming: the statistics' memory does not grow with the number of samples."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from mergeqp.stats import collect_statistics, estimate_statistics_bytes


@pytest.fixture(scope="session")
def mnist_models(finetuned_copies, mnist_mlp):
    """``mnist_models() -> (base, [3 fine-tuned copies])``: the float32 MNIST MLP and copies
    perturbed in layer ``"2"``."""

    def _mnist_models():
        base = mnist_mlp(dtype=torch.float32, seed=0)
        return base, finetuned_copies(base, 3, scale=0.02, layer="2", seed=1)

    return _mnist_models


def test_statistics_size_is_independent_of_sample_count(mnist_models):
    base, fts = mnist_models()
    sizes = []
    for n in (10, 150):
        cal = [torch.rand(n, 784, generator=torch.Generator().manual_seed(k)) for k in range(3)]
        stats = collect_statistics(base, fts, "2", cal, batch_size=50, progress=False)
        assert stats.n_samples == 3 * n
        sizes.append(stats.nbytes())
    assert sizes[0] == sizes[1]
    K, r, m1, c = 3, 128, 257, 10
    n = K * r
    expected = 8 * (K * (n * n + n) + K * (K * K + K)  # rows and scalar H_t, g_t
                    + K * r * m1 + r * m1               # deltas, base weight
                    + K * (c * c + 2 + r * m1 + c * r + m1 * m1))  # S, c, n, cross, jac, gram
    assert sizes[0] == expected
    estimate = estimate_statistics_bytes(r, 256, K, c)
    assert estimate["statistics"] == expected and estimate["samples"] == 0
    kept = collect_statistics(base, fts, "2", [torch.rand(7, 784)] * 3, keep_samples=True,
                              progress=False)
    est = estimate_statistics_bytes(r, 256, K, c, n_samples=21, keep_samples=True)
    assert kept.nbytes() == est["total"] and kept.nbytes(include_samples=False) == est["statistics"]


def test_batches_are_streamed_not_held(finetuned_copies):
    """Each batch is released (reference count zero) before the next-but-one is requested."""
    torch.manual_seed(2)
    base = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 12),
                               torch.nn.ReLU(), torch.nn.Linear(12, 4))
    fts = finetuned_copies(base, 3, scale=0.05, layer="2", seed=3)
    alive: list[weakref.ref] = []
    violations = []

    def stream(k):
        gen = torch.Generator().manual_seed(k)
        for _ in range(4):
            if len(alive) >= 2 and alive[-2]() is not None:
                violations.append(len(alive))
            x = torch.rand(8, 20, generator=gen)
            alive.append(weakref.ref(x))
            yield x
            del x

    stats = collect_statistics(base, fts, "2", [stream(k) for k in range(3)], progress=False)
    assert stats.n_samples == 3 * 4 * 8
    gc.collect()
    assert all(ref() is None for ref in alive)
    assert violations == []
    ref = collect_statistics(base, fts, "2", [list(stream(k)) for k in range(3)], progress=False)
    np.testing.assert_allclose(stats.problem("rows").H, ref.problem("rows").H, rtol=1e-12)
