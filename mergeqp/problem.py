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

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

import numpy as np
import scipy.linalg as sla
from scipy.sparse.linalg import ArpackNoConvergence, LinearOperator, eigsh

from .errors import BadDataError, NotConvexError, ValidationError
from .io.atomic import save_npz_atomic
from .jsonutil import to_jsonable

Matvec = Callable[[np.ndarray], np.ndarray]


def as_names(names: Sequence[str] | None, count: int, prefix: str, field_name: str) -> tuple[str, ...]:
    """``count`` unique names (``prefix0``, ``prefix1``, ... when ``names`` is ``None``), or a
    :class:`ValidationError` naming ``field_name``."""
    if names is None:
        return tuple(f"{prefix}{i}" for i in range(count))
    names = tuple(str(x) for x in names)
    if len(names) != count:
        raise ValidationError(f"{field_name}: expected {count} names, got {len(names)}")
    if len(set(names)) != len(names):
        raise ValidationError(f"{field_name}: names must be unique, got {list(names)}")
    return names


def as_float_array(value: Any, name: str) -> np.ndarray:
    """``value`` (array-like, torch tensor, scipy sparse matrix) as a float64 ndarray, or a
    :class:`ValidationError` naming ``name``."""
    if hasattr(value, "detach"):  # torch (bfloat16 and other types numpy lacks: via float64)
        value = value.detach().cpu()
        if value.is_complex():
            raise ValidationError(f"{name} must be real, got a complex tensor")
        value = value.double().numpy() if value.is_floating_point() else value.numpy()
    if hasattr(value, "toarray") and hasattr(value, "nnz"):  # scipy.sparse
        value = value.toarray()
    if isinstance(value, (str, bytes)):
        raise ValidationError(f"{name} must be an array of real numbers, got a string {value!r}")
    if value is None:  # (numpy reads None as NaN)
        raise ValidationError(f"{name} must be a number or an array of real numbers, got None")
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"{name} must be an array of real numbers ({exc})") from None
    if arr.dtype.kind == "c":
        raise ValidationError(f"{name} must be real, got complex values")
    if arr.dtype.kind in "SUb" or (arr.dtype.kind == "O" and any(isinstance(v, (str, bytes, bool)) for v in arr.ravel())):
        raise ValidationError(f"{name} must be an array of real numbers, got dtype {arr.dtype}")
    try:
        return np.asarray(arr, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"{name} must be an array of real numbers ({exc})") from None


def check_finite(name: str, array: np.ndarray) -> None:
    """Raise :class:`BadDataError` (a :class:`ValidationError`) naming ``name`` and the first
    bad index if not finite."""
    if not np.all(np.isfinite(array)):
        bad = np.argwhere(~np.isfinite(array))
        first = tuple(int(i) for i in bad[0]) if bad.size else ()
        raise BadDataError(
            f"{name} contains {len(bad)} non-finite value(s) (NaN or inf), first at index {first}"
        )


_TILE = 512


def _max_asymmetry(H: np.ndarray) -> tuple[float, tuple[int, int]]:
    """``max |H - H'|`` and where, tile by tile (no ``n x n`` temporaries; cache-friendly)."""
    n = H.shape[0]
    worst, where = 0.0, (0, 0)
    for a in range(0, n, _TILE):
        for b in range(a, n, _TILE):
            d = np.abs(H[a:a + _TILE, b:b + _TILE] - H[b:b + _TILE, a:a + _TILE].T)
            m = float(d.max()) if d.size else 0.0
            if m > worst:
                k = np.unravel_index(int(np.argmax(d)), d.shape)
                worst, where = m, (a + int(k[0]), b + int(k[1]))
    return worst, where


def _symmetrise_in_place(H: np.ndarray) -> None:
    """``H <- (H + H')/2`` tile by tile."""
    n = H.shape[0]
    for a in range(0, n, _TILE):
        for b in range(a, n, _TILE):
            avg = 0.5 * (H[a:a + _TILE, b:b + _TILE] + H[b:b + _TILE, a:a + _TILE].T)
            H[a:a + _TILE, b:b + _TILE] = avg
            H[b:b + _TILE, a:a + _TILE] = avg.T


