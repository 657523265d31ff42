"""Convex constraint sets for the merge QP.

Every set acts on ``d`` of shape ``(K, n_atoms)`` (models x atoms) and knows:

- ``cvxpy(var)``: its CVXPY constraints on a ``cp.Variable((K, n_atoms))``;
- ``project(d)``: the Euclidean projection, where it has a closed form
  (``has_projection``; otherwise ``NotImplementedError``);
- ``support(grad)``: ``(min_{s in C} <grad, s>, argmin s)``, the linear minimisation oracle
  behind the Frank-Wolfe gap; ``(-inf, None)`` when the set is unbounded in that direction;
- ``violation(d)``: the largest constraint violation, in the units of ``d`` (0 if feasible);
- ``linear_form(shape)``: a polyhedral description ``A_ub x <= b_ub, A_eq x = b_eq,
  lb <= x <= ub`` in the flat (row-major) variables, or ``None`` when the set is not
  polyhedral (user CVXPY constraints).

Sets are registered by name in :data:`CONSTRAINT_SETS` (explicitly, below) and parsed from the
command-line spelling with :func:`parse_constraint` (``"box:0,1"``, ``"simplex"``, ...).
Intersections are built with :func:`as_constraint_set` or ``a & b``.
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
        """``min_{s in C} <grad, s>`` and a minimiser (``(-inf, None)`` if unbounded below)."""

    @abstractmethod
    def violation(self, d: np.ndarray) -> float:
        """Largest violation of the set's constraints at ``d`` (0 when feasible)."""

    def linear_form(self, shape: Shape) -> LinearForm | None:
        """Polyhedral description in flat variables, or ``None`` if not polyhedral."""
        return None

    def members(self) -> tuple[ConstraintSet, ...]:
        """The sets whose intersection this is (itself for a basic set)."""
        return (self,)

    def __and__(self, other: ConstraintSet) -> ConstraintSet:
        return as_constraint_set([*self.members(), *other.members()])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"


# ---------------------------------------------------------------------- helpers
def _broadcast(value: Any, shape: Shape, what: str) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    try:
        return np.broadcast_to(arr, shape).astype(np.float64)
    except ValueError:
        raise ValidationError(
            f"{what} has shape {arr.shape}, which does not broadcast to d's shape {shape} "
            f"(models x atoms)"
        ) from None


def _fmt(x: float) -> str:
    return f"{x:g}"


