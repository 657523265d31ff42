"""The minimiser of ``1/2 x'Hx + g'x`` over ``R^n``: Cholesky, or the pseudo-inverse when H is
singular (with the part of ``-g`` outside the numerical range of H, a candidate ray of
unbounded descent). Shared by the closed-form solver and the unboundedness checks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.linalg as sla

from ..cholesky import cho_solve
from ..problem import stable_norm


@dataclass(frozen=True)
class UnconstrainedMinimiser:
    """What :func:`unconstrained_minimiser` found.

    ``x``: ``-H^{-1} g`` (Cholesky) or ``-H^+ g`` (eigh; ``method`` says which). ``outside``: the
    relative norm of ``g`` outside the numerical ``range(H)`` (0 for a definite H); ``ray``: that
    part of ``-g`` (``None`` when ``outside`` is 0), along which J may be unbounded below (see
    :mod:`.unbounded`). ``x_positive``: when eigenvalues below the pseudo-inverse's cut are still
    positive, the minimiser using them too (a badly conditioned but definite H has a finite
    minimum along them), else ``None``. ``kernel``: the eigenvectors below the cut (eigh path), where
    a ray of unbounded descent inside a set's cone is searched (:mod:`.unbounded`)."""

    x: np.ndarray
    method: str
    outside: float = 0.0
    ray: np.ndarray | None = None
    x_positive: np.ndarray | None = None
    #: the eigenvectors below the cut, ``(n, k)`` (the numerical kernel of H; eigh path only)
    kernel: np.ndarray | None = None


def unconstrained_minimiser(H: np.ndarray, g: np.ndarray, rcond: float | None = None) -> UnconstrainedMinimiser:
    """The minimiser of ``1/2 x'Hx + g'x`` over ``R^n`` (see :class:`UnconstrainedMinimiser`)."""
    n = H.shape[0]
    top = float(np.max(np.abs(np.diag(H)))) if n else 0.0
    try:
        c = sla.cho_factor(H, lower=True, check_finite=False)
        if np.min(np.abs(np.diag(c[0]))) ** 2 > 1e-12 * max(top, np.finfo(float).tiny):
            return UnconstrainedMinimiser(-cho_solve(c, g), "cholesky")
    except np.linalg.LinAlgError:
        pass
    w, V = np.linalg.eigh(H)
    cut = (rcond if rcond is not None else n * np.finfo(float).eps * 10) * max(abs(w[-1]), np.finfo(float).tiny)
    keep = w > cut
    coef = V.T @ g
    x = -(V[:, keep] @ (coef[keep] / w[keep]))
    outside = stable_norm(coef[~keep]) / max(stable_norm(g), np.finfo(float).tiny)  # (squares overflowed at 1e200)
    if outside == 0:
        return UnconstrainedMinimiser(x, "pseudo-inverse", kernel=V[:, ~keep])
    ray = -(V[:, ~keep] @ coef[~keep])
    x_positive = None
    if np.any(~keep & (w > 0)):
        pos = w > 0
        x_positive = -(V[:, pos] @ (coef[pos] / w[pos]))
        if not np.all(np.isfinite(x_positive)):
            x_positive = None
    return UnconstrainedMinimiser(x, "pseudo-inverse", outside, ray, x_positive, V[:, ~keep])
