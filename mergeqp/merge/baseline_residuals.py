"""The merged residuals ``U = W_baseline - W_base`` of tensor-wise baselines at one merge layer,
for the ``rows+baselines`` parametrisation of a checkpoint merge
(:class:`~mergeqp.stats.baseline_atoms.RowsBaselinesParametrisation`).

Each baseline (a registered tensor-wise merge method with its parameters, e.g. ``ties`` or
``task_arithmetic``) merges the layer's weight and bias tensors exactly as a ``method: {name:
...}`` merge would (:func:`~.registry.merge_tensors`, same tensor names, so seeded methods draw
the same masks), and the residual is taken in the augmented ``(r, m1)`` layout (bias column
last). Methods that need calibration statistics (``fisher``, ``regmean``) are not tensor-wise;
they are available as atoms in Python (pass their merged residuals to the parametrisation) and as
the ``start`` of ``mode: trust_region`` in a config.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import ValidationError
from .registry import get_merge_method, merge_tensors
from .sites import LayerSite

#: a configured baseline: its method name and its parameters
BaselineChoice = tuple[str, Mapping[str, Any]]


def check_tensorwise_baselines(choices: Sequence[BaselineChoice]) -> None:
    """Raise :class:`ValidationError` unless every baseline is a registered tensor-wise method with
    valid parameters (checked before any weight is read)."""
    for name, params in choices:
        method = get_merge_method(name)
        if not method.tensorwise:
            raise ValidationError(
                f"baselines: {name!r} needs calibration statistics, so it cannot be an atom of a checkpoint merge; "
                f"use tensor-wise baselines here (e.g. task_arithmetic, soup, ties, dare), or start a "
                f"trust region from it (mode: trust_region, start: {{name: {name}}})")
        method.parse(dict(params))


def site_baseline_residuals(choices: Sequence[BaselineChoice], base_weight: Any, site: LayerSite,
                            deltas: np.ndarray, names: Sequence[str]) -> dict[str, np.ndarray]:
    """``{name: U}`` (``(r, m1)`` float64) for the baselines ``names`` among ``choices`` at
    ``site``: ``base_weight`` is the augmented base weight (torch ``(r, m1)`` float64), ``deltas``
    the residuals ``W_k - W_base`` (``(K, r, m1)``)."""
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
        weight = merge_tensors(name, stored(W0), [stored(W) for W in Ws], name=site.weight_key, progress=False,
                               **dict(params[name]))
        parts = [weight.t() if flip else weight]
        if site.bias_key is not None:
            bias = merge_tensors(name, W0[:, m], [W[:, m] for W in Ws], name=site.bias_key, progress=False,
                                 **dict(params[name]))
            parts.append(bias.reshape(-1, 1))
        merged = torch.cat([p.to(torch.float64) for p in parts], dim=1)
        out[name] = (merged - W0).numpy()
    return out
