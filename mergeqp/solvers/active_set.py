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
   only approximated by 40 conjugate-gradient steps (products, no factorisation).
3. *Stop* when the Frank-Wolfe gap of the projected face minimiser (an exact, vectorised LMO)
   is below ``tol * max(|J|, 1e-8 (|c| + |x'Hx|/2 + |g'x|))`` -- the certificate's own test --
   or below its float64 rounding floor (interpolating problems, ``J* ~ 0``). On a box with an
   infinite side the gap is taken over the cube of half-width ``max(1, |x|_inf)`` around ``x``.
4. *Proximal PDAS*: on singular or ill-conditioned H (real merge QPs: dead units, fewer
   samples x outputs than unknowns) the face minimisers jump along nearly flat directions and
   PDAS cycles. When a face repeats, ``patience`` steps bring no decrease of J, or the gap
   does not halve within ``patience + 3`` steps, PDAS is run instead on the proximal problems
   ``min_C J(x) + rho/2 |x - xc|^2`` (strongly convex; PDAS converges for rho large enough),
   starting at ``rho = prox_start * max diag H`` from the best point. A solved subproblem
   (stable face) gives the next centre ``xc`` and ``rho`` shrinks by ``prox_decrease``
   (down to ``prox_min * max diag H``); a subproblem whose PDAS stalls (2 steps without
   decrease of its objective, or ``prox_inner_max`` steps) restarts from the centre with
   ``rho`` grown by the same factor. When the same face is accepted twice in a row, ``rho``
   jumps to its minimum (the plain problem on that face) and returns if that fails. Proximal
   steps move only where H is flat and never raise J, and the face of the optimum is found
   after a few subproblems.

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

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.linalg as sla

from ..constraints import ConstraintSet, SetStructure
from ..constraints.base import members_structure
from ..constraints.kernels import lmo_structure, project_structure
from ..errors import SolverError, UnboundedError, ValidationError
from ..problem import MergeQP
from ..solution import SolveStatus
from .base import QPSolver, RawResult

FREE, LO, HI, CEN = 0, 1, 2, 3


def set_structure(cset: ConstraintSet, shape: tuple[int, int]) -> SetStructure | str:
    """The set's structure (bounds, one simplex family or one L1 ball), from the members'
    ``structure`` capability, or why the active-set engine cannot handle it."""
    return members_structure(cset.members(), shape)


# ---------------------------------------------------------------------- linear algebra
def solve_psd(M: np.ndarray, rhs: np.ndarray, ridge: float = 1e-10, refine: int = 30,
              try_plain: bool = True, rtol: float = 1e-14, scale: float = 0.0) -> tuple[np.ndarray, str]:
    """Solve ``M y = rhs`` for symmetric PSD ``M`` (``(p, p)``): Cholesky when well posed, else
    Cholesky of ``M + ridge * max(diag M) * I`` with iterative refinement (proximal-point
    iterations from 0, converging to a minimiser of ``1/2 y'My - rhs'y`` when one exists)
    until the residual is below ``rtol (|rhs| + max(diag M) |y|)`` or stalls.
    ``try_plain=False`` skips the plain Cholesky (the caller knows it fails). ``scale``: the
    problem's curvature scale (max diag H); the ridge is relative to ``max(max diag M, scale)``
    so that a face whose curvature is all rounding noise still factorises.
    Returns ``(y, method)``."""
    p = rhs.shape[0]
    if p == 0:
        return np.zeros(0), "empty"
    top = float(np.max(np.diag(M)))
    if not top > 0:
        return np.zeros(p), "zero"
    if try_plain:
        try:
            fac = sla.cho_factor(M, lower=False, check_finite=False, overwrite_a=False)
            if float(np.min(np.abs(np.diag(fac[0])))) ** 2 > 1e-12 * top:
                return sla.cho_solve(fac, rhs, check_finite=False), "cholesky"
        except np.linalg.LinAlgError:
            pass
    eps = ridge * max(top, scale)
    for _ in range(6):
        try:
            fac = sla.cho_factor(M + eps * np.eye(p), lower=False, check_finite=False)
            break
        except np.linalg.LinAlgError:
            eps *= 100.0
    else:
        raise SolverError("active_set: could not factorise the reduced Hessian even with a ridge")
    y = np.zeros(p)
    res = rhs.copy()
    r0 = float(np.linalg.norm(rhs)) or 1.0
    prev = math.inf
    for _ in range(refine):
        y += sla.cho_solve(fac, res, check_finite=False)
        res = rhs - M @ y
        nr = float(np.linalg.norm(res))
        if nr <= rtol * (r0 + top * float(np.linalg.norm(y))) or nr > 0.999 * prev:
            break
        prev = nr
    return y, "ridge+refinement"


def _robust_cholesky(S: np.ndarray) -> tuple[np.ndarray, bool]:
    """Cholesky of a small SPD matrix, with a tiny ridge if rounding made it indefinite."""
    top = max(float(np.max(np.abs(np.diag(S)))), np.finfo(float).tiny)
    for eps in (0.0, 1e-10, 1e-6, 1e-3):
        try:
            return sla.cho_factor(S + eps * top * np.eye(S.shape[0]) if eps else S, lower=False, check_finite=False)
        except np.linalg.LinAlgError:
            continue
    raise np.linalg.LinAlgError("bordered update: Schur complement is not positive definite")


