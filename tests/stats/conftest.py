"""Fixtures of the statistics tests: small models, fine-tuned copies, and brute-force references."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call


@pytest.fixture(scope="session")
def seeded() -> Callable[[int], torch.Generator]:
    """``seeded(seed)``: a fresh CPU ``torch.Generator`` seeded with ``seed``."""

    def _seeded(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    return _seeded


@pytest.fixture(scope="session")
def finetuned_copies(seeded) -> Callable[..., list[nn.Module]]:
    """``finetuned_copies(base, K, scale=0.1, layer=None, seed=0)``: K deep copies of ``base``
    with Gaussian perturbations of std ``scale`` (only ``layer``'s parameters if given)."""

    def _finetuned_copies(base: nn.Module, K: int, scale: float = 0.1, layer: str | None = None,
                          seed: int = 0) -> list[nn.Module]:
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

    return _finetuned_copies


@pytest.fixture(scope="session")
def linear_net() -> Callable[..., nn.Sequential]:
    """``linear_net(dims=(6, 5, 4, 3), dtype=float64, seed=0, bias=True)``: an exactly linear
    network ``Linear -> Linear -> ...`` (no activations) with layer widths ``dims``."""

    def _linear_net(dims=(6, 5, 4, 3), dtype=torch.float64, seed: int = 0, bias: bool = True) -> nn.Sequential:
        torch.manual_seed(seed)
        layers = [nn.Linear(a, b, bias=bias) for a, b in itertools.pairwise(dims)]
        return nn.Sequential(*layers).to(dtype)

    return _linear_net


@pytest.fixture(scope="session")
def mnist_mlp() -> Callable[..., nn.Sequential]:
    """``mnist_mlp(dtype=float64, seed=0)``: the paper's MNIST MLP 784-256-128-10 with ReLU; the
    merge layer is ``"2"``."""

    def _mnist_mlp(dtype=torch.float64, seed: int = 0) -> nn.Sequential:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                             nn.Linear(128, 10)).to(dtype)

    return _mnist_mlp


@pytest.fixture(scope="session")
def true_error() -> Callable[..., float]:
    """``true_error(model, finetuned, calibration)``: ``sum_t sum_j ||model(x_j) - ft_t(x_j)||^2``
    over every task's calibration inputs (a float, squared output units)."""

    def _true_error(model: nn.Module, finetuned: list[nn.Module], calibration: list[torch.Tensor]) -> float:
        total = 0.0
        with torch.no_grad():
            for ft, x in zip(finetuned, calibration):
                total += float(((model(x) - ft(x)) ** 2).sum())
        return total

    return _true_error


@pytest.fixture(scope="session")
def weight_jacobian_change() -> Callable[..., np.ndarray]:
    """``weight_jacobian_change(model, layer, inputs, update, output_fn=None)``, brute force: the
    full Jacobian of the compared output w.r.t. the layer's weight (and bias) by
    ``torch.autograd.functional.jacobian``, contracted with the augmented ``update`` (``(r, m + 1)``
    with a bias, else ``(r, m)``). Returns the first-order output change ``(B, c)``. ``inputs`` is
    a tensor or a dict of keyword arguments."""

    def _weight_jacobian_change(model: nn.Module, layer: str, inputs, update: np.ndarray,
                                output_fn=None) -> np.ndarray:
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

    return _weight_jacobian_change
