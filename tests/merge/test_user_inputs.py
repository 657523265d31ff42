"""The baselines' and the statistics' checks of what a user hands them (a review at stop 42):
normalisation statistics, precomputed Fishers and Gram matrices, a model= of another architecture,
a model that fails on a batch, integer tensors, inputs that require grad, state dicts given where
models run. Each case is either merged correctly or refused with a message naming the input."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn

from mergeqp.errors import BadDataError, ValidationError
from mergeqp.merge import merge_state_dicts, merge_tensors
from mergeqp.stats import collect_statistics


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.lin(x))


@pytest.mark.parametrize("method", ["task_arithmetic", "ties", "dare", "dare_ties", "soup"])
def test_running_statistics_are_the_finetunes_mean(method):
    """Task arithmetic on a running variance (1 at the base, 0.2 and 0.4 in the fine-tunes) gave
    1 + (-0.8) + (-0.6) < 0 and a model that outputs NaN; every method now averages them."""
    torch.manual_seed(0)
    base, fts = BNNet(), [BNNet(), BNNet()]
    for m, v in zip(fts, (0.2, 0.4)):
        m.bn.running_var.data.fill_(v)
        m.bn.running_mean.data.fill_(v - 1)
    out = merge_state_dicts(method, base, fts, progress=False, **({"seed": 0} if "dare" in method else {}))
    assert torch.allclose(out["bn.running_var"], torch.full((4,), 0.3))
    assert torch.allclose(out["bn.running_mean"], torch.full((4,), -0.7))
    net = BNNet()
    net.load_state_dict(out)
    assert torch.isfinite(net.eval()(torch.randn(5, 3))).all()
    if method == "task_arithmetic":  # the weights are still task arithmetic
        want = base.lin.weight + sum(m.lin.weight - base.lin.weight for m in fts)
        assert torch.allclose(out["lin.weight"], want)


def test_merge_tensors_refuses_what_it_would_not_merge():
    with pytest.raises(ValidationError, match=r"floating-point tensors; base .* torch.int64"):
        merge_tensors("task_arithmetic", torch.tensor([1, 2]), [torch.tensor([3, 4]), torch.tensor([5, 6])])
    with pytest.raises(ValidationError, match=r"finetuned\[1\]"):
        merge_tensors("soup", None, [torch.ones(2), torch.ones(2, dtype=torch.bool)])


def test_results_do_not_hold_the_inputs_graph():
    base = {"w": torch.randn(3, requires_grad=True)}
    fts = [{"w": torch.randn(3, requires_grad=True)} for _ in range(2)]
    for method in ("task_arithmetic", "ties", "soup"):
        out = merge_state_dicts(method, base, fts, progress=False)
        assert not out["w"].requires_grad and out["w"].grad_fn is None


@pytest.fixture
def mlp():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    sd = net.state_dict()
    fts = [{k: v + 0.1 * torch.randn_like(v) for k, v in sd.items()} for _ in range(2)]
    return net, sd, fts


def test_supplied_fishers_are_checked(mlp):
    _, sd, fts = mlp
    ones = {k: torch.ones_like(v) for k, v in sd.items()}
    with pytest.raises(ValidationError, match=r"'0.weight' in fishers\[0\] has a negative entry"):
        merge_state_dicts("fisher", sd, fts, fishers=[{k: -v for k, v in ones.items()}, ones], progress=False)
    nan = {**ones, "2.bias": torch.tensor([1.0, float("nan")])}
    with pytest.raises(ValidationError, match=r"'2.bias' in fishers\[1\] contains NaN"):
        merge_state_dicts("fisher", sd, fts, fishers=[ones, nan], progress=False)
    # numpy Fishers work, and equal Fishers give the plain mean
    out = merge_state_dicts("fisher", sd, fts, fishers=[{k: v.numpy() for k, v in ones.items()}] * 2, progress=False)
    assert torch.allclose(out["0.weight"], (fts[0]["0.weight"] + fts[1]["0.weight"]) / 2, atol=1e-6)


def test_supplied_grams_are_checked(mlp):
    _, sd, fts = mlp
    G = {"0": torch.eye(4), "2": torch.eye(5)}
    with pytest.raises(ValidationError, match=r"layer '0' in grams\[1\] has a negative diagonal"):
        merge_state_dicts("regmean", sd, fts, grams=[G, {**G, "0": -10 * torch.eye(4)}], progress=False)
    skew = torch.eye(4)
    skew[0, 1] = 1.0
    with pytest.raises(ValidationError, match="not symmetric"):
        merge_state_dicts("regmean", sd, fts, grams=[G, {**G, "0": skew}], progress=False)
    with pytest.raises(ValidationError, match=r"layer '2' has a Gram matrix in grams\[1\] but not in grams\[0\]"):
        merge_state_dicts("regmean", sd, fts, grams=[{"0": torch.eye(4)}, G], progress=False)
    out = merge_state_dicts("regmean", sd, fts, grams=[{k: v.numpy() for k, v in G.items()}] * 2, progress=False)
    assert torch.allclose(out["0.weight"], (fts[0]["0.weight"] + fts[1]["0.weight"]) / 2, atol=1e-6)


def test_calibration_failures_name_the_batch(mlp):
    net, sd, fts = mlp
    nan = [[torch.full((4, 3), float("nan"))]] * 2
    with pytest.raises(ValidationError, match=r"layer '0' in finetuned\[0\] .* NaN or inf"):
        merge_state_dicts("regmean", sd, fts, model=net, calibration=nan, progress=False)
    wide = [[torch.randn(4, 5)]] * 2
    for method in ("regmean", "fisher"):
        with pytest.raises(ValidationError, match=r"finetuned\[0\] calibration batch 0: the model failed on this batch"):
            merge_state_dicts(method, sd, fts, model=net, calibration=wide, progress=False)
    labelled = [[(torch.randn(4, 5), torch.zeros(4, dtype=torch.long))]] * 2
    with pytest.raises(ValidationError, match="the model failed on this batch"):
        merge_state_dicts("fisher", sd, fts, model=net, calibration=labelled, progress=False)


def test_a_model_of_another_architecture_is_refused(mlp):
    _, sd, fts = mlp
    other = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 3))
    for method in ("regmean", "fisher"):
        with pytest.raises(ValidationError, match=r"'2.weight' has shape \(3, 4\) but \(2, 4\) in finetuned\[0\]"):
            merge_state_dicts(method, sd, fts, model=other, calibration=[[torch.randn(4, 3)]] * 2, progress=False)


def test_statistics_need_models_and_finite_weights(mlp):
    net = mlp[0]
    fts = [copy.deepcopy(net) for _ in range(2)]
    cal = [torch.randn(4, 3)] * 2
    with pytest.raises(ValidationError, match="base_model is a OrderedDict, not an nn.Module"):
        collect_statistics(net.state_dict(), fts, "0", cal, progress=False)
    with pytest.raises(ValidationError, match="fine-tuned model 'model1' is a dict"):
        collect_statistics(net, [fts[0], dict(fts[1].state_dict())], "0", cal, progress=False)
    with pytest.raises(ValidationError, match="batch_size must be an integer >= 1, got 2.5"):
        collect_statistics(net, fts, "0", cal, batch_size=2.5, progress=False)
    with torch.no_grad():
        fts[0][0].weight[0, 0] = float("nan")
    with pytest.raises(BadDataError, match="layer '0' in fine-tuned model 'model0' contain NaN or inf .its tensor '0.weight'"):
        collect_statistics(net, fts, "0", cal, targets="labels", progress=False)
    assert np.isnan(fts[0][0].weight[0, 0].item())  # (the input is left as it was)
