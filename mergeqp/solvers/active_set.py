"""A dense active-set solver for box / simplex / L1-ball merge QPs (dense LAPACK).

Method: a primal-dual active-set iteration (PDAS, Hintermueller, Ito & Kunisch 2002) on
faces of the set, globalised by proximal-point regularisation when it cycles:

1. *Face solve*: fix the variables at their bounds (and, for an active L1 ball, at the
   centre); the free variables obey one linear equation per group (per-atom or global simplex
   sum; the active ball's ``sum s_i (x_i - c_i) = radius``), eliminated through one pivot per
   group (null-space method: the reduced Hessian ``Z'HZ`` costs ``O(n_free^2)`` gathers).
   The face problem minimises ``J(x) + rho/2 |x - xc|^2`` (``rho = 0`` in plain PDAS), i.e.
   ``Z'(H + rho I)Z y = -Z'grad``. It is factorised by Cholesky: in float32 for large faces,
   with iterative refinement against float64 products until the reduced gradient reaches
   float64 accuracy; when the face differs from the last factorised one in few coordinates,
   the old factor is reused through a bordered (Schur complement) solve. Singular faces with
   ``rho = 0`` (zero rows of H: dead units; duplicated models) get a ridge
   ``1e-10 max diag H`` plus refinement (proximal iterations from the previous point).
2. *PDAS update*: free variables that left the set become fixed, fixed variables whose
   multiplier has the wrong sign are freed (group multipliers from the free variables), the
   L1 ball is activated / released by its multiplier; a group left without a free variable
   and an unmet equation frees one. The first face, when (nearly) all variables are free, is
   only approximated by 40 conjugate-gradient steps (products, no factorisation), and so is
   the face after it when that is still (nearly) all free (an L1 ball that became active).
3. *Stop* when the Frank-Wolfe gap of the projected face minimiser (an exact, vectorised LMO)
   is below ``tol * max(|J|, 1e-8 (|c| + |x'Hx|/2 + |g'x|))`` -- the certificate's own test --
   or below its float64 rounding floor (interpolating problems, ``J* ~ 0``). On a box with an
   infinite side the gap is taken over the cube of half-width ``max(1, |x|_inf)`` around ``x``.
4. *Proximal PDAS*: on singular or ill-conditioned H (real merge QPs: dead units, fewer
   samples x outputs than unknowns) the face minimisers jump along nearly flat directions and
   PDAS cycles. When a face repeats, ``patience`` steps bring no decrease of J, or the gap
   does not halve within ``patience + 3`` steps while no face update changes fewer
   coordinates than every earlier one (on large problems PDAS converges with thousands of
   changes per step, shrinking slowly), PDAS is run instead on the proximal problems
   ``min_C J(x) + rho/2 |x - xc|^2`` (strongly convex; PDAS converges for rho large enough),
   starting at ``rho = prox_start * max diag H`` from the best point. A solved subproblem
   (stable face) gives the next centre ``xc`` and ``rho`` shrinks by ``prox_decrease``
   (down to ``prox_min * max diag H``); a subproblem whose PDAS stalls (2 steps without
   decrease of its objective, or ``prox_inner_max`` steps) restarts from the centre with
   ``rho`` grown by the same factor. A level also ends, inexactly, when a step lowers the
   subproblem's objective by at most ``prox_accept`` (0.2) of what the level has gained since its
   first step, at a point where that objective is at most its value at the centre ``J(xc)`` (the
   face need not settle: the proximal point method converges with such inexact levels);
   its next centre is that point and the next level starts from its PDAS face update. When the
   same face is accepted twice in a row, ``rho`` jumps to its minimum (the plain problem on that
   face, where no level is accepted inexactly) and returns if that fails. Proximal
   steps move only where H is flat and never raise J, and the face of the optimum is found
   after a few subproblems.

Before the engine runs, coordinates with zero rows of H (dead units) are fixed where the set
says their optimal value (:mod:`.active_set_presolve`: bounds by the sign of ``g``, dead sum
groups by their linear minimiser, an L1 ball's centre where ``g = 0``): left in, they make every
face on which they are free singular (a ridged solve with refinement instead of one Cholesky).
Where every sum group then has two coordinates (a per-atom simplex of two models, capped or not),
the set is a box in half as many unknowns, ``x_a = s``, ``x_b = T - s``, and the engine solves
that box QP (:mod:`.active_set_pairs`, option ``pairs``; its ``H_s = P'HP`` formed once, where each
face of the simplex gathered the same free pairs' ``Z'HZ`` again and took products with all of H).
From n = 256, where H is a ridge plus a low-rank matrix (``sigma I + U U'``, rank at most n / 8 on
bounds and L1 balls, n / 4 on an L1 ball alone with a weak ridge or none, an eighth of the set's
dimension and at least n / 12 on sums;
``sigma = 0``, no ridge, from n = 64), the problem is first solved with ``r``-dimensional algebra
(:mod:`.active_set_low_rank`, option ``low_rank``): through its dual on bounds, by a proximal face
active set with Woodbury face solves on sums and on an L1 ball. Where the rank lies above that
limit and within n / 4, with a weak ridge or none (at most 1e-7 of the top eigenvalue: faces too
ill-conditioned for the engine's proximal levels) on a bounded set of bounds or sums, the engine
first runs within a head start (a tenth of the interior point's estimated work; the rank's pre-test
and the factor's detection run only once its steps are spent, and where they decline the engine goes
on without losing its work), and where that is spent an interior point on ``sigma I + U U'`` gives the
point it goes on from (:mod:`.low_rank_ipm`, stop 69: Newton systems by the Woodbury identity,
``n r^2`` flops each). On a bounded set of bounds or sums whose H the path's sample sees as
well-conditioned (a rank between the sample's n / 6 rows and n / 3, stop 71; sums since stop 72, the
engine's work then counted by the order of the matrices its faces factorise) the same runs late: the
pre-test once the engine's work reached one Cholesky of H, the interior point once it reached the
interior point's estimated work, unless the engine is then within ``LATE_NEAR`` of its own test; and so,
where J is then near 0 (interpolating), for an early candidate on bounds alone whose tests declined at
n / 4; on one-sided bounds (``nonneg``) only late (stop 72). A warm start that meets the stopping test
is returned before any of this. The engine starts at the point found: it
returns at once where the point meets its stopping test (3. above; an interpolating problem's
polished point meets it at the rounding floor; tested before the first CG faces, whose work it
would discard), and otherwise goes on from its face.

The returned point is the best feasible point seen (lowest J; among values of J equal up to
their rounding, the smallest gap). Supported sets: ``Box`` (finite or infinite sides),
``Simplex``, ``GlobalSimplex``, ``L1Ball``, ``Box & Simplex``, ``Box & GlobalSimplex``,
``Box & L1Ball`` (centre inside the box), and the unconstrained problem. Needs an explicit H.
Memory: H, its float32 copy and up to a few ``n_free x n_free`` work arrays. Projections
and the LMO are the shared kernels of :mod:`mergeqp.constraints.kernels` (exact, by sorting
breakpoints); the set is recognised through its members' ``structure`` capability, so a user's
set that declares one is solved here too.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.sparse.linalg import eigsh

from ..constraints import ConstraintSet, SetStructure
from ..constraints.base import members_structure
from ..constraints.kernels import lmo_structure, project_structure
from ..errors import SolverError, UnboundedError, ValidationError
from ..problem import GAP_ROUNDING_FACTOR, MergeQP, curvature_reach, gradient_rounding, stable_norm
from ..solution import SolveStatus
from .active_set_faces import CEN, FREE, HI, LO, FaceBookkeeping, _Face
from .active_set_linalg import FaceFactorisation, solve_psd
from .active_set_low_rank import (LOW_RANK_MIN_N, NO_RIDGE_MIN_N, RidgeLowRank, ball_low_rank, polish_at_zero, rank_limit,
                                  ridge_low_rank, solve_ridge_low_rank, solve_with_weak_ridge, weak_ridge_decides)
from .active_set_pairs import pair_box, pairs_apply
from .active_set_presolve import decouple
from .low_rank_ipm import LATE_WORK, ipm_candidate, ipm_gate, ipm_low_rank, ipm_may_apply, ipm_work, solve_low_rank_ipm
from .base import QPSolver, RawResult, work_arrays_decline
from .blas_threads import blas_threads, thread_cap
from .unbounded import into_recession_cone, verified_claim

__all__ = ["CEN", "FREE", "HI", "LO", "ActiveSetSolver", "set_structure", "solve_psd", "support_value",
           "project_structure", "unbounded_direction"]


def set_structure(cset: ConstraintSet, shape: tuple[int, int]) -> SetStructure | str:
    """The set's structure (bounds, one simplex family or one L1 ball), from the members'
    ``structure`` capability, or why the active-set engine cannot handle it."""
    return members_structure(cset.members(), shape)


# ---------------------------------------------------------------------- linear algebra


#: at a best point of :func:`at_zero_objective` (an interpolating problem), plain or proximal PDAS
#: gives up after this fraction of the usual faces without progress (stop 54)
AT_ZERO_WAIT_DIVISOR = 3
#: :func:`at_zero_objective`'s bound on the gap, in units of the size of J's terms
AT_ZERO_GAP = 1e-8


def at_zero_objective(J: float, size: float, gap: float) -> bool:
    """Whether a point looks like the optimum of an interpolating problem (J* ~ 0): its ``J`` is
    within its own float64 rounding (``8 eps size``, ``size`` = ``|c| + |x'Hx|/2 + |g'x|`` there) and
    its ``gap`` at most :data:`AT_ZERO_GAP` times ``size``, so that only a gap relative to ``|J|`` is
    out of reach. ``J = 0`` at a point far from optimal (``c = 0`` and ``d = 0`` feasible: ``size``
    0 there) is not such a point."""
    return abs(J) <= 8.0 * np.finfo(float).eps * size and gap <= AT_ZERO_GAP * size


def support_value(st: SetStructure, grad: np.ndarray) -> float:
    """``min_{s in C} grad's`` (``-inf`` when unbounded), exact (the shared kernel)."""
    return lmo_structure(st, grad)[0]


