"""Model shapes that broke the statistics silently before: in-place ops on the layer's input
or output, tied weights, a layer whose first dimension is not the batch, dict batches with
extra model arguments, a layer that never runs, non-finite weights, token labels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import mergeqp as mq
from mergeqp.errors import ValidationError


class InplaceResidual(nn.Module):
    """``x += fc(x)`` overwrites fc's input in place; an in-place ReLU after the output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.fc, self.out = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        x += self.fc(x)
        return self.out(x)


@pytest.mark.parametrize("param", ["rows", "scalar", "columns"])
def test_in_place_residual_gives_the_exact_objective(finetuned_copies, true_error, param: str) -> None:
    """Exactly linear model: J(d) equals the merged model's true squared error, although the
    model overwrites the layer's input in place after the layer ran."""
    torch.manual_seed(0)
    base = InplaceResidual().double()
    fts = finetuned_copies(base, 2, scale=0.3, layer="fc", seed=1)
    cal = [torch.randn(7, 3, dtype=torch.float64) for _ in range(2)]
    stats = mq.collect_statistics(base, fts, "fc", cal, parametrisations=[param], progress=False)
    problem = stats.problem(param)
    d = np.random.default_rng(2).uniform(-0.5, 1.5, problem.shape)
    merged = mq.apply_merge(base, fts, "fc", d, parametrisation=param)
    assert problem.objective(d) == pytest.approx(true_error(merged, fts, cal), rel=1e-10)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.c.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


def test_tied_weights_are_rejected_by_collect_and_apply(finetuned_copies) -> None:
    torch.manual_seed(0)
    base = Tied().double()
    fts = finetuned_copies(base, 2, scale=0.1, seed=1)
    cal = [torch.randn(5, 4, dtype=torch.float64)] * 2
    with pytest.raises(ValidationError, match=r"weight of layer 'a' is tied to 'c.weight'"):
        mq.collect_statistics(base, fts, "a", cal, progress=False)
    with pytest.raises(ValidationError, match=r"weight of layer 'c' is tied to 'a.weight'"):
        mq.apply_merge(base, fts, "c", np.full((2, 4), 0.5))
    # the untied layer is fine
    stats = mq.collect_statistics(base, fts, "b", cal, progress=False)
    assert stats.problem("rows").shape == (2, 4)


class SeqFirst(nn.Module):
    """Works on ``(T, B, r)`` inside: the layer's first dimension is time, not the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.mix, self.out = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, 3)
        h = self.fc(x.transpose(0, 1))  # (T, B, 4)
        h = h + h.mean(dim=0, keepdim=True)  # mixes positions: one sample's row moves all
        return self.out(self.mix(h)).transpose(0, 1).reshape(x.shape[0], -1)


@pytest.mark.parametrize("T", [5, 6])
def test_a_layer_whose_first_dimension_is_not_the_batch_is_rejected(finetuned_copies, T: int) -> None:
    torch.manual_seed(0)
    base = SeqFirst().double()
    fts = finetuned_copies(base, 2, scale=0.1, layer="fc", seed=1)
    cal = [torch.randn(5, T, 3, dtype=torch.float64)] * 2
    msg = "changed the compared output of other samples" if T == 5 else "is not the batch size"
    with pytest.raises(ValidationError, match=msg):
        mq.collect_statistics(base, fts, "fc", cal, progress=False)


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.a(x)
        return self.b(h if mask is None else h * mask)


def test_dict_batch_with_x_and_more_model_arguments_passes_all_of_them(finetuned_copies) -> None:
    torch.manual_seed(0)
    base = Masked().double()
    fts = finetuned_copies(base, 2, scale=0.2, layer="a", seed=1)
    x = torch.randn(8, 4, dtype=torch.float64)
    zero = [[{"x": x, "mask": torch.zeros(8, 5, dtype=torch.float64), "y": torch.zeros(8)}]] * 2
    stats = mq.collect_statistics(base, fts, "a", zero, progress=False)
    assert np.max(np.abs(stats.problem("rows").H)) == 0.0  # the mask reached the model
    ones = [[{"x": x, "mask": torch.ones(8, 5, dtype=torch.float64)}]] * 2
    plain = [[{"x": x}]] * 2
    a = mq.collect_statistics(base, fts, "a", ones, progress=False).problem("rows")
    b = mq.collect_statistics(base, fts, "a", plain, progress=False).problem("rows")
    np.testing.assert_allclose(a.H, b.H, rtol=1e-12, atol=1e-14)


def test_layer_that_never_runs_says_so(finetuned_copies) -> None:
    class Skips(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(3, 2), nn.Linear(3, 2)

        def forward(self, x):
            return self.used(x)

    base = Skips().double()
    fts = finetuned_copies(base, 2, scale=0.1, seed=1)
    with pytest.raises(ValidationError, match="the merge layer did not run in the forward pass"):
        mq.collect_statistics(base, fts, "unused", [torch.randn(3, 3, dtype=torch.float64)] * 2,
                              progress=False)


def test_non_finite_finetuned_weights_are_named_by_apply(finetuned_copies) -> None:
    base = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).double()
    fts = finetuned_copies(base, 2, scale=0.1, seed=1)
    with torch.no_grad():
        fts[1][0].weight[0, 0] = float("inf")
    with pytest.raises(ValidationError, match=r"fine-tuned model\(s\) \[1\]"):
        mq.apply_merge(base, fts, "0", np.full((2, 4), 0.5))


def test_integer_token_labels_ask_for_a_label_encoding(finetuned_copies) -> None:
    base = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 6)).double()
    fts = finetuned_copies(base, 2, scale=0.1, seed=1)
    cal = [[(torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 3, (4, 2)))]] * 2
    with pytest.raises(ValidationError, match="pass label_encoding"):
        mq.collect_statistics(base, fts, "0", cal, targets="labels", progress=False)


class BatchStats(nn.Module):
    """Always normalises with the batch's statistics (samples interact)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(0)) / (x.std(0) + 1e-3)