def project_capped_sum(v: np.ndarray, lo: np.ndarray, hi: np.ndarray, total: np.ndarray | float,
                       axis: int | None) -> np.ndarray:
    """Project ``v`` onto ``{x : lo <= x <= hi, sum(x, axis) = total}`` (per slice along ``axis``).

    Solves for the shift ``tau`` with ``sum clip(v - tau, lo, hi) = total`` by bisection to
    machine precision, then an exact finish on the breakpoints. Vectorised over slices.
    ``axis=None`` treats the whole array as one slice. Assumes feasibility
    (``sum lo <= total <= sum hi``), which callers check.
    """
    v = np.asarray(v, dtype=np.float64)
    if axis is None:
        out = project_capped_sum(v.reshape(-1, 1), lo.reshape(-1, 1), hi.reshape(-1, 1),
                                 np.asarray(total, dtype=np.float64).reshape(1), axis=0)
        return out.reshape(v.shape)
    if axis != 0:
        return np.moveaxis(project_capped_sum(np.moveaxis(v, axis, 0), np.moveaxis(lo, axis, 0),
                                              np.moveaxis(hi, axis, 0), total, 0), 0, axis)
    total = np.broadcast_to(np.asarray(total, dtype=np.float64), v.shape[1:])
    lo_f = np.where(np.isfinite(lo), lo, np.nan)
    hi_f = np.where(np.isfinite(hi), hi, np.nan)
    # bracket tau: at tau_lo every entry is at its upper clip (or large), at tau_hi at lower clip
    span = np.nanmax(np.abs(np.stack([v - lo_f, v - hi_f])), axis=(0, 1))
    span = np.where(np.isfinite(span), span, 0.0)
    scale = np.max(np.abs(v), axis=0) + np.abs(total) + span + 1.0
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
        self.lo = np.asarray(lo, dtype=np.float64)
        self.hi = np.asarray(hi, dtype=np.float64)
        if np.any(np.isnan(self.lo)) or np.any(np.isnan(self.hi)):
            raise ValidationError("box bounds contain NaN")
        if np.any(self.lo == np.inf) or np.any(self.hi == -np.inf):
            raise InfeasibleError("box: a lower bound is +inf or an upper bound is -inf")

    @property
    def spec(self) -> str:
        if self.lo.ndim == 0 and self.hi.ndim == 0:
            return f"box:{_fmt(float(self.lo))},{_fmt(float(self.hi))}"
        return "box:<per-entry bounds>"

    def bounds(self, shape: Shape) -> tuple[np.ndarray, np.ndarray]:
        return _broadcast(self.lo, shape, "box lower bound"), _broadcast(self.hi, shape, "box upper bound")

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
        if np.any(np.isfinite(lo)):
            mask = np.isfinite(lo)
            out.append(var[mask] >= lo[mask]) if not mask.all() else out.append(var >= lo)
        if np.any(np.isfinite(hi)):
            mask = np.isfinite(hi)
            out.append(var[mask] <= hi[mask]) if not mask.all() else out.append(var <= hi)
        return out

    def project(self, d: np.ndarray) -> np.ndarray:
        lo, hi = self.bounds(d.shape)
        return np.clip(d, lo, hi)

    def support(self, grad: np.ndarray) -> tuple[float, np.ndarray | None]:
        lo, hi = self.bounds(grad.shape)
        s = np.where(grad > 0, lo, np.where(grad < 0, hi, np.where(np.isfinite(lo), lo, np.where(np.isfinite(hi), hi, 0.0))))
        if not np.all(np.isfinite(s)):
            return -math.inf, None
        return float(np.sum(grad * s)), s

    def violation(self, d: np.ndarray) -> float:
        lo, hi = self.bounds(d.shape)
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
    axis: int | None = 0

    def __init__(self, total: float = 1.0):
        self.total = float(total)
        if not math.isfinite(self.total):
            raise ValidationError(f"{self.name}: total must be finite, got {total}")
        if self.total < 0:
            raise InfeasibleError(f"{self.name}: total {self.total:g} < 0 but d >= 0")

    @property
    def spec(self) -> str:
        return self.name if self.total == 1.0 else f"{self.name}:{_fmt(self.total)}"

    def _sum(self, var: Any) -> Any:
        import cvxpy as cp

        return cp.sum(var, axis=0) if self.axis == 0 else cp.sum(var)

    def cvxpy(self, var: Any) -> list[Any]:
        return [var >= 0, self._sum(var) == self.total]

    def project(self, d: np.ndarray) -> np.ndarray:
        zeros = np.zeros_like(d, dtype=np.float64)
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
        self.radius = float(radius)
        if not math.isfinite(self.radius):
            raise ValidationError(f"l1: radius must be finite, got {radius}")
        if self.radius < 0:
            raise InfeasibleError(f"l1: radius {self.radius:g} < 0 gives an empty ball")
        self.center = np.asarray(center, dtype=np.float64)
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
        c = self._center(d.shape)
        return c + project_l1(d - c, self.radius)

    def support(self, grad: np.ndarray) -> tuple[float, np.ndarray | None]:
        c = self._center(grad.shape)
        s = c.copy()
        i = int(np.argmax(np.abs(grad)))
        if grad.flat[i] != 0:
            s.flat[i] -= self.radius * np.sign(grad.flat[i])
        return float(np.sum(grad * s)), s

    def violation(self, d: np.ndarray) -> float:
        return float(max(np.sum(np.abs(d - self._center(d.shape))) - self.radius, 0.0))

    def linear_form(self, shape: Shape) -> LinearForm:
        # |x - c|_1 <= r is polyhedral but needs 2^n facets or auxiliary variables; the
        # certificate's LP uses CVXPY for it instead.
        return None


def project_l1(v: np.ndarray, radius: float) -> np.ndarray:
    """Euclidean projection of ``v`` onto ``{x : ||x||_1 <= radius}`` (Duchi et al. 2008)."""
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


