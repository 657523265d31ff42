"""Convex constraint sets for the merge QP.

Every set acts on ``d`` of shape ``(K, n_atoms)`` (models x atoms) and knows:

- ``cvxpy(var)``: its CVXPY constraints on a ``cp.Variable((K, n_atoms))``;
- ``project(d)``: the Euclidean projection, where it has a closed form
  (``has_projection``; otherwise ``NotImplementedError``);
- ``support(grad)``: ``(value, s)`` with ``value <= min_{s' in C} <grad, s'>`` and ``s`` a
  (near-)minimiser: the linear minimisation oracle (LMO) behind the Frank-Wolfe gap. For
  closed forms ``value = <grad, s>`` is the exact minimum; for LPs ``value`` is the LP's dual
  bound (a proven lower bound). ``(-inf, None)`` when the set is unbounded along ``-grad``;
- ``lmo_method``: how ``support`` computes (``closed form``, ``LP (HiGHS dual bound)``,
  ``LP (CVXPY/Clarabel)``);
- ``violation(d)``: the largest constraint violation, in the units of ``d`` (0 if feasible);
- ``linear_form(shape)``: a polyhedral description ``A_ub x <= b_ub, A_eq x = b_eq,
  lb <= x <= ub`` in the flat (row-major) variables, or ``None`` when the set has none
  (the L1 ball needs auxiliary variables; user CVXPY constraints).

Sets are registered by name in :data:`CONSTRAINT_SETS` (explicitly, below) and parsed from the
command-line spelling with :func:`parse_constraint` (``"box:0,1"``, ``"simplex"``,
``"box:0,1 & simplex"``, ...). Intersections are built with :func:`as_constraint_set` or
``a & b``; :func:`check_feasible` raises :class:`~mergeqp.errors.InfeasibleError` naming the
sets when an intersection is empty.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse as sp

from .errors import InfeasibleError, UnsupportedError, ValidationError, unknown

Shape = tuple[int, int]

LMO_CLOSED_FORM = "closed form"
LMO_HIGHS = "LP (HiGHS dual bound)"
LMO_CVXPY = "LP (CVXPY/Clarabel)"


@dataclass(frozen=True)
class LinearForm:
    """``A_ub x <= b_ub``, ``A_eq x = b_eq``, ``lb <= x <= ub`` over flat ``x`` of length n."""

    n: int
    A_ub: sp.csr_matrix
    b_ub: np.ndarray
    A_eq: sp.csr_matrix
    b_eq: np.ndarray
    lb: np.ndarray
    ub: np.ndarray

    @staticmethod
    def empty(n: int) -> LinearForm:
        z = sp.csr_matrix((0, n))
        return LinearForm(n, z, np.zeros(0), z, np.zeros(0), np.full(n, -np.inf), np.full(n, np.inf))

    def __and__(self, other: LinearForm) -> LinearForm:
        return LinearForm(
            self.n,
            sp.vstack([self.A_ub, other.A_ub]).tocsr(),
            np.concatenate([self.b_ub, other.b_ub]),
            sp.vstack([self.A_eq, other.A_eq]).tocsr(),
            np.concatenate([self.b_eq, other.b_eq]),
            np.maximum(self.lb, other.lb),
            np.minimum(self.ub, other.ub),
        )


class ConstraintSet(ABC):
    """A closed convex set of merge coefficients ``d`` (shape ``(K, n_atoms)``)."""

    #: registry name
    name: str = ""

    @property
    def spec(self) -> str:
        """The command-line spelling (``box:0,1``) used in reports and JSON."""
        return self.name

    def validate(self, shape: Shape) -> None:
        """Raise :class:`ValidationError` if the set does not fit ``d`` of this shape."""

    @abstractmethod
    def cvxpy(self, var: Any) -> list[Any]:
        """CVXPY constraints on ``var`` (a ``cp.Variable`` of shape ``(K, n_atoms)``)."""

    has_projection: bool = False

    def project(self, d: np.ndarray) -> np.ndarray:
        """Euclidean projection of ``d`` onto the set (closed form only)."""
        raise NotImplementedError(f"{self.spec} has no closed-form projection")

    @abstractmethod
    def support(self, grad: np.ndarray) -> tuple[float, np.ndarray | None]:
        """``(value, s)``: ``value <= min_{s' in C} <grad, s'>`` (equal for closed forms; an LP's
        dual bound otherwise) and a minimiser ``s``; ``(-inf, None)`` if unbounded below."""

    @property
    def lmo_method(self) -> str:
        """How :meth:`support` computes: ``closed form`` or the LP it solves."""
        return LMO_CLOSED_FORM

    @abstractmethod
    def violation(self, d: np.ndarray) -> float:
        """Largest violation of the set's constraints at ``d`` (0 when feasible), units of ``d``."""

    def linear_form(self, shape: Shape) -> LinearForm | None:
        """Polyhedral description in flat variables, or ``None`` if not available."""
        return None

    def members(self) -> tuple[ConstraintSet, ...]:
        """The sets whose intersection this is (itself for a basic set)."""
        return (self,)

    def __and__(self, other: ConstraintSet) -> ConstraintSet:
        return as_constraint_set([*self.members(), *other.members()])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"


# ---------------------------------------------------------------------- helpers
def _float_array(value: Any, what: str) -> np.ndarray:
    """``value`` as a float64 array, or a :class:`ValidationError` naming ``what``."""
    if hasattr(value, "detach"):  # torch tensors
        value = value.detach().cpu().numpy()
    try:
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValidationError(f"{what} must be a number or an array of numbers, got {type(value).__name__}") from None


def _broadcast(value: Any, shape: Shape, what: str) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    try:
        return np.broadcast_to(arr, shape).astype(np.float64)
    except ValueError:
        raise ValidationError(
            f"{what} has shape {arr.shape}, which does not broadcast to d's shape {tuple(shape)} "
            f"(models x atoms)"
        ) from None


def _fmt(x: float) -> str:
    return f"{x:g}"


def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    """Cumulative sum along axis 0 of the entries *before* each one (``inf``-safe)."""
    out = np.zeros_like(x)
    if x.shape[0] > 1:
        out[1:] = np.cumsum(x[:-1], axis=0)
    return out


def project_capped_sum(v: np.ndarray, lo: np.ndarray, hi: np.ndarray, total: np.ndarray | float,
                       axis: int | None) -> np.ndarray:
    """Project ``v`` onto ``{x : lo <= x <= hi, sum(x, axis) = total}`` (per slice along ``axis``).

    Solves for the shift ``tau`` with ``sum clip(v - tau, lo, hi) = total`` by bisection to
    machine precision, then an exact finish on the breakpoints. Vectorised over slices.
    ``axis=None`` treats the whole array as one slice. Assumes feasibility
    (``sum lo <= total <= sum hi``), which callers check.
    """
    v = np.asarray(v, dtype=np.float64)
    lo = np.broadcast_to(np.asarray(lo, dtype=np.float64), v.shape)
    hi = np.broadcast_to(np.asarray(hi, dtype=np.float64), v.shape)
    if axis is None:
        out = project_capped_sum(v.reshape(-1, 1), lo.reshape(-1, 1), hi.reshape(-1, 1),
                                 np.asarray(total, dtype=np.float64).reshape(1), axis=0)
        return out.reshape(v.shape)
    if axis != 0:
        return np.moveaxis(project_capped_sum(np.moveaxis(v, axis, 0), np.moveaxis(lo, axis, 0),
                                              np.moveaxis(hi, axis, 0), total, 0), 0, axis)
    total = np.broadcast_to(np.asarray(total, dtype=np.float64), v.shape[1:])
    # bracket tau: at t_lo every entry sits at its upper clip, at t_hi at its lower clip
    span = np.maximum(np.where(np.isfinite(lo), np.abs(v - np.where(np.isfinite(lo), lo, 0.0)), 0.0),
                      np.where(np.isfinite(hi), np.abs(v - np.where(np.isfinite(hi), hi, 0.0)), 0.0))
    scale = np.max(np.abs(v), axis=0) + np.abs(total) + np.max(span, axis=0) + 1.0
    t_lo = np.min(v, axis=0) - scale
    t_hi = np.max(v, axis=0) + scale

    def excess(tau: np.ndarray) -> np.ndarray:
        return np.sum(np.clip(v - tau, lo, hi), axis=0) - total

    for _ in range(200):
        mid = 0.5 * (t_lo + t_hi)
        e = excess(mid)
        t_lo = np.where(e > 0, mid, t_lo)
        t_hi = np.where(e > 0, t_hi, mid)
        if np.all(t_hi - t_lo <= 1e-15 * (1.0 + np.abs(mid))):
            break
    tau = 0.5 * (t_lo + t_hi)
    # exact finish: entries strictly inside (lo, hi) share tau; solve for it exactly
    x = np.clip(v - tau, lo, hi)
    free = (x > lo) & (x < hi)
    nfree = free.sum(axis=0)
    fixed_sum = np.sum(np.where(free, 0.0, x), axis=0)
    tau_exact = np.where(nfree > 0, (np.sum(np.where(free, v, 0.0), axis=0) - (total - fixed_sum))
                         / np.maximum(nfree, 1), tau)
    x2 = np.clip(v - tau_exact, lo, hi)
    ok = np.abs(np.sum(x2, axis=0) - total) <= np.abs(np.sum(x, axis=0) - total)
    return np.where(ok, x2, x)


def lmo_capped_sum(grad: np.ndarray, lo: np.ndarray, hi: np.ndarray, total: float,
                   axis: int | None) -> np.ndarray:
    """Minimiser of ``<grad, s>`` over ``{lo <= s <= hi, sum(s, axis) = total}`` (exact).

    A fractional knapsack per slice: start at ``lo`` and spend the budget ``total - sum lo``
    on the entries with the smallest gradient first, each up to its capacity ``hi - lo``.
    Raises :class:`InfeasibleError` when a slice cannot reach ``total``.
    """
    grad = np.asarray(grad, dtype=np.float64)
    shape = grad.shape
    lo = np.broadcast_to(lo, shape)
    hi = np.broadcast_to(hi, shape)
    if axis is None:
        g2, lo2, hi2 = grad.reshape(-1, 1), lo.reshape(-1, 1), hi.reshape(-1, 1)
    else:
        g2, lo2, hi2 = (np.moveaxis(a, axis, 0) for a in (grad, lo, hi))
    budget = total - np.sum(lo2, axis=0)
    capacity = np.sum(hi2 - lo2, axis=0)
    if np.any(budget < -1e-12 * (1 + abs(total))) or np.any(capacity < budget - 1e-12 * (1 + abs(total))):
        raise InfeasibleError(f"box & sum = {total:g} is empty: the bounds cannot sum to {total:g}")
    order = np.argsort(g2, axis=0, kind="stable")
    cap = np.take_along_axis(hi2 - lo2, order, axis=0)
    amount = np.clip(budget - _exclusive_cumsum(cap), 0.0, cap)
    s2 = np.array(lo2, dtype=np.float64, copy=True)
    np.put_along_axis(s2, order, np.take_along_axis(lo2, order, axis=0) + amount, axis=0)
    return s2.reshape(shape) if axis is None else np.moveaxis(s2, 0, axis)


def lmo_box_l1(grad: np.ndarray, lo: np.ndarray, hi: np.ndarray, center: np.ndarray,
               radius: float) -> np.ndarray:
    """Minimiser of ``<grad, s>`` over ``{lo <= s <= hi, ||s - center||_1 <= radius}``, exact,
    for ``lo <= center <= hi``: move from the centre against the gradient, largest ``|grad|``
    first, each entry up to its box capacity, until the L1 budget is spent."""
    g = np.asarray(grad, dtype=np.float64).ravel()
    c = np.asarray(center, dtype=np.float64).ravel()
    cap = np.where(g < 0, hi.ravel() - c, np.where(g > 0, c - lo.ravel(), 0.0))
    order = np.argsort(-np.abs(g), kind="stable")
    cap_o = cap[order]
    amount = np.zeros_like(g)
    amount[order] = np.clip(radius - _exclusive_cumsum(cap_o), 0.0, cap_o)
    return (c - np.sign(g) * amount).reshape(np.shape(grad))


# ---------------------------------------------------------------------- basic sets
class Unconstrained(ConstraintSet):
    """No constraint: ``d`` ranges over all of ``R^(K x n_atoms)``."""

    name = "none"
    has_projection = True

    def cvxpy(self, var: Any) -> list[Any]:
        return []

    def project(self, d: np.ndarray) -> np.ndarray:
        return np.array(d, dtype=np.float64)

    def support(self, grad: np.ndarray) -> tuple[float, np.ndarray | None]:
        if np.all(grad == 0):
            return 0.0, np.zeros_like(grad, dtype=np.float64)
        return -math.inf, None

    def violation(self, d: np.ndarray) -> float:
        return 0.0

    def linear_form(self, shape: Shape) -> LinearForm:
        return LinearForm.empty(shape[0] * shape[1])

    def members(self) -> tuple[ConstraintSet, ...]:
        return ()


class Box(ConstraintSet):
    """``lo <= d <= hi`` elementwise; ``lo``/``hi`` scalars or arrays broadcastable to
    ``(K, n_atoms)`` (``-inf``/``inf`` allowed). The paper's set is ``Box(0, 1)``."""

    name = "box"
    has_projection = True

    def __init__(self, lo: Any = 0.0, hi: Any = 1.0):
        self.lo = _float_array(lo, "box lower bound")
        self.hi = _float_array(hi, "box upper bound")
        if np.any(np.isnan(self.lo)) or np.any(np.isnan(self.hi)):
            raise ValidationError("box bounds contain NaN")
        if np.any(self.lo == np.inf) or np.any(self.hi == -np.inf):
            raise InfeasibleError("box is empty: a lower bound is +inf or an upper bound is -inf")
        try:
            lo_b, hi_b = np.broadcast_arrays(self.lo, self.hi)
        except ValueError:
            raise ValidationError(
                f"box bounds have shapes {self.lo.shape} and {self.hi.shape}, which do not broadcast"
            ) from None
        crossed = lo_b > hi_b
        if np.any(crossed):
            bad = np.argwhere(crossed)
            i = tuple(int(j) for j in bad[0])
            where = (f" at d[{i[0]}, {i[1]}]" if len(i) == 2 else f" at index {i}") if i else ""
            raise InfeasibleError(
                f"box is empty: lower bound {lo_b[i]:g} > upper bound {hi_b[i]:g}{where}"
                f"{f' ({len(bad)} such entries)' if len(bad) > 1 else ''}"
            )

    @property
    def spec(self) -> str:
        if self.lo.ndim == 0 and self.hi.ndim == 0:
            if float(self.lo) == 0.0 and float(self.hi) == math.inf:
                return "nonneg"
            return f"box:{_fmt(float(self.lo))},{_fmt(float(self.hi))}"
        return "box:<per-entry bounds>"

    def bounds(self, shape: Shape) -> tuple[np.ndarray, np.ndarray]:
        """``(lo, hi)`` broadcast to ``shape`` (fresh float64 arrays)."""
        return _broadcast(self.lo, shape, "box lower bound"), _broadcast(self.hi, shape, "box upper bound")

    @property
    def bounded(self) -> bool:
        return bool(np.all(np.isfinite(self.lo)) and np.all(np.isfinite(self.hi)))

    def validate(self, shape: Shape) -> None:
        lo, hi = self.bounds(shape)
        bad = np.argwhere(lo > hi)
        if bad.size:
            k, a = (int(i) for i in bad[0])
            raise InfeasibleError(
                f"box is empty: lower bound {lo[k, a]:g} > upper bound {hi[k, a]:g} at "
                f"d[{k}, {a}] ({len(bad)} such entries)"
            )

    def cvxpy(self, var: Any) -> list[Any]:
        lo, hi = self.bounds(var.shape)
        out = []
        for bound, upper in ((lo, False), (hi, True)):
            mask = np.isfinite(bound)
            if not mask.any():
                continue
            lhs, rhs = (var, bound) if mask.all() else (var[mask], bound[mask])
            out.append(lhs <= rhs if upper else lhs >= rhs)
        return out

    def project(self, d: np.ndarray) -> np.ndarray:
        lo, hi = self.bounds(np.shape(d))
        return np.clip(d, lo, hi)

    def support(self, grad: np.ndarray) -> tuple[float, np.ndarray | None]:
        lo, hi = self.bounds(grad.shape)
        tie = np.where(np.isfinite(lo), lo, np.where(np.isfinite(hi), hi, 0.0))
        s = np.where(grad > 0, lo, np.where(grad < 0, hi, tie))
        if not np.all(np.isfinite(s)):
            return -math.inf, None
        return float(np.sum(grad * s)), s

    def violation(self, d: np.ndarray) -> float:
        lo, hi = self.bounds(np.shape(d))
        return float(max(np.max(lo - d, initial=0.0), np.max(d - hi, initial=0.0)))

    def linear_form(self, shape: Shape) -> LinearForm:
        lo, hi = self.bounds(shape)
        base = LinearForm.empty(shape[0] * shape[1])
        return LinearForm(base.n, base.A_ub, base.b_ub, base.A_eq, base.b_eq, lo.ravel(), hi.ravel())


class Simplex(ConstraintSet):
    """Per-atom simplex: for every atom ``a``, ``sum_k d[k, a] = total`` and ``d >= 0``
    (a convex combination of the models, chosen per row / direction)."""

    name = "simplex"
    has_projection = True
    #: the axis summed over (0: over models, per atom; ``None``: everything)
    axis: int | None = 0

    def __init__(self, total: float = 1.0):
        try:
            self.total = float(total)
        except (TypeError, ValueError):
            raise ValidationError(f"{self.name}: total must be a number, got {total!r}") from None
        if not math.isfinite(self.total):
            raise ValidationError(f"{self.name}: total must be finite, got {total}")
        if self.total < 0:
            raise InfeasibleError(f"{self.name}: total {self.total:g} < 0 but d >= 0: the set is empty")

    @property
    def spec(self) -> str:
        return self.name if self.total == 1.0 else f"{self.name}:{_fmt(self.total)}"

    def _sum(self, var: Any) -> Any:
        import cvxpy as cp

        return cp.sum(var, axis=0) if self.axis == 0 else cp.sum(var)

    def cvxpy(self, var: Any) -> list[Any]:
        return [var >= 0, self._sum(var) == self.total]

    def project(self, d: np.ndarray) -> np.ndarray:
        zeros = np.zeros(np.shape(d), dtype=np.float64)
        return project_capped_sum(d, zeros, np.full_like(zeros, np.inf), self.total, self.axis)

    def support(self, grad: np.ndarray) -> tuple[float, np.ndarray | None]:
        s = np.zeros_like(grad, dtype=np.float64)
        if self.axis == 0:
            k = np.argmin(grad, axis=0)
            s[k, np.arange(grad.shape[1])] = self.total
        else:
            s.flat[int(np.argmin(grad))] = self.total
        return float(np.sum(grad * s)), s

    def violation(self, d: np.ndarray) -> float:
        sums = np.sum(d, axis=self.axis)
        return float(max(np.max(-d, initial=0.0), np.max(np.abs(sums - self.total), initial=0.0)))

    def linear_form(self, shape: Shape) -> LinearForm:
        K, m = shape
        n = K * m
        if self.axis == 0:
            # row a of A_eq sums d[k, a] over k: flat index k * m + a
            rows = np.tile(np.arange(m), K)
            A_eq = sp.csr_matrix((np.ones(n), (rows, np.arange(n))), shape=(m, n))
            b_eq = np.full(m, self.total)
        else:
            A_eq = sp.csr_matrix(np.ones((1, n)))
            b_eq = np.array([self.total])
        return LinearForm(n, sp.csr_matrix((0, n)), np.zeros(0), A_eq, b_eq, np.zeros(n), np.full(n, np.inf))


class GlobalSimplex(Simplex):
    """Global simplex: ``sum_{k,a} d[k, a] = total`` and ``d >= 0``."""

    name = "global_simplex"
    axis = None


class L1Ball(ConstraintSet):
    """``||d - center||_1 <= radius`` (the sparsity relaxation); ``center`` a scalar or an
    array broadcastable to ``(K, n_atoms)`` (default 0)."""

    name = "l1"
    has_projection = True

    def __init__(self, radius: float, center: Any = 0.0):
        try:
            self.radius = float(radius)
        except (TypeError, ValueError):
            raise ValidationError(f"l1: radius must be a number, got {radius!r}") from None
        if not math.isfinite(self.radius):
            raise ValidationError(f"l1: radius must be finite, got {radius}")
        if self.radius < 0:
            raise InfeasibleError(f"l1: radius {self.radius:g} < 0 gives an empty ball")
        self.center = _float_array(center, "l1 center")
        if not np.all(np.isfinite(self.center)):
            raise ValidationError("l1: center contains NaN or inf")

    @property
    def spec(self) -> str:
        if self.center.ndim == 0:
            c = float(self.center)
            return f"l1:{_fmt(self.radius)}" + ("" if c == 0 else f",{_fmt(c)}")
        return f"l1:{_fmt(self.radius)},<array center>"

    def _center(self, shape: Shape) -> np.ndarray:
        return _broadcast(self.center, shape, "l1 center")

    def validate(self, shape: Shape) -> None:
        self._center(shape)

    def cvxpy(self, var: Any) -> list[Any]:
        import cvxpy as cp

        return [cp.sum(cp.abs(var - self._center(var.shape))) <= self.radius]

    def project(self, d: np.ndarray) -> np.ndarray:
        c = self._center(np.shape(d))
        return c + project_l1(np.asarray(d, dtype=np.float64) - c, self.radius)

    def support(self, grad: np.ndarray) -> tuple[float, np.ndarray | None]:
        c = self._center(grad.shape)
        s = c.copy()
        i = int(np.argmax(np.abs(grad)))
        if grad.flat[i] != 0:
            s.flat[i] -= self.radius * np.sign(grad.flat[i])
        return float(np.sum(grad * s)), s

    def violation(self, d: np.ndarray) -> float:
        return float(max(np.sum(np.abs(d - self._center(np.shape(d)))) - self.radius, 0.0))

    def linear_form(self, shape: Shape) -> LinearForm | None:
        # |x - c|_1 <= r is polyhedral but needs 2^n facets or n auxiliary variables; the
        # solvers add the auxiliaries themselves, and so does the LMO's HiGHS LP (_lp_form).
        return None


def project_l1(v: np.ndarray, radius: float) -> np.ndarray:
    """Euclidean projection of ``v`` onto ``{x : ||x||_1 <= radius}`` (Duchi et al. 2008)."""
    v = np.asarray(v, dtype=np.float64)
    a = np.abs(v).ravel()
    if a.sum() <= radius:
        return np.array(v, dtype=np.float64)
    if radius == 0:
        return np.zeros_like(v, dtype=np.float64)
    u = np.sort(a)[::-1]
    css = np.cumsum(u)
    idx = np.arange(1, u.size + 1)
    rho = int(np.nonzero(u * idx > (css - radius))[0][-1])
    theta = (css[rho] - radius) / (rho + 1.0)
    return np.sign(v) * np.maximum(np.abs(v) - theta, 0.0)


def project_box_l1(v: np.ndarray, lo: np.ndarray, hi: np.ndarray, center: np.ndarray, radius: float) -> np.ndarray:
    """Project onto ``{lo <= x <= hi, ||x - center||_1 <= radius}`` with ``lo <= center <= hi``.

    For a multiplier ``lam >= 0`` the separable minimiser is
    ``clip(center + soft(v - center, lam), lo, hi)``; bisect on ``lam`` for the radius, then
    solve exactly on the final linear piece (the coordinates neither zeroed nor clipped there
    each contribute ``|v_i - c_i| - lam``).
    """
    v = np.asarray(v, dtype=np.float64)

    def at(lam: float) -> np.ndarray:
        w = v - center
        return np.clip(center + np.sign(w) * np.maximum(np.abs(w) - lam, 0.0), lo, hi)

    x = at(0.0)
    if np.sum(np.abs(x - center)) <= radius:
        return x
    lam_lo, lam_hi = 0.0, float(np.max(np.abs(v - center)))
    for _ in range(200):
        mid = 0.5 * (lam_lo + lam_hi)
        if np.sum(np.abs(at(mid) - center)) > radius:
            lam_lo = mid
        else:
            lam_hi = mid
        if lam_hi - lam_lo <= 1e-16 * (1.0 + lam_hi):
            break
    x = at(lam_hi)
    a = np.abs(v - center)
    free = (a > lam_hi) & (x > lo) & (x < hi)
    if np.any(free):
        fixed = float(np.sum(np.abs(x - center)[~free]))
        lam = (float(np.sum(a[free])) + fixed - radius) / int(np.count_nonzero(free))
        if lam_lo - 1e-12 * (1.0 + lam_hi) <= lam <= lam_hi:
            exact = at(max(lam, 0.0))
            if np.sum(np.abs(exact - center)) <= radius * (1.0 + 1e-14) + 1e-300:
                return exact
    return x


class SignConsensus(ConstraintSet):
    """TIES-like sign consensus: ``G d >= 0`` where each row of ``G`` is one merged
    parameter's update ``sum_k d[k, a] delta_k[p]`` times that parameter's elected sign.

    The merged update of parameter ``p`` must not point against the sign elected from the
    residuals, ``s_p = sign(sum_k delta_k[p])`` (TIES's "total mass" election). Because
    ``s_p sum_k delta_k[p] = |sum_k delta_k[p]| >= 0``, ``d = 0``, the soup and task
    arithmetic with a common ``lambda >= 0`` are always feasible. Alone the set is a cone
    (unbounded); intersect it with a box or simplex.

    Rows of ``G`` are normalised to unit Euclidean norm, so :meth:`violation` is the largest
    distance of ``d`` to a violated half-space (units of ``d``). Build it with
    :meth:`from_deltas` (scalar / rows / columns parametrisations; redundant rows removed) or
    directly from a ``(P, n)`` matrix ``G`` (flat, row-major ``d``).
    """

    name = "sign"
    has_projection = False

    def __init__(self, G: Any, shape: Shape, description: str = "sign consensus"):
        try:
            G = sp.csr_matrix(G, dtype=np.float64)
        except (TypeError, ValueError):
            raise ValidationError("sign consensus: G must be a (P, n) matrix of numbers") from None
        if len(shape) != 2 or G.shape[1] != shape[0] * shape[1]:
            raise ValidationError(
                f"sign consensus: G has {G.shape[1]} columns but d of shape {tuple(shape)} has "
                f"{int(np.prod(shape))} entries"
            )
        if not np.all(np.isfinite(G.data)):
            raise ValidationError("sign consensus: G (the signed residuals) contains NaN or inf")
        G.eliminate_zeros()
        norms = np.sqrt(np.asarray(G.multiply(G).sum(axis=1)).ravel())
        keep = norms > 0  # drop all-zero rows (parameters no coefficient can move)
        G = sp.diags(1.0 / norms[keep]) @ G[keep]
        self.G = G.tocsr()
        self.shape = (int(shape[0]), int(shape[1]))
        self.description = description

    @classmethod
    def from_deltas(cls, deltas: Any, parametrisation: str = "rows", density: float = 1.0,
                    reduce: bool = True) -> SignConsensus:
        """Build from residuals ``deltas`` of shape ``(K, r, m)`` (``delta_k = W_k - W_base``;
        append the bias as a last column when it is merged too).

        ``parametrisation``: ``"rows"`` (``d`` is ``(K, r)``: atom ``i`` scales row ``i`` of
        every ``delta_k``), ``"columns"`` (``(K, m)``) or ``"scalar"`` (``(K, 1)``).
        ``density`` < 1 constrains only the parameters that a TIES trim (top ``density``
        fraction of ``|delta_k|`` per model) keeps in at least one model; the elected sign
        stays ``sign(sum_k delta_k[p])`` so the soup remains feasible.
        ``reduce``: keep only the extreme rays among each atom's constraint vectors (the
        others are implied; exact, via a convex hull in ``K - 1`` dimensions for ``K <= 7``).
        """
        D = _float_array(deltas, "sign consensus: deltas")
        if D.ndim != 3:
            raise ValidationError(f"sign consensus: deltas must have shape (K, r, m), got {D.shape}")
        if D.size == 0:
            raise ValidationError(f"sign consensus: deltas are empty (shape {D.shape})")
        if not np.all(np.isfinite(D)):
            raise ValidationError("sign consensus: deltas contain NaN or inf")
        try:
            density = float(density)
        except (TypeError, ValueError):
            raise ValidationError(f"sign consensus: density must be a number, got {density!r}") from None
        if not 0 < density <= 1:
            raise ValidationError(f"sign consensus: density must lie in (0, 1], got {density}")
        K, r, m = D.shape
        elected = np.sign(D.sum(axis=0))  # (r, m)
        mask = elected != 0
        if density < 1:
            keep = max(1, int(density * r * m))
            kept = np.zeros((r, m), dtype=bool)
            for k in range(K):
                idx = np.argpartition(np.abs(D[k]).ravel(), -keep)[-keep:]
                kept.flat[idx] = True
            mask &= kept
        signed = D * elected[None]  # (K, r, m): s_p delta_k[p]
        if parametrisation == "rows":
            vecs, masks, shape = signed.transpose(1, 2, 0), mask, (K, r)
        elif parametrisation == "columns":
            vecs, masks, shape = signed.transpose(2, 1, 0), mask.T, (K, m)
        elif parametrisation == "scalar":
            vecs, masks, shape = signed.transpose(1, 2, 0).reshape(1, r * m, K), mask.reshape(1, -1), (K, 1)
        else:
            raise unknown("sign-consensus parametrisation", parametrisation, ["rows", "columns", "scalar"])
        n_atoms = shape[1]
        blocks, atom_of_row = [], []
        for a in range(n_atoms):
            V = vecs[a][masks[a]]  # (P_a, K), every row with a positive sum
            if V.shape[0] == 0:
                continue
            if reduce:
                V = V[_extreme_rays(V)]
            blocks.append(V)
            atom_of_row.append(np.full(V.shape[0], a))
        n_params = int(mask.sum())
        if blocks:
            V = np.concatenate(blocks)
            atoms = np.concatenate(atom_of_row)
        else:
            V, atoms = np.zeros((0, K)), np.zeros(0, dtype=int)
        P = V.shape[0]
        rows = np.repeat(np.arange(P), K)
        cols = (np.tile(np.arange(K), P) * n_atoms + np.repeat(atoms, K)).astype(np.int64)
        G = sp.csr_matrix((V.ravel(), (rows, cols)), shape=(P, K * n_atoms))
        out = cls(G, shape, description=f"sign consensus ({parametrisation}, density {density:g}: "
                                        f"{n_params} parameters, {P} rows)")
        out.n_parameters = n_params
        return out

    n_parameters: int | None = None

    @property
    def spec(self) -> str:
        return "sign"

    @property
    def lmo_method(self) -> str:
        return LMO_HIGHS

    def validate(self, shape: Shape) -> None:
        if tuple(shape) != self.shape:
            raise ValidationError(
                f"sign consensus was built for d of shape {self.shape}, the problem has {tuple(shape)}"
            )

    def cvxpy(self, var: Any) -> list[Any]:
        import cvxpy as cp

        if self.G.shape[0] == 0:
            return []
        return [self.G @ cp.vec(var, order="C") >= 0]

    def support(self, grad: np.ndarray) -> tuple[float, np.ndarray | None]:
        return _lp_support([self], grad)

    def violation(self, d: np.ndarray) -> float:
        x = np.asarray(d, dtype=np.float64).ravel()
        return float(max(np.max(-(self.G @ x), initial=0.0), 0.0))

    def linear_form(self, shape: Shape) -> LinearForm:
        n = shape[0] * shape[1]
        base = LinearForm.empty(n)
        return LinearForm(n, (-self.G).tocsr(), np.zeros(self.G.shape[0]), base.A_eq, base.b_eq, base.lb, base.ub)


def _extreme_rays(V: np.ndarray) -> np.ndarray:
    """Indices of rows of ``V`` (``(P, K)``, every row summing to > 0) that generate the cone
    ``{sum_p lam_p V[p] : lam >= 0}``: the vertices of the rows scaled to sum 1 (a polytope in
    the hyperplane ``1'v = 1``). Falls back to de-duplicated rows when the hull is degenerate
    or ``K > 7`` (where a hull in ``K - 1`` dimensions gets expensive)."""
    P, K = V.shape
    if K == 1:
        return np.array([0])
    if P <= K:
        return np.arange(P)
    Z = V / V.sum(axis=1, keepdims=True)
    if K == 2:
        return np.unique([int(np.argmin(Z[:, 0])), int(np.argmax(Z[:, 0]))])

    def unique_rows() -> np.ndarray:
        return np.sort(np.unique(np.round(Z, 13), axis=0, return_index=True)[1])

    if K > 7:
        return unique_rows()
    from scipy.spatial import ConvexHull, QhullError

    try:
        return np.sort(ConvexHull(Z[:, : K - 1]).vertices)
    except (QhullError, ValueError):
        return unique_rows()


class UserConstraints(ConstraintSet):
    """User-defined CVXPY constraints: ``fn(var)`` receives the ``cp.Variable`` of shape
    ``(K, n_atoms)`` and returns one constraint or a list of them (they must be DCP-convex).
    The constraints may introduce auxiliary CVXPY variables of their own."""

    name = "user"
    has_projection = False

    def __init__(self, fn: Callable[[Any], Any], label: str = "user"):
        if not callable(fn):
            raise ValidationError("user constraints must be a callable var -> CVXPY constraint(s)")
        self.fn = fn
        self.label = str(label)

    @property
    def spec(self) -> str:
        return self.label

    @property
    def lmo_method(self) -> str:
        return LMO_CVXPY

    def cvxpy(self, var: Any) -> list[Any]:
        import cvxpy as cp

        try:
            out = self.fn(var)
        except Exception as exc:
            raise ValidationError(f"user constraint {self.label!r} raised {type(exc).__name__}: {exc}") from exc
        if out is None:
            raise ValidationError(f"user constraint {self.label!r} returned None, not CVXPY constraint(s)")
        cons = list(out) if isinstance(out, (list, tuple)) else [out]
        for i, c in enumerate(cons):
            if not isinstance(c, cp.constraints.constraint.Constraint):
                raise ValidationError(
                    f"user constraint {self.label!r} returned {type(c).__name__} at position {i}, "
                    f"not a CVXPY constraint"
                )
            if not c.is_dcp():
                raise ValidationError(f"user constraint {self.label!r} #{i} ({c}) is not convex (DCP)")
        return cons

    def support(self, grad: np.ndarray) -> tuple[float, np.ndarray | None]:
        return _cvxpy_support([self], grad)

    def violation(self, d: np.ndarray) -> float:
        """The largest constraint residual (CVXPY's ``violation()``); when the constraints use
        auxiliary variables, the infinity-norm distance of ``d`` to the set (a small CVXPY solve)."""
        import cvxpy as cp

        d = np.asarray(d, dtype=np.float64)
        var = cp.Variable(d.shape)
        cons = self.cvxpy(var)
        if any(v.id != var.id for c in cons for v in c.variables()):
            return _cvxpy_distance([self], d)
        var.value = d
        worst = 0.0
        for c in cons:
            v = np.asarray(c.violation(), dtype=np.float64)
            worst = max(worst, float(np.max(v, initial=0.0)))
        return worst


# ---------------------------------------------------------------------- intersections
class Intersection(ConstraintSet):
    """The intersection of several constraint sets (build with :func:`as_constraint_set`).

    Boxes among the members are merged (elementwise ``max`` of lower, ``min`` of upper
    bounds). Closed forms exist for box(es) alone, box & (global) simplex (projection and LMO)
    and box & L1 ball with its centre inside the box; any other polyhedral combination (L1
    balls included, through auxiliary variables) uses an LP (HiGHS) for the LMO, and
    combinations with user constraints a CVXPY LP.
    """

    name = "intersection"

    def __init__(self, sets: Sequence[ConstraintSet]):
        self.sets = tuple(sets)

    @property
    def spec(self) -> str:
        return " & ".join(s.spec for s in self.sets)

    def members(self) -> tuple[ConstraintSet, ...]:
        return self.sets

    def validate(self, shape: Shape) -> None:
        for s in self.sets:
            s.validate(shape)

    def cvxpy(self, var: Any) -> list[Any]:
        return [c for s in self.sets for c in s.cvxpy(var)]

    def merged_box(self, shape: Shape) -> tuple[np.ndarray, np.ndarray] | None:
        """The intersection of the member boxes as ``(lo, hi)`` (``None`` if there is none)."""
        boxes = [s for s in self.sets if isinstance(s, Box)]
        if not boxes:
            return None
        lo, hi = boxes[0].bounds(shape)
        for b in boxes[1:]:
            b_lo, b_hi = b.bounds(shape)
            lo, hi = np.maximum(lo, b_lo), np.minimum(hi, b_hi)
        return lo, hi

    def _others(self) -> list[ConstraintSet]:
        return [s for s in self.sets if not isinstance(s, Box)]

    def _closed_form_kind(self) -> str | None:
        """``"box"``, ``"box_sum"``, ``"box_l1"`` (shape-independent part), else ``None``."""
        others = self._others()
        if not others:
            return "box"
        if len(others) == 1 and isinstance(others[0], Simplex):
            return "box_sum" if len(others) < len(self.sets) else None
        if len(others) == 1 and isinstance(others[0], L1Ball) and len(others) < len(self.sets):
            boxes = [s for s in self.sets if isinstance(s, Box)]
            try:  # the closed forms need the ball's centre inside the box
                lo = np.maximum.reduce(np.broadcast_arrays(*[b.lo for b in boxes]))
                hi = np.minimum.reduce(np.broadcast_arrays(*[b.hi for b in boxes]))
                c = others[0].center
                inside = bool(np.all(lo <= c) and np.all(c <= hi))
            except ValueError:  # shapes only reconcile at a given d shape
                inside = False
            return "box_l1" if inside else None
        return None

    def _box(self, shape: Shape) -> tuple[np.ndarray, np.ndarray]:
        box = self.merged_box(shape)
        if box is None:
            return np.full(shape, -np.inf), np.full(shape, np.inf)
        return box

    @property
    def has_projection(self) -> bool:  # type: ignore[override]
        return self._closed_form_kind() is not None

    @property
    def lmo_method(self) -> str:
        if self._closed_form_kind() is not None:
            return LMO_CLOSED_FORM
        return LMO_HIGHS if all(_polyhedral(s) for s in self.sets) else LMO_CVXPY

    def project(self, d: np.ndarray) -> np.ndarray:
        kind = self._closed_form_kind()
        shape = np.shape(d)
        if kind is not None:
            lo, hi = self._box(shape)
            if kind == "box":
                return np.clip(d, lo, hi)
            if kind == "box_sum":
                simplex = self._others()[0]
                assert isinstance(simplex, Simplex)
                return project_capped_sum(d, np.maximum(lo, 0.0), hi, simplex.total, simplex.axis)
            ball = self._others()[0]
            assert isinstance(ball, L1Ball)
            c = ball._center(shape)
            if np.all((lo <= c) & (c <= hi)):
                return project_box_l1(d, lo, hi, c, ball.radius)
        raise NotImplementedError(f"{self.spec} has no closed-form projection")

    def support(self, grad: np.ndarray) -> tuple[float, np.ndarray | None]:
        kind = self._closed_form_kind()
        shape = grad.shape
        if kind is not None:
            lo, hi = self._box(shape)
            if np.any(lo > hi):
                raise InfeasibleError(f"{self.spec} is empty: the boxes' bounds cross")
            if kind == "box":
                return Box(lo, hi).support(grad)
            if kind == "box_sum":
                simplex = self._others()[0]
                assert isinstance(simplex, Simplex)
                try:
                    s = lmo_capped_sum(grad, np.maximum(lo, 0.0), hi, simplex.total, simplex.axis)
                except InfeasibleError:
                    raise InfeasibleError(f"{self.spec} is empty: the box's bounds cannot sum to "
                                          f"{simplex.total:g}") from None
                return float(np.sum(grad * s)), s
            ball = self._others()[0]
            assert isinstance(ball, L1Ball)
            c = ball._center(shape)
            if np.all((lo <= c) & (c <= hi)):
                s = lmo_box_l1(grad, lo, hi, c, ball.radius)
                return float(np.sum(grad * s)), s
        if all(_polyhedral(s) for s in self.sets):
            return _lp_support(self.sets, grad)
        return _cvxpy_support(self.sets, grad)

    def violation(self, d: np.ndarray) -> float:
        return max((s.violation(d) for s in self.sets), default=0.0)

    def linear_form(self, shape: Shape) -> LinearForm | None:
        forms = [s.linear_form(shape) for s in self.sets]
        if any(f is None for f in forms):
            return None
        out = LinearForm.empty(shape[0] * shape[1])
        for f in forms:
            out = out & f  # type: ignore[operator]
        return out


def _polyhedral(s: ConstraintSet) -> bool:
    """Whether the LMO over ``s`` can be a HiGHS LP (a linear form for any shape; L1 balls
    through auxiliary variables, see :func:`_lp_form`)."""
    return isinstance(s, (Box, Simplex, SignConsensus, Unconstrained, L1Ball))


def _lp_form(sets: list[ConstraintSet], shape: Shape) -> LinearForm:
    """The intersection as one linear form over ``z = (x, t_1, ..., t_b)``: ``x`` the flat
    ``d`` (n entries), one ``t_i >= 0`` block of n per L1 ball ``|x - c|_1 <= r``, written as
    ``x - t <= c``, ``-x - t <= -c``, ``sum t <= r``."""
    n = shape[0] * shape[1]
    balls = [s for s in sets if isinstance(s, L1Ball)]
    N = n * (1 + len(balls))

    def pad(f: LinearForm) -> LinearForm:
        extra = N - n
        return LinearForm(N, sp.hstack([f.A_ub, sp.csr_matrix((f.A_ub.shape[0], extra))]).tocsr(), f.b_ub,
                          sp.hstack([f.A_eq, sp.csr_matrix((f.A_eq.shape[0], extra))]).tocsr(), f.b_eq,
                          np.concatenate([f.lb, np.zeros(extra)]), np.concatenate([f.ub, np.full(extra, np.inf)]))

    form = pad(LinearForm.empty(n))
    for s in sets:
        if isinstance(s, L1Ball):
            continue
        f = s.linear_form(shape)
        assert f is not None
        form = form & pad(f)
    eye = sp.identity(n, format="csr")
    for i, ball in enumerate(balls):
        c = ball._center(shape).ravel()
        blocks: list[list[Any]] = [[None] * (1 + len(balls)) for _ in range(3)]
        blocks[0][0], blocks[0][1 + i] = eye, -eye
        blocks[1][0], blocks[1][1 + i] = -eye, -eye
        blocks[2][0], blocks[2][1 + i] = sp.csr_matrix((1, n)), sp.csr_matrix(np.ones((1, n)))
        for row in blocks:
            for j in range(len(row)):
                if row[j] is None:
                    row[j] = sp.csr_matrix((row[0].shape[0], n))
        A = sp.bmat(blocks, format="csr")
        f = LinearForm(N, A, np.concatenate([c, -c, [ball.radius]]), sp.csr_matrix((0, N)), np.zeros(0),
                       np.full(N, -np.inf), np.full(N, np.inf))
        form = form & f
    return form


# ---------------------------------------------------------------------- LMO via LPs
#: reduced costs this small (relative to max |grad|) on unbounded variables count as zero
#: in the HiGHS dual bound (they are round-off on basic variables)
_RC_TOL = 1e-9


def _lp_support(sets: Iterable[ConstraintSet], grad: np.ndarray) -> tuple[float, np.ndarray | None]:
    """``min <grad, s>`` over a polyhedral intersection by HiGHS (dual simplex).

    Returns the Lagrangian dual bound built from HiGHS's multipliers (a lower bound on the
    minimum that holds whatever the LP's tolerances; the primal value when that bound is
    unavailable) and the primal vertex. The objective is scaled to ``max |grad| = 1`` first.
    """
    from scipy.optimize import linprog

    sets = list(sets)
    label = " & ".join(s.spec for s in sets) or "R^n"
    shape = grad.shape
    n = shape[0] * shape[1]
    form = _lp_form(sets, shape)
    if np.any(form.lb > form.ub):
        raise InfeasibleError(f"the constraint set {label} is empty: its bounds cross")
    gflat = np.asarray(grad, dtype=np.float64).ravel()
    gscale = float(np.max(np.abs(gflat))) if gflat.size else 0.0
    cost = np.zeros(form.n)
    if gscale > 0:
        cost[:n] = gflat / gscale
    A_ub = form.A_ub if form.A_ub.shape[0] else None
    A_eq = form.A_eq if form.A_eq.shape[0] else None
    kwargs: dict[str, Any] = {"A_ub": A_ub, "b_ub": form.b_ub if A_ub is not None else None,
                              "A_eq": A_eq, "b_eq": form.b_eq if A_eq is not None else None,
                              "bounds": np.column_stack([form.lb, form.ub])}
    try:
        res = linprog(cost, method="highs-ds", options={"primal_feasibility_tolerance": 1e-10,
                                                        "dual_feasibility_tolerance": 1e-10}, **kwargs)
        if res.status == 4:  # numerical difficulties: retry with the default HiGHS choice
            res = linprog(cost, method="highs", **kwargs)
    except ValueError as exc:
        raise UnsupportedError(f"linear minimisation over {label} failed: {exc}") from None
    if res.status == 3:
        return -math.inf, None
    if res.status == 2:
        raise InfeasibleError(f"the constraint set {label} is empty (no d satisfies all of them; "
                              f"the HiGHS LP over it is infeasible)")
    if res.status != 0 or res.x is None:
        raise UnsupportedError(f"linear minimisation over {label} failed: {res.message}")
    x = np.asarray(res.x, dtype=np.float64)
    primal = float(cost @ x)
    value = min(primal, _highs_dual_bound(cost, form, res, x))
    s = x[:n].reshape(shape)
    return value * gscale if gscale > 0 else 0.0, s


def _highs_dual_bound(cost: np.ndarray, form: LinearForm, res: Any, x: np.ndarray) -> float:
    """``y_ub'b_ub + y_eq'b_eq + sum_i min_{lb_i <= x_i <= ub_i} r_i x_i`` with ``y_ub <= 0`` and
    reduced costs ``r = cost - A_ub'y_ub - A_eq'y_eq``: weak duality makes it a lower bound
    on the LP minimum for any such multipliers."""
    try:
        y_ub = (np.minimum(np.atleast_1d(np.asarray(res.ineqlin.marginals, dtype=np.float64)), 0.0)
                if form.A_ub.shape[0] else np.zeros(0))
        y_eq = np.atleast_1d(np.asarray(res.eqlin.marginals, dtype=np.float64)) if form.A_eq.shape[0] else np.zeros(0)
    except (AttributeError, TypeError, ValueError):
        return float(cost @ x)
    if y_ub.shape != (form.A_ub.shape[0],) or y_eq.shape != (form.A_eq.shape[0],) \
            or not (np.all(np.isfinite(y_ub)) and np.all(np.isfinite(y_eq))):
        return float(cost @ x)  # no usable multipliers: the primal value
    r = cost.copy()
    if y_ub.size:
        r -= form.A_ub.T @ y_ub
    if y_eq.size:
        r -= form.A_eq.T @ y_eq
    bound = float(form.b_ub @ y_ub + form.b_eq @ y_eq)
    pos, neg = r > 0, r < 0
    lower = np.where(pos, form.lb, np.where(neg, form.ub, 0.0))
    unbounded = (pos | neg) & ~np.isfinite(lower)
    if np.any(unbounded & (np.abs(r) > _RC_TOL)):
        return float(cost @ x)  # the multipliers do not prove a bound: fall back to the primal
    # round-off reduced costs on unbounded (basic) variables: charge them at the vertex
    term = np.where(unbounded, r * x, r * np.where(np.isfinite(lower), lower, 0.0))
    return bound + float(np.sum(term))


def _cvxpy_lmo_problem(sets: list[ConstraintSet], shape: Shape, cost: np.ndarray) -> tuple[Any, Any]:
    import cvxpy as cp

    var = cp.Variable(shape)
    cons = [c for s in sets for c in s.cvxpy(var)]
    return cp.Problem(cp.Minimize(cp.sum(cp.multiply(cost, var))), cons), var


def _solve_cvxpy(prob: Any, label: str) -> None:
    import cvxpy as cp

    try:
        prob.solve(solver=cp.CLARABEL, tol_gap_abs=1e-10, tol_gap_rel=1e-10, tol_feas=1e-10)
    except cp.error.SolverError:
        try:
            prob.solve(solver=cp.CLARABEL)
        except cp.error.SolverError as exc:
            raise UnsupportedError(f"the CVXPY LP over {label} failed: {exc}") from None
    except cp.error.DCPError as exc:
        raise ValidationError(f"the constraints {label} are not convex (DCP): {exc}") from None


def _cvxpy_support(sets: Iterable[ConstraintSet], grad: np.ndarray) -> tuple[float, np.ndarray | None]:
    """``min <grad, s>`` over any intersection (user sets included), as a CVXPY LP (Clarabel,
    tolerances 1e-10). The returned value is the primal optimum minus a margin of ten times
    Clarabel's duality-gap tolerance (1e-9, or 1e-6 for an ``inaccurate`` solve)."""
    import cvxpy as cp

    sets = list(sets)
    label = " & ".join(s.spec for s in sets)
    gscale = float(np.max(np.abs(grad))) if grad.size else 0.0
    cost = grad / gscale if gscale > 0 else np.zeros_like(grad)
    prob, var = _cvxpy_lmo_problem(sets, grad.shape, cost)
    _solve_cvxpy(prob, label)
    if prob.status in (cp.UNBOUNDED, cp.UNBOUNDED_INACCURATE):
        return -math.inf, None
    if prob.status in (cp.INFEASIBLE, cp.INFEASIBLE_INACCURATE):
        raise InfeasibleError(f"the constraint set {label} is empty (no d satisfies all of them; "
                              f"the CVXPY problem over it is infeasible)")
    if var.value is None:
        raise UnsupportedError(f"the CVXPY LP over {label} ended with status {prob.status}")
    s = np.asarray(var.value, dtype=np.float64)
    primal = float(np.sum(cost * s))
    margin = (1e-6 if prob.status == cp.OPTIMAL_INACCURATE else 1e-9) * (1.0 + abs(primal))
    return ((primal - margin) * gscale if gscale > 0 else 0.0), s


def _cvxpy_distance(sets: Iterable[ConstraintSet], d: np.ndarray) -> float:
    """``min_{x in C} ||x - d||_inf`` by a CVXPY solve (for sets with auxiliary variables)."""
    import cvxpy as cp

    sets = list(sets)
    label = " & ".join(s.spec for s in sets)
    var = cp.Variable(d.shape)
    t = cp.Variable(nonneg=True)
    cons = [c for s in sets for c in s.cvxpy(var)] + [var - d <= t, d - var <= t]
    prob = cp.Problem(cp.Minimize(t), cons)
    _solve_cvxpy(prob, label)
    if prob.status in (cp.INFEASIBLE, cp.INFEASIBLE_INACCURATE):
        raise InfeasibleError(f"the constraint set {label} is empty")
    if t.value is None:
        raise UnsupportedError(f"measuring the violation of {label} failed (status {prob.status})")
    return max(float(t.value), 0.0)


# ---------------------------------------------------------------------- building / checking
def _vacuous(cset: ConstraintSet) -> bool:
    """A sign-consensus set without a single inequality (all residuals zero): all of R^n."""
    return isinstance(cset, SignConsensus) and cset.G.shape[0] == 0


def as_constraint_set(constraints: ConstraintSet | Sequence[Any] | Callable[[Any], Any] | str | None) -> ConstraintSet:
    """Normalise ``None`` / a set / a spec string (``"box:0,1 & simplex"``) / a callable (user
    CVXPY constraints) / a list of those into one set (an :class:`Intersection` if several)."""
    if constraints is None:
        return Unconstrained()
    if isinstance(constraints, ConstraintSet):
        return Unconstrained() if _vacuous(constraints) else constraints
    if isinstance(constraints, str):
        return as_constraint_set([parse_constraint(constraints)])
    if callable(constraints):
        return UserConstraints(constraints)
    if not isinstance(constraints, Iterable):
        raise ValidationError(
            f"constraints must be a ConstraintSet, a spec string, a callable or a list of these, "
            f"got {type(constraints).__name__}"
        )
    flat: list[ConstraintSet] = []
    for c in constraints:
        flat.extend(m for m in as_constraint_set(c).members() if not _vacuous(m))
    if not flat:
        return Unconstrained()
    if len(flat) == 1:
        return flat[0]
    return Intersection(flat)


def check_feasible(constraints: ConstraintSet, shape: Shape) -> None:
    """Raise :class:`InfeasibleError` (naming the sets) if the intersection is empty.

    Closed-form checks first (crossed box bounds, box vs. simplex totals, box vs. L1 ball);
    otherwise one LP with a zero objective (HiGHS for polyhedral sets, CVXPY otherwise).
    """
    constraints.validate(shape)
    members = constraints.members()
    if not members:
        return
    if len(members) == 1 and isinstance(members[0], (Box, Simplex, L1Ball, SignConsensus)):
        return  # non-empty whenever it was constructed and validated
    boxes = [s for s in members if isinstance(s, Box)]
    box_label = " & ".join(b.spec for b in boxes)
    lo, hi = (Intersection(boxes).merged_box(shape) if boxes
              else (np.full(shape, -np.inf), np.full(shape, np.inf)))
    assert lo is not None
    bad = np.argwhere(lo > hi)
    if bad.size:
        k, a = (int(i) for i in bad[0])
        raise InfeasibleError(f"{box_label} is empty: at d[{k}, {a}] the bounds give "
                              f"[{lo[k, a]:g}, {hi[k, a]:g}]")
    for simplex in (s for s in members if isinstance(s, Simplex)):
        lo0 = np.maximum(lo, 0.0)
        where = "the whole d" if simplex.axis is None else "atom {}"
        pair = f"{box_label} & {simplex.spec}" if boxes else simplex.spec
        neg = np.argwhere(lo0 > hi)
        if neg.size:
            k, a = (int(i) for i in neg[0])
            raise InfeasibleError(f"{pair} is empty: the box's upper bound {hi[k, a]:g} < 0 at d[{k}, {a}] "
                                  f"but the simplex needs d >= 0")
        lo_sum = np.atleast_1d(np.sum(lo0, axis=simplex.axis))
        hi_sum = np.atleast_1d(np.sum(hi, axis=simplex.axis))
        tol = 1e-12 * (1.0 + abs(simplex.total))
        bad_sum = np.nonzero((lo_sum > simplex.total + tol) | (hi_sum < simplex.total - tol))[0]
        if bad_sum.size:
            i = int(bad_sum[0])
            raise InfeasibleError(
                f"{pair} is empty: at {where.format(i)} the box allows sums in "
                f"[{lo_sum[i]:g}, {hi_sum[i]:g}] but the simplex needs {simplex.total:g}"
            )
    for ball in (s for s in members if isinstance(s, L1Ball)):
        c = ball._center(shape)
        dist = float(np.sum(np.maximum(lo - c, 0.0) + np.maximum(c - hi, 0.0)))
        if boxes and dist > ball.radius * (1 + 1e-12):
            raise InfeasibleError(f"{box_label} & {ball.spec} is empty: the box is at L1 distance "
                                  f"{dist:g} from the ball's centre, more than the radius {ball.radius:g}")
    if all(isinstance(s, Box) for s in members) or (
            isinstance(constraints, Intersection) and constraints._closed_form_kind() is not None):
        return  # the closed-form checks above are exact for these
    zero = np.zeros(shape)
    if all(_polyhedral(s) for s in members):
        _lp_support(members, zero)
    else:
        _cvxpy_support(members, zero)


# ---------------------------------------------------------------------- registry
ConstraintParser = Callable[[list[str], str, Mapping[str, Any]], ConstraintSet]


def _floats(args: list[str], spec: str, count: tuple[int, int]) -> list[float]:
    if not count[0] <= len(args) <= count[1]:
        want = f"{count[0]}" if count[0] == count[1] else f"{count[0]} to {count[1]}"
        raise ValidationError(f"constraint {spec!r}: expected {want} number(s), got {len(args)}")
    try:
        return [float(a) for a in args]
    except ValueError:
        raise ValidationError(f"constraint {spec!r}: arguments must be numbers, got {','.join(args)}") from None


def _parse_box(args: list[str], spec: str, ctx: Mapping[str, Any]) -> ConstraintSet:
    vals = _floats(args, spec, (0, 2)) if args else [0.0, 1.0]
    if len(vals) == 1:
        raise ValidationError(f"constraint {spec!r}: a box takes two bounds, box:LO,HI (e.g. box:0,1)")
    return Box(vals[0], vals[1])


def _parse_simplex(args: list[str], spec: str, ctx: Mapping[str, Any]) -> ConstraintSet:
    vals = _floats(args, spec, (0, 1))
    return Simplex(vals[0] if vals else 1.0)


def _parse_global_simplex(args: list[str], spec: str, ctx: Mapping[str, Any]) -> ConstraintSet:
    vals = _floats(args, spec, (0, 1))
    return GlobalSimplex(vals[0] if vals else 1.0)


def _parse_l1(args: list[str], spec: str, ctx: Mapping[str, Any]) -> ConstraintSet:
    if not args:
        raise ValidationError(f"constraint {spec!r}: an L1 ball needs a radius, l1:RADIUS[,CENTER]")
    vals = _floats(args, spec, (1, 2))
    return L1Ball(vals[0], vals[1] if len(vals) > 1 else 0.0)


def _parse_nonneg(args: list[str], spec: str, ctx: Mapping[str, Any]) -> ConstraintSet:
    _floats(args, spec, (0, 0))
    return Box(0.0, np.inf)


def _parse_none(args: list[str], spec: str, ctx: Mapping[str, Any]) -> ConstraintSet:
    _floats(args, spec, (0, 0))
    return Unconstrained()


def _parse_sign(args: list[str], spec: str, ctx: Mapping[str, Any]) -> ConstraintSet:
    if ctx.get("deltas") is None:
        raise ValidationError(
            "constraint 'sign' needs the residual tensors: put an array 'deltas' (K, r, m) in the "
            "problem file (and 'parametrisation' = rows|columns|scalar), or build "
            "SignConsensus.from_deltas(...) in Python"
        )
    density = _floats(args, spec, (0, 1))
    return SignConsensus.from_deltas(ctx["deltas"], str(ctx.get("parametrisation", "rows")),
                                     density[0] if density else 1.0)


#: command-line name -> parser ``(args, spec, context) -> ConstraintSet``
CONSTRAINT_SETS: dict[str, ConstraintParser] = {}


def register_constraint(name: str, parser: ConstraintParser) -> None:
    """Register a command-line constraint spelling ``name[:args]``."""
    if not name or any(ch in name for ch in ":,& "):
        raise ValidationError(f"constraint set name {name!r} must be non-empty without ':', ',', '&' or spaces")
    if name in CONSTRAINT_SETS:
        raise ValidationError(f"constraint set {name!r} is already registered")
    CONSTRAINT_SETS[name] = parser


register_constraint("box", _parse_box)
register_constraint("simplex", _parse_simplex)
register_constraint("global_simplex", _parse_global_simplex)
register_constraint("l1", _parse_l1)
register_constraint("nonneg", _parse_nonneg)
register_constraint("sign", _parse_sign)
register_constraint("none", _parse_none)


def parse_constraint(spec: str, context: Mapping[str, Any] | None = None) -> ConstraintSet:
    """Parse ``"name[:a,b,...]"`` (e.g. ``box:0,1``, ``simplex``, ``simplex:2``, ``l1:2``,
    ``l1:2,0.2`` (radius, centre), ``global_simplex``, ``nonneg``, ``none``,
    ``sign[:density]``), or several joined by ``&`` (an intersection). ``context`` supplies
    data some sets need (``deltas`` and ``parametrisation`` for ``sign``)."""
    if not isinstance(spec, str):
        raise ValidationError(f"a constraint spec must be a string, got {type(spec).__name__}")
    if "&" in spec:
        parts = [p for p in spec.split("&")]
        if any(not p.strip() for p in parts):
            raise ValidationError(f"constraint {spec!r}: empty part around '&'")
        return as_constraint_set([parse_constraint(p, context) for p in parts])
    spec = spec.strip()
    name, _, rest = spec.partition(":")
    name = name.strip().lower()
    if name not in CONSTRAINT_SETS:
        raise unknown("constraint set", name, CONSTRAINT_SETS)
    args = [a.strip() for a in rest.split(",")] if rest.strip() else []
    return CONSTRAINT_SETS[name](args, spec, context or {})


def parse_constraints(specs: Iterable[str], context: Mapping[str, Any] | None = None) -> ConstraintSet:
    """Parse several specs (e.g. repeated ``--constraint`` options) into their intersection
    (one string is one spec, which may itself join sets with ``&``)."""
    if isinstance(specs, str):
        specs = [specs]
    return as_constraint_set([parse_constraint(s, context) for s in specs])