def support_value(st: SetStructure, grad: np.ndarray) -> float:
    """``min_{s in C} grad's`` (``-inf`` when unbounded), exact (the shared kernel)."""
    return lmo_structure(st, grad)[0]


# ---------------------------------------------------------------------- the engine
@dataclass
class _Face:
    status: np.ndarray  # int8 FREE / LO / HI / CEN
    sign: np.ndarray | None  # int8 +-1 on free variables when the L1 ball is active
    ball_active: bool

    def key(self) -> bytes:
        s = b"" if self.sign is None else self.sign.tobytes()
        return self.status.tobytes() + s + bytes([self.ball_active])


class _Engine:
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
        self.eta = float(np.max(np.abs(diag))) if self.n else 1.0
        if not self.eta > 0:
            self.eta = 1.0
        self.factorisations = 0
        self.fista_steps = 0
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
        #: proximal term ``rho/2 ||x - xc||^2`` added to J in the face solves (0: plain J)
        self.rho = 0.0
        self.xc = np.zeros(self.n)
        self.proximal_restarts = 0
        self.g_inf = float(np.max(np.abs(self.g), initial=0.0))
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
        then uses a Lagrangian gap)."""
        sv = support_value(self.st, grad)
        if math.isfinite(sv):
            return float(grad @ x - sv)
        R = max(1.0, float(np.max(np.abs(x), initial=0.0)))
        s = np.where(grad > 0, np.maximum(self.st.lo, x - R), np.minimum(self.st.hi, x + R))
        return float(grad @ (x - s))

    def inner_grad(self, x: np.ndarray) -> np.ndarray:
        """Gradient of the face solves' objective ``J(x) + rho/2 ||x - xc||^2``."""
        grad = self.H @ x + self.g
        if self.rho > 0:
            grad += self.rho * (x - self.xc)
        return grad

    def inner_step(self, dx: np.ndarray) -> np.ndarray:
        """Change of :meth:`inner_grad` along ``dx``: ``(H + rho I) dx``."""
        out = self.H @ dx
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

    def rounding_floor(self, x: np.ndarray) -> float:
        """A bound on the rounding error of the float64 gap at ``x``: each gradient entry is
        off by ~``sqrt(n) eps (|g|_inf + max diag H |x|_inf)``, times ``|x - s|_1``. Below it
        the gap cannot be reduced (interpolating problems, where J* ~ 0, end there)."""
        err = math.sqrt(self.n) * np.finfo(float).eps * (self.g_inf + self.eta * float(np.max(np.abs(x), initial=0.0)))
        width = float(np.sum(np.abs(x))) + self.s_bound
        if not math.isfinite(width):  # unbounded box: the local gap's cube
            width = float(np.sum(np.abs(x))) + self.n * max(1.0, float(np.max(np.abs(x), initial=0.0)))
        return 8.0 * err * width

    def lipschitz(self) -> float:
        if self._lipschitz is None:
            from scipy.sparse.linalg import eigsh

            try:
                top = float(eigsh(self.H, k=1, which="LA", return_eigenvectors=False, tol=1e-6)[0])
            except Exception:  # noqa: BLE001 - fall back to a safe bound
                top = float(np.max(np.sum(np.abs(self.H), axis=1)))
            # floor: a (near-)zero H still needs a finite step (the objective is then ~linear)
            floor = 1e-8 * max(self.eta, float(np.max(np.abs(self.g), initial=0.0)), 1.0)
            self._lipschitz = max(top * 1.02, floor)
        return self._lipschitz

    # -- faces
    def identify(self, y: np.ndarray) -> _Face:
        """The face of the feasible point ``y`` (exact comparisons: projections return bounds
        and centres exactly)."""
        st = self.st
        status = np.zeros(self.n, dtype=np.int8)
        status[y == st.lo] = LO
        status[(y == st.hi) & (status == FREE)] = HI
        sign = None
        ball = False
        if st.center is not None:
            assert st.radius is not None
            dist = float(np.sum(np.abs(y - st.center)))
            ball = dist >= st.radius * (1.0 - 1e-12)
            if ball:
                status[(y == st.center) & (status == FREE)] = CEN
                sign = np.where(status == FREE, np.sign(y - st.center), 0).astype(np.int8)
        return _Face(status, sign, ball)

    def equations(self, face: _Face) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The face's group equations ``sum_{i in G} a_i x_i = t_G`` as ``(group, a, t)``.

        Simplex: ``a = 1``. Active L1 ball: one group, ``a_i`` the sign of ``x_i - c_i`` on
        free variables, for a variable fixed at a bound the direction in which moving it
        increases ``|x_i - c_i|`` (so ``a_i (x_i - c_i) = |x_i - c_i|``), 0 at the centre."""
        st = self.st
        if st.group is not None:
            assert st.totals is not None
            return st.group, np.ones(self.n), st.totals
        if st.center is not None and face.ball_active:
            assert face.sign is not None and st.radius is not None
            c = st.center
            s = face.status
            a = np.zeros(self.n)
            a[s == FREE] = face.sign[s == FREE]
            a[s == LO] = np.where(st.lo[s == LO] < c[s == LO], -1.0, 1.0)
            a[s == HI] = np.where(st.hi[s == HI] > c[s == HI], 1.0, -1.0)
            return np.zeros(self.n, dtype=np.intp), a, np.array([st.radius + float(a @ c)])
        return None

    def fixed_values(self, face: _Face, x: np.ndarray) -> np.ndarray:
        st = self.st
        x = x.copy()
        s = face.status
        x[s == LO] = st.lo[s == LO]
        x[s == HI] = st.hi[s == HI]
        if st.center is not None:
            x[s == CEN] = st.center[s == CEN]
        return x

    def update_face(self, face: _Face, xf: np.ndarray, gf: np.ndarray) -> _Face:
        """The primal-dual active-set rule: free variables that violate a bound (or cross the
        L1 centre) become fixed; fixed variables whose multiplier has the wrong sign are freed;
        the L1 ball is activated when violated and released when its multiplier is negative.
        Groups left without a free variable and an unmet equation free one variable."""
        st = self.st
        s = face.status
        new = s.copy()
        free = s == FREE
        sign = None if face.sign is None else face.sign.copy()
        eq = self.equations(face)
        tiny_x = 1e-13 * (1.0 + np.abs(xf))
        tiny_g = 1e-13 * (float(np.max(np.abs(gf), initial=0.0)) + 1e-300)
        lam = gf
        nu = np.zeros(0)
        if eq is not None:
            group, a, totals = eq
            ngr = totals.size
            q = gf * a
            cnt = np.bincount(group[free], minlength=ngr)
            nu = np.bincount(group[free], q[free], minlength=ngr) / np.maximum(cnt, 1)
            if np.any(cnt == 0):  # groups without free variables: nu in the admissible interval
                upper = np.full(ngr, np.inf)
                lower = np.full(ngr, -np.inf)
                up_mask = ((s == LO) & (a > 0)) | ((s == HI) & (a < 0))
                lo_mask = ((s == HI) & (a > 0)) | ((s == LO) & (a < 0))
                np.minimum.at(upper, group[up_mask], q[up_mask])
                np.maximum.at(lower, group[lo_mask], q[lo_mask])
                if st.center is not None:  # ball multiplier -nu >= |grad| at the centre, >= 0
                    cen = s == CEN
                    np.minimum.at(upper, group[cen], -np.abs(gf[cen]))
                    upper = np.minimum(upper, 0.0)
                lo_f, up_f = np.isfinite(lower), np.isfinite(upper)
                both = np.where(lo_f & up_f, 0.5 * (np.where(lo_f, lower, 0.0) + np.where(up_f, upper, 0.0)), 0.0)
                pick = np.where(lo_f & up_f, both, np.where(lo_f, lower, np.where(up_f, upper, 0.0)))
                nu = np.where(cnt == 0, pick, nu)
            lam = gf - nu[group] * a
        # free variables leaving the face
        new[free & (xf < st.lo - tiny_x)] = LO
        new[free & (xf > st.hi + tiny_x) & (new == FREE)] = HI
        # fixed variables with a multiplier of the wrong sign
        new[(s == LO) & (lam < -tiny_g)] = FREE
        new[(s == HI) & (lam > tiny_g)] = FREE
        ball = face.ball_active
        if st.center is not None:
            assert st.radius is not None
            c = st.center
            if ball:
                assert sign is not None and eq is not None
                nu_ball = -float(nu[0])
                if nu_ball < -tiny_g:
                    ball = False  # the ball constraint is not binding any more
                else:
                    released = ((s == LO) | (s == HI)) & (new == FREE)
                    sign[released] = eq[1][released].astype(np.int8)
                    cross = free & (new == FREE) & (sign * (xf - c) < -tiny_x)
                    new[cross] = CEN
                    up = (s == CEN) & (gf < -nu_ball - tiny_g) & (c < st.hi)
                    down = (s == CEN) & (gf > nu_ball + tiny_g) & (c > st.lo)
                    new[up | down] = FREE
                    sign[up] = 1
                    sign[down] = -1
                    sign[new != FREE] = 0
            if not ball:
                new[new == CEN] = FREE
                sign = None
                dist = float(np.sum(np.abs(np.clip(xf, st.lo, st.hi) - c)))
                if dist > st.radius * (1.0 + 1e-12):
                    ball = True
                    xc = np.where(new == LO, st.lo, np.where(new == HI, st.hi, xf))
                    on_c = (new == FREE) & (xc == c)
                    new[on_c] = CEN
                    sign = np.where(new == FREE, np.sign(xc - c), 0).astype(np.int8)
        out = _Face(new, sign, ball)
        return self._repair(out, gf)

    def _repair(self, face: _Face, gf: np.ndarray) -> _Face:
        """Free one variable in each group that has none and whose fixed values miss its total."""
        eq = self.equations(face)
        if eq is None:
            return face
        group, a, totals = eq
        s = face.status
        ngr = totals.size
        free_cnt = np.bincount(group[s == FREE], minlength=ngr)
        xv = self.fixed_values(face, np.zeros(self.n))
        sums = np.bincount(group, a * xv, minlength=ngr)
        bad = np.flatnonzero((free_cnt == 0) & (np.abs(sums - totals) > 1e-12 * (1.0 + np.abs(totals))))
        if bad.size == 0:
            return face
        s = s.copy()
        sign = None if face.sign is None else face.sign.copy()
        ball = face.ball_active
        for G in bad:
            idx = np.flatnonzero(group == G)
            need_up = sums[G] < totals[G]
            # candidates that move sum_i a_i x_i the needed way when released
            if need_up:
                cand = idx[((s[idx] == LO) & (a[idx] > 0)) | ((s[idx] == HI) & (a[idx] < 0))]
            else:
                cand = idx[((s[idx] == HI) & (a[idx] > 0)) | ((s[idx] == LO) & (a[idx] < 0))]
            if need_up and self.st.center is not None:
                cen = idx[s[idx] == CEN]
                if cen.size:
                    j = int(cen[np.argmax(np.abs(gf[cen]))])
                    s[j] = FREE
                    assert sign is not None
                    sign[j] = -1 if gf[j] > 0 else 1
                    continue
            if cand.size:
                j = int(cand[np.argmin(np.abs(gf[cand]))])
                s[j] = FREE
                if sign is not None:
                    sign[j] = int(a[j])
            elif self.st.center is not None:
                ball = False
                s[s == CEN] = FREE
                sign = None
        return _Face(s, sign, ball)

    def face_solve(self, face: _Face, x_prev: np.ndarray, cg_steps: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Minimise ``J(x) + rho/2 ||x - xc||^2`` (``rho = self.rho``, usually 0) over the affine
        hull of ``face``. Returns the minimiser and the gradient of that objective there.
        ``cg_steps > 0``: only that many conjugate-gradient steps (no factorisation).

        The free variables ``F`` minus one pivot per group are the reduced coordinates ``y``;
        ``x = x0 + Z y`` with ``Z`` eliminating each group's equation through its pivot
        (column ``z_i = e_i - w_i e_p(i)``), and ``M = Z'HZ`` is formed by gathers
        (``O(|F|^2)``). ``M`` is factorised by Cholesky (float32 in mixed precision) and the
        solution refined in float64 with full products ``H x`` until the reduced gradient
        ``Z'(Hx + g)`` vanishes to float64 accuracy. When the face differs from the last
        factorised one in few coordinates, the old factor is reused through a bordered
        (Schur complement) solve instead of a new factorisation. With ``rho > 0`` the reduced
        matrix is ``Z'(H + rho I)Z`` (positive definite). Singular faces with ``rho = 0`` use
        :func:`solve_psd` (ridge + refinement)."""
        H = self.H
        rho = self.rho
        x = self.fixed_values(face, x_prev)
        status = face.status
        changed = self.n if self._prev_status is None else int(np.count_nonzero(status != self._prev_status))
        self._prev_status = status
        # few changes: this is likely the last face, so solve it to float64 accuracy at once
        self._few_changes = changed <= max(3, 0.002 * self.n)
        free = np.flatnonzero(status == FREE)
        eq = self.equations(face)
        if eq is not None:
            group, a, totals = eq
            # one pivot per group with free variables; keep the last pivot when still free
            first_free = np.full(totals.size, -1, dtype=np.intp)
            first_free[group[free[::-1]]] = free[::-1]
            pivot_of_group = first_free
            if self._pivot_of_group is not None and self._pivot_of_group.size == totals.size:
                old = self._pivot_of_group
                keep = (old >= 0) & (status[np.maximum(old, 0)] == FREE) & (group[np.maximum(old, 0)] == np.arange(totals.size))
                pivot_of_group = np.where(keep & (first_free >= 0), old, first_free)
            self._pivot_of_group = pivot_of_group
            has = pivot_of_group >= 0
            pivots = pivot_of_group[has]
            piv_group = np.flatnonzero(has)
            slot = np.full(totals.size, -1, dtype=np.intp)
            slot[piv_group] = np.arange(pivots.size)
            is_piv = np.zeros(self.n, dtype=bool)
            is_piv[pivots] = True
            N = free[~is_piv[free]]
            gidx = slot[group[N]]
            w = a[N] * a[pivots[gidx]]  # a_i / a_p with a = +-1
            # particular solution: pivots absorb each group's equation
            contrib = np.bincount(group, a * np.where(is_piv, 0.0, x), minlength=totals.size)
            x[pivots] = (totals[piv_group] - contrib[piv_group]) / a[pivots]
        else:
            N = free
            pivots = np.zeros(0, dtype=np.intp)
            gidx = np.zeros(0, dtype=np.intp)
            w = np.zeros(0)
        grad = self.inner_grad(x)
        if N.size == 0:
            return x, grad
        piv_of_N = pivots[gidx] if pivots.size else np.full(N.size, -1, dtype=np.intp)
        w_full = w if pivots.size else np.zeros(N.size)

        def reduced(v: np.ndarray) -> np.ndarray:  # Z' v
            return v[N] - w * v[piv_of_N] if pivots.size else v[N]

        def expand(y: np.ndarray) -> np.ndarray:  # Z y
            dx = np.zeros(self.n)
            dx[N] = y
            if pivots.size:
                dx[pivots] -= np.bincount(gidx, w * y, minlength=pivots.size)
            return dx

        if cg_steps:
            return self._face_cg(reduced, expand, x, grad, cg_steps)

        def gather(src: np.ndarray) -> np.ndarray:
            # M = Z'(H + rho I)Z: M_ij = H_ij - A_ij - A_ji + w_i w_j Q_p(i),p(j) + rho [i = j]
            # with A_ij = H_i,p(j) w_j and Q = H_PP + rho I on the pivots (row-contiguous gathers)
            rows = np.take(src, N, axis=0)
            M = np.take(rows, N, axis=1)
            if pivots.size:
                wd = w.astype(src.dtype)
                HNP = np.take(rows, pivots, axis=1)  # (|N|, n_pivots)
                Q = np.take(np.take(src, pivots, axis=0), pivots, axis=1)
                if rho > 0:
                    Q[np.diag_indices_from(Q)] += rho
                if pivots.size == 1:  # one group (global simplex, L1 ball): rank-one terms
                    A = np.multiply.outer(HNP[:, 0], wd)
                    M += Q[0, 0] * np.multiply.outer(wd, wd)
                else:
                    A = np.take(HNP, gidx, axis=1) * wd[None, :]
                    M += np.take(np.take(Q, gidx, axis=0), gidx, axis=1) * np.multiply.outer(wd, wd)
                M -= A
                M -= A.T
            if rho > 0:
                M[np.diag_indices_from(M)] += rho
            return M

        ident = (N, piv_of_N, w_full)
        if self._factor is not None:
            apply = self._bordered(ident)
            if apply is not None:
                res = self._refine(apply, reduced, expand, x, grad)
                if res is not None:
                    self.solve_methods.add("bordered update")
                    return res
        self.factorisations += 1
        self._factor = None
        # float32 while the face still changes a lot; float64 (reusable by bordered updates
        # without loss of accuracy) once the changes are few
        tail = changed < float(self.opts["update_ratio"]) * N.size
        self.inexact_ok = changed > 0.25 * N.size
        self._singular = False
        if self.use_mixed(N.size) and not tail:
            apply = self._factorise(gather, np.float32, ident)
            if apply is not None:
                # far from the final face one float32 solve is accurate enough to find the next
                # face (the iteration is exact only on the face it stops on)
                res = self._refine(apply, reduced, expand, x, grad, exact=not self.inexact_ok)
                if res is not None:
                    self.solve_methods.add("cholesky-float32+refinement")
                    return res
            self._factor = None
        M = gather(H)
        if not self._singular:  # (a zero pivot in float32 is one in float64 too)
            apply = self._factorise(lambda _src: M, np.float64, ident, copy=True)
            if apply is not None:
                res = self._refine(apply, reduced, expand, x, grad)
                if res is not None:
                    self.solve_methods.add("cholesky")
                    return res
        self._factor = None
        rtol = 1e-14 if self.fine or self._few_changes else 1e-10
        y, method = solve_psd(M, -reduced(grad), self.opts["ridge"], self.opts["refine_steps"], try_plain=False,
                              rtol=rtol, scale=self.eta)
        self.solve_methods.add(method)
        dx = expand(y)
        return x + dx, grad + self.inner_step(dx)

    def use_mixed(self, size: int) -> bool:
        prec = self.opts["precision"]
        return prec == "mixed" or (prec == "auto" and size >= 512)

    def _factorise(self, gather: Any, dtype: Any, ident: tuple[np.ndarray, ...] | None,
                   copy: bool = False) -> Any:
        """Cholesky of ``M`` in ``dtype``; remembers it (for bordered updates) when ``ident``
        is given. ``None`` when ``M`` is not numerically positive definite in that precision."""
        if dtype == np.float32:
            if self.H32 is None:
                self.H32 = self.H.astype(np.float32)
            M = gather(self.H32)
            thresh = 1e-7
        else:
            M = gather(self.H)
            thresh = 1e-12
        diag = np.diag(M)
        top = float(np.max(diag)) if M.size else 0.0
        if not top > 0:
            return None
        if float(np.min(diag)) <= 1e-14 * top:
            self._singular = True  # a (numerically) zero row: singular in every precision
            return None
        try:
            fac = sla.cho_factor(M.copy() if copy else M, lower=False, check_finite=False, overwrite_a=True)
        except np.linalg.LinAlgError:
            return None
        if float(np.min(np.abs(np.diag(fac[0])))) ** 2 <= thresh * top:
            return None  # too ill-conditioned for this precision
        if ident is not None:
            N, piv, w = ident
            pos = np.full(self.n, -1, dtype=np.intp)
            pos[N] = np.arange(N.size)
            self._factor = {"fac": fac, "dtype": dtype, "N": N, "piv": piv, "w": w, "pos": pos,
                            "rho": self.rho}

        def apply(r: np.ndarray) -> np.ndarray:
            return sla.cho_solve(fac, r.astype(dtype), check_finite=False).astype(np.float64)

        return apply

    def _bordered(self, ident: tuple[np.ndarray, ...]) -> Any:
        """An approximate inverse of the new ``M`` from the last factor ``C`` of ``M_old``.

        On ``U = N_old + A`` (``A``: new coordinates), ``M_U = [[M_old, B], [B', M_AA]]``;
        the coordinates ``D`` of ``N_old`` that left the face are pinned to 0 with multipliers.
        Costs ``O(|N_old|^2 (|A| + |D|))``; ``None`` when too many coordinates changed."""
        cache = self._factor
        assert cache is not None
        if cache["rho"] != self.rho:
            return None  # factor of another proximal matrix
        N, piv, w = ident
        N0, piv0, w0, pos0 = cache["N"], cache["piv"], cache["w"], cache["pos"]
        pos = pos0[N]
        same = pos >= 0
        same[same] = (piv0[pos[same]] == piv[same]) & (w0[pos[same]] == w[same])
        if np.any((pos >= 0) & ~same):
            # a group's pivot changed while some of its coordinates stayed free: their old and
            # new reduced coordinates (e_i - e_p0, e_i - e_p1, e_p1 - e_p0) are linearly
            # dependent, so the bordered matrix M_U is singular; factorise afresh
            return None
        A = np.flatnonzero(~same)
        kept_old = np.zeros(N0.size, dtype=bool)
        kept_old[pos[same]] = True
        D = np.flatnonzero(~kept_old)
        if A.size + D.size > float(self.opts["update_ratio"]) * N0.size:
            return None
        if A.size == 0 and D.size == 0:
            fac, dt = cache["fac"], cache["dtype"]
            return lambda r: sla.cho_solve(fac, r.astype(dt), check_finite=False).astype(np.float64)
        fac, dt = cache["fac"], cache["dtype"]
        src = self.H32 if dt == np.float32 else self.H
        assert src is not None
        n0 = N0.size

        def solve_old(R: np.ndarray) -> np.ndarray:
            return sla.cho_solve(fac, R.astype(dt), check_finite=False).astype(np.float64)

        try:
            if A.size:
                iA, pA, wA = N[A], piv[A], w[A]
                B = self._zhz(src, N0, piv0, w0, iA, pA, wA, self.rho).astype(np.float64)
                MAA = self._zhz(src, iA, pA, wA, iA, pA, wA, self.rho).astype(np.float64)
                with np.errstate(invalid="ignore", over="ignore"):
                    X = solve_old(B)
                    S = MAA - B.T @ X
                if not (np.all(np.isfinite(X)) and np.all(np.isfinite(S))):
                    return None  # the old factor is too ill-conditioned for these columns
                facS = _robust_cholesky(0.5 * (S + S.T))
            else:
                X = np.zeros((n0, 0))
                facS = None

            def solve_U(b: np.ndarray) -> np.ndarray:  # M_U^{-1} b, b of length n0 + |A| (or matrix)
                b1, b2 = b[:n0], b[n0:]
                u1 = solve_old(b1)
                if facS is None:
                    return u1
                u2 = sla.cho_solve(facS, b2 - X.T @ b1, check_finite=False)
                return np.concatenate([u1 - X @ u2, u2])

            if D.size:
                E = np.zeros((n0 + A.size, D.size))
                E[D, np.arange(D.size)] = 1.0
                with np.errstate(invalid="ignore", over="ignore"):
                    T = solve_U(E)
                if not np.all(np.isfinite(T)):
                    return None
                facW = _robust_cholesky(0.5 * (T[D] + T[D].T))
            else:
                T = facW = None
        except np.linalg.LinAlgError:
            return None
        new_pos_same = pos[same]
        where_same = np.flatnonzero(same)

        def apply(r: np.ndarray) -> np.ndarray:  # (non-finite results are rejected by _refine)
            b = np.zeros(n0 + A.size)
            b[new_pos_same] = r[where_same]
            b[n0:] = r[A]
            with np.errstate(invalid="ignore", over="ignore"):
                u = solve_U(b)
                if T is not None:
                    u = u - T @ sla.cho_solve(facW, u[D], check_finite=False)
            y = np.empty(r.size)
            y[where_same] = u[new_pos_same]
            y[A] = u[n0:]
            return y

        return apply

    @staticmethod
    def _zhz(src: np.ndarray, i: np.ndarray, pi: np.ndarray, wi: np.ndarray,
             j: np.ndarray, pj: np.ndarray, wj: np.ndarray, rho: float = 0.0) -> np.ndarray:
        """``z_i' (H + rho I) z_j`` for reduced coordinates ``z = e_k - w e_p`` (``p = -1``: no
        pivot)."""
        pi0, pj0 = np.maximum(pi, 0), np.maximum(pj, 0)
        wi = wi.astype(src.dtype)
        wj = wj.astype(src.dtype)
        rows = np.take(src, i, axis=0)
        out = np.take(rows, j, axis=1)
        if np.any(wj):
            out -= np.take(rows, pj0, axis=1) * wj[None, :]
        if np.any(wi):
            prow = np.take(src, pi0, axis=0)
            out -= np.take(prow, j, axis=1) * wi[:, None]
            if np.any(wj):
                out += np.take(prow, pj0, axis=1) * np.outer(wi, wj)
        if rho > 0:  # z_i'z_j = [k_i = k_j] - w_j [k_i = p_j] - w_i [p_i = k_j] + w_i w_j [p_i = p_j]
            ztz = (i[:, None] == j[None, :]).astype(np.float64)
            ztz -= wj[None, :] * (i[:, None] == pj[None, :])
            ztz -= wi[:, None] * (pi[:, None] == j[None, :])
            ztz += np.outer(wi, wj) * ((pi[:, None] == pj[None, :]) & (pi[:, None] >= 0))
            out += (rho * ztz).astype(out.dtype)
        return out

    def _refine(self, apply: Any, reduced: Any, expand: Any, x: np.ndarray, grad: np.ndarray,
                exact: bool = True) -> tuple[np.ndarray, np.ndarray] | None:
        """Iterative refinement ``y += apply(-r)`` with float64 reduced gradients ``r`` (of the
        face solves' objective, proximal term included); ``None`` when it stalls before the
        reduced gradient reaches float64 accuracy. ``exact=False``: a single step."""
        if not exact:
            y = apply(-reduced(grad))
            if not np.all(np.isfinite(y)):
                return None
            dx = expand(y)
            return x + dx, grad + self.inner_step(dx)
        # aim for the rounding floor of the float64 gradient; accept a stall near it
        scale = (float(np.max(np.abs(self.g), initial=0.0)) + self.eta * (1.0 + float(np.max(np.abs(x), initial=0.0))))
        # coarse (faces still changing): 1e-8 relative is plenty to find the next face
        fine = self.fine or self._few_changes
        accept = 1e-11 * scale if fine else 1e-8 * scale
        aim = 1e-15 * scale * math.sqrt(self.n) if fine else accept
        r = reduced(grad)
        prev = math.inf
        for _ in range(int(self.opts["refine_steps"])):
            nr = float(np.max(np.abs(r), initial=0.0))
            if nr <= aim:
                return x, grad
            if nr > 0.5 * prev:
                return (x, grad) if prev <= accept else None
            prev = nr
            y = apply(-r)
            if not np.all(np.isfinite(y)):
                return None
            dx = expand(y)
            x_new = x + dx
            grad_new = grad + self.inner_step(dx)
            r_new = reduced(grad_new)
            if float(np.max(np.abs(r_new), initial=0.0)) > nr:
                return (x, grad) if nr <= accept else None  # the step made it worse: keep x
            x, grad, r = x_new, grad_new, r_new
        return (x, grad) if prev <= accept else None

    def _face_cg(self, reduced: Any, expand: Any, x: np.ndarray, grad: np.ndarray,
                 steps: int) -> tuple[np.ndarray, np.ndarray]:
        """Conjugate gradients on the face's reduced problem (float32 products for large n)."""
        if self.n >= 512:
            if self.H32 is None:
                self.H32 = self.H.astype(np.float32)
            Hm = self.H32
        else:
            Hm = self.H
        x = x.copy()
        r = -reduced(grad)
        p = r.copy()
        rr = float(r @ r)
        for _ in range(steps):
            zp = expand(p)
            Hzp = (Hm @ zp.astype(Hm.dtype)).astype(np.float64)
            if self.rho > 0:
                Hzp += self.rho * zp
            curv = float(zp @ Hzp)
            if not curv > 0 or rr == 0:
                break
            alpha = rr / curv
            x += alpha * zp
            r -= alpha * reduced(Hzp)
            rr_new = float(r @ r)
            p = r + (rr_new / rr) * p
            rr = rr_new
        return x, self.inner_grad(x)

    # -- projected gradient / FISTA with adaptive (gradient) restart
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
        tol = float(opts["tol"])
        patience = int(opts["patience"])
        status = SolveStatus.MAX_ITERATIONS
        last_gap = self.gap(best_x, grad)
        face = self.identify(self.project(x - grad / self.eta))
        if int(opts["cg_start"]) and np.count_nonzero(face.status == FREE) > 0.9 * self.n:
            # (nearly) all free: the first face solve would be a large factorisation; a few CG
            # steps on that face (products only) find most of its bound violations for less
            x, g_cg = self.face_solve(face, x, cg_steps=int(opts["cg_start"]))
            face = self.update_face(face, x, g_cg)

        def converged(J: float, gap: float, x: np.ndarray, grad: np.ndarray) -> bool:
            return gap <= tol * self.certificate_scale(J, x, grad) or gap <= self.rounding_floor(x)

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
        fail_rho = 0.0  # the last rho at which proximal PDAS failed (decrease slowly past it)
        jump_back = 0.0  # rho to return to when a jump to rho_min fails
        no_jump: bytes | None = None  # a face from which a jump failed
        idle = 0  # accepted proximal steps at rho_min that did not lower J
        since_best = 0  # face solves since J fell by more than its rounding or the gap halved
        low_gap = last_gap
        it = 0
        for it in range(1, int(opts["max_iter"]) + 1):
            rho = self.rho
            key = face.key()
            seen.add(key)
            xf, gf = self.face_solve(face, x)  # gf: gradient of J + rho/2 ||x - xc||^2
            xp = self.project(xf)
            inside = np.array_equal(xp, xf)
            if inside:
                gp = gf - self.rho * (xf - self.xc) if rho > 0 else gf
            else:
                gp = H @ xp + g
            Jp = self.objective(xp, gp)
            gap = self.gap(xp, gp)
            noise = 8.0 * np.finfo(float).eps * self.term_scale(xp, gp)  # rounding of J
            if Jp < best_J - 1e-13 * self.term_scale(xp, gp) or gap < 0.5 * low_gap:
                since_best = 0
            else:
                since_best += 1
            low_gap = min(low_gap, gap)
            # the best point: the lowest J; among Js equal up to rounding, the smallest gap
            if Jp < best_J - noise or (Jp <= best_J + noise and gap < last_gap):
                best_x, best_J, last_gap = xp, Jp, gap
            new_face = self.update_face(face, xf, gf)
            stable = new_face.key() == key
            if converged(Jp, gap, xp, gp):
                best_x, best_J, last_gap = xp, Jp, gap
                status = SolveStatus.OPTIMAL
                break
            if since_best >= 10 * max(patience, 3):
                status = SolveStatus.INACCURATE  # J stopped falling: the gap is at its floor
                break
            if stable and rho > 0:
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
                self.fine = True
                seen.clear()
                inner_best, stall, inner_it = math.inf, 0, 0
                x = xp
                continue
            if stable and not self.fine:
                # the face is stable: solve on it once more to float64 accuracy
                self.fine = True
                x = xf
                continue
            self.fine = stable
            # the PDAS step did not settle: is the iteration still making progress?
            Jr = Jp + 0.5 * rho * float(np.sum((xp - self.xc) ** 2)) if rho > 0 else Jp
            if Jr < inner_best - 1e-15 * self.scale(Jr):
                inner_best, stall = Jr, 0
            else:
                stall += 1
            if rho == 0:
                # plain PDAS that does not halve the gap within a few more steps is not
                # converging either (the objective can fall slowly while the faces wander)
                gap_best, gap_stall = (gap, 0) if gap <= 0.5 * gap_best else (gap_best, gap_stall + 1)
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
                seen.clear()
                inner_best, stall, inner_it = math.inf, 0, 0
                self.fine = False
                x = self.xc
                continue
            face, x = new_face, xf
        return best_x, status, it, self._info(it, face, last_gap)

    def _info(self, it: int, face: _Face, gap: float) -> dict[str, Any]:
        return {
            "face_iterations": it, "factorisations": self.factorisations,
            "fista_steps": self.fista_steps, "linear_solves": sorted(self.solve_methods),
            "n_free": int(np.sum(face.status == FREE)), "frank_wolfe_gap": gap,
            "tol": float(self.opts["tol"]), "proximal_restarts": self.proximal_restarts,
            "final_rho": self.rho,
        }


