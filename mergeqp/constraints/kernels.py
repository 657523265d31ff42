"""The one projection / linear-minimisation kernel shared by every set and every solver.

The built-in closed forms (box, per-atom and global simplex, L1 ball, and their intersections
with a box) are all one structure over the flat ``d`` (``n = K * n_atoms``, row-major): bounds
``lo <= x <= hi``, at most one family of group sums ``sum_{i in G} x_i = total_G`` and at most
one L1 ball ``||x - c||_1 <= r`` (not together with a sum). :class:`SetStructure` holds it;
:func:`project_structure` projects onto it exactly (one sort of the breakpoints,
:func:`capped_shift`), :func:`lmo_structure` minimises a linear function over it exactly (a
fractional knapsack). Sets build their part with ``ConstraintSet.structure(shape)`` and
:func:`combine_structures` intersects the parts. The older entry points
(:func:`project_capped_sum`, :func:`lmo_capped_sum`, :func:`lmo_box_l1`, :func:`project_l1`,
:func:`project_box_l1`) are thin views of these two kernels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from ..errors import InfeasibleError, MergeQPError, ValidationError, first_line


@dataclass(frozen=True)
class SetStructure:
    """A set in flat variables (``n = K * n_atoms``, row-major) that the kernels handle.

    ``lo``/``hi``: ``(n,)`` bounds (``+-inf`` allowed); ``group``: ``(n,)`` sum group of each
    variable (``None``: no sum constraint) with ``totals`` ``(n_groups,)``; ``center`` ``(n,)``
    and ``radius``: the L1 ball (``None`` if absent). A sum and a ball never occur together.
    """

    lo: np.ndarray
    hi: np.ndarray
    group: np.ndarray | None = None
    totals: np.ndarray | None = None
    center: np.ndarray | None = None
    radius: float | None = None

    @property
    def bounded(self) -> bool:
        """Whether the set is bounded (so the Frank-Wolfe gap is finite)."""
        if self.group is not None or self.center is not None:
            return True
        return bool(np.all(np.isfinite(self.lo)) and np.all(np.isfinite(self.hi)))

    @property
    def bounds_only(self) -> bool:
        """Whether the set is just the bounds ``lo <= x <= hi`` (no sum, no ball)."""
        return self.group is None and self.center is None

    @cached_property
    def simplex_columns(self) -> int | None:
        """``K`` when the set is per-column sums of the ``(K, n_groups)`` row-major view of ``d``
        (``group[k * n_groups + a] = a``: the per-atom simplex, also after whole atoms were taken out)
        with finite lower bounds and no upper ones; else ``None``. The kernels then sort each column's
        ``K`` entries along an axis (:func:`_project_columns`, :func:`_lmo_columns`) instead of all
        ``2n`` breakpoints by group and value: 3-5x faster at n = 560, the same points."""
        if self.group is None or self.totals is None:
            return None
        n, G = self.group.size, self.totals.size
        if G < 1 or n % G or not bool(np.all(np.isposinf(self.hi))) or not bool(np.all(np.isfinite(self.lo))):
            return None
        K = n // G
        return K if bool(np.all(self.group.reshape(K, G) == np.arange(G))) else None

    @staticmethod
    def free(n: int) -> SetStructure:
        """All of ``R^n``."""
        return SetStructure(np.full(n, -np.inf), np.full(n, np.inf))


def checked_structure(cset: Any, shape: tuple[int, int]) -> SetStructure | None:
    """``cset.structure(shape)`` with its arrays checked against ``d`` of ``shape`` (a user's set: a
    wrong structure is named here, with the set and the method, not by numpy in the kernel that
    reads it)."""
    shape = (int(shape[0]), int(shape[1]))
    owner = f"constraint set {cset.spec}: its structure({shape})"
    try:
        st = cset.structure(shape)
    except MergeQPError:
        raise
    except Exception as exc:  # noqa: BLE001 - a user's set: name it and what it raised
        raise ValidationError(f"{owner} raised {type(exc).__name__}: {first_line(exc, 200)}") from None
    if st is None:
        return None
    if not isinstance(st, SetStructure):
        raise ValidationError(f"{owner} returned {type(st).__name__}, not a SetStructure or None")
    n = shape[0] * shape[1]
    for name in ("lo", "hi", "group", "center"):
        value = getattr(st, name)
        if value is None and name in ("group", "center"):
            continue
        try:
            arr = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError):
            raise ValidationError(f"{owner}: {name} is not an array of numbers") from None
        if arr.shape != (n,):
            raise ValidationError(f"{owner}: {name} has shape {arr.shape}, expected ({n},): one entry per "
                                  f"coefficient of d, flat and row-major")
        if np.isnan(arr).any() or (name in ("group", "center") and not np.isfinite(arr).all()):
            raise ValidationError(f"{owner}: {name} contains NaN" + ("" if name in ("lo", "hi") else " or inf"))
    if st.group is not None:
        group = np.asarray(st.group, dtype=np.float64)
        totals = None if st.totals is None else np.asarray(st.totals, dtype=np.float64)
        if np.any(group < 0) or np.any(group != np.round(group)):
            raise ValidationError(f"{owner}: group must hold whole numbers >= 0 (the sum group of each coefficient)")
        if totals is None or totals.ndim != 1 or totals.size <= int(group.max(initial=-1)) \
                or not np.isfinite(totals).all():
            raise ValidationError(f"{owner}: totals must be finite, one per sum group ({int(group.max(initial=-1)) + 1})")
    if st.center is not None:
        radius = st.radius
        if isinstance(radius, bool) or not isinstance(radius, (int, float, np.floating, np.integer)) \
                or not math.isfinite(float(radius)) or float(radius) < 0:
            raise ValidationError(f"{owner}: the L1 ball's radius must be a finite number >= 0, got {radius!r}")
    return st


def combine_structures(parts: Sequence[tuple[str, SetStructure | None]], n: int) -> SetStructure | str:
    """Intersect the structures of several sets (``(spec, structure or None)`` each) into one,
    or say why the kernels cannot handle the intersection (the text follows ``"<solver> "``)."""
    lo = np.full(n, -np.inf)
    hi = np.full(n, np.inf)
    summed: SetStructure | None = None
    ball: SetStructure | None = None
    for spec, part in parts:
        if part is None:
            return (f"does not handle {spec} (only box, simplex, global_simplex, l1 and their box "
                    f"intersections: the set declares no separable structure)")
        lo = np.maximum(lo, part.lo)
        hi = np.minimum(hi, part.hi)
        if part.group is not None:
            if summed is not None:
                return "handles at most one simplex constraint"
            summed = part
        if part.center is not None:
            if ball is not None:
                return "handles at most one L1 ball"
            ball = part
    if summed is not None and ball is not None:
        return "does not handle a simplex intersected with an L1 ball"
    if ball is not None:
        assert ball.center is not None
        if np.any(ball.center < lo) or np.any(ball.center > hi):
            return "handles an L1 ball intersected with a box only when the centre lies in the box"
        return SetStructure(lo, hi, center=ball.center, radius=ball.radius)
    if summed is not None:
        return SetStructure(lo, hi, summed.group, summed.totals)
    return SetStructure(lo, hi)


def check_sum_feasible(st: SetStructure, label: str) -> None:
    """Raise :class:`InfeasibleError` when a group's bounds cannot reach its total."""
    if st.group is None:
        return
    assert st.totals is not None
    size = st.totals.size
    lo_sum = np.bincount(st.group, st.lo, minlength=size)
    hi_sum = np.bincount(st.group, st.hi, minlength=size)  # +inf where a bound is infinite
    tol = 1e-12 * (1 + np.abs(st.totals))
    if np.any(lo_sum > st.totals + tol) or np.any(hi_sum < st.totals - tol):
        total = float(st.totals[0])
        raise InfeasibleError(f"{label} is empty: the box's bounds cannot sum to {total:g}")


