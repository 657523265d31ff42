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

from ..errors import (
    ConfigError,
    MergeMethodError,
    ValidationError,
    check_callable,
    check_new_name,
    check_signature,
    lookup,
    named_failure,
)
from ..io.writer import cast_checked
from .calibration_statistics import FISHER_STATISTICS, REGMEAN_STATISTICS
from .dare import DARE, DARE_LINEAR, DARE_TIES, ROW_DARE
from .fisher import FISHER
from .inputs import prepare_inputs
from .method import MergeMethod, MethodParams
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
    check_signature("merge method", method.name, "run(inputs, names, params)", method.run, (None, [], None), {},
                    ConfigError)
    if not (isinstance(method.params, type) and issubclass(method.params, MethodParams)):
        raise ConfigError(f"merge method {method.name!r}: params must be a subclass of "
                          f"mergeqp.merge.method.MethodParams (it adds include / exclude / unselected / progress), "
                          f"got {method.params!r}")
    MERGE_METHODS[method.name] = method
    return method


def get_merge_method(name: str) -> MergeMethod:
    return lookup("merge method", name, MERGE_METHODS)


for _method in (TASK_ARITHMETIC, SOUP, TIES, DARE, DARE_LINEAR, DARE_TIES, ROW_DARE,
                dataclasses.replace(FISHER, statistics=FISHER_STATISTICS),
                dataclasses.replace(REGMEAN, statistics=REGMEAN_STATISTICS), OUTPUT_SPACE):
    register_merge_method(_method)
del _method


def merge_state_dicts(method: str, base: Any, finetuned: Sequence[Any], *, out_dtype: Any = None,
                      **params: Any) -> dict[str, Any]:
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
    ``out_dtype`` (a floating-point ``torch.dtype`` or its name, ``"float32"``): the merged and averaged
    tensors' dtype instead of the reference's (a bfloat16 base merged into float32 is rounded once, to
    float32, not to bfloat16 first).
    """
    import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

    if isinstance(out_dtype, str):
        out_dtype = getattr(torch, out_dtype, out_dtype)
    if out_dtype is not None and not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
        raise ValidationError(f"out_dtype must be a floating-point torch dtype or its name (float32, bfloat16, ...), got "
                              f"{out_dtype!r}")

    spec = get_merge_method(method)
    parsed = spec.parse(params)
    inputs = prepare_inputs(base, finetuned, needs_base=spec.needs_base, method=spec.name)
    names = select_tensors(inputs.names, parsed.include, parsed.exclude, eligible=inputs.float_names)
    tied = inputs.tied_groups(names)  # tied tensors (one memory, several names) merge once
    statistics = [n for n in names if n not in tied and is_running_statistic(n)]
    with named_failure(f"merge method {spec.name!r}", MergeMethodError):
        merged = spec.run(inputs, [n for n in names if n not in tied and n not in statistics], parsed)
    if not isinstance(merged, Mapping):
        raise MergeMethodError(f"merge method {spec.name!r} returned {type(merged).__name__}, not a dict of "
                               f"tensors by name")
    merged = dict(merged)
    for name in statistics:  # activation statistics, not weights: a task vector could make a variance negative
        merged[name] = _mean_of_finetuned(inputs, name)
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
        # in the output's dtype, checked: a float16 overflow named as one, or a user method's NaN
        if name in merged:  # (detached: inputs that require grad must not give results holding their graph)
            dtype, device = ref.dtype_device(name)
            out[name] = cast_checked(name, merged[name].detach(), out_dtype or dtype,
                                     f"the {spec.name} merge").to(device)
        elif unselected == "drop":
            continue
        elif unselected == "average" and name in float_names:
            out[name] = cast_checked(name, _mean_of_finetuned(inputs, name), out_dtype or ref.dtype_device(name)[0],
                                     f"the {spec.name} merge")
        else:
            out[name] = ref.get(name)  # checked finite when read
    return out


def _is_floating(x: Any) -> bool:
    if hasattr(x, "is_floating_point"):
        return bool(x.is_floating_point())
    dtype = getattr(x, "dtype", None)
    return dtype is not None and getattr(dtype, "kind", "") == "f"


#: names of normalisation layers' running statistics (``nn.BatchNorm*``, ``nn.InstanceNorm*`` with
#: ``track_running_stats``): means and variances of activations, not weights
RUNNING_STATISTICS = frozenset({"running_mean", "running_var"})


def is_running_statistic(name: str) -> bool:
    """Whether the tensor ``name`` is a normalisation layer's running mean or variance: every merge
    method averages those over the fine-tuned models (a task vector or a TIES / DARE rescaling of
    a variance can make it negative, and the merged model's outputs NaN)."""
    return name.rsplit(".", 1)[-1] in RUNNING_STATISTICS


def _mean_of_finetuned(inputs: Any, name: str) -> Any:
    """The uniform mean of the fine-tuned models' tensor ``name`` (float32, or float64 for float64),
    on the reference model's device."""
    import torch  # optional heavy dependency (see merge_state_dicts)

    dtype, device = inputs.reference.dtype_device(name)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    tensors = inputs.finetuned_tensors(name)
    return sum(t.to(device, dtype=wide) for t in tensors) / len(tensors)


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
    for who, tensor in ([("base", base)] if base is not None else []) + [(f"finetuned[{k}]", x)
                                                                       for k, x in enumerate(finetuned)]:
        if not _is_floating(tensor):  # merge_state_dicts copies such a tensor: here nothing would be merged
            raise ValidationError(f"merge_tensors merges floating-point tensors; {who} ({name!r}) is "
                                  f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
    result = merge_state_dicts(
        method,
        None if base is None else {name: base},
        [{name: t} for t in finetuned],
        **params,
    )
    return result[name]