class ActiveSetSolver(QPSolver):
    """Dense primal-dual active-set solver with proximal-point globalisation (see the module doc).

    Options (defaults): ``tol`` 1e-10 (stop when the Frank-Wolfe gap is below ``tol`` times
    ``max(|J|, 1e-8 (|c| + |x'Hx|/2 + |g'x|))``), ``max_iter`` 500 face solves, ``warm_steps``
    0 FISTA steps before the first face, ``cg_start`` 40 conjugate-gradient steps when the
    first face is (nearly) all free, ``patience`` 3 non-improving PDAS steps before the
    proximal mode (which starts at ``prox_start`` 3e-2 x max diag H, divides rho by
    ``prox_decrease`` 4 after each solved subproblem down to ``prox_min`` 1e-12 x max diag H,
    and gives a subproblem ``prox_inner_max`` 8 face solves), ``precision`` "auto" (float32
    factorisations with float64 refinement for faces with >= 512 free coordinates; "float64"
    or "mixed" to force), ``update_ratio`` 0.05 (reuse the last factor through a bordered
    solve while fewer than this fraction of coordinates changed), ``ridge`` 1e-10 (relative
    to max diag H, only for singular faces without proximal term) and ``refine_steps`` 30.
    """

    name = "active_set"
    defaults = {"tol": 1e-10, "max_iter": 500, "warm_steps": 0, "patience": 3, "prox_start": 3e-2,
                "prox_decrease": 4.0, "prox_min": 1e-12, "prox_inner_max": 8, "ridge": 1e-10,
                "refine_steps": 30, "precision": "auto", "update_ratio": 0.05, "cg_start": 40}

    #: ``auto`` passes larger problems to torch_fista (the factorisations need ~2 more dense
    #: n x n arrays beside H: 3.6 GB at n = 16384); see docs/solvers.md
    auto_max_n = 16384

    def auto_declines(self, problem: MergeQP, constraints: ConstraintSet) -> str | None:
        if problem.n > self.auto_max_n:
            return f"n = {problem.n} > {self.auto_max_n}: auto prefers the matrix-free torch_fista"
        return None

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
        }
        for key, ok in rules.items():
            value = opts[key]
            try:
                good = isinstance(value, (int, float, np.number)) and not isinstance(value, bool) \
                    and math.isfinite(float(value)) and bool(ok(float(value)))
            except TypeError:
                good = False
            if not good:
                raise ValidationError(f"active_set: option {key}={value!r} is out of range "
                                      f"(default {self.defaults[key]!r})")
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
        engine = _Engine(problem, constraints, st, opts)
        setup = time.perf_counter() - t0
        x, status, it, info = engine.run(x0)
        if not st.bounded:
            why = unbounded_direction(problem, st, x)
            if why is not None:
                raise UnboundedError(f"active_set: the problem is unbounded below on {constraints.spec}: {why}")
        return RawResult(problem.unflat(x), status, it, info, setup_seconds=setup)


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
    v = x / float(np.linalg.norm(x))
    lo_f, hi_f = np.isfinite(st.lo), np.isfinite(st.hi)
    v = np.where(lo_f & hi_f, 0.0, v)
    v = np.where(lo_f & ~hi_f, np.maximum(v, 0.0), v)
    v = np.where(hi_f & ~lo_f, np.minimum(v, 0.0), v)
    nv = float(np.linalg.norm(v))
    if nv == 0:
        return None
    v /= nv
    gv = float(problem.g @ v)
    curv = float(v @ problem.matvec(v))
    top = float(np.max(np.abs(problem.diagonal()), initial=0.0))
    flat = curv <= 1e-10 * max(top, 1e-300)
    beyond = curv <= 0 or -gv / curv > 1e3 * float(np.linalg.norm(x))
    if gv < -1e-8 * max(float(np.linalg.norm(problem.g)), np.finfo(float).tiny) and flat and beyond:
        return (f"J decreases without bound along the direction v (|v| = 1, inside the set's "
                f"recession cone) with v'Hv = {curv:.2g} and g'v = {gv:.3g} < 0 (the iterates "
                f"reached |d|_inf = {norm:.3g})")
    return None