# ---------------------------------------------------------------------- the engine


# ---------------------------------------------------------------------- the engine
class _Engine(FaceBookkeeping, FaceFactorisation):
    """One active-set solve of ``min_C J`` for a structured set ``st`` (see the module doc).

    The parts, one responsibility each:

    - :class:`~.active_set_faces.FaceBookkeeping`: faces (which variables are free, at a
      bound or at the ball's centre), their equations and the primal-dual face update;
    - :class:`~.active_set_linalg.FaceFactorisation`: the face solves (reduced Cholesky, float32
      with float64 refinement, bordered updates, ridge, CG);
    - this class: the objective, gap and rounding floor, the FISTA warm-up (:meth:`fista`)
      and the outer iteration with its proximal globalisation and stopping rule (:meth:`run`).

    State: ``H`` (explicit, ``(n, n)``), ``g``, ``c``; ``rho``/``xc``: the proximal term of the
    face solves (0: plain J); ``fine``: refine face solves to the float64 floor; counters
    ``factorisations``, ``fista_steps``, ``proximal_restarts`` for the solution's info.
    """

    def __init__(self, problem: MergeQP, cset: ConstraintSet, st: SetStructure, opts: dict[str, Any]):
        assert problem.H is not None
        self.H = problem.H
        self.g = problem.g
        self.c = problem.c
        self.shape = problem.shape
        self.cset = cset
        self.st = st
        self.opts = opts
        self.n = problem.n
        diag = np.diag(self.H)
        self.sqrt_diag = np.sqrt(np.abs(diag))
        self.eta = float(np.max(np.abs(diag))) if self.n else 1.0
        if not self.eta > 0:
            self.eta = 1.0
        self.factorisations = 0
        self.fista_steps = 0
        #: faces approximated by CG steps instead of a factorisation (at most :data:`CG_FACES`)
        self.cg_faces = 0
        self.solve_methods: set[str] = set()
        self._lipschitz: float | None = None
        self.H32: np.ndarray | None = None
        self._factor: dict[str, Any] | None = None
        self._pivot_of_group: np.ndarray | None = None
        self._prev_status: np.ndarray | None = None
        self.inexact_ok = False
        #: refine face solves to the float64 floor (else to 1e-11 relative, enough to find faces)
        self.fine = False
        self._few_changes = False
        self._singular = False
        self._ill_size = (0.0, math.inf)
        #: ``(grad, s)``: the linear minimiser of the last gradient :meth:`gap` was taken at
        self._lmo: tuple[np.ndarray, np.ndarray | None] | None = None
        #: proximal term ``rho/2 ||x - xc||^2`` added to J in the face solves (0: plain J)
        self.rho = 0.0
        self.xc = np.zeros(self.n)
        self.proximal_restarts = 0
        #: where set, :meth:`run` stops (status ``MAX_ITERATIONS``, ``budget_spent``) once its faces' work
        #: (:func:`face_work`) exceeds it: the head start of :mod:`.low_rank_ipm`'s interior point
        self.budget: float | None = None
        #: asked, with the engine, where the work first exceeds the budget: a larger budget (the run goes on
        #: while its work is within it), or ``None`` (no budget: the run goes on as if it had none). (Given
        #: the engine as its argument, it holds no reference to it: a closure over the engine would keep it,
        #: its H and its factors alive until the garbage collector's next cycle.)
        self.on_budget: Callable[[_Engine], float | None] | None = None
        self.work = 0.0
        self.budget_spent = False
        #: the faces solved so far, and the last one's Frank-Wolfe gap relative to ``max(|J|, 1e-8 x its
        #: terms)``, the measure of the stopping test (``tol``)
        self.faces_done, self.last_rel_gap = 0, math.inf
        #: ``|J|`` over the size of its terms at the last face's point (near 0: an interpolating problem)
        self.last_J_share = math.inf
        #: the work counts a face by :meth:`face_order` (a late candidate's, stop 72) instead of its free
        #: coordinates (the early head start's count, with which it was measured, stop 69)
        self.count_order = False
        self.g_inf = float(np.max(np.abs(self.g), initial=0.0))
        #: recent ``(x, H x + g)`` pairs (:meth:`objective_gradient`)
        self._known: list[tuple[np.ndarray, np.ndarray]] = []
        #: the rows of H that the last sparse product read, ``(S, H[S])``
        self._rows: tuple[np.ndarray, np.ndarray] | None = None
        #: a bound on |s|_1 over the set (for the rounding floor of the gap)
        lo_f = np.where(np.isfinite(st.lo), np.abs(st.lo), 0.0)
        if st.group is not None:
            assert st.totals is not None
            budget = st.totals - np.bincount(st.group, np.where(np.isfinite(st.lo), st.lo, 0.0), minlength=st.totals.size)
            self.s_bound = float(np.sum(lo_f) + np.sum(np.abs(budget)))
        elif st.center is not None:
            assert st.radius is not None
            self.s_bound = float(np.sum(np.abs(st.center)) + st.radius)
        else:
            self.s_bound = float(np.sum(np.maximum(np.abs(st.lo), np.abs(st.hi))))
        #: a bound on :meth:`rounding_floor` at every point of the set (``|x|_inf <= |x|_1 <= s_bound``
        #: bounds the reach, ``|x - s|_1 <= 2 s_bound`` the width); ``inf`` on an unbounded set
        top = float(np.max(self.sqrt_diag, initial=0.0))
        self.floor_bound = 4.0 * GAP_ROUNDING_FACTOR * self.s_bound * gradient_rounding(
            self.n, self.g_inf, top, top * self.s_bound) if math.isfinite(self.s_bound) and (
                st.group is None or bool(np.all(np.isfinite(st.lo)))) else math.inf

    # -- basic pieces
    def project(self, x: np.ndarray) -> np.ndarray:
        return project_structure(self.st, x)

    def objective(self, x: np.ndarray, grad: np.ndarray) -> float:
        # J = 1/2 x'(Hx + g) + 1/2 g'x + c, using grad = Hx + g
        return float(0.5 * x @ grad + 0.5 * self.g @ x + self.c)

    def gap(self, x: np.ndarray, grad: np.ndarray) -> float:
        """The Frank-Wolfe gap ``max_{s in C} grad'(x - s)``. On an unbounded box, where it is
        infinite, the gap over ``C`` intersected with the cube of half-width
        ``max(1, |x|_inf)`` around ``x`` (a stopping rule, not a bound: the certificate
        then uses a Lagrangian gap). Keeps the linear minimiser for :meth:`rounding_floor` at the
        same ``grad``."""
        sv, s_min = lmo_structure(self.st, grad)
        self._lmo = (grad.copy(), s_min)  # (a copy: equal values, not the same array, are what count)
        if math.isfinite(sv):
            return float(grad @ x - sv)
        R = max(1.0, float(np.max(np.abs(x), initial=0.0)))
        s = np.where(grad > 0, np.maximum(self.st.lo, x - R), np.minimum(self.st.hi, x + R))
        return float(grad @ (x - s))

    def sparse_product(self, dx: np.ndarray, support: np.ndarray | None = None) -> np.ndarray:
        """``H dx`` (``(n,)``). When ``dx`` is nonzero on fewer than :data:`SPARSE_PRODUCT`
        of the coordinates, from those rows of H only (H is symmetric: ``H dx = H[S]' dx[S]``),
        which reads a fraction of H instead of all of it (faces change few coordinates)."""
        S = np.flatnonzero(dx) if support is None else support
        if S.size > SPARSE_PRODUCT * self.n:
            return self.H @ dx
        if S.size == 0:
            return np.zeros(self.n)
        cached = self._rows
        if cached is not None and np.array_equal(cached[0], S):
            rows = cached[1]  # the refinement of a face solve repeats the same support
        else:
            rows = np.take(self.H, S, axis=0)
            self._rows = (S, rows)
        return dx[S] @ rows

    def remember_gradient(self, x: np.ndarray, grad_J: np.ndarray) -> None:
        """Keep ``(x, H x + g)`` (the last two) to update gradients at nearby points."""
        self._known = [(x, grad_J), *self._known[:1]]

    def objective_gradient(self, x: np.ndarray) -> np.ndarray:
        """``H x + g`` (``(n,)``): updated from a remembered gradient at a point that differs from
        ``x`` in few coordinates (:meth:`sparse_product`), else a full product; always a full
        product while solving to float64 accuracy (``fine``, or a face that changed in few
        coordinates: likely the last), so that rounding does not accumulate into the answer."""
        if not (self.fine or self._few_changes):
            best: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
            for xr, gr in self._known:
                diff = np.flatnonzero(x != xr)
                if best is None or diff.size < best[0].size:
                    best = (diff, xr, gr)
            if best is not None and best[0].size <= SPARSE_PRODUCT * self.n:
                S, xr, gr = best
                return gr + self.sparse_product(x - xr, S)
        return self.H @ x + self.g

    def inner_grad(self, x: np.ndarray) -> np.ndarray:
        """Gradient of the face solves' objective ``J(x) + rho/2 ||x - xc||^2``."""
        grad = self.objective_gradient(x)
        if self.rho > 0:
            grad += self.rho * (x - self.xc)
        return grad

    def inner_step(self, dx: np.ndarray) -> np.ndarray:
        """Change of :meth:`inner_grad` along ``dx``: ``(H + rho I) dx``."""
        out = self.sparse_product(dx)
        if self.rho > 0:
            out += self.rho * dx
        return out

    def scale(self, J: float) -> float:
        return max(abs(J), 1e-8 * abs(self.c), np.finfo(float).tiny)

    def term_scale(self, x: np.ndarray, grad: np.ndarray) -> float:
        """``|c| + |x'Hx|/2 + |g'x|``: the size of the terms that J sums (its rounding unit)."""
        lin = float(self.g @ x)
        quad = 0.5 * float(x @ grad) - 0.5 * lin
        return abs(self.c) + abs(quad) + abs(lin)

    def certificate_scale(self, J: float, x: np.ndarray, grad: np.ndarray) -> float:
        """The certificate's scale ``max(|J|, 1e-8 (|c| + |x'Hx|/2 + |g'x|))``."""
        return max(abs(J), 1e-8 * self.term_scale(x, grad), np.finfo(float).tiny)

    def rounding_floor(self, x: np.ndarray, grad: np.ndarray) -> float:
        """The rounding error of the float64 gap at ``x`` that the certificate allows: each
        gradient entry is off by ~``sqrt(n) eps (|g|_inf + max_ij |H_ij x_j|)``
        (``curvature_reach``), times ``|x - s|_1`` (``s`` the linear minimiser of ``grad``), times
        the certificate's factor and its 2 (``Certificate.at_rounding_floor``). Below it the gap
        cannot be reduced (interpolating problems, where J* ~ 0, end there). Before stop 54 the
        width was the looser ``|x|_1 + max |s|_1``: a solve ended above the certificate's floor,
        uncertified, and ``auto`` paid for a second solver."""
        err = gradient_rounding(self.n, self.g_inf, *curvature_reach(self.sqrt_diag, x))
        last = self._lmo
        s = last[1] if last is not None and np.array_equal(last[0], grad) else lmo_structure(self.st, grad)[1]
        if s is not None and np.all(np.isfinite(s)):
            return 2.0 * GAP_ROUNDING_FACTOR * err * float(np.sum(np.abs(x - s)))
        width = float(np.sum(np.abs(x))) + self.s_bound
        if not math.isfinite(width):  # unbounded box: the local gap's cube
            width = float(np.sum(np.abs(x))) + self.n * max(1.0, float(np.max(np.abs(x), initial=0.0)))
        return GAP_ROUNDING_FACTOR * err * width

    def converged(self, J: float, gap: float, x: np.ndarray, grad: np.ndarray, floor: bool = True) -> bool:
        """The engine's stopping test at the feasible ``x`` (``grad`` its gradient, ``J`` and ``gap``
        there): the gap within ``tol`` of the certificate's scale, or (``floor``) at its rounding floor."""
        # (the floor is computed only where the gap is below its bound over the whole set)
        return gap <= float(self.opts["tol"]) * self.certificate_scale(J, x, grad) or (
            floor and gap <= self.floor_bound and gap <= self.rounding_floor(x, grad))

    def test_point(self, x: np.ndarray) -> tuple[float, bool, bool]:
        """At the feasible ``x`` (one product with H): J, whether the gap is within ``tol`` of the
        certificate's scale, and whether the stopping test holds (:meth:`converged`: within ``tol``
        or at the rounding floor)."""
        grad = self.H @ x + self.g
        J, gap = self.objective(x, grad), self.gap(x, grad)
        within = self.converged(J, gap, x, grad, floor=False)
        return J, within, within or self.converged(J, gap, x, grad)

    def lipschitz(self) -> float:
        if self._lipschitz is None:
            try:
                top = float(eigsh(self.H, k=1, which="LA", return_eigenvectors=False, tol=1e-6)[0])
            except Exception:  # noqa: BLE001 - fall back to a safe bound
                top = float(np.max(np.sum(np.abs(self.H), axis=1)))
            # floor: a (near-)zero H still needs a finite step (the objective is then ~linear)
            floor = 1e-8 * max(self.eta, float(np.max(np.abs(self.g), initial=0.0)), 1.0)
            self._lipschitz = max(top * 1.02, floor)
        return self._lipschitz

    # -- faces
    def fista(self, x: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray, float]:
        """``steps`` FISTA steps (step ``1/lambda_max(H)``, gradient restart) from feasible ``x``;
        returns the best iterate, its gradient and objective (never worse than ``x``)."""
        L = self.lipschitz()
        H, g = self.H, self.g
        gx = H @ x + g
        best = (x, gx, self.objective(x, gx))
        y, gy = x, gx
        t = 1.0
        for _ in range(steps):
            x_new = self.project(y - gy / L)
            self.fista_steps += 1
            g_new = H @ x_new + g
            J_new = self.objective(x_new, g_new)
            if J_new < best[2]:
                best = (x_new, g_new, J_new)
            if float(gy @ (x_new - x)) > 0:  # restart: the momentum points uphill
                t = 1.0
                y, gy = x_new, g_new
            else:
                t_new = 0.5 * (1.0 + math.sqrt(1.0 + 4.0 * t * t))
                beta = (t - 1.0) / t_new
                y = x_new + beta * (x_new - x)
                gy = H @ y + g
                t = t_new
            x = x_new
        return best

    def face_order(self, face: _Face) -> int:
        """The order of the matrix a face solve factorises: the free coordinates, less one per sum group
        that has any (each group's equation pins its pivot)."""
        free = face.status == FREE
        size = int(np.count_nonzero(free))
        if self.st.group is not None and size:
            size -= int(np.count_nonzero(np.bincount(self.st.group[free])))
        return size

    # -- main loop
    def run(self, x0: np.ndarray | None) -> tuple[np.ndarray, SolveStatus, int, dict[str, Any]]:
        """PDAS on J; on cycling or stalling, proximal PDAS (see the module doc). Returns the
        best feasible point seen, the status, the face iterations and diagnostics."""
        opts = self.opts
        H, g = self.H, self.g
        start = np.full(self.n, 1.0 / self.shape[0]) if x0 is None else np.asarray(x0, dtype=np.float64).ravel()
        x = self.project(start)
        if opts["warm_steps"]:
            x = self.fista(x, int(opts["warm_steps"]))[0]
        grad = H @ x + g
        best_x, best_J = x, self.objective(x, grad)
        best_T = self.term_scale(x, grad)  # the size of J's terms at the best point (its rounding unit)
        patience = int(opts["patience"])
        status = SolveStatus.MAX_ITERATIONS
        last_gap = self.gap(best_x, grad)
        if opts["start_face"] == "point" and x0 is not None:
            face = self._repair(self.identify(x), grad)  # the warm start's face: the guess
        else:
            face = self.identify(self.project(x - grad / self.eta))
        converged = self.converged
        if x0 is not None and converged(best_J, last_gap, best_x, grad):
            # a warm start that already meets the test (the low-rank path's or interior point's point,
            # the last QP's optimum) returns before the CG faces below, whose work it would discard
            return best_x, SolveStatus.OPTIMAL, 0, self._info(0, face, last_gap)
        for _ in range(CG_FACES):
            if not (int(opts["cg_start"]) and np.count_nonzero(face.status == FREE) > 0.9 * self.n):
                break
            # (nearly) all free: the face solve would be a large factorisation; a few CG steps
            # on that face (products only) find most of its bound violations for less. The face
            # after it can be nearly all free too (an L1 ball or simplex that became active)
            x, g_cg = self.face_solve(face, x, cg_steps=int(opts["cg_start"]))
            self.cg_faces += 1
            new_face = self.update_face(face, x, g_cg)
            if new_face.key() == face.key():
                break  # stable: solve it exactly
            face = new_face

        if converged(best_J, last_gap, best_x, grad):
            return best_x, SolveStatus.OPTIMAL, 0, self._info(0, face, last_gap)
        rho_min = float(opts["prox_min"]) * self.eta
        rho_max = 1e4 * self.eta
        dec = float(opts["prox_decrease"])
        anchor = face  # the face of the last accepted proximal point
        xc_J = best_J
        seen: set[bytes] = set()
        inner_best, stall, inner_it = math.inf, 0, 0
        gap_best, gap_stall = last_gap, 0  # plain PDAS: steps since the gap last halved
        fewest_changes = self.n + 1  # plain PDAS: the fewest coordinates a face update changed
        fail_rho = 0.0  # the last rho at which proximal PDAS failed (decrease slowly past it)
        jump_back = 0.0  # rho to return to when a jump to rho_min fails
        no_jump: bytes | None = None  # a face from which a jump failed
        idle = 0  # accepted proximal steps at rho_min that did not lower J
        since_best = 0  # face solves since J fell by more than its rounding or the gap halved
        level_first: float | None = None  # inexact proximal point: the level's first objective
        prev_Jr: float | None = None
        low_gap = last_gap
        it = 0
        for it in range(1, int(opts["max_iter"]) + 1):
            self.work += face_work(int(np.count_nonzero(face.status == FREE)), self.n,
                                   self.face_order(face) if self.count_order else None)
            if self.budget is not None:
                if self.work > self.budget and self.on_budget is not None:
                    self.budget = self.on_budget(self)
                if self.budget is not None and self.work > self.budget:
                    self.budget_spent = True
                    it -= 1
                    break
            rho = self.rho
            key = face.key()
            seen.add(key)
            xf, gf = self.face_solve(face, x)  # gf: gradient of J + rho/2 ||x - xc||^2
            xp = self.project(xf)
            inside = np.array_equal(xp, xf)
            gJf = gf - self.rho * (xf - self.xc) if rho > 0 else gf
            self.remember_gradient(xf, gJf)
            if inside:
                gp = gJf
            else:
                gp = self.objective_gradient(xp)
                self.remember_gradient(xp, gp)
            Jp = self.objective(xp, gp)
            gap = self.gap(xp, gp)
            conv = converged(Jp, gap, xp, gp)
            verified = self.fine or not conv
            if not verified:  # gp was updated from nearby points: stop on a full product only
                gp = H @ xp + g
                Jp = self.objective(xp, gp)
                gap = self.gap(xp, gp)
                self.remember_gradient(xp, gp)
                conv = converged(Jp, gap, xp, gp)
            T_p = self.term_scale(xp, gp)
            noise = 8.0 * np.finfo(float).eps * T_p  # rounding of J
            if Jp < best_J - 1e-13 * T_p or gap < 0.5 * low_gap:
                since_best = 0
            else:
                since_best += 1
            low_gap = min(low_gap, gap)
            # the best point: the lowest J; among Js equal up to rounding, the smallest gap
            if Jp < best_J - noise or (Jp <= best_J + noise and gap < last_gap):
                best_x, best_J, last_gap, best_T = xp, Jp, gap, T_p
            new_face = self.update_face(face, xf, gf)
            stable = new_face.key() == key
            # (for the late interior point's decision: how near the engine's own test this face's point is)
            self.faces_done, self.last_rel_gap = it, gap / max(abs(Jp), 1e-8 * T_p, np.finfo(float).tiny)
            self.last_J_share = abs(Jp) / max(T_p, np.finfo(float).tiny)
            if conv:
                best_x, best_J, last_gap = xp, Jp, gap
                status = SolveStatus.OPTIMAL
                break
            if not verified:
                # converged only with the updated gradient: solve this face again to float64
                # accuracy with full products
                self.fine = True
                x = xf
                continue
            # the best point has J at its own rounding and a gap already tiny in the units of J's
            # terms (J* ~ 0: an interpolating problem, where only a gap relative to |J| stays out of
            # reach): a third of the wait ends a wandering that no face solve improves (stop 54:
            # n = 4608, J ~ 1e-15 from the 9th face, 44 more faces of 3,000 free, 10x the floor).
            # Both at the best point: J = 0 exactly at a point far from optimal (c = 0, d = 0
            # feasible) has a large gap, and a far iterate's rounding says nothing of the best's
            wait = 10 * max(patience, 3) // (AT_ZERO_WAIT_DIVISOR if at_zero_objective(best_J, best_T, last_gap) else 1)
            if since_best >= wait:
                status = SolveStatus.INACCURATE  # J stopped falling: the gap is at its floor
                break
            Jr = Jp + 0.5 * rho * float(np.sum((xp - self.xc) ** 2)) if rho > 0 else Jp
            inexact = False
            if rho > rho_min * (1.0 + 1e-12) and not stable and float(opts["prox_accept"]) > 0:
                # inexact proximal point: the subproblem's objective has stopped falling by more
                # than prox_accept of what this level gained: take its point as the next centre
                if level_first is None:
                    level_first = Jr
                elif prev_Jr is not None and Jr <= prev_Jr and Jr <= xc_J and \
                        prev_Jr - Jr <= float(opts["prox_accept"]) * (level_first - Jr):
                    # (never above the subproblem's value at its centre, J(xc): an accepted centre
                    # then never raises J; before stop 51 a level whose first step started far above
                    # it was accepted at J(xp) > J(xc), and the restarts from the best point cycled)
                    inexact = True
                prev_Jr = Jr
            if (stable or inexact) and rho > 0:
                level_first = prev_Jr = None
                # the proximal subproblem is solved: its minimiser is the next centre (to the
                # accuracy of this solve; solves on a stable face are then refined fully)
                idle = idle + 1 if rho <= rho_min and Jp >= xc_J - 1e-15 * self.scale(xc_J) else 0
                if idle >= patience:
                    status = SolveStatus.INACCURATE  # no progress at float64 resolution
                    break
                settled = key == anchor.key()
                self.xc, xc_J, anchor = xp, Jp, face
                jump_back = 0.0
                if settled and rho > rho_min and key != no_jump:
                    # the same face twice in a row: try the plain problem on it at once
                    jump_back = max(rho / dec, rho_min)
                    self.rho = rho_min
                elif rho / dec <= fail_rho * (1.0 + 1e-12):
                    fail_rho /= dec  # failed there recently: stay once more, then try again
                else:
                    self.rho = max(rho / dec, rho_min)
                self.fine = not inexact
                seen.clear()
                inner_best, stall, inner_it = math.inf, 0, 0
                x = xp
                if inexact:
                    face = new_face
                continue
            if stable and not self.fine:
                # the face is stable: solve on it once more to float64 accuracy
                self.fine = True
                x = xf
                continue
            self.fine = stable
            # the PDAS step did not settle: is the iteration still making progress?
            if Jr < inner_best - 1e-15 * self.scale(Jr):
                inner_best, stall = Jr, 0
            else:
                stall += 1
            if rho == 0:
                # plain PDAS that neither halves the gap nor changes fewer coordinates than ever
                # within a few more steps is not converging either (the objective can fall
                # slowly while the faces wander)
                # progress: the gap halved, or the face changed in fewer coordinates than ever
                # before (PDAS converging on a large problem, thousands of changes per step)
                changes = int(np.count_nonzero(new_face.status != face.status))
                if gap <= 0.5 * gap_best:
                    gap_best, gap_stall = gap, 0
                elif changes < fewest_changes:
                    gap_stall = 0
                else:
                    gap_stall += 1
                fewest_changes = min(fewest_changes, changes)
                stall = max(stall, gap_stall - 3)
            inner_it += 1
            if rho == 0:
                failed = stall >= patience
            else:
                failed = stall >= 2 or inner_it >= int(opts["prox_inner_max"])
            if failed or new_face.key() in seen or stable:
                # cycling or stalling: (re)start proximal PDAS with more regularisation
                # (PDAS converges on J + rho/2 ||x - xc||^2 for rho large enough)
                if rho >= rho_max:
                    status = SolveStatus.INACCURATE
                    break
                if rho == 0:
                    self.rho = float(opts["prox_start"]) * self.eta
                elif jump_back > 0:
                    self.rho, jump_back, no_jump = jump_back, 0.0, anchor.key()
                else:
                    fail_rho = rho
                    self.rho = min(dec * rho, rho_max)
                if rho == 0 or best_J < xc_J - 1e-15 * self.scale(xc_J):
                    # restart from the best point, on the face of a gradient step there
                    self.xc, xc_J = best_x, best_J
                    gc = self.inner_grad(best_x)
                    face = self.identify(self.project(best_x - gc / (self.eta + self.rho)))
                else:
                    face = anchor
                self.proximal_restarts += 1
                level_first = prev_Jr = None
                seen.clear()
                inner_best, stall, inner_it = math.inf, 0, 0
                self.fine = False
                x = self.xc
                continue
            face, x = new_face, xf
        if status != SolveStatus.OPTIMAL and not self.budget_spent and at_zero_objective(best_J, best_T, last_gap):
            # an interpolating problem left short of the certificate's floor: Newton steps on the
            # best point's face (stop 66)
            polished = polish_at_zero(H, g, self.st, best_x, self._face_and_equations)
            if polished is not None:
                gp = H @ polished + g
                Jp, gap = self.objective(polished, gp), self.gap(polished, gp)
                if gap < last_gap and Jp <= best_J + 8.0 * np.finfo(float).eps * self.term_scale(polished, gp):
                    best_x, last_gap = polished, gap
                    if converged(Jp, gap, polished, gp):
                        status = SolveStatus.OPTIMAL
        return best_x, status, it, self._info(it, face, last_gap)

    def restart(self) -> None:
        """Back to plain PDAS for another :meth:`run` on the same problem (after a spent budget): no
        proximal term, no budget; what is cached about H stays."""
        self.rho = 0.0
        self.xc = np.zeros(self.n)
        self.fine = False
        self.budget, self.budget_spent, self.on_budget = None, False, None

    def _face_and_equations(self, y: np.ndarray) -> tuple[np.ndarray, Any]:
        """The free coordinates of ``y``'s face and its group equations (:meth:`equations`)."""
        face = self.identify(y)
        return np.flatnonzero(face.status == FREE), self.equations(face)

    def _info(self, it: int, face: _Face, gap: float) -> dict[str, Any]:
        return {
            "face_iterations": it, "factorisations": self.factorisations,
            "fista_steps": self.fista_steps, "cg_faces": self.cg_faces, "linear_solves": sorted(self.solve_methods),
            "n_free": int(np.sum(face.status == FREE)), "frank_wolfe_gap": gap,
            "tol": float(self.opts["tol"]), "proximal_restarts": self.proximal_restarts,
            "final_rho": self.rho, "work": self.work,
        }


