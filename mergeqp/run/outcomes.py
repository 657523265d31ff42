"""What a merge method hands back, checked before it is used: its tensors (keys, shapes, floating point,
not aliasing the live model) and its report fields and sections."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import MergeMethodError, MergeQPError, first_line, listing, named_failure
from ..merge.report import jsonable
from .merge_plan import MergePlan
from .model_method import ModelMethod
from .report import REPORT_KEYS


def method_sections(method: ModelMethod) -> Callable[[dict[str, Any]], list[str]]:
    """A model method's ``report_markdown``, checked: a failure, or anything but a list of strings, is
    one line naming the method (exit 2; nothing is written: the folder appears with its report or not
    at all)."""
    def sections(report: dict[str, Any]) -> list[str]:
        with named_failure(f"model method {method.name!r}: report_markdown(report)", MergeMethodError):
            out = method.report_markdown(report)  # type: ignore[misc]
        if isinstance(out, str) or not isinstance(out, Sequence) or not all(isinstance(x, str) for x in out):
            raise MergeMethodError(f"model method {method.name!r}: report_markdown(report) returned "
                                   f"{type(out).__name__}, not a list of Markdown sections (strings)")
        return list(out)

    return sections


def checked_report_fields(name: str, fields: Any) -> dict[str, Any]:
    """A model method's extra ``report.json`` fields: a dict of JSON-able values whose names are not
    the report's own (:data:`~.report.REPORT_KEYS`); else a :class:`MergeMethodError` naming the
    field, before anything is written."""
    if fields is None:
        return {}
    if not isinstance(fields, Mapping):
        raise MergeMethodError(f"model method {name!r}: report_fields must be a dict of field -> JSON value, got "
                               f"{type(fields).__name__}")
    out = {}
    for key, value in fields.items():
        if not isinstance(key, str) or key in REPORT_KEYS:
            raise MergeMethodError(f"model method {name!r}: report field {key!r} is "
                                   + ("one of the report's own (" + ", ".join(sorted(REPORT_KEYS)) + ")"
                                      if isinstance(key, str) else "not a string") + "; name it otherwise")
        try:
            json.dumps(jsonable(value))
        except (TypeError, ValueError) as exc:
            raise MergeMethodError(f"model method {name!r}: report field {key!r} is not JSON-able: "
                                   f"{first_line(exc)}") from None
        out[key] = value
    return out


def checked_merge(plan: MergePlan, output_dtype: Any, merged: Mapping[str, Any], allowed: Sequence[str],
                  bad: Callable[[str], MergeQPError], scope: str, cast: bool = True,
                  live: Any = None) -> dict[str, Any]:
    """``merged`` (a user's entry's ``{checkpoint key: tensor}``) checked: each key one of ``allowed``
    (``scope`` says which those are), each value a tensor with the base's shape, floating point where
    the base's is, dense; with ``cast``, cast to the base tensor's dtype unless ``output_dtype`` is set;
    without, kept in their dtype (a start candidate's tensors: loading them casts, and so does the
    writer) and copied where they share memory with the module ``live`` (its parameters or buffers).
    ``bad(why)`` is the error naming the entry."""
    import torch  # optional heavy dependency: the merge runs on torch

    allowed_set = set(allowed)
    base = plan.base
    shared = set() if live is None else {t.untyped_storage().data_ptr()
                                         for t in (*live.parameters(), *live.buffers()) if not t.is_meta}
    out: dict[str, Any] = {}
    for key, tensor in merged.items():
        if key not in allowed_set:
            where = f"a tensor outside {scope}" if key in base.names() else "not a tensor of the base checkpoint"
            raise bad(f"returned {key!r}: {where}; the tensors it may set: {listing(sorted(allowed_set), 6)}")
        if not isinstance(tensor, torch.Tensor):
            raise bad(f"returned {type(tensor).__name__} for {key!r}, not a tensor")
        if tensor.is_meta or tensor.layout != torch.strided:
            raise bad(f"returned {key!r} as a {'meta' if tensor.is_meta else str(tensor.layout)} tensor, not one "
                      f"holding values (a dense tensor)")
        info = base.info(key)
        if tuple(tensor.shape) != tuple(info.shape):
            raise bad(f"returned {key!r} of shape {tuple(tensor.shape)}, the base's is {tuple(info.shape)}")
        like = getattr(torch, info.dtype, None)
        base_float = isinstance(like, torch.dtype) and like.is_floating_point
        if base_float and not tensor.is_floating_point():
            raise bad(f"returned {key!r} as {tensor.dtype}, not a floating-point tensor")
        if not base_float and tensor.dtype != like:  # (an integer buffer: the base's own, as it is)
            raise bad(f"returned {key!r} as {tensor.dtype}, the base stores it as {info.dtype}")
        if not cast:  # a tensor that shares memory with the live model (its own parameters) would change
            # under the candidates fitted and scored after it: copied (stop 58 review: the winner's stored
            # tensors became another candidate's, 5,780 against the 377 it was scored at)
            aliased = tensor.untyped_storage().data_ptr() in shared
            out[key] = tensor.detach().clone() if aliased else tensor.detach()
            continue
        keep = output_dtype is not None or not base_float
        out[key] = tensor.detach() if keep else tensor.detach().to(like)
    return out
