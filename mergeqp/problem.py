"""The canonical merge problem ``min_d 1/2 d'Hd + g'd + c`` (the paper's (QP)).

Layout: the decision ``d`` is a ``(K, n_atoms)`` array (models x atoms). Flattened, it is
row-major (C order): ``d.ravel()[k * n_atoms + a] = d[k, a]``, which is the paper's stacking
``d = [d^(1); ...; d^(K)]``. ``H`` is ``(n, n)`` with ``n = K * n_atoms`` in that same order.

Units: ``J(d)`` is a sum of squared output errors over the calibration set (the units of the
model output squared, times the sample weights); ``c = J(0)`` is the base model's error.

``H`` may be given explicitly (validated: finite, symmetric within tolerance, PSD within
tolerance) or only as a matrix-vector product callback (``hessian_matvec``) for instances too
large to store; then only the solvers and certificate quantities that need products work.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from .errors import NotConvexError, ValidationError

Matvec = Callable[[np.ndarray], np.ndarray]


def _as_names(names: Sequence[str] | None, count: int, prefix: str, field_name: str) -> tuple[str, ...]:
    if names is None:
        return tuple(f"{prefix}{i}" for i in range(count))
    names = tuple(str(x) for x in names)
    if len(names) != count:
        raise ValidationError(f"{field_name}: expected {count} names, got {len(names)}")
    if len(set(names)) != len(names):
        raise ValidationError(f"{field_name}: names must be unique")
    return names


def check_finite(name: str, array: np.ndarray) -> None:
    """Raise :class:`ValidationError` naming ``name`` and the first bad index if not finite."""
    if not np.all(np.isfinite(array)):
        bad = np.argwhere(~np.isfinite(array))
        first = tuple(int(i) for i in bad[0]) if bad.size else ()
        raise ValidationError(
            f"{name} contains {len(bad)} non-finite value(s) (NaN or inf), first at index {first}"
        )


@dataclass(frozen=True, eq=False)
class MergeQP:
    """A convex merge QP ``J(d) = 1/2 d'Hd + g'd + c`` over ``d`` of shape ``(K, n_atoms)``.

    Parameters
    ----------
    H:
        ``(n, n)`` symmetric PSD Hessian, or ``None`` when ``hessian_matvec`` is given.
        Stored as float64; symmetrised when asymmetric within ``sym_tol`` (relative to its
        largest entry), an error otherwise.
    g:
        ``(n,)`` linear term (``n = K * n_atoms``).
    c:
        constant: the objective at ``d = 0`` (the base model's calibration error).
    shape:
        ``(K, n_atoms)``; defaults to ``(1, n)``.
    model_names, atom_names:
        labels for the rows / columns of ``d`` (default ``model0..``, ``atom0..``).
    hessian_matvec:
        optional callback ``x (n,) -> H x (n,)``; used instead of ``H`` when ``H`` is None.
    psd_tol:
        smallest eigenvalue below ``-psd_tol * largest`` is an error (:class:`NotConvexError`).
        The eigenvalue check costs one ``eigvalsh`` (skipped above ``psd_check_max_n``, where
        a Lanczos estimate of the smallest eigenvalue is used instead).
    metadata:
        free-form JSON-serialisable information (layer, parametrisation, ...).
    """

    H: np.ndarray | None
    g: np.ndarray
    c: float = 0.0
    shape: tuple[int, int] | None = None
    model_names: tuple[str, ...] | None = None
    atom_names: tuple[str, ...] | None = None
    hessian_matvec: Matvec | None = field(default=None, repr=False)
    psd_tol: float = 1e-8
    sym_tol: float = 1e-8
    psd_check_max_n: int = 8192
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        g = np.asarray(self.g, dtype=np.float64)
        if g.ndim == 2 and self.shape is not None and g.shape == tuple(self.shape):
            g = g.ravel()
        if g.ndim != 1:
            raise ValidationError(f"g must be a vector of length n, got shape {g.shape}")
        n = g.shape[0]
        if n == 0:
            raise ValidationError("g is empty: the problem has no variables")
        check_finite("g", g)

        try:
            c = float(self.c)
        except (TypeError, ValueError):
            raise ValidationError(f"c must be a scalar, got {type(self.c).__name__}") from None
        if not math.isfinite(c):
            raise ValidationError(f"c is not finite ({c})")

        shape = (1, n) if self.shape is None else tuple(int(s) for s in self.shape)
        if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
            raise ValidationError(f"shape must be (K, n_atoms) with positive entries, got {shape}")
        if shape[0] * shape[1] != n:
            raise ValidationError(
                f"shape {shape} has {shape[0] * shape[1]} entries but g has length {n}"
            )

        H = self.H
        if H is None:
            if self.hessian_matvec is None:
                raise ValidationError("give H (n x n) or hessian_matvec")
        else:
            H = np.array(H, dtype=np.float64, copy=True)
            if H.shape != (n, n):
                raise ValidationError(f"H must have shape ({n}, {n}) to match g, got {H.shape}")
            check_finite("H", H)
            scale = float(np.max(np.abs(H))) if H.size else 0.0
            asym = float(np.max(np.abs(H - H.T))) if H.size else 0.0
            if asym > self.sym_tol * max(scale, np.finfo(float).tiny):
                i, j = np.unravel_index(int(np.argmax(np.abs(H - H.T))), H.shape)
                raise ValidationError(
                    f"H is not symmetric: |H[{i},{j}] - H[{j},{i}]| = {asym:.3g} exceeds "
                    f"sym_tol * max|H| = {self.sym_tol * scale:.3g}"
                )
            H = 0.5 * (H + H.T)
            H.setflags(write=False)

        model_names = _as_names(self.model_names, shape[0], "model", "model_names")
        atom_names = _as_names(self.atom_names, shape[1], "atom", "atom_names")

        g.setflags(write=False)
        object.__setattr__(self, "H", H)
        object.__setattr__(self, "g", g)
        object.__setattr__(self, "c", c)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "model_names", model_names)
        object.__setattr__(self, "atom_names", atom_names)
        object.__setattr__(self, "metadata", MappingProxyType(dict(self.metadata)))
        if H is not None:
            self._check_psd()

    # ------------------------------------------------------------------ basic facts
    @property
    def n(self) -> int:
        """Number of variables ``K * n_atoms``."""
        return int(self.g.shape[0])

    @property
    def K(self) -> int:
        return int(self.shape[0])

    @property
    def n_atoms(self) -> int:
        return int(self.shape[1])

    @property
    def has_explicit_hessian(self) -> bool:
        return self.H is not None

    def _check_psd(self) -> None:
        """Raise :class:`NotConvexError` if ``lambda_min(H) < -psd_tol * lambda_max(H)``.

        Up to ``psd_check_max_n`` variables: a Cholesky factorisation of
        ``H + psd_tol * max(diag H) * I`` (one LAPACK ``potrf``; ``max diag <= lambda_max``, so
        success proves the condition); only when it fails are the eigenvalues computed to
        report the smallest one. Above that size: a Lanczos estimate (ARPACK).
        """
        import scipy.linalg as sla

        H = self.H
        assert H is not None
        n = H.shape[0]
        top = float(np.max(np.diag(H))) if n else 0.0
        if n <= self.psd_check_max_n:
            shift = self.psd_tol * max(top, np.finfo(float).tiny)
            try:
                sla.cholesky(H + shift * np.eye(n), lower=True, check_finite=False)
                return
            except np.linalg.LinAlgError:
                eig = np.linalg.eigvalsh(H)
                lo, hi = float(eig[0]), float(eig[-1])
        else:
            from scipy.sparse.linalg import ArpackNoConvergence, eigsh

            try:
                hi = float(eigsh(H, k=1, which="LA", return_eigenvectors=False, tol=1e-6)[0])
                lo = float(eigsh(H, k=1, which="SA", return_eigenvectors=False, tol=1e-4,
                                 maxiter=20 * n)[0])
            except ArpackNoConvergence:
                return
        if lo < -self.psd_tol * max(abs(hi), np.finfo(float).tiny):
            raise NotConvexError(
                f"H is not positive semidefinite: smallest eigenvalue {lo:.6g} is below "
                f"-psd_tol * largest ({-self.psd_tol * abs(hi):.3g}); the merge QP must be convex"
            )

    # ------------------------------------------------------------------ algebra
    def flat(self, d: np.ndarray) -> np.ndarray:
        """Validate ``d`` (``(K, n_atoms)`` or ``(n,)``) and return it flattened, float64."""
        d = np.asarray(d, dtype=np.float64)
        if d.shape == self.shape:
            d = d.reshape(-1)
        elif d.shape != (self.n,):
            raise ValidationError(
                f"d must have shape {self.shape} (models x atoms) or ({self.n},), got {d.shape}"
            )
        check_finite("d", d)
        return d

    def unflat(self, x: np.ndarray) -> np.ndarray:
        """Reshape a flat ``(n,)`` vector to ``(K, n_atoms)``."""
        return np.asarray(x, dtype=np.float64).reshape(self.shape)

    def matvec(self, x: np.ndarray) -> np.ndarray:
        """``H @ x`` for flat ``x`` (``(n,)`` or ``(n, m)``)."""
        if self.H is not None:
            return self.H @ x
        assert self.hessian_matvec is not None
        if x.ndim == 2:
            return np.stack([np.asarray(self.hessian_matvec(x[:, i])) for i in range(x.shape[1])], 1)
        return np.asarray(self.hessian_matvec(x), dtype=np.float64)

    def objective(self, d: np.ndarray) -> float:
        """``J(d) = 1/2 d'Hd + g'd + c`` (float64)."""
        x = self.flat(d)
        return float(0.5 * x @ self.matvec(x) + self.g @ x + self.c)

    def gradient(self, d: np.ndarray) -> np.ndarray:
        """``grad J(d) = H d + g``, returned with the same layout as ``d`` was given."""
        d_arr = np.asarray(d)
        x = self.flat(d)
        grad = self.matvec(x) + self.g
        return grad.reshape(self.shape) if d_arr.shape == self.shape else grad

    def soup_point(self) -> np.ndarray:
        """The model-soup point ``d = 1/K`` everywhere, shape ``(K, n_atoms)``."""
        return np.full(self.shape, 1.0 / self.K)

    def constant_point(self, value: float) -> np.ndarray:
        """``d = value`` everywhere (task arithmetic with lambda = value), ``(K, n_atoms)``."""
        return np.full(self.shape, float(value))

    def regularised(self, mu: float, reference: np.ndarray | float | None = None) -> MergeQP:
        """Return the problem ``J(d) + mu * ||d - d_ref||^2``.

        ``reference`` defaults to the soup ``1/K``; a scalar broadcasts. ``mu >= 0``.
        """
        mu = float(mu)
        if not math.isfinite(mu) or mu < 0:
            raise ValidationError(f"regularisation weight mu must be finite and >= 0, got {mu}")
        if reference is None:
            ref = self.soup_point().ravel()
        else:
            ref = np.broadcast_to(np.asarray(reference, dtype=np.float64), self.shape).ravel()
            check_finite("reference", ref)
        g = self.g - 2.0 * mu * ref
        c = self.c + mu * float(ref @ ref)
        meta = dict(self.metadata)
        meta["regularisation"] = {"mu": mu, "reference": "soup" if reference is None else "given"}
        if self.H is not None:
            H = self.H + 2.0 * mu * np.eye(self.n)
            matvec = None
        else:
            base = self.hessian_matvec
            assert base is not None
            H = None

            def matvec(x: np.ndarray, _base: Matvec = base, _mu: float = mu) -> np.ndarray:
                return np.asarray(_base(x)) + 2.0 * _mu * x

        return MergeQP(
            H=H, g=g, c=c, shape=self.shape, model_names=self.model_names,
            atom_names=self.atom_names, hessian_matvec=matvec, psd_tol=self.psd_tol,
            sym_tol=self.sym_tol, psd_check_max_n=self.psd_check_max_n, metadata=meta,
        )

    def diagonal(self) -> np.ndarray:
        """The diagonal of ``H`` (``(n,)``); with a matvec-only H, computed by n products."""
        if self.H is not None:
            return np.diag(self.H).copy()
        eye = np.eye(self.n)
        return np.array([self.matvec(eye[i])[i] for i in range(self.n)])

    # ------------------------------------------------------------------ io
    def save_npz(self, path: str) -> None:
        """Write ``H, g, c, shape`` (+ names) to an ``.npz`` file readable by ``mergeqp solve``."""
        if self.H is None:
            raise ValidationError("cannot save a problem whose H is only a matvec callback")
        import json

        np.savez(
            path, H=self.H, g=self.g, c=np.float64(self.c), shape=np.array(self.shape),
            model_names=np.array(self.model_names), atom_names=np.array(self.atom_names),
            metadata=np.array(json.dumps(dict(self.metadata), default=str)),
        )

    @classmethod
    def load_npz(cls, path: str) -> MergeQP:
        """Read a problem written by :meth:`save_npz` (or any npz with ``H``, ``g``[, ``c``, ``shape``])."""
        import json
        import os

        if not os.path.exists(path):
            raise ValidationError(f"problem file not found: {path}")
        try:
            data = np.load(path, allow_pickle=False)
        except Exception as exc:  # noqa: BLE001 - report any unreadable file the same way
            raise ValidationError(f"cannot read problem file {path}: {exc}") from None
        missing = [k for k in ("H", "g") if k not in data.files]
        if missing:
            raise ValidationError(
                f"{path} lacks array(s) {missing}; a problem npz holds H (n x n), g (n), "
                f"optional c (scalar) and shape (K, n_atoms)"
            )
        shape = tuple(int(s) for s in data["shape"]) if "shape" in data.files else None
        kwargs: dict[str, Any] = {}
        if "model_names" in data.files:
            kwargs["model_names"] = tuple(str(s) for s in data["model_names"])
        if "atom_names" in data.files:
            kwargs["atom_names"] = tuple(str(s) for s in data["atom_names"])
        if "metadata" in data.files:
            try:
                kwargs["metadata"] = json.loads(str(data["metadata"]))
            except json.JSONDecodeError:
                pass
        c = float(data["c"]) if "c" in data.files else 0.0
        return cls(H=data["H"], g=data["g"], c=c, shape=shape, **kwargs)
