"""The L1 ball ``||d - center||_1 <= radius`` (the sparsity relaxation)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import scipy.sparse as sp

from ..errors import InfeasibleError, ValidationError
from .base import ConstraintSet, Shape, broadcast, float_array, fmt
from .forms import AuxiliaryForm
from .kernels import SetStructure


class L1Ball(ConstraintSet):
    """``||d - center||_1 <= radius`` (the sparsity relaxation); ``center`` a scalar or an
    array broadcastable to ``(K, n_atoms)`` (default 0)."""

    name = "l1"
    known_nonempty = True
    has_projection = True
    polyhedral = True

    def __init__(self, radius: float, center: Any = 0.0):
        try:
            self.radius = float(radius)
        except (TypeError, ValueError):
            raise ValidationError(f"l1: radius must be a number, got {radius!r}") from None
        if not math.isfinite(self.radius):
            raise ValidationError(f"l1: radius must be finite, got {radius}")
        if self.radius < 0:
            raise InfeasibleError(f"l1: radius {self.radius:g} < 0 gives an empty ball")
        self.center = float_array(center, "l1 center")
        if not np.all(np.isfinite(self.center)):
            raise ValidationError("l1: center contains NaN or inf")

    @property
    def spec(self) -> str:
        if self.center.ndim == 0:
            c = float(self.center)
            return f"l1:{fmt(self.radius)}" + ("" if c == 0 else f",{fmt(c)}")
        return f"l1:{fmt(self.radius)},<array center>"

    def _center(self, shape: Shape) -> np.ndarray:
        return broadcast(self.center, shape, "l1 center")

    def validate(self, shape: Shape) -> None:
        self._center(shape)

    def cvxpy(self, var: Any) -> list[Any]:
        import cvxpy as cp  # optional heavy dependency: only the CVXPY form needs it

        return [cp.sum(cp.abs(var - self._center(var.shape))) <= self.radius]

    def structure(self, shape: Shape) -> SetStructure:
        n = int(np.prod(shape))
        return SetStructure(np.full(n, -np.inf), np.full(n, np.inf),
                            center=self._center(shape).ravel().copy(), radius=self.radius)

    def parameters(self) -> tuple[np.ndarray, ...]:
        return (self.center,)

    @property
    def bounded(self) -> bool:
        return True

    def violation(self, d: np.ndarray) -> float:
        return float(max(np.sum(np.abs(d - self._center(np.shape(d)))) - self.radius, 0.0))

    def auxiliary_form(self, shape: Shape) -> AuxiliaryForm:
        """``|x - c|_1 <= r`` with ``n`` auxiliaries: ``x - t <= c``, ``-x - t <= -c``,
        ``1't <= r`` (``t >= 0`` implied)."""
        n = shape[0] * shape[1]
        c = self._center(shape).ravel()
        eye = sp.identity(n, format="csr")
        A_x = sp.vstack([eye, -eye, sp.csr_matrix((1, n))]).tocsr()
        A_t = sp.vstack([-eye, -eye, sp.csr_matrix(np.ones((1, n)))]).tocsr()
        return AuxiliaryForm(n, A_x, A_t, np.concatenate([c, -c, [self.radius]]), np.zeros(n))
