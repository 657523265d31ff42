"""Parametrisations of the merged update: which weight-space directions (atoms) the QP weights.

Notation (DESIGN.md): the merge layer has weight ``W`` of shape ``(r, m)``; with a bias the
layer input gets a constant 1 appended, so all weights here are *augmented*, ``(r, m1)`` with
``m1 = m + 1`` (last column = bias). ``deltas`` is ``(K, r, m1)``: ``delta_k = W_k - W_base``.

A parametrisation is a set of atoms ``B_(k, a)`` (each ``(r, m1)``), laid out ``(K, n_atoms)``
like the QP decision ``d``; the merged weight is ``W_base + sum_(k,a) d[k, a] B_(k, a)``:

- ``scalar``: ``B_k = delta_k`` (``n_atoms = 1``; task arithmetic with one lambda per model);
- ``rows`` (the paper's diagonal mask): ``B_(k,i) = e_i e_i' delta_k`` (``n_atoms = r``);
- ``columns`` (input-feature masks): ``B_(k,i) = delta_k e_i e_i'`` (``n_atoms = m1``; the last
  atom is the bias column when the layer has a bias);
- ``basis(Q)`` for an orthonormal ``Q`` (``(r, p)``): ``B_(k,q) = q q' delta_k`` (``n_atoms = p``).
  ``rows`` is ``basis(I)`` (with a faster design).

Each parametrisation builds, for a batch of samples, the design tensor ``A`` with
``A[b, :, k, a] = L_b vec(B_(k,a) z_b)``: the first-order change of the compared output of
sample ``b`` per unit of ``d[k, a]`` (shape ``(B, c, K, n_atoms)``), from the per-sample
downstream Jacobian ``L`` (``(B, c, T, r)``), the residual activations
``R[b, k, t] = delta_k z_(b,t)`` (``(B, K, T, r)``), the augmented layer inputs ``Z``
(``(B, T, m1)``) and the deltas. ``T`` is the number of positions (1 for a plain vector input).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from ..errors import ValidationError, unknown

ORTHONORMAL_TOL = 1e-8


@dataclass(frozen=True, eq=False)
class Basis:
    """An orthonormal basis ``Q`` (``(r, p)``, float64, ``Q'Q = I``) of the layer's output space.

    ``name`` says where it came from (``standard``, ``svd``, ``random``, ``optimal`` or
    ``user``); ``info`` records how it was built (e.g. which Jacobian the optimal basis used).
    """

    Q: np.ndarray
    name: str = "user"
    info: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        Q = np.array(self.Q, dtype=np.float64, copy=True)
        if Q.ndim == 1:
            Q = Q[:, None]
        if Q.ndim != 2 or Q.shape[1] < 1 or Q.shape[0] < Q.shape[1]:
            raise ValidationError(
                f"basis Q must be a matrix of shape (r, p) with 1 <= p <= r, got shape {Q.shape}"
            )
        if not np.all(np.isfinite(Q)):
            raise ValidationError("basis Q contains NaN or inf")
        dev = float(np.max(np.abs(Q.T @ Q - np.eye(Q.shape[1]))))
        if dev > ORTHONORMAL_TOL:
            raise ValidationError(
                f"basis Q (shape {Q.shape}) is not orthonormal: max |Q'Q - I| = {dev:.3g} "
                f"exceeds {ORTHONORMAL_TOL:g}; orthonormalise it first (Basis.orthonormalised)"
            )
        Q.setflags(write=False)
        object.__setattr__(self, "Q", Q)
        object.__setattr__(self, "info", MappingProxyType(dict(self.info)))

    @classmethod
    def orthonormalised(cls, X: np.ndarray, name: str = "user", **info: Any) -> Basis:
        """The basis of ``span(X)`` from a thin QR of ``X`` (``(r, p)``, full column rank)."""
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2:
            raise ValidationError(f"X must be (r, p), got shape {X.shape}")
        Q, R = np.linalg.qr(X)
        diag = np.abs(np.diag(R))
        if diag.size and diag.min() <= 1e-12 * max(diag.max(), np.finfo(float).tiny):
            raise ValidationError("X is rank deficient: its columns do not span p dimensions")
        return cls(Q=Q * np.sign(np.where(np.diag(R) == 0, 1.0, np.diag(R))), name=name, info=info)

    @property
    def r(self) -> int:
        return int(self.Q.shape[0])

    @property
    def p(self) -> int:
        return int(self.Q.shape[1])

    @property
    def key(self) -> str:
        """A content hash identifying ``Q`` (used to find statistics collected for it)."""
        digest = hashlib.sha1(np.ascontiguousarray(self.Q).tobytes()).hexdigest()[:16]
        return f"basis:{self.r}x{self.p}:{digest}"


class Parametrisation(ABC):
    """A set of atoms (weight-space directions); see the module docstring for the layout."""

    name: str = ""

    @property
    def key(self) -> str:
        """Identifies the parametrisation among collected statistics."""
        return self.name

    @abstractmethod
    def n_atoms(self, r: int, m1: int) -> int:
        """Number of atoms per model for a layer with ``r`` outputs and ``m1`` augmented inputs."""

    @abstractmethod
    def atom_names(self, r: int, m1: int, has_bias: bool) -> tuple[str, ...]:
        """Names of the atoms (columns of ``d``)."""

    @abstractmethod
    def design(self, L: Any, R: Any, Z: Any, deltas: Any) -> Any:
        """Torch design tensor ``A`` (``(B, c, K, n_atoms)``) from ``L`` (``(B, c, T, r)``),
        ``R`` (``(B, K, T, r)``), ``Z`` (``(B, T, m1)``) and ``deltas`` (``(K, r, m1)``)."""

    @abstractmethod
    def update(self, d: np.ndarray, deltas: np.ndarray) -> np.ndarray:
        """Merged update ``sum_(k,a) d[k,a] B_(k,a)`` (``(r, m1)``) for ``d`` (``(K, n_atoms)``)."""

    @abstractmethod
    def shared_hessian(self, deltas: np.ndarray, gram: np.ndarray, G: np.ndarray) -> np.ndarray:
        """``H`` (``(n, n)``, factor 2 included) when one Jacobian ``L`` serves every sample and
        ``T = 1``: from ``gram = sum_j w_j z_j z_j'`` (``(m1, m1)``) and ``G = L'L`` (``(r, r)``).
        For ``rows`` this is ``2 (R'R) o (1_K 1_K' (x) L'L)`` with ``R'R = D gram D'``."""

    @abstractmethod
    def gradient(self, deltas: np.ndarray, cross: np.ndarray) -> np.ndarray:
        """``g`` (``(n,)``, factor 2 included) from ``cross = sum_(j,t) w_j (L_jt' b_j) z_jt'``
        (``(r, m1)``); exact for per-sample Jacobians and any number of positions."""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name}

    def check(self, r: int, m1: int) -> None:
        """Raise if the parametrisation does not fit a layer of this shape."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ScalarParametrisation(Parametrisation):
    """One coefficient per model: ``B_k = delta_k`` (task arithmetic with learned lambdas)."""

    name = "scalar"

    def n_atoms(self, r: int, m1: int) -> int:
        return 1

    def atom_names(self, r: int, m1: int, has_bias: bool) -> tuple[str, ...]:
        return ("delta",)

    def design(self, L: Any, R: Any, Z: Any, deltas: Any) -> Any:
        import torch

        return torch.einsum("bcti,bkti->bck", L, R).unsqueeze(-1)

    def update(self, d: np.ndarray, deltas: np.ndarray) -> np.ndarray:
        return np.einsum("k,kim->im", d[:, 0], deltas)

    def shared_hessian(self, deltas: np.ndarray, gram: np.ndarray, G: np.ndarray) -> np.ndarray:
        # H[k,l] = 2 sum_j (delta_k z_j)' G (delta_l z_j) = 2 <delta_k gram, G delta_l>
        left = np.einsum("kim,mn->kin", deltas, gram)
        right = np.einsum("ij,ljn->lin", G, deltas)
        return 2.0 * np.einsum("kin,lin->kl", left, right)

    def gradient(self, deltas: np.ndarray, cross: np.ndarray) -> np.ndarray:
        return 2.0 * np.einsum("kim,im->k", deltas, cross)


class RowsParametrisation(Parametrisation):
    """The paper's diagonal mask: ``B_(k,i) = e_i e_i' delta_k`` (one weight per output row)."""

    name = "rows"

    def n_atoms(self, r: int, m1: int) -> int:
        return r

    def atom_names(self, r: int, m1: int, has_bias: bool) -> tuple[str, ...]:
        return tuple(f"row{i}" for i in range(r))

    def design(self, L: Any, R: Any, Z: Any, deltas: Any) -> Any:
        import torch

        return torch.einsum("bcti,bkti->bcki", L, R)

    def update(self, d: np.ndarray, deltas: np.ndarray) -> np.ndarray:
        return np.einsum("ki,kim->im", d, deltas)

    def shared_hessian(self, deltas: np.ndarray, gram: np.ndarray, G: np.ndarray) -> np.ndarray:
        K, r, m1 = deltas.shape
        flat = deltas.reshape(K * r, m1)
        return 2.0 * (flat @ gram @ flat.T) * np.tile(G, (K, K))

    def gradient(self, deltas: np.ndarray, cross: np.ndarray) -> np.ndarray:
        return 2.0 * np.einsum("kim,im->ki", deltas, cross).ravel()


class ColumnsParametrisation(Parametrisation):
    """Input-feature masks: ``B_(k,i) = delta_k e_i e_i'`` (the bias column is the last atom)."""

    name = "columns"

    def n_atoms(self, r: int, m1: int) -> int:
        return m1

    def atom_names(self, r: int, m1: int, has_bias: bool) -> tuple[str, ...]:
        names = [f"col{i}" for i in range(m1)]
        if has_bias:
            names[-1] = "bias"
        return tuple(names)

    def design(self, L: Any, R: Any, Z: Any, deltas: Any) -> Any:
        import torch

        # A[b,c,k,i] = sum_t Z[b,t,i] (L[b,:,t,:] @ delta_k[:, i])[c]; one position at a time
        # keeps the intermediate at (B, c, K, m1).
        A = None
        for t in range(L.shape[2]):
            LD = torch.einsum("bcr,krm->bckm", L[:, :, t, :], deltas)
            term = LD * Z[:, None, None, t, :]
            A = term if A is None else A + term
        return A

    def update(self, d: np.ndarray, deltas: np.ndarray) -> np.ndarray:
        return np.einsum("km,kim->im", d, deltas)

    def shared_hessian(self, deltas: np.ndarray, gram: np.ndarray, G: np.ndarray) -> np.ndarray:
        # H[(k,a),(l,b)] = 2 gram[a,b] * delta_k[:,a]' G delta_l[:,b]
        K, r, m1 = deltas.shape
        cols = deltas.transpose(0, 2, 1).reshape(K * m1, r)
        return 2.0 * (cols @ G @ cols.T) * np.tile(gram, (K, K))

    def gradient(self, deltas: np.ndarray, cross: np.ndarray) -> np.ndarray:
        return 2.0 * np.einsum("kim,im->km", deltas, cross).ravel()


class BasisParametrisation(Parametrisation):
    """General basis: ``B_(k,q) = q q' delta_k`` for the columns ``q`` of an orthonormal ``Q``."""

    name = "basis"

    def __init__(self, basis: Basis):
        if not isinstance(basis, Basis):
            basis = Basis(basis)
        self.basis = basis

    @property
    def key(self) -> str:
        return self.basis.key

    def n_atoms(self, r: int, m1: int) -> int:
        return self.basis.p

    def atom_names(self, r: int, m1: int, has_bias: bool) -> tuple[str, ...]:
        return tuple(f"{self.basis.name}{i}" for i in range(self.basis.p))

    def check(self, r: int, m1: int) -> None:
        if self.basis.r != r:
            raise ValidationError(
                f"basis Q has {self.basis.r} rows but the merge layer has r = {r} outputs"
            )

    def design(self, L: Any, R: Any, Z: Any, deltas: Any) -> Any:
        import torch

        Q = torch.tensor(np.array(self.basis.Q), dtype=L.dtype, device=L.device)
        LQ = torch.einsum("bctr,rp->bctp", L, Q)
        alpha = torch.einsum("bktr,rp->bktp", R, Q)
        return torch.einsum("bctp,bktp->bckp", LQ, alpha)

    def update(self, d: np.ndarray, deltas: np.ndarray) -> np.ndarray:
        Q = self.basis.Q
        # sum_k Q diag(d_k) Q' delta_k
        proj = np.einsum("rp,krm->kpm", Q, deltas)
        return np.einsum("rp,kp,kpm->rm", Q, d, proj)

    def shared_hessian(self, deltas: np.ndarray, gram: np.ndarray, G: np.ndarray) -> np.ndarray:
        Q = self.basis.Q
        K, _, m1 = deltas.shape
        flat = np.einsum("rp,krm->kpm", Q, deltas).reshape(K * Q.shape[1], m1)
        return 2.0 * (flat @ gram @ flat.T) * np.tile(Q.T @ G @ Q, (K, K))

    def gradient(self, deltas: np.ndarray, cross: np.ndarray) -> np.ndarray:
        Q = self.basis.Q
        proj = np.einsum("rp,krm->kpm", Q, deltas)
        return 2.0 * np.einsum("kpm,pm->kp", proj, Q.T @ cross).ravel()

    def to_json(self) -> dict[str, Any]:
        return {"name": "basis", "basis": self.basis.name, "p": self.basis.p, "key": self.key,
                "info": dict(self.basis.info)}

    def __repr__(self) -> str:
        return f"BasisParametrisation({self.basis.name}, r={self.basis.r}, p={self.basis.p})"


PARAMETRISATIONS: dict[str, Parametrisation] = {}


def register_parametrisation(param: Parametrisation) -> None:
    """Add a named parametrisation (explicit registration; names must be unique)."""
    if not param.name or param.name in PARAMETRISATIONS:
        raise ValidationError(f"parametrisation name {param.name!r} is empty or already taken")
    PARAMETRISATIONS[param.name] = param


register_parametrisation(ScalarParametrisation())
register_parametrisation(RowsParametrisation())
register_parametrisation(ColumnsParametrisation())


def as_parametrisation(spec: Any) -> Parametrisation:
    """Resolve ``"rows" | "scalar" | "columns"``, a :class:`Basis`, an orthonormal ``(r, p)``
    array or a :class:`Parametrisation` instance. Basis *names* (``"optimal:8"``) need the
    statistics: use :meth:`CalibrationStats.parametrisation` for those."""
    if isinstance(spec, Parametrisation):
        return spec
    if isinstance(spec, Basis):
        return BasisParametrisation(spec)
    if isinstance(spec, np.ndarray) or (hasattr(spec, "shape") and hasattr(spec, "dtype")):
        return BasisParametrisation(Basis(np.asarray(spec)))
    if isinstance(spec, str):
        if spec in PARAMETRISATIONS:
            return PARAMETRISATIONS[spec]
        if ":" in spec:
            raise ValidationError(
                f"the basis spec {spec!r} needs calibration statistics: build it with "
                f"stats.parametrisation({spec!r}) or make_basis(...) and pass the Basis"
            )
        raise unknown("parametrisation", spec, [*PARAMETRISATIONS, "<basis>:<p>"])
    raise ValidationError(
        f"parametrisation must be a name ({', '.join(PARAMETRISATIONS)}), a Basis or an "
        f"orthonormal (r, p) array, got {type(spec).__name__}"
    )


def check_d(d: Any, K: int, n_atoms: int, param: Parametrisation) -> np.ndarray:
    """Validate a decision ``d`` (``(K, n_atoms)`` or flat) and return it as ``(K, n_atoms)``."""
    d = np.asarray(d, dtype=np.float64)
    if d.shape == (K * n_atoms,):
        d = d.reshape(K, n_atoms)
    if d.shape != (K, n_atoms):
        raise ValidationError(
            f"d must have shape ({K}, {n_atoms}) (models x atoms of the {param.name} "
            f"parametrisation) or ({K * n_atoms},), got {d.shape}"
        )
    if not np.all(np.isfinite(d)):
        raise ValidationError("d contains NaN or inf")
    return d