#: ``H + PSD_ROUNDING * n * eps * max(diag H) * I`` factorising by Cholesky shows H PSD to float64
#: rounding (a singular PSD H, e.g. dead units or duplicated models, passes)
PSD_ROUNDING = 100.0


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
    soup:
        the model soup's coefficients ``d`` (``(K, n_atoms)`` or ``(n,)``) when they are not ``1/K``
        everywhere: a parametrisation with atoms other than the task vectors (``rows+baselines``:
        rows ``1/K``, baseline atoms 0). ``None`` (the default): ``1/K`` everywhere. :meth:`soup_point` returns it and :meth:`regularised`
        regularises toward it by default; ``CalibrationStats.problem`` sets it.
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
    soup: np.ndarray | None = field(default=None, repr=False)
    #: a lower bound on ``lambda_min(H)`` when it is negative beyond float64 rounding (H accepted as
    #: convex within ``psd_tol``); ``0.0`` when H was shown PSD to rounding (or not checked: a
    #: matrix-vector H above :data:`MATVEC_DENSE_CHECK_N` with a non-negative Lanczos estimate). The
    #: certificate charges it (``docs/certificates.md``); set by the validation, not an argument
    curvature_floor: float = field(default=0.0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for tol_name in ("psd_tol", "sym_tol"):
            tol = getattr(self, tol_name)
            if not (isinstance(tol, (int, float)) and math.isfinite(tol) and tol >= 0):
                raise ValidationError(f"{tol_name} must be a finite number >= 0, got {tol!r}")
        shape_in = _as_shape(self.shape)
        g = np.array(as_float_array(self.g, "g"), copy=True)
        if g.ndim == 2 and shape_in is not None and g.shape == shape_in:
            g = g.ravel()
        if g.ndim != 1:
            raise ValidationError(
                f"g must be a vector of length n = K * n_atoms (or of shape (K, n_atoms) = shape), "
                f"got shape {g.shape}"
            )
        n = g.shape[0]
        if n == 0:
            raise ValidationError("g is empty: the problem has no variables")
        check_finite("g", g)

        c_arr = as_float_array(self.c, "c (a scalar)")
        if c_arr.size != 1:
            raise ValidationError(f"c must be a scalar, got an array of shape {c_arr.shape}")
        c = float(c_arr.reshape(()))
        if not math.isfinite(c):
            raise BadDataError(f"c is not finite ({c})")

        shape = (1, n) if shape_in is None else shape_in
        if shape[0] * shape[1] != n:
            raise ValidationError(
                f"shape {shape} (models x atoms) has {shape[0] * shape[1]} entries but g has length {n}"
            )

        H = self.H
        if H is None:
            if self.hessian_matvec is None:
                raise ValidationError("give H (n x n) or hessian_matvec")
        elif self.hessian_matvec is not None:
            raise ValidationError("give H (n x n) or hessian_matvec, not both: every solver and the certificate "
                                  "would use H and never call hessian_matvec")
        else:
            H = np.array(as_float_array(H, "H"), copy=True)
            if H.shape != (n, n):
                raise ValidationError(f"H must have shape ({n}, {n}) to match g, got {H.shape}")
            check_finite("H", H)
            scale = max(float(H.max()), -float(H.min())) if H.size else 0.0
            asym, (i, j) = _max_asymmetry(H)
            if asym > self.sym_tol * max(scale, np.finfo(float).tiny):
                raise ValidationError(
                    f"H is not symmetric: |H[{i},{j}] - H[{j},{i}]| = {asym:.3g} exceeds "
                    f"sym_tol * max|H| = {self.sym_tol * scale:.3g}"
                )
            if asym > 0:
                _symmetrise_in_place(H)
            H.setflags(write=False)

        model_names = as_names(self.model_names, shape[0], "model", "model_names")
        atom_names = as_names(self.atom_names, shape[1], "atom", "atom_names")

        if not isinstance(self.metadata, Mapping):
            raise ValidationError(f"metadata must be a mapping, got {type(self.metadata).__name__}")
        if H is None and not callable(self.hessian_matvec):
            raise ValidationError("hessian_matvec must be a callable x (n,) -> H x (n,)")

        soup = None
        if self.soup is not None:
            soup = np.array(as_float_array(self.soup, "soup"), copy=True)
            if soup.shape == shape:
                soup = soup.ravel()
            if soup.shape != (n,):
                raise ValidationError(f"soup must have shape {shape} (models x atoms) or ({n},), got {soup.shape}")
            check_finite("soup", soup)
            soup.setflags(write=False)
        g.setflags(write=False)
        object.__setattr__(self, "soup", soup)
        object.__setattr__(self, "H", H)
        object.__setattr__(self, "g", g)
        object.__setattr__(self, "c", c)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "model_names", model_names)
        object.__setattr__(self, "atom_names", atom_names)
        object.__setattr__(self, "metadata", MappingProxyType(dict(self.metadata)))
        if H is not None:
            self._check_psd()
        else:
            self._check_matvec()

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
        """Raise :class:`NotConvexError` if ``lambda_min(H) < -psd_tol * lambda_max(H)``
        (see :func:`check_psd_matrix`)."""
        assert self.H is not None
        object.__setattr__(self, "curvature_floor", check_psd_matrix(self.H, self.psd_tol, self.psd_check_max_n))

    def _check_matvec(self) -> None:
        """Checks of a matrix-vector-only H (the certificate's bounds assume a convex J):
        the callback returns finite ``(n,)`` vectors, is symmetric (``y'Hx = x'Hy`` for random
        probes, within ``sym_tol``) and PSD: exactly (H formed from ``n`` products, then
        :func:`check_psd_matrix`) up to :data:`MATVEC_DENSE_CHECK_N` variables, else a bounded
        Lanczos estimate of the smallest eigenvalue (:func:`_lanczos_extremes`)."""
        n = self.n
        rng = np.random.default_rng(0)
        X = rng.standard_normal((n, 2))
        HX = np.empty_like(X)
        for j in range(2):
            try:
                out = np.asarray(self.hessian_matvec(X[:, j]), dtype=np.float64)  # type: ignore[misc]
            except Exception as exc:  # noqa: BLE001 - user callback
                raise ValidationError(f"hessian_matvec failed on a probe vector: {type(exc).__name__}: {exc}") from exc
            if out.shape != (n,):
                raise ValidationError(f"hessian_matvec must return a vector of shape ({n},), got {out.shape}")
            if not np.all(np.isfinite(out)):
                raise ValidationError("hessian_matvec returned NaN or inf for a finite probe vector")
            HX[:, j] = out
        scale = float(np.linalg.norm(X[:, 0]) * np.linalg.norm(HX[:, 1]) + np.linalg.norm(X[:, 1]) * np.linalg.norm(HX[:, 0]))
        asym = abs(float(X[:, 1] @ HX[:, 0] - X[:, 0] @ HX[:, 1]))
        if asym > max(self.sym_tol, 1e-12) * max(scale, np.finfo(float).tiny):
            raise ValidationError(
                f"hessian_matvec is not symmetric: y'Hx - x'Hy = {asym:.3g} for random x, y "
                f"(relative {asym / max(scale, np.finfo(float).tiny):.2g})"
            )
        if n <= MATVEC_DENSE_CHECK_N:
            H = np.column_stack([self.matvec(e) for e in np.eye(n)])
            object.__setattr__(self, "curvature_floor", check_psd_matrix(
                0.5 * (H + H.T), self.psd_tol, MATVEC_DENSE_CHECK_N, what="hessian_matvec: H"))
            return
        op = LinearOperator((n, n), matvec=lambda v: self.matvec(np.asarray(v, dtype=np.float64).ravel()),
                            dtype=np.float64)
        found = _lanczos_extremes(op, max_iter_top=50)  # each product is a user callback
        if found is None:
            return
        lo, hi, _converged = found
        if lo < -PSD_ROUNDING * n * np.finfo(float).eps * max(abs(hi), np.finfo(float).tiny):
            object.__setattr__(self, "curvature_floor", float(lo))
        if lo < -self.psd_tol * max(abs(hi), np.finfo(float).tiny):
            raise NotConvexError(
                f"hessian_matvec is not positive semidefinite: a Lanczos estimate of its smallest "
                f"eigenvalue is {lo:.6g}, below -psd_tol * largest ({-self.psd_tol * abs(hi):.3g}); "
                f"the merge QP must be convex"
            )

    # ------------------------------------------------------------------ algebra
    def flat(self, d: np.ndarray, name: str = "d") -> np.ndarray:
        """Validate ``d`` (``(K, n_atoms)`` or ``(n,)``) and return it flattened, float64; errors
        call it ``name`` (e.g. ``x0`` for a warm start)."""
        d = as_float_array(d, name)
        if d.shape == self.shape:
            d = d.reshape(-1)
        elif d.shape != (self.n,):
            raise ValidationError(
                f"{name} must have shape {self.shape} (models x atoms) or ({self.n},), got {d.shape}"
            )
        check_finite(name, d)
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
        """The model soup's coefficients, shape ``(K, n_atoms)``: ``d = 1/K`` everywhere unless the
        problem was given its own :attr:`soup` (e.g. ``rows+baselines``: baseline atoms 0)."""
        if self.soup is not None:
            return self.soup.reshape(self.shape).copy()
        return np.full(self.shape, 1.0 / self.K)

    def constant_point(self, value: float) -> np.ndarray:
        """``d = value`` everywhere (task arithmetic with lambda = value), ``(K, n_atoms)``;
        ``value`` one finite number."""
        arr = as_float_array(value, "constant_point's value")
        if arr.size != 1:
            raise ValidationError(f"constant_point takes one number (every coefficient gets it), got an array of "
                                  f"shape {arr.shape}")
        out = float(arr.reshape(()))
        if not math.isfinite(out):
            raise ValidationError(f"constant_point's value must be finite, got {out}")
        return np.full(self.shape, out)

    def regularised(self, mu: float, reference: np.ndarray | float | None = None) -> MergeQP:
        """Return the problem ``J(d) + mu * ||d - d_ref||^2``.

        ``reference`` defaults to the soup (:meth:`soup_point`: ``1/K`` unless the problem has its
        own :attr:`soup`); a scalar broadcasts. ``mu >= 0``.
        """
        mu_arr = as_float_array(mu, "regularisation weight mu")
        if mu_arr.size != 1:
            raise ValidationError(f"regularisation weight mu must be a scalar, got shape {mu_arr.shape}")
        mu = float(mu_arr.reshape(()))
        if not math.isfinite(mu) or mu < 0:
            raise ValidationError(f"regularisation weight mu must be finite and >= 0, got {mu}")
        if reference is None:
            ref = self.soup_point().ravel()
        else:
            ref_arr = as_float_array(reference, "reference")
            try:
                ref = np.broadcast_to(ref_arr, self.shape).ravel()
            except ValueError:
                raise ValidationError(
                    f"reference has shape {ref_arr.shape}, which does not broadcast to d's shape "
                    f"{self.shape} (models x atoms)"
                ) from None
            check_finite("reference", ref)
        g = self.g - 2.0 * mu * ref
        c = self.c + mu * float(ref @ ref)
        meta = dict(self.metadata)
        if reference is None:
            ref_label: Any = "soup"
        elif np.ndim(reference) == 0:
            ref_label = float(np.asarray(reference))
        else:
            ref_label = "array"
        meta["regularisation"] = {"mu": mu, "reference": ref_label}
        if self.H is not None:
            H = np.array(self.H, copy=True)
            H[np.diag_indices_from(H)] += 2.0 * mu
            H.setflags(write=False)
            matvec = None
        else:
            base = self.hessian_matvec
            assert base is not None
            H = None

            def matvec(x: np.ndarray, _base: Matvec = base, _mu: float = mu) -> np.ndarray:
                return np.asarray(_base(x)) + 2.0 * _mu * x

        g.setflags(write=False)
        # H + 2 mu I is symmetric PSD when H is: no need to validate (and factorise) again
        return self._derived(H=H, g=g, c=c, hessian_matvec=matvec, metadata=MappingProxyType(meta),
                             curvature_floor=min(0.0, self.curvature_floor + 2.0 * mu))

    def with_linear_term(self, g: Any, c: float | None = None) -> MergeQP:
        """The problem with ``g`` (``(n,)`` or ``(K, n_atoms)``) and optionally ``c`` replaced,
        holding this problem's very ``H`` array (not a copy), so that a sequence of related
        QPs reuses what was computed from ``H`` (:mod:`mergeqp.matrix_cache`)."""
        g_arr = np.array(as_float_array(g, "g"), copy=True)
        if g_arr.shape == self.shape:
            g_arr = g_arr.ravel()
        if g_arr.shape != (self.n,):
            raise ValidationError(f"g must have shape ({self.n},) or {self.shape} (models x atoms), got {g_arr.shape}")
        check_finite("g", g_arr)
        g_arr.setflags(write=False)
        if c is None:
            return self._derived(g=g_arr)
        c_new = float(as_float_array(c, "c (a scalar)").reshape(()))
        if not math.isfinite(c_new):
            raise BadDataError(f"c is not finite ({c_new})")
        return self._derived(g=g_arr, c=c_new)

    def _derived(self, **changes: Any) -> MergeQP:
        """A copy with already-validated fields replaced (skips ``__post_init__``)."""
        new = object.__new__(MergeQP)
        for f in fields(MergeQP):
            object.__setattr__(new, f.name, changes.get(f.name, getattr(self, f.name)))
        return new

    def diagonal(self) -> np.ndarray:
        """The diagonal of ``H`` (``(n,)``); with a matvec-only H, computed by n products."""
        if self.H is not None:
            return np.diag(self.H).copy()
        eye = np.eye(self.n)
        return np.array([self.matvec(eye[i])[i] for i in range(self.n)])

    # ------------------------------------------------------------------ io
    def save_npz(self, path: str, extra: Mapping[str, Any] | None = None) -> None:
        """Write ``H, g, c, shape`` (+ names, metadata, and ``extra`` arrays such as ``deltas``
        (K, r, m) and ``parametrisation`` for the ``sign`` constraint) to an ``.npz`` file
        readable by ``mergeqp solve``."""
        if self.H is None:
            raise ValidationError("cannot save a problem whose H is only a matvec callback")
        arrays: dict[str, Any] = {
            "H": self.H, "g": self.g, "c": np.float64(self.c), "shape": np.array(self.shape),
            "model_names": np.array(self.model_names), "atom_names": np.array(self.atom_names),
            # (numbers and arrays as JSON numbers and lists; numpy's were their text, stop 74)
            "metadata": np.array(json.dumps(to_jsonable(dict(self.metadata), nonfinite="keep", other="string"))),
        }
        if self.psd_tol != 1e-8:  # a problem accepted with a looser tolerance loads with it again
            arrays["psd_tol"] = np.float64(self.psd_tol)
        if self.soup is not None:
            arrays["soup"] = self.soup
        for key, value in (extra or {}).items():
            if key in arrays:
                raise ValidationError(f"extra array {key!r} would overwrite the problem's own field")
            arrays[key] = np.asarray(value)
        path = os.fspath(path)
        if not path.endswith(".npz"):
            path += ".npz"  # the name numpy.savez has always given the file
        save_npz_atomic(path, arrays)

    @classmethod
    def load_npz(cls, path: str) -> MergeQP:
        """Read a problem written by :meth:`save_npz` (or any npz with ``H``, ``g``[, ``c``, ``shape``])."""
        return load_problem_file(path)[0]


