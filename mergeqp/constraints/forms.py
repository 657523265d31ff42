"""Polyhedral descriptions of constraint sets in flat variables (row-major ``d``)."""

from __future__ import annotations

from dataclasses import dataclass

from typing import Any

import numpy as np
import scipy.sparse as sp

from ..errors import MergeQPError, ValidationError, first_line


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

    def check(self, n: int, owner: str) -> None:
        """A :class:`ValidationError` naming ``owner`` unless the form is over ``n`` variables with
        matching right-hand sides and bounds, none of them NaN."""
        def bad(why: str) -> ValidationError:
            return ValidationError(f"{owner} {why}")

        if int(self.n) != n:
            raise bad(f"is over n = {self.n} variables, but d has {n}")
        for A, b, what in ((self.A_ub, self.b_ub, "A_ub"), (self.A_eq, self.b_eq, "A_eq")):
            if len(A.shape) != 2 or A.shape[1] != n:
                raise bad(f"has {what} of shape {A.shape}, expected (rows, {n})")
            if np.shape(b) != (A.shape[0],):
                raise bad(f"has {what} with {A.shape[0]} rows but its right-hand side has shape {np.shape(b)}")
            if np.any(np.isnan(b)) or np.any(np.isnan(A.data if sp.issparse(A) else A)):
                raise bad(f"has NaN in {what} or its right-hand side")
        for v, what in ((self.lb, "lb"), (self.ub, "ub")):
            if np.shape(v) != (n,):
                raise bad(f"has {what} of shape {np.shape(v)}, expected ({n},)")
            if np.any(np.isnan(v)):
                raise bad(f"has NaN in {what}")

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


def checked_linear_form(cset: Any, shape: tuple[int, int]) -> LinearForm | None:
    """``cset.linear_form(shape)`` with its dimensions checked against ``d`` of ``shape`` (a user's
    set: a wrong form is named here, not by the solver that reads it)."""
    try:
        form = cset.linear_form(shape)
    except MergeQPError:
        raise
    except Exception as exc:  # noqa: BLE001 - a user's set: name it and what it raised, not the solver asking
        raise ValidationError(f"constraint set {cset.spec}: its linear_form({tuple(shape)}) raised "
                              f"{type(exc).__name__}: {first_line(exc, 200)}") from None
    if form is not None:
        form.check(int(shape[0]) * int(shape[1]), f"constraint set {cset.spec}: its linear_form({tuple(shape)})")
    return form