class Roll(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.roll(x, 1, 0)


class LookAhead(nn.Module):
    """Each sample reads the next one (no wrap): perturbing the first sample moves no other."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y[:-1] = y[:-1] + 0.5 * x[1:]
        return y


@pytest.mark.parametrize("mixer", [BatchStats, Roll, LookAhead], ids=["batch statistics", "roll", "look-ahead"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16], ids=["f64", "f16", "bf16"])
def test_samples_that_interact_are_caught_in_every_precision(finetuned_copies, mixer, dtype) -> None:
    """Also in half precision, and when sample 0's own output does not move (roll)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 12), mixer(), nn.Tanh(), nn.Linear(12, 3)).to(dtype)
    fts = finetuned_copies(base, 2, scale=0.1, layer="2", seed=1)
    cal = [torch.randn(8, 6).to(dtype)] * 2
    with pytest.raises(ValidationError, match="changed the compared output of other samples"):
        mq.collect_statistics(base, fts, "2", cal, batch_size=4, progress=False)


def test_a_first_batch_of_one_does_not_use_up_the_check(finetuned_copies) -> None:
    torch.manual_seed(0)
    class Center(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x - x.mean(0)

    base = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 12), Center(), nn.Linear(12, 3)).double()
    fts = finetuned_copies(base, 1, scale=0.1, layer="2", seed=1)
    x = torch.randn(9, 6, dtype=torch.float64)
    with pytest.raises(ValidationError, match="other samples"):
        mq.collect_statistics(base, fts, "2", [[x[:1], x[1:]]], progress=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_independent_half_precision_models_pass(finetuned_copies, dtype) -> None:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 12), nn.LayerNorm(12), nn.Linear(12, 3)).to(dtype)
    fts = finetuned_copies(base, 2, scale=0.1, layer="2", seed=1)
    stats = mq.collect_statistics(base, fts, "2", [torch.randn(8, 6).to(dtype)] * 2, batch_size=4, progress=False)
    assert stats.problem("rows").shape == (2, 12)


def test_broadcast_keyword_inputs_do_not_set_the_batch_size(finetuned_copies) -> None:
    """A (1, T) position tensor listed before the (B, T) main input is not the batch."""
    class Pos(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, position_ids, x):
            return self.b(self.a(x + position_ids[..., None]))

    torch.manual_seed(0)
    base = Pos().double()
    fts = finetuned_copies(base, 2, scale=0.1, layer="a", seed=1)
    batch = {"position_ids": torch.arange(5, dtype=torch.float64)[None], "x": torch.randn(4, 5, 3, dtype=torch.float64)}
    stats = mq.collect_statistics(base, fts, "a", [[batch], [batch]], progress=False)
    assert stats.n_samples == 8