#: a matrix-vector-only H with at most this many variables is checked for convexity exactly
#: (by forming it from ``n`` products); above, by a Lanczos estimate
MATVEC_DENSE_CHECK_N = 512

#: the rounding error of a Frank-Wolfe gap ``grad'(d - s)`` is taken as this multiple of one
#: gradient entry's error (:func:`gradient_rounding`) times ``|d - s|_1``
GAP_ROUNDING_FACTOR = 8.0


def stable_norm(x: Any) -> float:
    """``||x||_2`` without overflow or underflow of the squares (entries near 1e200 or 1e-200): the
    largest magnitude is factored out first."""
    x = np.asarray(x, dtype=np.float64)
    m = float(np.max(np.abs(x), initial=0.0))
    if m == 0.0 or not math.isfinite(m):
        return m
    return m * float(np.linalg.norm(x / m))


def gradient_rounding(n: int, g_inf: float, curvature: float, x_inf: float) -> float:
    """Estimated float64 error of one entry of ``grad J = H x + g`` (units of the gradient):
    ``sqrt(n) eps (|g|_inf + curvature |x|_inf)``, with ``curvature |x|_inf`` a bound on every
    ``|H_ij x_j|`` (:func:`curvature_reach`). The one rounding floor of the certificate and the
    solvers' stopping rules."""
    return math.sqrt(max(n, 1)) * float(np.finfo(float).eps) * (g_inf + curvature * x_inf)


