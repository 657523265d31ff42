"""``rows+baselines``: the per-row atoms plus one atom per baseline merge, so that every
baseline is a feasible point of the QP.

Notation as in :mod:`.parametrisation` (augmented weights ``(r, m1)``, ``deltas`` ``(K, r, m1)``).
A baseline merge ``j`` (RegMean, Fisher, TIES, task arithmetic, ...) gives a merged weight
``W_j`` at the layer; its *merged residual* is ``U_j = W_j - W_base`` (``(r, m1)``). Model
``k``'s atoms are

- ``B_(k,i) = e_i e_i' delta_k`` for ``i < r`` (the paper's rows), and
- ``B_(k, r+j) = U_j`` for each of the ``J`` baselines (the same matrix for every model),

so ``n_atoms = r + J`` and the merged weight is ``W_base + sum_(k,i) d[k,i] e_i e_i' delta_k +
sum_j (sum_k d[k, r+j]) U_j``. Baseline ``j`` is the point ``d = 0`` on the rows and
``d[:, r+j] = 1/K`` (one ``K``-th per model, like the soup's ``1/K``; :meth:`baseline_point`).
The box ``[0, 1]`` contains every baseline point, the soup (rows ``1/K``) and their convex
combinations, so its certified optimum is never above any baseline's linearised objective; no
constraint (or any set containing the points) keeps that property, while a simplex or an L1
ball of radius < 1 does not. The ``K`` copies of a baseline atom make ``H`` singular along their
differences (the QP is still convex; only ``sum_k d[k, r+j]`` is determined).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import ValidationError
from ..formatting import format_number
from .parametrisation import Parametrisation, RowsParametrisation, register_parametrisation

__all__ = ["ROW_SPAN_TOL", "BaselineResiduals", "RowsBaselinesParametrisation", "snap_to_row_span"]

#: ``provider(site, deltas, names) -> {name: U}``: the merged residuals ``U`` (``(r, m1)``
#: float64) of the named baselines at one merge layer; a checkpoint merge passes one in the
#: parametrisation options under ``baseline_residuals``
BaselineResiduals = Callable[[Any, np.ndarray, tuple[str, ...]], Mapping[str, np.ndarray]]

_ROWS = RowsParametrisation()


class RowsBaselinesParametrisation(Parametrisation):
    """Rows atoms plus the merged residuals of chosen baselines (module docstring).

    ``residuals``: ``{baseline name: U}`` with ``U = W_baseline - W_base`` (augmented ``(r, m1)``,
    bias column last); ``None`` only for the registry entry, which builds them per merge layer
    (:meth:`for_site`, config key ``baselines``)."""

    name = "rows+baselines"
    config_options = ("baselines",)
    contains_task_vectors = True  # (rows lam, baseline atoms 0: task_vector_point)

    def __init__(self, residuals: Mapping[str, Any] | None = None):
        self._names: tuple[str, ...] = ()
        self._U: np.ndarray | None = None
        if residuals is None:
            return
        if not isinstance(residuals, Mapping) or not residuals:
            raise ValidationError("rows+baselines needs a non-empty mapping {baseline name: merged residual (r, m1)}")
        names = tuple(str(n) for n in residuals)
        arrays = [np.array(residuals[n], dtype=np.float64) for n in residuals]
        shapes = {a.shape for a in arrays}
        if len(shapes) != 1 or arrays[0].ndim != 2:
            raise ValidationError(f"rows+baselines: every merged residual must be one (r, m1) matrix, got shapes "
                                  f"{dict(zip(names, [a.shape for a in arrays]))}")
        U = np.stack(arrays)
        if not np.all(np.isfinite(U)):
            bad = [n for n, a in zip(names, arrays) if not np.all(np.isfinite(a))]
            raise ValidationError(f"rows+baselines: the merged residual of {bad} contains NaN or inf")
        U.setflags(write=False)
        self._names, self._U = names, U
        #: per baseline that lies in the span of the rows atoms (:func:`snap_to_row_span`): its
        #: coefficients ``(r, K)``, ``U[i] = sum_k coef[i, k] delta_k[i]``
        self._span: dict[str, np.ndarray] = {}

    def tie_to_rows(self, name: str, coef: np.ndarray) -> None:
        """Declare baseline ``name``'s residual the rows' combination ``coef`` (``(r, K)``): its atoms'
        statistics are then made exact along the tie (:meth:`atom_combinations`)."""
        coef = np.array(coef, dtype=np.float64)
        if name not in self._names or coef.ndim != 2 or coef.shape[0] != self.residuals.shape[1]:
            raise ValidationError(f"rows+baselines: cannot tie {name!r} with coefficients of shape {coef.shape}")
        self._span[name] = coef

    # ------------------------------------------------------------------ the atoms
    @property
    def baselines(self) -> tuple[str, ...]:
        """The baselines' names, in atom order."""
        return self._names

    @property
    def residuals(self) -> np.ndarray:
        """``U`` (``(J, r, m1)`` float64, read-only): the baselines' merged residuals."""
        if self._U is None:
            raise ValidationError("parametrisation 'rows+baselines' needs the baselines' merged residuals: pass "
                                  "{name: W_baseline - W_base}, or build it per layer with for_site")
        return self._U

    @property
    def built_per_layer(self) -> bool:
        return self._U is None

    @property
    def key(self) -> str:
        digest = hashlib.sha1(np.ascontiguousarray(self.residuals).tobytes()).hexdigest()[:16]
        return f"rows+baselines:{','.join(self._names)}:{digest}"

    def n_atoms(self, r: int, m1: int) -> int:
        return r + len(self.residuals)

    def atom_names(self, r: int, m1: int, has_bias: bool) -> tuple[str, ...]:
        return _ROWS.atom_names(r, m1, has_bias) + tuple(f"baseline:{n}" for n in self._names)

    def check(self, r: int, m1: int) -> None:
        shape = self.residuals.shape[1:]
        if shape != (r, m1):
            raise ValidationError(f"rows+baselines: the baselines' merged residuals are {shape} but the merge "
                                  f"layer's augmented weight is ({r}, {m1})")

    def baseline_point(self, name: str, K: int) -> np.ndarray:
        """The ``d`` (``(K, r + J)``) whose merge is baseline ``name``: rows 0, its atoms ``1/K``."""
        if name not in self._names:
            raise ValidationError(f"unknown baseline {name!r} of this rows+baselines parametrisation; valid: "
                                  f"{', '.join(self._names)}")
        r = self.residuals.shape[1]
        d = np.zeros((K, r + len(self._names)))
        d[:, r + self._names.index(name)] = 1.0 / K
        return d

    def task_vector_point(self, K: int, r: int, m1: int, lam: float = 1.0) -> np.ndarray:
        """Task arithmetic with weight ``lam`` (the soup at ``1/K``): rows ``lam``, baseline atoms 0
        (every atom ``lam`` would add every baseline's residual as well)."""
        d = np.zeros((int(K), int(self.n_atoms(r, m1))))
        d[:, :r] = float(lam)
        return d

    def reference_points(self, K: int) -> dict[str, np.ndarray]:
        return {f"baseline:{n}": self.baseline_point(n, K) for n in self._names}

    def solution_record(self, d: np.ndarray) -> dict[str, Any]:
        """``{"baselines": {name: {"weight", "residual_norm"}}}``: the weight ``sum_k d[k, r+j]`` the
        solution gives each baseline's merged residual (1 = the baseline itself, for coefficients
        taken from the base; a trust region's are its step from its start) and that residual's
        Frobenius norm."""
        U = self.residuals
        r = U.shape[1]
        d = np.asarray(d, dtype=np.float64)
        weights = d[:, r:].sum(axis=0)
        return {"baselines": {n: {"weight": float(w), "residual_norm": float(np.linalg.norm(u))}
                              for n, w, u in zip(self._names, weights, U)}}

    def report_markdown(self, layers: Sequence[Mapping[str, Any]]) -> list[str]:
        """``report.md``'s table of :meth:`solution_record` (each baseline's weight per layer)."""
        with_baselines = [r for r in layers if r.get("baselines")]
        if not with_baselines:
            return []
        names = list(with_baselines[0]["baselines"])
        lines = [("Baseline atoms (rows+baselines): the weight the solution gives each baseline's merged "
                  "residual (1 = the baseline itself; its Frobenius norm in brackets):"), "",
                 "| layer | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for r in with_baselines:
            b = r["baselines"]
            lines.append(f"| `{r['layer']}` | " + " | ".join(
                f"{format_number(b[n]['weight'], 4)} ({format_number(b[n]['residual_norm'], 4)})" if n in b else ""
                for n in names) + " |")
        return ["\n".join(lines)]

    def design(self, L: Any, R: Any, Z: Any, deltas: Any) -> Any:
        import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

        rows = _ROWS.design(L, R, Z, deltas)  # (B, c, K, r)
        U = torch.as_tensor(np.array(self.residuals), dtype=L.dtype, device=L.device)  # (J, r, m1)
        RU = torch.einsum("jim,btm->bjti", U, Z)  # each baseline's residual activations (B, J, T, r)
        base = torch.einsum("bcti,bjti->bcj", L, RU)  # (B, c, J)
        K = rows.shape[2]
        return torch.cat([rows, base.unsqueeze(2).expand(-1, -1, K, -1)], dim=3)

    def atom_combinations(self, K: int, r: int, m1: int) -> dict[int, np.ndarray] | None:
        """Each baseline in the rows' span (the soup, task arithmetic: :func:`snap_to_row_span`) has
        atoms ``(k, r + j)`` that are, for every ``k``, the rows atoms ``(k', i)`` times ``coef[i, k']``
        (the module docstring's flat directions of ``H``, made exact)."""
        if not self._span:
            return None
        n = r + len(self._names)
        out: dict[int, np.ndarray] = {}
        for j, name in enumerate(self._names):
            coef = self._span.get(name)
            if coef is None or coef.shape != (r, K):
                continue
            column = np.zeros(K * n)
            for k2 in range(K):
                column[k2 * n:k2 * n + r] = coef[:, k2]
            for k in range(K):
                out[k * n + r + j] = column
        return out or None

    def update(self, d: np.ndarray, deltas: np.ndarray) -> np.ndarray:
        r = deltas.shape[1]
        return _ROWS.update(d[:, :r], deltas) + np.einsum("j,jim->im", d[:, r:].sum(axis=0), self.residuals)

    def tangents(self, Z: Any, delta: Any) -> Any:
        import torch  # optional heavy dependency: only checkpoint merging calls the tangent rule

        U = torch.as_tensor(np.array(self.residuals), dtype=Z.dtype, device=Z.device)  # (J, r, m1)
        base = torch.einsum("...m,jim->j...i", Z, U)  # (J, ..., r)
        return torch.cat([_ROWS.tangents(Z, delta), base], dim=0)

    def shared_hessian(self, deltas: np.ndarray, gram: np.ndarray, G: np.ndarray) -> np.ndarray:
        # H = 2 <B_a gram, G B_b> over the atoms: rows-rows (the rows formula), rows-baseline
        # 2 sum_m (delta_k gram)[i, m] (G U_j)[i, m], baseline-baseline 2 <U_j gram, G U_l>
        K, r, m1 = deltas.shape
        U = self.residuals
        J = U.shape[0]
        n_atoms = r + J
        H = np.zeros((K, n_atoms, K, n_atoms))
        H[:, :r, :, :r] = _ROWS.shared_hessian(deltas, gram, G).reshape(K, r, K, r)
        GU = np.einsum("ih,jhm->jim", G, U)
        cross = 2.0 * np.einsum("kim,mn,jin->kij", deltas, gram, GU)  # (K, r, J)
        H[:, :r, :, r:] = cross[:, :, None, :]
        H[:, r:, :, :r] = cross.transpose(2, 0, 1)[None, :, :, :]
        bb = 2.0 * np.einsum("jim,mn,lin->jl", U, gram, GU)
        H[:, r:, :, r:] = bb[None, :, None, :]
        return H.reshape(K * n_atoms, K * n_atoms)

    def gradient(self, deltas: np.ndarray, cross: np.ndarray) -> np.ndarray:
        K, r, _ = deltas.shape
        rows = 2.0 * np.einsum("kim,im->ki", deltas, cross)
        base = 2.0 * np.einsum("jim,im->j", self.residuals, cross)
        return np.concatenate([rows, np.broadcast_to(base, (K, base.size))], axis=1).ravel()

    # ------------------------------------------------------------------ registry-entry rules
    def check_config(self, options: Mapping[str, Any], given: Collection[str]) -> None:
        names = _baseline_names(options)
        if not names:
            raise ValueError("parametrisation: rows+baselines needs 'baselines', a list of baseline names "
                             "(e.g. [ties, task_arithmetic])")
        if len(set(names)) != len(names):
            raise ValueError(f"baselines: {list(names)} names a baseline twice")

    def planned_atoms(self, r: int, m1: int, options: Mapping[str, Any]) -> int:
        return r + len(_baseline_names(options))

    def for_site(self, site: Any, deltas: np.ndarray, options: Mapping[str, Any], *, seed: int = 0,
                 output_stats: Any = None) -> Parametrisation:
        names = _baseline_names(options)
        provider = options.get("baseline_residuals")
        if not names:
            raise ValidationError(f"rows+baselines at layer {site.name!r}: no baselines named")
        if provider is None:
            raise ValidationError(f"rows+baselines at layer {site.name!r}: nothing computes the baselines' merged "
                                  "residuals (options['baseline_residuals'])")
        residuals = provider(site, deltas, names)
        snapped = {n: snap_to_row_span(np.asarray(residuals[n], dtype=np.float64), deltas) for n in names}
        param = RowsBaselinesParametrisation({n: fit for n, (fit, _) in snapped.items()})
        for n, (_, coef) in snapped.items():
            if coef is not None:
                param.tie_to_rows(n, coef)
        return param

    def describe(self, options: Mapping[str, Any]) -> str:
        return f"{self.name} ({', '.join(_baseline_names(options))})"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "baselines": list(self._names),
                **({"key": self.key} if self._U is not None else {})}

    def __repr__(self) -> str:
        if self._U is None:
            return "RowsBaselinesParametrisation(<built per layer>)"
        return f"RowsBaselinesParametrisation({', '.join(self._names)}; r={self._U.shape[1]}, m1={self._U.shape[2]})"



