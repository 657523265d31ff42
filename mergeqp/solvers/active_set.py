"""A dense active-set solver for box / simplex / L1-ball merge QPs (dense LAPACK).

Method: a primal-dual active-set iteration (PDAS, Hintermueller, Ito & Kunisch 2002) on
faces of the set, globalised by monotone projected-gradient / damped-Newton steps:

1. *Face solve*: fix the variables at their bounds (and, for an active L1 ball, at the
   centre); the free variables obey one linear equation per group (per-atom or global simplex
   sum; the active ball's ``sum s_i (x_i - c_i) = radius``), eliminated through one pivot per
   group (null-space method: the reduced Hessian ``Z'HZ`` costs ``O(n_free^2)`` gathers).
   ``Z'HZ`` is factorised by Cholesky: in float32 for large faces, with iterative refinement
   against float64 products ``H x`` until the reduced gradient reaches float64 accuracy; when
   the face differs from the last factorised one in few coordinates, the old factor is reused
   through a bordered (Schur complement) solve. Singular faces (singular H) get a ridge
   ``1e-10 max diag`` plus refinement (proximal-point iterations recover a minimiser).
2. *PDAS update*: free variables that left the set become fixed, fixed variables whose
   multiplier has the wrong sign are freed (group multipliers from the free variables), the
   L1 ball is activated / released by its multiplier; a group left without a free variable
   and an unmet equation frees one. The first face, when (nearly) all variables are free, is
   only approximated by 40 conjugate-gradient steps (products, no factorisation).
3. *Stop* when the Frank-Wolfe gap of the projected face minimiser (an exact, vectorised LMO)
   is below ``tol * max(|J|, 1e-8 |c|)`` -- the certificate's own test. A stable face is solved
   once more to float64 accuracy before that test.
4. *Safeguard*: PDAS is not monotone and can cycle on ill-conditioned problems. When a face
   repeats or ``patience`` steps bring no decrease, a few monotone steps follow: a projected
   gradient step with ``1 / lambda_max(H)`` (optionally FISTA steps) identifies a face, a
   damped Newton step on it is kept when its projection lowers J (Levenberg-Marquardt
   damping adapts), then PDAS resumes from the best point. The iteration never returns a
   point worse than the best feasible one seen.

Supported sets: ``Box`` (finite or infinite sides), ``Simplex``, ``GlobalSimplex``,
``L1Ball``, ``Box & Simplex``, ``Box & GlobalSimplex``, ``Box & L1Ball`` (centre inside the
box), and the unconstrained problem. Needs an explicit H. Memory: H, its float32 copy and up
to a few ``n_free x n_free`` work arrays.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.linalg as sla

from ..constraints import (
    Box,
    ConstraintSet,
    GlobalSimplex,
    L1Ball,
    Simplex,
    Unconstrained,
)
from ..errors import SolverError
from ..problem import MergeQP
from ..solution import SolveStatus
from .base import QPSolver, RawResult

FREE, LO, HI, CEN = 0, 1, 2, 3


@dataclass(frozen=True)
class SetStructure:
    """A recognised set in flat variables (``n = K * n_atoms``, row-major).

    ``lo``/``hi``: bounds (``+-inf`` allowed); ``group``: simplex group of each variable
    (``-1`` = none) with ``totals``; ``center``/``radius``: the L1 ball (``None`` if absent).
    """

    lo: np.ndarray
    hi: np.ndarray
    group: np.ndarray | None
    totals: np.ndarray | None
    center: np.ndarray | None
    radius: float | None

    @property
    def bounded(self) -> bool:
        """Whether the set is bounded (so the Frank-Wolfe gap is finite)."""
        if self.group is not None or self.center is not None:
            return True
        return bool(np.all(np.isfinite(self.lo)) and np.all(np.isfinite(self.hi)))


def set_structure(cset: ConstraintSet, shape: tuple[int, int]) -> SetStructure | str:
    """Recognise ``cset`` as box / simplex / L1 structure, or return why it is not supported."""
    K, m = shape
    n = K * m
    lo = np.full(n, -np.inf)
    hi = np.full(n, np.inf)
    simplex: Simplex | None = None
    ball: L1Ball | None = None
    for s in cset.members():
        if isinstance(s, Box):
            b_lo, b_hi = s.bounds(shape)
            lo = np.maximum(lo, b_lo.ravel())
            hi = np.minimum(hi, b_hi.ravel())
        elif isinstance(s, Simplex):  # includes GlobalSimplex
            if simplex is not None:
                return "handles at most one simplex constraint"
            simplex = s
        elif isinstance(s, L1Ball):
            if ball is not None:
                return "handles at most one L1 ball"
            ball = s
        elif isinstance(s, Unconstrained):
            continue
        else:
            return f"does not handle {s.spec} (only box, simplex, global_simplex, l1 and their box intersections)"
    if simplex is not None and ball is not None:
        return "does not handle a simplex intersected with an L1 ball"
    group = totals = center = None
    radius = None
    if simplex is not None:
        lo = np.maximum(lo, 0.0)
        if isinstance(simplex, GlobalSimplex):
            group = np.zeros(n, dtype=np.intp)
            totals = np.array([simplex.total])
        else:
            group = np.tile(np.arange(m, dtype=np.intp), K)
            totals = np.full(m, simplex.total)
    if ball is not None:
        center = ball._center(shape).ravel().copy()
        radius = ball.radius
        if np.any(center < lo) or np.any(center > hi):
            return "handles an L1 ball intersected with a box only when the centre lies in the box"
    return SetStructure(lo, hi, group, totals, center, radius)


# ---------------------------------------------------------------------- linear algebra
def solve_psd(M: np.ndarray, rhs: np.ndarray, ridge: float = 1e-10, refine: int = 30) -> tuple[np.ndarray, str]:
    """Solve ``M y = rhs`` for symmetric PSD ``M`` (``(p, p)``): Cholesky when well posed, else
    Cholesky of ``M + ridge * max(diag M) * I`` with iterative refinement (proximal-point
    iterations from 0, converging to a minimiser of ``1/2 y'My - rhs'y`` when one exists).
    Returns ``(y, method)``."""
    p = rhs.shape[0]
    if p == 0:
        return np.zeros(0), "empty"
    top = float(np.max(np.diag(M)))
    if not top > 0:
        return np.zeros(p), "zero"
    try:
        fac = sla.cho_factor(M, lower=False, check_finite=False, overwrite_a=False)
        if float(np.min(np.abs(np.diag(fac[0])))) ** 2 > 1e-12 * top:
            return sla.cho_solve(fac, rhs, check_finite=False), "cholesky"
    except np.linalg.LinAlgError:
        pass
    eps = ridge * top
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
        if nr <= 1e-14 * (r0 + top * float(np.linalg.norm(y))) or nr > 0.999 * prev:
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


# ---------------------------------------------------------------------- linear minimisation
def support_value(st: SetStructure, grad: np.ndarray) -> float:
    """``min_{s in C} grad's`` (``-inf`` when unbounded), exact and vectorised."""
    lo, hi = st.lo, st.hi
    if st.group is not None:
        assert st.totals is not None
        # start every variable at its lower bound, then fill each group's remaining budget in
        # increasing order of the gradient up to the upper bounds (a fractional knapsack)
        budget = st.totals - np.bincount(st.group, lo, minlength=st.totals.size)
        order = np.lexsort((grad, st.group))
        cap = (hi - lo)[order]
        grp = st.group[order]
        csum = np.cumsum(np.where(np.isfinite(cap), cap, 0.0))
        inf_seen = np.cumsum(~np.isfinite(cap))
        starts = np.searchsorted(grp, np.arange(st.totals.size))
        base = np.where(starts > 0, csum[np.maximum(starts - 1, 0)], 0.0)
        inf_base = np.where(starts > 0, inf_seen[np.maximum(starts - 1, 0)], 0)
        before = np.concatenate([[0.0], csum[:-1]]) - base[grp]  # capacity used before this var
        inf_before = np.concatenate([[0], inf_seen[:-1]]) - inf_base[grp]
        rem = budget[grp] - before
        take = np.where(inf_before > 0, 0.0, np.clip(rem, 0.0, cap))
        s = lo[order] + take
        return float(grad[order] @ s)
    if st.center is not None:
        c = st.center
        assert st.radius is not None
        # move away from the centre along -sign(grad), largest |grad| first, within the box
        cap = np.where(grad > 0, c - lo, hi - c)
        gain = np.abs(grad)
        order = np.argsort(-gain, kind="stable")
        capo = np.minimum(cap[order], st.radius)
        before = np.concatenate([[0.0], np.cumsum(capo)[:-1]])
        step = np.clip(st.radius - before, 0.0, capo)
        return float(grad @ c - gain[order] @ step)
    s = np.where(grad > 0, lo, np.where(grad < 0, hi, np.where(np.isfinite(lo), lo, np.where(np.isfinite(hi), hi, 0.0))))
    if not np.all(np.isfinite(s)):
        return -math.inf
    return float(grad @ s)


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

    # -- basic pieces
    def project(self, x: np.ndarray) -> np.ndarray:
        return self.cset.project(x.reshape(self.shape)).ravel()

    def objective(self, x: np.ndarray, grad: np.ndarray) -> float:
        # J = 1/2 x'(Hx + g) + 1/2 g'x + c, using grad = Hx + g
        return float(0.5 * x @ grad + 0.5 * self.g @ x + self.c)

    def gap(self, x: np.ndarray, grad: np.ndarray) -> float:
        sv = support_value(self.st, grad)
        return float(grad @ x - sv) if math.isfinite(sv) else math.inf

    def scale(self, J: float) -> float:
        return max(abs(J), 1e-8 * abs(self.c), np.finfo(float).tiny)

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

    def face_solve(self, face: _Face, x_prev: np.ndarray, mu: float = 0.0,
                   cg_steps: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Minimise J (plus ``mu/2 ||y||^2`` in the reduced coordinates, a damping toward
        ``x_prev``) over the affine hull of ``face``. Returns the minimiser and its gradient.
        ``cg_steps > 0``: only that many conjugate-gradient steps (no factorisation).

        The free variables ``F`` minus one pivot per group are the reduced coordinates ``y``;
        ``x = x0 + Z y`` with ``Z`` eliminating each group's equation through its pivot
        (column ``z_i = e_i - w_i e_p(i)``), and ``M = Z'HZ`` is formed by gathers
        (``O(|F|^2)``). ``M`` is factorised by Cholesky (float32 in mixed precision) and the
        solution refined in float64 with full products ``H x`` until the reduced gradient
        ``Z'(Hx + g)`` vanishes to float64 accuracy. When the face differs from the last
        factorised one in few coordinates, the old factor is reused through a bordered
        (Schur complement) solve instead of a new factorisation. Singular faces use
        :func:`solve_psd` (ridge + refinement)."""
        H, g = self.H, self.g
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
        grad = H @ x + g
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
            # M_ij = H_ij - w_j H_i,p(j) - w_i (H_p(i),j - w_j H_p(i),p(j)): row-contiguous gathers
            rows = np.take(src, N, axis=0)
            M = np.take(rows, N, axis=1)
            if pivots.size:
                wd = w.astype(src.dtype)
                M -= np.take(rows, piv_of_N, axis=1) * wd[None, :]
                prow = np.take(src, pivots, axis=0)
                TP = np.take(prow, N, axis=1)
                TP -= np.take(prow, piv_of_N, axis=1) * wd[None, :]
                M -= np.take(TP, gidx, axis=0) * wd[:, None]
            if mu > 0:
                M[np.diag_indices_from(M)] += mu
            return M

        ident = (N, piv_of_N, w_full)
        if mu == 0 and self._factor is not None:
            apply = self._bordered(ident)
            if apply is not None:
                res = self._refine(apply, reduced, expand, x, grad, 0.0)
                if res is not None:
                    self.solve_methods.add("bordered update")
                    return res
        self.factorisations += 1
        self._factor = None
        # float32 while the face still changes a lot; float64 (reusable by bordered updates
        # without loss of accuracy) once the changes are few
        tail = changed < float(self.opts["update_ratio"]) * N.size
        self.inexact_ok = changed > 0.25 * N.size
        if self.use_mixed(N.size) and not tail:
            apply = self._factorise(gather, np.float32, ident if mu == 0 else None)
            if apply is not None:
                # far from the final face one float32 solve is accurate enough to find the next
                # face (the iteration is exact only on the face it stops on)
                res = self._refine(apply, reduced, expand, x, grad, mu, exact=mu > 0 or not self.inexact_ok)
                if res is not None:
                    self.solve_methods.add("cholesky-float32+refinement")
                    return res
            self._factor = None
        M = gather(H)
        apply = self._factorise(lambda _src: M, np.float64, ident if mu == 0 else None, copy=True)
        if apply is not None:
            res = self._refine(apply, reduced, expand, x, grad, mu)
            if res is not None:
                self.solve_methods.add("cholesky")
                return res
        self._factor = None
        y, method = solve_psd(M, -reduced(grad), self.opts["ridge"], self.opts["refine_steps"])
        self.solve_methods.add(method)
        dx = expand(y)
        return x + dx, grad + H @ dx

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
        top = float(np.max(np.diag(M))) if M.size else 0.0
        if not top > 0:
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
            self._factor = {"fac": fac, "dtype": dtype, "N": N, "piv": piv, "w": w, "pos": pos}

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
        N, piv, w = ident
        N0, piv0, w0, pos0 = cache["N"], cache["piv"], cache["w"], cache["pos"]
        pos = pos0[N]
        same = pos >= 0
        same[same] = (piv0[pos[same]] == piv[same]) & (w0[pos[same]] == w[same])
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
                B = self._zhz(src, N0, piv0, w0, iA, pA, wA).astype(np.float64)
                MAA = self._zhz(src, iA, pA, wA, iA, pA, wA).astype(np.float64)
                X = solve_old(B)
                S = MAA - B.T @ X
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
                T = solve_U(E)
                facW = _robust_cholesky(0.5 * (T[D] + T[D].T))
            else:
                T = facW = None
        except np.linalg.LinAlgError:
            return None
        new_pos_same = pos[same]
        where_same = np.flatnonzero(same)

        def apply(r: np.ndarray) -> np.ndarray:
            b = np.zeros(n0 + A.size)
            b[new_pos_same] = r[where_same]
            b[n0:] = r[A]
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
             j: np.ndarray, pj: np.ndarray, wj: np.ndarray) -> np.ndarray:
        """``z_i' H z_j`` for reduced coordinates ``z = e_k - w e_p`` (``p = -1``: no pivot)."""
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
        return out

    def _refine(self, apply: Any, reduced: Any, expand: Any, x: np.ndarray, grad: np.ndarray,
                mu: float, exact: bool = True) -> tuple[np.ndarray, np.ndarray] | None:
        """Iterative refinement ``y += apply(-r)`` with float64 reduced gradients ``r``;
        ``None`` when it stalls before the reduced gradient reaches float64 accuracy.
        ``exact=False``: a single step."""
        H = self.H
        if not exact:
            y = apply(-reduced(grad))
            if not np.all(np.isfinite(y)):
                return None
            dx = expand(y)
            return x + dx, grad + H @ dx
        # aim for the rounding floor of the float64 gradient; accept a stall near it
        scale = (float(np.max(np.abs(self.g), initial=0.0)) + self.eta * (1.0 + float(np.max(np.abs(x), initial=0.0))))
        # coarse (faces still changing): 1e-8 relative is plenty to find the next face
        fine = self.fine or self._few_changes
        accept = 1e-11 * scale if fine else 1e-8 * scale
        aim = 1e-15 * scale * math.sqrt(self.n) if fine else accept
        r = reduced(grad)
        y_total = np.zeros(r.size)
        prev = math.inf
        for _ in range(int(self.opts["refine_steps"])):
            rr = r + mu * y_total if mu > 0 else r
            nr = float(np.max(np.abs(rr), initial=0.0))
            if nr <= aim:
                return x, grad
            if nr > 0.5 * prev:
                return (x, grad) if prev <= accept else None
            prev = nr
            y = apply(-rr)
            if not np.all(np.isfinite(y)):
                return None
            y_total += y
            dx = expand(y)
            x_new = x + dx
            grad_new = grad + H @ dx
            r_new = reduced(grad_new)
            if float(np.max(np.abs(r_new + mu * y_total if mu > 0 else r_new), initial=0.0)) > nr:
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
            curv = float(zp @ Hzp)
            if not curv > 0 or rr == 0:
                break
            alpha = rr / curv
            x += alpha * zp
            r -= alpha * reduced(Hzp)
            rr_new = float(r @ r)
            p = r + (rr_new / rr) * p
            rr = rr_new
        return x, self.H @ x + self.g

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
        opts = self.opts
        H, g = self.H, self.g
        start = np.full(self.n, 1.0 / self.shape[0]) if x0 is None else np.asarray(x0, dtype=np.float64).ravel()
        x = self.project(start)
        if opts["warm_steps"]:
            x = self.fista(x, int(opts["warm_steps"]))[0]
        grad = H @ x + g
        best_x, best_g, best_J = x, grad, self.objective(x, grad)
        tol = float(opts["tol"])
        status = SolveStatus.MAX_ITERATIONS
        last_gap = self.gap(best_x, best_g)
        mode = "pdas"
        face = self.identify(self.project(x - grad / self.eta))
        if int(opts["cg_start"]) and np.count_nonzero(face.status == FREE) > 0.9 * self.n:
            # (nearly) all free: the first face solve would be a large factorisation; a few CG
            # steps on that face (products only) find most of its bound violations for less
            x, g_cg = self.face_solve(face, x, cg_steps=int(opts["cg_start"]))
            face = self.update_face(face, x, g_cg)
        seen: set[bytes] = set()
        stall = 0
        it = 0
        mu: float | None = None
        L = 0.0
        mono_left = 0
        mono_stall = 0

        def converged(J: float, gap: float) -> bool:
            return gap <= tol * self.scale(J)

        if converged(best_J, last_gap):
            return best_x, SolveStatus.OPTIMAL, 0, self._info(0, face, last_gap, mode)
        for it in range(1, int(opts["max_iter"]) + 1):
            if mode == "pdas":
                # non-monotone primal-dual active-set step from the last face minimiser
                key = face.key()
                seen.add(key)
                xf, gf = self.face_solve(face, x)
                xp = self.project(xf)
                gp = gf if np.array_equal(xp, xf) else H @ xp + g
                Jp = self.objective(xp, gp)
                gap = self.gap(xp, gp)
                new_face = self.update_face(face, xf, gf)
                fixed = new_face.key() == key and np.array_equal(xp, xf)
                improved = Jp < best_J - 1e-15 * self.scale(best_J)
                if Jp <= best_J:
                    best_x, best_g, best_J, last_gap = xp, gp, Jp, gap
                if converged(Jp, gap) or (fixed and self.fine and not math.isfinite(gap)):
                    best_x, best_g, best_J, last_gap = xp, gp, Jp, gap
                    status = SolveStatus.OPTIMAL
                    break
                if new_face.key() == key and not self.fine:
                    # the face is stable: solve on it once more to float64 accuracy
                    self.fine = True
                    x = xf
                    continue
                self.fine = new_face.key() == key
                stall = 0 if improved else stall + 1
                if stall >= int(opts["patience"]) or new_face.key() in seen:
                    mode = "monotone"  # cycling or stalling: a few globalised steps
                    self.fine = True
                    mono_left = int(opts["monotone_steps"])
                    continue
                face, x = new_face, xf
            else:
                # monotone: a projected-gradient (or FISTA) step p identifies the face; the
                # damped Newton step on that face is kept when P(face minimiser) beats p
                if mu is None:
                    mu = float(opts["damping"]) * self.eta
                    L = self.lipschitz()
                steps = int(opts["fista_steps"])
                if steps:
                    p, gp, Jp = self.fista(best_x, steps)
                else:
                    p = self.project(best_x - best_g / L)
                    gp = H @ p + g
                    Jp = self.objective(p, gp)
                face = self.identify(p)
                xf, _ = self.face_solve(face, p, mu)
                z = self.project(xf)
                gz = H @ z + g
                Jz = self.objective(z, gz)
                if Jz < Jp:
                    cand = (z, gz, Jz)
                    mu = 0.0 if mu < 1e-9 * self.eta else mu / 10.0
                else:
                    cand = (p, gp, Jp)
                    mu = min(max(10.0 * mu, 1e-9 * self.eta), 1e6 * self.eta)
                mono_stall = mono_stall + 1 if cand[2] >= best_J - 1e-15 * self.scale(best_J) else 0
                if cand[2] <= best_J:
                    best_x, best_g, best_J = cand
                    last_gap = self.gap(best_x, best_g)
                if converged(best_J, last_gap):
                    status = SolveStatus.OPTIMAL
                    break
                if mono_stall >= 2 * int(opts["patience"]):
                    status = SolveStatus.INACCURATE  # no progress at float64 resolution
                    break
                mono_left -= 1
                if mono_left <= 0:  # back to the fast iteration from the improved point
                    mode = "pdas"
                    self.fine = False
                    stall = 0
                    seen.clear()
                    face = self.identify(self.project(best_x - best_g / self.eta))
                    x = best_x
        return best_x, status, it, self._info(it, face, last_gap, mode)

    def _info(self, it: int, face: _Face, gap: float, mode: str) -> dict[str, Any]:
        return {
            "face_iterations": it, "factorisations": self.factorisations,
            "fista_steps": self.fista_steps, "linear_solves": sorted(self.solve_methods),
            "n_free": int(np.sum(face.status == FREE)), "frank_wolfe_gap": gap,
            "tol": float(self.opts["tol"]), "final_mode": mode,
        }


class ActiveSetSolver(QPSolver):
    """Dense primal-dual active-set solver with a monotone safeguard (see the module doc).

    Options (defaults): ``tol`` 1e-10 (stop when the Frank-Wolfe gap is below ``tol`` times
    ``max(|J|, 1e-8 |c|)``), ``max_iter`` 500 face iterations, ``warm_steps`` 0 FISTA steps
    before the first face, ``cg_start`` 40 conjugate-gradient steps when the first face is
    (nearly) all free, ``patience`` 3 non-improving active-set steps before
    ``monotone_steps`` 3 safeguarded steps (a projected-gradient step with ``1/lambda_max``,
    or ``fista_steps`` FISTA steps if > 0, then a damped Newton step on its face, damping
    starting at ``damping`` 1e-6 x max diag H), ``precision`` "auto" (float32 factorisations
    with float64 refinement for faces with >= 512 free coordinates; "float64" or "mixed" to
    force), ``update_ratio`` 0.05 (reuse the last factor through a bordered solve while
    fewer than this fraction of coordinates changed), ``ridge`` 1e-10 (relative to max
    diag, only for singular faces) and ``refine_steps`` 30.
    """

    name = "active_set"
    defaults = {"tol": 1e-10, "max_iter": 500, "warm_steps": 0, "patience": 3, "monotone_steps": 3,
                "fista_steps": 0, "damping": 1e-6, "ridge": 1e-10, "refine_steps": 30,
                "precision": "auto", "update_ratio": 0.05, "cg_start": 40}

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
        return RawResult(problem.unflat(x), status, it, info, setup_seconds=setup)