class ActiveSetSolver(QPSolver):
    """Dense primal-dual active-set solver with proximal-point globalisation (see the module doc).

    Options (defaults): ``tol`` 1e-10 (stop when the Frank-Wolfe gap is below ``tol`` times
    ``max(|J|, 1e-8 (|c| + |x'Hx|/2 + |g'x|))``), ``max_iter`` 500 face solves, ``warm_steps``
    0 FISTA steps before the first face, ``cg_start`` 40 conjugate-gradient steps for each of
    the first (at most :data:`CG_FACES`) faces that are (nearly) all free, ``patience`` 3 non-improving PDAS steps before the
    proximal mode (which starts at ``prox_start`` 3e-2 x max diag H, divides rho by
    ``prox_decrease`` 4 after each solved subproblem down to ``prox_min`` 1e-12 x max diag H,
    and gives a subproblem ``prox_inner_max`` 8 face solves; ``prox_accept`` 0.2 ends a level once
    a step gains at most that share of what the level gained, 0 waits for a stable face),
    ``precision`` "auto" (float32
    factorisations with float64 refinement for faces with >= 512 free coordinates; "float64"
    or "mixed" to force), ``update_ratio`` 0.05 (reuse the last factor through a bordered
    solve while fewer than this fraction of coordinates changed), ``ridge`` 1e-10 (relative
    to max diag H, only for singular faces without proximal term), ``refine_steps`` 30 and
    ``start_face`` "gradient" (the first face is that of a projected gradient step from the start;
    "point": the face the start ``x0`` lies on, an active-set guess from a warm start, e.g. the
    previous solution of a sequence of related QPs) and ``threads`` "auto" (the dense BLAS uses at
    most :data:`~mergeqp.solvers.blas_threads.AUTO_MAX_THREADS` threads during the solve: its many
    small operations ran 3-4x slower with 16; "all" leaves the pools as they are, an integer caps
    them there), ``low_rank`` "auto" (the ``r``-dimensional path where H is a ridge, or none, plus a
    low-rank matrix, or the interior point on it at medium ranks with a weak ridge; "off": never) and
    ``pairs`` "auto" (sums of two coordinates solved as a box of half the size; "off": never).

    Solves on the same H array (``MergeQP.with_linear_term``) share its float32 copy, and a
    warm-started one starts from the factor of the last face the previous solve ended on
    (:mod:`mergeqp.matrix_cache`, up to ``active_set_linalg.SHARE_MAX_N`` variables).
    """

    name = "active_set"
    large_n_benchmark = True
    defaults = {"tol": 1e-10, "max_iter": 500, "warm_steps": 0, "patience": 3, "prox_start": 3e-2,
                "prox_decrease": 4.0, "prox_min": 1e-12, "prox_inner_max": 8, "ridge": 1e-10,
                "refine_steps": 30, "precision": "auto", "update_ratio": 0.05, "cg_start": 40,
                "start_face": "gradient", "prox_accept": 0.2, "threads": "auto", "low_rank": "auto",
                "pairs": "auto"}

    #: up to this size ``auto`` takes active_set without asking the machine for memory; beyond it
    #: only while its work arrays fit in the memory available (see :meth:`auto_declines`)
    auto_max_n = 16384
    #: work arrays beyond H, in units of H's bytes, that ``auto`` reserves for larger problems: a
    #: float32 copy of H and up to three float32 blocks of the free variables (measured: 1.05 H
    #: at n = 12288; docs/solvers.md)
    AUTO_MEMORY_FACTOR = 2.0
    #: ... and for a set of pairs (:mod:`.active_set_pairs`), solved as a box of n / 2: ``H_s`` (a
    #: quarter of H), its float32 copy (an eighth) and the free blocks of n / 2 (measured: 0.53 H at
    #: n = 12288, docs/solvers.md stop 65)
    AUTO_MEMORY_FACTOR_PAIRS = 1.0

    def auto_declines(self, problem: MergeQP, constraints: ConstraintSet) -> str | None:
        """Beyond :attr:`auto_max_n` variables, decline when the work arrays (:attr:`AUTO_MEMORY_FACTOR`
        times H, :attr:`AUTO_MEMORY_FACTOR_PAIRS` on a set of pairs) would not fit in the machine's
        available memory (or it is unknown): ``auto`` then takes the matrix-free torch_fista, which
        needs no copy of H but thousands of products with it."""
        factor = self.AUTO_MEMORY_FACTOR
        if problem.n > self.auto_max_n:
            st = set_structure(constraints, problem.shape)
            if not isinstance(st, str) and pairs_apply(st):
                factor = self.AUTO_MEMORY_FACTOR_PAIRS
        why = work_arrays_decline(problem.n, self.auto_max_n, factor)
        return None if why is None else f"{why}; auto prefers the matrix-free torch_fista"

    def supports(self, problem: MergeQP, constraints: ConstraintSet) -> str | None:
        if problem.H is None:
            return "needs an explicit H (use torch_fista for a matvec-only problem)"
        st = set_structure(constraints, problem.shape)
        return st if isinstance(st, str) else None

    def check_options(self, options: Any) -> dict[str, Any]:
        """Known names (base class) and admissible values; errors name the option."""
        opts = super().check_options(options)
        rules = {
            "tol": lambda v: v >= 0, "max_iter": lambda v: v >= 1, "warm_steps": lambda v: v >= 0,
            "patience": lambda v: v >= 1, "prox_start": lambda v: v > 0, "prox_decrease": lambda v: v > 1,
            "prox_min": lambda v: 0 < v <= opts["prox_start"], "prox_inner_max": lambda v: v >= 1,
            "ridge": lambda v: v > 0, "refine_steps": lambda v: v >= 1,
            "update_ratio": lambda v: v >= 0, "cg_start": lambda v: v >= 0,
            "prox_accept": lambda v: 0 <= v < 1,
        }
        self.check_ranges(opts, rules)
        if opts["start_face"] not in ("gradient", "point"):
            raise ValidationError(f"active_set: option start_face={opts['start_face']!r} must be "
                                  "'gradient' or 'point'")
        try:
            thread_cap(opts["threads"])
        except ValidationError as e:
            raise ValidationError(f"active_set: option {e}") from None
        for name in ("low_rank", "pairs"):
            if opts[name] not in ("auto", "off"):
                raise ValidationError(f"active_set: option {name}={opts[name]!r} must be 'auto' or 'off'")
        if opts["precision"] not in ("auto", "float64", "mixed"):
            raise ValidationError(f"active_set: option precision={opts['precision']!r} must be "
                                  "'auto', 'float64' or 'mixed'")
        return opts

    def solve(self, problem: MergeQP, constraints: ConstraintSet, x0: np.ndarray | None = None,
              **options: Any) -> RawResult:
        opts = self.check_options(options)
        t0 = time.perf_counter()
        st = set_structure(constraints, problem.shape)
        if isinstance(st, str):
            raise SolverError(f"active_set: {st}")
        with blas_threads(opts["threads"]) as cap:
            assert problem.H is not None
            split = decouple(problem.H, problem.g, problem.c, problem.shape, st, x0)
            if split is None:
                kept, st_kept, x0_kept = problem, st, x0
            else:  # coordinates with zero rows of H, fixed (active_set_presolve)
                kept, st_kept = split.problem, split.structure
                x0_kept = None if x0 is None else np.asarray(x0, dtype=np.float64).ravel()[split.keep]
            assert kept.H is not None
            paired = None if opts["pairs"] == "off" else pair_box(kept.H, kept.g, kept.c, st_kept)
            if paired is None:
                engine = _Engine(kept, constraints, st_kept, opts)
            else:  # sums of two coordinates: a box of half the size (active_set_pairs)
                engine = _Engine(paired.problem, constraints, paired.structure, opts)
                x0_kept = None if x0_kept is None else paired.start(x0_kept)
            low_rank = _low_rank_start(engine, opts, x0_kept)
            own_start = x0_kept
            if low_rank is not None and low_rank.x is not None:
                x0_kept = low_rank.x
                engine.opts = {**opts, "start_face": "point"}
            elif x0 is not None:
                engine.reuse_shared_factor()
            setup = time.perf_counter() - t0
            if low_rank is not None and low_rank.notes is not None:  # (never warm-started)
                x, status, it, info = _with_interior_point(engine, opts, low_rank)
            else:
                x, status, it, info = engine.run(x0_kept)
                if status != SolveStatus.OPTIMAL and low_rank is not None and low_rank.x is not None:
                    x, status, it, info = _from_own_start(engine, opts, own_start, (x, status, it, info))
            engine.share_factor()
            if low_rank is not None and low_rank.info:
                info["low_rank"] = low_rank.info
        if paired is not None:
            x = paired.expand(x)
            info["paired"] = paired.m
        if split is not None:
            x = split.expand(x)
            info["decoupled"] = split.removed
        if cap is not None:
            info["blas_threads"] = cap
        if not st.bounded:
            why = unbounded_direction(problem, st, x)
            if why is not None:
                raise verified_claim(
                    UnboundedError(f"active_set: the problem is unbounded below on {constraints.spec}: {why}"))
        return RawResult(problem.unflat(x), status, it, info, setup_seconds=setup)


