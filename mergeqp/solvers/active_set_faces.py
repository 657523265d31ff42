"""Faces of a structured set (bounds, group sums, one L1 ball) and the primal-dual active-set
update between them: the bookkeeping half of the active-set engine (:mod:`.active_set`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..constraints import SetStructure

FREE, LO, HI, CEN = 0, 1, 2, 3


@dataclass
class _Face:
    """A face of the set: each variable FREE, at its lower / upper bound (LO / HI) or at the
    L1 ball's centre (CEN); the signs of the free variables while the ball is active."""

    status: np.ndarray  # int8 FREE / LO / HI / CEN
    sign: np.ndarray | None  # int8 +-1 on free variables when the L1 ball is active
    ball_active: bool

    def key(self) -> bytes:
        s = b"" if self.sign is None else self.sign.tobytes()
        return self.status.tobytes() + s + bytes([self.ball_active])


class FaceBookkeeping:
    """Face bookkeeping of the active-set engine (a mixin of ``_Engine``): which face a point
    lies on (:meth:`identify`), the linear equations the free variables obey on it
    (:meth:`equations`), the values of the fixed ones (:meth:`fixed_values`), and the
    primal-dual update to the next face (:meth:`update_face`, :meth:`_repair`)."""

    st: SetStructure
    n: int
    _pivot_of_group: np.ndarray | None

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
