"""Depths of merge sites: which sites' inputs depend on which other sites' weights, measured.

Site ``B`` *depends on* site ``A`` when changing ``A``'s weight changes the input that ``B``
sees. The depth of a site is 0 when it depends on no other selected site, else one more than the
largest depth of the sites it depends on. Sites of one depth read inputs that none of them
changes (in a Llama block: ``q_proj``, ``k_proj``, ``v_proj``, then ``o_proj``, then
``gate_proj``, ``up_proj``, then ``down_proj``), so each can be linearised at the model merged
below that depth and solved on its own: ``mode: sequential`` with ``by_depth: true`` does that,
and spreads a depth's sites over the ranks under ``torchrun``.

The dependencies are measured, not read from names, so any architecture works: one forward pass
on a calibration batch records a fingerprint of every site's input (its sums and sums of
squares over the tokens), then one more pass per site with that site's
weight perturbed says whose inputs moved. ``S + 1`` forward passes for ``S`` sites, no gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import ValidationError
from .sites import LayerSite, read_augmented, site_module, write_augmented

#: a site's perturbation, relative to the mean absolute entry of its weight (plus one)
PERTURBATION = 1e-2
#: an input "moved" when its fingerprint changed by more than this, relative to its largest entry
MOVED = 1e-6


def _inputs(model: Any, sites: Sequence[LayerSite], run: Any) -> dict[str, Any]:
    """Each site's input (first positional argument of its module) in one run of ``run()``, as
    its :func:`_fingerprint`."""
    seen: dict[str, Any] = {}
    handles = []
    for site in sites:
        def hook(module: Any, args: tuple[Any, ...], name: str = site.name) -> None:
            seen[name] = _fingerprint(args[0])
        handles.append(site_module(model, site).register_forward_pre_hook(hook))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    missing = [s.name for s in sites if s.name not in seen]
    if missing:
        raise ValidationError(f"the depth of {missing[0]} cannot be measured: the model's forward pass on a "
                              f"calibration batch never called that layer")
    return seen


def _fingerprint(x: Any) -> Any:
    """``(2, features)`` float64: the sums of a site's input and of its squares over every token (a
    perturbation upstream moves them; kept instead of the input itself, so that probing a large
    model's many sites holds two vectors per site, not every site's activations)."""
    import torch

    x = x.detach().to(torch.float64)
    x = x.reshape(-1, x.shape[-1])
    return torch.stack([x.sum(0), (x * x).sum(0)])


def _moved(before: Any, after: Any) -> bool:
    """Whether a fingerprint changed beyond round-off (each row against its own largest entry)."""
    import torch

    if before.shape != after.shape:
        return True
    scale = before.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    return bool(torch.any((after - before).abs() > MOVED * scale))


def site_dependencies(model: Any, sites: Sequence[LayerSite], run: Any) -> dict[str, set[str]]:
    """``{site: the sites whose weights change its input}`` for the live ``model``; ``run()`` runs
    it on one calibration batch. The model is left as it was (each perturbed weight restored)."""
    import torch

    reference = _inputs(model, sites, run)
    out: dict[str, set[str]] = {s.name: set() for s in sites}
    generator = torch.Generator().manual_seed(0)
    for a in sites:
        weight = read_augmented(model, a)
        noise = torch.randn(weight.shape, generator=generator, dtype=torch.float64).to(weight.dtype)
        scale = PERTURBATION * (float(weight.abs().mean()) + 1.0)
        write_augmented(model, a, weight + scale * noise.to(weight.device))
        try:
            moved = _inputs(model, sites, run)
        finally:
            write_augmented(model, a, weight)
        for b in sites:
            if b.name != a.name and _moved(reference[b.name], moved[b.name]):
                out[b.name].add(a.name)
    return out


def depth_levels(sites: Sequence[LayerSite], depends_on: dict[str, set[str]]) -> list[tuple[LayerSite, ...]]:
    """``sites`` grouped by depth, shallowest first, each group in the given order. Sites that
    change each other's inputs (a cycle: weights shared or reused) raise
    :class:`~mergeqp.errors.ValidationError`."""
    depth: dict[str, int] = {}
    remaining = [s.name for s in sites]
    while remaining:
        ready = [n for n in remaining if depends_on[n] <= depth.keys()]
        if not ready:
            raise ValidationError(f"by_depth: the layers {remaining} change each other's inputs (a cycle), so they "
                                  f"have no depth order; use mode: sequential without by_depth")
        for n in ready:
            depth[n] = 1 + max((depth[a] for a in depends_on[n]), default=-1)
        remaining = [n for n in remaining if n not in depth]
    levels: dict[int, list[LayerSite]] = {}
    for s in sites:
        levels.setdefault(depth[s.name], []).append(s)
    return [tuple(levels[k]) for k in sorted(levels)]
