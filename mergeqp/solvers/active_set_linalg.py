"""Linear algebra of the active-set engine (:mod:`.active_set`): PSD solves with a ridge and
refinement, and the face solves (factorisation, bordered updates, refinement, CG)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import scipy.linalg as sla

from ..cholesky import cho_solve
from ..errors import SolverError
from ..matrix_cache import matrix_values
from .active_set_faces import FREE, _Face

#: names of the active-set solver's values in :func:`~mergeqp.matrix_cache.matrix_values`:
#: the float32 copy of H, and the last factor of a face of the plain problem (``rho = 0``)
#: that a solve ended with (a warm-started solve on the same H starts from it)
FLOAT32_KEY = "active_set.float32"
FACTOR_KEY = "active_set.last_face_factor"
#: the values above are kept between solves only up to this many variables (the float32 copy
#: is 268 MB at n = 8192 and stays while H does; above, a solve frees it at its end)
SHARE_MAX_N = 8192


def group_pairs(gidx: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Every pair ``(i, j)`` of positions with ``gidx[i] == gidx[j]`` (``i = j`` included), as two
    index arrays: each position repeated once per member of its group, against those members (by
    index arithmetic; forming ``S'S`` of the sparse group indicator ``S`` cost 10x more on the
    proximal faces of ``mnist_real640``'s simplex)."""
    order = np.argsort(gidx, kind="stable")
    sizes = np.bincount(gidx, minlength=n_groups)
    rep = sizes[gidx[order]]
    i = np.repeat(order, rep)
    first = np.repeat((np.cumsum(sizes) - sizes)[gidx[order]], rep)
    j = order[first + np.arange(i.size) - np.repeat(np.cumsum(rep) - rep, rep)]
    return i, j


def solve_psd(M: np.ndarray, rhs: np.ndarray, ridge: float = 1e-10, refine: int = 30,
              try_plain: bool = True, rtol: float = 1e-14, scale: float = 0.0) -> tuple[np.ndarray, str]:
    """Solve ``M y = rhs`` for symmetric PSD ``M`` (``(p, p)``): Cholesky when well posed, else
    Cholesky of ``M + ridge * max(diag M) * I`` with iterative refinement (proximal-point
    iterations from 0, converging to a minimiser of ``1/2 y'My - rhs'y`` when one exists)
    until the residual is below ``rtol (|rhs| + max(diag M) |y|)`` or stalls.
    ``try_plain=False`` skips the plain Cholesky (the caller knows it fails). ``scale``: the
    problem's curvature scale (max diag H); the ridge is relative to ``max(max diag M, scale)``
    so that a face whose curvature is all rounding noise still factorises.
    Returns ``(y, method)``: ``method`` is ``"cholesky (ridged)"`` when ``try_plain=False`` and the
    ridged factor shows that ``M`` was well posed after all (every pivot^2 above 4x the ridge, so
    the plain factor's above ~3x it), else ``"ridge+refinement"``."""
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
                return cho_solve(fac, rhs), "cholesky"
        except np.linalg.LinAlgError:
            pass
    eps = ridge * max(top, scale)
    diag = np.diag_indices(p)
    for _ in range(6):
        Mr = M.copy()
        Mr[diag] += eps
        try:
            fac = sla.cho_factor(Mr, lower=False, check_finite=False, overwrite_a=True)
            break
        except np.linalg.LinAlgError:
            eps *= 100.0
    else:
        raise SolverError("active_set: could not factorise the reduced Hessian even with a ridge")
    del Mr
    well_posed = not try_plain and float(np.min(np.abs(np.diag(fac[0])))) ** 2 > 4.0 * eps
    y = np.zeros(p)
    res = rhs.copy()
    r0 = float(np.linalg.norm(rhs)) or 1.0
    prev = math.inf
    for _ in range(refine):
        y += cho_solve(fac, res)
        res = rhs - M @ y
        nr = float(np.linalg.norm(res))
        if nr <= rtol * (r0 + top * float(np.linalg.norm(y))) or nr > 0.999 * prev:
            break
        prev = nr
    return y, "cholesky (ridged)" if well_posed else "ridge+refinement"


