"""Parametrisations of the merged update: which weight-space directions (atoms) the QP weights.

Notation (the paper's, as in docs/statistics.md): the merge layer has weight ``W`` of shape
``(r, m)``; with a bias the layer input gets a constant 1 appended, so all weights here are
*augmented*, ``(r, m1)`` with ``m1 = m + 1`` (last column = bias). ``deltas`` is ``(K, r, m1)``: ``delta_k = W_k - W_base``.

A parametrisation is a set of atoms ``B_(k, a)`` (each ``(r, m1)``), laid out ``(K, n_atoms)``
like the QP decision ``d``; the merged weight is ``W_base + sum_(k,a) d[k, a] B_(k, a)``:

- ``scalar``: ``B_k = delta_k`` (``n_atoms = 1``; task arithmetic with one lambda per model);
- ``rows`` (the paper's diagonal mask): ``B_(k,i) = e_i e_i' delta_k`` (``n_atoms = r``);
- ``columns`` (input-feature masks): ``B_(k,i) = delta_k e_i e_i'`` (``n_atoms = m1``; the last
  atom is the bias column when the layer has a bias);
- ``basis(Q)`` for an orthonormal ``Q`` (``(r, p)``): ``B_(k,q) = q q' delta_k`` (``n_atoms = p``).
  ``rows`` is ``basis(I)`` (with a faster design).

Each parametrisation builds, for a batch of samples, the design tensor ``A`` with
``A[b, :, k, a] = L_b vec(B_(k,a) z_b)``: the first-order change of the compared output of
sample ``b`` per unit of ``d[k, a]`` (shape ``(B, c, K, n_atoms)``), from the per-sample
downstream Jacobian ``L`` (``(B, c, T, r)``), the residual activations
``R[b, k, t] = delta_k z_(b,t)`` (``(B, K, T, r)``), the augmented layer inputs ``Z``
(``(B, T, m1)``) and the deltas. ``T`` is the number of positions (1 for a plain vector input).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..errors import BadDataError, MergeQPError, ValidationError, check_new_name, first_line, lookup, unknown
from ..formatting import format_number
from ..solution import Solution
from .bases import BASES, PARAMETRISATION_NAMES, SiteResiduals, checkpoint_bases, random_basis, svd_basis
from .basis import ORTHONORMAL_TOL, Basis

__all__ = ["ORTHONORMAL_TOL", "Basis", "BasisParametrisation", "ColumnsParametrisation", "PARAMETRISATIONS", "checked_design", "checked_tangents", "merged_update",
           "Parametrisation", "RowsParametrisation", "ScalarParametrisation", "as_parametrisation", "check_d",
           "get_parametrisation", "register_parametrisation"]


def checked_design(param: Parametrisation, L: Any, R: Any, Z: Any, deltas: Any) -> Any:
    """``param.design(L, R, Z, deltas)``, checked: ``(B, c, K, n_atoms)`` (``L``: ``(B, c, T, r)``,
    ``deltas``: ``(K, r, m1)``). A user's parametrisation that answers otherwise is
    named (its rows failed deep inside the statistics)."""
    A = param.design(L, R, Z, deltas)
    K, r, m1 = (int(x) for x in deltas.shape)
    want = (int(L.shape[0]), int(L.shape[1]), K, int(param.n_atoms(r, m1)))
    got = tuple(getattr(A, "shape", ()))
    if got != want:
        raise ValidationError(f"parametrisation {param.name!r}: design(L, R, Z, deltas) returned shape {got}, "
                              f"expected {want} (samples, outputs, models, atoms = n_atoms({r}, {m1}))")
    A = _like(A, L, f"parametrisation {param.name!r}: design(L, R, Z, deltas)")
    if hasattr(A, "isfinite") and hasattr(L, "isfinite") and bool(L.isfinite().all()) and not bool(A.isfinite().all()):
        raise BadDataError(f"parametrisation {param.name!r}: design(L, R, Z, deltas) returned NaN or inf for finite "
                           f"inputs")
    return A


def checked_n_atoms(param: Parametrisation, r: int, m1: int) -> int:
    """``param.n_atoms(r, m1)``, checked: a whole number >= 1 (a user's parametrisation that answers
    otherwise is named here, not by the first array it sizes)."""
    what = f"parametrisation {param.name!r}: n_atoms({r}, {m1})"
    try:
        n = param.n_atoms(r, m1)
    except MergeQPError:
        raise
    except Exception as exc:  # noqa: BLE001 - a user's rule: name it, one line
        raise ValidationError(f"{what} raised {type(exc).__name__}: {first_line(exc, 200)}") from None
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValidationError(f"{what} must be a whole number >= 1 (atoms per model), got {n!r}")
    return int(n)


def _like(x: Any, ref: Any, what: str) -> Any:
    """A user's array answer in ``ref``'s dtype and device when ``ref`` is a torch tensor (a float32
    answer to float64 statistics failed inside torch's products); an integer, complex or
    non-numeric answer is named."""
    if not hasattr(ref, "is_floating_point"):
        return x
    import torch  # deferred: torch is heavy, and only tensors' answers need it

    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(np.asarray(x))
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValidationError(f"{what} returned {type(x).__name__}, not an array of numbers ({exc})") from None
    if not x.is_floating_point():
        raise ValidationError(f"{what} returned {x.dtype}, not a floating-point (real) tensor")
    return x.to(dtype=ref.dtype, device=ref.device)


def checked_tangents(param: Parametrisation, Z: Any, delta: Any) -> Any:
    """``param.tangents(Z, delta)``, checked: ``(n_atoms, *Z.shape[:-1], r)`` (``delta``: ``(r, m1)``)."""
    T = param.tangents(Z, delta)
    r, m1 = (int(x) for x in delta.shape)
    want = (int(param.n_atoms(r, m1)), *(int(x) for x in Z.shape[:-1]), r)
    got = tuple(getattr(T, "shape", ()))
    if got != want:
        raise ValidationError(f"parametrisation {param.name!r}: tangents(Z, delta) returned shape {got}, "
                              f"expected {want} (atoms = n_atoms({r}, {m1}), Z's leading shape, rows)")
    return _like(T, Z, f"parametrisation {param.name!r}: tangents(Z, delta)")


def merged_update(param: Parametrisation, d: np.ndarray, deltas: np.ndarray) -> np.ndarray:
    """``param.update(d, deltas)``, checked: a real ``(r, m1)`` array (``deltas`` is ``(K, r,
    m1)``). A user's parametrisation that answers otherwise is named (it failed deep inside the
    merge, or was broadcast silently)."""
    out = np.asarray(param.update(d, deltas))
    want = tuple(np.shape(deltas)[1:])
    if out.shape != want:
        raise ValidationError(f"parametrisation {param.name!r}: update(d, deltas) returned shape {out.shape}, "
                              f"expected {want} (the layer's rows x columns)")
    if not (np.issubdtype(out.dtype, np.floating) or np.issubdtype(out.dtype, np.integer)):
        raise ValidationError(f"parametrisation {param.name!r}: update(d, deltas) returned dtype {out.dtype}")
    return out.astype(np.float64, copy=False)


class Parametrisation(ABC):
    """A set of atoms (weight-space directions); see the module docstring for the layout.

    A registered parametrisation (:func:`register_parametrisation`) is also the entry that a
    ``mergeqp merge`` config names (``method.parametrisation``); it owns every rule of its kind:
    the statistics shape (:meth:`n_atoms`, :meth:`atom_names`), the design rule (:meth:`design`,
    :meth:`shared_hessian`, :meth:`gradient`: calibration statistics), the tangent rule
    (:meth:`tangents`: JVP-based checkpoint merging), the update rule (:meth:`update`), the config
    keys it reads (:attr:`config_options`, :meth:`check_config`), how it is built for one layer
    of a checkpoint merge (:meth:`for_site`, :meth:`planned_atoms`) and whether task arithmetic
    is one of its points (:attr:`contains_task_vectors`).
    """

    name: str = ""
    #: method-level config keys (besides ``parametrisation``) this parametrisation reads
    config_options: ClassVar[tuple[str, ...]] = ()
    #: whether task arithmetic is a point of the family, :meth:`task_vector_point` (the soup and task
    #: arithmetic are then reference points in the merge report, and ``reference: soup`` is the soup)
    contains_task_vectors: ClassVar[bool] = True

    @property
    def key(self) -> str:
        """Identifies the parametrisation among collected statistics."""
        return self.name

    @abstractmethod
    def n_atoms(self, r: int, m1: int) -> int:
        """Number of atoms per model for a layer with ``r`` outputs and ``m1`` augmented inputs."""

    @abstractmethod
    def atom_names(self, r: int, m1: int, has_bias: bool) -> tuple[str, ...]:
        """Names of the atoms (columns of ``d``)."""

    @abstractmethod
    def design(self, L: Any, R: Any, Z: Any, deltas: Any) -> Any:
        """Torch design tensor ``A`` (``(B, c, K, n_atoms)``) from ``L`` (``(B, c, T, r)``),
        ``R`` (``(B, K, T, r)``), ``Z`` (``(B, T, m1)``) and ``deltas`` (``(K, r, m1)``)."""

    @abstractmethod
    def update(self, d: np.ndarray, deltas: np.ndarray) -> np.ndarray:
        """Merged update ``sum_(k,a) d[k,a] B_(k,a)`` (``(r, m1)``) for ``d`` (``(K, n_atoms)``)."""

    @abstractmethod
    def shared_hessian(self, deltas: np.ndarray, gram: np.ndarray, G: np.ndarray) -> np.ndarray:
        """``H`` (``(n, n)``, factor 2 included) when one Jacobian ``L`` serves every sample and
        ``T = 1``: from ``gram = sum_j w_j z_j z_j'`` (``(m1, m1)``) and ``G = L'L`` (``(r, r)``).
        For ``rows`` this is ``2 (R'R) o (1_K 1_K' (x) L'L)`` with ``R'R = D gram D'``."""

    @abstractmethod
    def gradient(self, deltas: np.ndarray, cross: np.ndarray) -> np.ndarray:
        """``g`` (``(n,)``, factor 2 included) from ``cross = sum_(j,t) w_j (L_jt' b_j) z_jt'``
        (``(r, m1)``); exact for per-sample Jacobians and any number of positions."""

    def tangents(self, Z: Any, delta: Any) -> Any:
        """Layer-output perturbations of one model's atoms: ``(n_atoms, *Z.shape[:-1], r)`` (torch)
        from augmented layer inputs ``Z`` (``(..., m1)``) and that model's ``delta`` (``(r, m1)``):
        atom ``a`` maps the input ``z`` to ``B_a z``."""
        raise ValidationError(f"parametrisation {self.name!r} has no tangent rule (tangents) for checkpoint merging")

    # ------------------------------------------------------------------ registry-entry rules
    def check_config(self, options: Mapping[str, Any], given: Collection[str]) -> None:
        """Raise ``ValueError`` (its message is shown under ``method``) when the config's
        ``options`` (every key of :attr:`config_options` with its value; ``given``: the ones the
        file set) do not suit this parametrisation."""

    def planned_atoms(self, r: int, m1: int, options: Mapping[str, Any]) -> int:
        """Atoms per model at a layer of shape ``(r, m1)`` as the plan counts them (no weights loaded)."""
        return self.n_atoms(r, m1)

    def needs_output_jacobian(self, options: Mapping[str, Any]) -> bool:
        """Whether :meth:`for_site` needs the layer's output-Jacobian statistics (collected by the merge)."""
        return False

    def check_site(self, site: Any, options: Mapping[str, Any]) -> None:
        """Raise :class:`ValidationError` if the options do not fit merge layer ``site`` (checked
        before anything is computed at the layer)."""

    def for_site(self, site: Any, deltas: np.ndarray, options: Mapping[str, Any], *, seed: int = 0,
                 output_stats: Any = None) -> Parametrisation:
        """The parametrisation to use at one merge layer ``site`` (an object with ``name``, ``r``,
        ``m1``) with residuals ``deltas`` (``(K, r, m1)`` float64): ``self`` unless the atoms depend
        on the layer (a basis). In a checkpoint merge ``options`` also holds ``site_inputs``, a
        :class:`SiteInputs` (the layer's base and current weights, each read when asked), and, with
        ``method.baselines``, ``baseline_residuals``."""
        return self

    def describe(self, options: Mapping[str, Any]) -> str:
        """One phrase for the merge plan."""
        return self.name

    def task_vector_point(self, K: int, r: int, m1: int, lam: float = 1.0) -> np.ndarray:
        """The coefficients ``d`` (``(K, n_atoms)``) of task arithmetic with weight ``lam``, ``W_base +
        lam sum_k delta_k`` (``lam = 1/K``: the soup): every atom weight ``lam`` by default, which is
        exactly it where :attr:`contains_task_vectors` (a family with other atoms overrides this, e.g.
        ``rows+baselines``: rows ``lam``, baseline atoms 0), and for an orthonormal basis its
        projection onto the basis."""
        return np.full((int(K), int(self.n_atoms(r, m1))), float(lam))

    def reference_points(self, K: int) -> dict[str, np.ndarray]:
        """Named points ``d`` (``(K, n_atoms)``) of this family that a merge report evaluates
        beside the optimum (besides zero and the soup), e.g. the baselines of ``rows+baselines``."""
        return {}

    def solution_record(self, d: np.ndarray) -> dict[str, Any] | None:
        """What a merge report says of the solution ``d`` (``(K, n_atoms)``) at one layer beyond the
        common fields (e.g. how much of each baseline ``rows+baselines`` took), or ``None``."""
        return None

    def site_record(self, deltas: np.ndarray, output_stats: Any = None, *, seed: int = 0) -> dict[str, Any] | None:
        """What a merge report says of this site's parametrisation (``report.json``'s layer ``basis``
        entry for a basis), built from the site's ``deltas`` and, where :meth:`for_site` took them,
        its ``output_stats``; ``None`` (nothing) by default."""
        return None

    def report_markdown(self, layers: Sequence[Mapping[str, Any]]) -> list[str]:
        """Markdown sections of a merge's ``report.md`` for the fields this parametrisation adds to
        its ``layers`` records (``report.json``'s, e.g. :meth:`solution_record`'s); none by default."""
        return []

    def parameter_atoms(self, r: int, m1: int) -> np.ndarray | None:
        """For a layer of shape ``(r, m1)``, the atom that scales each parameter (an ``(r, m1)`` integer
        array) when every parameter ``p`` is moved by exactly one atom per model, ``a(p)``, by
        ``d[k, a(p)] delta_k[p]`` (a mask of the residual: rows, columns, scalar, blocks of them);
        ``None`` when atoms mix parameters (a basis). TIES-like sign consensus (``sign``) is built
        from it for any parametrisation that gives one."""
        return None

    def atom_combinations(self, K: int, r: int, m1: int) -> dict[int, np.ndarray] | None:
        """The atoms that are exact linear combinations of others: ``{t: m_t}`` with ``t`` an index
        ``k * n + a`` (``n = n_atoms``) and ``m_t`` (``(K n,)``, zero at every combined atom) the
        coefficients of the others whose design columns make atom ``t``'s; ``None`` (the default) where
        no atom is. The statistics are then made exact along the tie (:func:`tie_statistics`: ``H <-
        M'HM``, ``g <- M'g`` with ``M`` the identity whose columns ``t`` are ``m_t``). Computed
        separately, a tie holds only to the model's own rounding (float32 in transformers' RMSNorm even
        for a float64 model), and the QP's flat direction then has a slope."""
        return None

    @property
    def built_per_layer(self) -> bool:
        """Whether this is a registry entry whose atoms are built for each layer (:meth:`for_site`)
        and so cannot be used as it is."""
        return False

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name}

    def check(self, r: int, m1: int) -> None:
        """Raise if the parametrisation does not fit a layer of this shape."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ScalarParametrisation(Parametrisation):
    """One coefficient per model: ``B_k = delta_k`` (task arithmetic with learned lambdas)."""

    name = "scalar"

    def parameter_atoms(self, r: int, m1: int) -> np.ndarray:
        return np.zeros((r, m1), dtype=np.int64)

    def n_atoms(self, r: int, m1: int) -> int:
        return 1

    def atom_names(self, r: int, m1: int, has_bias: bool) -> tuple[str, ...]:
        return ("delta",)

    def design(self, L: Any, R: Any, Z: Any, deltas: Any) -> Any:
        import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

        return torch.einsum("bcti,bkti->bck", L, R).unsqueeze(-1)

    def update(self, d: np.ndarray, deltas: np.ndarray) -> np.ndarray:
        return np.einsum("k,kim->im", d[:, 0], deltas)

    def tangents(self, Z: Any, delta: Any) -> Any:
        return (Z @ delta.t()).unsqueeze(0)

    def shared_hessian(self, deltas: np.ndarray, gram: np.ndarray, G: np.ndarray) -> np.ndarray:
        # H[k,l] = 2 sum_j (delta_k z_j)' G (delta_l z_j) = 2 <delta_k gram, G delta_l>
        left = np.einsum("kim,mn->kin", deltas, gram)
        right = np.einsum("ij,ljn->lin", G, deltas)
        return 2.0 * np.einsum("kin,lin->kl", left, right)

    def gradient(self, deltas: np.ndarray, cross: np.ndarray) -> np.ndarray:
        return 2.0 * np.einsum("kim,im->k", deltas, cross)


class RowsParametrisation(Parametrisation):
    """The paper's diagonal mask: ``B_(k,i) = e_i e_i' delta_k`` (one weight per output row)."""

    name = "rows"

    def parameter_atoms(self, r: int, m1: int) -> np.ndarray:
        return np.repeat(np.arange(r, dtype=np.int64)[:, None], m1, axis=1)

    def n_atoms(self, r: int, m1: int) -> int:
        return r

    def atom_names(self, r: int, m1: int, has_bias: bool) -> tuple[str, ...]:
        return tuple(f"row{i}" for i in range(r))

    def design(self, L: Any, R: Any, Z: Any, deltas: Any) -> Any:
        import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

        return torch.einsum("bcti,bkti->bcki", L, R)

    def update(self, d: np.ndarray, deltas: np.ndarray) -> np.ndarray:
        return np.einsum("ki,kim->im", d, deltas)

    def tangents(self, Z: Any, delta: Any) -> Any:
        import torch  # optional heavy dependency: only checkpoint merging calls the tangent rule

        r = int(delta.shape[0])
        R = Z @ delta.t()  # (..., r)
        eye = torch.eye(r, dtype=Z.dtype, device=Z.device)  # (r, r)
        return R.unsqueeze(0) * eye.reshape(r, *([1] * (R.dim() - 1)), r)

    def shared_hessian(self, deltas: np.ndarray, gram: np.ndarray, G: np.ndarray) -> np.ndarray:
        K, r, m1 = deltas.shape
        flat = deltas.reshape(K * r, m1)
        return 2.0 * (flat @ gram @ flat.T) * np.tile(G, (K, K))

    def gradient(self, deltas: np.ndarray, cross: np.ndarray) -> np.ndarray:
        return 2.0 * np.einsum("kim,im->ki", deltas, cross).ravel()


class ColumnsParametrisation(Parametrisation):
    """Input-feature masks: ``B_(k,i) = delta_k e_i e_i'`` (the bias column is the last atom)."""

    name = "columns"

    def parameter_atoms(self, r: int, m1: int) -> np.ndarray:
        return np.repeat(np.arange(m1, dtype=np.int64)[None, :], r, axis=0)

    def n_atoms(self, r: int, m1: int) -> int:
        return m1

    def atom_names(self, r: int, m1: int, has_bias: bool) -> tuple[str, ...]:
        names = [f"col{i}" for i in range(m1)]
        if has_bias:
            names[-1] = "bias"
        return tuple(names)

    def design(self, L: Any, R: Any, Z: Any, deltas: Any) -> Any:
        import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

        # A[b,c,k,i] = sum_t Z[b,t,i] (L[b,:,t,:] @ delta_k[:, i])[c]; one position at a time
        # keeps the intermediate at (B, c, K, m1).
        A = None
        for t in range(L.shape[2]):
            LD = torch.einsum("bcr,krm->bckm", L[:, :, t, :], deltas)
            term = LD * Z[:, None, None, t, :]
            A = term if A is None else A + term
        return A

    def update(self, d: np.ndarray, deltas: np.ndarray) -> np.ndarray:
        return np.einsum("km,kim->im", d, deltas)

    def tangents(self, Z: Any, delta: Any) -> Any:
        # atom i: z_i * delta[:, i]
        r, m1 = (int(x) for x in delta.shape)
        return Z.movedim(-1, 0).unsqueeze(-1) * delta.t().reshape(m1, *([1] * (Z.dim() - 1)), r)

    def shared_hessian(self, deltas: np.ndarray, gram: np.ndarray, G: np.ndarray) -> np.ndarray:
        # H[(k,a),(l,b)] = 2 gram[a,b] * delta_k[:,a]' G delta_l[:,b]
        K, r, m1 = deltas.shape
        cols = deltas.transpose(0, 2, 1).reshape(K * m1, r)
        return 2.0 * (cols @ G @ cols.T) * np.tile(gram, (K, K))

    def gradient(self, deltas: np.ndarray, cross: np.ndarray) -> np.ndarray:
        return 2.0 * np.einsum("kim,im->km", deltas, cross).ravel()


