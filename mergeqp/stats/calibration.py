"""``CalibrationStats``: everything the merge QP needs from a calibration pass, in float64.

Per task ``t`` (one calibration set per fine-tuned model, in the models' order), unweighted
sums over its samples ``j`` (``b_j = h_j - y_j``, ``L_j`` the downstream Jacobian, ``z_j`` the
augmented layer input, ``A_j`` the design of a parametrisation):

- ``task_counts`` (``(K,)``) samples; ``task_c`` (``(K,)``) ``c_t = sum ||b_j||^2``;
- ``task_S`` (``(K, c, c)``) residual energy ``S_t = sum b_j b_j'``;
- ``task_cross`` (``(K, r, m1)``) ``C_t = sum_(j,pos) (L_j' b_j) z_j'``, from which the linear
  term ``g`` of *every* parametrisation follows exactly;
- ``task_gram`` (``(K, m1, m1)``, only for ``T = 1``) ``sum z_j z_j'``, from which ``H`` of every
  parametrisation follows when one Jacobian serves all samples (``jacobian_shared``);
- ``task_jacobian_sum`` (``(K, c, T, r)``) ``sum L_j`` (for the calibration-mean Jacobian);
- ``collected``: per requested parametrisation, ``H_t = 2 sum A_j'A_j`` (``(K, n, n)``) and
  ``g_t = 2 sum A_j'b_j`` (``(K, n)``), streamed in batches;
- optionally ``samples``: the per-sample ``z_j, L_j, b_j`` (``keep_samples=True``), from which any
  parametrisation's QP and the per-sample energy diagnostics are built afterwards.

Task weights ``w`` (``None``: all 1, the paper's plain sum; ``"mean"``: ``1/n_t``; or one
non-negative number per task) combine them: ``H = sum_t w_t H_t`` etc., so reweighting needs no
recollection. ``stats.problem(parametrisation, task_weights)`` builds the :class:`MergeQP` from
the first source that has it: statistics collected for that parametrisation, the kept
samples, or (shared Jacobian, ``T = 1``) the sufficient statistics ``gram, L'L, cross``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from ..errors import BadDataError, ValidationError, unknown
from ..problem import MergeQP
from .apply import merge_points, set_linear_weights
from .bases import parse_basis_spec
from .diagnostics import energy_report, suboptimality_gap
from .parametrisation import (
    Basis,
    BasisParametrisation,
    Parametrisation,
    as_parametrisation,
    check_d,
    checked_design,
    merged_update,
    solution_point,
)
from .records import CollectedProblem, SampleChunk
from .storage import read_stats, save_stats

SOURCES = ("auto", "collected", "samples", "shared")


def _frozen(a: np.ndarray | None) -> np.ndarray | None:
    if a is None:
        return None
    a = np.asarray(a)
    a.setflags(write=False)
    return a


@dataclass(frozen=True, eq=False)
class CalibrationStats:
    """Statistics of one merge layer over K tasks' calibration data (see module docstring).

    Shapes: ``deltas`` ``(K, r, m1)`` (``m1 = m + 1`` with a bias: the last column is the
    bias), ``base_weight`` ``(r, m1)`` at the linearisation point, ``reference_weight`` the
    weights the deltas are measured from when that differs from ``base_weight`` (else None).
    """

    layer: str
    model_names: tuple[str, ...]
    task_names: tuple[str, ...]
    has_bias: bool
    deltas: np.ndarray
    base_weight: np.ndarray
    task_counts: np.ndarray
    task_c: np.ndarray
    task_S: np.ndarray
    task_cross: np.ndarray
    task_jacobian_sum: np.ndarray | None
    task_gram: np.ndarray | None
    jacobian_shared: bool
    jacobian_variation: float
    positions: int | None
    collected: Mapping[str, CollectedProblem] = field(default_factory=dict)
    samples: tuple[SampleChunk, ...] | None = None
    reference_weight: np.ndarray | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        K = len(self.model_names)
        if self.deltas.ndim != 3 or self.deltas.shape[0] != K:
            raise ValidationError(f"deltas must be (K={K}, r, m1), got {self.deltas.shape}")
        if len(self.task_names) != K:
            raise ValidationError(f"expected {K} task names, got {len(self.task_names)}")
        counts = np.asarray(self.task_counts)
        if counts.shape != (K,):
            raise ValidationError(f"task_counts must be ({K},), one sample count per task, got {counts.shape}")
        if not (np.all(np.isfinite(counts)) and np.all(counts > 0) and np.all(counts == np.round(counts))):
            raise BadDataError(f"task_counts must be positive whole numbers (the samples behind each task's sums), "
                               f"got {counts.tolist()}: a statistics file no collection wrote")
        for name in ("deltas", "base_weight", "task_counts", "task_c", "task_S", "task_cross",
                     "task_jacobian_sum", "task_gram", "reference_weight"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))
        object.__setattr__(self, "collected", MappingProxyType(dict(self.collected)))
        if self.samples is not None:
            object.__setattr__(self, "samples", tuple(self.samples))
        object.__setattr__(self, "metadata", MappingProxyType(dict(self.metadata)))

    # ------------------------------------------------------------------ sizes
    @property
    def K(self) -> int:
        """Number of fine-tuned models (= number of tasks)."""
        return int(self.deltas.shape[0])

    @property
    def r(self) -> int:
        """Output features of the merge layer."""
        return int(self.deltas.shape[1])

    @property
    def m1(self) -> int:
        """Input features of the merge layer, plus one with a bias."""
        return int(self.deltas.shape[2])

    @property
    def c(self) -> int:
        """Length of the compared (flattened) model output."""
        return int(self.task_S.shape[1])

    @property
    def n_samples(self) -> int:
        return int(self.task_counts.sum())

    def nbytes(self, include_samples: bool = True) -> int:
        """Memory held by the statistics (bytes); without samples it does not grow with N."""
        total = 0
        for name in ("deltas", "base_weight", "task_counts", "task_c", "task_S", "task_cross",
                     "task_jacobian_sum", "task_gram", "reference_weight"):
            a = getattr(self, name)
            total += 0 if a is None else int(a.nbytes)
        for item in self.collected.values():
            total += int(item.H.nbytes + item.g.nbytes)
        if include_samples and self.samples is not None:
            total += sum(ch.nbytes for ch in self.samples)
        return total

    # ------------------------------------------------------------------ weights
    def task_weight_vector(self, task_weights: Any = None) -> np.ndarray:
        """``(K,)`` task weights: ``None`` -> 1 each; ``"mean"`` -> ``1/n_t``; a sequence of K
        non-negative numbers; or a mapping ``{task_name: weight}`` (missing tasks weigh 1)."""
        if task_weights is None:
            return np.ones(self.K)
        if isinstance(task_weights, str):
            if task_weights == "mean":
                return 1.0 / self.task_counts.astype(np.float64)
            raise unknown("task weighting", task_weights, ["mean"])
        if isinstance(task_weights, Mapping):
            bad = [k for k in task_weights if k not in self.task_names]
            if bad:
                raise ValidationError(
                    f"task_weights names unknown task {bad[0]!r}; tasks: {', '.join(self.task_names)}"
                )
            w = np.array([float(task_weights.get(t, 1.0)) for t in self.task_names])
        else:
            w = np.asarray(task_weights, dtype=np.float64).reshape(-1)
            if w.shape != (self.K,):
                raise ValidationError(
                    f"task_weights must have one entry per task ({self.K}), got {w.shape[0]}"
                )
        if not np.all(np.isfinite(w)) or np.any(w < 0):
            raise ValidationError(f"task_weights must be finite and >= 0, got {w.tolist()}")
        if not np.any(w > 0):
            raise ValidationError("task_weights are all zero")
        return w

    # ------------------------------------------------------------------ derived statistics
    def S(self, task_weights: Any = None) -> np.ndarray:
        """Residual energy ``S = sum_j w_j b_j b_j'`` (``(c, c)``)."""
        w = self.task_weight_vector(task_weights)
        return np.einsum("t,tij->ij", w, self.task_S)

    def total_energy(self, task_weights: Any = None) -> float:
        """``tr(S) = sum_j w_j ||b_j||^2 = J(0)``, the base model's calibration error."""
        return float(self.task_weight_vector(task_weights) @ self.task_c)

    def mean_jacobian(self, task_weights: Any = None) -> np.ndarray:
        """Calibration-mean Jacobian ``sum_j w_j L_j / sum_j w_j`` (``(c, T, r)``)."""
        if self.task_jacobian_sum is None:
            raise ValidationError(
                "the mean Jacobian is unavailable: the number of positions varied between "
                "batches; collect with keep_samples=True for per-sample diagnostics"
            )
        w = self.task_weight_vector(task_weights)
        return np.einsum("t,tcpr->cpr", w, self.task_jacobian_sum) / float(w @ self.task_counts)

    # ------------------------------------------------------------------ parametrisations
    def parametrisation(self, spec: Any, *, seed: int = 0, task_weights: Any = None) -> Parametrisation:
        """Resolve a parametrisation; besides :func:`as_parametrisation`'s forms, a basis spec
        ``"NAME:P[:SEED]"`` (``standard``, ``svd``, ``random``, ``optimal``) is built from these
        statistics."""
        if isinstance(spec, str) and ":" in spec:
            return BasisParametrisation(parse_basis_spec(spec, self, seed=seed,
                                                         task_weights=task_weights))
        param = as_parametrisation(spec)
        param.check(self.r, self.m1)
        return param

    def n_atoms(self, parametrisation: Any) -> int:
        return self.parametrisation(parametrisation).n_atoms(self.r, self.m1)

    def sources(self, parametrisation: Any = "rows") -> list[str]:
        """Which sources can build the exact QP of ``parametrisation`` (in preference order)."""
        param = self.parametrisation(parametrisation)
        out = []
        if param.key in self.collected:
            out.append("collected")
        if self.samples is not None:
            out.append("samples")
        if self.jacobian_shared and self.positions == 1 and self.task_gram is not None:
            out.append("shared")
        return out

    def problem(
        self,
        parametrisation: Any = "rows",
        task_weights: Any = None,
        *,
        offset: Any = None,
        source: str = "auto",
    ) -> MergeQP:
        """The merge QP ``J(d) = 1/2 d'Hd + g'd + c`` for ``d`` of shape ``(K, n_atoms)``.

        ``parametrisation``: ``"rows"`` (default), ``"scalar"``, ``"columns"``, a
        :class:`Basis`, an orthonormal ``(r, p)`` array or a basis spec ``"optimal:8"``.
        ``offset``: when the statistics were linearised at ``reference + update(d0)`` (collected
        with ``reference_model``), ``d0``; the QP is then in absolute ``d``.
        ``source``: ``auto`` or one of ``collected``, ``samples``, ``shared`` (see
        :meth:`sources`). Raises :class:`ValidationError` naming how to get a missing one.
        """
        if source not in SOURCES:
            raise unknown("statistics source", source, SOURCES)
        param = self.parametrisation(parametrisation, task_weights=task_weights)
        w = self.task_weight_vector(task_weights)
        available = self.sources(param)
        if source == "auto":
            if not available:
                what = (f"basis {param.basis.name}:{param.basis.p}"
                        if isinstance(param, BasisParametrisation) and not param.built_per_layer
                        else f"{param.name} parametrisation")
                # (a review, stop 74: it named the basis by its content hash and gave only the Python advice)
                raise ValidationError(
                    f"no statistics for the {what}: it was not collected "
                    f"(collected: {', '.join(self.collected) or 'none'}), no per-sample data was "
                    f"kept, and the Jacobian varies between samples; collect again keeping the samples "
                    f"(mergeqp collect --keep-samples; Python: keep_samples=True) or, for a named "
                    f"parametrisation, streaming it (collect --parametrisation NAME; parametrisations=[...])"
                )
            source = available[0]
        elif source not in available:
            raise ValidationError(
                f"source {source!r} cannot build the {param.key} parametrisation here; "
                f"available: {', '.join(available) or 'none'}"
            )
        if source == "collected":
            item = self.collected[param.key]
            H = np.einsum("t,tij->ij", w, item.H)
            g = np.einsum("t,ti->i", w, item.g)
        elif source == "samples":
            H, g = self._from_samples(param, w)
        else:
            H, g = self._from_shared(param, w)
        c = self.total_energy(w)
        H = 0.5 * (H + H.T)
        shape = (self.K, param.n_atoms(self.r, self.m1))
        meta: dict[str, Any] = {
            "layer": self.layer,
            "parametrisation": param.to_json(),
            "source": source,
            "task_weights": w.tolist(),
            "n_samples": self.n_samples,
            "output_dim": self.c,
            "jacobian_shared": bool(self.jacobian_shared),
            "targets": self.metadata.get("targets"),
        }
        # the soup's coefficients (rows+baselines: baseline atoms 0); with an offset d is still absolute
        soup = param.task_vector_point(self.K, self.r, self.m1, 1.0 / self.K)
        if offset is not None:
            d0 = check_d(offset, *shape, param)
            self._check_offset(param, d0)
            x0 = d0.ravel()
            Hx0 = H @ x0
            c = c - float(g @ x0) + 0.5 * float(x0 @ Hx0)
            g = g - Hx0
            meta["offset"] = "linearised at reference + update(offset)"
        uniform = bool(np.all(soup == 1.0 / self.K))
        return MergeQP(
            H=H, g=g, c=c, shape=shape, model_names=self.model_names,
            atom_names=param.atom_names(self.r, self.m1, self.has_bias), metadata=meta,
            soup=None if uniform else soup,
        )

    def _check_offset(self, param: Parametrisation, d0: np.ndarray) -> None:
        reference = self.base_weight if self.reference_weight is None else self.reference_weight
        expected = reference + merged_update(param, d0, self.deltas)
        err = float(np.max(np.abs(expected - self.base_weight)))
        scale = max(float(np.max(np.abs(self.base_weight))), 1e-30)
        if err > 1e-5 * scale:
            raise ValidationError(
                f"offset does not match the linearisation point: reference + update(offset) "
                f"differs from the layer weights the statistics were collected at by {err:.3g}"
            )

    def _from_samples(self, param: Parametrisation, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        import torch  # deferred: torch is heavy

        assert self.samples is not None
        n = self.K * param.n_atoms(self.r, self.m1)
        H = torch.zeros(n, n, dtype=torch.float64)
        g = torch.zeros(n, dtype=torch.float64)
        D = torch.tensor(np.asarray(self.deltas), dtype=torch.float64)
        for chunk in self.samples:
            weight = float(w[chunk.task])
            if weight == 0.0:
                continue
            A, b = self._chunk_design(param, chunk, D)
            H += (2.0 * weight) * (A.T @ A)
            g += (2.0 * weight) * (A.T @ b)
        return H.numpy(), g.numpy()

    def _chunk_design(self, param: Parametrisation, chunk: SampleChunk, D: Any) -> tuple[Any, Any]:
        import torch  # deferred: torch is heavy

        Z = torch.from_numpy(chunk.layer_input)
        L = torch.from_numpy(chunk.jacobian)
        R = torch.einsum("btm,krm->bktr", Z, D)
        A = checked_design(param, L, R, Z, D)
        B, c = A.shape[:2]
        return A.reshape(B * c, -1), torch.from_numpy(chunk.residual).reshape(-1)

    def _from_shared(self, param: Parametrisation, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        assert self.task_gram is not None
        L = self.mean_jacobian(w)[:, 0, :]
        gram = np.einsum("t,tij->ij", w, self.task_gram)
        H = param.shared_hessian(np.asarray(self.deltas, dtype=np.float64), gram, L.T @ L)
        g = param.gradient(np.asarray(self.deltas, dtype=np.float64), self.cross(w))
        return H, g

    def cross(self, task_weights: Any = None) -> np.ndarray:
        """``C = sum_j w_j sum_pos (L_j' b_j) z_j'`` (``(r, m1)``)."""
        w = self.task_weight_vector(task_weights)
        return np.einsum("t,trm->rm", w, self.task_cross)

    # ------------------------------------------------------------------ diagnostics
    def energy_report(self, basis: Any, task_weights: Any = None, method: str = "auto") -> Any:
        """Captured energy, fraction and relaxed bound of a basis (:func:`energy_report`)."""
        return energy_report(self, basis, task_weights=task_weights, method=method)

    def energy_fraction(self, basis: Any, task_weights: Any = None, method: str = "auto") -> float:
        """``tr(S P)/tr(S)`` with ``P`` the projector on ``span{L q}`` (per-sample form when
        samples were kept and ``L_j`` varies)."""
        return self.energy_report(basis, task_weights, method).fraction

    def relaxed_bound(self, basis: Any, task_weights: Any = None, method: str = "auto") -> float:
        """``tr(S) - tr(S P)``: a lower bound on ``J`` for that basis, before any solve."""
        return self.energy_report(basis, task_weights, method).relaxed_bound

    def suboptimality_gap(self, basis: Any, reference: Any = None, task_weights: Any = None,
                          method: str = "auto") -> float:
        """``tr(S (P_ref - P_basis))``; ``reference`` defaults to the optimal basis of equal p."""
        return suboptimality_gap(self, basis, reference, task_weights=task_weights, method=method)

    # ------------------------------------------------------------------ merged weights
    def merged_weights(self, d: Any, parametrisation: Any = None) -> tuple[np.ndarray, np.ndarray | None]:
        """``W_ref + sum_a d_a B_a`` split into weight ``(r, m)`` and bias ``(r,)`` (or None); ``d`` a
        :class:`~mergeqp.solution.Solution` (read in its QP's parametrisation) or coefficients of
        ``parametrisation`` (``rows`` when ``None``)."""
        d, param = solution_point(d, parametrisation, self.parametrisation, layer=self.layer)
        d = check_d(d, self.K, param.n_atoms(self.r, self.m1), param)
        reference = self.base_weight if self.reference_weight is None else self.reference_weight
        W = reference + merged_update(param, d, np.asarray(self.deltas, dtype=np.float64))
        if self.has_bias:
            return W[:, :-1].copy(), W[:, -1].copy()
        return W, None

    def apply(self, base_model: Any, d: Any, parametrisation: Any = None) -> Any:
        """A copy of ``base_model`` with the merge layer set to :meth:`merged_weights`."""
        weight, bias = self.merged_weights(d, parametrisation)
        return set_linear_weights(base_model, self.layer, weight, bias,
                                  expected_base=self.reference_weight if self.reference_weight
                                  is not None else self.base_weight)

    def merge_points(self, parametrisation: Any = "rows", *, lam: float = 1.0,
                     dare_p: float = 0.5, seed: int = 0) -> dict[str, np.ndarray]:
        """Known merges as points of the QP: ``task_arithmetic``, ``soup`` and (rows) ``row_dare``."""
        param = self.parametrisation(parametrisation)
        return merge_points(param, self.K, self.r, self.m1, lam=lam, dare_p=dare_p, seed=seed)

    # ------------------------------------------------------------------ per-sample views
    def _require_samples(self, what: str) -> tuple[SampleChunk, ...]:
        if self.samples is None:
            raise ValidationError(f"{what} needs per-sample data: collect with keep_samples=True")
        return self.samples

    def residuals(self) -> np.ndarray:
        """Per-sample residuals ``b_j = h_j - y_j`` (``(N, c)``, calibration order)."""
        return np.concatenate([ch.residual for ch in self._require_samples("residuals()")])

    def linearised_change(self, d: Any, parametrisation: Any = "rows") -> np.ndarray:
        """First-order output change ``A_j d`` for every sample (``(N, c)``, calibration order)."""
        import torch  # deferred: torch is heavy

        samples = self._require_samples("linearised_change()")
        param = self.parametrisation(parametrisation)
        d = check_d(d, self.K, param.n_atoms(self.r, self.m1), param)
        D = torch.tensor(np.asarray(self.deltas), dtype=torch.float64)
        x = torch.from_numpy(d.ravel())
        out = []
        for chunk in samples:
            A, _ = self._chunk_design(param, chunk, D)
            out.append((A @ x).reshape(chunk.size, -1).numpy())
        return np.concatenate(out)

    # ------------------------------------------------------------------ io and display
    def save(self, path: str, *, include_samples: bool = True) -> None:
        """Write the statistics to an ``.npz`` (arrays + JSON metadata); see :mod:`.storage`."""
        save_stats(self, path, include_samples=include_samples)

    @classmethod
    def load(cls, path: str) -> CalibrationStats:
        return cls(**read_stats(path))

    def summary(self) -> str:
        T = self.positions if self.positions is not None else "varying"
        bias = " + bias" if self.has_bias else ""
        sharing = "shared by all samples" if self.jacobian_shared else "varies"
        per_task = ", ".join(f"{t}={int(n)}" for t, n in zip(self.task_names, self.task_counts))
        kept = "kept" if self.samples is not None else "not kept"
        lines = [
            (f"layer {self.layer}: W {self.r} x {self.m1 - int(self.has_bias)}{bias}; "
             f"K = {self.K} models; c = {self.c} outputs; positions T = {T}"),
            f"samples per task: {per_task}",
            (f"J(0) = tr(S) = {self.total_energy():.6g}; Jacobian {sharing} "
             f"(max relative deviation {self.jacobian_variation:.3g})"),
            (f"collected: {', '.join(self.collected) or 'none'}; per-sample data {kept}; "
             f"{self.nbytes() / 2**20:.2f} MiB"),
        ]
        return "\n".join(lines)


def load_stats(path: str) -> CalibrationStats:
    """Read statistics written by :func:`~mergeqp.stats.storage.save_stats`
    (:meth:`CalibrationStats.save`)."""
    return CalibrationStats.load(path)


__all__ = ["Basis", "CalibrationStats", "CollectedProblem", "SampleChunk", "load_stats"]