def _from_own_start(engine: _Engine, opts: dict[str, Any], start: np.ndarray | None,
                    first: tuple[np.ndarray, SolveStatus, int, dict[str, Any]]
                    ) -> tuple[np.ndarray, SolveStatus, int, dict[str, Any]]:
    """The engine from its own start (the caller's ``x0`` or none) where, from the low-rank path's point, it
    ended short of its stopping test: the better of the two runs (lower J; a run that met the test first).
    A review of stop 75: on L1 balls whose ridge is 1e-11 to 1e-12 of the top (taken as none) and
    ``J*`` near 0, the engine from the path's point stopped at twice the optimum, uncertified, where from
    its own start it certified; the second run costs time only where the first failed."""
    x1, status1, it1, info1 = first
    engine.restart()
    engine.opts = opts
    x2, status2, it2, info2 = engine.run(start)
    J1, J2 = (float(x @ (0.5 * (engine.H @ x) + engine.g)) for x in (x1, x2))
    runs = {"after_path_start": {"status": status1.value, "face_iterations": it1},
            "own_start": {"status": status2.value, "face_iterations": it2}}
    if status2 == SolveStatus.OPTIMAL or J2 < J1:
        info2["from_own_start"] = {**runs, "kept": "own_start"}
        return x2, status2, it1 + it2, info2
    info1["from_own_start"] = {**runs, "kept": "after_path_start"}
    return x1, status1, it1 + it2, info1


