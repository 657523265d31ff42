"""The merge QP in the sparse standard forms of general QP solvers (OSQP, Clarabel).

Variables ``z = [x; t]``: ``x`` the flat ``d`` (``n = K * n_atoms``, row-major) and the
auxiliary variables of each set that declares an ``auxiliary_form`` (the L1 ball
``||x - c||_1 <= r``: ``n`` auxiliary ``t`` with ``-t <= x - c <= t``, ``1't <= r``).
Every other polyhedral set contributes its :meth:`~mergeqp.constraints.ConstraintSet.linear_form`
(bounds, equalities, inequalities). User CVXPY constraints have no such form (use the CVXPY
solvers). The objective is ``1/2 z'Pz + q'z`` with ``P = blockdiag(H, 0)`` (upper triangle for
the solvers), ``q = [g; 0]``; the constant ``c`` is added back by the caller.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from ..constraints import ConstraintSet
from ..constraints.base import cvxpy_reason
from ..constraints.forms import checked_linear_form
from ..constraints.lp import polyhedral_parts
from ..problem import MergeQP
from .base import QPSolver


class StandardFormSolver(QPSolver):
    """A solver called directly on :func:`standard_form`: needs an explicit H and a set with a
    linear form; ``package`` is the Python package it imports (checked by :meth:`available`)."""

    package: str = ""

    def available(self) -> str | None:
        try:
            importlib.import_module(self.package)
        except ImportError:
            return f"the {self.package} package is not installed (pip install {self.package})"
        return None

    def supports(self, problem: MergeQP, constraints: ConstraintSet) -> str | None:
        if problem.H is None:
            return "needs an explicit H"
        return standard_form_reason(constraints, problem.shape)


@dataclass(frozen=True)
class StandardQP:
    """``min 1/2 z'Pz + q'z`` s.t. ``A_eq z = b_eq``, ``A_in z <= b_in`` (bounds included as
    rows), ``z`` of length ``n_total``; ``x = z[:n]``. ``P`` is upper-triangular CSC."""

    n: int
    n_total: int
    P: sp.csc_matrix
    q: np.ndarray
    A_eq: sp.csr_matrix
    b_eq: np.ndarray
    A_in: sp.csr_matrix
    b_in: np.ndarray

    def osqp_form(self) -> tuple[sp.csc_matrix, np.ndarray, np.ndarray]:
        """``(A, l, u)`` with ``l <= A z <= u`` (equalities as ``l = u``)."""
        A = sp.vstack([self.A_eq, self.A_in]).tocsc()
        lo = np.concatenate([self.b_eq, np.full(self.b_in.size, -np.inf)])
        hi = np.concatenate([self.b_eq, self.b_in])
        return A, lo, hi


def standard_form_reason(constraints: ConstraintSet, shape: tuple[int, int]) -> str | None:
    """``None`` when :func:`standard_form` handles the set, else why not (the missing capability)."""
    for s in constraints.members():
        if s.auxiliary_form(shape) is None and checked_linear_form(s, shape) is None:
            others = [name for name, offered in (("cvxpy_clarabel", cvxpy_reason(s) is None),
                                                 ("torch_fista", s.has_projection)) if offered]
            hint = (f"use {' or '.join(others)}" if others else
                    "it declares no cvxpy(var) or projection either, so no built-in solver takes it")
            return (f"{s.spec} is not polyhedral: it declares neither linear_form nor auxiliary_form ({hint})")
    return None


def standard_form(problem: MergeQP, constraints: ConstraintSet) -> StandardQP:
    """Build the standard form (needs an explicit H)."""
    assert problem.H is not None
    n = problem.n
    shape = problem.shape
    parts = polyhedral_parts(constraints.members(), shape)
    if parts is None:
        raise ValueError(standard_form_reason(constraints, shape))
    form, lifted = parts
    n_total = n + sum(a.n_aux for a in lifted)

    def widen(M: sp.spmatrix) -> sp.csr_matrix:
        return sp.hstack([M, sp.csr_matrix((M.shape[0], n_total - n))]).tocsr()

    eq_rows = [widen(form.A_eq)]
    eq_rhs = [form.b_eq]
    in_rows = [widen(form.A_ub)]
    in_rhs = [form.b_ub]
    fin_hi = np.flatnonzero(np.isfinite(form.ub))
    fin_lo = np.flatnonzero(np.isfinite(form.lb))
    fixed = np.intersect1d(fin_hi, fin_lo)
    fixed = fixed[form.lb[fixed] == form.ub[fixed]]
    if fixed.size:  # lo == hi: an equality (keeps interior-point solvers well posed)
        eq_rows.append(sp.csr_matrix((np.ones(fixed.size), (np.arange(fixed.size), fixed)), shape=(fixed.size, n_total)))
        eq_rhs.append(form.lb[fixed])
        fin_hi = np.setdiff1d(fin_hi, fixed)
        fin_lo = np.setdiff1d(fin_lo, fixed)
    if fin_hi.size:
        in_rows.append(sp.csr_matrix((np.ones(fin_hi.size), (np.arange(fin_hi.size), fin_hi)), shape=(fin_hi.size, n_total)))
        in_rhs.append(form.ub[fin_hi])
    if fin_lo.size:
        in_rows.append(sp.csr_matrix((-np.ones(fin_lo.size), (np.arange(fin_lo.size), fin_lo)), shape=(fin_lo.size, n_total)))
        in_rhs.append(-form.lb[fin_lo])
    off = n
    for a in lifted:  # e.g. the L1 ball's -t <= x - c <= t, 1't <= r (t free: implied >= 0)
        rows = a.A_x.shape[0]
        in_rows.append(sp.hstack([a.A_x, sp.csr_matrix((rows, off - n)), a.A_t,
                                  sp.csr_matrix((rows, n_total - off - a.n_aux))]).tocsr())
        in_rhs.append(a.b)
        off += a.n_aux
    P = sp.triu(sp.csc_matrix(problem.H), format="csc")
    if n_total > n:
        P = sp.block_diag([P, sp.csc_matrix((n_total - n, n_total - n))], format="csc")
    q = np.concatenate([problem.g, np.zeros(n_total - n)])
    return StandardQP(
        n=n, n_total=n_total, P=P, q=q,
        A_eq=sp.vstack(eq_rows).tocsr(), b_eq=np.concatenate(eq_rhs),
        A_in=sp.vstack(in_rows).tocsr(), b_in=np.concatenate(in_rhs),
    )
