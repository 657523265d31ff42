"""The merged residuals ``U = W_baseline - W_base`` of tensor-wise baselines at one merge layer,
for the ``rows+baselines`` parametrisation of a checkpoint merge
(:class:`~mergeqp.stats.baseline_atoms.RowsBaselinesParametrisation`).

Each baseline (a registered tensor-wise merge method with its parameters, e.g. ``ties`` or
``task_arithmetic``) merges the layer's weight and bias tensors exactly as a ``method: {name:
...}`` merge would (:func:`~.registry.merge_tensors`, same tensor names, so seeded methods draw
the same masks), and the residual is taken in the augmented ``(r, m1)`` layout (bias column
last). Methods that need calibration statistics (``fisher``, ``regmean``, or a user's method that
declares them) are not tensor-wise: the run layer collects their statistics on the calibration
prompts while each fine-tune is loaded for its targets, merges the merge layers' tensors with
them once, and passes those merged tensors here (``merged``); their residual is taken from them
in the same layout. In Python, pass any merged residuals to the parametrisation directly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import MergeQPError, ValidationError
from .calibrated import check_params
from .registry import get_merge_method, merge_tensors
from .sites import LayerSite, weight_from_tensors

#: a configured baseline: its method name and its parameters
BaselineChoice = tuple[str, Mapping[str, Any]]


def check_baselines(choices: Sequence[BaselineChoice]) -> None:
    """Raise :class:`ValidationError` unless every baseline is a registered method with valid
    parameters that is tensor-wise or takes its calibration statistics from the run layer
    (checked before any weight is read)."""
    for i, (name, params) in enumerate(choices):
        method = get_merge_method(name)
        if method.statistics is not None:
            try:
                check_params(name, params, f"baselines[{i}]")
            except MergeQPError as exc:
                raise ValidationError(str(exc)) from None
        elif not method.tensorwise:
            raise ValidationError(
                f"baselines: {name!r} is neither tensor-wise nor declares the calibration statistics the run layer "
                f"collects, so it cannot be an atom of a checkpoint merge")
        else:
            method.parse(dict(params))


def statistics_baselines(choices: Sequence[BaselineChoice]) -> list[BaselineChoice]:
    """The baselines among ``choices`` whose merge needs calibration statistics (RegMean, Fisher)."""
    return [(n, p) for n, p in choices if get_merge_method(n).statistics is not None]


def site_baseline_residuals(choices: Sequence[BaselineChoice], base_weight: Any, site: LayerSite,
                            deltas: np.ndarray, names: Sequence[str], *,
                            merged: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, np.ndarray]:
    """``{name: U}`` (``(r, m1)`` float64) for the baselines ``names`` among ``choices`` at
    ``site``: ``base_weight`` is the augmented base weight (torch ``(r, m1)`` float64), ``deltas``
    the residuals ``W_k - W_base`` (``(K, r, m1)``). ``merged``: ``{name: {checkpoint key: merged
    tensor}}`` of baselines merged beforehand (those with calibration statistics, whose merge is
    not a function of the tensors alone); the others are merged here."""
    import torch  # optional heavy dependency (the merge needs it; importing this module does not)

    params = dict(choices)
    W0 = base_weight.to(torch.float64)
    Ws = [W0 + torch.from_numpy(np.asarray(d, dtype=np.float64)) for d in deltas]
    m = site.m
    flip = site.kind == "conv1d"  # stored transposed: merge the tensor as it is stored

    def stored(W: Any) -> Any:
        return W[:, :m].t() if flip else W[:, :m]

    out: dict[str, np.ndarray] = {}
    for name in names:
        if name not in params:
            raise ValidationError(f"baseline {name!r} at layer {site.name!r} is not configured; configured: "
                                  f"{', '.join(params)}")
        if merged is not None and name in merged:
            tensors = merged[name]
            missing = [k for k in site.keys if k not in tensors]
            if missing:
                raise ValidationError(f"baseline {name!r} at layer {site.name!r}: its merge has no tensor {missing[0]!r}")
            bias = tensors[site.bias_key] if site.bias_key else None
            out[name] = (weight_from_tensors(site, tensors[site.weight_key], bias) - W0).numpy()
            continue
        if not get_merge_method(name).tensorwise:
            raise ValidationError(f"baseline {name!r} at layer {site.name!r} needs calibration statistics: pass its "
                                  "merged tensors (merged=)")
        weight = merge_tensors(name, stored(W0), [stored(W) for W in Ws], name=site.weight_key, progress=False,
                               **dict(params[name]))
        parts = [weight.t() if flip else weight]
        if site.bias_key is not None:
            bias = merge_tensors(name, W0[:, m], [W[:, m] for W in Ws], name=site.bias_key, progress=False,
                                 **dict(params[name]))
            parts.append(bias.reshape(-1, 1))
        joined = torch.cat([p.to(torch.float64) for p in parts], dim=1)
        out[name] = (joined - W0).numpy()
    return out