def _robust_cholesky(S: np.ndarray) -> tuple[np.ndarray, bool]:
    """Cholesky of a small SPD matrix, with a tiny ridge if rounding made it indefinite."""
    top = max(float(np.max(np.abs(np.diag(S)))), np.finfo(float).tiny)
    for eps in (0.0, 1e-10, 1e-6, 1e-3):
        try:
            return sla.cho_factor(S + eps * top * np.eye(S.shape[0]) if eps else S, lower=False, check_finite=False)
        except np.linalg.LinAlgError:
            continue
    raise np.linalg.LinAlgError("bordered update: Schur complement is not positive definite")


class FaceFactorisation:
    """Face solves of the active-set engine (a mixin of ``_Engine``): the reduced system
    ``Z'(H + rho I)Z y = -Z'grad`` on a face by the null-space method, factorised by Cholesky
    (float32 with float64 refinement on large faces), reusing the last factor through a
    bordered Schur-complement solve when the face changed little, with a ridge and refinement
    when the face is singular, or approximated by conjugate gradients on the first face."""

    H: np.ndarray
    H32: np.ndarray | None
    g: np.ndarray
    n: int
    eta: float
    rho: float
    xc: np.ndarray
    opts: dict[str, Any]
    fine: bool
    inexact_ok: bool
    factorisations: int
    solve_methods: set[str]
    _factor: dict[str, Any] | None
    _few_changes: bool
    _singular: bool
    #: ``(rho, size)``: the smallest face (at that ``rho``) whose reduced matrix did not factorise
    _ill_size: tuple[float, float]

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

        def same_group_pairs() -> tuple[np.ndarray, np.ndarray]:
            return group_pairs(gidx, pivots.size)

        def gather(src: np.ndarray) -> np.ndarray:
            # M = Z'(H + rho I)Z = Z'HZ + rho (I + Z_P'Z_P): M_ij = H_ij - w_j H_i,p(j) - w_i H_p(i),j
            # + w_i w_j H_p(i),p(j) + rho ([i = j] + w_i w_j [p(i) = p(j)]) (row-contiguous gathers)
            rows = np.take(src, N, axis=0)
            if pivots.size > 1:
                # many groups (per-atom simplex): difference rows first, then columns,
                # M = R_N - R_p(N) w' with R = H_N - w H_p(N) (two row and two column gathers and no
                # |N| x |N| temporary beyond M: about half the time of forming H_N,p(N) and its transpose)
                wd = w.astype(src.dtype)
                signed = not np.all(w == 1.0)
                pN = pivots[gidx]
                R = np.take(src, pN, axis=0)
                if signed:
                    R *= wd[:, None]
                np.subtract(rows, R, out=R)
                del rows
                M = np.take(R, N, axis=1)
                RP = np.take(R, pN, axis=1)
                del R
                if signed:
                    RP *= wd[None, :]
                M -= RP
                del RP
                if rho > 0:
                    i, j = same_group_pairs()
                    M[i, j] += rho * (wd[i] * wd[j])
            else:
                M = np.take(rows, N, axis=1)
                if pivots.size:  # one group (global simplex, L1 ball): a rank-two update
                    wd = w.astype(src.dtype)
                    a = np.take(rows, pivots[0], axis=1)  # H_N,p
                    q = src[pivots[0], pivots[0]] + rho
                    # M -= a w' + w a' - q w w' = u w' + w u' with u = a - q/2 w, in place (BLAS
                    # ger on the Fortran view of M): one pass, no temporaries
                    u = a - (0.5 * q) * wd
                    ger = sla.get_blas_funcs("ger", (M,))
                    Mt = M.T
                    Mt = ger(-1.0, u, wd, a=Mt, overwrite_a=True)
                    Mt = ger(-1.0, wd, u, a=Mt, overwrite_a=True)
                    M = Mt.T
            if rho > 0:
                M[np.diag_indices_from(M)] += rho
            return M

        ident = (N, piv_of_N, w_full)
        known_ill = self._holds_ill_face(N)
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
        # without loss of accuracy) once the changes are few on the plain problem. A proximal level's
        # first solve repeats the face its centre was accepted on (no change) at a new rho, and the
        # level then moves on to other faces: float32 there too (stop 61: a float64 factorisation at
        # every level's start was a quarter of the low-rank instances' time)
        plain = self.rho <= float(self.opts["prox_min"]) * self.eta * (1.0 + 1e-9)
        tail = changed < float(self.opts["update_ratio"]) * N.size and plain
        self.inexact_ok = changed > 0.25 * N.size
        self._singular = False
        if self.use_mixed(N.size) and not tail and not known_ill:
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
        ill = self._singular
        if not (self._singular or known_ill):  # (a zero pivot in float32 is one in float64 too)
            apply = self._factorise(lambda _src: M, np.float64, ident, copy=True)
            if apply is not None:
                res = self._refine(apply, reduced, expand, x, grad)
                if res is not None:
                    self.solve_methods.add("cholesky")
                    return res
            ill = ill or apply is None
        if ill:
            self._ill_size = (self.rho, min(N.size, self._ill_size[1]) if self.rho <= self._ill_size[0] else N.size)
        self._factor = None
        rtol = 1e-14 if self.fine or self._few_changes else 1e-10
        y, method = solve_psd(M, -reduced(grad), self.opts["ridge"], self.opts["refine_steps"], try_plain=False,
                              rtol=rtol, scale=self.eta)
        if known_ill and method == "cholesky (ridged)":
            self._ill_size = (self._ill_size[0], N.size + 1)  # presumed wrongly: try the plain factors again
        self.solve_methods.add(method)
        dx = expand(y)
        return x + dx, grad + self.inner_step(dx)

    def _holds_ill_face(self, N: np.ndarray) -> bool:
        """Whether the face ``N`` is presumed not to factorise in float64: it is no smaller than
        the smallest face that did not (at no smaller ``rho``). A singular H (more unknowns than
        samples x outputs) makes every face larger than its rank singular, and PDAS moves
        between such faces; the plain Cholesky attempts (float32, then float64: each about a
        factorisation, then failing) are skipped for the ridged solve they would end in. A
        wrong presumption costs a ridged factorisation instead of a plain one (the same
        minimiser) and is undone when the ridged factor shows a well-posed matrix."""
        rho, size = self._ill_size
        return self.rho <= rho and N.size >= size

    def float32_hessian(self) -> np.ndarray:
        """``H`` in float32 (``(n, n)``), made once per H array (shared through
        :func:`~mergeqp.matrix_cache.matrix_values` by later solves on the same array)."""
        if self.H32 is None:
            shared = self._shared_values()
            H32 = None if shared is None else shared.get(FLOAT32_KEY)
            if H32 is None:
                H32 = self.H.astype(np.float32)
                H32.setflags(write=False)
                if shared is not None:
                    shared[FLOAT32_KEY] = H32
            self.H32 = H32
        return self.H32

    def _shared_values(self) -> dict[str, Any] | None:
        """This H array's cached values (``None`` above :data:`SHARE_MAX_N` variables)."""
        return matrix_values(self.H) if self.n <= SHARE_MAX_N else None

    def reuse_shared_factor(self) -> None:
        """Start from the last face factor of an earlier solve on this same H array (a warm
        start: its first faces are near that solve's last one, and a face that differs from it
        in few coordinates is then a bordered solve instead of a factorisation)."""
        shared = self._shared_values()
        if shared is not None and self._factor is None:
            factor = shared.get(FACTOR_KEY)
            if factor is not None and factor["dtype"] == np.float32:
                self.float32_hessian()
            self._factor = factor

    def share_factor(self) -> None:
        """Keep the current face factor (of the plain problem only) for later warm starts on
        this H array."""
        shared = self._shared_values()
        if shared is not None and self._factor is not None and self._factor["rho"] == 0.0:
            shared[FACTOR_KEY] = self._factor

    def use_mixed(self, size: int) -> bool:
        prec = self.opts["precision"]
        return prec == "mixed" or (prec == "auto" and size >= 512)

    def _factorise(self, gather: Any, dtype: Any, ident: tuple[np.ndarray, ...] | None,
                   copy: bool = False) -> Any:
        """Cholesky of ``M`` in ``dtype``; remembers it (for bordered updates) when ``ident``
        is given. ``None`` when ``M`` is not numerically positive definite in that precision."""
        if dtype == np.float32:
            M = gather(self.float32_hessian())
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
            return cho_solve(fac, r.astype(dtype)).astype(np.float64)

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
            return lambda r: cho_solve(fac, r.astype(dt)).astype(np.float64)
        fac, dt = cache["fac"], cache["dtype"]
        src = self.H32 if dt == np.float32 else self.H
        assert src is not None
        n0 = N0.size

        def solve_old(R: np.ndarray) -> np.ndarray:
            return cho_solve(fac, R.astype(dt)).astype(np.float64)

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
                u2 = cho_solve(facS, b2 - X.T @ b1)
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
                    u = u - T @ cho_solve(facW, u[D])
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
            Hm = self.float32_hessian()
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