# ---------------------------------------------------------------------- linear minimisation
def lmo_structure(st: SetStructure, grad: np.ndarray) -> tuple[float, np.ndarray | None]:
    """``(min_{s in C} grad's, s)`` over the structure, exact and vectorised (``grad`` flat
    ``(n,)``); ``(-inf, None)`` when the set is unbounded along ``-grad``."""
    lo, hi = st.lo, st.hi
    if st.group is not None:
        assert st.totals is not None
        K = st.simplex_columns
        if K is not None:
            return _lmo_columns(st, grad, K)
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
        s_sorted = lo[order] + take
        s = np.empty_like(s_sorted)
        s[order] = s_sorted
        return float(grad[order] @ s_sorted), s
    if st.center is not None:
        c = st.center
        assert st.radius is not None
        # move away from the centre along -sign(grad), largest |grad| first, within the box
        cap = np.where(grad > 0, c - lo, hi - c)
        gain = np.abs(grad)
        order = np.argsort(-gain, kind="stable")
        capo = np.minimum(cap[order], st.radius)
        before = np.concatenate([[0.0], np.cumsum(capo)[:-1]])
        step_sorted = np.clip(st.radius - before, 0.0, capo)
        step = np.empty_like(step_sorted)
        step[order] = step_sorted
        return float(grad @ c - gain[order] @ step_sorted), c - np.sign(grad) * step
    tie = np.where(np.isfinite(lo), lo, np.where(np.isfinite(hi), hi, 0.0))
    s = np.where(grad > 0, lo, np.where(grad < 0, hi, tie))
    if not np.all(np.isfinite(s)):
        return -math.inf, None
    return float(grad @ s), s


