"""Energy diagnostics of a basis, from the statistics alone (before any solve).

For an orthonormal basis ``Q`` (``(r, p)``) of the layer's output space, the output directions
available to sample ``j`` span ``range(L_j (I_T (x) Q))`` (``span{L q}`` for ``T = 1``); let
``P_j`` project onto it. The paper's Theorem 4.1 for this (relaxed) problem, in which every
sample may be corrected independently inside its span, gives

    J_relaxed(Q) = sum_j w_j ||(I - P_j) b_j||^2 = tr(S) - captured(Q),
    captured(Q)  = sum_j w_j ||P_j b_j||^2        (= tr(S P) when L_j = L for all j),

so ``fraction = captured / tr(S)`` and ``J_relaxed`` lower-bounds the QP objective of that basis
(its corrections ``A_j d`` lie in the same spans, with coefficients tied across samples).
The gap between two bases is ``tr(S (P_ref - P_basis)) = J_relaxed(basis) - J_relaxed(ref)``.

Methods: ``per_sample`` (exact; needs ``keep_samples=True``), ``shared`` (exact when one
Jacobian serves all samples), ``mean_jacobian`` (``P`` from the calibration-mean Jacobian: an
approximation when ``L_j`` varies, recorded in the report). ``auto`` picks the first exact one
available, else ``mean_jacobian``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..errors import ValidationError, unknown
from .bases import optimal_basis, parse_basis_spec
from .parametrisation import Basis, BasisParametrisation, RowsParametrisation

ENERGY_METHODS = ("auto", "per_sample", "shared", "mean_jacobian")
RANK_RTOL = 1e-10


@dataclass(frozen=True)
class EnergyReport:
    """Energy captured by a basis: ``captured`` and ``total = tr(S)`` in squared output units,
    ``fraction = captured / total``, ``relaxed_bound = total - captured`` (a lower bound on
    ``J`` for the basis), and the ``method`` used (see module docstring)."""

    basis: str
    p: int
    captured: float
    total: float
    fraction: float
    relaxed_bound: float
    method: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def range_basis(M: np.ndarray, rtol: float = RANK_RTOL) -> np.ndarray:
    """Orthonormal basis (``(c, rank)``) of ``range(M)`` for ``M`` of shape ``(c, k)``."""
    if M.size == 0:
        return np.zeros((M.shape[0], 0))
    U, s, _ = np.linalg.svd(M, full_matrices=False)
    if s.size == 0 or s[0] == 0:
        return np.zeros((M.shape[0], 0))
    return U[:, s > rtol * s[0]]


def as_basis(stats: Any, basis: Any, task_weights: Any = None) -> Basis:
    """A :class:`Basis` from a Basis, an ``(r, p)`` array, ``"rows"`` (the identity), a
    basis parametrisation, or a spec ``"NAME:P[:SEED]"``."""
    if isinstance(basis, Basis):
        out = basis
    elif isinstance(basis, BasisParametrisation):
        out = basis.basis
    elif isinstance(basis, RowsParametrisation) or (isinstance(basis, str) and basis in ("rows", "standard")):
        out = Basis(np.eye(stats.r), name="standard")
    elif isinstance(basis, str):
        if ":" not in basis:
            raise ValidationError(
                f"energy diagnostics need a basis: a Basis, an (r, p) array, 'rows', or a spec "
                f"like 'optimal:8', got {basis!r}"
            )
        out = parse_basis_spec(basis, stats, task_weights=task_weights)
    else:
        try:
            out = Basis(np.asarray(basis))
        except (TypeError, ValueError) as exc:
            raise ValidationError(f"cannot use {type(basis).__name__} as a basis: {exc}") from None
    if out.r != stats.r:
        raise ValidationError(f"basis has {out.r} rows but the merge layer has r = {stats.r}")
    return out


def _choose_method(stats: Any, method: str) -> str:
    if method not in ENERGY_METHODS:
        raise unknown("energy method", method, ENERGY_METHODS)
    if method == "auto":
        if stats.samples is not None:
            return "per_sample"
        if stats.jacobian_shared:
            return "shared"
        return "mean_jacobian"
    if method == "per_sample" and stats.samples is None:
        raise ValidationError("method='per_sample' needs per-sample data: collect with keep_samples=True")
    if method == "shared" and not stats.jacobian_shared:
        raise ValidationError(
            f"method='shared' needs one Jacobian for every sample, but it varies (max relative "
            f"deviation {stats.jacobian_variation:.3g}); use 'per_sample' or 'mean_jacobian'"
        )
    return method


def captured_energy(stats: Any, Q: np.ndarray, w: np.ndarray, method: str) -> float:
    """``sum_j w_j ||P_j b_j||^2`` (per_sample) or ``tr(S P)`` with the mean Jacobian."""
    if method == "per_sample":
        total = 0.0
        for chunk in stats.samples:
            weight = float(w[chunk.task])
            if weight == 0.0:
                continue
            B, c = chunk.jacobian.shape[:2]
            M = np.einsum("bctr,rp->bctp", chunk.jacobian, Q).reshape(B, c, -1)
            U, s, _ = np.linalg.svd(M, full_matrices=False)
            keep = s > RANK_RTOL * np.maximum(s[:, :1], np.finfo(float).tiny)
            coeff = np.einsum("bck,bc->bk", U, chunk.residual) * keep
            total += weight * float(np.sum(coeff * coeff))
        return total
    L = stats.mean_jacobian(w)  # (c, T, r)
    M = np.einsum("ctr,rp->ctp", L, Q).reshape(L.shape[0], -1)
    U = range_basis(M)
    S = stats.S(w)
    return float(np.einsum("ci,cd,di->", U, S, U))


def energy_report(stats: Any, basis: Any, task_weights: Any = None, method: str = "auto") -> EnergyReport:
    """The :class:`EnergyReport` of ``basis`` for ``stats`` (a :class:`CalibrationStats`)."""
    B = as_basis(stats, basis, task_weights)
    w = stats.task_weight_vector(task_weights)
    chosen = _choose_method(stats, method)
    total = stats.total_energy(w)
    captured = min(captured_energy(stats, B.Q, w, chosen), total)
    return EnergyReport(
        basis=B.name, p=B.p, captured=captured, total=total,
        fraction=captured / total if total > 0 else 1.0,
        relaxed_bound=max(total - captured, 0.0), method=chosen,
    )


def suboptimality_gap(stats: Any, basis: Any, reference: Any = None, task_weights: Any = None,
                      method: str = "auto") -> float:
    """``tr(S (P_ref - P_basis))``: how much more energy ``reference`` captures than ``basis``
    (the reference defaults to the optimal basis of the same ``p``)."""
    B = as_basis(stats, basis, task_weights)
    if reference is None:
        R = optimal_basis(stats, B.p, task_weights=task_weights)
    else:
        R = as_basis(stats, reference, task_weights)
    return (energy_report(stats, R, task_weights, method).captured
            - energy_report(stats, B, task_weights, method).captured)
