"""Where ``dense_ipm``'s dense linear algebra runs: H, the normal matrices and their Cholesky factors.

The interior point (:mod:`mergeqp.solvers.dense_ipm`) spends its time on ``n x n`` work: forming
the normal matrix ``M = H + C'WC`` (a copy of H plus a diagonal and sparse entries of the per-atom
rows; with the L1 ball's sum row, a scaling and a Householder rotation, stop 66), factorising it,
solving with the factor and multiplying by H.
A backend does exactly these operations on its own arrays; everything else (the iteration, the
crossover's face solves, the certificate) stays on the host in NumPy.

- :class:`HostLinalg`: NumPy and LAPACK in the host's memory (``dense_ipm``).
- :class:`TorchLinalg`: PyTorch on any device (``torch_ipm``): H is copied to the device once
  (float64, and float32 when asked for), M is formed and factorised there, and only vectors of
  length n (right-hand sides, solutions, the sparse entries of ``C'WC``) cross to and from it.

Both take and return float64 NumPy vectors; their matrices (``M``, factors) stay opaque to the
caller. The ridge ladder, the float32 scaling and the pivot test that use these operations are
:meth:`mergeqp.solvers.dense_ipm._Ipm._cholesky`'s.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import scipy.linalg as sla

from ..cholesky import cho_solve


def add_sym2(S: np.ndarray, U: np.ndarray, V: np.ndarray) -> None:
    """``S += U V' + V U'`` in place (``S`` C-contiguous ``n x n``, ``U``, ``V`` ``n x d`` with small
    ``d``): two BLAS rank-one updates per column (S's transpose, the Fortran-ordered view BLAS
    takes, gets ``V U' + U V'``: the same), without the ``n x n`` temporaries of ``S += U @ V.T +
    V @ U.T`` (at n = 3072 they cost as much as a third of the float32 Cholesky)."""
    ger = sla.get_blas_funcs("ger", (S,))
    St = S.T
    for j in range(U.shape[1]):
        u = np.ascontiguousarray(U[:, j], dtype=S.dtype)
        v = np.ascontiguousarray(V[:, j], dtype=S.dtype)
        for a, b in ((u, v), (v, u)):
            out = ger(1.0, a, b, a=St, overwrite_a=True)
            if not np.shares_memory(out, S):  # (not expected for a contiguous S)
                S[...] = out.T


def rotation_update(A: np.ndarray, Vh: np.ndarray, T: np.ndarray) -> np.ndarray:
    """For ``Q = I - Vh T Vh'`` and ``A = M Vh`` (M symmetric), the ``U`` of ``Q'MQ = M + U Vh' +
    Vh U'``: ``U = -A T + Vh C / 2`` with ``C = T'(Vh'A)T``."""
    C = T.T @ (Vh.T @ A) @ T
    return -A @ T + 0.5 * Vh @ (0.5 * (C + C.T))


#: rows of the reduced Hessian formed at a time (on the host)
ELIMINATE_BLOCK = 256


def reduced_hessian(H: np.ndarray, keep: np.ndarray, owner: np.ndarray, coef: np.ndarray) -> np.ndarray:
    """``T'HT`` for the elimination ``z_keep[i] = y_i`` and ``z_owner[i] += coef_i y_i`` (each kept
    variable enters at most one pivot's row: ``owner[i]`` is that pivot, or ``keep[i]`` itself
    with ``coef_i = 0``), in row blocks of :data:`ELIMINATE_BLOCK` (no ``N x N`` temporaries);
    symmetric to the last bit."""
    n = keep.size
    Hr = np.empty((n, n))
    for a in range(0, n, ELIMINATE_BLOCK):
        b = min(n, a + ELIMINATE_BLOCK)
        ka, oa, ca = keep[a:b], owner[a:b], coef[a:b, None]
        blk = H[np.ix_(ka, keep)]
        blk += H[np.ix_(ka, owner)] * coef[None, :]
        blk += ca * H[np.ix_(oa, keep)]
        blk += ca * (H[np.ix_(oa, owner)] * coef[None, :])
        Hr[a:b] = blk
    np.add(Hr, Hr.T, out=Hr)  # (the four terms' sums differ in order)
    Hr *= 0.5
    return Hr


def max_step(v: np.ndarray, dv: np.ndarray) -> float:
    """The largest ``a`` with ``v + a dv >= 0`` for ``v > 0`` (``inf`` where no entry of ``dv`` is
    negative): the step to the boundary of an interior point's slacks or multipliers."""
    neg = dv < 0
    if not np.any(neg):
        return float("inf")
    return float(np.min(-v[neg] / dv[neg]))


def unit_scaling(diag: np.ndarray) -> np.ndarray:
    """``D = diag(M)^-1/2`` (float64) for scaling M to a unit diagonal."""
    return 1.0 / np.sqrt(np.maximum(np.asarray(diag, dtype=np.float64), np.finfo(float).tiny))


class HostLinalg:
    """NumPy / LAPACK in the host's memory."""

    #: a torch device, or ``None`` for the host's memory
    device = None

    def __init__(self, H: np.ndarray):
        self.H = H
        self._H32: np.ndarray | None = None

    def _H(self, dtype: Any) -> np.ndarray:
        if np.dtype(dtype) == np.float32:
            if self._H32 is None:
                self._H32 = self.H.astype(np.float32)
            return self._H32
        return self.H

    def reduce_hessian(self, keep: np.ndarray, owner: np.ndarray, coef: np.ndarray) -> np.ndarray:
        """Replace H by the reduced ``T'HT`` of :func:`reduced_hessian`; returns it (on the host)."""
        self.H = reduced_hessian(self.H, keep, owner, coef)
        self._H32 = None
        return self.H

    def host_hessian(self) -> np.ndarray:
        """H in the host's memory (float64)."""
        return self.H

    def max_abs_diagonal(self) -> float:
        return float(np.max(np.abs(np.diag(self.H)), initial=0.0))

    def hmul(self, y: np.ndarray) -> np.ndarray:
        """``H y`` (``y`` of shape ``(nx,)`` or ``(nx, k)``)."""
        return self.H @ y

    def base(self, dtype: Any, N: int) -> np.ndarray:
        """A fresh ``N x N`` matrix holding H in its leading block (zeros beyond), in ``dtype``."""
        H = self._H(dtype)
        if N == H.shape[0]:
            return H.copy()
        M = np.zeros((N, N), dtype=H.dtype)
        M[:H.shape[0], :H.shape[0]] = H
        return M

    def add_diagonal(self, M: np.ndarray, v: np.ndarray | float) -> None:
        idx = np.arange(M.shape[0])
        M[idx, idx] += np.asarray(v).astype(M.dtype)

    def add_entries(self, M: np.ndarray, rows: np.ndarray, cols: np.ndarray, data: np.ndarray) -> None:
        """``M[rows, cols] += data`` (pairs distinct)."""
        M[rows, cols] += data.astype(M.dtype)

    def rotate(self, M: np.ndarray, Vh: np.ndarray, T: np.ndarray) -> None:
        """``M <- Q'MQ`` in place, ``Q = I - Vh T Vh'`` (compact Householder; ``Vh`` ``n x d``)."""
        A = (M @ Vh.astype(M.dtype)).astype(np.float64)
        add_sym2(M, rotation_update(A, Vh, T), Vh)

    def max_diagonal(self, M: np.ndarray) -> float:
        return float(np.max(np.diag(M)))

    def scale_to_unit_diagonal(self, M: np.ndarray) -> np.ndarray:
        """``M <- D M D`` in place; returns ``diag(D)`` (float64)."""
        d = unit_scaling(np.diag(M))
        self.scale(M, d)
        return d

    def scale(self, M: np.ndarray, d: np.ndarray) -> None:
        """``M <- diag(d) M diag(d)`` in place."""
        dl = d.astype(M.dtype)
        M *= dl[:, None]
        M *= dl[None, :]

    def hessian_diagonal(self) -> np.ndarray:
        """``diag(H)`` (float64)."""
        return np.diag(self.H).astype(np.float64)

    def cholesky(self, M: np.ndarray) -> Any:
        """The Cholesky factor of M (M may be overwritten), ``None`` when M is not positive definite."""
        try:
            return sla.cho_factor(M, lower=False, check_finite=False, overwrite_a=True)
        except np.linalg.LinAlgError:
            return None

    def min_pivot(self, fac: Any) -> float:
        return float(np.min(np.abs(np.diag(fac[0]))))

    def solver(self, fac: Any, scale: np.ndarray | None) -> Any:
        """``r -> M^-1 r`` (float64 in and out, ``r`` of shape ``(N,)`` or ``(N, k)``); with
        ``scale`` = ``diag(D)`` the factor is of ``D M D``: ``M^-1 r = D (D M D)^-1 D r``."""
        if scale is None:
            return lambda r: cho_solve(fac, r)
        d, dtype = scale, fac[0].dtype

        def solve(r: np.ndarray) -> np.ndarray:
            col = (slice(None),) + (None,) * (r.ndim - 1)
            return cho_solve(fac, (r * d[col]).astype(dtype)).astype(np.float64) * d[col]

        return solve


#: rows of the reduced Hessian formed at a time on a device
DEVICE_BLOCK = 2048


class TorchLinalg:
    """PyTorch on ``device`` (CPU or CUDA): H held there in float64 (and float32 once asked for)."""

    def __init__(self, H: np.ndarray, device: Any):
        import torch  # optional heavy dependency: deferred so mergeqp imports without torch

        self.torch = torch
        self.device = torch.device(device)
        with warnings.catch_warnings():  # H is only ever read here: no host copy for a read-only array
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            self.H = torch.as_tensor(np.ascontiguousarray(H, dtype=np.float64), device=self.device)
        self._H32: Any = None

    def _H(self, dtype: Any) -> Any:
        if np.dtype(dtype) == np.float32:
            if self._H32 is None:
                self._H32 = self.H.to(self.torch.float32)
            return self._H32
        return self.H

    def _tensor(self, a: np.ndarray, dtype: Any) -> Any:
        return self.torch.as_tensor(np.ascontiguousarray(a), device=self.device).to(dtype)

    def reduce_hessian(self, keep: np.ndarray, owner: np.ndarray, coef: np.ndarray) -> None:
        """As :meth:`HostLinalg.reduce_hessian`, formed on the device (in row blocks of
        :data:`DEVICE_BLOCK` rows) and kept there in H's place; returns ``None``: the host gets
        a copy only when it asks (:meth:`host_hessian`; at n = 12288 the copy cost 0.4-0.6 s)."""
        torch = self.torch
        H = self.H
        k, o = self._tensor(keep, torch.long), self._tensor(owner, torch.long)
        c = self._tensor(coef, torch.float64)
        n = keep.size
        Hr = torch.empty((n, n), dtype=torch.float64, device=self.device)
        for a in range(0, n, DEVICE_BLOCK):
            b = min(n, a + DEVICE_BLOCK)
            rows_k, rows_o = H.index_select(0, k[a:b]), H.index_select(0, o[a:b])
            blk = rows_k.index_select(1, k) + rows_k.index_select(1, o) * c[None, :]
            blk += c[a:b, None] * (rows_o.index_select(1, k) + rows_o.index_select(1, o) * c[None, :])
            Hr[a:b] = blk
            del rows_k, rows_o, blk
        del H
        self.H = self._H32 = None  # (the full H is not needed again: free it before the sum)
        Hr = (Hr + Hr.T).mul_(0.5)
        self.H = Hr
        return None

    def host_hessian(self) -> np.ndarray:
        return self.H.cpu().numpy()

    def max_abs_diagonal(self) -> float:
        return float(self.H.diagonal().abs().max()) if self.H.shape[0] else 0.0

    def hmul(self, y: np.ndarray) -> np.ndarray:
        return (self.H @ self._tensor(y, self.torch.float64)).cpu().numpy()

    def base(self, dtype: Any, N: int) -> Any:
        H = self._H(dtype)
        if N == H.shape[0]:
            return H.clone()
        M = self.torch.zeros((N, N), dtype=H.dtype, device=self.device)
        M[:H.shape[0], :H.shape[0]] = H
        return M

    def add_diagonal(self, M: Any, v: np.ndarray | float) -> None:
        if np.ndim(v) == 0:
            M.diagonal().add_(float(v))  # type: ignore[arg-type]
        else:
            M.diagonal().add_(self._tensor(np.asarray(v, dtype=np.float64), M.dtype))

    def add_entries(self, M: Any, rows: np.ndarray, cols: np.ndarray, data: np.ndarray) -> None:
        if rows.size:
            idx = (self._tensor(rows, self.torch.long), self._tensor(cols, self.torch.long))
            M.index_put_(idx, self._tensor(np.asarray(data, dtype=np.float64), M.dtype), accumulate=True)

    def rotate(self, M: Any, Vh: np.ndarray, T: np.ndarray) -> None:
        v = self._tensor(np.asarray(Vh, dtype=np.float64), M.dtype)
        A = (M @ v).to(self.torch.float64).cpu().numpy()
        u = self._tensor(rotation_update(A, Vh, T), M.dtype)
        M.addmm_(u, v.T).addmm_(v, u.T)

    def max_diagonal(self, M: Any) -> float:
        return float(M.diagonal().max())

    def scale_to_unit_diagonal(self, M: Any) -> np.ndarray:
        d = unit_scaling(M.diagonal().to(self.torch.float64).cpu().numpy())
        self.scale(M, d)
        return d

    def scale(self, M: Any, d: np.ndarray) -> None:
        dl = self._tensor(d, M.dtype)
        M.mul_(dl[:, None]).mul_(dl[None, :])

    def hessian_diagonal(self) -> np.ndarray:
        return self.H.diagonal().to(self.torch.float64).cpu().numpy().copy()

    def cholesky(self, M: Any) -> Any:
        L, info = self.torch.linalg.cholesky_ex(M)
        if int(info) != 0 or not bool(self.torch.isfinite(L.diagonal()).all()):
            return None
        return L

    def min_pivot(self, fac: Any) -> float:
        return float(fac.diagonal().abs().min())

    def solver(self, fac: Any, scale: np.ndarray | None) -> Any:
        torch = self.torch
        d = None if scale is None else self._tensor(scale, torch.float64)

        def solve(r: np.ndarray) -> np.ndarray:
            b = self._tensor(np.asarray(r, dtype=np.float64), torch.float64)
            vector = b.ndim == 1
            if vector:
                b = b[:, None]
            if d is not None:
                b = b * d[:, None]
            y = torch.cholesky_solve(b.to(fac.dtype), fac).to(torch.float64)
            if d is not None:
                y = y * d[:, None]
            out = y.cpu().numpy()
            return out[:, 0] if vector else out

        return solve