def _lmo_columns(st: SetStructure, grad: np.ndarray, K: int) -> tuple[float, np.ndarray]:
    """:func:`lmo_structure` for :attr:`SetStructure.simplex_columns`: every variable at its lower
    bound and each column's budget on its smallest gradient entry (the first ``k`` among ties, as
    the general knapsack fills them)."""
    assert st.totals is not None
    G = st.totals.size
    lo = st.lo.reshape(K, G)
    best = np.argmin(grad.reshape(K, G), axis=0) * G + np.arange(G)
    s = st.lo.copy()
    s[best] += st.totals - lo.sum(axis=0)
    return float(grad @ s), s


def _project_columns(st: SetStructure, x: np.ndarray, K: int) -> np.ndarray:
    """:func:`project_structure` for :attr:`SetStructure.simplex_columns`: per column, ``y = x - lo``
    onto ``{y >= 0, sum y = total - sum lo}`` by the sorted-threshold rule (Held, Wolfe & Crowder;
    Duchi et al. 2008), all columns at once."""
    assert st.totals is not None
    G = st.totals.size
    lo = st.lo.reshape(K, G)
    y = x.reshape(K, G) - lo
    t = st.totals - lo.sum(axis=0)
    u = -np.sort(-y, axis=0)
    css = np.cumsum(u, axis=0) - t
    ind = np.arange(1, K + 1, dtype=np.float64)[:, None]
    cond = u * ind > css  # u_j - css_j / (j + 1) > 0
    # the last j where it holds; 0 when none does (a zero budget: tau = u_0 puts every entry at lo)
    last = np.where(cond.any(axis=0), K - 1 - np.argmax(cond[::-1], axis=0), 0)
    tau = css[last, np.arange(G)] / (last + 1.0)
    return (np.maximum(y - tau, 0.0) + lo).ravel()


# ---------------------------------------------------------------------- projection
def capped_shift(v: np.ndarray, lo: np.ndarray, hi: np.ndarray, group: np.ndarray,
                 totals: np.ndarray) -> np.ndarray:
    """Per group ``G``, the shift ``tau_G`` with ``sum_{i in G} clip(v_i - tau_G, lo_i, hi_i) =
    totals[G]`` (exact, by sorting the breakpoints ``v - hi`` and ``v - lo``; ``+-inf`` bounds
    allowed). ``v``, ``lo``, ``hi``, ``group``: ``(n,)``; ``totals``: ``(n_groups,)``; assumes
    ``sum lo <= total <= sum hi`` in every group. Cost: one sort of ``2n`` numbers."""
    n = v.size
    ngr = totals.size
    fin_hi = np.isfinite(hi)
    # sum_i clip(v_i - tau, lo_i, hi_i) = C - S tau between breakpoints: entering (tau passes
    # v_i - hi_i) turns hi_i into v_i - tau, leaving (tau passes v_i - lo_i) turns it into lo_i
    base = np.bincount(group, np.where(fin_hi, hi, 0.0), minlength=ngr)
    b = np.concatenate([v - hi, v - lo])
    dC = np.concatenate([v - np.where(fin_hi, hi, 0.0), lo - v])
    dS = np.concatenate([np.ones(n), -np.ones(n)])
    grp = np.concatenate([group, group])
    order = np.lexsort((b, grp))
    b, dC, dS, grp = b[order], dC[order], dS[order], grp[order]
    with np.errstate(invalid="ignore"):
        # cumulative state after each event, restarted per group
        C = np.cumsum(np.where(np.isfinite(dC), dC, 0.0))
        S = np.cumsum(dS)
        starts = np.searchsorted(grp, np.arange(ngr))
        prevC = np.where(starts > 0, C[np.maximum(starts - 1, 0)], 0.0)
        prevS = np.where(starts > 0, S[np.maximum(starts - 1, 0)], 0.0)
        C = C - prevC[grp] + base[grp]
        S = S - prevS[grp]
        phi = np.where(np.isposinf(b), -np.inf, np.where(np.isneginf(b), np.where(S > 0, np.inf, C), C - S * b))
        # the last event per group at which the sum is still >= the total
        ok = phi >= totals[grp]
        idx = np.where(ok, np.arange(2 * n), -1)
        last = np.full(ngr, -1, dtype=np.intp)
        np.maximum.at(last, grp, idx)
    tau = np.empty(ngr)
    for_groups = last >= 0
    k = last[for_groups]
    Sk, Ck = S[k], C[k]
    tau_k = np.where(Sk > 0, (Ck - totals[for_groups]) / np.where(Sk > 0, Sk, 1.0), b[k])
    tau[for_groups] = np.where(np.isfinite(tau_k), tau_k, 0.0)
    # no event reaches the total: every variable at its upper bound (sum hi = total)
    first = np.minimum(starts, 2 * n - 1)
    tau[~for_groups] = b[first[~for_groups]] - 1.0
    return tau