@dataclass
class _LowRankStart:
    """What :func:`_low_rank_start` found: the point for the engine to start from (``None``: its own
    start), what was done (``info["low_rank"]``), and whether the interior point may apply (``notes``:
    the engine then runs first, within a head start, :func:`_with_interior_point`)."""

    x: np.ndarray | None
    info: dict[str, Any]
    #: where the interior point may apply: the path's detection notes, for its own detection after the
    #: engine's head start
    notes: dict[str, Any] | None = None


#: the engine's head start before the interior point, as a share of the interior point's estimated work
#: (:func:`~.low_rank_ipm.ipm_work`)
IPM_HEAD_START = 0.1
#: ... and where the path's sample was well-conditioned (a late candidate, :func:`~.low_rank_ipm.ipm_gate`)
LATE_SHARE = 1.0
#: a late candidate's interior point is not run where the engine's last face had a relative gap (the
#: stopping test's measure, whose ``tol`` is 1e-10) at most this: it is about to finish (planted boxes
#: measured 8e-9 to 2.2e-6 there, interpolating ones 1e3 to 4e7, nearly interpolating ones 2e-2; 1e-6 left a
#: planted box at 1.8x the engine alone, a second QA review, stop 71)
LATE_NEAR = 1e-4
#: an early candidate on bounds alone whose pre-test or detection declined at n / 4 is tried again as a
#: late one (up to n / 3) only where, once the engine's work reached the late head start, ``|J|`` at its
#: last point is at most this share of its terms (an interpolating problem, J* ~ 0: the class where the
#: engine alone wanders; measured there 6e-6 to 6e-4 at that point, on planted boxes 0.3-0.5)
INTERPOLATING = 1e-3