def curvature_reach(sqrt_diag: np.ndarray, x: np.ndarray) -> tuple[float, float]:
    """``(curvature, reach)`` for :func:`gradient_rounding` at ``x``: ``sqrt(max diag H)`` and
    ``max_j sqrt(H_jj) |x_j|`` (``sqrt_diag``: ``sqrt(|diag H|)``), whose product bounds every
    ``|H_ij x_j|`` of a PSD H (``|H_ij| <= sqrt(H_ii H_jj)``). Tighter than ``max diag H |x|_inf``
    where a large coordinate has little curvature (a dead unit, a flat direction): there
    ``x_j`` moves the gradient by little, so it does not raise the floor (a warm start at
    ``x = (0, 1e10)`` of ``H = diag(1, 1e-16)`` was taken as optimal to rounding)."""
    top = float(np.max(sqrt_diag, initial=0.0))
    return top, float(np.max(sqrt_diag * np.abs(x), initial=0.0))


def _lanczos_extremes(A: Any, max_iter_top: int | None = None) -> tuple[float, float, bool] | None:
    """``(lambda_min, lambda_max, converged)`` of a symmetric ``A`` (dense or a
    ``LinearOperator``) by ARPACK, the smallest with bounded effort (``max_iter_top`` bounds the
    largest's too; ``None``: ARPACK's default); on non-convergence the Ritz values found so far
    (``converged`` False), or ``None`` when there are none."""
    try:
        hi = float(eigsh(A, k=1, which="LA", return_eigenvectors=False, tol=1e-6, maxiter=max_iter_top)[0])
        lo = float(eigsh(A, k=1, which="SA", return_eigenvectors=False, tol=1e-4,
                         maxiter=20)[0])  # bounded effort: best-effort check
        return lo, hi, True
    except ArpackNoConvergence as exc:
        found = np.asarray(getattr(exc, "eigenvalues", []), dtype=np.float64)
        if found.size == 0:
            return None
        return float(found.min()), float(found.max()), False


