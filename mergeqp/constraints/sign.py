"""TIES-like sign consensus: the merged update of a parameter never opposes its elected sign."""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.sparse as sp
from scipy.spatial import ConvexHull, QhullError

from ..errors import ValidationError
from ..lower_bounds import LinearMinimum
from .base import LMO_HIGHS, ConstraintSet, Shape, float_array
from .forms import LinearForm
from .lp import highs_minimum


def _grouped_by_atom(signed: np.ndarray, mask: np.ndarray, atoms: Any, name: str
                     ) -> tuple[list[np.ndarray], list[np.ndarray], tuple[int, int]]:
    """Per atom, the signed residuals of the parameters it scales (``(P_a, K)``, in row-major order)
    and their mask, from the ``(r, m)`` map ``atoms`` (each parameter's atom)."""
    K, r, m = signed.shape
    A = np.asarray(atoms)
    if A.shape != (r, m) or A.size == 0 or not np.issubdtype(A.dtype, np.integer) or A.min() < 0:
        raise ValidationError(f"sign consensus ({name}): parameter_atoms must be an ({r}, {m}) array of atom "
                              f"indices >= 0, got {A.dtype} of shape {A.shape}")
    flat = A.ravel()
    n_atoms = int(flat.max()) + 1
    order = np.argsort(flat, kind="stable")  # each atom's parameters, in row-major order
    ends = np.cumsum(np.bincount(flat, minlength=n_atoms))[:-1]
    S, M = signed.reshape(K, -1).T, mask.ravel()
    groups = np.split(order, ends)
    return [S[g] for g in groups], [M[g] for g in groups], (K, n_atoms)


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
    known_nonempty = True
    has_projection = False
    polyhedral = True

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
                    reduce: bool = True, atoms: Any = None) -> SignConsensus:
        """Build from residuals ``deltas`` of shape ``(K, r, m)`` (``delta_k = W_k - W_base``;
        append the bias as a last column when it is merged too).

        ``parametrisation``: ``"rows"`` (``d`` is ``(K, r)``: atom ``i`` scales row ``i`` of
        every ``delta_k``), ``"columns"`` (``(K, m)``) or ``"scalar"`` (``(K, 1)``).
        ``density`` < 1 constrains only the parameters that a TIES trim (top ``density``
        fraction of ``|delta_k|`` per model) keeps in at least one model; the elected sign
        stays ``sign(sum_k delta_k[p])`` so the soup remains feasible.
        ``reduce``: keep only the extreme rays among each atom's constraint vectors (the
        others are implied; exact, via a convex hull in ``K - 1`` dimensions for ``K <= 7``).
        ``atoms``: for another parametrisation (``parametrisation`` is then only its name), the
        ``(r, m)`` integer array of the atom that scales each parameter
        (:meth:`~mergeqp.stats.parametrisation.Parametrisation.parameter_atoms`), or a function of no
        arguments returning it (called only for such a parametrisation: rows, columns and scalar
        need no map); ``d`` is then ``(K, atoms.max() + 1)``.
        """
        D = float_array(deltas, "sign consensus: deltas")
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
        elif (atoms := atoms() if callable(atoms) else atoms) is not None:
            vecs, masks, shape = _grouped_by_atom(signed, mask, atoms, parametrisation)
        else:
            raise ValidationError(
                f"sign consensus is defined for parametrisations whose atoms each scale their own parameters "
                f"(rows, columns, scalar, or one whose parameter_atoms says which atom moves each parameter); "
                f"{parametrisation!r} gives no such map (a basis mixes parameters)")
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
        out.density = density
        return out

    n_parameters: int | None = None
    #: the TIES trim's density the set was built with (:meth:`from_deltas`; 1: every parameter)
    density: float = 1.0

    @property
    def spec(self) -> str:
        """``sign``, or ``sign:DENSITY`` for a set built with ``density < 1`` (another set)."""
        return "sign" if self.density >= 1 else f"sign:{self.density:g}"

    @property
    def lmo_method(self) -> str:
        return LMO_HIGHS

    def validate(self, shape: Shape) -> None:
        if tuple(shape) != self.shape:
            raise ValidationError(
                f"sign consensus was built for d of shape {self.shape}, the problem has {tuple(shape)}"
            )

    def cvxpy(self, var: Any) -> list[Any]:
        import cvxpy as cp  # optional heavy dependency: only the CVXPY form needs it

        if self.G.shape[0] == 0:
            return []
        return [self.G @ cp.vec(var, order="C") >= 0]

    def linear_minimum(self, grad: np.ndarray) -> LinearMinimum:
        return highs_minimum([self], grad)

    @property
    def vacuous(self) -> bool:
        """No inequality at all (every residual zero): the set is all of ``R^n``."""
        return self.G.shape[0] == 0

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
    try:
        return np.sort(ConvexHull(Z[:, : K - 1]).vertices)
    except (QhullError, ValueError):
        return unique_rows()