def face_work(n_free: int, n: int, order: int | None = None) -> float:
    """The flops of a face solve with ``n_free`` free coordinates of ``n``: its factorisation (of order
    ``order`` where given, :meth:`_Engine.face_order`, else ``n_free``) and the products with the free
    rows of H."""
    m = n_free if order is None else order
    return m ** 3 / 3.0 + 2.0 * n * n_free


def _with_interior_point(engine: _Engine, opts: dict[str, Any],
                         low_rank: _LowRankStart) -> tuple[np.ndarray, SolveStatus, int, dict[str, Any]]:
    """A cold solve: the engine first, within :data:`IPM_HEAD_START` of the interior point's work: where
    the optimum's free set is small (most coordinates at a bound, one global sum) it finishes there, at a
    fraction of the interior point's cost (a QA review, stop 69: the interior point first cost 2-13x the
    engine alone on such QPs). The head start grows in steps, each test run only where the engine's work
    reached the step before (:func:`_head_start`): first that of the smallest rank above the path's limit,
    then, after the pre-test, that of the rank it counts, after which the factor's detection decides.
    A late candidate (:func:`~.low_rank_ipm.ipm_gate`: the path's sample was well-conditioned, a bounded
    set of bounds or sums) waits until the engine's work reached :data:`~.low_rank_ipm.LATE_WORK` Cholesky
    factorisations of H before the pre-test, then :data:`LATE_SHARE` of the interior point's work (where
    it finishes before the pre-test, nothing is recorded: no test ran); its engine counts a face by the
    order of the matrix it factorises (:meth:`_Engine.face_order`, stop 72).
    Where the pre-test or the detection declines, the engine goes on as if it had no budget (no work
    lost). Where the head start is spent, the interior point's point and the engine again from it (its
    face as the first guess), or from where the head start ended where the iteration gave no point."""
    assert low_rank.notes is not None
    found: list[RidgeLowRank] = []
    engine.budget = IPM_HEAD_START * ipm_work(engine.n, rank_limit(engine.n, engine.st) + 1)
    late = ipm_gate(engine.H, engine.st, low_rank.notes) == "late"
    if late:  # a well-conditioned sample (stop 71): the pre-test only once the engine has worked that long
        engine.budget = max(engine.budget, _late_work(engine))
        # in the flops its faces' factorisations cost (stop 72: on per-atom simplices the free coordinates
        # over-count them by (K / (K - 1))^3 or more, and the interior point ran where the engine was about to
        # finish alone, `simplex_singular` n = 3072 seed 1 0.99 -> 1.74 s)
        engine.count_order = True
        low_rank.info["late"] = True
    engine.on_budget = functools.partial(_head_start, low_rank=low_rank, found=found)
    x, status, it, info = engine.run(None)
    spent = engine.budget_spent
    if not spent and late and "rank_counted" not in low_rank.info and "note" not in low_rank.info:
        low_rank.info.clear()  # no test ran: nothing to say (the caller records no "low_rank")
        return x, status, it, info
    low_rank.info["taken"] = False
    low_rank.info.setdefault("head_start_faces", it)  # (where a test declined: the faces before it)
    if not spent:
        low_rank.info.setdefault("note", "the engine finished within its head start")
        return x, status, it, info
    engine.restart()
    lr = found[-1]
    xi, ipm_info = solve_low_rank_ipm(engine.H, engine.g, engine.st, lr, c=engine.c)
    low_rank.info.update(ipm_info, rank=lr.rank, taken=xi is not None)
    xi = None if xi is None else engine.project(xi)
    # from the interior point's point, or where there is none from where the head start ended
    engine.opts = {**opts, "start_face": "point"}
    x, status, it2, info = engine.run(x if xi is None else xi)
    info["face_iterations"] = it + it2
    return x, status, it + it2, info