class BasisParametrisation(Parametrisation):
    """General basis: ``B_(k,q) = q q' delta_k`` for the columns ``q`` of an orthonormal ``Q``."""

    name = "basis"
    config_options = ("basis", "rank", "basis_max_size")
    contains_task_vectors = False

    def __init__(self, basis: Basis | Any = None):
        """``basis``: a :class:`Basis` or an orthonormal ``(r, p)`` array; ``None`` only for the
        registry entry, which builds the basis of each merge layer (:meth:`for_site`)."""
        if basis is not None and not isinstance(basis, Basis):
            basis = Basis(basis)
        self._basis = basis

    @property
    def basis(self) -> Basis:
        if self._basis is None:
            raise ValidationError("parametrisation 'basis' needs a basis Q: pass a Basis or an orthonormal "
                                  "(r, p) array, or build one per layer with for_site")
        return self._basis

    @property
    def key(self) -> str:
        return self.basis.key

    @property
    def built_per_layer(self) -> bool:
        return self._basis is None

    # ------------------------------------------------------------------ registry-entry rules
    def check_config(self, options: Mapping[str, Any], given: Collection[str]) -> None:
        if options.get("rank") is None:
            raise ValueError("parametrisation: basis needs 'rank' (the number of basis directions p)")
        kind = options.get("basis", "svd")
        if kind not in BASES or BASES[kind].checkpoint_source is None:
            raise ValueError(f"basis {kind!r} is not available when merging checkpoints; valid: "
                             f"{', '.join(checkpoint_bases())}")
        if "basis_max_size" in given and BASES[kind].checkpoint_source != "output_jacobian":
            raise ValueError("'basis_max_size' applies only to parametrisation: basis with basis: optimal")

    def planned_atoms(self, r: int, m1: int, options: Mapping[str, Any]) -> int:
        rank = options.get("rank")
        return int(rank) if rank is not None else r

    def needs_output_jacobian(self, options: Mapping[str, Any]) -> bool:
        kind = options.get("basis")
        return kind in BASES and BASES[kind].checkpoint_source == "output_jacobian"

    def for_site(self, site: Any, deltas: np.ndarray, options: Mapping[str, Any], *, seed: int = 0,
                 output_stats: Any = None) -> Parametrisation:
        kind = options.get("basis")
        if kind not in BASES or BASES[kind].checkpoint_source is None:
            raise ValidationError(f"basis {kind!r} is not available when merging checkpoints; valid: "
                                  f"{', '.join(checkpoint_bases())}")
        p = self.site_rank(site, options)
        entry = BASES[kind]
        if entry.checkpoint_source == "output_jacobian":
            if output_stats is None:
                raise ValidationError(f"basis: {kind} at layer {site.name!r} needs its output-basis statistics")
            return BasisParametrisation(output_stats.basis(p, entry.build, seed=seed))
        return BasisParametrisation(entry.make(SiteResiduals(int(site.r), deltas), p, seed=seed))

    def check_site(self, site: Any, options: Mapping[str, Any]) -> None:
        self.site_rank(site, options)

    def site_record(self, deltas: np.ndarray, output_stats: Any = None, *, seed: int = 0) -> dict[str, Any] | None:
        """The basis's name and rank; for a basis built from output statistics (``basis: optimal``,
        Corollary 4.2, or a user's ``output_jacobian`` entry) also the pass's facts and the mean-Jacobian
        energy of this basis beside the optimal (for a user's), the SVD and a random basis of the same
        rank (``output_stats.energy_fraction``)."""
        basis = self.basis
        out: dict[str, Any] = {"name": basis.name, "rank": basis.p}
        if output_stats is None:
            return out
        info = dict(basis.info)
        holder = SiteResiduals(int(output_stats.r), np.asarray(deltas, dtype=np.float64))
        energy = {basis.name: output_stats.energy_fraction(basis.Q)}
        if basis.name != "optimal":  # a user's output_jacobian basis, beside the optimal one it competes with
            energy["optimal"] = output_stats.energy_fraction(output_stats.basis(basis.p).Q)
        energy |= {"svd": output_stats.energy_fraction(svd_basis(holder, basis.p).Q),
                  "random": output_stats.energy_fraction(random_basis(int(output_stats.r), basis.p, seed=seed).Q)}
        out.update({"jacobian": info.get("jacobian"), "rank_L": info.get("rank_L"),
                    "output_size": output_stats.c, "samples": output_stats.n_samples,
                    "seconds": output_stats.seconds, "jvp_chunk": output_stats.info.get("jvp_chunk"),
                    "captured_eigenvalues": info.get("captured_eigenvalues"), "mean_jacobian_energy": energy})
        if "note" in info:
            out["note"] = info["note"]
        return out

    @staticmethod
    def site_rank(site: Any, options: Mapping[str, Any]) -> int:
        """The basis rank ``p`` at ``site`` (``rank``, else ``r``), checked against ``[1, r]``."""
        rank = options.get("rank")
        p = int(rank) if rank is not None else int(site.r)
        if not 1 <= p <= site.r:
            raise ValidationError(f"basis rank {p} must be in [1, {site.r}] for layer {site.name!r}")
        return p

    def describe(self, options: Mapping[str, Any]) -> str:
        return f"{self.name} ({options.get('basis')}, rank {options.get('rank')})"

    def report_markdown(self, layers: Sequence[Mapping[str, Any]]) -> list[str]:
        """``report.md``'s table of each layer's basis (rank, energy fractions of the bases compared)."""
        with_basis = [r for r in layers if r.get("basis")]
        if not with_basis:
            return []
        lines = ["## Bases", "",
                 ("Energy fractions: `per-sample` = the QP's own (the table above); `mean-Jacobian` = "
                  "tr(S P_LQ)/tr(S) with the calibration-mean Jacobian summed over positions, the quantity "
                  "the optimal basis maximises, for the optimal, SVD and random bases of the same rank."), "",
                 "| layer | basis | p | rank L | per-sample | mean-Jacobian optimal | svd | random |",
                 "|---|---|---|---|---|---|---|---|"]
        for r in with_basis:
            b = r["basis"]
            mj = b.get("mean_jacobian_energy") or {}
            lines.append(f"| `{r['layer']}` | {b.get('name')} | {b.get('rank')} | {format_number(b.get('rank_L'))} | "
                         f"{format_number(r['energy_fraction'], 4)} | {format_number(mj.get('optimal'), 4)} | "
                         f"{format_number(mj.get('svd'), 4)} | {format_number(mj.get('random'), 4)} |")
        return ["\n".join(lines)]

    def n_atoms(self, r: int, m1: int) -> int:
        return self.basis.p

    def atom_names(self, r: int, m1: int, has_bias: bool) -> tuple[str, ...]:
        return tuple(f"{self.basis.name}{i}" for i in range(self.basis.p))

    def check(self, r: int, m1: int) -> None:
        if self.basis.r != r:
            raise ValidationError(
                f"basis Q has {self.basis.r} rows but the merge layer has r = {r} outputs"
            )

    def design(self, L: Any, R: Any, Z: Any, deltas: Any) -> Any:
        import torch  # optional heavy dependency, imported on first use (importing mergeqp stays light)

        Q = torch.tensor(np.array(self.basis.Q), dtype=L.dtype, device=L.device)
        LQ = torch.einsum("bctr,rp->bctp", L, Q)
        alpha = torch.einsum("bktr,rp->bktp", R, Q)
        return torch.einsum("bctp,bktp->bckp", LQ, alpha)

    def tangents(self, Z: Any, delta: Any) -> Any:
        import torch  # optional heavy dependency: only checkpoint merging calls the tangent rule

        Q = torch.as_tensor(np.array(self.basis.Q), dtype=Z.dtype, device=Z.device)  # (r, p)
        R = Z @ delta.t()  # (..., r)
        alpha = R @ Q  # (..., p)
        return alpha.movedim(-1, 0).unsqueeze(-1) * Q.t().reshape(Q.shape[1], *([1] * (R.dim() - 1)), Q.shape[0])

    def update(self, d: np.ndarray, deltas: np.ndarray) -> np.ndarray:
        Q = self.basis.Q
        # sum_k Q diag(d_k) Q' delta_k
        proj = np.einsum("rp,krm->kpm", Q, deltas)
        return np.einsum("rp,kp,kpm->rm", Q, d, proj)

    def shared_hessian(self, deltas: np.ndarray, gram: np.ndarray, G: np.ndarray) -> np.ndarray:
        Q = self.basis.Q
        K, _, m1 = deltas.shape
        flat = np.einsum("rp,krm->kpm", Q, deltas).reshape(K * Q.shape[1], m1)
        return 2.0 * (flat @ gram @ flat.T) * np.tile(Q.T @ G @ Q, (K, K))

    def gradient(self, deltas: np.ndarray, cross: np.ndarray) -> np.ndarray:
        Q = self.basis.Q
        proj = np.einsum("rp,krm->kpm", Q, deltas)
        return 2.0 * np.einsum("kpm,pm->kp", proj, Q.T @ cross).ravel()

    def to_json(self) -> dict[str, Any]:
        return {"name": "basis", "basis": self.basis.name, "p": self.basis.p, "key": self.key,
                "info": dict(self.basis.info)}

    def __repr__(self) -> str:
        if self._basis is None:
            return "BasisParametrisation(<built per layer>)"
        return f"BasisParametrisation({self.basis.name}, r={self.basis.r}, p={self.basis.p})"


