"""Simplices: per-atom (``sum_k d[k, a] = total``) and global (``sum d = total``), ``d >= 0``."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import scipy.sparse as sp

from ..errors import InfeasibleError, ValidationError
from .base import ConstraintSet, Shape, fmt
from .forms import LinearForm
from .kernels import SetStructure, sum_groups


class Simplex(ConstraintSet):
    """Per-atom simplex: for every atom ``a``, ``sum_k d[k, a] = total`` and ``d >= 0``
    (a convex combination of the models, chosen per row / direction)."""

    name = "simplex"
    known_nonempty = True
    has_projection = True
    polyhedral = True
    #: the axis summed over (0: over models, per atom; ``None``: everything)
    axis: int | None = 0

    def __init__(self, total: float = 1.0):
        try:
            self.total = float(total)
        except (TypeError, ValueError):
            raise ValidationError(f"{self.name}: total must be a number, got {total!r}") from None
        if not math.isfinite(self.total):
            raise ValidationError(f"{self.name}: total must be finite, got {total}")
        if self.total < 0:
            raise InfeasibleError(f"{self.name}: total {self.total:g} < 0 but d >= 0: the set is empty")

    @property
    def spec(self) -> str:
        return self.name if self.total == 1.0 else f"{self.name}:{fmt(self.total)}"

    def _sum(self, var: Any) -> Any:
        import cvxpy as cp  # optional heavy dependency: only the CVXPY form needs it

        return cp.sum(var, axis=0) if self.axis == 0 else cp.sum(var)

    def cvxpy(self, var: Any) -> list[Any]:
        return [var >= 0, self._sum(var) == self.total]

    def structure(self, shape: Shape) -> SetStructure:
        group, n_groups = sum_groups(tuple(shape), self.axis)
        n = int(np.prod(shape))
        return SetStructure(np.zeros(n), np.full(n, np.inf), group, np.full(n_groups, self.total))

    @property
    def bounded(self) -> bool:
        return True

    def violation(self, d: np.ndarray) -> float:
        sums = np.sum(d, axis=self.axis)
        return float(max(np.max(-d, initial=0.0), np.max(np.abs(sums - self.total), initial=0.0)))

    def linear_form(self, shape: Shape) -> LinearForm:
        K, m = shape
        n = K * m
        if self.axis == 0:
            # row a of A_eq sums d[k, a] over k: flat index k * m + a
            rows = np.tile(np.arange(m), K)
            A_eq = sp.csr_matrix((np.ones(n), (rows, np.arange(n))), shape=(m, n))
            b_eq = np.full(m, self.total)
        else:
            A_eq = sp.csr_matrix(np.ones((1, n)))
            b_eq = np.array([self.total])
        return LinearForm(n, sp.csr_matrix((0, n)), np.zeros(0), A_eq, b_eq, np.zeros(n), np.full(n, np.inf))


class GlobalSimplex(Simplex):
    """Global simplex: ``sum_{k,a} d[k, a] = total`` and ``d >= 0``."""

    name = "global_simplex"
    axis = None