def _head_start(engine: _Engine, low_rank: _LowRankStart, found: list[RidgeLowRank]) -> float | None:
    """The engine's next budget where its work first exceeded the last (:attr:`_Engine.on_budget`): after
    the first step, the pre-test's (:func:`~.low_rank_ipm.ipm_candidate`: a QA review, stop 69, measured
    its pivoted Cholesky at +2-5 ms on solves of a few ms, which now end before it); after the second, the
    detection (:func:`~.low_rank_ipm.ipm_low_rank`), whose factor, appended to ``found``, the interior
    point then takes (the budget stays spent). ``None`` where either declines, or, for a late candidate,
    where the engine's last face was within :data:`LATE_NEAR` of its own test (``head_start_faces`` then
    counts the faces before the test)."""
    info = low_rank.info
    assert low_rank.notes is not None
    late = bool(info.get("late"))
    if info.get("converted") and engine.last_J_share > INTERPOLATING:
        return _declined(engine, info, f"tried again as a late candidate, but |J| at the engine's point is "
                         f"{engine.last_J_share:.1e} of its terms (above {INTERPOLATING:g}: not interpolating)")
    if "rank_counted" not in info:
        rank = ipm_candidate(engine.H, engine.st, low_rank.notes, late=late)
        if rank is None and not late and engine.st.group is None:
            # an early candidate on bounds alone whose count declined (a rank above n / 4, or none): counted
            # again up to n / 3 as a late candidate once the engine's work reached LATE_WORK, where the
            # problem then looks interpolating (a QA review, stop 71: interpolating boxes of rank n / 4 to
            # n / 3 whose decaying spectrum made the sample ill-conditioned took 2.5-2.8x dense_ipm, neither
            # gate taking them; on `simplex_pair`, a planted weak-ridge box of rank 0.26 n, the interior
            # point then cost 1.2-1.3x the engine alone)
            return _tried_late(engine, info, "the pre-test counted no rank within n / 4: counted again up to n / 3 "
                               "once the engine's work reaches one Cholesky of H")
        if rank is None:
            return _declined(engine, info, "the pre-test counted no rank above the path's limit and within "
                             f"n / {3 if late else 4}")
        info["rank_counted"] = rank
        budget = (LATE_SHARE if late else IPM_HEAD_START) * ipm_work(engine.n, rank)
        if engine.work <= budget:
            return budget
    if late and engine.last_rel_gap <= LATE_NEAR:
        # the engine's last point is within a few decades of its own test (a planted QP's last faces: a QA
        # review, stop 71, measured 1.5-1.75x where the interior point ran there, and no face after it)
        return _declined(engine, info, f"the engine's relative gap {engine.last_rel_gap:.1e} was within {LATE_NEAR:g}")
    lr = ipm_low_rank(engine.H, engine.st, low_rank.notes, late=late)
    if lr is None and not late and engine.st.group is None:
        # the same for its detection (a decaying spectrum: the pre-test counted below n / 4, the factor lies
        # above it): again up to n / 3, on the late schedule
        return _tried_late(engine, info, "the detection found no factor within n / 4: tried again up to n / 3 once "
                           "the engine's work reaches the late head start",
                           LATE_SHARE * ipm_work(engine.n, info["rank_counted"]))
    if lr is None:
        return _declined(engine, info, "no ridge of at most 1e-7 of the top (or none) plus a rank within "
                         f"n / {3 if late else 4}")
    found.append(lr)
    return engine.budget


def _late_work(engine: _Engine) -> float:
    """The engine's work before a late candidate's pre-test: :data:`~.low_rank_ipm.LATE_WORK` Cholesky
    factorisations of H."""
    return LATE_WORK * engine.n ** 3 / 3.0


def _declined(engine: _Engine, info: dict[str, Any], why: str) -> None:
    """A declined test (:func:`_head_start`): recorded with the faces before it; the engine goes on as if it
    had no budget."""
    info["head_start_faces"] = engine.faces_done
    info["note"] = f"{why}: the engine goes on"


