"""Statistics on an accelerator equal those on the CPU (skipped where there is no CUDA)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from mergeqp.stats import collect_statistics
from tests.stats.tiny_models import TinyTransformer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


def test_cuda_statistics_match_cpu(finetuned_copies):
    base = TinyTransformer(seed=0).double()
    fts = finetuned_copies(base, 2, scale=0.1, layer="fc1", seed=1)
    gen = torch.Generator().manual_seed(2)
    cal = [torch.randn(4, 3, 5, generator=gen, dtype=torch.float64) for _ in range(2)]
    cpu = collect_statistics(base, fts, "fc1", cal, keep_samples=True, progress=False)
    dev = torch.device("cuda")
    gpu = collect_statistics(copy.deepcopy(base).to(dev), [copy.deepcopy(f).to(dev) for f in fts],
                             "fc1", cal, keep_samples=True, progress=False)
    for spec in ("rows", "scalar", "columns"):
        a, b = cpu.problem(spec), gpu.problem(spec)
        np.testing.assert_allclose(b.H, a.H, rtol=1e-9, atol=1e-12 * np.abs(a.H).max())
        np.testing.assert_allclose(b.g, a.g, rtol=1e-9, atol=1e-12 * np.abs(a.g).max())
        assert b.c == pytest.approx(a.c, rel=1e-12)
    merged = gpu.apply(copy.deepcopy(base).to(dev), np.full((2, gpu.r), 0.5))
    assert merged.fc1.weight.device.type == "cuda"