#: a baseline's merged residual whose every row lies within this fraction of its norm of the span of the
#: fine-tunes' same rows is that span's (the soup, task arithmetic: merged in float64 from the same
#: residuals, they lie within ~1e-13 of it; TIES, RegMean, Fisher, DARE rows lie far off it)
ROW_SPAN_TOL = 1e-8


def snap_to_row_span(U: np.ndarray, deltas: np.ndarray,
                     tol: float = ROW_SPAN_TOL) -> tuple[np.ndarray, np.ndarray | None]:
    """``(U, None)`` for ``U`` (``(r, m1)``), or, where each of its rows is a combination of the
    fine-tunes' same rows (``deltas`` ``(K, r, m1)``) up to ``tol`` of its norm, ``(fit, coef)``:
    those combinations computed in float64 and their coefficients ``(r, K)``.

    A soup's or task arithmetic's residual is such a combination, so its atoms are exact combinations
    of the rows atoms and ``H`` is singular along their difference; but their statistics, computed
    apart, agree only to the model's rounding (transformers' RMSNorm computes in float32 even in a
    float64 model), and ``g`` then had a component along that flat direction far above the
    certificate's float64 rounding: with no constraint bounding it, the optimum went uncertified ("no
    finite optimality bound", exit 1; a review, stop 74). The coefficients tie the statistics
    (:meth:`RowsBaselinesParametrisation.atom_combinations`); a residual off the span (TIES,
    RegMean, Fisher, DARE) is returned as it is."""
    D = np.asarray(deltas, dtype=np.float64)
    if U.ndim != 2 or D.ndim != 3 or D.shape[1:] != U.shape:
        return U, None
    G = np.einsum("kim,lim->ikl", D, D)  # (r, K, K): each row's Gram matrix of the fine-tunes' rows
    b = np.einsum("kim,im->ik", D, U)
    coef = np.einsum("ikl,il->ik", np.linalg.pinv(G, hermitian=True), b)
    fit = np.einsum("ik,kim->im", coef, D)
    off = np.linalg.norm(U - fit, axis=1)
    size = np.linalg.norm(U, axis=1)
    if not np.all(off <= tol * size):
        return U, None
    return fit, coef


def _baseline_names(options: Mapping[str, Any]) -> tuple[str, ...]:
    """The configured baselines' names (``options["baselines"]``: names, or entries with a ``name``)."""
    return tuple(str(getattr(b, "name", b)) for b in options.get("baselines") or ())


register_parametrisation(RowsBaselinesParametrisation())
