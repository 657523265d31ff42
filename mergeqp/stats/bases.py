"""Bases of the merge layer's output space (``Q``, ``(r, p)``, orthonormal), in a registry.

- ``standard``: ``p`` coordinate vectors ``e_i`` (diagonal masking restricted to p rows): the
  rows whose single direction captures the most energy, ``(L e_i)' S (L e_i) / ||L e_i||^2``
  (``select="energy"``, default), or the first p (``select="index"``);
- ``svd``: the top-p left singular vectors of the stacked residual updates
  ``[delta_1 ... delta_K]`` (``(r, K m1)``);
- ``random``: a seeded Haar-random orthonormal ``Q`` (QR of a Gaussian matrix);
- ``optimal`` (the paper's Corollary 4.2): the ``Q`` whose output span ``span{L q}`` is the
  top-p eigenspace ``U_p`` of ``S`` restricted to ``range(L)`` (eigenvectors of ``P_L S P_L``),
  ``Q = orth(L^+ U_p)``; by Ky Fan it maximises ``tr(S P)`` over all ``p``-dimensional bases.
  (The top eigenvectors of the back-projected ``L' S L`` are *not* optimal.) ``L`` is the shared
  Jacobian, or the calibration-mean Jacobian when ``L_j`` varies (recorded in ``info``); with
  ``T > 1`` positions, the mean Jacobian summed over positions (the response to the same
  perturbation at every position), an approximation also recorded.

When fewer than ``p`` useful directions exist (``rank(L) < p``, or rank of the updates
``< p``), the remaining columns complete ``Q`` orthonormally; they add no captured energy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ..errors import (
    MergeQPError,
    ValidationError,
    check_callable,
    check_new_name,
    check_signature,
    first_line,
    lookup,
    unknown,
)
from .basis import Basis

BasisBuilder = Callable[..., Basis]

#: what a checkpoint merge (``mergeqp merge``) builds a basis from at one layer: ``"deltas"``
#: (the layer's residuals: the builder gets an object with ``r`` and ``deltas`` ``(K, r, m1)``),
#: ``"output_jacobian"`` (the calibration-mean output Jacobian of the layer, collected by the
#: merge at the linearisation point), or ``None`` (needs full calibration statistics: Python only)
CheckpointSource = Literal["deltas", "output_jacobian"] | None


@dataclass(frozen=True)
class BasisEntry:
    """A registered basis kind.

    ``build(stats, p, *, seed, task_weights) -> Basis`` builds ``p`` directions from
    :class:`~mergeqp.stats.CalibrationStats` (or any object with the attributes it reads);
    ``checkpoint_source`` says whether and from what a checkpoint merge can build it (see
    :data:`CheckpointSource`). Calling the entry calls ``build``."""

    name: str
    build: BasisBuilder
    checkpoint_source: CheckpointSource = None
    description: str = ""
    #: the builder's ``seed`` changes the basis (``random``): sweeps vary it over their seeds
    seeded: bool = False

    def __call__(self, stats: Any, p: int, **kwargs: Any) -> Basis:
        return self.make(stats, p, **kwargs)

    def make(self, stats: Any, p: int, **kwargs: Any) -> Basis:
        """``build(stats, p, **kwargs)`` checked by :func:`checked_build` (a user's builder that returned
        more directions than asked was taken silently, stop 74)."""
        return checked_build(self.build, stats, p, f"basis {self.name!r} (p = {p}): its builder", **kwargs)


def checked_build(build: BasisBuilder, stats: Any, p: int, where: str, *, attribute_hint: str = "",
                  **kwargs: Any) -> Basis:
    """``build(stats, p, **kwargs)``: an exception inside the builder is one line naming ``where`` (an
    ``AttributeError`` followed by ``attribute_hint``, what the builder may read, where given), and the
    result must be a :class:`Basis` of ``p`` directions in ``stats.r`` outputs. Shared by
    :meth:`BasisEntry.make` and the merge's output-Jacobian bases
    (:meth:`mergeqp.merge.outputbasis.OutputBasisStats.basis`)."""
    try:
        made = build(stats, p, **kwargs)
    except AttributeError as exc:
        if not attribute_hint:
            raise ValidationError(f"{where} failed: {type(exc).__name__}: {first_line(exc)}") from exc
        raise ValidationError(f"{where}: {exc}; {attribute_hint}") from None
    except MergeQPError as exc:  # (a Basis it built that is not orthonormal, or not finite)
        raise ValidationError(f"{where}: {exc}") from None
    except (OSError, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - a user's builder: named, one line
        raise ValidationError(f"{where} failed: {type(exc).__name__}: {first_line(exc)}") from exc
    r = getattr(stats, "r", None)
    if not isinstance(made, Basis) or made.Q.shape[1] != p or (r is not None and made.Q.shape[0] != int(r)):
        got = f"a Basis of shape {made.Q.shape}" if isinstance(made, Basis) else type(made).__name__
        raise ValidationError(f"{where} returned {got}, not a Basis of shape ({'r' if r is None else int(r)}, {p})")
    return made


@dataclass(frozen=True)
class SiteResiduals:
    """What a ``"deltas"`` basis builder reads at one merge layer: ``r`` (outputs) and ``deltas``
    (``(K, r, m1)`` float64 residuals ``W_k - W_base``, bias column included)."""

    r: int
    deltas: np.ndarray


BASES: dict[str, BasisEntry] = {}
#: the registered parametrisations' names, which no basis may take (filled by
#: :func:`mergeqp.stats.parametrisation.register_parametrisation`, which imports this module)
PARAMETRISATION_NAMES: set[str] = set()


def register_basis(name: str, builder: BasisBuilder, *, checkpoint_source: CheckpointSource = None,
                   description: str = "", seeded: bool = False) -> BasisEntry:
    """Register ``builder(stats, p, *, seed, task_weights) -> Basis`` under ``name``;
    ``checkpoint_source`` (``"deltas"`` / ``"output_jacobian"``) makes it usable as
    ``basis: NAME`` in a ``mergeqp merge`` config; ``seeded``: its ``seed`` changes the basis
    (``mergeqp sweep --seeds`` varies it, as for ``random``)."""
    check_new_name("basis", name, BASES)
    if name in PARAMETRISATION_NAMES:  # ("rows:2" would then be read as this basis)
        raise ValidationError(f"basis name {name!r} is a parametrisation name (a config's parametrisation: {name}); "
                              f"choose another name")
    check_callable("basis", name, "the builder (stats, p, *, seed, task_weights) -> Basis", builder)
    check_signature("basis", name, "the builder (stats, p, *, seed, task_weights) -> Basis", builder,
                    (None, 1), {"seed": 0, "task_weights": None})
    if checkpoint_source not in (None, "deltas", "output_jacobian"):
        raise ValidationError(f"basis {name!r}: checkpoint_source must be 'deltas', 'output_jacobian' or None, "
                              f"got {checkpoint_source!r}")
    entry = BasisEntry(name, builder, checkpoint_source, description or (builder.__doc__ or "").split("\n")[0],
                       seeded=bool(seeded))
    BASES[name] = entry
    return entry


def get_basis(name: str) -> BasisEntry:
    """The registered basis ``name`` (an unknown name lists the valid ones)."""
    return lookup("basis name", name, BASES)


def checkpoint_bases() -> list[str]:
    """Names of the bases a checkpoint merge can build (``checkpoint_source`` set)."""
    return [n for n, e in BASES.items() if e.checkpoint_source is not None]


def make_basis(name: str, stats: Any, p: int, *, seed: int = 0, task_weights: Any = None) -> Basis:
    """Build the registered basis ``name`` with ``p`` directions from ``stats``."""
    entry = get_basis(name)
    _check_p(p, stats.r)
    return entry.make(stats, p, seed=seed, task_weights=task_weights)


def parse_basis_spec(spec: str, stats: Any, *, seed: int = 0, task_weights: Any = None) -> Basis:
    """``"NAME:P"`` or ``"NAME:P:SEED"`` -> :func:`make_basis`."""
    parts = spec.split(":")
    if len(parts) not in (2, 3):
        raise ValidationError(f"basis spec must be NAME:P or NAME:P:SEED, got {spec!r}")
    try:
        p = int(parts[1])
        if len(parts) == 3:
            seed = int(parts[2])
    except ValueError:
        raise ValidationError(f"basis spec {spec!r}: P and SEED must be integers") from None
    return make_basis(parts[0], stats, p, seed=seed, task_weights=task_weights)


def _check_p(p: int, r: int) -> None:
    if not isinstance(p, (int, np.integer)) or isinstance(p, bool) or not 1 <= int(p) <= r:
        raise ValidationError(f"basis dimension p must be an integer in [1, r = {r}], got {p!r}")


def complete_basis(Q1: np.ndarray, r: int, p: int) -> np.ndarray:
    """Extend orthonormal columns ``Q1`` (``(r, k)``, k <= p) to ``p`` orthonormal columns (``(r, p)``)."""
    k = Q1.shape[1]
    if k >= p:
        return Q1[:, :p]
    full, _ = np.linalg.qr(np.concatenate([Q1, np.eye(r)], axis=1))
    # the first k columns of `full` span Q1; the next ones are an orthonormal complement
    comp = full[:, k:p]
    return np.concatenate([Q1, comp], axis=1)


def downstream_jacobian(stats: Any, task_weights: Any = None) -> tuple[np.ndarray, str]:
    """The ``(c, r)`` Jacobian the optimal basis uses, and a description of it."""
    L = stats.mean_jacobian(task_weights)  # (c, T, r)
    if L.shape[1] == 1:
        how = "shared" if stats.jacobian_shared else "calibration-mean"
        return L[:, 0, :], how
    return L.sum(axis=1), f"calibration-mean summed over {L.shape[1]} positions"


def optimal_basis_from(L: np.ndarray, S: np.ndarray, p: int, rtol: float = 1e-10) -> tuple[np.ndarray, dict[str, Any]]:
    """``Q = orth(L^+ U_p)`` (``(r, p)``) for a Jacobian ``L`` (``(c, r)``) and ``S`` (``(c, c)``).

    ``U_p``: the top-p eigenvectors of ``S`` restricted to ``range(L)`` (``U' S U`` with ``U`` an
    orthonormal basis of ``range(L)``). Returns ``Q`` and info (eigenvalues, rank of L).
    """
    L = np.asarray(L, dtype=np.float64)
    S = np.asarray(S, dtype=np.float64)
    r = L.shape[1]
    _check_p(p, r)
    U, s, Vt = np.linalg.svd(L, full_matrices=False)
    rank = int(np.sum(s > rtol * s[0])) if s.size and s[0] > 0 else 0
    info: dict[str, Any] = {"rank_L": rank}
    if rank == 0:
        info["captured_eigenvalues"] = []
        return complete_basis(np.zeros((r, 0)), r, p), info
    U, s, V = U[:, :rank], s[:rank], Vt[:rank].T
    evals, E = np.linalg.eigh(U.T @ S @ U)
    order = np.argsort(evals)[::-1][: min(p, rank)]
    Up_coords = E[:, order]
    X = V @ (Up_coords / s[:, None])  # L^+ U_p, (r, k)
    Q1, R = np.linalg.qr(X)
    Q1 = Q1 * np.sign(np.where(np.diag(R) == 0, 1.0, np.diag(R)))
    info["captured_eigenvalues"] = [float(v) for v in evals[order]]
    return complete_basis(Q1, r, p), info


def optimal_basis(stats: Any, p: int, *, task_weights: Any = None, seed: int = 0) -> Basis:
    """The optimal basis of Corollary 4.2 for these statistics (see module docstring)."""
    _check_p(p, stats.r)
    L, how = downstream_jacobian(stats, task_weights)
    Q, info = optimal_basis_from(L, stats.S(task_weights), p)
    info["jacobian"] = how
    if how != "shared":
        info["note"] = ("the Jacobian varies between samples: Q is optimal for the mean Jacobian; "
                        "no closed form exists for the per-sample problem")
    return Basis(Q, name="optimal", info=info)


def standard_basis(stats: Any, p: int, *, task_weights: Any = None, seed: int = 0,
                   select: str = "energy") -> Basis:
    """``p`` coordinate vectors; ``select="energy"`` ranks rows by single-direction energy."""
    _check_p(p, stats.r)
    r = stats.r
    if p == r or select == "index":
        idx = np.arange(p)
    elif select == "energy":
        L, _ = downstream_jacobian(stats, task_weights)
        S = stats.S(task_weights)
        norms = np.einsum("ci,ci->i", L, L)
        energy = np.einsum("ci,cd,di->i", L, S, L) / np.where(norms > 0, norms, 1.0)
        energy = np.where(norms > 0, energy, 0.0)
        idx = np.sort(np.argsort(-energy, kind="stable")[:p])
    else:
        raise unknown("standard-basis selection", select, ["energy", "index"])
    return Basis(np.eye(r)[:, idx], name="standard", info={"rows": idx.tolist(), "select": select})


def svd_basis(stats: Any, p: int, *, task_weights: Any = None, seed: int = 0) -> Basis:
    """Top-p left singular vectors of ``[delta_1 ... delta_K]`` (``(r, K m1)``)."""
    _check_p(p, stats.r)
    stacked = np.concatenate(list(np.asarray(stats.deltas, dtype=np.float64)), axis=1)
    U, s, _ = np.linalg.svd(stacked, full_matrices=False)
    rank = int(np.sum(s > 1e-12 * s[0])) if s.size and s[0] > 0 else 0
    Q = complete_basis(U[:, : min(p, rank)], stats.r, p)
    return Basis(Q, name="svd", info={"singular_values": [float(v) for v in s[: min(p, rank)]]})


def random_basis(stats: Any, p: int, *, task_weights: Any = None, seed: int = 0) -> Basis:
    """A Haar-random orthonormal ``(r, p)`` basis from ``numpy.random.default_rng(seed)``."""
    r = stats if isinstance(stats, (int, np.integer)) else stats.r
    _check_p(p, int(r))
    G = np.random.default_rng(seed).standard_normal((int(r), p))
    Q, R = np.linalg.qr(G)
    Q = Q * np.sign(np.where(np.diag(R) == 0, 1.0, np.diag(R)))
    return Basis(Q, name="random", info={"seed": int(seed)})


register_basis("standard", standard_basis)
register_basis("svd", svd_basis, checkpoint_source="deltas")
register_basis("random", random_basis, checkpoint_source="deltas", seeded=True)
register_basis("optimal", optimal_basis, checkpoint_source="output_jacobian")
