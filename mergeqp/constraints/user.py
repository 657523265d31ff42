"""User-defined CVXPY constraints."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import ValidationError
from ..lower_bounds import LinearMinimum
from .base import ConstraintSet
from .lp import LMO_CVXPY
from .lp import cvxpy_distance, cvxpy_minimum


class UserConstraints(ConstraintSet):
    """User-defined CVXPY constraints: ``fn(var)`` receives the ``cp.Variable`` of shape
    ``(K, n_atoms)`` and returns one constraint or a list of them (they must be DCP-convex).
    The constraints may introduce auxiliary CVXPY variables of their own."""

    name = "user"
    has_projection = False

    def __init__(self, fn: Callable[[Any], Any], label: str = "user"):
        if not callable(fn):
            raise ValidationError("user constraints must be a callable var -> CVXPY constraint(s)")
        self.fn = fn
        self.label = str(label)

    @property
    def spec(self) -> str:
        return self.label

    @property
    def lmo_method(self) -> str:
        return LMO_CVXPY

    def cvxpy(self, var: Any) -> list[Any]:
        import cvxpy as cp  # optional heavy dependency: user constraints are CVXPY expressions

        try:
            out = self.fn(var)
        except Exception as exc:
            raise ValidationError(f"user constraint {self.label!r} raised {type(exc).__name__}: {exc}") from exc
        if out is None:
            raise ValidationError(f"user constraint {self.label!r} returned None, not CVXPY constraint(s)")
        cons = list(out) if isinstance(out, (list, tuple)) else [out]
        for i, c in enumerate(cons):
            if not isinstance(c, cp.constraints.constraint.Constraint):
                raise ValidationError(
                    f"user constraint {self.label!r} returned {type(c).__name__} at position {i}, "
                    f"not a CVXPY constraint"
                )
            if not c.is_dcp():
                raise ValidationError(f"user constraint {self.label!r} #{i} ({c}) is not convex (DCP)")
        return cons

    def linear_minimum(self, grad: np.ndarray) -> LinearMinimum:
        return cvxpy_minimum([self], grad)

    def violation(self, d: np.ndarray) -> float:
        """The largest constraint residual (CVXPY's ``violation()``); when the constraints use
        auxiliary variables, the infinity-norm distance of ``d`` to the set (a small CVXPY solve)."""
        import cvxpy as cp  # optional heavy dependency: user constraints are CVXPY expressions

        d = np.asarray(d, dtype=np.float64)
        var = cp.Variable(d.shape)
        cons = self.cvxpy(var)
        if any(v.id != var.id for c in cons for v in c.variables()):
            return cvxpy_distance([self], d)
        var.value = d
        worst = 0.0
        for c in cons:
            v = np.asarray(c.violation(), dtype=np.float64)
            worst = max(worst, float(np.max(v, initial=0.0)))
        return worst