class SignConsensus(ConstraintSet):
    """TIES-like sign consensus: ``G d >= 0`` where each row of ``G`` is one merged
    parameter's update ``sum_a d_a B_a[p]`` multiplied by that parameter's elected sign.

    The merged update of parameter ``p`` must not point against the sign elected from the
    residuals (``sign(sum_k delta_k[p])``, TIES's "total mass" election). ``d = 0``, the soup
    and task arithmetic with a common lambda >= 0 are always feasible. Alone the set is a cone
    (unbounded); intersect it with a box or simplex.

    Build it with :meth:`from_deltas` (scalar / rows / columns parametrisations, sparse) or
    directly from a ``(P, n)`` matrix ``G`` (flat, row-major ``d``).
    """

    name = "sign"
    has_projection = False

    def __init__(self, G: Any, shape: Shape, description: str = "sign consensus"):
        G = sp.csr_matrix(G, dtype=np.float64)
        if G.shape[1] != shape[0] * shape[1]:
            raise ValidationError(
                f"sign consensus: G has {G.shape[1]} columns but d has {shape[0] * shape[1]} entries"
            )
        if not np.all(np.isfinite(G.data)):
            raise ValidationError("sign consensus: residuals contain NaN or inf")
        # drop all-zero rows (parameters no atom can move)
        nz = np.diff(G.indptr) > 0
        self.G = G[nz]
        self.shape = tuple(shape)
        self.description = description

    @classmethod
    def from_deltas(cls, deltas: Any, parametrisation: str = "rows", density: float = 1.0) -> SignConsensus:
        """Build from residuals ``deltas`` of shape ``(K, r, m)`` (``delta_k = W_k - W_base``;
        append the bias as a last column when it is merged too).

        ``parametrisation``: ``"rows"`` (d is ``(K, r)``), ``"columns"`` (``(K, m)``) or
        ``"scalar"`` (``(K, 1)``). ``density`` < 1 constrains only the parameters kept by a
        TIES trim (top ``density`` fraction of ``|delta_k|`` per model) when electing signs.
        """
        D = np.asarray(deltas.detach().cpu().numpy() if hasattr(deltas, "detach") else deltas,
                       dtype=np.float64)
        if D.ndim != 3:
            raise ValidationError(f"sign consensus: deltas must have shape (K, r, m), got {D.shape}")
        if not np.all(np.isfinite(D)):
            raise ValidationError("sign consensus: deltas contain NaN or inf")
        if not 0 < density <= 1:
            raise ValidationError(f"sign consensus: density must lie in (0, 1], got {density}")
        K, r, m = D.shape
        trimmed = D
        if density < 1:
            keep = max(1, int(density * r * m))
            trimmed = np.zeros_like(D)
            for k in range(K):
                flat = np.abs(D[k]).ravel()
                idx = np.argpartition(flat, -keep)[-keep:]
                trimmed[k].flat[idx] = D[k].flat[idx]
        elected = np.sign(trimmed.sum(axis=0))  # (r, m)
        signed = D * elected[None]  # (K, r, m): row entries of G
        ii, jj = np.nonzero(elected)
        P = ii.size
        rows = np.repeat(np.arange(P), K)
        ks = np.tile(np.arange(K), P)
        vals = signed[ks, np.repeat(ii, K), np.repeat(jj, K)]
        if parametrisation == "rows":
            cols = ks * r + np.repeat(ii, K)
            shape = (K, r)
        elif parametrisation == "columns":
            cols = ks * m + np.repeat(jj, K)
            shape = (K, m)
        elif parametrisation == "scalar":
            cols = ks
            shape = (K, 1)
        else:
            raise unknown("sign-consensus parametrisation", parametrisation, ["rows", "columns", "scalar"])
        G = sp.csr_matrix((vals, (rows, cols)), shape=(P, shape[0] * shape[1]))
        G.sum_duplicates()
        return cls(G, shape, description=f"sign consensus ({parametrisation}, density {density:g})")

    @property
    def spec(self) -> str:
        return "sign"

    def validate(self, shape: Shape) -> None:
        if tuple(shape) != self.shape:
            raise ValidationError(
                f"sign consensus was built for d of shape {self.shape}, problem has {tuple(shape)}"
            )

    def cvxpy(self, var: Any) -> list[Any]:
        import cvxpy as cp

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


