"""Solves with a Cholesky factor: one vector by two BLAS triangular solves.

``scipy.linalg.cho_solve`` calls LAPACK ``potrs``, which OpenBLAS runs as a blocked triangular
solve with a matrix right-hand side (``trsm``) even for one vector. For one vector that costs
2-5x two level-2 triangular solves (``trsv``) on one or two cores (n = 3072: 12-15 ms against
5.7 ms in float64, 12 ms against 2.3-2.8 ms in float32), and far more with a large BLAS thread
pool: on 16 cores 62 calls (nearly all with one vector) took 3.8 s of an interior-point solve
whose 13 factorisations took 1.6 s (docs/solvers.md, stop 33).
:func:`cho_solve` takes the same factor as SciPy's and uses ``trsv`` for a vector right-hand
side; a matrix right-hand side goes to ``potrs`` as before.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.linalg as sla
from scipy.linalg import blas


def cho_solve(factor: tuple[np.ndarray, bool], b: np.ndarray) -> np.ndarray:
    """``M^-1 b`` for ``factor = (c, lower)`` of :func:`scipy.linalg.cho_factor` (``M = U'U``
    with ``U`` the upper triangle of ``c``, or ``L L'`` with ``L`` the lower one), without
    checking for non-finite entries (like ``cho_solve(..., check_finite=False)``). ``b`` of
    shape ``(n,)`` is solved in ``c``'s precision by two triangular solves, ``(n, k)`` by LAPACK."""
    c, lower = factor
    if b.ndim != 1 or c.dtype not in (np.float32, np.float64) or b.shape[0] != c.shape[0]:
        return sla.cho_solve(factor, b, check_finite=False)
    # trsv reads a Fortran-ordered triangle; a C-ordered factor is the transposed one in Fortran
    # order, with the other triangle (no copy of the n x n factor either way)
    if c.flags.f_contiguous:
        a, low = c, bool(lower)
    elif c.flags.c_contiguous:
        a, low = c.T, not lower
    else:
        return sla.cho_solve(factor, b, check_finite=False)
    trsv: Any = blas.get_blas_funcs("trsv", (a,))
    x = np.array(b, dtype=a.dtype, copy=True)
    if low:  # M = L L': L y = b, then L' x = y
        x = trsv(a, x, lower=1, trans=0, overwrite_x=1)
        return trsv(a, x, lower=1, trans=1, overwrite_x=1)
    # M = U'U: U' y = b, then U x = y
    x = trsv(a, x, lower=0, trans=1, overwrite_x=1)
    return trsv(a, x, lower=0, trans=0, overwrite_x=1)


__all__ = ["cho_solve"]
