"""The registry of baseline merge methods and the state-dict entry points.

``MERGE_METHODS`` maps a name to its :class:`~mergeqp.merge.method.MergeMethod`; the built-in
methods are registered explicitly below (see ``docs/baselines.md`` for the formulas, defaults
and references). :func:`register_merge_method` adds a method; :func:`get_merge_method` looks one
up (an unknown name lists the valid ones).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ConfigError, ValidationError, check_callable, check_new_name, lookup
from ..io.writer import check_tensor_finite
from .calibration_statistics import FISHER_STATISTICS, REGMEAN_STATISTICS
from .dare import DARE, DARE_LINEAR, DARE_TIES, ROW_DARE
from .fisher import FISHER
from .inputs import prepare_inputs
from .method import MergeMethod
from .output_space import OUTPUT_SPACE
from .regmean import REGMEAN
from .selection import select_tensors
from .task_arithmetic import SOUP, TASK_ARITHMETIC
from .ties import TIES

MERGE_METHODS: dict[str, MergeMethod] = {}


#: ``method.name`` values of a merge config that select the QP merge, not a registered method
RESERVED_METHOD_NAMES = frozenset({"qp", "auto"})


def register_merge_method(method: MergeMethod) -> MergeMethod:
    """Add ``method`` under ``method.name``; a duplicate name is an error. A registered method is
    usable from Python (:func:`merge_state_dicts`) and from a ``mergeqp merge`` config
    (``method: {name: NAME, params: {...}}``, or as a hybrid ``start``) when it is tensor-wise or
    declares its calibration ``statistics``."""
    if not isinstance(method, MergeMethod):
        raise ConfigError(f"register_merge_method expects a MergeMethod, got {type(method).__name__}")
    check_new_name("merge method", method.name, MERGE_METHODS, error=ConfigError)
    if method.name in RESERVED_METHOD_NAMES:  # (method.name: qp / auto in a config mean the QP)
        raise ConfigError(f"merge method name {method.name!r} is reserved: in a merge config it selects the QP merge")
    check_callable("merge method", method.name, "run(inputs, names, params)", method.run, ConfigError)
    MERGE_METHODS[method.name] = method
    return method


def get_merge_method(name: str) -> MergeMethod:
    return lookup("merge method", name, MERGE_METHODS)


for _method in (TASK_ARITHMETIC, SOUP, TIES, DARE, DARE_LINEAR, DARE_TIES, ROW_DARE,
                dataclasses.replace(FISHER, statistics=FISHER_STATISTICS),
                dataclasses.replace(REGMEAN, statistics=REGMEAN_STATISTICS), OUTPUT_SPACE):
    register_merge_method(_method)
del _method


def merge_state_dicts(method: str, base: Any, finetuned: Sequence[Any], **params: Any) -> dict[str, Any]:
    """Merge ``finetuned`` (K models) onto ``base`` with the registered method ``method``.

    ``base`` and each fine-tuned model: a state dict (``name -> tensor``), an ``nn.Module`` or a
    mergeqp ``Checkpoint`` (read lazily). ``base`` may be ``None`` for methods that do not use task
    vectors (``soup``, ``fisher``, ``regmean``). ``params`` are the method's parameters plus the
    shared ``include`` / ``exclude`` / ``unselected`` / ``progress`` (see
    :mod:`mergeqp.merge.method`); unknown parameters are a :class:`ConfigError` listing the
    valid ones.

    Returns a new dict in the reference model's key order (base, else ``finetuned[0]``) and
    dtypes: merged tensors for the selected floating-point names; the others per
    ``unselected`` (tensors copied from the base are the base's own objects, not clones).
    """
    import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

    spec = get_merge_method(method)
    parsed = spec.parse(params)
    inputs = prepare_inputs(base, finetuned, needs_base=spec.needs_base, method=spec.name)
    names = select_tensors(inputs.names, parsed.include, parsed.exclude, eligible=inputs.float_names)
    tied = inputs.tied_groups(names)  # tied tensors (one memory, several names) merge once
    merged = spec.run(inputs, [n for n in names if n not in tied], parsed)
    for alias, first in tied.items():
        merged[alias] = merged[first]
    missing = [n for n in names if n not in merged]
    if missing:  # a method bug, never user input
        raise ValidationError(f"merge method {spec.name!r} returned no tensor for {missing[0]!r}")
    for name in names:  # (a user's method: a wrong shape or an integer tensor is named, never cast silently)
        got, want = merged[name], tuple(inputs.reference.shape(name))
        if not isinstance(got, torch.Tensor):
            raise ValidationError(f"merge method {spec.name!r} returned {type(got).__name__} for {name!r}, "
                                  f"not a tensor")
        if tuple(got.shape) != want:
            raise ValidationError(f"merge method {spec.name!r} returned {name!r} of shape {tuple(got.shape)}, "
                                  f"expected {want}")
        if not got.is_floating_point():
            raise ValidationError(f"merge method {spec.name!r} returned {name!r} as {got.dtype}, not a "
                                  f"floating-point tensor")
    unselected = parsed.unselected or ("base" if inputs.base is not None else "average")
    if unselected == "base" and inputs.base is None:
        raise ConfigError("unselected='base' needs a base model; pass base= or unselected='average'")
    float_names = set(inputs.float_names)
    ref = inputs.reference
    out: dict[str, Any] = {}
    for name in inputs.names:
        if name in merged:
            dtype, device = ref.dtype_device(name)
            out[name] = merged[name].to(dtype=dtype, device=device)
        elif unselected == "drop":
            continue
        elif unselected == "average" and name in float_names:
            dtype, device = ref.dtype_device(name)
            wide = torch.float64 if dtype == torch.float64 else torch.float32
            tensors = inputs.finetuned_tensors(name)
            out[name] = (sum(t.to(device, dtype=wide) for t in tensors) / len(tensors)).to(dtype)
        else:
            out[name] = ref.get(name)
            continue  # checked finite when read
        # in the output's dtype: a float16 overflow, or a user method's bug
        check_tensor_finite(name, out[name], f"the {spec.name} merge")
    return out


def merge_tensors(method: str, base: Any, finetuned: Sequence[Any], *, name: str = "tensor", **params: Any) -> Any:
    """Merge single tensors: ``base`` (a tensor, or ``None`` where allowed) and K fine-tuned
    tensors of the same shape; returns the merged tensor. Only for methods that merge each
    tensor from its own values (not ``fisher`` / ``regmean``). ``name`` is the tensor's name,
    used for error messages, per-tensor seeds and injected masks."""
    spec = get_merge_method(method)
    if not spec.tensorwise:
        raise ConfigError(f"merge method {spec.name!r} needs a model and calibration data; use merge_state_dicts")
    if not isinstance(finetuned, Sequence) or isinstance(finetuned, Mapping):
        raise ConfigError("finetuned must be a list of tensors")
    result = merge_state_dicts(
        method,
        None if base is None else {name: base},
        [{name: t} for t in finetuned],
        **params,
    )
    return result[name]
