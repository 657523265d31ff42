"""Closed form for the unconstrained problem: ``d* = -H^{-1} g`` by Cholesky, or the
minimum-norm minimiser ``-H^+ g`` (eigendecomposition) when H is singular."""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.linalg as sla

from ..constraints import ConstraintSet, Unconstrained
from ..errors import UnboundedError
from ..problem import MergeQP
from ..solution import SolveStatus
from .base import QPSolver, RawResult


def unconstrained_minimiser(H: np.ndarray, g: np.ndarray, rcond: float | None = None) -> tuple[np.ndarray, str, float]:
    """Return ``(x, method, outside)``: ``x = -H^{-1} g`` (Cholesky) or ``-H^+ g`` (eigh).

    ``outside`` is the relative norm of ``g`` outside ``range(H)`` (0 for a definite H); when it
    is not ~0, J is unbounded below and ``x`` minimises only the part in ``range(H)``.
    """
    n = H.shape[0]
    top = float(np.max(np.abs(np.diag(H)))) if n else 0.0
    try:
        c = sla.cho_factor(H, lower=True, check_finite=False)
        if np.min(np.abs(np.diag(c[0]))) ** 2 > 1e-12 * max(top, np.finfo(float).tiny):
            return -sla.cho_solve(c, g, check_finite=False), "cholesky", 0.0
    except np.linalg.LinAlgError:
        pass
    w, V = np.linalg.eigh(H)
    cut = (rcond if rcond is not None else n * np.finfo(float).eps * 10) * max(abs(w[-1]), np.finfo(float).tiny)
    keep = w > cut
    coef = V.T @ g
    x = -(V[:, keep] @ (coef[keep] / w[keep]))
    outside = float(np.linalg.norm(coef[~keep])) / max(float(np.linalg.norm(g)), np.finfo(float).tiny)
    return x, "pseudo-inverse", outside


class ClosedFormSolver(QPSolver):
    """Unconstrained problems only: Cholesky, or the pseudo-inverse when H is singular."""

    name = "closed_form"
    defaults = {"rcond": None}

    def supports(self, problem: MergeQP, constraints: ConstraintSet) -> str | None:
        if problem.H is None:
            return "needs an explicit H"
        if not isinstance(constraints, Unconstrained):
            return "handles only the unconstrained problem"
        return None

    def solve(self, problem: MergeQP, constraints: ConstraintSet, x0: np.ndarray | None = None, **options: Any) -> RawResult:
        opts = self.check_options(options)
        assert problem.H is not None
        x, method, outside = unconstrained_minimiser(problem.H, problem.g, opts["rcond"])
        if outside > 1e-8:
            raise UnboundedError(
                f"closed_form: the problem is unbounded below without constraints (a relative "
                f"{outside:.2g} of g lies outside range(H)); add constraints"
            )
        return RawResult(problem.unflat(x), SolveStatus.CLOSED_FORM, 0, {"method": method})