#: up to this size a slightly indefinite H has its smallest eigenvalue computed (the curvature floor);
#: above it the floor is bracketed by shifted Cholesky factorisations to a factor of 10
EIGH_FLOOR_MAX_N = 2048


def _factorises(H: np.ndarray, shift: float) -> bool:
    """Whether ``H + shift I`` has a Cholesky factorisation (is numerically positive definite)."""
    try:
        sla.cholesky(H + shift * np.eye(H.shape[0]), lower=True, check_finite=False)
        return True
    except np.linalg.LinAlgError:
        return False


def check_psd_matrix(H: np.ndarray, psd_tol: float, max_n: int, what: str = "H") -> float:
    """Raise :class:`NotConvexError` if ``lambda_min(H) < -psd_tol * lambda_max(H)``; return the
    curvature floor: ``0.0`` when ``H`` is PSD to float64 rounding, else ``lambda_min(H) < 0`` (H
    accepted within ``psd_tol``, but ``J`` is not convex: the certificate charges it).

    Up to ``max_n`` variables: a Cholesky factorisation of ``H + PSD_ROUNDING n eps max(diag H) I``
    (one LAPACK ``potrf``; success shows H PSD to rounding); when it fails, the eigenvalues
    (``lambda_min`` is then reported, or refused beyond ``psd_tol``), or above
    :data:`EIGH_FLOOR_MAX_N` variables a floor bracketed by shifted factorisations (``-s`` for the
    smallest power-of-ten step ``s <= psd_tol max(diag H)`` with ``H + s I`` factorising). Above that size: a
    negative-diagonal test (a proof of indefiniteness) and a Lanczos estimate (ARPACK), whose
    smallest eigenvalue is the floor when it is negative beyond rounding.
    """
    n = H.shape[0]
    top = float(np.max(np.diag(H))) if n else 0.0
    rounding = PSD_ROUNDING * n * np.finfo(float).eps
    if n <= max_n:
        unit = max(top, np.finfo(float).tiny)
        if _factorises(H, rounding * unit):
            return 0.0
        if n > EIGH_FLOOR_MAX_N:
            # large: bracket lambda_min by shifted factorisations (each a Cholesky, cheaper than the
            # eigenvalues): H + s I positive definite proves lambda_min > -s, so -s is a valid floor
            shift = psd_tol * unit
            if _factorises(H, shift):
                while shift / 10.0 > rounding * unit and _factorises(H, shift / 10.0):
                    shift /= 10.0
                return -shift
        eig = np.linalg.eigvalsh(H)
        lo, hi = float(eig[0]), float(eig[-1])
    else:
        diag = np.diag(H)
        lo_diag = float(np.min(diag))
        if lo_diag < -psd_tol * max(abs(top), np.finfo(float).tiny):
            # lambda_min <= min diag and lambda_max >= max diag: a proof of indefiniteness
            i = int(np.argmin(diag))
            raise NotConvexError(
                f"{what} is not positive semidefinite: its diagonal entry H[{i},{i}] = {lo_diag:.6g} "
                f"is negative (below -psd_tol * max diag); the merge QP must be convex"
            )
        found = _lanczos_extremes(H)
        if found is None:
            return 0.0
        lo, hi, converged = found
        if not converged:
            hi = max(hi, top)
    if lo < -psd_tol * max(abs(hi), np.finfo(float).tiny):
        raise NotConvexError(
            f"{what} is not positive semidefinite: smallest eigenvalue {lo:.6g} is below "
            f"-psd_tol * largest ({-psd_tol * abs(hi):.3g}); the merge QP must be convex"
        )
    # the same unit as the shifted factorisation above (max diag H, which can be n times below
    # lambda_max): a negative eigenvalue it could not absorb is charged
    if lo >= -rounding * max(top, np.finfo(float).tiny):
        return 0.0
    # the computed eigenvalue is within about n eps lambda_max of the true one: a floor below both
    return float(lo) - 10.0 * n * np.finfo(float).eps * max(abs(hi), top)


