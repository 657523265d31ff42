"""The models a merge reads: a base and K fine-tuned checkpoints, checked against each other.

Each model may be given as

- a mapping ``name -> tensor`` (a state dict; numpy arrays are accepted too),
- an ``nn.Module`` (its ``state_dict()`` is used), or
- a :class:`mergeqp.io.checkpoint.Checkpoint` (read lazily: a tensor is loaded only when a
  merge method or the copy of an unselected tensor needs it).

The *reference* model is the base when there is one, else ``finetuned[0]``: its names fix the
output's keys and order, its dtypes the output's dtypes. Every model must hold exactly the
reference's tensor names with the same shapes; the error names the first offending tensor and
the model (``base`` or ``finetuned[k]``, 0-based). Every floating-point tensor is checked
finite when it is first read: NaN or inf is a :class:`~mergeqp.errors.BadDataError` naming the
tensor and the model, whatever the method or its ``evaluate`` setting.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ValidationError
from ..io import verified
from ..io.writer import check_tensor_finite

MAX_LISTED = 5


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


class TensorSource:
    """Read access to one model's tensors. ``label`` names the model in error messages."""

    def __init__(self, obj: Any, label: str):
        import torch

        self.label = label
        self._checked: set[str] = set()  # names already checked finite
        self._signature: verified.Signature | None = None  # the checkpoint's files (process-wide memo)
        self._checkpoint = None
        self._tensors: Mapping[str, Any] | None = None
        if isinstance(obj, torch.nn.Module):
            obj = obj.state_dict()
        if isinstance(obj, Mapping):
            for name, value in obj.items():
                if not isinstance(name, str):
                    raise ValidationError(f"{label} has a non-string key {name!r}; a state dict maps names to tensors")
                if not isinstance(value, torch.Tensor):
                    if hasattr(value, "shape") and hasattr(value, "dtype"):
                        continue  # numpy array: converted on access
                    raise ValidationError(
                        f"tensor {name!r} of {label} is a {type(value).__name__}, not a tensor"
                    )
            self._tensors = obj
            self.names: tuple[str, ...] = tuple(obj.keys())
        elif all(hasattr(obj, a) for a in ("names", "info", "get")):  # mergeqp Checkpoint
            self._checkpoint = obj
            names = obj.names() if callable(obj.names) else obj.names
            self.names = tuple(names)
        else:
            raise ValidationError(
                f"{label} must be a state dict (mapping name -> tensor), an nn.Module or a "
                f"mergeqp Checkpoint, got {type(obj).__name__}"
            )

    def shape(self, name: str) -> tuple[int, ...]:
        if self._checkpoint is not None:
            return tuple(self._checkpoint.info(name).shape)
        return _shape(self._tensors[name])  # type: ignore[index]

    def is_float(self, name: str) -> bool:
        import torch

        if self._checkpoint is not None:
            return self._checkpoint.info(name).floating
        value = self._tensors[name]  # type: ignore[index]
        if isinstance(value, torch.Tensor):
            return value.is_floating_point()
        return getattr(value.dtype, "kind", "") == "f"

    def dtype_device(self, name: str) -> tuple[Any, Any]:
        """``(torch dtype, device)`` of ``name`` without loading a checkpoint tensor."""
        import torch

        if self._checkpoint is not None:
            return getattr(torch, self._checkpoint.info(name).dtype), torch.device("cpu")
        t = self.get(name)
        return t.dtype, t.device

    def alias_key(self, name: str) -> tuple[Any, ...] | None:
        """What identifies the memory of an in-memory tensor (two names with the same key are
        one tied tensor); ``None`` for a lazily read checkpoint."""
        import torch

        if self._checkpoint is not None:
            return None
        value = self._tensors[name]  # type: ignore[index]
        if not isinstance(value, torch.Tensor) or value.device.type == "meta" or value.numel() == 0:
            return None
        return (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
                tuple(value.stride()), value.dtype, str(value.device))

    def get(self, name: str) -> Any:
        """The tensor ``name`` (a torch tensor; not copied when the source holds tensors).
        Raises :class:`~mergeqp.errors.BadDataError` when it holds NaN or inf."""
        import torch

        if self._checkpoint is not None:
            tensor = self._checkpoint.get(name)
        else:
            value = self._tensors[name]  # type: ignore[index]
            tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        if name not in self._checked:
            if tensor.device.type != "meta":
                self._check_finite(name, tensor)
            self._checked.add(name)
        return tensor

    def _check_finite(self, name: str, tensor: Any) -> None:
        """NaN / inf named; a checkpoint's tensor once per process while its file is unchanged."""
        if self._checkpoint is None:
            check_tensor_finite(name, tensor, self.describe())
            return
        if self._signature is None:
            self._signature = verified.signature(self._checkpoint.path)
        verified.once(("finite tensor", self._signature, name, str(tensor.dtype)),
                      lambda: check_tensor_finite(name, tensor, self.describe()))

    def describe(self) -> str:
        """The model's label, with its checkpoint path when read from disk."""
        path = getattr(self._checkpoint, "path", None)
        return self.label if path is None else f"{self.label} ({path})"