@dataclass(frozen=True)
class SiteInputs:
    """What a checkpoint merge gives :meth:`Parametrisation.for_site` at one layer besides its
    residuals (``options["site_inputs"]``): ``base_weight()``, the layer's weight in the base
    checkpoint (read on the first call, then kept), and ``current_weight()``, the live model's weight
    at the layer when the parametrisation is built (read then, so that a later call gives the same
    tensor whatever the model holds by then): the base's in ``single``, ``sequential`` and ``joint``
    modes (the layer is not merged yet), the start's in ``hybrid`` and ``trust_region`` (whose atoms
    are built once, at the start). Both augmented with the bias column, ``(r, m1)`` float64 CPU
    tensors."""

    base_weight: Callable[[], Any]
    current_weight: Callable[[], Any]

    @classmethod
    def at(cls, base_weight: Callable[[], Any], current_weight: Any) -> SiteInputs:
        """Inputs of a layer whose live weight is ``current_weight`` now and whose base weight is read
        by ``base_weight()`` once, when first asked."""
        return cls(functools.cache(base_weight), lambda: current_weight)


#: keys of ``for_site``'s options that the merge fills (a parametrisation's own ``config_options`` may not use them)
SITE_OPTION_KEYS = ("site_inputs", "baseline_residuals")