def _tried_late(engine: _Engine, info: dict[str, Any], note: str, at_least: float = 0.0) -> float:
    """An early candidate whose test declined at n / 4 goes on as a late one (:func:`_head_start`): its next
    budget, at least the late head start and ``at_least``."""
    info["late"] = info["converted"] = True
    info["note"] = note
    return max(_late_work(engine), at_least, engine.work)


def _low_rank_start(engine: _Engine, opts: dict[str, Any],
                    x0: np.ndarray | None = None) -> _LowRankStart | None:
    """Where H is a ridge (or none) plus a low-rank matrix (:mod:`.active_set_low_rank`), the path's
    point (``None`` where neither its stages nor its face active set reached an optimum: the engine
    then starts as usual, from the caller's start) and what it did, for the engine to start from (it
    returns at once where the point meets its stopping test); ``None`` where the option is off, the
    problem smaller than ``LOW_RANK_MIN_N`` (``NO_RIDGE_MIN_N`` where H has no ridge), or no such
    structure is found. Above the path's rank limit, an ill-conditioned H on a bounded set of bounds or
    sums is, in a cold solve, a candidate for the interior point of :mod:`.low_rank_ipm` (stop 69;
    ``notes`` set: the caller runs :func:`_with_interior_point`, whose head start runs its pre-test).
    A warm start that meets the stopping test within tol is returned first, before any detection.
    Where a weak ridge was taken as none and decides the optimum (``weak_ridge_decides``: an
    interpolating box) and the point's gap is not within ``tol``, the
    path runs again with the ridge (``solve_with_weak_ridge``), whose point the engine starts from
    where the first failed the test, or where its gap is within ``tol`` or its J lower. A warm start
    ``x0`` (in the engine's coordinates) that meets the stopping test within ``tol``, or at a lower J
    than the path's point, is returned instead (the engine then returns it at once)."""
    if opts["low_rank"] == "off" or engine.n < min(LOW_RANK_MIN_N, NO_RIDGE_MIN_N):
        return None
    warm: tuple[np.ndarray, float, bool] | None = None  # the warm start, its J, whether it meets the test
    if x0 is not None:
        # a warm start that meets the test within tol is returned at once, before any detection or path
        # (a QA review, stop 69: at the optimum, the interior point's start cost 10-20x the engine's test)
        xw = engine.project(np.asarray(x0, dtype=np.float64).ravel())
        J_w, within_w, stops_w = engine.test_point(xw)
        if within_w:
            return _LowRankStart(xw, {"warm_start_kept": True})
        warm = (xw, J_w, stops_w)
    notes: dict[str, Any] = {}
    lr = ridge_low_rank(engine.H, max_rank=rank_limit(engine.n, engine.st), notes=notes)
    if lr is None:  # an L1 ball alone with a weak ridge or none: ranks up to n / 4 (stop 67)
        lr = ball_low_rank(engine.H, engine.st)
    if lr is None:  # a weak ridge and a medium rank on bounds or sums: an interior point (stop 69)
        # (not warm-started: the interior point cannot use the start, and in 1%-step sequences on a
        # per-atom simplex it ran at every step, 1.2-1.4x the engine from the last optimum, a QA review)
        if x0 is not None or not ipm_may_apply(engine.H, engine.st, notes):
            return None
        # (the pre-test and the detection run within the engine's head start, _with_interior_point)
        return _LowRankStart(None, {"method": "interior point"}, notes=notes)
    if lr.sigma > 0 and engine.n < LOW_RANK_MIN_N:
        return None
    # the dual starts from 1/K even when warm-started: centred at the last QP's optimum (most
    # coordinates at a bound) its stages took 1.3-1.5x the Newton steps (docs/solvers.md, stop 62)
    start = engine.project(np.full(engine.n, 1.0 / engine.shape[0]))
    x, info = solve_ridge_low_rank(engine.H, engine.g, engine.st, lr, start, engine.eta)
    x = _weak_ridge_retry(engine, lr, start, x, info)
    if warm is not None and x is not None and warm[2] and warm[1] < engine.test_point(x)[0]:
        # a warm start that meets the test (at the floor) at a lower J than the path's point is kept: from
        # 1/K the path can end elsewhere on a flat set of optima, at the floor with a higher J (a QA review,
        # stop 68: warm-started at dense_ipm's certified point, the answer was the cold one, J 300x higher)
        info["warm_start_kept"] = True
        return _LowRankStart(warm[0], info)
    return _LowRankStart(x, info)


def _weak_ridge_retry(engine: _Engine, lr: RidgeLowRank, start: np.ndarray, x: np.ndarray | None,
                      info: dict[str, Any]) -> np.ndarray | None:
    """The path's point ``x``, or the point of the path run again with the weak ridge that the
    detection took as none (``info["weak_ridge"]`` says what it did), where that decides the optimum."""
    if not weak_ridge_decides(lr, engine.st, engine.g, x):
        return x
    # a weak ridge (below SIGMA_MIN) was taken as none: on an interpolating box it is what decides
    # the optimum among H's flat directions (stop 68). Where the point does not meet the engine's
    # test, the engine's faces are ill-conditioned at the ridge's level and it wandered until its
    # wait ran out; where it meets it only at the rounding floor, J was up to 30% above the optimum
    # that dense_ipm certified. So the path again with the ridge, unless the gap is within tol
    J_x, within, stops = engine.test_point(x) if x is not None else (math.inf, False, False)
    if within:
        return x
    y, other = solve_with_weak_ridge(engine.H, engine.g, engine.st, lr, start, engine.eta)
    used = False
    if y is not None:
        J_y, within_y, _ = engine.test_point(y)
        # (a point that failed the test: the retry's, which the engine then finishes; one at the floor:
        # the retry's where its gap is within tol or its J lower)
        used = not stops or within_y or J_y < J_x
    info["weak_ridge"] = {**other, "used": used}
    return y if used else x


#: at most this many (nearly) all-free first faces are approximated by ``cg_start`` CG steps
#: instead of being factorised
CG_FACES = 2

#: products with H whose vector has fewer nonzeros than this fraction of n read only those rows
SPARSE_PRODUCT = 0.25

#: iterates beyond this multiple of the problem's own size count as diverged (see
#: :func:`unbounded_direction`)
DIVERGED = 1e8


def unbounded_direction(problem: MergeQP, st: SetStructure, x: np.ndarray) -> str | None:
    """Why ``J`` is unbounded below on an unbounded box, read off diverged iterates ``x``:
    ``None`` unless ``|x|_inf`` exceeds :data:`DIVERGED` times the size of the finite bounds,
    ``|g|`` and ``c`` (in units of ``d``), and the direction ``v = x / |x|``, put in the
    box's recession cone, has ``v'Hv <= 1e-10 max diag H``, ``g'v < 0`` and the minimiser of
    ``J`` along the ray, ``t = -g'v / v'Hv``, beyond ``1e3 |x|`` (so a far but finite optimum of
    a badly conditioned problem, which the iterates reach, is not mistaken for one): then
    ``J(t v)`` falls without bound (to float64 precision)."""
    x = np.asarray(x, dtype=np.float64).ravel()
    finite = np.concatenate([np.abs(st.lo[np.isfinite(st.lo)]), np.abs(st.hi[np.isfinite(st.hi)])])
    size = 1.0 + float(np.max(finite, initial=0.0))
    norm = float(np.max(np.abs(x), initial=0.0))
    if not norm > DIVERGED * size:
        return None
    v = into_recession_cone(st, x / float(np.linalg.norm(x)))
    nv = float(np.linalg.norm(v))
    if nv == 0:
        return None
    v /= nv
    gv = float(problem.g @ v)
    curv = float(v @ problem.matvec(v))
    top = float(np.max(np.abs(problem.diagonal()), initial=0.0))
    flat = curv <= 1e-10 * max(top, 1e-300)
    beyond = curv <= 0 or -gv / curv > 1e3 * float(np.linalg.norm(x))
    if gv < -1e-8 * max(stable_norm(problem.g), np.finfo(float).tiny) and flat and beyond:
        return (f"J decreases without bound along the direction v (|v| = 1, inside the set's "
                f"recession cone) with v'Hv = {curv:.2g} and g'v = {gv:.3g} < 0 (the iterates "
                f"reached |d|_inf = {norm:.3g})")
    return None
