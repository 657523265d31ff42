"""A dense primal-dual interior-point solver for merge QPs over any polyhedral set.

For the sets the active-set engine does not take (TIES sign consensus, intersections with it,
users' sets that declare a ``linear_form``) the general sparse solvers factorise the merge QP's
*dense* H inside a sparse KKT matrix: Clarabel took 36-87x one dense Cholesky of H on the sign
family (docs/solvers.md). This solver keeps H dense and factorises, once per iteration, the normal matrix

    M = H + C' W C        (W = diag(lambda / s), C: the inequality rows, bounds included)

by LAPACK, where the rows of ``C`` are sparse (bounds: a diagonal; the sign rows of one atom
touch only that atom's K coefficients, so ``C'WC`` is block diagonal), plus a Schur complement for
equality rows ``E x = f``. The iteration is Mehrotra's predictor-corrector (one factorisation,
two solves per iteration) from an infeasible start, with one step length for primal and dual
variables, and up to ``correctors`` (2) of Gondzio's centrality correctors per iteration (one more
solve each, kept when it lengthens the step: 9-12 -> 7-9 iterations on the sign family).

- *Precision*: while the relative duality gap is above ``float32_until`` (1e-7), ``M`` is
  factorised in float32 with one refinement step against the float64 M (far from the optimum the
  Newton direction need not be exact: the iteration count was the same on the families
  measured); from there on, and from the first M too ill-conditioned for float32, in float64.
  The float32 M is scaled to a unit diagonal first (the weights of nearly active constraints
  reach 1e10 and beyond; unscaled, float32 failed on 3-4 of 9 factorisations of box & sign at
  n = 3072, scaled on none). A matrix that does not factorise gets the smallest ridge of
  :data:`RIDGES` that works.
- *Crossover* (``crossover`` on by default): once the relative gap is below ``crossover_from``
  (1e-6), the constraints that look active (``s_i < lambda_i`` or ``s_i < sqrt(mu)``) are made
  equalities and that face's minimiser is computed directly (where the active rows fall into
  small groups of variables, as per-atom sign rows do, by a null space per group and a Cholesky
  of the reduced ``Z'HZ``: :func:`_nullspace_face`; else by a Cholesky of the free block of
  H and a Schur complement of the active rows; an active row on a single free variable fixes
  it like a bound and gets its multiplier afterwards, by the row it pushes the right way;
  auxiliaries pinned by one active row are substituted; where H is singular on the free block
  but the rows pin its flat directions, the Cholesky of ``H_FF + gamma Abar'Abar``, which
  leaves the face problem unchanged; dependent rows by a ridge and iterated Tikhonov, else an
  eigendecomposition; where H is singular on the face itself, the face minimiser nearest the
  iterate); then, as in a primal-dual
  active-set step, violated constraints join the face and constraints with a clearly negative
  multiplier leave it (bounds of a degenerate vertex, whose multipliers the face does not
  determine, excepted; on a singular face no correction is tried), up to
  :data:`CROSSOVER_ROUNDS` face solves. Constraints in a *degenerate* part of the face (a
  connected component of the active constraints with more constraints than variables: an L1
  coordinate at the ball's centre with its auxiliary's bound, an atom at 0 with its sign rows)
  have multipliers the face does not determine: they stay on the face while other constraints
  move, and a feasible face minimiser whose only wrong-signed multipliers are such ones is
  offered to the certificate at once (dropping them made the corrections wander away from
  optimal points: `l1 & sign` at n = 3072 23-24x one Cholesky -> 15-16x, docs/solvers.md). The point is
  kept only when the float64 certificate (:func:`~mergeqp.certificate.certify`, the Frank-Wolfe
  gap) certifies it at ``tol``; otherwise the interior-point iteration goes on (faces already
  tried are skipped; at most ``crossover_face_solves`` face solves in all). A crossover point
  lies exactly on its face (coefficients exactly at their bounds).
- *Stop*: relative gap ``s'lambda <= tol * max(|J|, 1e-8 (|c| + |x'Hx|/2 + |g'x|))`` with
  primal and dual residuals below ``tol`` (relative); or, with the gap reached, when the
  residuals have not improved for 2 iterations (their float64 floor on an ill-conditioned M:
  the best iterate is returned); ``max_iter`` iterations otherwise.
- A set with no interior point that is feasible (e.g. an empty intersection) leaves the primal
  residual large: the solver then says so instead of returning a point; iterates that diverge
  on an unbounded set are checked as a descent ray (:func:`~.unbounded.unbounded_claim`).

- *Auxiliary variables* (the L1 ball's ``t``: zero rows of H) are eliminated from each
  Newton system in closed form (:class:`_AuxBlock`): only an ``n x n`` Schur complement is
  factorised, not the lifted ``2n x 2n`` M. Its sparse part is formed as a sum of positive
  terms, and the ball's sum row, a rank-one term that grows like ``1 / s``, is rotated onto the
  first coordinate (S scaled to a unit diagonal first) so that it is a diagonal entry the
  scaling takes care of (:meth:`_Ipm.aux_matrix`; stop 66).
- *A float32 factor* is checked by its first solve (:meth:`_Ipm._checked32`): where the refined
  residual is above :data:`FLOAT32_GUARD` of the right-hand side, the iteration goes on in
  float64 (``info["float32_rejected"]``).
- *Equality rows* of at most :data:`ELIMINATE_MAX_SUPPORT` variables with disjoint supports
  (per-atom simplex sums, coefficients with ``lo == hi``) are eliminated before the iteration
  (:func:`_eliminate`): each is solved for one pivot variable, whose bounds become inequality
  rows on the same atom; the iteration runs on the other variables (reduced Hessian ``T'HT``),
  and the point is lifted back. Longer or overlapping rows (a global simplex) stay equalities.

- *Where the dense work runs*: forming ``M``, its factorisations and solves, and the products
  with H go through a backend (:mod:`.ipm_linalg`): the host's NumPy / LAPACK here, PyTorch on a
  GPU in ``torch_ipm`` (:mod:`.torch_ipm`, the same iteration); the rest stays on the host.

Memory: ``M`` (float64) and a float32 copy of H beside H itself, about ``1.5`` H, and the
reduced H (about one more H) when equality rows are eliminated; H is never padded to the
auxiliaries (but where :class:`_AuxBlock` does not apply, ``M`` is the lifted matrix). Needs an
explicit H.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.linalg as sla
import scipy.sparse as sp
from scipy.sparse.csgraph import connected_components

from ..certificate import certify
from ..constraints import ConstraintSet
from ..constraints.lp import lifted_form
from ..errors import SolverError, ValidationError
from ..problem import MergeQP
from ..solution import SolveStatus
from . import base
from .base import QPSolver, RawResult, objective_sizes, unit_scaled, work_arrays_decline
from .blas_threads import blas_threads, thread_cap
from .ipm_linalg import HostLinalg, max_step, reduced_hessian, unit_scaling
from ..cholesky import cho_solve, triangular_solve
from .standard_form import standard_form_reason
from .unbounded import unbounded_claim

#: fraction of the way to the boundary that a step may go
STEP_FRACTION = 0.99
#: ridges (relative to max diag M; in float32, to M's unit diagonal after scaling) tried in turn
#: when M does not factorise; the float32 ones are corrected by the refinement step against the
#: float64 M (without the ridge)
RIDGES = {"float32": (0.0, 1e-7, 1e-6, 1e-5), "float64": (0.0, 1e-14, 1e-12, 1e-10, 1e-8)}
#: equality rows of at most this many variables are eliminated (:func:`_eliminate`)
ELIMINATE_MAX_SUPPORT = 64
#: rows on many auxiliary variables (the L1 ball's sum) that :class:`_AuxBlock` takes by Woodbury
AUX_MAX_DENSE = 16
#: sparse rows on one auxiliary variable that :class:`_AuxBlock` takes (the L1 ball has two)
AUX_MAX_ROWS = 8
#: a float32 factor whose first refined solve leaves a residual above this fraction of the
#: right-hand side is given up for float64 (:meth:`_Ipm._checked32`)
FLOAT32_GUARD = 1e-4
#: proximal weight (relative to max diag H) of a crossover face on which H is singular
FACE_PROX = 1e-10
#: primal-dual corrections of a crossover's face guess before it is given up
CROSSOVER_ROUNDS = 6
#: iterates beyond this multiple of the problem's own size count as diverged (unbounded)
DIVERGED = 1e10
#: the smallest scale of the stopping rule's relative gap, relative to the problem's size
#: (``|c| + max |g| + max diag H``): a point with ``J ~ 0`` stops once the complementarity gap is
#: ``tol`` times this (``J* = 0`` is certified only with an ``abs_tol``: docs/certificates.md)
SCALE_FLOOR = 1e-8

#: the iteration starts from unit multipliers and slacks: a problem whose scale
#: ``max(max |g|, max diag H)`` lies outside this band is solved as ``J / scale`` (the same
#: minimiser; measured: ``g`` of 1e10-1e20 against ``H`` of 1e2-1e12 left the iterates infeasible
#: after 100 iterations, scaled they certified in 8-11). Below 1 since stop 51 (was 1e-6, as the
#: sparse solvers' :data:`~.base.SCALE_UP_ONLY`): a simplex & sign QP of scale 26 took 9 iterations,
#: 0.18 s, the same QP times 1e-6 16 iterations, 0.80 s (its crossover failed twice), scaled up 11,
#: 0.28 s; scaling down from 1e2-3e3 to 1 was measured slower on the sign family (8 -> 11 iterations)
OBJECTIVE_SCALE_BAND = (1.0, 1e6)


@dataclass
class _Form:
    """The QP over ``z`` (length ``N``: ``d`` flat, then auxiliary variables) in the solver's
    terms: ``min 1/2 z'Hz + q'z`` s.t. ``A z <= b``, ``E z = f``, ``z[U] <= u``, ``z[L] >= l``."""

    N: int
    #: ``None`` where a device backend formed the reduced H and holds it (copied here on demand:
    #: :meth:`_Ipm._crossover`)
    H: np.ndarray | None
    q: np.ndarray
    A: sp.csr_matrix
    b: np.ndarray
    E: sp.csr_matrix
    f: np.ndarray
    U: np.ndarray
    u: np.ndarray
    L: np.ndarray
    l: np.ndarray
    #: constant added to J by an elimination of equality rows (:func:`_eliminate`)
    c0: float = 0.0
    #: the last ``n_aux`` variables are auxiliaries (the L1 ball's), on which H is zero: ``H`` holds
    #: only the first :attr:`nx` rows and columns
    n_aux: int = 0

    @property
    def nx(self) -> int:
        """Variables that H acts on (``H`` is ``nx x nx``; the auxiliaries after them)."""
        return self.N - self.n_aux

    def Hsub(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """``H[rows, cols]`` of the lifted H (zero on auxiliaries)."""
        if self.n_aux == 0:
            return self.H[np.ix_(rows, cols)]
        out = np.zeros((rows.size, cols.size))
        rm, cm = rows < self.nx, cols < self.nx
        out[np.ix_(rm, cm)] = self.H[np.ix_(rows[rm], cols[cm])]
        return out

    def Hmul(self, y: np.ndarray, mul: Any = None) -> np.ndarray:
        """``H y`` of the lifted H (zero on the auxiliaries; ``y`` of shape ``(N,)`` or ``(N, k)``);
        ``mul(v)``: the product with H itself (default ``self.H @ v``; a backend's ``hmul``)."""
        mul = mul or (lambda v: self.H @ v)
        if self.n_aux == 0:
            return mul(y)
        out = np.zeros(y.shape)
        out[:self.nx] = mul(y[:self.nx])
        return out

    @property
    def m(self) -> int:
        return self.A.shape[0] + self.U.size + self.L.size

    def Cx(self, x: np.ndarray) -> np.ndarray:
        """The inequality rows' values ``[A x; x_U; -x_L]`` (``C x <= d``)."""
        return np.concatenate([self.A @ x, x[self.U], -x[self.L]])

    def d(self) -> np.ndarray:
        return np.concatenate([self.b, self.u, -self.l])

    def Ctv(self, v: np.ndarray) -> np.ndarray:
        """``C' v``."""
        mA, mU = self.A.shape[0], self.U.size
        out = self.A.T @ v[:mA] if mA else np.zeros(self.N)
        out = np.asarray(out, dtype=np.float64)
        np.add.at(out, self.U, v[mA:mA + mU])
        np.subtract.at(out, self.L, v[mA + mU:])
        return out

    def diagonal(self, w: np.ndarray) -> np.ndarray:
        """The diagonal part of ``C' diag(w) C`` that the bounds contribute."""
        mA, mU = self.A.shape[0], self.U.size
        out = np.zeros(self.N)
        np.add.at(out, self.U, w[mA:mA + mU])
        np.add.at(out, self.L, w[mA + mU:])
        return out


def _form(problem: MergeQP, cset: ConstraintSet) -> _Form:
    assert problem.H is not None
    n = problem.n
    lf = lifted_form(cset.members(), problem.shape)
    if lf is None:  # supports() said otherwise
        raise SolverError(f"dense_ipm: {standard_form_reason(cset, problem.shape)}")
    N = lf.n
    H = np.asarray(problem.H, dtype=np.float64)  # (the auxiliaries' rows and columns are zero: not stored)
    q = np.concatenate([problem.g, np.zeros(N - n)])
    lb, ub = np.asarray(lf.lb, dtype=np.float64), np.asarray(lf.ub, dtype=np.float64)
    if np.any(lb > ub):
        i = int(np.flatnonzero(lb > ub)[0])
        raise SolverError(f"dense_ipm: the set {cset.spec} is empty (variable {i}: lower bound {lb[i]:g} > "
                          f"upper bound {ub[i]:g})")
    fixed = np.flatnonzero(np.isfinite(lb) & (lb == ub))
    E = lf.A_eq.tocsr()
    f = np.asarray(lf.b_eq, dtype=np.float64)
    if fixed.size:  # lo == hi: an equality (an inequality pair has no interior)
        E = sp.vstack([E, sp.csr_matrix((np.ones(fixed.size), (np.arange(fixed.size), fixed)),
                                        shape=(fixed.size, N))]).tocsr()
        f = np.concatenate([f, lb[fixed]])
    free_of_eq = np.ones(N, dtype=bool)
    free_of_eq[fixed] = False
    U = np.flatnonzero(np.isfinite(ub) & free_of_eq)
    L = np.flatnonzero(np.isfinite(lb) & free_of_eq)
    return _Form(N, H, q, lf.A_ub.tocsr(), np.asarray(lf.b_ub, dtype=np.float64), E, f, U, ub[U], L, lb[L],
                 n_aux=N - n)


@dataclass
class _Elimination:
    """Equality rows solved for one pivot variable each: ``z = T y + t0`` (``y``: the other
    variables, in order), from :func:`_eliminate`."""

    T: sp.csr_matrix
    t0: np.ndarray
    taken: np.ndarray  # the equality rows solved (indices into the form's E)
    lo: np.ndarray  # the pivots' bounds in z (clipped to after lifting)
    hi: np.ndarray

    def lift(self, y: np.ndarray) -> np.ndarray:
        z = self.T @ y + self.t0
        return np.minimum(np.maximum(z, self.lo), self.hi)


def _eliminate(F: _Form, reduce: Any = None) -> tuple[_Form, _Elimination | None]:
    """``F`` with its short equality rows eliminated (``None``: none was).

    Every equality row of at most :data:`ELIMINATE_MAX_SUPPORT` variables whose support is
    disjoint from the rows already taken (per-atom simplex sums, variables with ``lo == hi``)
    is solved for its largest coefficient's variable, the pivot: ``z_p = (f_j - sum_i e_ji z_i)
    / e_jp``. The pivots leave the problem; their bounds become inequality rows on the same
    few variables (so per-atom rows stay per-atom and ``C'WC`` stays block diagonal), and the
    rows left over (long or overlapping ones: a global simplex) stay equalities. Without this,
    every iteration paid a Schur complement with one solve per equality row: ``simplex & sign``
    took 26-32x one Cholesky of H at n = 1536, against 12-16x for ``box & sign``.
    The reduced Hessian ``T'HT`` is formed by ``reduce(keep, owner, coef)`` (a backend's
    ``reduce_hessian``; by default on the host, in row blocks with no ``N x N`` temporaries),
    which returns it, or ``None`` where the backend keeps it on its device (the form's ``H`` is
    then ``None`` until the crossover asks for it)."""
    E = F.E.tocsr()
    if E.shape[0] == 0:
        return F, None
    E.sum_duplicates()
    used = np.zeros(F.N, dtype=bool)
    take: list[int] = []
    pivots: list[int] = []
    for j in range(E.shape[0]):
        lo, hi = E.indptr[j], E.indptr[j + 1]
        cols, vals = E.indices[lo:hi], E.data[lo:hi]
        nz = vals != 0
        cols, vals = cols[nz], vals[nz]
        if not 0 < cols.size <= ELIMINATE_MAX_SUPPORT or used[cols].any() or cols.max() >= F.N - F.n_aux:
            continue  # (auxiliaries stay last and unpivoted)
        used[cols] = True
        take.append(j)
        pivots.append(int(cols[np.argmax(np.abs(vals))]))
    if not take or len(take) == F.N - F.n_aux:
        return F, None  # (nothing but auxiliaries left to solve for: the plain form handles it)
    piv = np.array(pivots, dtype=np.intp)
    is_piv = np.zeros(F.N, dtype=bool)
    is_piv[piv] = True
    keep = np.flatnonzero(~is_piv)
    n_red = keep.size
    col_of = np.full(F.N, -1, dtype=np.intp)
    col_of[keep] = np.arange(n_red)
    # T: identity on the kept variables, pivot p_j = t0_j + sum_i coef_i y_i over its row
    Et = E[take].tocoo()
    row_piv = piv[Et.row]
    other = Et.col != row_piv
    e_piv = np.zeros(len(take))
    e_piv[Et.row[~other]] = Et.data[~other]
    coef = -Et.data[other] / e_piv[Et.row[other]]
    t_rows = np.concatenate([keep, row_piv[other]])
    t_cols = np.concatenate([np.arange(n_red), col_of[Et.col[other]]])
    t_vals = np.concatenate([np.ones(n_red), coef])
    T = sp.csr_matrix((t_vals, (t_rows, t_cols)), shape=(F.N, n_red))
    t0 = np.zeros(F.N)
    t0[piv] = F.f[take] / e_piv
    # per kept variable: the pivot of its row (its own index and coefficient 0 when none)
    owner = np.arange(F.N)[keep].copy()
    ocoef = np.zeros(n_red)
    owner[col_of[Et.col[other]]] = row_piv[other]
    ocoef[col_of[Et.col[other]]] = coef
    H = F.H
    nxr = n_red - F.n_aux  # (the auxiliaries are last, never pivots, and H is zero on them)
    keep_x, owner, ocoef = keep[:nxr], owner[:nxr], ocoef[:nxr]
    Hr = (reduce or (lambda *a: reduced_hessian(H, *a)))(keep_x, owner, ocoef)
    Ht0 = np.zeros(F.N)
    Ht0[:F.nx] = H @ t0[:F.nx]  # (t0 is zero off the pivots: one contiguous pass over H, no column gather)
    q = T.T @ (Ht0 + F.q)
    c0 = F.c0 + float(0.5 * t0[piv] @ Ht0[piv] + F.q[piv] @ t0[piv])
    # inequality rows on y; the pivots' finite bounds become rows
    A = (F.A @ T).tocsr()
    b = F.b - F.A @ t0
    lo = np.full(F.N, -np.inf)
    hi = np.full(F.N, np.inf)
    lo[F.L], hi[F.U] = F.l, F.u
    Tp = T[piv]
    up, dn = np.isfinite(hi[piv]), np.isfinite(lo[piv])
    A = sp.vstack([A, Tp[up], -Tp[dn]]).tocsr()
    b = np.concatenate([b, hi[piv][up] - t0[piv][up], t0[piv][dn] - lo[piv][dn]])
    vacuous = (np.diff(A.indptr) == 0) & (b >= 0)  # rows on no variable that hold anyway
    if vacuous.any():
        A, b = A[~vacuous], b[~vacuous]
    rest = np.setdiff1d(np.arange(E.shape[0]), take)
    E2 = (E[rest] @ T).tocsr()
    f2 = F.f[rest] - E[rest] @ t0
    U = col_of[F.U[~is_piv[F.U]]]
    u = F.u[~is_piv[F.U]]
    L = col_of[F.L[~is_piv[F.L]]]
    l_ = F.l[~is_piv[F.L]]
    red = _Form(n_red, Hr, np.asarray(q).ravel(), A, b, E2, f2, U, u, L, l_, c0, F.n_aux)
    return red, _Elimination(T, t0, np.array(take), lo, hi)


@dataclass
class _AuxBlock:
    """The auxiliary variables' block of the normal matrix, eliminated in closed form.

    With ``z = (x, t)`` and ``H_tt = H_xt = 0``, ``M = [[M_xx, G], [G', M_tt]]`` where, when
    every row of ``A`` touches at most one auxiliary or only auxiliaries ("dense" rows, at most
    :data:`AUX_MAX_DENSE`: the L1 ball's ``1't <= r``), ``M_tt = diag(D) + U'W_dU`` and ``G``
    comes from the sparse rows only. Then ``M_tt^-1 = D^-1 - V K^-1 V'`` (Woodbury, ``V =
    D^-1 U' W_d^1/2``, ``K = I + W_d^1/2 U D^-1 U' W_d^1/2``) and only the Schur complement
    ``S = M_xx - G M_tt^-1 G'`` (``n x n``: ``M_xx``, a sparse ``G D^-1 G'`` and a rank-``d``
    term) is factorised, instead of the lifted ``2n x 2n`` M whose auxiliary block is H's zeros.

    The sparse part ``A_x'W A_x - G D^-1 G'`` is formed without subtracting (:meth:`sparse_part`):
    per auxiliary ``j`` with rows ``r`` (x part ``a_r``, coefficient ``b_r`` on ``t_j``) and the
    rest of its diagonal ``e_j`` (``D_j = e_j + sum_r w_r b_r^2``), by Lagrange's identity
    ``sum_r w_r a_r a_r' - (sum_r w_r b_r a_r)(...)' / D_j = (e_j sum_r w_r a_r a_r' + sum_{r<s} w_r
    w_s (b_s a_r - b_r a_s)(...)') / D_j``, a sum of positive terms. Subtracted, the two sides of
    a coordinate at the L1 ball's centre (both rows active, weights 1e8 and beyond) cancel to an
    absolute error of ``eps w``, which can exceed H's smallest eigenvalues under a weak ridge
    (stop 66: with the ball's sum row rotated, :meth:`_Ipm.aux_matrix`, 45 of 48 random L1 QPs
    certified with the subtraction, 48 without it)."""

    nx: int
    sparse_rows: np.ndarray
    dense_rows: np.ndarray
    Ax_s: sp.csr_matrix  # the sparse rows' x and t columns
    At_s: sp.csr_matrix
    U: np.ndarray  # (d, n_aux): the dense rows' t columns
    #: each sparse row's auxiliary (-1: none)
    row_aux: np.ndarray
    #: the pairs of sparse rows on one auxiliary (indices into the sparse rows) and, one row per
    #: pair, ``b_s a_r - b_r a_s`` (x columns)
    pair_r: np.ndarray
    pair_s: np.ndarray
    P: sp.csr_matrix

    @classmethod
    def detect(cls, F: _Form) -> _AuxBlock | None:
        if F.n_aux == 0:
            return None
        nx = F.N - F.n_aux
        A = F.A.tocsc()
        Ax, At = A[:, :nx].tocsr(), A[:, nx:].tocsr()
        aux_per_row = np.diff(At.indptr)
        dense = np.flatnonzero(aux_per_row > 1)
        if dense.size > AUX_MAX_DENSE or np.any(np.diff(Ax.indptr)[dense] > 0):
            return None  # (the general normal matrix)
        sparse_rows = np.flatnonzero(aux_per_row <= 1)
        Ax_s, At_s = Ax[sparse_rows], At[sparse_rows]
        has = np.diff(At_s.indptr) > 0
        row_aux = np.full(sparse_rows.size, -1)
        row_b = np.zeros(sparse_rows.size)
        row_aux[has] = At_s.indices[At_s.indptr[:-1][has]]
        row_b[has] = At_s.data[At_s.indptr[:-1][has]]
        # the pairs of rows on one auxiliary (the L1 ball's two sides of |x_i - c_i| <= t_i)
        on = np.flatnonzero(row_aux >= 0)
        order = on[np.argsort(row_aux[on], kind="stable")]
        counts = np.bincount(row_aux[on], minlength=F.n_aux)
        if counts.max(initial=0) > AUX_MAX_ROWS:
            return None  # (many rows on one auxiliary: the general normal matrix)
        starts = np.concatenate([[0], np.cumsum(counts)])
        pr: list[np.ndarray] = []
        ps: list[np.ndarray] = []
        for c in range(2, int(counts.max(initial=0)) + 1):
            groups = np.flatnonzero(counts == c)
            if groups.size == 0:
                continue
            rows = order[starts[groups][:, None] + np.arange(c)[None, :]]  # (groups, c)
            i, j = np.triu_indices(c, 1)
            pr.append(rows[:, i].ravel())
            ps.append(rows[:, j].ravel())
        pair_r = np.concatenate(pr) if pr else np.zeros(0, dtype=np.intp)
        pair_s = np.concatenate(ps) if ps else np.zeros(0, dtype=np.intp)
        P = (sp.diags(row_b[pair_s]) @ Ax_s[pair_r] - sp.diags(row_b[pair_r]) @ Ax_s[pair_s]).tocsr()
        return cls(nx, sparse_rows, dense, Ax_s, At_s, At[dense].toarray(), row_aux, pair_r, pair_s, P)

    def sparse_part(self, ws: np.ndarray, D: np.ndarray, e: np.ndarray) -> sp.coo_matrix:
        """``A_x'W A_x - G D^-1 G'`` of the sparse rows (weights ``ws``), a sum of positive terms
        (see the class doc; ``e``: the auxiliaries' diagonals without their sparse rows)."""
        aux = self.row_aux
        on = aux >= 0
        c_row = ws.copy()
        c_row[on] = ws[on] * e[aux[on]] / D[aux[on]]
        c_pair = ws[self.pair_r] * ws[self.pair_s] / D[aux[self.pair_r]]
        out = (self.Ax_s.T @ sp.diags(c_row) @ self.Ax_s + self.P.T @ sp.diags(c_pair) @ self.P).tocoo()
        out.sum_duplicates()
        return out


@dataclass
class _AuxPins:
    """A face's free auxiliaries pinned by exactly one active row on no other free auxiliary
    (``t = alpha + Bm x``), substituted into the face's other rows (``AF x = rhs`` over the
    other free variables ``x_cols``, rows ``rest``); see :meth:`_Ipm._aux_pins`."""

    x_cols: np.ndarray
    aux_cols: np.ndarray
    pivot_rows: np.ndarray
    a: np.ndarray
    alpha: np.ndarray
    Bm: sp.csr_matrix
    rest: np.ndarray
    Ra: sp.csr_matrix
    AF: sp.csr_matrix
    rhs: np.ndarray


def _has_equalities(problem: MergeQP, cset: ConstraintSet) -> bool:
    """Whether the set's linear form has equality rows or fixed variables (``lo == hi``)."""
    lf = lifted_form(cset.members(), problem.shape)
    return lf is not None and (lf.A_eq.shape[0] > 0 or bool(np.any(np.isfinite(lf.lb) & (lf.lb == lf.ub))))


class _Ipm:
    """One interior-point solve (see the module doc)."""

    def __init__(self, problem: MergeQP, cset: ConstraintSet, opts: dict[str, Any], linalg: Any = None,
                 scale: tuple[float, float] | None = None, name: str = "dense_ipm", capped: bool = False):
        """``linalg(H)``: the backend of the dense work (:mod:`.ipm_linalg`; default
        :class:`~.ipm_linalg.HostLinalg`), made from the H the iteration runs on. ``scale``: the
        caller's problem's :func:`~.base.objective_sizes` when ``problem`` is it divided by its scale
        (what the errors report; default: ``problem``'s own). ``name``: the solver the messages
        name; ``capped``: the caller lowered ``max_iter`` below the default, so an iteration that
        reaches it ends with the best iterate (not certified) instead of an error."""
        self.name = name
        self.capped = capped
        self.problem = problem
        self.scale = scale if scale is not None else objective_sizes(problem)
        self.cset = cset
        self.opts = opts
        form = _form(problem, cset)
        # the backend holds H first: where equality rows are eliminated, it forms the reduced H
        # itself (on its device) and keeps it in H's place
        self.la = (linalg or HostLinalg)(form.H)
        self.F, self.elimination = _eliminate(form, self.la.reduce_hessian)
        F = self.F
        self.eta = self.la.max_abs_diagonal() or 1.0
        self.float32_ok = True
        #: float32 factors given up after their first solve (:meth:`_checked32`)
        self.float32_rejected = 0
        self._hd: np.ndarray | None = None
        #: index into :data:`RIDGES` of the ridge that last gave a factorisation, per dtype
        self._ridge_level: dict[str, int] = {}
        self.factorisations = {"float32": 0, "float64": 0}
        self.crossovers: list[str] = []
        self._faces_tried: set[bytes] = set()
        self.face_solves = 0
        self.faces_skipped = 0
        self.crossover_seconds = 0.0
        #: the diagonal regularisation of M (keeps a singular H with few constraints factorisable)
        self.delta = 1e-13 * self.eta
        self.At = F.A.T.tocsr()
        self.Et = F.E.T.tocsr()
        self.aux = _AuxBlock.detect(F)

    # -- pieces
    def _aux_parts(self, w: np.ndarray) -> tuple[Any, ...]:
        """The pieces of :class:`_AuxBlock`'s elimination at weights ``w``: ``D``, ``G`` (sparse,
        ``nx x n_aux``), ``V`` and the Cholesky factor of ``K`` (``None`` without dense rows), the
        sparse rows' weights, the diagonal ``dw`` of the bounds (plus ``delta``), the sparse rows'
        part of the Schur complement (:meth:`_AuxBlock.sparse_part`) and, for the dense rows' term
        ``Z Z'`` (``Z = G V Lk^-T``), the scaling ``dz`` of S to a unit diagonal and the Householder
        rotation that takes ``dz Z`` to ``[R; 0]`` (:func:`_householder`): ``(dz, Vh, T, R)``,
        ``None`` without dense rows."""
        F, ax = self.F, self.aux
        assert ax is not None
        nx = ax.nx
        wA = w[:F.A.shape[0]]
        dw = F.diagonal(w) + self.delta
        ws = wA[ax.sparse_rows]
        D = dw[ax.nx:] + np.asarray(ax.At_s.multiply(ax.At_s).T @ ws).ravel()
        G = (ax.Ax_s.T @ sp.diags(ws) @ ax.At_s).tocsr()
        sparse = ax.sparse_part(ws, D, dw[nx:])
        V = Lk = rot = None
        if ax.dense_rows.size:
            wd = np.sqrt(wA[ax.dense_rows])
            V = (ax.U.T / D[:, None]) * wd[None, :]
            Lk = np.linalg.cholesky(np.eye(wd.size) + (wd[:, None] * ax.U) @ V)
            Z = sla.solve_triangular(Lk, np.asarray(G @ V).T, lower=True).T  # G V Lk^-T
            if Z.shape[1] <= nx:
                # the scaling to S's unit diagonal, then the rotation of the scaled Z
                diag = self._h_diag() + dw[:nx] + _coo_diagonal(sparse, nx) + np.sum(Z * Z, axis=1)
                dz = unit_scaling(diag)
                rot = (dz, *_householder(dz[:, None] * Z))
            else:  # (more dense rows than variables: a tiny problem, Z Z' added as it is)
                sparse = (sparse + sp.coo_matrix(Z @ Z.T)).tocoo()
                sparse.sum_duplicates()
        return D, G, V, Lk, ws, dw, sparse, rot

    def _h_diag(self) -> np.ndarray:
        """``diag(H)`` of the H the iteration runs on (float64; kept)."""
        if self._hd is None:
            self._hd = self.la.hessian_diagonal()
        return self._hd

    def aux_matrix(self, parts: tuple[Any, ...], dtype: Any) -> np.ndarray:
        """The Schur complement ``S = M_xx - G M_tt^-1 G'`` of :class:`_AuxBlock` in ``dtype``; with
        dense rows, scaled and rotated: ``Q'(D S D)Q = Q'(D S0 D)Q + [R R', 0; 0, 0]`` (``S0``: S
        without the dense rows' term ``Z Z'``; ``D``: S's unit-diagonal scaling; ``Q'D Z = [R;
        0]``; :meth:`aux_solver` undoes both). Scaled first, the rotation mixes coordinates of
        comparable size: rotated unscaled, a bound's weight of 1e8 spread over the rotated row
        (a unit-diagonal condition number of 8e7 against 6e6 unrotated, random weights).

        ``Z Z'`` is the L1 ball's sum row ``1't <= r`` seen from x: near the optimum its weight
        grows like ``1 / s``, and along the signs of the nonzero coordinates it dwarfs H's smallest
        eigenvalues there. Added as it is, it made S (scaled to a unit diagonal) as ill-conditioned
        as their ratio: 3e8 in float32 and 4e15 in float64 where ``S0``'s stayed at 2e4 and 3e6,
        so the Newton solves' residuals reached 1e-2 to 0.5 and the iteration stalled (stop 66:
        n = 512, H of rank 120 plus a ridge at 1e-8 of its largest eigenvalue; a relative gap of
        4e-7 after 100 iterations). Rotated onto the first ``d`` coordinates it is a diagonal
        block, which the unit-diagonal scaling takes care of as it does a bound's weight."""
        ax = self.aux
        assert ax is not None
        nx = ax.nx
        D, G, V, Lk, ws, dw, sparse, rot = parts
        la = self.la
        S = la.base(dtype, nx)
        la.add_diagonal(S, dw[:nx])
        la.add_entries(S, sparse.row, sparse.col, sparse.data)
        if rot is not None:
            dz, Vh, T, R = rot
            la.scale(S, dz)
            la.rotate(S, Vh, T)
            d = R.shape[0]
            i, j = np.meshgrid(np.arange(d), np.arange(d), indexing="ij")
            la.add_entries(S, i.ravel(), j.ravel(), (R @ R.T).ravel())
        return S

    def aux_solver(self, solve_QSQ: Any, parts: tuple[Any, ...]) -> Any:
        """A solver of ``M y = r`` from one of :meth:`aux_matrix`'s (rotated and scaled back:
        ``S^-1 = D Q (Q'DSDQ)^-1 Q'D``), by block elimination of the auxiliaries."""
        ax = self.aux
        assert ax is not None
        nx = ax.nx
        D, G, V, Lk, _, _, _, rot = parts
        if rot is None:
            solve_S = solve_QSQ
        else:
            dz, Vh, T, _ = rot

            def solve_S(r: np.ndarray) -> np.ndarray:
                col = (slice(None),) + (None,) * (r.ndim - 1)
                r = dz[col] * r
                y = solve_QSQ(r - Vh @ (T.T @ (Vh.T @ r)))  # Q' D r
                return dz[col] * (y - Vh @ (T @ (Vh.T @ y)))  # D Q y

        def tt_inverse(v: np.ndarray) -> np.ndarray:
            col = (slice(None),) + (None,) * (v.ndim - 1)
            out = v / D[col]
            if V is not None:
                out -= V @ sla.cho_solve((Lk, True), V.T @ v, check_finite=False)
            return out

        def solve(r: np.ndarray) -> np.ndarray:
            rx, rt = r[:nx], r[nx:]
            zx = solve_S(rx - G @ tt_inverse(rt))
            return np.concatenate([zx, tt_inverse(rt - G.T @ zx)])

        return solve

    def normal_matrix(self, w: np.ndarray, dtype: Any) -> np.ndarray:
        """``H + C' diag(w) C + delta I`` in ``dtype`` (a fresh array; ``A'WA`` by a sparse
        product, block diagonal for per-atom rows)."""
        F, la = self.F, self.la
        M = la.base(dtype, F.N)  # (the lifted matrix: the auxiliaries' block of H zero)
        la.add_diagonal(M, F.diagonal(w) + self.delta)
        mA = F.A.shape[0]
        if mA:
            AWA = (self.At @ sp.diags(w[:mA]) @ F.A).tocoo()
            AWA.sum_duplicates()
            la.add_entries(M, AWA.row, AWA.col, AWA.data)
        return M

    def _cholesky(self, w: np.ndarray, dtype: Any, build: Any = None) -> Any:
        """A solver of ``M y = r`` (float64 in and out) from the Cholesky factor of ``M`` in
        ``dtype`` with the smallest ridge of :data:`RIDGES` (relative to M's own scale: near the
        optimum C'WC dwarfs H, and its rounding can make M indefinite by more than any multiple
        of H's scale) that works, starting from the one that worked last (M only grows more
        ill-conditioned); ``None`` when none does, or in float32 when M is too ill-conditioned
        for that precision. In float32 M is first scaled to a unit diagonal (``D M D``, ``D =
        diag(M)^-1/2``): the weights ``lambda / s`` of nearly active constraints grow to 1e10 and
        beyond, and unscaled float32 pivots then failed (box & sign, n = 3072: 3-4 of the 9
        factorisations went to float64; scaled, none, and the solve 20% faster).
        ``build(dtype)``: the matrix (default :meth:`normal_matrix`; :meth:`aux_matrix` for the
        auxiliaries' Schur complement)."""
        if build is None:
            build = lambda dt: self.normal_matrix(w, dt)  # noqa: E731
        key = np.dtype(dtype).name
        ladder = RIDGES[key]
        start = self._ridge_level.get(key, 0)
        la = self.la

        def matrix() -> tuple[Any, np.ndarray | None]:
            """M (float32: scaled to a unit diagonal) and the scaling ``diag(D)`` (``None``: none)."""
            M = build(dtype)
            if dtype != np.float32:
                return M, None
            return M, la.scale_to_unit_diagonal(M)

        M, scale = matrix()
        top = 1.0 if scale is not None else max(la.max_diagonal(M), self.eta)
        for i in range(start, len(ladder)):
            if i > start:
                M, scale = matrix()  # the failed attempt overwrote it
            if ladder[i]:
                la.add_diagonal(M, ladder[i] * top)
            fac = la.cholesky(M)
            if fac is None:
                continue
            self._ridge_level[key] = i
            if scale is not None and la.min_pivot(fac) ** 2 <= 1e-6 * top:
                return None
            return la.solver(fac, scale)
        return None

    def factorise(self, w: np.ndarray, low: bool) -> Any:
        """A solver of ``M y = r`` (``M`` from :meth:`normal_matrix`; ``r`` of shape ``(N,)`` or
        ``(N, k)``): float32 with one refinement step against the float64 M when ``low`` and M
        allows it (checked: :meth:`_checked32`), else float64."""
        solve_small = None
        parts = self._aux_parts(w) if self.aux is not None else None
        build = None if parts is None else (lambda dt: self.aux_matrix(parts, dt))

        def full(solve_part: Any) -> Any:  # a solver of M from one of the matrix factorised
            return solve_part if parts is None else self.aux_solver(solve_part, parts)

        # (weights beyond float32's range come from diverging iterates: float64)
        if low and self.float32_ok and float(np.max(w, initial=0.0)) < 1e30:
            solve_small = self._cholesky(w, np.float32, build)
            # M only grows more ill-conditioned as the iteration goes on: once float32 has
            # failed, the later factorisations go straight to float64
            self.float32_ok = solve_small is not None
        if solve_small is not None:
            self.factorisations["float32"] += 1
            first = full(solve_small)

            def solve32(r: np.ndarray) -> np.ndarray:
                y = first(r)
                return y + first(r - self._matvec(w, y))

            return self._checked32(solve32, w)
        solve64 = self._cholesky(w, np.float64, build)
        if solve64 is None:
            raise SolverError(f"{self.name}: the normal matrix H + C'WC could not be factorised even with a ridge")
        self.factorisations["float64"] += 1
        return full(solve64)

    def _matvec(self, w: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``M y`` with the float64 M (its products: H, the bounds' diagonal, the rows)."""
        F = self.F
        mA = F.A.shape[0]
        col = (slice(None),) + (None,) * (y.ndim - 1)
        My = self.hmul(y) + (F.diagonal(w) + self.delta)[col] * y
        if mA:
            My += self.At @ (w[:mA][col] * (F.A @ y))
        return My

    def _checked32(self, solve32: Any, w: np.ndarray) -> Any:
        """``solve32`` (from a float32 factor, refined once), its first answer checked: where the
        residual is above :data:`FLOAT32_GUARD` of the right-hand side, float32 is given up (here
        and for every later factorisation) and M factorised in float64 instead. The float32 factor
        of a matrix too ill-conditioned for it can pass the pivot test of :meth:`_cholesky`: its
        solves then left residuals of 1e-3 to 0.2 (stop 66, on the L1 ball's Schur complement
        with a rank-2 H) where sound ones stay below 1e-5, and the iteration diverged."""
        current: list[Any] = [solve32]
        checked = [False]

        def solve(r: np.ndarray) -> np.ndarray:
            y = current[0](r)
            if not checked[0]:
                checked[0] = True
                top = max(float(np.max(np.abs(r), initial=0.0)), np.finfo(float).tiny)
                res = float(np.max(np.abs(r - self._matvec(w, y)), initial=0.0))
                if not res <= FLOAT32_GUARD * top:
                    self.float32_ok = False
                    self.float32_rejected += 1
                    current[0] = self.factorise(w, False)
                    y = current[0](r)
            return y

        return solve

    # -- the iteration
    def run(self) -> tuple[np.ndarray, SolveStatus, int, dict[str, Any]]:
        fixed = self._fixed_point()
        if fixed is not None:
            return fixed, SolveStatus.OPTIMAL, 0, {"ipm_iterations": 0, "note": "every variable is fixed "
                                                   "(lo == hi): the set's one point"}
        F, opts = self.F, self.opts
        P = self.problem
        tol = float(opts["tol"])
        m = F.m
        d = F.d()
        x = self._start()
        s = np.maximum(d - F.Cx(x), 1.0)
        lam = np.ones(m)
        y = np.zeros(F.E.shape[0])
        size = 1.0 + float(np.max(np.abs(d), initial=0.0))
        qscale = 1.0 + float(np.max(np.abs(F.q), initial=0.0))
        # the relative gap's scale never falls below this (units of J): where J* = 0 at d = 0 (c = 0),
        # J and its terms vanish along the iterates, and without a floor the relative gap grew as
        # they converged (the start became the "best" iterate: "no feasible point" on box:0,1)
        floor = SCALE_FLOOR * (abs(P.c + F.c0) + float(np.max(np.abs(F.q), initial=0.0)) + self.eta)
        status = SolveStatus.MAX_ITERATIONS
        # crossover "stalled" (torch_ipm's "auto" on a bounded set): only from an iterate whose residual
        # stopped falling short of tol, below
        stalled_only = isinstance(opts["crossover"], str) and opts["crossover"] == "stalled"
        budget = int(opts["crossover_face_solves"]) if opts["crossover"] and not stalled_only else 0
        it = 0
        history: list[tuple[float, float, float]] = []
        # the best iterate by max(relative gap, dual residual, primal residual)
        best: tuple[float, np.ndarray, int, tuple[float, float, float]] = (math.inf, x, 0, (math.inf,) * 3)
        since_best = 0
        crossed = False
        for it in range(int(opts["max_iter"]) + 1):
            Hx = self.hmul(x)
            rd = Hx + F.q + F.Ctv(lam) + (self.Et @ y if y.size else 0.0)
            rp = F.Cx(x) + s - d
            re = F.E @ x - F.f
            J = float(0.5 * x @ Hx + F.q @ x) + P.c + F.c0
            terms = abs(P.c + F.c0) + abs(0.5 * float(x @ Hx)) + abs(float(F.q @ x))
            scale = max(abs(J), 1e-8 * terms, floor, np.finfo(float).tiny)
            gap = float(s @ lam) if m else 0.0
            err_d = float(np.max(np.abs(rd), initial=0.0)) / (qscale + float(np.max(np.abs(Hx), initial=0.0)))
            err_p = max(float(np.max(np.abs(rp), initial=0.0)), float(np.max(np.abs(re), initial=0.0))) / size
            with np.errstate(over="ignore"):
                history.append((gap / scale, err_d, err_p))
            if float(np.max(np.abs(x), initial=0.0)) > DIVERGED * size:
                raise unbounded_claim(P, self.cset, self.name, "diverged iterates", self.lift(x)[:P.n])
            merit = max(history[-1])
            if merit < best[0]:
                best, since_best = (merit, x, it, history[-1]), 0
            else:
                since_best += 1
            if merit <= tol:
                status = SolveStatus.OPTIMAL
                break
            if gap <= tol * scale and (since_best >= 2 or merit > 1e3 * best[0]):
                # complementarity is reached but a residual has stopped falling (its float64
                # floor on an ill-conditioned M): the best iterate is the answer, or with crossover
                # "stalled" the minimiser of the face it points at (an interior point off its face by
                # 1e-9 left the certificate's first-order gap at 4e-8 of |J|)
                if stalled_only and err_p <= 1e-6 and int(opts["crossover_face_solves"]) > 0:
                    t_cross = time.perf_counter()
                    xc = self._crossover(x, s, lam, gap / m if m else 0.0)
                    self.crossover_seconds += time.perf_counter() - t_cross
                    if xc is not None:
                        x, crossed = xc, True
                        status = SolveStatus.OPTIMAL
                        break
                status = SolveStatus.OPTIMAL if best[0] <= math.sqrt(tol) else SolveStatus.INACCURATE
                break
            if it == int(opts["max_iter"]):
                break
            mu = gap / m if m else 0.0
            if self.face_solves < budget and gap <= float(opts["crossover_from"]) * scale and err_p <= 1e-6:
                t_cross = time.perf_counter()
                xc = self._crossover(x, s, lam, mu)
                self.crossover_seconds += time.perf_counter() - t_cross
                if xc is not None:
                    x, crossed = xc, True
                    status = SolveStatus.OPTIMAL
                    break
            low = opts["precision"] == "mixed" or (opts["precision"] == "auto"
                                                   and gap > float(opts["float32_until"]) * scale)
            dx, dy, dl, ds = self._direction(s, lam, rd, rp, re, mu, low)
            a = min(1.0, STEP_FRACTION * min(_max_step(s, ds), _max_step(lam, dl)))
            x = x + a * dx
            if y.size:
                y = y + a * dy
            lam = lam + a * dl
            s = s + a * ds
        if status == SolveStatus.OPTIMAL and crossed:
            last = history[-1]
        else:
            _, x, _, last = best
        # stopped by a max_iter the caller lowered while the infeasibility was still falling (it
        # halved over the last three iterations): the best iterate, not an empty set (whose
        # infeasibility stalls at its distance to the constraints)
        falling = len(history) < 4 or history[-1][2] < 0.5 * history[-4][2]
        stopped_by_cap = self.capped and status == SolveStatus.MAX_ITERATIONS and falling
        if status != SolveStatus.OPTIMAL and last[2] > 1e-6 and not stopped_by_cap:
            scale_note = f"max |g| {self.scale[0]:.3g}, max diag H {self.scale[1]:.3g}"
            raise SolverError(
                f"{self.name}: no feasible point after {it} iterations (relative primal residual "
                f"{last[2]:.2g}): the set {self.cset.spec} may be empty (mergeqp.solve checks that before any "
                f"solver runs, unless check_feasibility=False), or the iteration lost its accuracy on a badly "
                f"scaled problem ({scale_note}): rescale H and g, or try solver='active_set' or 'osqp'")
        x = self._clip(x)
        info = {"ipm_iterations": it, "factorisations": dict(self.factorisations),
                "float32_rejected": self.float32_rejected,
                "crossover": list(self.crossovers), "crossover_face_solves": self.face_solves,
                "crossover_faces_skipped": self.faces_skipped, "crossover_seconds": self.crossover_seconds,
                "relative_gap": last[0], "dual_residual": last[1], "primal_residual": last[2]}
        if stopped_by_cap:
            info["note"] = (f"stopped at max_iter = {it} (lowered below the default "
                            f"{DenseIpmSolver.defaults['max_iter']}): the best iterate, not yet optimal or feasible")
        if self.elimination is not None:
            info["equalities_eliminated"] = int(self.elimination.taken.size)
        if self.la.device is not None:
            info["device"] = str(self.la.device)
        return self.lift(x)[:P.n], status, it, info

    def _fixed_point(self) -> np.ndarray | None:
        """The set's one point where equality rows of one variable each fix every variable (a
        box with ``lo == hi``: :func:`_eliminate` leaves that form as it is, and the iteration had
        no interior to run in: on H with a zero row and a small scale it ended "no feasible point",
        a review's find, stop 67); ``None`` otherwise, or where that point breaks an inequality
        (the iteration then reports it)."""
        F = self.F
        if self.elimination is not None or F.n_aux or F.E.shape[0] < F.N:
            return None
        E = F.E.tocoo()
        keep = E.data != 0
        rows, cols, vals = E.row[keep], E.col[keep], E.data[keep]
        if rows.size == 0 or np.bincount(rows, minlength=F.E.shape[0]).max() != 1:
            return None
        x = np.full(F.N, np.nan)
        x[cols] = F.f[rows] / vals
        if not bool(np.all(np.isfinite(x))):
            return None
        if not bool(np.allclose(F.E @ x, F.f, rtol=1e-12, atol=0.0)):
            return None  # (two rows fixing one variable at different values)
        slack = F.d() - F.Cx(x)
        if slack.size and float(np.min(slack)) < -1e-12 * (1.0 + float(np.max(np.abs(F.d())))):
            return None
        return self.lift(self._clip(x))[:self.problem.n]

    def hmul(self, y: np.ndarray) -> np.ndarray:
        """``H y`` of the lifted H by the backend (:meth:`_Form.Hmul`)."""
        return self.F.Hmul(y, self.la.hmul)

    def lift(self, x: np.ndarray) -> np.ndarray:
        """The solver's variables back in the form's (pivots of eliminated equality rows restored)."""
        return x if self.elimination is None else self.elimination.lift(x)

    def _direction(self, s: np.ndarray, lam: np.ndarray, rd: np.ndarray, rp: np.ndarray, re: np.ndarray,
                   mu: float, low: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Mehrotra's predictor-corrector direction ``(dx, dy, dlambda, ds)``: one factorisation
        of M (float32 when ``low``; again in float64 when the float32 solve overflowed), two
        solves."""
        F = self.F
        m = F.m
        w = lam / s if m else np.zeros(0)
        for low_now in ((True, False) if low else (False,)):
            solve_M = self.factorise(w, low_now)
            with np.errstate(over="ignore", invalid="ignore"):
                try:
                    schur = self._schur(solve_M) if F.E.shape[0] else None
                except SolverError:
                    if low_now:
                        continue  # E M^-1 E' from a float32 factor of M: form it again in float64
                    raise

            def newton(rc: np.ndarray, pure: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
                # pure: the residuals rd, rp, re taken as 0 (a centrality corrector)
                rd_, rp_, re_ = (0.0 * rd, 0.0 * rp, 0.0 * re) if pure else (rd, rp, re)
                h = -rd_ - F.Ctv(w * rp_ - rc / s)
                if schur is not None:
                    MiEt, facE = schur
                    Mih = solve_M(h)
                    dy = cho_solve(facE, F.E @ Mih + re_)
                    dx = Mih - MiEt @ dy
                else:
                    dy, dx = np.zeros(0), solve_M(h)
                dl = w * (F.Cx(dx) + rp_) - rc / s
                ds = -(rc + s * dl) / lam
                return dx, dy, dl, ds

            with np.errstate(over="ignore", invalid="ignore"):
                dx, dy, dl, ds = newton(s * lam)
                a = min(_max_step(s, ds), _max_step(lam, dl))
                mu_aff = float((s + a * ds) @ (lam + a * dl)) / m if m else 0.0
                sigma = (mu_aff / mu) ** 3 if mu > 0 else 0.0
                out = newton(s * lam + ds * dl - sigma * mu)
                for _ in range(int(self.opts["correctors"]) if m else 0):
                    # Gondzio's multiple centrality correctors: push the complementarity products of
                    # a longer trial step into [0.1, 10] sigma mu (extra solves, no factorisation)
                    a = min(_max_step(s, out[3]), _max_step(lam, out[2]))
                    trial = min(1.0, 1.5 * a + 0.1)
                    v = (s + trial * out[3]) * (lam + trial * out[2])
                    target = sigma * mu
                    t = np.clip(v, 0.1 * target, 10.0 * target) - v
                    t = np.maximum(t, -10.0 * target)
                    corr = newton(-t, pure=True)
                    cand = tuple(o + c for o, c in zip(out, corr))
                    a_new = min(_max_step(s, cand[3]), _max_step(lam, cand[2]))
                    if not a_new >= a + 0.1 * (trial - a):
                        break
                    out = cand
            if all(np.all(np.isfinite(v)) for v in out):
                return out
        raise SolverError(f"{self.name}: the Newton direction is not finite (the iterates diverged)")

    def _start(self) -> np.ndarray:
        """Mid-box where both bounds are finite, one unit inside a single bound, else 0."""
        F = self.F
        lo = np.full(F.N, -np.inf)
        hi = np.full(F.N, np.inf)
        lo[F.L], hi[F.U] = F.l, F.u
        both = np.isfinite(lo) & np.isfinite(hi)
        return np.where(both, 0.5 * (np.where(both, lo, 0) + np.where(both, hi, 0)),
                        np.where(np.isfinite(lo), lo + 1.0, np.where(np.isfinite(hi), hi - 1.0, 0.0)))

    def _clip(self, x: np.ndarray) -> np.ndarray:
        F = self.F
        x = x.copy()
        x[F.U] = np.minimum(x[F.U], F.u)
        x[F.L] = np.maximum(x[F.L], F.l)
        return x

    def _schur(self, solve_M: Any) -> tuple[np.ndarray, Any]:
        """``M^{-1} E'`` and the Cholesky factor of ``E M^{-1} E'`` (equality rows)."""
        F = self.F
        MiEt = solve_M(F.E.T.toarray())
        S = np.asarray(F.E @ MiEt)
        top = float(np.max(np.abs(np.diag(S)), initial=0.0)) or 1.0
        for ridge in (1e-14, 1e-10, 1e-6):
            try:
                return MiEt, sla.cho_factor(S + ridge * top * np.eye(S.shape[0]), check_finite=False)
            except np.linalg.LinAlgError:
                continue
        raise SolverError("dense_ipm: the equality rows are linearly dependent beyond repair "
                          "(E M^-1 E' is not positive definite)")

    # -- crossover
    def _crossover(self, x: np.ndarray, s: np.ndarray, lam: np.ndarray, mu: float) -> np.ndarray | None:
        """The minimiser of the face that the iterate points at, if it certifies (else ``None``).

        The guess: constraints with ``s_i < lambda_i`` or ``s_i < sqrt(mu)``. Then up to
        :data:`CROSSOVER_ROUNDS` primal-dual corrections: violated constraints join the face,
        constraints whose multiplier is clearly negative leave it. A face already tried is not
        certified again. A feasible face minimiser whose multipliers are not all of the right
        sign is offered to the certificate before the corrections go on (degenerate points)."""
        if self.F.H is None:  # the reduced H was formed on a device: the face solves need it here
            self.F.H = self.la.host_hessian()
        F = self.F
        mA, mU = F.A.shape[0], F.U.size
        th = math.sqrt(max(mu, 0.0))
        act = (s < lam) | (s < th)
        act_A, act_U, act_L = act[:mA].copy(), act[mA:mA + mU].copy(), act[mA + mU:].copy()
        lam_U, lam_L = lam[mA:mA + mU], lam[mA + mU:]
        gscale = 1.0 + float(np.max(np.abs(F.q), initial=0.0)) + self.eta
        xc = None
        for _ in range(CROSSOVER_ROUNDS):
            key = np.packbits(np.concatenate([act_A, act_U, act_L])).tobytes()
            if key in self._faces_tried:
                self.faces_skipped += 1  # the same face as an earlier attempt: no new answer
                return None
            self._faces_tried.add(key)
            self.face_solves += 1
            out = self._face(act_A, act_U, act_L, lam_U, lam_L, x)
            if out is None:
                self.crossovers.append("face not solvable")
                return None
            xc, nu_A, at_U, at_L, r, singular = out
            vA = F.A @ xc - F.b > 1e-12 * (1.0 + np.abs(F.b))
            vU = xc[F.U] - F.u > 1e-12 * (1.0 + np.abs(F.u))
            vL = F.l - xc[F.L] > 1e-12 * (1.0 + np.abs(F.l))
            # multipliers of the face's constraints (A x <= b: nu >= 0; x <= u: -r >= 0; x >= l: r >= 0)
            neg = -1e-9 * gscale
            dA = act_A & (nu_A < neg)
            dU = at_U & (-r[F.U] < neg)
            dL = at_L & (r[F.L] < neg)
            feasible = not (vA.any() or vU.any() or vL.any())
            wrong = dA.any() or dU.any() or dL.any()
            if feasible and not wrong:
                break
            # constraints where more are active than the variables they touch (the L1 ball's
            # centre, an atom at 0 with its sign rows): their multipliers are not determined by
            # the face, so a wrong sign there is the face solve's choice, not a fact (without a
            # wrong sign there is nothing to decide: dA, dU, dL are all False)
            gA, gU, gL = self._degenerate(act_A, at_U, at_L) if wrong else (dA, dU, dL)
            firm = (dA & ~gA).any() or (dU & ~gU).any() or (dL & ~gL).any()
            if feasible and not firm:
                # a feasible face minimiser whose wrong-signed multipliers are all degenerate ones:
                # dropping those constraints sent the corrections away from an optimal point
                xp = self._clip(xc)
                if self._certify(xp)[0]:
                    self.crossovers.append("certified (degenerate face)")
                    return xp
            if singular:
                # the multipliers of a face on which H is singular are not unique, so the
                # corrections wander (measured: they cycled on real singular merge QPs)
                self.crossovers.append("H singular on the face")
                return None
            if not feasible or firm:
                # degenerate constraints stay while others move (dropped, they came back and the
                # corrections wandered); a feasible face with only those left drops them all
                dA, dU, dL = dA & ~gA, dU & ~gU, dL & ~gL
            act_A = (act_A | vA) & ~dA
            act_U = (act_U | vU) & ~dU
            act_L = (act_L | vL) & ~dL
        else:
            self.crossovers.append(f"no consistent face in {CROSSOVER_ROUNDS} rounds")
            return None
        assert xc is not None
        xc = self._clip(xc)
        ok, gap = self._certify(xc)
        if ok:
            self.crossovers.append("certified")
            return xc
        self.crossovers.append(f"not certified (gap {gap:.2g})")
        return None

    def _degenerate(self, act_A: np.ndarray, at_U: np.ndarray, at_L: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Which active rows, upper and lower bounds (masks over all of them) lie in a degenerate
        part of the face: a connected component (variables linked by the active constraints on
        them; rows on more than :data:`ELIMINATE_MAX_SUPPORT` or a quarter of the variables, such
        as the L1 ball's sum or a global simplex, left out) with more active constraints than
        variables. Elsewhere the face's multipliers are unique."""
        F = self.F
        rows_A = np.flatnonzero(act_A)
        rows = F.A[rows_A]
        short = np.diff(rows.indptr) <= min(ELIMINATE_MAX_SUPPORT, max(F.N // 4, 2))
        bounds = np.concatenate([F.U[at_U], F.L[at_L]])
        R = sp.vstack([rows[np.flatnonzero(short)],
                       sp.csr_matrix((np.ones(bounds.size), (np.arange(bounds.size), bounds)),
                                     shape=(bounds.size, F.N))]).tocsr()
        R.eliminate_zeros()  # (stored zeros touch nothing)
        gA = np.zeros(act_A.size, dtype=bool)
        gU = np.zeros(at_U.size, dtype=bool)
        gL = np.zeros(at_L.size, dtype=bool)
        if R.shape[0] == 0 or np.any(np.diff(R.indptr) == 0):
            return gA, gU, gL  # (a row that vanishes: no component to count it in)
        _, comp = _variable_components(R)
        touched = np.zeros(F.N, dtype=bool)
        touched[R.indices] = True
        n_vars = np.bincount(comp[touched], minlength=comp.max() + 1)
        of_row = comp[R.indices[R.indptr[:-1]]]
        deg = (np.bincount(of_row, minlength=comp.max() + 1) > n_vars)[of_row]
        m_short = int(short.sum())
        gA[rows_A[short]] = deg[:m_short]
        gU[np.flatnonzero(at_U)] = deg[m_short:m_short + int(at_U.sum())]
        gL[np.flatnonzero(at_L)] = deg[m_short + int(at_U.sum()):]
        return gA, gU, gL

    def _certify(self, x: np.ndarray) -> tuple[bool, float]:
        """Whether the float64 certificate proves ``x`` (on its bounds) optimal at ``tol`` (or at
        its rounding floor), and the Frank-Wolfe gap it found."""
        P = self.problem
        cert = certify(P, self.cset, P.unflat(self.lift(x)[:P.n]), rel_tol=float(self.opts["tol"]), pinv=False)
        return bool(cert.certified() or (cert.feasible and cert.at_rounding_floor)), float(cert.fw_gap)

    def _aux_pins(self, Fr: np.ndarray, AF: sp.csr_matrix, rhs: np.ndarray) -> _AuxPins | None:
        """The face's free auxiliaries solved from their rows (``None``: none is pinned by
        exactly one active row on no other free auxiliary). The L1 ball's active
        ``+-(x_i - c_i) <= t_i`` makes ``t_i = +-(x_i - c_i)``; the face solve then runs on the
        other free variables, where H is what it is (H is zero on the auxiliaries: with them free,
        the face's H is singular)."""
        nx = self.F.nx
        aux_cols = np.flatnonzero(Fr >= nx)
        if aux_cols.size == 0:
            return None
        x_cols = np.flatnonzero(Fr < nx)
        Aa = AF[:, aux_cols].tocoo()
        per_row = np.bincount(Aa.row, minlength=AF.shape[0])
        ok = (per_row[Aa.row] == 1) & (Aa.data != 0)
        order = np.lexsort((Aa.row[ok], Aa.col[ok]))
        cols, rws, vals = Aa.col[ok][order], Aa.row[ok][order], Aa.data[ok][order]
        ucols, first, count = np.unique(cols, return_index=True, return_counts=True)
        # an auxiliary on two such rows stays: their multipliers are not unique (the face's solve
        # of dependent rows picks the least-norm ones)
        one = count == 1
        if not one.any():
            return None
        pinned, first = ucols[one], first[one]
        pivot_rows, a = rws[first], vals[first]
        x_cols = np.sort(np.concatenate([x_cols, aux_cols[np.setdiff1d(np.arange(aux_cols.size), pinned)]]))
        aux_cols = aux_cols[pinned]
        Px = AF[pivot_rows][:, x_cols]
        Bm = (sp.diags(-1.0 / a) @ Px).tocsr()
        alpha = rhs[pivot_rows] / a
        rest = np.setdiff1d(np.arange(AF.shape[0]), pivot_rows)
        Rx, Ra = AF[rest][:, x_cols], AF[rest][:, aux_cols].tocsr()
        AFx = (Rx + Ra @ Bm).tocsr()
        AFx.eliminate_zeros()
        return _AuxPins(x_cols, aux_cols, pivot_rows, a, alpha, Bm, rest, Ra, AFx, rhs[rest] - Ra @ alpha)

    def _face(self, act_A: np.ndarray, act_U: np.ndarray, act_L: np.ndarray, lam_U: np.ndarray,
              lam_L: np.ndarray, x_ref: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool] | None:
        """Minimise J with the active bounds fixed and the active rows (and ``E``) as equalities:
        ``H_FF x_F + c_F + Abar' nu = 0``, ``Abar x_F = abar``, by a Cholesky of ``H_FF`` and one
        of the Schur complement ``Abar H_FF^-1 Abar'`` (:func:`_definite_solve`; an eigenvalue
        solve where that misses the rows). Active rows on a single free variable fix it first
        (:func:`_single_variable_rows`; their multipliers from its force afterwards), and
        auxiliaries pinned by one row are substituted (:meth:`_aux_pins`). Where H is singular on
        the free variables but the rows pin them, ``H_FF + gamma Abar'Abar`` (same face problem);
        where not, the face minimiser nearest ``x_ref`` (the interior point) through a proximal
        term ``FACE_PROX * max diag H``. Returns ``x``, the
        rows' multipliers ``nu_A`` (0 off the face), which upper / lower bounds fix a variable,
        ``r = Hx + q + A'nu_A + E'nu_E`` (the bounds' multipliers: ``-r`` at an upper bound,
        ``r`` at a lower one) and whether the proximal term was needed; ``None`` when the face
        cannot be solved."""
        F = self.F
        mA = F.A.shape[0]
        xB = np.full(F.N, np.nan)
        xB[F.U[act_U]] = F.u[act_U]
        # a variable with both bounds active (degenerate): the bound with the larger multiplier
        up_mult = np.full(F.N, -np.inf)
        up_mult[F.U[act_U]] = lam_U[act_U]
        take_L = act_L & (lam_L >= up_mult[F.L])
        xB[F.L[take_L]] = F.l[take_L]
        at_U = act_U & (xB[F.U] == F.u) & ~np.isin(F.U, F.L[take_L])
        at_L = take_L
        rows_A = np.flatnonzero(act_A)
        rows = sp.vstack([F.A[rows_A], F.E]).tocsr()

        def split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, sp.csr_matrix]:
            """``fixed``, the free and fixed variables, and the rows on the free ones with the
            fixed values moved to the right-hand side, for the values in ``xB``."""
            fixed = np.isfinite(xB)
            Fr, B = np.flatnonzero(~fixed), np.flatnonzero(fixed)
            rhs = np.concatenate([F.b[rows_A], F.f]) - rows[:, B] @ xB[B]
            return fixed, Fr, B, rhs, rows[:, Fr].tocsr()

        fixed, Fr, B, rhs, AF = split()
        nonvanishing = np.flatnonzero(np.diff(AF.indptr) > 0)
        # active inequality rows on one free variable fix it, like a bound (the L1 ball's rows at
        # x_i = c_i, often both): the variable leaves the solve, the rows get its multiplier after
        fixes = _single_variable_rows(AF, rhs, rows_A.size)
        if fixes is not None:
            pin_rows, pin_a, pin_group, pin_cols, pin_vals = fixes
            pin_vars = Fr[pin_cols]
            xB[pin_vars] = pin_vals
            fixed, Fr, B, rhs, AF = split()
        x = np.where(fixed, xB, 0.0)
        nu = np.zeros(rows.shape[0])
        rho = 0.0
        aux_pins = self._aux_pins(Fr, AF, rhs)
        if aux_pins is None:
            Fs, AFs, rhs_s, rows_s = Fr, AF, rhs, np.arange(rows.shape[0])
        else:
            Fs, AFs, rhs_s, rows_s = Fr[aux_pins.x_cols], aux_pins.AF, aux_pins.rhs, aux_pins.rest
        keep_s = np.flatnonzero(np.diff(AFs.indptr) > 0)  # rows that vanish on F are implied by the bounds
        nu_s = np.zeros(rows_s.size)
        local = None
        if Fs.size:
            HFF = F.Hsub(Fs, Fs)
            cF = F.q[Fs] + F.Hsub(Fs, B) @ xB[B]
            if keep_s.size:
                local = _nullspace_face(HFF, cF, AFs[keep_s], rhs_s[keep_s], self.eta, x_ref[Fs])
        if local is not None:
            xF, nu_s[keep_s], rho = local
            x[Fs] = xF
        elif Fs.size:
            Ad = AFs[keep_s].toarray() if keep_s.size else None
            rhs_k = rhs_s[keep_s]
            fac = None
            for how in ("plain", "augmented", "proximal"):
                if how == "plain":
                    Hk = HFF
                elif how == "augmented":
                    if Ad is None:
                        continue
                    # H singular on F but the active rows pin its flat directions (auxiliaries not
                    # pinned one row each): the face problem is unchanged by gamma/2 |Abar x - abar|^2,
                    # and H_FF + gamma Abar'Abar is definite
                    gamma = self.eta / max(float(np.max(np.sum(Ad * Ad, axis=1))), np.finfo(float).tiny)
                    Hk = HFF + gamma * (Ad.T @ Ad)
                else:
                    rho = FACE_PROX * self.eta
                    Hk = HFF + rho * np.eye(Fs.size)
                fac = _face_factor(Hk, self.eta)
                if fac is not None:
                    break
            if fac is None:
                return None
            if how == "augmented":
                cF = cF - gamma * (Ad.T @ rhs_k)
            elif rho:
                # H singular on F (a flat direction the face does not pin): the minimiser of
                # J + rho/2 |x_F - x_ref|^2 on the face, the one nearest the interior point
                cF = cF - rho * x_ref[Fs]
            xF = -cho_solve(fac, cF)
            if Ad is not None:
                # S = Abar H_FF^-1 Abar' = W'W with U'W = Abar' (U: the upper factor): one triangular
                # solve with the rows as right-hand sides instead of two, and S PSD by construction
                W = triangular_solve(fac, Ad.T, transpose=True)
                S = W.T @ W
                viol = Ad @ xF - rhs_k
                solved = _definite_solve(S, viol)  # independent rows (the usual case): Cholesky
                if solved is not None:
                    cand = xF - triangular_solve(fac, W @ solved)
                    scale = 1.0 + float(np.max(np.abs(rhs_k), initial=0.0))
                    if float(np.max(np.abs(Ad @ cand - rhs_k), initial=0.0)) > 1e-9 * scale:
                        solved = None  # nearly dependent rows: the rank-revealing solve below
                    else:
                        nu_s[keep_s], xF = solved, cand
                if solved is None:
                    ev, V = np.linalg.eigh(S)
                    top = float(ev[-1]) if ev.size else 0.0
                    if not top > 0:
                        return None
                    good = ev > 1e-10 * top
                    nu_s[keep_s] = V[:, good] @ ((V[:, good].T @ viol) / ev[good])
                    xF = xF - triangular_solve(fac, W @ nu_s[keep_s])
            x[Fs] = xF
        else:
            xF = np.zeros(0)
        nu[rows_s] = nu_s
        if aux_pins is not None:
            # the pinned auxiliaries from their rows; those rows' multipliers from stationarity in
            # the auxiliaries (H and q vanish there): a_j nu_j + sum_rest R_a' nu = 0
            x[Fr[aux_pins.aux_cols]] = aux_pins.alpha + aux_pins.Bm @ xF
            nu[aux_pins.pivot_rows] = -(aux_pins.Ra.T @ nu_s) / aux_pins.a
        nu_A = np.zeros(mA)

        def residual() -> np.ndarray:
            nu_A[rows_A] = nu[:rows_A.size]
            out = F.Hmul(x) + F.q + F.A.T @ nu_A
            return out + F.E.T @ nu[rows_A.size:] if F.E.shape[0] else out

        r = residual()
        if fixes is not None:
            # each fixed variable's force -r_v goes to the first of its rows that it pushes the
            # right way (nu >= 0; else to the first, whose negative multiplier drops it)
            net = -r[pin_vars]
            right = np.sign(pin_a) == np.sign(net[pin_group])
            chosen = np.full(net.size, -1)
            for j in range(pin_rows.size):
                g = pin_group[j]
                if chosen[g] < 0 or (right[j] and not right[chosen[g]]):
                    chosen[g] = j
            nu[pin_rows[chosen]] = net / pin_a[chosen]
            r = residual()
        # active rows that vanish on F share the fixed variables' multipliers with their bounds
        # (a degenerate vertex): r does not decide those bounds' signs
        vanish = np.setdiff1d(np.arange(rows_A.size), nonvanishing)
        if vanish.size:
            touched = np.unique(F.A[rows_A[vanish]].indices)
            at_U = at_U & ~np.isin(F.U, touched)
            at_L = at_L & ~np.isin(F.L, touched)
        return x, nu_A, at_U, at_L, r, rho > 0


def _coo_diagonal(part: sp.coo_matrix, n: int) -> np.ndarray:
    """The diagonal of a COO matrix (duplicates summed) of order ``n``."""
    on = part.row == part.col
    return np.bincount(part.row[on], weights=part.data[on], minlength=n)


def _householder(Z: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``Z`` (``n x d``, ``d <= n``) as ``Q [R; 0]`` with ``Q = I - Vh T Vh'`` (LAPACK's Householder
    QR in compact WY form: ``Vh`` unit lower trapezoidal ``n x d``, ``T`` upper triangular): ``(Vh,
    T, R)``."""
    (qr, tau), R = sla.qr(Z, mode="raw")
    d = Z.shape[1]
    Vh = np.tril(qr[:, :d], -1)
    Vh[np.arange(d), np.arange(d)] = 1.0
    T = np.zeros((d, d))
    for i in range(d):  # (LAPACK's dlarft)
        T[i, i] = tau[i]
        if i:
            T[:i, i] = -tau[i] * (T[:i, :i] @ (Vh[:, :i].T @ Vh[:, i]))
    return Vh, T, np.asarray(R)[:d, :d]


def _face_factor(M: np.ndarray, eta: float) -> tuple[np.ndarray, bool] | None:
    """The (upper) Cholesky factor of a face's matrix ``M`` where it is clearly definite: every
    pivot squared above ``1e-12 eta`` (``eta``: max diag H); else ``None``."""
    try:
        fac = sla.cho_factor(M, lower=False, check_finite=False)
    except np.linalg.LinAlgError:
        return None
    return fac if float(np.min(np.abs(np.diag(fac[0])))) ** 2 > 1e-12 * eta else None


def _variable_components(R: sp.csr_matrix) -> tuple[int, np.ndarray]:
    """The connected components of the variables (columns of ``R``) that ``R``'s rows link (an
    entry stored as 0 links nothing): their count and each variable's component."""
    P = R.tocsr(copy=True)
    P.eliminate_zeros()
    P.data[:] = 1.0
    return connected_components((P.T @ P).tocsr(), directed=False)


def _nullspace_face(HFF: np.ndarray, cF: np.ndarray, AF: sp.csr_matrix, rhs: np.ndarray, eta: float,
                    x_ref: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, float] | None:
    """The face problem ``min 1/2 x'H_FF x + c_F'x`` s.t. ``AF x = rhs`` by a null-space method
    where the rows fall into small groups of variables (per-atom rows: sign consensus, the
    pivots' bounds of eliminated simplex sums): each connected component of the rows (at most
    :data:`ELIMINATE_MAX_SUPPORT` variables) gets an orthonormal null-space basis and a
    minimum-norm particular solution from its SVD (batched over components of one shape), and
    the reduced ``Z'H_FF Z`` (``Z`` sparse, block diagonal) is factorised: about
    ``(|F| - rank)^3 / 3`` flops instead of the Cholesky of ``H_FF`` and the Schur complement
    of the rows. Where ``Z'H_FF Z`` is not clearly definite (H singular on the face itself), the
    face minimiser nearest ``x_ref`` as in the general solve: ``+ rho/2 |x - x_ref|^2`` with
    ``rho = FACE_PROX * eta`` (``Z`` has orthonormal columns, so ``Z'Z = I``). Returns ``x_F``,
    the rows' multipliers (minimum-norm per component, the face's own where the rows are
    independent) and ``rho`` (0 unless the proximal term was needed); ``None`` where it does not
    apply (a long row, rows that cannot all be met), for the general face solve."""
    nF = HFF.shape[0]
    AF = AF.tocsr(copy=True)
    AF.sum_duplicates()  # (each entry is then set, not added, into its group's block)
    AF.eliminate_zeros()
    m = AF.shape[0]
    lengths = np.diff(AF.indptr)
    if m == 0 or lengths.max() > ELIMINATE_MAX_SUPPORT or lengths.min() == 0:
        return None  # (a long row: the L1 ball's sum, a global simplex; or a row on nothing)
    R = AF.tocoo()
    r_idx, j_idx, vals = R.row, R.col, R.data
    ncomp, comp = _variable_components(AF)
    nvars = np.bincount(comp, minlength=ncomp)
    row_comp = np.zeros(m, dtype=np.intp)
    row_comp[r_idx] = comp[j_idx]
    nrows = np.bincount(row_comp, minlength=ncomp)
    if nvars[nrows > 0].max(initial=0) > ELIMINATE_MAX_SUPPORT:
        return None
    # each variable's and row's place inside its component
    var_order = np.argsort(comp, kind="stable")
    var_pos = np.empty(nF, dtype=np.intp)
    var_pos[var_order] = np.arange(nF) - np.concatenate([[0], np.cumsum(nvars)])[comp[var_order]]
    row_order = np.argsort(row_comp, kind="stable")
    row_pos = np.empty(m, dtype=np.intp)
    row_pos[row_order] = np.arange(m) - np.concatenate([[0], np.cumsum(nrows)])[row_comp[row_order]]
    # variables on no active row: free, their own columns of Z
    free_vars = np.flatnonzero(nrows[comp] == 0)
    z_r, z_c, z_v = [free_vars], [np.arange(free_vars.size)], [np.ones(free_vars.size)]
    ncol = free_vars.size
    xp = np.zeros(nF)
    groups = []  # per shape: U, 1 / sv (0 past the rank), Vt, the components' variables and rows by place
    shape_key = nrows.astype(np.int64) * (ELIMINATE_MAX_SUPPORT + 1) + nvars
    for key in np.unique(shape_key[nrows > 0]):
        comps = np.flatnonzero(shape_key == key)
        p_, q_ = int(nrows[comps[0]]), int(nvars[comps[0]])
        at = np.full(ncomp, -1, dtype=np.intp)
        at[comps] = np.arange(comps.size)
        A = np.zeros((comps.size, p_, q_))
        sel = at[comp[j_idx]] >= 0
        A[at[comp[j_idx[sel]]], row_pos[r_idx[sel]], var_pos[j_idx[sel]]] = vals[sel]
        vmap = np.zeros((comps.size, q_), dtype=np.intp)
        vsel = at[comp] >= 0
        vmap[at[comp[vsel]], var_pos[vsel]] = np.flatnonzero(vsel)
        rmap = np.zeros((comps.size, p_), dtype=np.intp)
        rsel = at[row_comp] >= 0
        rmap[at[row_comp[rsel]], row_pos[rsel]] = np.flatnonzero(rsel)
        U, sv, Vt = np.linalg.svd(A)  # (g, p, p), (g, k), (g, q, q)
        k = sv.shape[1]
        big = sv > 1e-12 * sv[:, :1]
        inv = np.where(big, 1.0 / np.where(big, sv, 1.0), 0.0)
        b = rhs[rmap]  # (g, p)
        coef = np.einsum("gpk,gp->gk", U[:, :, :k], b) * inv
        xc = np.einsum("gkq,gk->gq", Vt[:, :k, :], coef)
        resid = np.einsum("gpq,gq->gp", A, xc) - b
        if np.max(np.abs(resid), initial=0.0) > 1e-9 * (1.0 + float(np.max(np.abs(b), initial=0.0))):
            return None  # rows that cannot all be met
        xp[vmap] = xc
        rank = big.sum(axis=1)
        null = np.arange(q_)[None, :] >= rank[:, None]  # (g, q): rows of Vt spanning the null space
        gi, ki = np.nonzero(null)
        cols = ncol + np.arange(gi.size)
        ncol += gi.size
        z_r.append(vmap[gi].ravel())
        z_c.append(np.repeat(cols, q_))
        z_v.append(Vt[gi, ki, :].ravel())
        groups.append((U[:, :, :k], inv, Vt[:, :k, :], vmap, rmap))
    Z = sp.csr_matrix((np.concatenate(z_v), (np.concatenate(z_r), np.concatenate(z_c))), shape=(nF, ncol))
    x, rho = xp, 0.0
    if ncol:
        ZT = Z.T.tocsr()
        HZ = np.asarray(ZT @ HFF).T  # H_FF Z (H symmetric): a sparse-dense product
        Hz = np.asarray(ZT @ HZ)
        Hz = 0.5 * (Hz + Hz.T)
        fac = None
        for rho in (0.0, FACE_PROX * eta):
            fac = _face_factor(Hz + rho * np.eye(ncol) if rho else Hz, eta)
            if fac is not None:
                break
        if fac is None:
            return None
        shift = rho * (xp - x_ref) if rho and x_ref is not None else 0.0
        y = -cho_solve(fac, np.asarray(ZT @ (HFF @ xp + cF + shift)).ravel())
        x = xp + Z @ y
    # the rows' multipliers: AF' nu = -g on each component, minimum norm (g with the proximal
    # term where it was needed, as the general solve's)
    g = HFF @ x + cF + (rho * (x - x_ref) if rho and x_ref is not None else 0.0)
    nu = np.zeros(m)
    for Uk, inv, Vtk, vmap, rmap in groups:
        nu[rmap] = -np.einsum("gpk,gk->gp", Uk, np.einsum("gkq,gq->gk", Vtk, g[vmap]) * inv)
    return x, nu, rho


def _single_variable_rows(AF: sp.csr_matrix, rhs: np.ndarray, m: int
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Among the first ``m`` rows of a face's ``AF x = rhs`` (active inequalities), those on a
    single free variable, grouped by variable where every row of a group gives it the same value:
    ``(rows, their coefficients, their group, each group's variable (a column of AF), its
    value)``; ``None`` when there is none. Rows of a group that disagree are left out (the face
    solve meets them as it can)."""
    nnz = np.diff(AF.indptr)[:m]
    single = np.flatnonzero(nnz == 1)
    if single.size == 0:
        return None
    var = AF.indices[AF.indptr[single]]
    a = AF.data[AF.indptr[single]]
    val = rhs[single] / a
    order = np.lexsort((single, var))
    single, var, a, val = single[order], var[order], a[order], val[order]
    uvar, first, group = np.unique(var, return_index=True, return_inverse=True)
    v0 = val[first]
    agree = np.abs(val - v0[group]) <= 1e-12 * (1.0 + np.abs(v0[group]))
    ok_group = np.ones(uvar.size, dtype=bool)
    np.logical_and.at(ok_group, group, agree)
    keep = ok_group[group]
    if not keep.any():
        return None
    renum = np.cumsum(ok_group) - 1
    return single[keep], a[keep], renum[group[keep]], uvar[ok_group], v0[ok_group]


def _definite_solve(S: np.ndarray, r: np.ndarray) -> np.ndarray | None:
    """``S^-1 r`` by Cholesky for a symmetric PSD ``S`` (the Schur complement of a face's active
    rows): plain when its pivots all exceed ``1e-8`` of its largest diagonal entry, else with a
    ridge of ``1e-10`` of it and four steps of iterated Tikhonov (dependent rows, e.g. the L1
    ball's two rows at ``x_i = c_i``: toward the minimum-norm multiplier); ``None`` when neither
    factorises.
    The caller checks that the rows are met (nearly dependent, inconsistent rows are not)."""
    top = float(np.max(np.diag(S), initial=0.0))
    if not top > 0:
        return None
    for ridge in (0.0, 1e-10):
        try:
            fac = sla.cho_factor(S + ridge * top * np.eye(S.shape[0]) if ridge else S, lower=False,
                                 check_finite=False)
        except np.linalg.LinAlgError:
            continue
        if not ridge:
            if float(np.min(np.abs(np.diag(fac[0])))) ** 2 > 1e-8 * top:
                return cho_solve(fac, r)
            continue
        y = cho_solve(fac, r)
        for _ in range(4):  # iterated Tikhonov: toward the least-norm solution, rows met to rounding
            y = y + cho_solve(fac, r - S @ y)
        return y
    return None


def _max_step(v: np.ndarray, dv: np.ndarray) -> float:
    """The largest ``a <= 1`` with ``v + a dv >= 0`` (``v > 0``)."""
    return min(1.0, max_step(v, dv))


class DenseIpmSolver(QPSolver):
    """Dense primal-dual interior point for any polyhedral set (see the module doc).

    Options (defaults): ``tol`` 1e-10 (relative duality gap and residuals), ``max_iter`` 100,
    ``correctors`` 2 (Gondzio's centrality correctors per iteration, 0 for plain Mehrotra),
    ``precision`` "auto" (float32 factorisations while the relative gap is above
    ``float32_until`` 1e-7; "float64" or "mixed" to force), ``crossover`` true (from a relative
    gap of ``crossover_from`` 1e-6, at most ``crossover_face_solves`` 12 face solves) and
    ``threads`` "auto" (the BLAS pools capped at :attr:`AUTO_THREADS` = 8 threads during the
    solve: on a 16-core machine the whole pool made the same solve 2.3x slower than 8 threads;
    "all" leaves them as they are, an integer caps them there; docs/solvers.md)."""

    name = "dense_ipm"
    defaults = {"tol": 1e-10, "max_iter": 100, "correctors": 2, "precision": "auto", "float32_until": 1e-7,
                "crossover": True, "crossover_from": 1e-6, "crossover_face_solves": 12, "threads": "auto"}
    #: ``threads: "auto"``: at most this many BLAS threads during a solve (measured on 16 cores,
    #: sign family, n = 3072: 16 threads 2.80-2.89 s, 8 1.24-1.25 s, 4 1.55-1.79 s, 2 1.82-2.40 s)
    AUTO_THREADS = 8
    #: ``auto`` takes this solver from this many variables (below it Clarabel's fixed costs are
    #: lower: on the sign family Clarabel was 1.5-1.7x faster at n = 64 / 96, 1.2x at 128, and
    #: 1.5-1.6x slower from 192; docs/solvers.md)
    auto_min_n = 128
    #: ... and up to this many without asking the machine for memory; beyond it while ``M``, the
    #: float32 H and H fit (and the reduced H when equality rows are eliminated)
    auto_max_n = 16384
    AUTO_MEMORY_FACTOR = 1.5

    def supports(self, problem: MergeQP, constraints: ConstraintSet) -> str | None:
        if problem.H is None:
            return "needs an explicit H"
        return standard_form_reason(constraints, problem.shape)

    def auto_declines(self, problem: MergeQP, constraints: ConstraintSet) -> str | None:
        if problem.n < self.auto_min_n:
            return (f"n = {problem.n} < {self.auto_min_n}: clarabel was measured faster on problems this "
                    f"small (its fixed costs are lower)")
        factor = self.AUTO_MEMORY_FACTOR
        if problem.n > self.auto_max_n and _has_equalities(problem, constraints):
            factor += 1.0  # the reduced H of the eliminated equality rows (:func:`_eliminate`)
        return work_arrays_decline(problem.n, self.auto_max_n, factor)

    def auto_fallback(self, problem: MergeQP, constraints: ConstraintSet) -> float | None:
        """``auto``'s fallback (since stop 47: it certified a QP times 1e-10 that Clarabel and OSQP did
        not): first from its ``auto_min_n`` (stop 51: where ``active_set`` had stopped uncertified on
        low-rank instances, n = 640-1536, it certified 2-6x faster than Clarabel), after Clarabel
        below it; above :data:`~mergeqp.solvers.base.AUTO_FALLBACK_MAX_N` and up to
        :data:`~mergeqp.solvers.base.AUTO_DENSE_FALLBACK_MAX_N` the only built-in fallback, where it
        does not decline ``auto`` (its memory rule)."""
        n = problem.n
        if n <= base.AUTO_FALLBACK_MAX_N:
            return 0.5 if n >= self.auto_min_n else 2.0
        if n <= base.AUTO_DENSE_FALLBACK_MAX_N and self.auto_declines(problem, constraints) is None:
            return 0.5
        return None

    def check_options(self, options: Any) -> dict[str, Any]:
        opts = super().check_options(options)
        self.check_ranges(opts, {
            "tol": lambda v: v > 0, "max_iter": lambda v: v >= 1, "correctors": lambda v: v >= 0,
            "float32_until": lambda v: v >= 0,
            "crossover_from": lambda v: v > 0, "crossover_face_solves": lambda v: v >= 0,
        })
        if opts["precision"] not in ("auto", "float64", "mixed"):
            raise ValidationError(f"dense_ipm: option precision={opts['precision']!r} must be "
                                  "'auto', 'float64' or 'mixed'")
        try:
            thread_cap(opts["threads"], self.AUTO_THREADS)
        except ValidationError as e:
            raise ValidationError(f"dense_ipm: option {e}") from None
        return opts

    def linalg(self, opts: dict[str, Any]) -> Any:
        """The backend of the dense work, ``H -> backend`` (:mod:`.ipm_linalg`); the host's."""
        return HostLinalg

    def solve(self, problem: MergeQP, constraints: ConstraintSet, x0: np.ndarray | None = None,
              **options: Any) -> RawResult:
        opts = self.check_options(options)
        t0 = time.perf_counter()
        linalg = self.linalg(opts)
        sizes = objective_sizes(problem)
        scaled, factor = unit_scaled(problem, sizes, OBJECTIVE_SCALE_BAND)
        with blas_threads(opts["threads"], self.AUTO_THREADS) as cap:
            ipm = _Ipm(scaled, constraints, opts, linalg, sizes, name=self.name,
                       capped=int(opts["max_iter"]) < int(self.defaults["max_iter"]))
            setup = time.perf_counter() - t0
            x, status, it, info = ipm.run()
        if cap is not None:
            info["blas_threads"] = cap
        if factor != 1.0:
            info["objective_scaled_by"] = factor
        if x0 is not None:
            info["x0"] = "ignored (an interior-point method starts inside the set)"
        return RawResult(problem.unflat(x), status, it, info, setup_seconds=setup)