@dataclass(frozen=True, eq=False)
class MergeInputs:
    """A validated base (``None`` when the method needs none and none was given) and K >= 1
    fine-tuned models sharing the reference's tensor names and shapes."""

    base: TensorSource | None
    finetuned: tuple[TensorSource, ...]
    names: tuple[str, ...]
    float_names: tuple[str, ...]

    @property
    def K(self) -> int:
        return len(self.finetuned)

    @property
    def reference(self) -> TensorSource:
        return self.base if self.base is not None else self.finetuned[0]

    def base_tensor(self, name: str) -> Any:
        if self.base is None:
            raise ValidationError(f"tensor {name!r}: this merge needs a base model, but base is None")
        return self.base.get(name)

    def finetuned_tensors(self, name: str) -> list[Any]:
        return [ft.get(name) for ft in self.finetuned]

    def tied_groups(self, names: Sequence[str]) -> dict[str, str]:
        """``{alias: first}`` for names that are one tied tensor (the same memory) in every
        model (base and fine-tuned, all in memory): such names are merged once, so that a
        random method (DARE) gives them one mask and the tie survives."""
        sources = ([self.base] if self.base is not None else []) + list(self.finetuned)
        first_of: dict[tuple[Any, ...], str] = {}
        out: dict[str, str] = {}
        for name in names:
            keys = [src.alias_key(name) for src in sources]
            if any(k is None for k in keys):
                continue
            key = tuple(keys)
            if key in first_of:
                out[name] = first_of[key]
            else:
                first_of[key] = name
        return out


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:MAX_LISTED])
    return shown + (f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else "")


def prepare_inputs(base: Any, finetuned: Any, *, needs_base: bool, method: str) -> MergeInputs:
    """Wrap and cross-check the models; raises :class:`ValidationError` naming the tensor."""
    if isinstance(finetuned, Mapping) or not isinstance(finetuned, Sequence) or isinstance(finetuned, str):
        raise ValidationError(
            f"finetuned must be a list of models (one state dict per fine-tuned model), got "
            f"{type(finetuned).__name__}"
        )
    if len(finetuned) == 0:
        raise ValidationError("finetuned is empty: give at least one fine-tuned model")
    if base is None and needs_base:
        raise ValidationError(f"merge method {method!r} needs a base model (task vectors are finetuned - base)")
    sources = tuple(TensorSource(ft, f"finetuned[{k}]") for k, ft in enumerate(finetuned))
    base_src = None if base is None else TensorSource(base, "base")
    ref = base_src if base_src is not None else sources[0]
    ref_names = ref.names
    ref_set = set(ref_names)
    for src in sources:
        if src is ref:
            continue
        theirs = set(src.names)
        missing = [n for n in ref_names if n not in theirs]
        if missing:
            raise ValidationError(
                f"tensor {missing[0]!r} of {ref.label} is missing from {src.label} "
                f"({len(missing)} missing: {_listing(missing)})"
            )
        extra = [n for n in src.names if n not in ref_set]
        if extra:
            raise ValidationError(
                f"tensor {extra[0]!r} of {src.label} is not in {ref.label} "
                f"({len(extra)} extra: {_listing(extra)})"
            )
        for name in ref_names:
            s_ref, s_src = ref.shape(name), src.shape(name)
            if s_ref != s_src:
                raise ValidationError(
                    f"tensor {name!r} has shape {s_src} in {src.label} but {s_ref} in {ref.label}"
                )
            if ref.is_float(name) != src.is_float(name):
                raise ValidationError(
                    f"tensor {name!r} is {'' if src.is_float(name) else 'not '}floating-point in "
                    f"{src.label} but {'' if ref.is_float(name) else 'not '}in {ref.label}"
                )
    float_names = tuple(n for n in ref_names if ref.is_float(n))
    return MergeInputs(base_src, sources, tuple(ref_names), float_names)