PARAMETRISATIONS: dict[str, Parametrisation] = {}


def register_parametrisation(param: Parametrisation) -> Parametrisation:
    """Add a named parametrisation (explicit registration; names must be unique). Once
    registered, ``method.parametrisation: NAME`` selects it in a ``mergeqp merge`` config."""
    if not isinstance(param, Parametrisation):
        raise ValidationError(f"register_parametrisation expects a Parametrisation instance, got {type(param).__name__}")
    check_new_name("parametrisation", param.name, PARAMETRISATIONS)
    clash = [k for k in getattr(param, "config_options", ()) if k in SITE_OPTION_KEYS]
    if clash:
        raise ValidationError(f"parametrisation {param.name!r}: config_options {clash} are keys the merge fills in "
                              f"for_site's options ({', '.join(SITE_OPTION_KEYS)}); choose other names")
    if param.name in BASES:  # ("svd:4" is basis svd; a parametrisation "svd" would be read as it too)
        raise ValidationError(f"parametrisation name {param.name!r} is a basis name (a config's basis: {param.name}); "
                              f"choose another name")
    PARAMETRISATIONS[param.name] = param
    PARAMETRISATION_NAMES.add(param.name)
    return param


def tie_statistics(H: np.ndarray, g: np.ndarray, columns: Mapping[int, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``(M'HM, M'g)`` for ``M`` the identity whose columns ``t`` are ``columns[t]`` (zero at every
    ``t``; :meth:`Parametrisation.atom_combinations`), ``H`` ``(..., n, n)`` and ``g`` ``(..., n)`` with
    a leading axis of tasks allowed: the combined atoms' rows and columns replaced, ``O(len(columns)
    n^2)`` (a dense ``M`` cost ``n^3`` per task, and its ``n x n`` memory)."""
    H = np.array(H, dtype=np.float64, copy=True)
    g = np.array(g, dtype=np.float64, copy=True)
    tied = list(columns)
    if not tied:
        return H, g
    C = np.stack([np.asarray(columns[t], dtype=np.float64) for t in tied], axis=1)  # (n, T)
    HC = H @ C  # (..., n, T): the combined columns of H M (rows of the combined atoms not yet replaced)
    idx = np.asarray(tied)
    H[..., :, idx] = HC
    H[..., idx, :] = np.swapaxes(HC, -1, -2)
    block = C.T @ HC  # (..., T, T)
    H[..., idx[:, None], idx[None, :]] = 0.5 * (block + np.swapaxes(block, -1, -2))
    g[..., idx] = g @ C
    return H, g


def get_parametrisation(name: str) -> Parametrisation:
    """The registered parametrisation ``name`` (an unknown name lists the valid ones)."""
    return lookup("parametrisation", name, PARAMETRISATIONS)


def _needs_layer(param: Parametrisation) -> bool:
    return param.built_per_layer


register_parametrisation(ScalarParametrisation())
register_parametrisation(RowsParametrisation())
register_parametrisation(ColumnsParametrisation())
register_parametrisation(BasisParametrisation())


def as_parametrisation(spec: Any) -> Parametrisation:
    """Resolve ``"rows" | "scalar" | "columns"``, a :class:`Basis`, an orthonormal ``(r, p)``
    array or a :class:`Parametrisation` instance. Basis *names* (``"optimal:8"``) need the
    statistics: use :meth:`CalibrationStats.parametrisation` for those."""
    if isinstance(spec, Parametrisation):
        return spec
    if isinstance(spec, Basis):
        return BasisParametrisation(spec)
    if isinstance(spec, np.ndarray) or (hasattr(spec, "shape") and hasattr(spec, "dtype")):
        return BasisParametrisation(Basis(np.asarray(spec)))
    if isinstance(spec, str):
        if spec in PARAMETRISATIONS and not _needs_layer(PARAMETRISATIONS[spec]):
            return PARAMETRISATIONS[spec]
        if spec in PARAMETRISATIONS and not isinstance(PARAMETRISATIONS[spec], BasisParametrisation):
            raise ValidationError(
                f"the parametrisation {spec!r} is built for each layer: construct it with its atoms "
                f"(e.g. {type(PARAMETRISATIONS[spec]).__name__}(...)) and pass the instance"
            )
        if ":" in spec or spec in PARAMETRISATIONS:
            raise ValidationError(
                f"the basis spec {spec!r} needs calibration statistics: build it with "
                f"stats.parametrisation({spec!r}) or make_basis(...) and pass the Basis"
            )
        raise unknown("parametrisation", spec, [*_named(), "<basis>:<p>"])
    raise ValidationError(
        f"parametrisation must be a name ({', '.join(_named())}), a Basis or an "
        f"orthonormal (r, p) array, got {type(spec).__name__}"
    )


def solution_point(d: Any, parametrisation: Any,
                   resolve: Callable[[Any], Parametrisation] = as_parametrisation,
                   layer: str | None = None) -> tuple[Any, Parametrisation]:
    """``d``'s coefficients and the parametrisation to read them with.

    ``d``: coefficients (an array; ``parametrisation`` ``None`` means ``rows``), or a
    :class:`~mergeqp.solution.Solution`, which records its QP's parametrisation: used when
    ``parametrisation`` is ``None``, and a different one given is an error (a columns solution
    read as rows has the right shape whenever a layer has as many rows as inputs, and would merge
    the wrong atoms without a word). ``resolve`` turns a spec into a :class:`Parametrisation`.
    ``layer``: where the coefficients are applied; a Solution whose QP records another layer is
    an error (two layers of one shape would take each other's merge silently)."""
    if isinstance(d, Solution) and d.layer is not None and layer is not None \
            and _layer_name(d.layer) != _layer_name(layer):
        raise ValidationError(f"this solution's QP was built for layer {d.layer!r}, not {layer!r}: its coefficients "
                              f"weigh that layer's residuals (apply it to {d.layer!r}, or pass d.d to apply the "
                              f"coefficients anyway)")
    recorded = d.parametrisation if isinstance(d, Solution) else None
    coefficients = d.d if isinstance(d, Solution) else d
    if recorded is None:
        return coefficients, resolve("rows" if parametrisation is None else parametrisation)
    key = str(recorded.get("key", recorded["name"]))
    if parametrisation is None:
        named = recorded["name"] in PARAMETRISATIONS and not _needs_layer(PARAMETRISATIONS[recorded["name"]])
        if not named or key != recorded["name"]:
            raise ValidationError(
                f"this solution's QP was posed in the parametrisation {key!r}, which cannot be rebuilt from its "
                f"name: pass the one the problem was built with (parametrisation=...)")
        parametrisation = recorded["name"]
    param = resolve(parametrisation)
    if param.key != key:
        raise ValidationError(
            f"this solution's QP was posed in the parametrisation {key!r}, but {param.key!r} was given to apply "
            f"it: its coefficients would be read as other atoms (pass the solution without parametrisation=, or "
            f"the parametrisation its problem was built with)")
    return coefficients, param


def _layer_name(name: str) -> str:
    """A layer's module name (``model.layers.0.mlp`` and ``model.layers.0.mlp.weight`` alike)."""
    return name[: -len(".weight")] if name.endswith(".weight") else name


def named_parametrisations() -> list[str]:
    """The registered parametrisations that a name alone builds (``rows``, ``scalar``, ``columns``,
    and users' own without layer data)."""
    return _named()


def _named() -> list[str]:
    """Registered names usable without a layer (every one but the per-layer ``basis`` entry)."""
    return [n for n, p in PARAMETRISATIONS.items() if not _needs_layer(p)]


def check_d(d: Any, K: int, n_atoms: int, param: Parametrisation) -> np.ndarray:
    """Validate a decision ``d`` (``(K, n_atoms)`` or flat) and return it as ``(K, n_atoms)``."""
    d = np.asarray(d, dtype=np.float64)
    if d.shape == (K * n_atoms,):
        d = d.reshape(K, n_atoms)
    if d.shape != (K, n_atoms):
        raise ValidationError(
            f"d must have shape ({K}, {n_atoms}) (models x atoms of the {param.name} "
            f"parametrisation) or ({K * n_atoms},), got {d.shape}"
        )
    if not np.all(np.isfinite(d)):
        raise ValidationError("d contains NaN or inf")
    return d
