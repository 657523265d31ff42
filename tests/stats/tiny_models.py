"""Small torch models that the statistics tests linearise. They are classes that tests build with
arguments and name in ``parametrize`` lists (read when the modules are imported), so they live
here rather than in fixtures; the model *builders* are fixtures in ``conftest.py``."""

from __future__ import annotations

import math

import torch
from torch import nn


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