def _as_shape(shape: Any) -> tuple[int, int] | None:
    """Validate ``(K, n_atoms)`` (positive integers) or ``None``."""
    if shape is None:
        return None
    try:
        arr = np.asarray(shape)
        if arr.dtype.kind not in "iuf" or any(isinstance(v, (bool, np.bool_)) for v in np.ravel(np.asarray(shape, dtype=object))):
            raise TypeError  # not booleans, strings or objects
        vals = [float(s) for s in arr.ravel()]
    except (TypeError, ValueError):
        raise ValidationError(f"shape must be (K, n_atoms), two positive integers; got {shape!r}") from None
    if len(vals) != 2 or any(not math.isfinite(v) or v != int(v) or v < 1 for v in vals):
        raise ValidationError(f"shape must be (K, n_atoms), two positive integers; got {shape!r}")
    return int(vals[0]), int(vals[1])


#: arrays of a problem file that are not part of the QP itself, returned as context
#: (the ``sign`` constraint needs ``deltas`` (K, r, m) and ``parametrisation``)
CONTEXT_KEYS = ("deltas", "parametrisation")


def problem_file_path(path: str | os.PathLike[str]) -> str:
    """The file that :func:`load_problem_file` reads for ``path``: ``path`` itself, or ``path.npz``
    when only that exists (as ``np.savez`` names the file it writes)."""
    path = os.fspath(path)
    if not os.path.exists(path) and os.path.exists(path + ".npz"):
        return path + ".npz"
    return path


