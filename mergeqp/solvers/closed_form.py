"""Closed form for the unconstrained problem: ``d* = -H^{-1} g`` by Cholesky, or the
minimum-norm minimiser ``-H^+ g`` (eigendecomposition) when H is singular."""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.linalg as sla

from ..constraints import ConstraintSet, Unconstrained
from ..errors import SolverError, UnboundedError
from ..problem import MergeQP
from ..solution import SolveStatus
from .base import QPSolver, RawResult
from .unbounded import descent_ray


def unconstrained_minimiser(H: np.ndarray, g: np.ndarray, rcond: float | None = None
                            ) -> tuple[np.ndarray, str, float, np.ndarray | None]:
    """Return ``(x, method, outside, v)``: ``x = -H^{-1} g`` (Cholesky) or ``-H^+ g`` (eigh).

    ``outside`` is the relative norm of ``g`` outside the numerical ``range(H)`` (0 for a
    definite H) and ``v`` that part of ``-g`` (``None`` when ``outside`` is 0): when
    ``outside`` is not ~0, J may be unbounded below along ``v`` (see :mod:`.unbounded`), and
    ``x`` minimises only the part in ``range(H)``.
    """
    n = H.shape[0]
    top = float(np.max(np.abs(np.diag(H)))) if n else 0.0
    try:
        c = sla.cho_factor(H, lower=True, check_finite=False)
        if np.min(np.abs(np.diag(c[0]))) ** 2 > 1e-12 * max(top, np.finfo(float).tiny):
            return -sla.cho_solve(c, g, check_finite=False), "cholesky", 0.0, None
    except np.linalg.LinAlgError:
        pass
    w, V = np.linalg.eigh(H)
    cut = (rcond if rcond is not None else n * np.finfo(float).eps * 10) * max(abs(w[-1]), np.finfo(float).tiny)
    keep = w > cut
    coef = V.T @ g
    x = -(V[:, keep] @ (coef[keep] / w[keep]))
    outside = float(np.linalg.norm(coef[~keep])) / max(float(np.linalg.norm(g)), np.finfo(float).tiny)
    v = -(V[:, ~keep] @ coef[~keep]) if outside > 0 else None
    if v is not None and np.any(~keep & (w > 0)):
        # eigenvalues below the cut but positive: the minimum along them may be finite (a
        # badly conditioned but definite H); the full inverse on them, for the caller to use
        # when v turns out not to be a ray of unbounded descent
        pos = w > 0
        x_pos = -(V[:, pos] @ (coef[pos] / w[pos]))
        return x, "pseudo-inverse", outside, v if not np.all(np.isfinite(x_pos)) else np.stack([v, x_pos])
    return x, "pseudo-inverse", outside, v


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
        x, method, outside, v = unconstrained_minimiser(problem.H, problem.g, opts["rcond"])
        if outside > 1e-8 and v is not None:
            x_pos = None
            if v.ndim == 2:
                v, x_pos = v
            why = descent_ray(problem, v)
            if why is not None:
                raise UnboundedError(f"closed_form: the problem is unbounded below without constraints: {why}; "
                                     f"add constraints")
            if x_pos is None:
                raise SolverError(
                    f"closed_form: a relative {outside:.2g} of g lies outside the numerical range of H, "
                    f"but J is not unbounded along it (H is badly conditioned); try solver='active_set'"
                )
            # tiny positive eigenvalues carry a finite minimum: use them (the certificate judges)
            x, method = x_pos, "eigh (all positive eigenvalues; H badly conditioned)"
        return RawResult(problem.unflat(x), SolveStatus.CLOSED_FORM, 0, {"method": method})
