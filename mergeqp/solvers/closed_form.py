"""Closed form for the unconstrained problem: ``d* = -H^{-1} g`` by Cholesky, or the
minimum-norm minimiser ``-H^+ g`` (eigendecomposition) when H is singular."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.linalg as sla

from ..constraints import ConstraintSet, Unconstrained
from ..errors import SolverError, UnboundedError
from ..problem import MergeQP
from ..solution import SolveStatus
from .base import QPSolver, RawResult
from .unbounded import descent_ray


@dataclass(frozen=True)
class UnconstrainedMinimiser:
    """What :func:`unconstrained_minimiser` found.

    ``x``: ``-H^{-1} g`` (Cholesky) or ``-H^+ g`` (eigh; ``method`` says which). ``outside``: the
    relative norm of ``g`` outside the numerical ``range(H)`` (0 for a definite H); ``ray``: that
    part of ``-g`` (``None`` when ``outside`` is 0), along which J may be unbounded below (see
    :mod:`.unbounded`). ``x_positive``: when eigenvalues below the pseudo-inverse's cut are still
    positive, the minimiser using them too (a badly conditioned but definite H has a finite
    minimum along them), else ``None``."""

    x: np.ndarray
    method: str
    outside: float = 0.0
    ray: np.ndarray | None = None
    x_positive: np.ndarray | None = None


def unconstrained_minimiser(H: np.ndarray, g: np.ndarray, rcond: float | None = None) -> UnconstrainedMinimiser:
    """The minimiser of ``1/2 x'Hx + g'x`` over ``R^n`` (see :class:`UnconstrainedMinimiser`)."""
    n = H.shape[0]
    top = float(np.max(np.abs(np.diag(H)))) if n else 0.0
    try:
        c = sla.cho_factor(H, lower=True, check_finite=False)
        if np.min(np.abs(np.diag(c[0]))) ** 2 > 1e-12 * max(top, np.finfo(float).tiny):
            return UnconstrainedMinimiser(-sla.cho_solve(c, g, check_finite=False), "cholesky")
    except np.linalg.LinAlgError:
        pass
    w, V = np.linalg.eigh(H)
    cut = (rcond if rcond is not None else n * np.finfo(float).eps * 10) * max(abs(w[-1]), np.finfo(float).tiny)
    keep = w > cut
    coef = V.T @ g
    x = -(V[:, keep] @ (coef[keep] / w[keep]))
    outside = float(np.linalg.norm(coef[~keep])) / max(float(np.linalg.norm(g)), np.finfo(float).tiny)
    if outside == 0:
        return UnconstrainedMinimiser(x, "pseudo-inverse")
    ray = -(V[:, ~keep] @ coef[~keep])
    x_positive = None
    if np.any(~keep & (w > 0)):
        pos = w > 0
        x_positive = -(V[:, pos] @ (coef[pos] / w[pos]))
        if not np.all(np.isfinite(x_positive)):
            x_positive = None
    return UnconstrainedMinimiser(x, "pseudo-inverse", outside, ray, x_positive)


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
        found = unconstrained_minimiser(problem.H, problem.g, opts["rcond"])
        x, method = found.x, found.method
        if found.outside > 1e-8 and found.ray is not None:
            why = descent_ray(problem, found.ray)
            if why is not None:
                raise UnboundedError(f"closed_form: the problem is unbounded below without constraints: {why}; "
                                     f"add constraints")
            if found.x_positive is None:
                raise SolverError(
                    f"closed_form: a relative {found.outside:.2g} of g lies outside the numerical range of H, "
                    f"but J is not unbounded along it (H is badly conditioned); try solver='active_set'"
                )
            # tiny positive eigenvalues carry a finite minimum: use them (the certificate judges)
            x, method = found.x_positive, "eigh (all positive eigenvalues; H badly conditioned)"
        return RawResult(problem.unflat(x), SolveStatus.CLOSED_FORM, 0, {"method": method})