class UserConstraints(ConstraintSet):
    """User-defined CVXPY constraints: ``fn(var)`` receives the ``cp.Variable`` of shape
    ``(K, n_atoms)`` and returns one constraint or a list of them (they must be DCP-convex)."""

    name = "user"
    has_projection = False

    def __init__(self, fn: Callable[[Any], Any], label: str = "user"):
        if not callable(fn):
            raise ValidationError("user constraints must be a callable var -> CVXPY constraint(s)")
        self.fn = fn
        self.label = label

    @property
    def spec(self) -> str:
        return self.label

    def cvxpy(self, var: Any) -> list[Any]:
        import cvxpy as cp

        try:
            out = self.fn(var)
        except Exception as exc:  # noqa: BLE001 - surface the user's error with context
            raise ValidationError(f"user constraint {self.label!r} raised {type(exc).__name__}: {exc}") from exc
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
        import cvxpy as cp

        var = cp.Variable(d.shape)
        var.value = np.asarray(d, dtype=np.float64)
        worst = 0.0
        for c in self.cvxpy(var):
            v = np.asarray(c.violation(), dtype=np.float64)
            worst = max(worst, float(np.max(v, initial=0.0)))
        return worst


class Intersection(ConstraintSet):
    """The intersection of several constraint sets (build with :func:`as_constraint_set`)."""

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

    def _box_and_sum(self) -> tuple[Box, Simplex] | None:
        boxes = [s for s in self.sets if isinstance(s, Box)]
        simplices = [s for s in self.sets if isinstance(s, Simplex)]
        if len(boxes) == 1 and len(simplices) == 1 and len(self.sets) == 2:
            return boxes[0], simplices[0]
        return None

    def _box_and_l1(self) -> tuple[Box, L1Ball] | None:
        boxes = [s for s in self.sets if isinstance(s, Box)]
        balls = [s for s in self.sets if isinstance(s, L1Ball)]
        if len(boxes) == 1 and len(balls) == 1 and len(self.sets) == 2:
            return boxes[0], balls[0]
        return None

    @property
    def has_projection(self) -> bool:  # type: ignore[override]
        return self._box_and_sum() is not None or self._box_and_l1() is not None

    def project(self, d: np.ndarray) -> np.ndarray:
        pair = self._box_and_sum()
        if pair is not None:
            box, simplex = pair
            lo, hi = box.bounds(d.shape)
            return project_capped_sum(d, np.maximum(lo, 0.0), hi, simplex.total, simplex.axis)
        pair_l1 = self._box_and_l1()
        if pair_l1 is not None:
            box, ball = pair_l1
            lo, hi = box.bounds(d.shape)
            c = ball._center(d.shape)
            if np.all((lo <= c) & (c <= hi)):
                return project_box_l1(d, lo, hi, c, ball.radius)
        raise NotImplementedError(f"{self.spec} has no closed-form projection")

    def support(self, grad: np.ndarray) -> tuple[float, np.ndarray | None]:
        if all(s.linear_form(grad.shape) is not None for s in self.sets):
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


def project_box_l1(v: np.ndarray, lo: np.ndarray, hi: np.ndarray, center: np.ndarray, radius: float) -> np.ndarray:
    """Project onto ``{lo <= x <= hi, ||x - center||_1 <= radius}`` with ``lo <= center <= hi``.

    For a multiplier ``lam >= 0`` the separable minimiser is
    ``clip(center + soft(v - center, lam), lo, hi)``; bisect on ``lam`` for the radius.
    """
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
    return at(lam_hi)


# ---------------------------------------------------------------------- LMO via LPs
def _lp_support(sets: Iterable[ConstraintSet], grad: np.ndarray) -> tuple[float, np.ndarray | None]:
    """``min <grad, s>`` over a polyhedral intersection, by scipy's HiGHS LP solver."""
    from scipy.optimize import linprog

    shape = grad.shape
    form = LinearForm.empty(shape[0] * shape[1])
    for s in sets:
        f = s.linear_form(shape)
        assert f is not None
        form = form & f
    res = linprog(
        grad.ravel(),
        A_ub=form.A_ub if form.A_ub.shape[0] else None, b_ub=form.b_ub if form.b_ub.size else None,
        A_eq=form.A_eq if form.A_eq.shape[0] else None, b_eq=form.b_eq if form.b_eq.size else None,
        bounds=np.column_stack([np.where(np.isfinite(form.lb), form.lb, -np.inf),
                                np.where(np.isfinite(form.ub), form.ub, np.inf)]),
        method="highs",
    )
    if res.status == 3:
        return -math.inf, None
    if res.status == 2:
        raise InfeasibleError(
            f"the constraint set {' & '.join(s.spec for s in sets)} is empty (the LP over it is infeasible)"
        )
    if res.status != 0:
        raise UnsupportedError(f"linear minimisation over {' & '.join(s.spec for s in sets)} failed: {res.message}")
    s = np.asarray(res.x, dtype=np.float64).reshape(shape)
    return float(np.sum(grad * s)), s


