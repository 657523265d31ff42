"""Exact Euclidean projections in PyTorch (CPU or CUDA, float32 or float64) for the built-in
sets, so that first-order solvers never leave the device. Tensors are flat ``(n,)`` views of
``d`` (row-major ``(K, n_atoms)``). Sets without a torch projection here fall back to the set's
numpy projection (one host round trip per call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..constraints import (
    Box,
    ConstraintSet,
    GlobalSimplex,
    L1Ball,
    Simplex,
    Unconstrained,
)

Projection = Callable[[Any], Any]


def _simplex_sort(v: Any, total: float) -> Any:
    """Project each column of ``v`` (``(K, m)``) onto ``{x >= 0, sum_k x_k = total}`` (sort-based)."""
    import torch

    K = v.shape[0]
    u, _ = torch.sort(v, dim=0, descending=True)
    css = torch.cumsum(u, dim=0) - total
    idx = torch.arange(1, K + 1, device=v.device, dtype=v.dtype).unsqueeze(1)
    cond = u - css / idx > 0
    rho = (cond.to(torch.int64) * torch.arange(1, K + 1, device=v.device).unsqueeze(1)).amax(dim=0)
    rho = rho.clamp(min=1)
    theta = css.gather(0, (rho - 1).unsqueeze(0)).squeeze(0) / rho.to(v.dtype)
    return (v - theta.unsqueeze(0)).clamp(min=0)


def _capped_sum(v: Any, lo: Any, hi: Any, total: float, iters: int = 0) -> Any:
    """Project each column of ``v`` onto ``{lo <= x <= hi, sum_k x_k = total}`` (bisection on
    the shift, then the exact shift from the free entries)."""
    import torch

    iters = iters or (64 if v.dtype == torch.float64 else 36)
    t_lo = (v - hi).amin(dim=0) - abs(total) - 1.0
    t_hi = (v - lo).amax(dim=0) + abs(total) + 1.0
    t_lo = torch.where(torch.isfinite(t_lo), t_lo, (v.amin(dim=0) - v.abs().amax(dim=0) - abs(total) - 1.0))
    t_hi = torch.where(torch.isfinite(t_hi), t_hi, (v.amax(dim=0) + v.abs().amax(dim=0) + abs(total) + 1.0))
    for _ in range(iters):
        mid = 0.5 * (t_lo + t_hi)
        excess = torch.clamp(v - mid, lo, hi).sum(dim=0) - total
        t_lo = torch.where(excess > 0, mid, t_lo)
        t_hi = torch.where(excess > 0, t_hi, mid)
    tau = 0.5 * (t_lo + t_hi)
    x = torch.clamp(v - tau, lo, hi)
    free = (x > lo) & (x < hi)
    nfree = free.sum(dim=0)
    fixed_sum = torch.where(free, torch.zeros_like(x), x).sum(dim=0)
    tau2 = torch.where(nfree > 0, (torch.where(free, v, torch.zeros_like(v)).sum(dim=0) - (total - fixed_sum))
                       / nfree.clamp(min=1).to(v.dtype), tau)
    x2 = torch.clamp(v - tau2, lo, hi)
    better = (x2.sum(dim=0) - total).abs() <= (x.sum(dim=0) - total).abs()
    return torch.where(better.unsqueeze(0), x2, x)


def _l1_sort(w: Any, radius: float) -> Any:
    """Project ``w`` (flat) onto ``{||x||_1 <= radius}`` (Duchi et al., sort-based)."""
    import torch

    a = w.abs()
    if float(a.sum()) <= radius:
        return w.clone()
    if radius == 0:
        return torch.zeros_like(w)
    u, _ = torch.sort(a, descending=True)
    css = torch.cumsum(u, dim=0)
    idx = torch.arange(1, u.numel() + 1, device=w.device, dtype=w.dtype)
    rho = int(torch.nonzero(u * idx > (css - radius)).max())
    theta = (css[rho] - radius) / (rho + 1.0)
    return torch.sign(w) * (a - theta).clamp(min=0)


def _box_l1(v: Any, lo: Any, hi: Any, c: Any, radius: float, iters: int = 0) -> Any:
    import torch

    iters = iters or (64 if v.dtype == torch.float64 else 36)
    w = v - c

    def at(lam: Any) -> Any:
        return torch.clamp(c + torch.sign(w) * (w.abs() - lam).clamp(min=0), lo, hi)

    x = at(torch.zeros((), dtype=v.dtype, device=v.device))
    if float((x - c).abs().sum()) <= radius:
        return x
    lam_lo = torch.zeros((), dtype=v.dtype, device=v.device)
    lam_hi = w.abs().max()
    for _ in range(iters):
        mid = 0.5 * (lam_lo + lam_hi)
        over = (at(mid) - c).abs().sum() > radius
        lam_lo = torch.where(over, mid, lam_lo)
        lam_hi = torch.where(over, lam_hi, mid)
    return at(lam_hi)


def torch_projection(cset: ConstraintSet, shape: tuple[int, int], device: Any, dtype: Any) -> Projection:
    """A function ``flat tensor -> flat tensor`` projecting onto ``cset`` (on ``device``)."""
    import torch

    K, m = shape
    members = cset.members()

    def tens(a: np.ndarray) -> Any:
        return torch.as_tensor(np.asarray(a, dtype=np.float64), dtype=dtype, device=device)

    boxes = [s for s in members if isinstance(s, Box)]
    simplices = [s for s in members if isinstance(s, Simplex)]
    balls = [s for s in members if isinstance(s, L1Ball)]
    others = [s for s in members if not isinstance(s, (Box, Simplex, L1Ball, Unconstrained))]
    if not members:
        return lambda x: x
    if not others and len(boxes) <= 1 and len(simplices) + len(balls) <= 1:
        if boxes:
            b_lo, b_hi = boxes[0].bounds(shape)
        else:
            b_lo, b_hi = np.full(shape, -np.inf), np.full(shape, np.inf)
        if not simplices and not balls:
            lo, hi = tens(b_lo).reshape(-1), tens(b_hi).reshape(-1)
            return lambda x: torch.clamp(x, lo, hi)
        if simplices:
            sx = simplices[0]
            glob = isinstance(sx, GlobalSimplex)
            lo2 = np.maximum(b_lo, 0.0)
            capped = bool(np.any(np.isfinite(b_hi)) or np.any(lo2 > 0))
            if glob:
                lo_t, hi_t = tens(lo2).reshape(-1, 1), tens(b_hi).reshape(-1, 1)
                if capped:
                    return lambda x: _capped_sum(x.reshape(-1, 1), lo_t, hi_t, sx.total).reshape(-1)
                return lambda x: _simplex_sort(x.reshape(-1, 1), sx.total).reshape(-1)
            lo_t, hi_t = tens(lo2), tens(b_hi)
            if capped:
                return lambda x: _capped_sum(x.reshape(K, m), lo_t, hi_t, sx.total).reshape(-1)
            return lambda x: _simplex_sort(x.reshape(K, m), sx.total).reshape(-1)
        ball = balls[0]
        c = ball._center(shape)
        if not boxes:
            c_t = tens(c).reshape(-1)
            return lambda x: c_t + _l1_sort(x - c_t, ball.radius)
        if np.all((b_lo <= c) & (c <= b_hi)):
            lo, hi, c_t = tens(b_lo).reshape(-1), tens(b_hi).reshape(-1), tens(c).reshape(-1)
            return lambda x: _box_l1(x, lo, hi, c_t, ball.radius)

    def host(x: Any) -> Any:  # numpy fallback (one round trip)
        d = x.detach().to("cpu", torch.float64).numpy().reshape(shape)
        return tens(cset.project(d)).reshape(-1)

    return host
