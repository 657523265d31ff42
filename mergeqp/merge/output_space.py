"""Full-matrix output-space merge: RegMean generalised to the paper's downstream objective.

RegMean (:mod:`.regmean`) chooses a whole weight matrix per layer to match each fine-tune's
*layer output*. The paper's objective compares the *model outputs* downstream of the layer.
Linearised at a point ``W_0`` of the layer (augmented ``(r, m1)``: the bias is the last
column), a change ``E`` of the layer's weights changes the compared output of sample ``s`` by
``A_s E x_s`` (``A_s``: Jacobian ``(c, r)`` of the compared outputs w.r.t. the layer output,
``x_s``: the augmented layer input ``(m1,)``; with ``T`` positions per sample the change is
``sum_t A_(s,t) E x_(s,t)``). This module finds the free matrix ``E`` that minimises::

    F(E) = sum_s w_s ||A_s E x_s - t_s||^2 + mu ||E - E_c||_F^2      (s.t. ||E - E_c||_F <= R)

``t_s`` (``(c,)``) the wanted output change (the fine-tune's output minus the output at
``W_0``: the negated QP residual ``-b_s``), ``w_s >= 0`` sample weights, ``mu >= 0`` the ridge
toward the centre ``E_c`` (e.g. RegMean's or the soup's residual measured from ``W_0``), ``R``
an optional radius (a norm ball / trust region around the centre).

The solve is matrix-free: conjugate gradients on the normal equations
``(N + mu I) D = L*W(t - L E_c)`` for ``D = E - E_c``, with ``N = L*WL`` applied through
``A_s`` and ``x_s`` (two contractions; no matrix of size ``(r m1)^2`` is formed), preconditioned
by :class:`KroneckerPreconditioner`: the diagonal of ``N`` (positions taken one at a time) in the
eigenbasis ``U x V`` of its Kronecker factors ``B = sum_(s,t) w_s A_(s,t)'A_(s,t)`` ``(r, r)`` and
``C = sum_(s,t) w_s x_(s,t) x_(s,t)'`` ``(m1, m1)`` (the eigenvalue-corrected K-FAC of
second-order optimisation). Against the plain diagonal (Jacobi, before stop 53) it took 2-15x
fewer CG iterations on transformer sites and about 40% fewer on the MNIST MLP. Certificate:

- unconstrained (``radius=None``): the relative normal-equation residual
  ``||(N + mu I) D - rhs||_F / ||rhs||_F``, computed afresh at the end (not the CG recurrence);
  ``certified`` when it is at most ``cert_tol``. With ``mu > 0`` the system is positive
  definite and the minimiser unique; with ``mu = 0`` any solution of the normal equations is a
  minimiser (which one the preconditioned CG from ``D = 0`` returns depends on the
  preconditioner: not in general the one closest to the centre).
- radius ``R``: the KKT conditions of the ball-constrained problem, ``(N + (mu + nu) I) D =
  rhs``, ``nu >= 0``, ``||D|| <= R``, ``nu (R - ||D||) = 0``. ``nu`` is found by a safeguarded
  secant search on ``1/||D(nu)||`` (each evaluation one CG solve, warm-started); ``certified``
  when the stationarity residual is at most ``cert_tol`` and feasibility and complementarity
  hold to ``cert_tol`` relative to ``R``.

With ``A_s = I`` (the layer's own output compared in the euclidean metric) and targets
``t_s = Delta_k x_s`` for the samples of fine-tune ``k`` (weights ``1/N_k``) the minimiser is
RegMean's closed form with ``alpha = 1``, ``(sum_k Delta_k G_k + mu E_c)(sum_k G_k + mu I)^(-1)``
(tested).

The merge method ``output_space`` (:data:`OUTPUT_SPACE`, registered in
:mod:`.registry`) applies one such solve to every selected ``nn.Linear`` layer of a model, each
linearised at the *reference* merge (``reference``: ``regmean``, the default, or ``soup``; every
selected tensor holds the reference's value there, unselected tensors what the output will hold)
with the fine-tunes' outputs on their own calibration data as targets and the ridge toward the
reference (``E_c = 0``): ``W = W_ref + E``. ``ridge`` is relative (``mu = ridge x`` the mean
diagonal of the layer's normal operator); ``radius`` (absolute, Frobenius, optional) bounds
``||W - W_ref||``. Layers are solved one at a time, the others held at the reference (as
RegMean treats each layer on its own). Every other selected tensor is the reference's; a layer
whose bias is not selected keeps its weight's solve and the output's bias (the solve's bias
change is dropped). ``task_weights``: one weight per fine-tune's samples (default 1 each).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from ..errors import ConfigError, ValidationError
from ..solvers.blas_threads import blas_threads
from ..stats import collect_statistics
from .batches import check_calibration, check_model, model_device, model_weights
from .method import MergeMethod, MethodParams, iterate, resolve_weights
from .regmean import REGMEAN, RegMeanParams
from .sites import model_sites

#: relative normal-equation (or KKT stationarity) residual at which a solve counts as certified
CERT_TOL = 1e-6


#: a preconditioner entry below this fraction of the largest is raised to it (a null direction of
#: ``N`` with a zero shift would divide by zero)
PRECONDITIONER_FLOOR = 1e-12


@dataclass(frozen=True, eq=False)
class KroneckerPreconditioner:
    """``M = (U x V) diag(s) (U x V)'`` acting on ``(r, m1)`` matrices: ``M^-1`` (with a shift)
    is ``R -> U ((U' R V) / (s + shift)) V'``. ``U`` ``(r, r)`` and ``V`` ``(m1, m1)`` orthogonal,
    ``diagonal`` ``s`` ``(r, m1)`` (raised to :data:`PRECONDITIONER_FLOOR` times its largest
    entry). ``U`` or ``V`` ``None``: the identity on that side (both: the plain diagonal, Jacobi)."""

    diagonal: np.ndarray
    U: np.ndarray | None = None
    V: np.ndarray | None = None

    def __post_init__(self) -> None:
        d = np.asarray(self.diagonal, dtype=np.float64)
        object.__setattr__(self, "diagonal", np.maximum(d, PRECONDITIONER_FLOOR * max(float(d.max(initial=0.0)),
                                                                                       1e-300)))

    @classmethod
    def from_factors(cls, B: np.ndarray | None, C: np.ndarray | None, rotated_diagonal: Any) -> KroneckerPreconditioner:
        """From the Kronecker factors ``B`` ``(r, r)`` and ``C`` ``(m1, m1)`` (``None``: that side is
        not rotated, :data:`KRONECKER_MAX_SIDE`) and a function of their eigenvectors ``(U, V)``
        (``None`` for the identity) returning the diagonal of ``N`` in the basis ``U x V``."""
        U = None if B is None else np.linalg.eigh(B)[1]
        V = None if C is None else np.linalg.eigh(C)[1]
        return cls(rotated_diagonal(U, V), U, V)

    def solve(self, R: np.ndarray, shift: float) -> np.ndarray:
        """``(M + shift I)^-1 R``."""
        Y = R if self.U is None else self.U.T @ R
        Y = (Y if self.V is None else Y @ self.V) / (self.diagonal + shift)
        Y = Y if self.U is None else self.U @ Y
        return Y if self.V is None else Y @ self.V.T


#: a side (``r`` or ``m1``) longer than this is not rotated by :class:`KroneckerPreconditioner`: its
#: factor (``side^2`` float64) and eigendecomposition (0.75 s at 1,537, 6 s at 3,072 on one thread;
#: minutes at a language model's 11,008) would cost more than they save (stop 53 review)
KRONECKER_MAX_SIDE = 4096


def preconditioner_of(operator: Any) -> KroneckerPreconditioner:
    """The operator's :meth:`kronecker_preconditioner` when it has one, else the Jacobi
    preconditioner of its :meth:`normal_diagonal` (an operator of a caller's own)."""
    make = getattr(operator, "kronecker_preconditioner", None)
    return make() if callable(make) else KroneckerPreconditioner(operator.normal_diagonal())


@dataclass(frozen=True, eq=False)
class OutputSpaceSamples:
    """The per-sample linearisation of one layer (float64 numpy arrays).

    ``layer_input`` ``(N, T, m1)`` (augmented, constant 1 last when the layer has a bias),
    ``jacobian`` ``(N, c, T, r)`` (compared outputs w.r.t. the layer output at each position),
    ``target`` ``(N, c)`` the wanted output change, ``weight`` ``(N,)`` sample weights."""

    layer_input: np.ndarray
    jacobian: np.ndarray
    target: np.ndarray
    weight: np.ndarray

    def __post_init__(self) -> None:
        X, A, t, w = (np.asarray(a, dtype=np.float64) for a in
                      (self.layer_input, self.jacobian, self.target, self.weight))
        if X.ndim != 3 or A.ndim != 4 or t.ndim != 2 or w.ndim != 1:
            raise ValidationError(
                f"output-space samples need layer_input (N, T, m1), jacobian (N, c, T, r), target (N, c) and "
                f"weight (N,); got shapes {X.shape}, {A.shape}, {t.shape}, {w.shape}")
        N, T, _ = X.shape
        if A.shape[0] != N or A.shape[2] != T or t.shape != (N, A.shape[1]) or w.shape != (N,):
            raise ValidationError(
                f"output-space samples disagree: layer_input {X.shape}, jacobian {A.shape}, target {t.shape}, "
                f"weight {w.shape} (expected jacobian (N, c, T, r), target (N, c), weight (N,))")
        for name, a in (("layer_input", X), ("jacobian", A), ("target", t), ("weight", w)):
            if not np.all(np.isfinite(a)):
                raise ValidationError(f"output-space samples: {name} contains NaN or inf")
        if np.any(w < 0):
            raise ValidationError("output-space samples: sample weights must be >= 0")
        for name, a in (("layer_input", X), ("jacobian", A), ("target", t), ("weight", w)):
            object.__setattr__(self, name, a)

    @property
    def shape(self) -> tuple[int, int]:
        """``(r, m1)``: the shape of the layer's augmented weight."""
        return int(self.jacobian.shape[3]), int(self.layer_input.shape[2])

    def apply(self, E: np.ndarray) -> np.ndarray:
        """``L(E)``: the linearised output change ``(N, c)`` of a weight change ``E`` ``(r, m1)``."""
        N, T, m1 = self.layer_input.shape
        c, r = self.jacobian.shape[1], self.jacobian.shape[3]
        U = (self.layer_input.reshape(N * T, m1) @ E.T).reshape(N, T * r, 1)  # layer-output changes
        return np.matmul(self.jacobian.reshape(N, c, T * r), U)[..., 0]  # sum over t, r (batched BLAS)

    def adjoint(self, V: np.ndarray) -> np.ndarray:
        """``L*(w V)``: the adjoint applied to weighted output changes ``V`` ``(N, c)``, ``(r, m1)``."""
        N, T, m1 = self.layer_input.shape
        c, r = self.jacobian.shape[1], self.jacobian.shape[3]
        U = np.matmul((V * self.weight[:, None])[:, None, :], self.jacobian.reshape(N, c, T * r))  # (N, 1, T r)
        return U.reshape(N * T, r).T @ self.layer_input.reshape(N * T, m1)

    def normal(self, E: np.ndarray) -> np.ndarray:
        """``N E = L*W L E`` (``(r, m1)``)."""
        return self.adjoint(self.apply(E))

    def normal_diagonal(self) -> np.ndarray:
        """``(r, m1)``: the diagonal of ``N`` when ``T = 1`` (with several positions the sum over
        positions of each position's diagonal, the Jacobi preconditioner's approximation)."""
        col = np.einsum("nctr->ntr", self.jacobian ** 2)
        return np.einsum("n,ntr,ntm->rm", self.weight, col, self.layer_input ** 2)

    def kronecker_preconditioner(self) -> KroneckerPreconditioner:
        """:class:`KroneckerPreconditioner` of ``N`` (positions one at a time, as
        :meth:`normal_diagonal`); computed once."""
        return self._kronecker

    @cached_property
    def _kronecker(self) -> KroneckerPreconditioner:
        N, c, T, r = self.jacobian.shape
        m1 = self.layer_input.shape[2]
        root = np.sqrt(self.weight)
        Xw = (self.layer_input * root[:, None, None]).reshape(N * T, m1)
        B = None
        if r <= KRONECKER_MAX_SIDE:
            Aw = (self.jacobian * root[:, None, None, None]).reshape(N * c * T, r)
            B = Aw.T @ Aw
            del Aw
        C = Xw.T @ Xw if m1 <= KRONECKER_MAX_SIDE else None

        def rotated(U: np.ndarray | None, V: np.ndarray | None) -> np.ndarray:
            P2 = np.empty((N, T, r))
            for n in range(N):  # one sample at a time: no second (N, c, T, r) array
                P2[n] = np.sum((self.jacobian[n] if U is None else self.jacobian[n] @ U) ** 2, axis=0)
            Q2 = (Xw if V is None else Xw @ V) ** 2  # carries the weights
            return P2.reshape(N * T, r).T @ Q2

        return KroneckerPreconditioner.from_factors(B, C, rotated)

    def error(self, E: np.ndarray) -> float:
        """``sum_s w_s ||A_s E x_s - t_s||^2``."""
        return float(self.weight @ np.sum((self.apply(E) - self.target) ** 2, axis=1))

    def ridge_scale(self) -> float:
        """Mean of :meth:`normal_diagonal`: the unit of a relative ridge weight (``mu = ridge x
        scale``), so one relative value means the same for any layer size or sample count."""
        return float(np.mean(self.normal_diagonal()))


@dataclass(frozen=True, eq=False)
class OutputSpaceSolution:
    """The minimiser ``E`` ``(r, m1)`` of ``F`` (module docstring) and its certificate.

    ``objective`` ``F(E)``; ``fit`` its data term ``sum_s w_s ||A_s E x_s - t_s||^2``;
    ``ridge`` ``mu``; ``radius`` ``R`` (``None``: unconstrained); ``multiplier`` ``nu`` (0 when
    the ball is inactive); ``residual`` the relative normal-equation / KKT stationarity residual;
    ``feasibility`` ``max(0, ||E - E_c|| - R) / R`` and ``complementarity``
    ``nu |R - ||E - E_c||| / (R (mu + nu))`` (0 without a radius); ``iterations`` CG iterations
    in all; ``certified`` whether every check is at most ``cert_tol``."""

    E: np.ndarray
    objective: float
    fit: float
    ridge: float
    radius: float | None
    multiplier: float
    residual: float
    feasibility: float
    complementarity: float
    iterations: int
    cert_tol: float
    notes: tuple[str, ...] = field(default=())

    def certified(self) -> bool:
        return bool(self.residual <= self.cert_tol and self.feasibility <= self.cert_tol
                    and self.complementarity <= self.cert_tol)

    def to_dict(self) -> dict[str, Any]:
        return {"objective": self.objective, "fit": self.fit, "ridge": self.ridge, "radius": self.radius,
                "multiplier": self.multiplier, "normal_residual": self.residual,
                "feasibility": self.feasibility, "complementarity": self.complementarity,
                "iterations": self.iterations, "cert_tol": self.cert_tol, "certified": self.certified(),
                "notes": list(self.notes)}


def _cg(samples: OutputSpaceSamples, shift: float, rhs: np.ndarray, D0: np.ndarray,
        precond: KroneckerPreconditioner, tol: float, max_iter: int) -> tuple[np.ndarray, int]:
    """Preconditioned CG on ``(N + shift I) D = rhs`` from ``D0``; stops when the recurrence's
    residual is below ``tol x ||rhs||`` (the caller measures the true residual)."""
    D = D0.copy()
    res = rhs - samples.normal(D) - shift * D
    target = tol * float(np.linalg.norm(rhs))
    z = precond.solve(res, shift)
    p = z.copy()
    rz = float(np.sum(res * z))
    it = 0
    while it < max_iter and float(np.linalg.norm(res)) > target:
        Ap = samples.normal(p) + shift * p
        pAp = float(np.sum(p * Ap))
        if pAp <= 0.0:  # a null direction of N with shift 0: nothing more to gain
            break
        alpha = rz / pAp
        D += alpha * p
        res -= alpha * Ap
        z = precond.solve(res, shift)
        rz_new = float(np.sum(res * z))
        p = z + (rz_new / rz) * p
        rz = rz_new
        it += 1
    return D, it


def _relative_residual(samples: OutputSpaceSamples, shift: float, rhs: np.ndarray, D: np.ndarray) -> float:
    scale = float(np.linalg.norm(rhs))
    res = float(np.linalg.norm(samples.normal(D) + shift * D - rhs))
    return res / scale if scale > 0 else res


#: BLAS threads while an output-space solve runs: its products are many small or memory-bound ones,
#: for which a pool of threads costs more in synchronisation than it gains, and under load from other
#: processes far more (stop 53: 10 damped MNIST solves took 174 s wall with the default pool of 2
#: threads beside another busy process, 13 s with 1)
CG_BLAS_THREADS = 1


def output_space_solve(samples: OutputSpaceSamples, *, ridge: float, center: np.ndarray | None = None,
                       radius: float | None = None, tol: float = 1e-10, max_iter: int = 2000,
                       cert_tol: float = CERT_TOL, max_multiplier_steps: int = 60) -> OutputSpaceSolution:
    """Minimise ``F`` (module docstring) over ``E`` ``(r, m1)``.

    ``ridge``: ``mu >= 0`` (absolute; :meth:`OutputSpaceSamples.ridge_scale` gives the unit);
    ``center``: ``E_c`` ``(r, m1)`` (default 0: the linearisation point itself); ``radius``:
    ``R > 0`` for the ball ``||E - E_c||_F <= R`` (``None``: unconstrained); ``tol`` the CG
    stopping tolerance, ``max_iter`` per CG solve. The BLAS runs :data:`CG_BLAS_THREADS` threads
    meanwhile."""
    with blas_threads(CG_BLAS_THREADS):
        return _solve(samples, ridge, center, radius, tol, max_iter, cert_tol, max_multiplier_steps)


def _solve(samples: OutputSpaceSamples, ridge: float, center: np.ndarray | None, radius: float | None, tol: float,
           max_iter: int, cert_tol: float, max_multiplier_steps: int) -> OutputSpaceSolution:
    r, m1 = samples.shape
    if not (math.isfinite(ridge) and ridge >= 0):
        raise ValidationError(f"output-space merge: the ridge weight must be finite and >= 0, got {ridge!r}")
    if radius is not None and not (math.isfinite(radius) and radius > 0):
        raise ValidationError(f"output-space merge: the radius must be finite and > 0, got {radius!r}")
    C = np.zeros((r, m1)) if center is None else np.asarray(center, dtype=np.float64)
    if C.shape != (r, m1) or not np.all(np.isfinite(C)):
        raise ValidationError(f"output-space merge: the ridge centre must be a finite ({r}, {m1}) matrix, "
                              f"got shape {C.shape}")
    rhs = samples.adjoint(samples.target - samples.apply(C))
    notes: list[str] = []
    if not np.any(rhs):
        D, iters, nu = np.zeros((r, m1)), 0, 0.0
        notes.append("the centre already satisfies the normal equations (right-hand side 0)")
    else:
        precond = preconditioner_of(samples)
        D, iters = _cg(samples, ridge, rhs, np.zeros((r, m1)), precond, tol, max_iter)
        nu = 0.0
        if ridge == 0.0:
            notes.append("ridge 0: the minimiser need not be unique; CG from the centre")
        if radius is not None and float(np.linalg.norm(D)) > radius:
            D, nu, extra = _ball_multiplier(samples, ridge, rhs, D, precond, radius, tol, max_iter,
                                            max_multiplier_steps)
            iters += extra
    shift = ridge + nu
    residual = _relative_residual(samples, shift, rhs, D) if np.any(rhs) else 0.0
    norm = float(np.linalg.norm(D))
    feas = comp = 0.0
    if radius is not None:
        feas = max(0.0, norm - radius) / radius
        comp = nu * abs(radius - norm) / (radius * shift) if nu > 0 else 0.0
    E = C + D
    fit = samples.error(E)
    return OutputSpaceSolution(E=E, objective=fit + ridge * norm ** 2, fit=fit, ridge=float(ridge),
                               radius=None if radius is None else float(radius), multiplier=float(nu),
                               residual=float(residual), feasibility=float(feas), complementarity=float(comp),
                               iterations=int(iters), cert_tol=float(cert_tol), notes=tuple(notes))


def _ball_multiplier(samples: OutputSpaceSamples, ridge: float, rhs: np.ndarray, D: np.ndarray,
                     precond: KroneckerPreconditioner, radius: float, tol: float, max_iter: int,
                     max_steps: int) -> tuple[np.ndarray, float, int]:
    """``nu > 0`` with ``||D(nu)|| = radius`` (``D(nu)`` solves ``(N + (mu + nu) I) D = rhs``;
    its norm falls as ``nu`` grows): bracket by growing ``nu`` tenfold, then regula falsi
    (Illinois variant) on ``phi(nu) = 1/||D(nu)|| - 1/R``, nearly linear in ``nu``."""
    iters = 0
    lo, phi_lo = 0.0, 1.0 / float(np.linalg.norm(D)) - 1.0 / radius  # < 0: the ball is active
    hi, phi_hi = None, 0.0
    nu = max(ridge, float(np.mean(precond.diagonal))) * 1e-3
    side, solved = 0, nu
    for _ in range(max_steps):
        D, it = _cg(samples, ridge + nu, rhs, D, precond, tol, max_iter)
        iters, solved = iters + it, nu
        norm = float(np.linalg.norm(D))
        if abs(norm - radius) <= 1e-10 * radius:
            break
        phi = 1.0 / norm - 1.0 / radius
        if phi < 0:
            lo, phi_lo = nu, phi
            if side == -1 and hi is not None:
                phi_hi /= 2.0
            side = -1
        else:
            hi, phi_hi = nu, phi
            if side == 1:
                phi_lo /= 2.0
            side = 1
        if hi is None:
            nu *= 10.0
            continue
        nu = lo - phi_lo * (hi - lo) / (phi_hi - phi_lo)
    return D, solved, iters


def samples_from_stats(stats: Any, task_weights: Any = None) -> OutputSpaceSamples:
    """The per-sample linearisation kept by :func:`~mergeqp.stats.collect_statistics`
    (``keep_samples=True``) as :class:`OutputSpaceSamples`: targets ``t_s = -b_s = y_s - h_s``
    (the fine-tune's compared output minus the output at the linearisation point, as the QP's
    ``g`` uses), sample weights the task weights (``stats.task_weight_vector``: ``None`` -> 1)."""
    if getattr(stats, "samples", None) is None:
        raise ValidationError("the output-space merge needs per-sample statistics: collect them with "
                              "keep_samples=True")
    w = stats.task_weight_vector(task_weights)
    chunks = list(stats.samples)
    if not chunks:
        raise ValidationError("the statistics hold no calibration sample")
    return OutputSpaceSamples(
        layer_input=np.concatenate([ch.layer_input for ch in chunks]),
        jacobian=np.concatenate([ch.jacobian for ch in chunks]),
        target=-np.concatenate([ch.residual for ch in chunks]),
        weight=np.concatenate([np.full(ch.size, float(w[ch.task])) for ch in chunks]))


# ---------------------------------------------------------------------------- the merge method
class OutputSpaceParams(MethodParams):
    """Parameters of the ``output_space`` merge method (module docstring)."""

    model: Any = None
    calibration: Any = None
    reference: Literal["regmean", "soup"] = "regmean"
    ridge: float = Field(0.1, ge=0.0)
    radius: float | None = Field(None, gt=0.0)
    alpha: float = Field(0.9, ge=0.0, le=1.0)
    task_weights: float | tuple[float, ...] | None = None

    @model_validator(mode="after")
    def _needs_model(self) -> OutputSpaceParams:
        if self.model is None or self.calibration is None:
            raise ValueError("output_space needs model= (the architecture) and calibration= (one list of batches "
                             "per fine-tuned model)")
        return self


def _reference_tensors(inputs: Any, names: Sequence[str], params: OutputSpaceParams, model: Any,
                       calibration: Any) -> dict[str, Any]:
    import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

    if params.reference == "regmean":
        return REGMEAN.run(inputs, names, RegMeanParams(model=model, calibration=calibration, alpha=params.alpha,
                                                        progress=False))
    return {n: sum(t.to(torch.float64) for t in inputs.finetuned_tensors(n)) / inputs.K for n in names}


def _loaded(model: Any, tensors: Any, device: Any) -> Any:
    """A deep copy of ``model`` holding ``tensors`` (``name -> tensor`` or a TensorSource)."""
    out = copy.deepcopy(model)
    out.load_state_dict(model_weights(model, tensors, device), strict=False)
    return out


class _Merged:
    """The tensors of the linearisation model: the reference's for selected names, what the
    output will hold for the others (a TensorSource-like ``names`` / ``get`` / ``label``)."""

    def __init__(self, inputs: Any, reference: dict[str, Any], unselected: str):
        self.inputs, self.reference, self.unselected = inputs, reference, unselected
        self.names = tuple(inputs.names)
        self.label = "the reference merge"

    def get(self, name: str) -> Any:
        if name in self.reference:
            return self.reference[name]
        if self.unselected == "base" and self.inputs.base is not None:
            return self.inputs.base.get(name)
        if self.unselected == "average" and name in set(self.inputs.float_names):
            tensors = self.inputs.finetuned_tensors(name)
            return sum(t.double() for t in tensors) / len(tensors)
        return self.inputs.reference.get(name)


def _run(inputs: Any, names: Sequence[str], params: OutputSpaceParams) -> dict[str, Any]:
    import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

    model = check_model(params.model, "output_space")
    calibration = check_calibration(params.calibration, inputs.K, "output_space")
    selected = set(names)
    sites = [s for s in model_sites(model) if s.weight_key in selected]
    conv = [s.name for s in sites if s.kind != "linear"]
    if conv:
        raise ConfigError(f"merge method 'output_space' solves nn.Linear layers; {conv[0]!r} is a "
                          f"{sites[0].kind} layer: exclude it (exclude=[{conv[0] + '.*'!r}]) or use regmean for it")
    if not sites:
        raise ValidationError(f"output_space: no selected nn.Linear layer in the {type(model).__name__} model "
                              f"(every selected tensor would just be the reference)")
    reference = _reference_tensors(inputs, names, params, model, calibration)
    unselected = params.unselected or ("base" if inputs.base is not None else "average")
    device = model_device(model)
    ref_model = _loaded(model, _Merged(inputs, reference, unselected), device)
    fts = [_loaded(model, src, device) for src in inputs.finetuned]
    out = dict(reference)
    for site in iterate(sites, params, "output_space"):
        stats = collect_statistics(ref_model, fts, site.name, list(calibration), targets="finetuned",
                                   parametrisations=(), keep_samples=True, progress=False,
                                   model_names=[src.label for src in inputs.finetuned])
        samples = samples_from_stats(stats, resolve_weights(params.task_weights, inputs.K, 1.0))
        sol = output_space_solve(samples, ridge=params.ridge * samples.ridge_scale(), radius=params.radius)
        if not sol.certified():
            warnings.warn(f"output_space: layer {site.name!r} not certified (normal-equation residual "
                          f"{sol.residual:.2g}, feasibility {sol.feasibility:.2g})", RuntimeWarning, stacklevel=2)
        W = torch.from_numpy(stats.base_weight + sol.E)
        m = W.shape[1] - (1 if stats.has_bias else 0)
        out[site.weight_key] = W[:, :m]
        if stats.has_bias and site.bias_key in selected:
            out[site.bias_key] = W[:, m]
    return out


OUTPUT_SPACE = MergeMethod(
    name="output_space",
    summary=("per linear layer, the free weight matrix minimising the linearised downstream output error "
             "(RegMean generalised to the compared outputs), ridge toward RegMean or the soup"),
    reference="mergeqp (issue 16); generalises Jin et al., ICLR 2023 (arXiv:2212.09849) to the paper's objective",
    params=OutputSpaceParams,
    run=_run,
    needs_base=False,
    tensorwise=False,
)