#: an input this many times larger than its projection is projected twice (see :func:`project_structure`)
FAR_INPUT = 1e3


def project_structure(st: SetStructure, x: np.ndarray) -> np.ndarray:
    """Euclidean projection of flat ``x`` ``(n,)`` onto the structure (exact; sorts instead of
    bisection). A point that is feasible up to rounding in the equations (``1e-14``
    relative) is returned as it is. A sum or ball constraint's shift is computed in the units of
    ``x``: from a point :data:`FAR_INPUT` times farther out than its projection (a face solve along
    a direction of zero curvature ends at 1e9), the shift's rounding leaves the result off the set
    by ``eps |x|`` (1.9e-7 of a radius 1.8 from 7e9, an active-set solve returned it); such a
    result is projected once more, from where the rounding is that of the set's own scale."""
    y = _project_once(st, x)
    if st.bounds_only:
        return y  # a clip is exact
    if float(np.max(np.abs(x), initial=0.0)) > FAR_INPUT * (1.0 + float(np.max(np.abs(y), initial=0.0))):
        y = _project_once(st, y)
    return y


def _project_once(st: SetStructure, x: np.ndarray) -> np.ndarray:
    lo, hi = st.lo, st.hi
    if st.group is not None:
        assert st.totals is not None
        if bool(np.all(x >= lo)) and bool(np.all(x <= hi)):
            sums = np.bincount(st.group, x, minlength=st.totals.size)
            size = np.bincount(st.group, np.abs(x), minlength=st.totals.size)
            if float(np.max(np.abs(sums - st.totals) - 1e-14 * (size + np.abs(st.totals)))) <= 0:
                return x
        K = st.simplex_columns
        if K is not None:
            return _project_columns(st, x, K)
        tau = capped_shift(x, lo, hi, st.group, st.totals)
        return np.clip(x - tau[st.group], lo, hi)
    y = np.clip(x, lo, hi)
    if st.center is None:
        return y
    assert st.radius is not None
    c = st.center
    if float(np.sum(np.abs(y - c))) <= st.radius:
        return y
    u = x - c
    au = np.abs(u)
    # x_i = c_i + sign(u_i) min(max(|u_i| - tau, 0), cap_i): a capped sum over |u|
    cap = np.where(u > 0, hi - c, c - lo)
    zero = np.zeros(x.size, dtype=np.intp)
    tau = float(capped_shift(au, np.zeros(x.size), cap, zero, np.array([st.radius]))[0])
    step = np.clip(au - max(tau, 0.0), 0.0, cap)
    return c + np.sign(u) * step


