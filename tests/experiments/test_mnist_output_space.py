"""The experiments' output-space merge (mergeqp.experiments.output_space): damped Gauss-Newton
steps from a start are never worse than the start on the true calibration error, on random
small networks (hypothesis)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeqp.errors import ValidationError
from mergeqp.experiments.output_space import OutputSpaceConfig, output_space_merge
from mergeqp.experiments.trust_region import calibration_error, calibration_targets


class _Net(torch.nn.Module):
    def __init__(self, d: int, h: int, c: int):
        super().__init__()
        self.layer1 = torch.nn.Linear(d, h)
        self.layer2 = torch.nn.Linear(h, h)
        self.layer3 = torch.nn.Linear(h, c)

    def forward(self, x):
        return self.layer3(torch.relu(self.layer2(torch.relu(self.layer1(x)))))


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), K=st.integers(1, 3), ridge=st.sampled_from([0.0, 0.01, 1.0]),
       scale=st.floats(0.05, 1.0))
def test_never_worse_than_the_start(seed: int, K: int, ridge: float, scale: float) -> None:
    torch.manual_seed(seed)
    base = _Net(5, 6, 3).double()
    fts = []
    for _ in range(K):
        ft = copy.deepcopy(base)
        with torch.no_grad():
            ft.layer2.weight.add_(scale * torch.randn_like(ft.layer2.weight))
            ft.layer2.bias.add_(scale * torch.randn_like(ft.layer2.bias))
        fts.append(ft)
    calibration = [torch.randn(8, 5, dtype=torch.float64) for _ in range(K)]
    start = copy.deepcopy(base)  # any start; here the base
    result = output_space_merge(start, fts, "layer2", calibration, OutputSpaceConfig(ridge=ridge, steps=4))
    targets = calibration_targets(fts, calibration)
    start_error = calibration_error(start, calibration, targets)
    assert result.start_error == pytest.approx(start_error, rel=1e-12)
    assert result.error <= start_error * (1 + 1e-12)
    assert calibration_error(result.model, calibration, targets) == pytest.approx(result.error, rel=1e-9)
    for step in result.steps:
        assert step.certified
    W = torch.cat([result.model.layer2.weight, result.model.layer2.bias[:, None]], 1).detach().numpy()
    np.testing.assert_allclose(W, result.weight)
    assert torch.equal(result.model.layer1.weight, base.layer1.weight)  # only the merge layer changes


def test_config_is_checked() -> None:
    with pytest.raises(ValidationError, match="ridge >= 0"):
        OutputSpaceConfig(ridge=-1.0)
    with pytest.raises(ValidationError, match="steps >= 1"):
        OutputSpaceConfig(steps=0)