def _cvxpy_support(sets: Iterable[ConstraintSet], grad: np.ndarray) -> tuple[float, np.ndarray | None]:
    """``min <grad, s>`` over any intersection (user sets included), as a CVXPY problem."""
    import cvxpy as cp

    sets = list(sets)
    var = cp.Variable(grad.shape)
    cons = [c for s in sets for c in s.cvxpy(var)]
    prob = cp.Problem(cp.Minimize(cp.sum(cp.multiply(grad, var))), cons)
    try:
        prob.solve(solver=cp.CLARABEL)
    except cp.error.SolverError as exc:
        raise UnsupportedError(f"linear minimisation over {' & '.join(s.spec for s in sets)} failed: {exc}") from None
    if prob.status in (cp.UNBOUNDED, cp.UNBOUNDED_INACCURATE):
        return -math.inf, None
    if prob.status in (cp.INFEASIBLE, cp.INFEASIBLE_INACCURATE):
        raise InfeasibleError(f"the constraint set {' & '.join(s.spec for s in sets)} is empty")
    if var.value is None:
        raise UnsupportedError(f"linear minimisation over {' & '.join(s.spec for s in sets)}: status {prob.status}")
    s = np.asarray(var.value, dtype=np.float64)
    return float(np.sum(grad * s)), s


# ---------------------------------------------------------------------- building / checking
def as_constraint_set(constraints: ConstraintSet | Sequence[ConstraintSet] | Callable[[Any], Any] | str | None) -> ConstraintSet:
    """Normalise ``None`` / a set / a spec string / a callable / a list of those into one set."""
    if constraints is None:
        return Unconstrained()
    if isinstance(constraints, ConstraintSet):
        return constraints
    if isinstance(constraints, str):
        return parse_constraint(constraints)
    if callable(constraints):
        return UserConstraints(constraints)
    flat: list[ConstraintSet] = []
    for c in constraints:
        flat.extend(as_constraint_set(c).members())
    if not flat:
        return Unconstrained()
    if len(flat) == 1:
        return flat[0]
    return Intersection(flat)


def check_feasible(constraints: ConstraintSet, shape: Shape) -> None:
    """Raise :class:`InfeasibleError` (naming the sets) if the intersection is empty.

    Closed-form checks first (empty box, box vs. simplex totals); otherwise one LP
    (HiGHS for polyhedral sets, CVXPY for user constraints) with a zero objective.
    """
    constraints.validate(shape)
    members = constraints.members()
    if len(members) <= 1 and not isinstance(constraints, (SignConsensus, UserConstraints)):
        return
    boxes = [s for s in members if isinstance(s, Box)]
    for simplex in (s for s in members if isinstance(s, Simplex)):
        for box in boxes:
            lo, hi = box.bounds(shape)
            lo, hi = np.maximum(lo, 0.0), hi
            if np.any(lo > hi):
                raise InfeasibleError(f"{box.spec} & {simplex.spec} is empty: the box excludes d >= 0 somewhere")
            lo_sum, hi_sum = np.sum(lo, axis=simplex.axis), np.sum(hi, axis=simplex.axis)
            bad = np.nonzero(np.atleast_1d((lo_sum > simplex.total + 1e-12) | (hi_sum < simplex.total - 1e-12)))[0]
            if bad.size:
                where = f"atom {int(bad[0])}" if simplex.axis == 0 else "the whole d"
                raise InfeasibleError(
                    f"{box.spec} & {simplex.spec} is empty: at {where} the box allows sums in "
                    f"[{np.atleast_1d(lo_sum)[bad[0]]:g}, {np.atleast_1d(hi_sum)[bad[0]]:g}] "
                    f"but the simplex needs {simplex.total:g}"
                )
    # a zero objective LP: status infeasible -> InfeasibleError from the support routine
    zero = np.zeros(shape)
    if all(s.linear_form(shape) is not None for s in members):
        _lp_support(members, zero)
    else:
        _cvxpy_support(members, zero)


