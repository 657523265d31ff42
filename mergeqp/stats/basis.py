"""An orthonormal basis ``Q`` (``(r, p)``) of a merge layer's output space (the atoms of the
``basis`` parametrisation, built by the registry in :mod:`.bases`)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from ..errors import ValidationError

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
