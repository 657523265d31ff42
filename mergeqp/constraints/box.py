"""Elementwise bounds: ``lo <= d <= hi``."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import InfeasibleError, ValidationError
from .base import ConstraintSet, Shape, broadcast, float_array, fmt
from .forms import LinearForm
from .kernels import SetStructure


class Box(ConstraintSet):
    """``lo <= d <= hi`` elementwise; ``lo``/``hi`` scalars or arrays broadcastable to
    ``(K, n_atoms)`` (``-inf``/``inf`` allowed). The paper's set is ``Box(0, 1)``."""

    name = "box"
    known_nonempty = True
    has_projection = True
    polyhedral = True

    def __init__(self, lo: Any = 0.0, hi: Any = 1.0):
        self.lo = float_array(lo, "box lower bound")
        self.hi = float_array(hi, "box upper bound")
        if np.any(np.isnan(self.lo)) or np.any(np.isnan(self.hi)):
            raise ValidationError("box bounds contain NaN")
        if np.any(self.lo == np.inf) or np.any(self.hi == -np.inf):
            raise InfeasibleError("box is empty: a lower bound is +inf or an upper bound is -inf")
        try:
            lo_b, hi_b = np.broadcast_arrays(self.lo, self.hi)
        except ValueError:
            raise ValidationError(
                f"box bounds have shapes {self.lo.shape} and {self.hi.shape}, which do not broadcast"
            ) from None
        crossed = lo_b > hi_b
        if np.any(crossed):
            bad = np.argwhere(crossed)
            i = tuple(int(j) for j in bad[0])
            where = (f" at d[{i[0]}, {i[1]}]" if len(i) == 2 else f" at index {i}") if i else ""
            raise InfeasibleError(
                f"box is empty: lower bound {lo_b[i]:g} > upper bound {hi_b[i]:g}{where}"
                f"{f' ({len(bad)} such entries)' if len(bad) > 1 else ''}"
            )

    @property
    def spec(self) -> str:
        if self.lo.ndim == 0 and self.hi.ndim == 0:
            if float(self.lo) == 0.0 and float(self.hi) == math.inf:
                return "nonneg"
            return f"box:{fmt(float(self.lo))},{fmt(float(self.hi))}"
        return "box:<per-entry bounds>"

    def bounds(self, shape: Shape) -> tuple[np.ndarray, np.ndarray]:
        """``(lo, hi)`` broadcast to ``shape`` (fresh float64 arrays)."""
        return broadcast(self.lo, shape, "box lower bound"), broadcast(self.hi, shape, "box upper bound")

    @property
    def bounded(self) -> bool:
        """Whether every bound is finite."""
        return bool(np.all(np.isfinite(self.lo)) and np.all(np.isfinite(self.hi)))

    def validate(self, shape: Shape) -> None:
        lo, hi = self.bounds(shape)
        bad = np.argwhere(lo > hi)
        if bad.size:
            k, a = (int(i) for i in bad[0])
            raise InfeasibleError(
                f"box is empty: lower bound {lo[k, a]:g} > upper bound {hi[k, a]:g} at "
                f"d[{k}, {a}] ({len(bad)} such entries)"
            )

    def cvxpy(self, var: Any) -> list[Any]:
        lo, hi = self.bounds(var.shape)
        out = []
        for bound, upper in ((lo, False), (hi, True)):
            mask = np.isfinite(bound)
            if not mask.any():
                continue
            lhs, rhs = (var, bound) if mask.all() else (var[mask], bound[mask])
            out.append(lhs <= rhs if upper else lhs >= rhs)
        return out

    def structure(self, shape: Shape) -> SetStructure:
        lo, hi = self.bounds(shape)
        return SetStructure(lo.ravel(), hi.ravel())

    def parameters(self) -> tuple[np.ndarray, ...]:
        return (self.lo, self.hi)

    def violation(self, d: np.ndarray) -> float:
        lo, hi = self.bounds(np.shape(d))
        return float(max(np.max(lo - d, initial=0.0), np.max(d - hi, initial=0.0)))

    def linear_form(self, shape: Shape) -> LinearForm:
        lo, hi = self.bounds(shape)
        base = LinearForm.empty(shape[0] * shape[1])
        return LinearForm(base.n, base.A_ub, base.b_ub, base.A_eq, base.b_eq, lo.ravel(), hi.ravel())
