"""Damped Gauss-Newton (Levenberg-Marquardt) output-space steps at one layer.

One output-space solve (:func:`~.output_space.output_space_solve`) is one Gauss-Newton step of
the true calibration error ``F(W)`` of the layer's weight ``W`` (augmented ``(r, m1)``). Where
the model is far from linear (a ReLU network) the full step can raise ``F``.
:func:`damped_output_space` minimises ``G(W) = F(W) + mu ||W - W_ref||_F^2`` from the reference
``W_ref`` by solves that each minimise the linearisation of ``F`` at the current ``W_t`` plus that
ridge plus a proximal term ``nu ||W - W_t||_F^2``::

    mu ||E - (W_ref - W_t)||^2 + nu ||E||^2 = (mu + nu) ||E - mu / (mu + nu) (W_ref - W_t)||^2 + const

so each is one ridge solve with a shifted centre. ``mu = ridge x scale`` and ``nu = prox x scale``
with ``scale`` the ridge unit of the first linearisation (the mean diagonal of its normal
operator). A solve is accepted when ``G`` falls (then ``nu`` is divided by ``relax``), else ``nu``
is multiplied by ``damping`` and the solve retried, from the same linearisation when the caller
says it can be reused. It stops after ``steps`` solves or when an accepted one lowers ``G`` by less
than ``tol`` times it. ``G`` at the result is below ``G(W_ref) = F(W_ref)``, so ``F`` is too.

The caller owns the model: ``linearised(W)`` sets the layer to ``W`` and yields the operator there
(a context manager, for operators valid only while hooks are registered), ``true_error(W)`` sets
it to ``W`` and returns ``F``. Used by the run layer (:func:`.output_space_hf.damped_site`) and the
MNIST experiment (:func:`mergeqp.experiments.output_space.output_space_merge`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .output_space import CERT_TOL, OutputSpaceSolution, output_space_solve


@dataclass(frozen=True)
class DampingOptions:
    """``ridge`` and ``prox`` (relative to the first linearisation's ridge unit), ``damping`` (> 1)
    and ``relax`` (>= 1) of ``nu``, at most ``steps`` solves, relative ``tol``; CG ``cg_tol``,
    ``max_iter`` and the certificate's ``cert_tol``."""

    ridge: float
    prox: float = 16.0
    damping: float = 4.0
    relax: float = 1.5
    steps: int = 60
    tol: float = 1e-4
    cg_tol: float = 1e-10
    max_iter: int = 1000
    cert_tol: float = CERT_TOL


@dataclass(frozen=True)
class DampedStep:
    """One solve: its proximal weight ``nu`` (absolute), the true ``F`` before and after, the
    linearised prediction of ``F`` (``predicted``), ``G`` after, whether accepted, the solve's
    certificate and CG iterations, seconds."""

    nu: float
    error_before: float
    predicted: float
    error_after: float
    objective_after: float
    accepted: bool
    normal_residual: float
    certified: bool
    iterations: int
    seconds: float

    def record(self, nu_key: str) -> dict[str, Any]:
        """The step as a JSON mapping, its proximal weight under ``nu_key`` (each caller's own name)."""
        return {(nu_key if k == "nu" else k): v for k, v in asdict(self).items()}


@dataclass(frozen=True, eq=False)
class DampedResult:
    """The final weight ``W``, its true ``error`` ``F`` and ``value`` ``G``, the ridge ``mu`` and its
    unit ``scale``, every solve, and the last accepted solve (``None``: none was)."""

    W: np.ndarray
    error: float
    value: float
    mu: float
    scale: float
    steps: tuple[DampedStep, ...] = field(default=())
    last: OutputSpaceSolution | None = None

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.steps)

    def certified(self) -> bool:
        """Every accepted solve certified (vacuously true when none was accepted)."""
        return all(s.certified for s in self.steps if s.accepted)


def damped_output_space(W_ref: np.ndarray, error: float,
                        linearised: Callable[[np.ndarray], AbstractContextManager[tuple[Any, bool]]],
                        true_error: Callable[[np.ndarray], float], options: DampingOptions) -> DampedResult:
    """Levenberg-Marquardt from ``W_ref`` (module docstring); ``error`` is ``F(W_ref)``.
    ``linearised(W)``: sets the layer to ``W`` and yields ``(operator, reusable)`` (``reusable``: the
    operator stays valid after the block, so a rejected solve is retried without linearising
    again); ``true_error(W)``: sets the layer to ``W`` and returns ``F(W)``. The layer is left at
    the last weight evaluated; set it to ``result.W``."""
    o = options
    ref = np.asarray(W_ref, dtype=np.float64)
    W, value, F = ref.copy(), float(error), float(error)
    mu = nu = scale = 0.0
    steps: list[DampedStep] = []
    last: OutputSpaceSolution | None = None
    kept: Any = None

    def solve(operator: Any) -> OutputSpaceSolution:
        return output_space_solve(operator, ridge=mu + nu, center=mu / (mu + nu) * (ref - W), tol=o.cg_tol,
                                  max_iter=o.max_iter, cert_tol=o.cert_tol)

    for _ in range(o.steps):
        t0 = time.perf_counter()
        if kept is not None:
            sol = solve(kept)
        else:
            with linearised(W) as (operator, reusable):
                if not steps:
                    scale = float(operator.ridge_scale())
                    mu, nu = o.ridge * scale, o.prox * scale
                sol = solve(operator)
                kept = operator if reusable else None
        W_new = W + sol.E
        F_new = float(true_error(W_new))
        value_new = F_new + mu * float(np.sum((W_new - ref) ** 2))
        accepted = bool(np.isfinite(value_new) and value_new < value)
        steps.append(DampedStep(nu=nu, error_before=F, predicted=sol.fit, error_after=F_new,
                                objective_after=value_new, accepted=accepted, normal_residual=sol.residual,
                                certified=sol.certified(), iterations=sol.iterations,
                                seconds=time.perf_counter() - t0))
        if accepted:
            gain = value - value_new
            W, value, F, last, kept = W_new, value_new, F_new, sol, None
            nu /= o.relax
            if gain < o.tol * value:
                break
        else:
            nu *= o.damping
    return DampedResult(W=W, error=F, value=value, mu=mu, scale=scale, steps=tuple(steps), last=last)


__all__ = ["DampedResult", "DampedStep", "DampingOptions", "damped_output_space"]
