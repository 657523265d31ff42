"""Euclidean projections for the torch solvers. Tensors are flat ``(n,)`` views of ``d``
(row-major ``(K, n_atoms)``).

Bounds (a set whose ``structure`` is only ``lo <= x <= hi``) are a clamp on the device. Every
other set is projected by its own ``project`` -- for the built-in sets the one exact kernel of
:mod:`mergeqp.constraints.kernels` -- in float64 on the host: one round trip per call (free on
CPU, where the tensor and the array share memory; a transfer on CUDA). There is deliberately no
second, torch-written copy of the capped-sum / L1 projections.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..constraints import ConstraintSet
from ..constraints.kernels import checked_structure
from ..errors import SolverError, ValidationError

Projection = Callable[[Any], Any]


def torch_projection(cset: ConstraintSet, shape: tuple[int, int], device: Any, dtype: Any) -> Projection:
    """A function ``flat tensor -> flat tensor`` projecting onto ``cset`` (on ``device``)."""
    import torch  # optional heavy dependency: only the torch solvers need it

    members = cset.members()

    def tens(a: np.ndarray) -> Any:
        return torch.as_tensor(np.asarray(a, dtype=np.float64), dtype=dtype, device=device)

    if not members:
        return lambda x: x
    st = checked_structure(cset, shape) if cset.has_projection else None
    if st is not None and st.bounds_only:
        lo, hi = tens(st.lo), tens(st.hi)
        return lambda x: torch.clamp(x, lo, hi)

    def host(x: Any) -> Any:  # numpy fallback (one round trip)
        d = x.detach().to("cpu", torch.float64).numpy().reshape(shape)
        return tens(checked_projection(cset, d)).reshape(-1)

    return host


def checked_projection(cset: ConstraintSet, d: np.ndarray) -> np.ndarray:
    """``cset.project(d)`` as a float64 array of ``d``'s shape; a :class:`ValidationError` naming the
    set when its ``project`` (a user's) returns another shape (a flat one of d's size is read in d's
    shape) or non-finite numbers."""
    out = cset.project(d)
    try:
        arr = np.asarray(out, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValidationError(f"constraint set {cset.spec}: its project(d) returned {type(out).__name__}, "
                              f"not an array of numbers") from None
    if arr.shape not in (np.shape(d), (np.size(d),)):  # (a flat answer is read in d's shape)
        raise ValidationError(f"constraint set {cset.spec}: its project(d) returned shape {arr.shape} for d of "
                              f"shape {np.shape(d)}")
    arr = arr.reshape(np.shape(d))
    if not np.all(np.isfinite(arr)):
        if not np.all(np.isfinite(d)):  # the solver's iterate overflowed: not the set's fault
            raise SolverError(f"the solver's iterate overflowed to NaN or inf before its projection onto {cset.spec}: the "
                              "problem's scale is beyond float64 here (rescale H and g, or use active_set / dense_ipm)")
        raise ValidationError(f"constraint set {cset.spec}: its project(d) returned NaN or inf")
    return arr
