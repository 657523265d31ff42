"""What output of a Hugging Face model is compared, teacher-forced targets, and the MSE metric.

The merge objective compares, at every real (unpadded) token position, the merged model's
output with the task's fine-tuned model's output on the same prompt (teacher forcing: the
prompt's tokens are the inputs, no generation). ``OutputSpec`` says which output
(``field``, default ``logits``) and how a large vocabulary ``V`` is reduced to ``k`` numbers
per position so that the statistics stay tractable (their size grows with the compared
output's length):

- ``restrict="none"``: every logit; the objective is the summed squared logit error.
- ``restrict="projection"``: ``o = logits @ P`` with ``P`` a ``(V, k)`` Gaussian matrix with
  entries ``N(0, 1/k)`` drawn from ``seed``: ``E ||P'(h - y)||^2 = ||h - y||^2``, so the
  objective is an unbiased, Johnson-Lindenstrauss estimate of the full one (relative error
  ~ ``sqrt(2/k)`` per position, averaging out over positions). It is linear, so the
  linearisation and the QP are those of the full objective seen through ``P``.
- ``restrict="topk"``: at each position, the ``k`` vocabulary entries the *target* ranks
  highest; the merged model's logits are gathered at the same indices. The objective ignores
  every other logit (a biased restriction that weights the tokens that matter to the task).

Positions outside the attention mask are multiplied by 0 in both the output and the target.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import BadDataError, ValidationError
from .io.calibration import Batch

RESTRICTIONS = ("none", "topk", "projection")


@dataclass(frozen=True)
class OutputSpec:
    """Which output is compared and its restriction (see the module docstring).

    ``field``: attribute of the model's output (``logits``, ``last_hidden_state``, ...).
    ``restrict``: ``none`` | ``topk`` | ``projection``; ``k``: their size; ``seed``: of ``P``.
    """

    field: str = "logits"
    restrict: str = "none"
    k: int | None = None
    seed: int = 0
    _cache: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.restrict not in RESTRICTIONS:
            raise ValidationError(f"output restriction {self.restrict!r}; valid: {', '.join(RESTRICTIONS)}")
        if self.restrict != "none" and (self.k is None or self.k < 1):
            raise ValidationError(f"output restriction {self.restrict!r} needs k >= 1")

    def raw(self, model_output: Any) -> Any:
        """The compared tensor of a model's forward output (``(B, T, V)``, ``(B, C)``, ...)."""
        import torch

        if isinstance(model_output, torch.Tensor):
            return model_output
        try:
            value = model_output[self.field]
        except (KeyError, TypeError, IndexError):
            value = getattr(model_output, self.field, None)
        if value is None:
            keys = list(model_output.keys()) if hasattr(model_output, "keys") else []
            raise ValidationError(f"model output has no {self.field!r}; available: {keys}")
        return value

    def projection(self, vocab: int, dtype: Any, device: Any) -> Any:
        """The ``(V, k)`` projection matrix (float64 draw from ``seed``, then cast)."""
        import torch

        key = (vocab, str(dtype), str(device))
        if key not in self._cache:
            gen = torch.Generator().manual_seed(int(self.seed))
            assert self.k is not None
            P = torch.randn(vocab, self.k, generator=gen, dtype=torch.float64) / math.sqrt(self.k)
            self._cache[key] = P.to(dtype=dtype, device=device)
        return self._cache[key]

    def topk_index(self, target_raw: Any) -> Any:
        """Indices ``(..., k)`` of the target's ``k`` largest entries along the last axis."""
        assert self.k is not None
        if self.k > target_raw.shape[-1]:
            raise ValidationError(f"output topk k={self.k} exceeds the output size {target_raw.shape[-1]}")
        return target_raw.topk(self.k, dim=-1).indices

    def select(self, raw: Any, mask: Any = None, index: Any = None) -> Any:
        """Restrict ``raw`` (last axis = vocabulary / features) and zero the masked positions."""
        if self.restrict == "projection":
            out = raw @ self.projection(raw.shape[-1], raw.dtype, raw.device)
        elif self.restrict == "topk":
            if index is None:
                raise ValidationError("topk restriction needs the target's indices")
            out = raw.gather(-1, index)
        else:
            out = raw
        return apply_mask(out, mask)