# ---------------------------------------------------------------------- views by axis
def sum_groups(shape: tuple[int, ...], axis: int | None) -> tuple[np.ndarray, int]:
    """``(group, n_groups)`` of the flat (row-major) entries of an array of ``shape`` when
    summing along ``axis`` (``None``: one group)."""
    n = int(np.prod(shape))
    if axis is None:
        return np.zeros(n, dtype=np.intp), 1
    ids = np.arange(n).reshape(shape)
    rest = np.moveaxis(ids, axis, 0).shape[1:]
    group = np.empty(n, dtype=np.intp)
    group[np.moveaxis(ids, axis, 0).reshape(shape[axis], -1)] = np.arange(int(np.prod(rest)))[None, :]
    return group, int(np.prod(rest))


def _axis_structure(shape: tuple[int, ...], lo: np.ndarray, hi: np.ndarray, total: np.ndarray | float,
                    axis: int | None) -> SetStructure:
    group, ngr = sum_groups(shape, axis)
    totals = np.broadcast_to(np.asarray(total, dtype=np.float64).ravel(), (ngr,)).astype(np.float64) \
        if np.size(total) in (1, ngr) else np.asarray(total, dtype=np.float64).ravel()
    return SetStructure(np.broadcast_to(lo, shape).astype(np.float64).ravel(),
                        np.broadcast_to(hi, shape).astype(np.float64).ravel(), group, totals)


def project_capped_sum(v: np.ndarray, lo: np.ndarray, hi: np.ndarray, total: np.ndarray | float,
                       axis: int | None) -> np.ndarray:
    """Project ``v`` onto ``{x : lo <= x <= hi, sum(x, axis) = total}`` (per slice along
    ``axis``; ``None``: the whole array is one slice), exactly, by :func:`project_structure`.
    Assumes feasibility (``sum lo <= total <= sum hi``), which callers check."""
    v = np.asarray(v, dtype=np.float64)
    st = _axis_structure(v.shape, np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64), total, axis)
    return project_structure(st, v.ravel()).reshape(v.shape)


def lmo_capped_sum(grad: np.ndarray, lo: np.ndarray, hi: np.ndarray, total: float,
                   axis: int | None) -> np.ndarray:
    """Minimiser of ``<grad, s>`` over ``{lo <= s <= hi, sum(s, axis) = total}`` (exact, by
    :func:`lmo_structure`). Raises :class:`InfeasibleError` when a slice cannot reach ``total``."""
    grad = np.asarray(grad, dtype=np.float64)
    st = _axis_structure(grad.shape, np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64), total, axis)
    check_sum_feasible(st, f"box & sum = {total:g}")
    _, s = lmo_structure(st, grad.ravel())
    assert s is not None
    return s.reshape(grad.shape)


def lmo_box_l1(grad: np.ndarray, lo: np.ndarray, hi: np.ndarray, center: np.ndarray,
               radius: float) -> np.ndarray:
    """Minimiser of ``<grad, s>`` over ``{lo <= s <= hi, ||s - center||_1 <= radius}``, exact,
    for ``lo <= center <= hi`` (by :func:`lmo_structure`)."""
    grad = np.asarray(grad, dtype=np.float64)
    shape = grad.shape
    st = SetStructure(np.broadcast_to(lo, shape).astype(np.float64).ravel(),
                      np.broadcast_to(hi, shape).astype(np.float64).ravel(),
                      center=np.broadcast_to(center, shape).astype(np.float64).ravel(), radius=float(radius))
    _, s = lmo_structure(st, grad.ravel())
    assert s is not None
    return s.reshape(shape)


def project_box_l1(v: np.ndarray, lo: np.ndarray, hi: np.ndarray, center: np.ndarray, radius: float) -> np.ndarray:
    """Project onto ``{lo <= x <= hi, ||x - center||_1 <= radius}`` with ``lo <= center <= hi``
    (exact, by :func:`project_structure`)."""
    v = np.asarray(v, dtype=np.float64)
    shape = v.shape
    st = SetStructure(np.broadcast_to(lo, shape).astype(np.float64).ravel(),
                      np.broadcast_to(hi, shape).astype(np.float64).ravel(),
                      center=np.broadcast_to(center, shape).astype(np.float64).ravel(), radius=float(radius))
    return project_structure(st, v.ravel()).reshape(shape)


def project_l1(v: np.ndarray, radius: float) -> np.ndarray:
    """Euclidean projection of ``v`` onto ``{x : ||x||_1 <= radius}``."""
    v = np.asarray(v, dtype=np.float64)
    return project_box_l1(v, np.full(v.shape, -np.inf), np.full(v.shape, np.inf), np.zeros(v.shape), radius)
