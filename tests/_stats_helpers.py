"""Shared fixtures for the statistics tests: small models, fine-tuned copies, references."""

from __future__ import annotations

import copy
import itertools
import math

import numpy as np
import torch
from torch import nn


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def finetuned_copies(base: nn.Module, K: int, scale: float = 0.1, layer: str | None = None,
                     seed: int = 0) -> list[nn.Module]:
    """K deep copies of ``base`` with Gaussian perturbations (only ``layer`` if given)."""
    gen = seeded(seed)
    out = []
    for _ in range(K):
        model = copy.deepcopy(base)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if layer is None or name.startswith(layer + "."):
                    p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        out.append(model)
    return out


def linear_net(dims=(6, 5, 4, 3), dtype=torch.float64, seed: int = 0, bias: bool = True) -> nn.Sequential:
    """An exactly linear network ``Linear -> Linear -> ...`` (no activations)."""
    torch.manual_seed(seed)
    layers = [nn.Linear(a, b, bias=bias) for a, b in itertools.pairwise(dims)]
    return nn.Sequential(*layers).to(dtype)


def mnist_mlp(dtype=torch.float64, seed: int = 0) -> nn.Sequential:
    """The paper's MNIST MLP 784-256-128-10 with ReLU; the merge layer is ``"2"``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                         nn.Linear(128, 10)).to(dtype)


class LinearSequence(nn.Module):
    """Exactly linear sequence model: per-token linear maps and a fixed token-mixing matrix,
    so a perturbation at one position changes the outputs at every position."""

    def __init__(self, m0=4, m=5, r=3, c=2, T=3, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(m0, m)
        self.merge = nn.Linear(m, r)
        self.mix = nn.Parameter(torch.randn(T, T))
        self.head = nn.Linear(r, c)

    def forward(self, x):  # (B, T, m0) -> (B, T, c)
        u = self.merge(self.embed(x))
        return self.head(torch.einsum("st,btr->bsr", self.mix, u))


class TinyTransformer(nn.Module):
    """One attention block with LayerNorm, residuals and a GELU MLP; output per position."""

    def __init__(self, d_in=5, d=8, hidden=12, c=3, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(d_in, d)
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.norm1 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.norm2 = nn.LayerNorm(d)
        self.head = nn.Linear(d, c)

    def forward(self, x):  # (B, T, d_in) -> (B, T, c)
        h = self.embed(x)
        att = torch.softmax(self.q(h) @ self.k(h).transpose(1, 2) / math.sqrt(h.shape[-1]), dim=-1)
        h = self.norm1(h + att @ self.v(h))
        h = self.norm2(h + self.fc2(torch.nn.functional.gelu(self.fc1(h))))
        return self.head(h)


def true_error(model: nn.Module, finetuned: list[nn.Module], calibration: list[torch.Tensor]) -> float:
    """``sum_t sum_j ||model(x_j) - ft_t(x_j)||^2`` over every task's calibration inputs."""
    total = 0.0
    with torch.no_grad():
        for ft, x in zip(finetuned, calibration):
            total += float(((model(x) - ft(x)) ** 2).sum())
    return total


def weight_jacobian_change(model: nn.Module, layer: str, inputs, update: np.ndarray,
                           output_fn=None) -> np.ndarray:
    """Brute force: the full Jacobian of the compared output w.r.t. the layer's weight (and
    bias) by ``torch.autograd.functional.jacobian``, contracted with the augmented ``update``
    (``(r, m + 1)`` with a bias, else ``(r, m)``). Returns the first-order output change
    ``(B, c)``. ``inputs`` is a tensor or a dict of keyword arguments."""
    from torch.func import functional_call

    params = dict(model.named_parameters())
    W0 = params[f"{layer}.weight"].detach()
    has_bias = f"{layer}.bias" in params
    b0 = params[f"{layer}.bias"].detach() if has_bias else torch.zeros(0, dtype=W0.dtype)
    select = output_fn or (lambda out: out)

    def f(W, b):
        new = {f"{layer}.weight": W}
        if has_bias:
            new[f"{layer}.bias"] = b
        if isinstance(inputs, dict):
            out = functional_call(model, new, (), inputs)
        else:
            out = functional_call(model, new, (inputs,))
        return select(out)

    JW, Jb = torch.autograd.functional.jacobian(f, (W0, b0))
    out_dims = JW.ndim - 2
    U = torch.as_tensor(update, dtype=W0.dtype)
    change = torch.tensordot(JW, U[:, : W0.shape[1]], dims=([out_dims, out_dims + 1], [0, 1]))
    if has_bias:
        change = change + torch.tensordot(Jb, U[:, -1], dims=([out_dims], [0]))
    return change.reshape(change.shape[0], -1).detach().numpy()
