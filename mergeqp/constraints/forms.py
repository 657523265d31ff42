"""Polyhedral descriptions of constraint sets in flat variables (row-major ``d``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp


@dataclass(frozen=True)
class LinearForm:
    """``A_ub x <= b_ub``, ``A_eq x = b_eq``, ``lb <= x <= ub`` over flat ``x`` of length n."""

    n: int
    A_ub: sp.csr_matrix
    b_ub: np.ndarray
    A_eq: sp.csr_matrix
    b_eq: np.ndarray
    lb: np.ndarray
    ub: np.ndarray

    @staticmethod
    def empty(n: int) -> LinearForm:
        z = sp.csr_matrix((0, n))
        return LinearForm(n, z, np.zeros(0), z, np.zeros(0), np.full(n, -np.inf), np.full(n, np.inf))

    def __and__(self, other: LinearForm) -> LinearForm:
        return LinearForm(
            self.n,
            sp.vstack([self.A_ub, other.A_ub]).tocsr(),
            np.concatenate([self.b_ub, other.b_ub]),
            sp.vstack([self.A_eq, other.A_eq]).tocsr(),
            np.concatenate([self.b_eq, other.b_eq]),
            np.maximum(self.lb, other.lb),
            np.minimum(self.ub, other.ub),
        )

    def recession_violation(self, v: np.ndarray) -> float:
        """Largest violation of the recession cone ``A_ub v <= 0, A_eq v = 0, v_i >= 0`` where
        ``lb_i`` is finite, ``v_i <= 0`` where ``ub_i`` is finite (``v`` flat, length n)."""
        parts = [np.max(self.A_ub @ v, initial=0.0), np.max(np.abs(self.A_eq @ v), initial=0.0),
                 np.max(np.where(np.isfinite(self.lb), -v, 0.0), initial=0.0),
                 np.max(np.where(np.isfinite(self.ub), v, 0.0), initial=0.0)]
        return float(max(parts))


@dataclass(frozen=True)
class AuxiliaryForm:
    """A polyhedral set written with ``n_aux`` auxiliary variables ``t``: ``A_x x + A_t t <= b``
    (``x`` the flat ``d``, length n) and ``t >= t_lb``. The rows alone describe the set (the
    bounds on ``t`` are implied by them; LPs may add them)."""

    n_aux: int
    A_x: sp.csr_matrix
    A_t: sp.csr_matrix
    b: np.ndarray
    t_lb: np.ndarray