def apply_mask(out: Any, mask: Any) -> Any:
    """Zero positions where ``mask`` (``(B, T)``) is 0, if ``out`` is ``(B, T, ...)``."""
    if mask is None or out.dim() < 2 or tuple(out.shape[:2]) != tuple(mask.shape):
        return out
    m = mask.to(out.dtype)
    while m.dim() < out.dim():
        m = m.unsqueeze(-1)
    return out * m


@dataclass(frozen=True)
class TargetBatch:
    """A batch with its target: ``target`` is the fine-tuned model's compared output
    (restricted and masked, float64 on CPU); ``index`` the top-k indices (or ``None``);
    ``count`` the number of compared positions (real tokens, or samples)."""

    batch: Batch
    target: Any
    index: Any = None

    @property
    def count(self) -> int:
        """Compared positions: real tokens of a masked sequence output, else every position
        (``B`` for one vector per sample)."""
        if self.target.dim() >= 3:
            if self.batch.mask is not None and tuple(self.batch.mask.shape) == tuple(self.target.shape[:2]):
                return int(self.batch.mask.sum())
            return int(self.target[..., 0].numel())
        return int(self.target.shape[0])

    @property
    def entries(self) -> int:
        """Compared scalars: ``count`` times the per-position size."""
        per_position = int(self.target.shape[-1]) if self.target.dim() >= 3 else int(self.target[0].numel())
        return self.count * per_position


def forward(model: Any, batch: Batch, device: Any) -> Any:
    """Run ``model`` on a batch (moved to ``device``) without gradients."""
    import torch

    with torch.no_grad():
        return model(**{k: v.to(device) for k, v in batch.inputs.items()})


def teacher_forced_targets(model: Any, batches: Sequence[Batch], spec: OutputSpec, device: Any) -> list[TargetBatch]:
    """The fine-tuned ``model``'s compared outputs on ``batches`` (teacher forced), as targets."""
    import torch

    out = []
    for batch in batches:
        raw = spec.raw(forward(model, batch, device))
        if not torch.all(torch.isfinite(raw)):
            raise BadDataError("the fine-tuned model produced non-finite outputs on the calibration prompts "
                               "(NaN or inf in its checkpoint, or an overflow in its dtype)")
        index = spec.topk_index(raw) if spec.restrict == "topk" else None
        target = spec.select(raw, None if batch.mask is None else batch.mask.to(raw.device), index)
        out.append(TargetBatch(batch, target.detach().to("cpu", torch.float64),
                               None if index is None else index.to("cpu")))
    return out


def compared_output(model: Any, tb: TargetBatch, spec: OutputSpec, device: Any) -> Any:
    """The model's restricted, masked output on ``tb``'s batch (float64, CPU)."""
    import torch

    raw = spec.raw(forward(model, tb.batch, device))
    index = None if tb.index is None else tb.index.to(raw.device)
    mask = None if tb.batch.mask is None else tb.batch.mask.to(raw.device)
    return spec.select(raw, mask, index).to("cpu", torch.float64)


def squared_error(model: Any, batches: Sequence[TargetBatch], spec: OutputSpec, device: Any) -> tuple[float, int]:
    """``(sum of squared errors, number of compared entries)`` of ``model`` against the targets."""
    total = 0.0
    entries = 0
    for tb in batches:
        diff = compared_output(model, tb, spec, device) - tb.target
        total += float((diff * diff).sum())
        entries += tb.entries
    return total, entries


def teacher_forced_mse(model: Any, batches: Sequence[TargetBatch], spec: OutputSpec, device: Any) -> float:
    """Mean squared error per compared entry (e.g. per logit of each real token)."""
    total, entries = squared_error(model, batches, spec, device)
    return total / max(entries, 1)
