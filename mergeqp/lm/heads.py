"""The models' parts the output metrics work with: a language model's linear output head and the
backbone that feeds it, a task's classifier head on the pooled output, running a batch without
gradients, and the precisions a checkpoint is stored in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import BadDataError, ValidationError
from ..io.calibration import Batch


def forward(model: Any, batch: Batch, device: Any) -> Any:
    """Run ``model`` on a batch (moved to ``device``) without gradients."""
    import torch

    with torch.no_grad():
        return model(**{k: v.to(device) for k, v in batch.inputs.items()})


@dataclass(frozen=True, eq=False)
class ClassifierHead:
    """A task's linear classifier on the pooled output: ``logits = pooled @ weight' + bias``
    (``weight`` ``(C, H)``, ``bias`` ``(C,)`` or ``None``; float64 tensors)."""

    weight: Any
    bias: Any = None
    name: str = "head"

    @classmethod
    def of(cls, weight: Any, bias: Any = None, name: str = "head") -> ClassifierHead:
        """Checked: a finite 2-D weight with two or more classes and a matching finite bias."""
        import torch

        w = torch.as_tensor(weight).detach().to("cpu", torch.float64)
        if w.dim() != 2 or w.shape[0] < 2 or w.shape[1] < 1:
            raise ValidationError(f"{name}: the head's weight must be (classes >= 2, features), got shape {tuple(w.shape)}")
        if not torch.all(torch.isfinite(w)):
            raise BadDataError(f"{name}: the head's weight has NaN or inf entries")
        b = None
        if bias is not None:
            b = torch.as_tensor(bias).detach().to("cpu", torch.float64).reshape(-1)
            if b.numel() != w.shape[0]:
                raise ValidationError(f"{name}: the head's bias has {b.numel()} entries for {w.shape[0]} classes")
            if not torch.all(torch.isfinite(b)):
                raise BadDataError(f"{name}: the head's bias has NaN or inf entries")
        return cls(w, b, name)

    @property
    def classes(self) -> int:
        return int(self.weight.shape[0])

    def logits(self, pooled: Any) -> Any:
        """``(B, C)`` class logits of a pooled output ``(B, H)``, in its dtype and on its device."""
        if pooled.dim() != 2 or int(pooled.shape[-1]) != int(self.weight.shape[1]):
            raise ValidationError(f"{self.name}: the head reads {int(self.weight.shape[1])} features but the pooled "
                                  f"output has shape {tuple(pooled.shape)}")
        x = pooled @ self.weight.to(device=pooled.device, dtype=pooled.dtype).t()
        return x if self.bias is None else x + self.bias.to(device=pooled.device, dtype=pooled.dtype)


def narrower_floats(t: Any) -> list[Any]:
    """The floating-point dtypes a checkpoint is commonly stored in (bfloat16, then float16) that are
    narrower than tensor ``t``'s (none for a tensor that is not floating-point)."""
    import torch

    if not t.is_floating_point():
        return []
    return [low for low in (torch.bfloat16, torch.float16) if torch.finfo(low).bits < torch.finfo(t.dtype).bits]


def stored_precision(weight: Any, bias: Any = None) -> Any:
    """The narrower floating-point dtype (bfloat16, then float16) in which ``weight`` and ``bias``
    are exactly representable, when narrower than their own dtype (a checkpoint saved in it and
    read into a wider one); else ``None``."""
    import torch

    for low in narrower_floats(weight):
        if all(t is None or bool(torch.equal(t.detach().to(low).to(t.dtype), t.detach())) for t in (weight, bias)):
            return low
    return None


def linear_head(model: Any) -> Any:
    """The model's output head (``get_output_embeddings()``) if it is an ``nn.Linear``, else ``None``."""
    import torch

    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return head if isinstance(head, torch.nn.Linear) else None


def backbone(model: Any) -> Any:
    """The module whose output's ``last_hidden_state`` feeds the head (``model.base_model``), or
    ``None`` when the model has no separate one."""
    inner = getattr(model, "base_model", None)
    return inner if inner is not None and inner is not model else None


def last_hidden(out: Any) -> Any:
    """``last_hidden_state`` of a backbone's output (or its first element)."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    value = getattr(out, "last_hidden_state", None)
    return value if value is not None else out[0]


def agree(a: Any, b: Any, dtype: Any) -> bool:
    """``a`` and ``b`` equal to rounding of ``dtype`` (relative to ``b``'s norm, float64)."""
    import torch

    a, b = a.to("cpu", torch.float64), b.to("cpu", torch.float64)
    tol = min(1e3 * float(torch.finfo(dtype).eps), 1e-2)
    return float((a - b).norm()) <= tol * float(b.norm()) + 1e-300