# ---------------------------------------------------------------------- registry
def _floats(args: list[str], spec: str, count: tuple[int, int]) -> list[float]:
    if not count[0] <= len(args) <= count[1]:
        raise ValidationError(f"constraint {spec!r}: expected {count[0]}..{count[1]} numbers, got {len(args)}")
    try:
        return [float(a) for a in args]
    except ValueError:
        raise ValidationError(f"constraint {spec!r}: arguments must be numbers") from None


def _parse_box(args: list[str], spec: str, ctx: Mapping[str, Any]) -> ConstraintSet:
    vals = _floats(args, spec, (0, 2)) if args else [0.0, 1.0]
    if len(vals) == 1:
        raise ValidationError(f"constraint {spec!r}: box takes two bounds, box:LO,HI")
    return Box(vals[0], vals[1])


def _parse_simplex(args: list[str], spec: str, ctx: Mapping[str, Any]) -> ConstraintSet:
    vals = _floats(args, spec, (0, 1))
    return Simplex(vals[0] if vals else 1.0)


def _parse_global_simplex(args: list[str], spec: str, ctx: Mapping[str, Any]) -> ConstraintSet:
    vals = _floats(args, spec, (0, 1))
    return GlobalSimplex(vals[0] if vals else 1.0)


def _parse_l1(args: list[str], spec: str, ctx: Mapping[str, Any]) -> ConstraintSet:
    vals = _floats(args, spec, (1, 2))
    return L1Ball(vals[0], vals[1] if len(vals) > 1 else 0.0)


def _parse_nonneg(args: list[str], spec: str, ctx: Mapping[str, Any]) -> ConstraintSet:
    _floats(args, spec, (0, 0))
    return Box(0.0, np.inf)


def _parse_sign(args: list[str], spec: str, ctx: Mapping[str, Any]) -> ConstraintSet:
    if "deltas" not in ctx:
        raise ValidationError(
            "constraint 'sign' needs the residual tensors: put an array 'deltas' (K, r, m) in the "
            "problem file (and 'parametrisation' = rows|columns|scalar), or build "
            "SignConsensus.from_deltas(...) in Python"
        )
    density = _floats(args, spec, (0, 1))
    return SignConsensus.from_deltas(ctx["deltas"], str(ctx.get("parametrisation", "rows")),
                                     density[0] if density else 1.0)


CONSTRAINT_SETS: dict[str, Callable[[list[str], str, Mapping[str, Any]], ConstraintSet]] = {}


def register_constraint(name: str, parser: Callable[[list[str], str, Mapping[str, Any]], ConstraintSet]) -> None:
    """Register a command-line constraint spelling ``name[:args]``."""
    if name in CONSTRAINT_SETS:
        raise ValidationError(f"constraint set {name!r} is already registered")
    CONSTRAINT_SETS[name] = parser


register_constraint("box", _parse_box)
register_constraint("simplex", _parse_simplex)
register_constraint("global_simplex", _parse_global_simplex)
register_constraint("l1", _parse_l1)
register_constraint("nonneg", _parse_nonneg)
register_constraint("sign", _parse_sign)


def parse_constraint(spec: str, context: Mapping[str, Any] | None = None) -> ConstraintSet:
    """Parse ``"name[:a,b,...]"`` (e.g. ``box:0,1``, ``simplex``, ``l1:2``, ``l1:2,0.2``,
    ``global_simplex``, ``nonneg``, ``sign[:density]``). ``context`` supplies data some sets
    need (``deltas`` and ``parametrisation`` for ``sign``)."""
    spec = spec.strip()
    name, _, rest = spec.partition(":")
    name = name.strip().lower()
    if name not in CONSTRAINT_SETS:
        raise unknown("constraint set", name, CONSTRAINT_SETS)
    args = [a.strip() for a in rest.split(",")] if rest.strip() else []
    return CONSTRAINT_SETS[name](args, spec, context or {})