def load_problem_file(path: str) -> tuple[MergeQP, dict[str, Any]]:
    """Read an ``.npz`` problem file: ``H`` (n x n), ``g`` (n), optional ``c`` (scalar),
    ``shape`` (K, n_atoms), ``model_names``, ``atom_names``, ``metadata`` (JSON string), and
    the context arrays ``deltas`` / ``parametrisation``. Returns ``(problem, context)``.
    Every defect is a :class:`ValidationError` naming the file and the array."""
    path = problem_file_path(path)
    if not os.path.exists(path):
        raise ValidationError(f"problem file not found: {path}")
    if os.path.isdir(path):
        raise ValidationError(f"problem file {path} is a directory, not an .npz file")
    not_ours = (f"cannot read problem file {path}: not a mergeqp problem file (an .npz archive "
                f"with H, g, c and shape, as written by MergeQP.save_npz or mergeqp collect)")
    try:
        with open(path, "rb") as fh:
            magic = fh.read(6)
    except OSError as exc:
        raise ValidationError(f"cannot read problem file {path}: {exc.strerror or exc}") from None
    if not magic.startswith((b"PK\x03\x04", b"PK\x05\x06", b"\x93NUMPY")):
        raise ValidationError(f"{not_ours}; it {'is empty' if not magic else 'starts with ' + repr(magic)}")
    try:
        data = np.load(path, allow_pickle=False)
    except Exception as exc:  # noqa: BLE001 - report any unreadable file the same way
        raise ValidationError(f"{not_ours}; numpy says {type(exc).__name__}: {exc}") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise ValidationError(
            f"{path} holds a single array, not an .npz archive with H, g, c and shape "
            f"(write one with MergeQP.save_npz or numpy.savez)"
        )

    def get(key: str) -> np.ndarray:
        try:
            return data[key]
        except Exception as exc:  # noqa: BLE001 - object arrays, truncated files, ...
            if "allow_pickle" in str(exc):  # numpy's advice to unpickle would run arbitrary code
                raise ValidationError(f"{path}: array {key!r} holds pickled Python objects, not numbers: "
                                      f"not a mergeqp problem file") from None
            raise ValidationError(f"{path}: cannot read array {key!r}: {exc}") from None

    with data:
        missing = [k for k in ("H", "g") if k not in data.files]
        if missing:
            raise ValidationError(
                f"{path} lacks array(s) {missing} (it has {sorted(data.files)}); a problem npz holds "
                f"H (n x n), g (n), optional c (scalar) and shape (K, n_atoms)"
            )
        kwargs: dict[str, Any] = {"H": get("H"), "g": get("g")}
        if "shape" in data.files:
            try:
                kwargs["shape"] = _as_shape(get("shape"))
            except ValidationError as exc:
                raise ValidationError(f"{path}: {exc}") from None
        if "c" in data.files:
            c = get("c")
            if c.size != 1:
                raise ValidationError(f"{path}: c must be a scalar, got an array of shape {c.shape}")
            kwargs["c"] = c.reshape(())
        for key in ("model_names", "atom_names"):
            if key in data.files:
                kwargs[key] = tuple(str(x) for x in np.atleast_1d(get(key)))
        if "psd_tol" in data.files:
            tol = get("psd_tol")
            if tol.size != 1:
                raise ValidationError(f"{path}: psd_tol must be a scalar, got an array of shape {tol.shape}")
            value = tol.reshape(())
            try:  # a number, or a number written as text ("1e-6"); not a switch or a complex number
                if tol.dtype == bool or np.issubdtype(tol.dtype, np.complexfloating):
                    raise TypeError
                kwargs["psd_tol"] = float(str(value) if tol.dtype.kind in "US" else value)
            except (TypeError, ValueError):
                raise ValidationError(f"{path}: psd_tol must be a real number, got {tol.dtype} ({value!r})") from None
        if "soup" in data.files:
            kwargs["soup"] = get("soup")
        if "metadata" in data.files:
            try:
                meta = json.loads(str(get("metadata")))
            except json.JSONDecodeError as exc:
                raise ValidationError(f"{path}: metadata is not valid JSON ({exc}); it names the problem's layer "
                                      f"and parametrisation, which apply_merge relies on") from None
            if not isinstance(meta, dict):
                raise ValidationError(f"{path}: metadata must be a JSON object, got {type(meta).__name__}")
            kwargs["metadata"] = meta
        context: dict[str, Any] = {}
        if "deltas" in data.files:
            context["deltas"] = get("deltas")
            context["source"] = path  # (a set built from them names the file in its errors)
        if "parametrisation" in data.files:
            context["parametrisation"] = str(get("parametrisation"))
    try:
        problem = MergeQP(**kwargs)
    except ValidationError as exc:
        raise type(exc)(f"{path}: {exc}") from None
    return problem, context
