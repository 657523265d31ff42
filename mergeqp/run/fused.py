"""Where a stored tensor lives in a live model that fuses it with others.

``transformers`` (5 and later) loads some checkpoints through a weight conversion that is not a plain
rename: a mixture-of-experts layer's per-expert weights (Mixtral's ``experts.E.w1`` / ``w3`` /
``w2``, Qwen2-MoE's ``experts.E.gate_proj`` / ``up_proj`` / ``down_proj``) are stacked into one 3-D
parameter per layer (``experts.gate_up_proj``: every expert's gate and up projections; ``experts.down_proj``),
and ``save_pretrained`` writes them back one per expert. A merge computes such tensors under their
stored names (a baseline, or a start merged on every tensor) and must put them into the live model for
its statistics and evaluation. Their place in the fused parameter is found by value: the live model
was loaded from the base checkpoint, so exactly one block of one fused parameter (an expert's slice,
along the stacked dimension and a contiguous range of the next) holds each stored tensor's values.
Before stop 55 such a merge stopped after its statistics with "not a parameter of the loaded model".
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from ..errors import ValidationError
from ..io import Checkpoint
from ..merge.sites import checkpoint_names

#: model -> the :class:`FusedPlacer` of the checkpoint it was loaded from (:func:`remember_source`)
_PLACERS: weakref.WeakKeyDictionary[Any, FusedPlacer] = weakref.WeakKeyDictionary()


class FusedPlacer:
    """Finds, and remembers, the block of a fused live parameter that holds a stored tensor.

    ``stored``: the checkpoint the live model was loaded from. A tensor is located the first time it
    is asked for, before a merged value enters its block: the blocks of tensors not loaded yet
    still hold the stored values."""

    def __init__(self, stored: Checkpoint):
        self.stored = stored
        self.fused: list[str] | None = None  # live tensors stored otherwise (found on first need)
        self.plain: set[str] = set()  # stored (and live) names of the tensors stored as they are
        self.found: dict[str, tuple[str, int, int, int]] = {}

    def view(self, model: Any, key: str, state: dict[str, Any] | None = None) -> Any | None:
        """The block of a live parameter that the stored tensor ``key`` fills (a view: writing into
        it writes the parameter), or ``None`` when ``key`` is no stored tensor of the checkpoint, one
        stored as a parameter of its own, or the model has no fused parameter. ``state``: the model's
        ``state_dict()`` when the caller holds it (made here otherwise). Raises
        :class:`ValidationError` when its place is not one block (none holds its values, or several:
        identical experts cannot be told apart)."""
        if state is None:
            state = model.state_dict()
        if key not in self.found:
            if self.fused is None:
                plain = checkpoint_names(model)  # live -> stored for plain renames; fused tensors are left out
                self.fused = [name for name in state if name not in plain]
                self.plain = set(plain.values()) | set(plain)
            if not self.fused or key not in self.stored or key in self.plain:
                return None
            self.found[key] = self._locate(state, key)
        name, expert, start, stop = self.found[key]
        return state[name][expert, start:stop]

    def _locate(self, state: dict[str, Any], key: str) -> tuple[str, int, int, int]:
        import torch  # optional heavy dependency: the merge runs on torch

        assert self.fused is not None
        value = self.stored.get(key)
        taken = set(self.found.values())
        matches = []
        converted: dict[tuple[Any, Any], Any] = {}  # the stored value in each live (device, dtype), made once
        for name in self.fused:
            P = state[name]
            if not P.is_floating_point() or not value.is_floating_point():
                continue
            for where, block in _blocks(name, P, tuple(value.shape)):
                if where in taken:
                    continue
                want = converted.get((P.device, P.dtype))
                if want is None:
                    want = converted[(P.device, P.dtype)] = value.to(device=P.device, dtype=P.dtype)
                if torch.equal(block[:1], want[:1]) and torch.equal(block, want):
                    matches.append(where)
        if len(matches) == 1:
            return matches[0]
        fused = ", ".join(f"{n} {tuple(state[n].shape)}" for n in self.fused[:4])
        if not matches:
            raise ValidationError(
                f"merged tensor {key!r} is not a parameter of the loaded model, and no block of the model's "
                f"fused parameters ({fused}) holds its stored values: transformers converts it on load in a "
                f"way mergeqp cannot place; leave it out of the merge (select other layers, or a method that "
                f"does not merge every tensor)")
        raise ValidationError(
            f"merged tensor {key!r} is stored by transformers inside a fused parameter, but {len(matches)} "
            f"blocks of them hold its stored values ({', '.join(f'{m[0]}[{m[1]}]' for m in matches[:4])}: "
            f"identical experts?), so its place cannot be told; leave it out of the merge")


def _blocks(name: str, P: Any, shape: tuple[int, ...]) -> Iterator[tuple[tuple[str, int, int, int], Any]]:
    """The blocks of ``P`` (``(E, R, ...)``) that a stored tensor of ``shape`` (``(r, ...)``) can fill:
    ``P[e, j r:(j + 1) r]`` (stacked experts, each a concatenation of tensors of ``r`` rows)."""
    if P.dim() != len(shape) + 1 or not shape or tuple(P.shape[2:]) != shape[1:]:
        return
    rows = shape[0]
    if rows == 0 or P.shape[1] % rows:
        return
    for e in range(P.shape[0]):
        for start in range(0, P.shape[1], rows):
            yield (name, e, start, start + rows), P[e, start:start + rows]


def remember_source(model: Any, stored: Checkpoint) -> None:
    """Record that ``model`` was just loaded from ``stored`` (before any merged tensor entered it)."""
    _PLACERS[model] = FusedPlacer(stored)


def fused_view(model: Any, key: str, state: dict[str, Any] | None = None) -> Any | None:
    """The block of ``model``'s fused parameter that the stored tensor ``key`` fills
    (:meth:`FusedPlacer.view`; ``state``: the model's ``state_dict()`` if the caller has it), or
    ``None`` when the model's source was not recorded or holds no such tensor."""
    placer = _PLACERS.get(model)
    return None if placer is None else placer.view(model, key, state)
