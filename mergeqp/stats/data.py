"""Calibration batches: splitting inputs from labels, moving them, calling a model on them.

A calibration set (one per task) is any iterable of batches, or one tensor of inputs that is
cut into batches of ``batch_size`` along its first dimension. A batch is

- a tensor ``x`` (called as ``model(x)``);
- a tuple/list ``(inputs, labels)`` or ``(inputs,)``;
- a mapping: ``{"inputs" | "x": ..., "labels" | "y": ...}`` (called as ``model(inputs)``), or
  keyword arguments for the model (Hugging Face style: ``model(**batch)``), from which a
  ``"labels"`` entry is taken out; a mapping with ``"inputs"``/``"x"`` *and* other entries
  (a mask, ...) is called with all of them (labels removed) as keywords.

The first dimension of the inputs is the batch; samples must not interact inside a model in
eval mode (true for MLPs, transformers, batch norm in eval mode).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ..errors import MergeQPError, ValidationError, first_line

INPUT_KEYS = ("inputs", "x")
#: keyword inputs whose first dimension is the batch (Hugging Face names first)
BATCH_KEYS = ("input_ids", "inputs_embeds", "pixel_values", "input_values", "input_features",
              "inputs", "x")
LABEL_KEYS = ("labels", "y")


def split_batch(batch: Any, where: str) -> tuple[Any, Any]:
    """``(inputs, labels or None)`` from one batch (see the module docstring)."""
    import torch  # deferred: torch is heavy

    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, Mapping):
        for key in INPUT_KEYS:
            if key in batch:
                labels = next((batch[k] for k in LABEL_KEYS if k in batch), None)
                rest = {k: v for k, v in batch.items() if k not in LABEL_KEYS}
                if len(rest) > 1:  # further model arguments (a mask, ...): all are keywords
                    return rest, labels
                return batch[key], labels
        kwargs = dict(batch)
        labels = kwargs.pop("labels", None)
        if not kwargs:
            raise ValidationError(f"{where}: batch mapping has no model inputs")
        return kwargs, labels
    if isinstance(batch, (tuple, list)):
        if len(batch) == 1:
            return batch[0], None
        if len(batch) == 2:
            return batch[0], batch[1]
        raise ValidationError(
            f"{where}: a batch tuple must be (inputs,) or (inputs, labels), got {len(batch)} items"
        )
    raise ValidationError(
        f"{where}: a batch must be a tensor, a tuple (inputs, labels) or a mapping, "
        f"got {type(batch).__name__}"
    )


def batch_len(inputs: Any, where: str) -> int:
    """Number of samples in a batch of inputs (first dimension)."""
    import torch  # deferred: torch is heavy

    if isinstance(inputs, torch.Tensor):
        if inputs.ndim == 0:
            raise ValidationError(f"{where}: inputs are a scalar tensor; expected a batch")
        return int(inputs.shape[0])
    if isinstance(inputs, Mapping):
        for key in BATCH_KEYS:  # the main input, when it has a usual name
            value = inputs.get(key)
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                return int(value.shape[0])
        # else the largest first dimension: broadcast extras (position_ids (1, T), a scalar
        # factor of shape (1,)) are not the batch
        sizes = [int(v.shape[0]) for v in inputs.values() if isinstance(v, torch.Tensor) and v.ndim > 0]
        if sizes:
            return max(sizes)
    if isinstance(inputs, (tuple, list)):
        for value in inputs:
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                return int(value.shape[0])
    raise ValidationError(f"{where}: cannot find a batch dimension in the inputs")


def to_device(x: Any, device: Any) -> Any:
    """Move tensors (possibly nested in tuples / mappings) to ``device``."""
    import torch  # deferred: torch is heavy

    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, Mapping):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(to_device(v, device) for v in x)
    return x


def call_model(model: Any, inputs: Any) -> Any:
    """``model(x)``, ``model(**kwargs)`` or ``model(*args)`` depending on the inputs' type."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def checked_call(model: Any, inputs: Any, where: str, who: str = "the model") -> Any:
    """:func:`call_model`, with a failure of the model on these inputs (wrong feature size,
    dtype or device, missing keyword) turned into one :class:`ValidationError` naming the
    batch and the model."""
    try:
        return call_model(model, inputs)
    except MergeQPError:
        raise
    except Exception as exc:
        first = first_line(exc)
        raise ValidationError(
            f"{where}: {who} failed on this batch ({type(exc).__name__}: {first}); check that "
            f"the calibration inputs fit the model (shape, dtype, device, keywords)"
        ) from exc


def iterate_batches(source: Any, batch_size: int, where: str) -> Iterator[Any]:
    """Batches of one calibration set (a tensor is cut along its first dimension)."""
    import torch  # deferred: torch is heavy

    if isinstance(source, torch.Tensor):
        if source.ndim == 0:
            raise ValidationError(f"{where}: a scalar tensor is not a calibration set")
        for start in range(0, int(source.shape[0]), batch_size):
            yield source[start:start + batch_size]
        return
    if not isinstance(source, Iterable):
        raise ValidationError(
            f"{where}: a calibration set must be an iterable of batches or a tensor, "
            f"got {type(source).__name__}"
        )
    yield from source


def count_batches(source: Any, batch_size: int) -> int | None:
    """Number of batches if known without consuming the set (for the progress bar)."""
    import torch  # deferred: torch is heavy

    if isinstance(source, torch.Tensor):
        return -(-int(source.shape[0]) // batch_size) if source.ndim else None
    try:
        return len(source)
    except TypeError:
        return None
