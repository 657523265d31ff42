"""Solves with a Cholesky factor: one vector by two BLAS triangular solves.

``scipy.linalg.cho_solve`` calls LAPACK ``potrs``, which OpenBLAS runs as a blocked triangular
solve with a matrix right-hand side (``trsm``) even for one vector. For one vector that costs
2-5x two level-2 triangular solves (``trsv``) on one or two cores (n = 3072: 12-15 ms against
5.7 ms in float64, 12 ms against 2.3-2.8 ms in float32), and far more with a large BLAS thread
pool: on 16 cores 62 calls (nearly all with one vector) took 3.8 s of an interior-point solve
whose 13 factorisations took 1.6 s (docs/solvers.md, stop 33).
:func:`cho_solve` takes the same factor as SciPy's and uses ``trsv`` for a vector right-hand
side; a matrix right-hand side goes to ``potrs`` as before. :func:`triangular_solve` solves with
the factor's triangle alone (or its transpose) the same way.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.linalg as sla
from scipy.linalg import blas


def _fortran_triangle(c: np.ndarray, lower: bool) -> tuple[np.ndarray, bool] | None:
    """``c`` as a Fortran-ordered array and which of its triangles holds the factor (a C-ordered
    factor is the transposed one in Fortran order, with the other triangle: no copy either way);
    ``None`` for a strided array."""
    if c.flags.f_contiguous:
        return c, bool(lower)
    if c.flags.c_contiguous:
        return c.T, not lower
    return None


def cho_solve(factor: tuple[np.ndarray, bool], b: np.ndarray) -> np.ndarray:
    """``M^-1 b`` for ``factor = (c, lower)`` of :func:`scipy.linalg.cho_factor` (``M = U'U``
    with ``U`` the upper triangle of ``c``, or ``L L'`` with ``L`` the lower one), without
    checking for non-finite entries (like ``cho_solve(..., check_finite=False)``). ``b`` of
    shape ``(n,)`` is solved in ``c``'s precision by two triangular solves, ``(n, k)`` by LAPACK."""
    c, lower = factor
    if not _vector_case(c, b):
        return sla.cho_solve(factor, b, check_finite=False)
    # M = U'U: U' y = b, then U x = y; M = L L': L y = b, then L' x = y
    first, second = (True, False) if not lower else (False, True)
    return triangular_solve(factor, triangular_solve(factor, b, transpose=first), transpose=second)


def triangular_solve(factor: tuple[np.ndarray, bool], b: np.ndarray, transpose: bool = False) -> np.ndarray:
    """``T^-1 b`` (``transpose``: ``T'^-1 b``) for the triangle ``T`` of ``factor = (c, lower)``
    (the upper one of ``c``, or the lower one with ``lower``; the other is never read), without
    checking for non-finite entries: one ``trsv`` for a vector, LAPACK for a matrix."""
    c, lower = factor
    tri = _fortran_triangle(c, lower) if _vector_case(c, b) else None
    if tri is None:
        return sla.solve_triangular(c, b, trans="T" if transpose else "N", lower=bool(lower), check_finite=False)
    a, low = tri
    # a Fortran array holding T' when the triangle flipped: solving with it transposed is solving with T
    trans = int(transpose) if low == bool(lower) else int(not transpose)
    trsv: Any = blas.get_blas_funcs("trsv", (a,))
    x = np.array(b, dtype=a.dtype, copy=True)
    return trsv(a, x, lower=int(low), trans=trans, overwrite_x=1)


def _vector_case(c: np.ndarray, b: np.ndarray) -> bool:
    return b.ndim == 1 and c.dtype in (np.float32, np.float64) and b.shape[0] == c.shape[0]


__all__ = ["cho_solve", "triangular_solve"]
