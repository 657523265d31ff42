"""Seeded Bernoulli keep-masks for DARE and row-uniform DARE, or masks the caller injects.

All randomness goes through ``torch.Generator`` objects (the global RNG is never touched):

- ``seed_scope="tensor"`` (default): each tensor (or row group) gets its own generator, seeded
  from ``seed`` and the tensor's name (BLAKE2b hash), so a tensor's mask does not depend on which
  other tensors are selected: merging one layer gives the same mask as merging the whole model.
- ``seed_scope="global"``: one generator seeded with ``seed`` draws the masks in the
  reference model's tensor order, model by model within a tensor. This is the order PEFT's
  ``merge_utils`` functions and mergekit use with the global RNG after ``torch.manual_seed(seed)``,
  so for a single tensor (or the same sequence of tensors) the masks are identical to theirs.

A mask entry is ``torch.bernoulli(p)`` with ``p`` the keep probability (``density``) held in a
float32 tensor on the CPU (as mergekit does; PEFT uses the tensor's dtype, the same for float32).
``density >= 1`` keeps everything and draws nothing (as both peers).

Injected masks (``masks={name: mask}``) replace the draw for those tensors: shape ``(K, *shape)``
for element-wise DARE, ``(K, shape[0])`` (one entry per row) for row-uniform DARE; values 0/1
(bool or numeric). Injected names that no merged tensor used are an error (a typo would
otherwise silently draw random masks).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Literal

from ..errors import ConfigError, ValidationError


def tensor_seed(seed: int, name: str) -> int:
    """The seed of ``name``'s generator under ``seed_scope="tensor"`` (63-bit, deterministic)."""
    digest = hashlib.blake2b(f"{int(seed)}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class MaskDrawer:
    """Draws (or looks up) keep-masks for ``K`` models; see the module docstring."""

    def __init__(self, K: int, seed: int, scope: Literal["tensor", "global"],
                 injected: Mapping[str, Any] | None = None):
        import torch

        self.K = K
        self.seed = int(seed)
        self.scope = scope
        self.injected = dict(injected or {})
        self.used: set[str] = set()
        self._global = torch.Generator().manual_seed(self.seed) if scope == "global" else None
        self._cache: dict[str, Any] = {}

    def _generator(self, name: str) -> Any:
        import torch

        if self._global is not None:
            return self._global
        return torch.Generator().manual_seed(tensor_seed(self.seed, name))

    def _draw(self, key: str, shape: tuple[int, ...], density: float) -> Any:
        """``(K, *shape)`` float32 CPU mask for ``key``: injected, cached or drawn."""
        import torch

        if key in self._cache:
            return self._cache[key]
        if key in self.injected:
            mask = torch.as_tensor(self.injected[key])
            want = (self.K, *shape)
            if tuple(mask.shape) != want:
                raise ValidationError(
                    f"injected mask for tensor {key!r} has shape {tuple(mask.shape)}, expected {want}")
            mask = mask.detach().to("cpu", torch.float32)
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise ValidationError(f"injected mask for tensor {key!r} has entries other than 0 and 1")
            self.used.add(key)
        elif density >= 1.0:
            mask = torch.ones((self.K, *shape), dtype=torch.float32)
        else:
            gen = self._generator(key)
            p = torch.full(shape, float(density), dtype=torch.float32)
            mask = torch.stack([torch.bernoulli(p, generator=gen) for _ in range(self.K)])
        self._cache[key] = mask
        return mask

    def elementwise(self, name: str, shape: tuple[int, ...], density: float) -> Any:
        """Keep-mask ``(K, *shape)`` (float32, CPU) for tensor ``name``."""
        return self._draw(name, tuple(shape), density)

    def rows(self, group: str, n_rows: int, density: float) -> Any:
        """One keep-entry per row: ``(K, n_rows)`` (float32, CPU) for the row group ``group``."""
        return self._draw(group, (int(n_rows),), density)

    def check_all_used(self) -> None:
        unused = sorted(set(self.injected) - self.used)
        if unused:
            raise ConfigError(
                f"masks were given for tensors that were not merged: {', '.join(map(repr, unused))} "
                f"(check the names against include/exclude)"
            )
