"""Reference merge QPs: synthetic diagonal merge problems built as in the paper, and the
committed instances under ``problems/`` with their certified optima.

The synthetic construction follows Section 3 of the paper. For calibration sample ``j`` and
model ``k`` the hidden-layer residual activation is ``r_kj = delta_k z_j`` (``(r,)``, with
``z_j = Z x_j`` the layer input), the merged output error is

    e_j(d) = L (sum_k d_k o r_kj) + b_j,       b_j = h(x_j; theta) - y_j   (``(c,)``)

with ``L`` the ``(c, r)`` downstream map, and ``J(d) = sum_j ||e_j(d)||^2``. The target ``y_j``
is the output of the fine-tuned model of the task sample ``j`` belongs to (``t_j = j mod K``)
plus Gaussian noise, so ``b_j = -L r_{t_j j} - noise_j``: the tasks conflict, and the
unconstrained optimum leaves the box ``[0, 1]``.

The Hessian is formed from its structure, never from the stacked ``A_j``:
``H = 2 (R'R) o (1 1' (x) L'L)`` where ``R = [R_1 ... R_K]`` is ``(N, K r)`` (row ``j`` of
``R_k`` is ``r_kj``), ``g_k = 2 sum_j r_kj o (L' b_j)`` and ``c = sum_j ||b_j||^2``.

Instances are named (:data:`REFERENCE_SPECS`); small ones are committed as ``.npz`` under
``problems/`` with a JSON of certified optima per constraint set, larger ones are generated
deterministically on demand and cached under ``problems/generated/`` (git-ignored).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..constraints import ConstraintSet, as_constraint_set, parse_constraint
from ..errors import InfeasibleError, MergeQPError, ValidationError, lookup
from ..io.atomic import save_npy_atomic, write_json_atomic
from ..problem import MergeQP
from .registry import solve


@dataclass(frozen=True)
class SyntheticFactors:
    """The pieces behind a synthetic merge QP (for tests that rebuild H naively).

    ``R``: ``(K, N, r)`` residual activations ``r_kj``; ``L``: ``(c, r)`` downstream map;
    ``B``: ``(N, c)`` output offsets ``b_j``; ``task``: ``(N,)`` task of each sample.
    """

    R: np.ndarray
    L: np.ndarray
    B: np.ndarray
    task: np.ndarray


def synthetic_factors(K: int, r: int, c: int, N: int, *, m: int | None = None, noise: float = 0.5,
                      seed: int = 0, dead_rows: float = 0.0, duplicate_last: bool = False) -> SyntheticFactors:
    """Draw residual activations, a downstream map and targets as in the paper's setting.

    ``K`` models, ``r`` rows of the merged layer (atoms), ``c`` outputs, ``N`` calibration
    samples, ``m`` the layer's input width (default ``min(r, 256)``). Residuals
    ``delta_k = (shared + own_k)`` with decaying singular values, per-row magnitudes drawn
    log-normal (some rows of a residual matter much more than others), inputs ``z_j`` with a
    decaying spectrum. ``noise`` is the target noise relative to the RMS task output.

    Singular Hessians arise as in practice: ``dead_rows`` (a fraction of rows whose residual
    is zero in every model: zero rows and columns of H) and ``duplicate_last`` (the last model
    is a copy of the first: H is singular along ``d_0 - d_{K-1}``).
    """
    for name, v in (("K", K), ("r", r), ("c", c), ("N", N)):
        if int(v) < 1:
            raise ValidationError(f"synthetic problem: {name} must be >= 1, got {v}")
    rng = np.random.default_rng(seed)
    m = int(m or min(r, 256))
    q = max(1, min(m, r) // 2)  # rank of each residual
    spectrum = 1.0 / np.sqrt(1.0 + np.arange(q))
    shared_u = rng.standard_normal((r, q))
    shared_v = rng.standard_normal((m, q))
    z_scale = 1.0 / (1.0 + np.arange(m) / (0.25 * m))
    Z = rng.standard_normal((N, m)) * z_scale  # layer inputs z_j, (N, m)
    R = np.empty((K, N, r))
    for k in range(K):
        u = 0.5 * shared_u + rng.standard_normal((r, q))
        v = 0.5 * shared_v + rng.standard_normal((m, q))
        row_mag = np.exp(0.75 * rng.standard_normal(r))
        delta = (u * spectrum) @ v.T * row_mag[:, None] / np.sqrt(q * m)  # (r, m)
        R[k] = Z @ delta.T
    if duplicate_last and K > 1:
        R[K - 1] = R[0]
    if dead_rows > 0:
        dead = rng.permutation(r)[: round(dead_rows * r)]
        R[:, :, dead] = 0.0
    col_mag = np.exp(0.5 * rng.standard_normal(r))
    L = rng.standard_normal((c, r)) * col_mag / np.sqrt(r)
    task = np.arange(N) % K
    clean = np.einsum("cr,nr->nc", L, R[task, np.arange(N)])  # L r_{t_j j}, (N, c)
    rms = float(np.sqrt(np.mean(clean**2))) or 1.0
    B = -(clean + noise * rms * rng.standard_normal((N, c)))
    return SyntheticFactors(R=R, L=L, B=B, task=task)


def merge_qp_from_factors(f: SyntheticFactors, **kwargs: Any) -> MergeQP:
    """Form ``H = 2 (R'R) o (1 1' (x) L'L)``, ``g``, ``c`` from the factors (structure, not
    the stacked ``A_j``: ``O(N n^2)`` flops and one ``n x n`` array)."""
    K, N, r = f.R.shape
    n = K * r
    Rflat = np.ascontiguousarray(np.transpose(f.R, (1, 0, 2)).reshape(N, n))  # row j = [r_1j .. r_Kj]
    H = Rflat.T @ Rflat  # (n, n), symmetric (syrk)
    M = f.L.T @ f.L  # (r, r)
    for k in range(K):
        for l in range(K):
            H[k * r:(k + 1) * r, l * r:(l + 1) * r] *= M
    H *= 2.0
    LtB = f.B @ f.L  # (N, r): row j = L' b_j
    g = 2.0 * np.einsum("knr,nr->kr", f.R, LtB).ravel()
    c = float(np.sum(f.B**2))
    return MergeQP(H, g, c, shape=(K, r), **kwargs)


def synthetic_merge_qp(K: int, r: int, c: int, N: int, *, m: int | None = None, noise: float = 0.5,
                       seed: int = 0, dead_rows: float = 0.0, duplicate_last: bool = False,
                       name: str = "synthetic") -> MergeQP:
    """A synthetic diagonal merge QP (see the module docstring); ``d`` has shape ``(K, r)``."""
    f = synthetic_factors(K, r, c, N, m=m, noise=noise, seed=seed, dead_rows=dead_rows,
                          duplicate_last=duplicate_last)
    meta = {"name": name, "generator": "mergeqp.solvers.reference_problems.synthetic_merge_qp",
            "K": K, "r": r, "c": c, "N": N, "m": m or min(r, 256), "noise": noise, "seed": seed,
            "dead_rows": dead_rows, "duplicate_last": duplicate_last}
    return merge_qp_from_factors(f, model_names=[f"task{k}" for k in range(K)], metadata=meta)


# ---------------------------------------------------------------------- named instances
@dataclass(frozen=True)
class ReferenceSpec:
    """A named reference instance. ``constraints``: constraint specs (``" & "`` joins an
    intersection) whose certified optima are stored; ``infeasible``: specs that must raise
    :class:`~mergeqp.errors.InfeasibleError`; ``committed``: whether the ``.npz`` is in git;
    ``saved``: the instance is not synthetic but saved from a real run (its ``.npz`` is the
    only source: :meth:`build` refuses, and nothing regenerates it)."""

    name: str
    K: int
    r: int
    c: int
    N: int
    seed: int
    description: str
    committed: bool
    noise: float = 0.5
    m: int | None = None
    dead_rows: float = 0.0
    duplicate_last: bool = False
    constraints: tuple[str, ...] = ("box:0,1", "simplex")
    infeasible: tuple[str, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)
    saved: bool = False

    @property
    def n(self) -> int:
        return self.K * self.r

    def build(self) -> MergeQP:
        if self.saved:
            raise ValidationError(
                f"reference problem {self.name!r} was saved from a real run and cannot be "
                f"regenerated; restore problems/{self.name}.npz from git")
        return synthetic_merge_qp(self.K, self.r, self.c, self.N, m=self.m, noise=self.noise,
                                  seed=self.seed, dead_rows=self.dead_rows,
                                  duplicate_last=self.duplicate_last, name=self.name)


_ALL_SETS = ("box:0,1", "simplex", "global_simplex", "box:0,1 & simplex", "box:0,0.6 & simplex",
             "box:0,1 & global_simplex", "nonneg", "box:-1,2", "l1:L1R", "box:0,1 & l1:L1R")

REFERENCE_SPECS: dict[str, ReferenceSpec] = {}


def register_reference(spec: ReferenceSpec) -> None:
    """Register a named reference instance (explicitly)."""
    if spec.name in REFERENCE_SPECS:
        raise ValidationError(f"reference problem {spec.name!r} is already registered")
    REFERENCE_SPECS[spec.name] = spec


register_reference(ReferenceSpec(
    "tiny96", K=3, r=32, c=4, N=40, seed=1, committed=True,
    description="tiny: K=3 models x 32 rows, c=4 outputs, N=40 samples (fast tests)",
    constraints=_ALL_SETS,
    infeasible=("box:0,0.2 & simplex", "box:0.5,1 & global_simplex"),
))
register_reference(ReferenceSpec(
    "singular192", K=3, r=64, c=4, N=80, seed=2, committed=True, dead_rows=0.1, duplicate_last=True,
    description="singular H: K=3 x 64 rows, c=4, N=80; 6 dead rows (zero rows of H) and the last "
                "model a copy of the first (H singular along d_0 - d_2)",
    constraints=_ALL_SETS,
))
register_reference(ReferenceSpec(
    "k1_100", K=1, r=100, c=5, N=60, seed=3, committed=True,
    description="a single model (K=1): 100 rows, c=5, N=60",
    constraints=("box:0,1", "simplex", "global_simplex", "box:0,1 & global_simplex", "nonneg",
                 "l1:L1R", "box:0,1 & l1:L1R"),
))
register_reference(ReferenceSpec(
    "mnist640", K=5, r=128, c=10, N=500, seed=4, committed=True,
    description="MNIST MLP penultimate layer size: K=5 x 128 rows, c=10 classes, N=500 samples",
    constraints=_ALL_SETS,
))
register_reference(ReferenceSpec(
    "mnist_real640", K=5, r=128, c=10, N=500, seed=0, committed=True, saved=True,
    description="real merge QP saved from `mergeqp experiment mnist` (seed 0, layer2, rows, 100 "
                "calibration samples per task): singular H (84 zero rows, rank 553 of 640)",
    constraints=_ALL_SETS,
))
register_reference(ReferenceSpec(
    "vit3072", K=4, r=768, c=64, N=400, seed=5, committed=False,
    description="ViT-B/32 layer size: K=4 x 768 rows, c=64 outputs, N=400 samples",
    constraints=("box:0,1", "simplex", "box:0,1 & simplex", "global_simplex", "l1:L1R"),
))
register_reference(ReferenceSpec(
    "llama12288", K=3, r=4096, c=64, N=256, seed=6, committed=False,
    description="Llama-3-8B down_proj size: K=3 x 4096 rows, c=64 outputs, N=256 samples",
    constraints=("box:0,1", "simplex"),
))


def repo_problems_dir() -> Path:
    """``problems/`` of the source tree (override with ``$MERGEQP_PROBLEMS_DIR``)."""
    env = os.environ.get("MERGEQP_PROBLEMS_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "problems"


def get_reference(name: str) -> ReferenceSpec:
    return lookup("reference problem", name, REFERENCE_SPECS)


def problem_path(name: str, root: Path | None = None) -> Path:
    """Where the instance's ``.npz`` lives: ``problems/NAME.npz`` if committed, else
    ``problems/generated/NAME.npz``."""
    spec = get_reference(name)
    root = repo_problems_dir() if root is None else Path(root)
    return root / f"{name}.npz" if spec.committed else root / "generated" / f"{name}.npz"


def load_reference_problem(name: str, *, generate: bool = True, cache: bool = True,
                           root: Path | None = None) -> MergeQP:
    """Load a named instance; generate (and cache) it deterministically if missing."""
    spec = get_reference(name)
    path = problem_path(name, root)
    if path.exists():
        return MergeQP.load_npz(str(path))
    if spec.saved:
        raise ValidationError(f"reference problem {name!r} not found at {path}: it was saved from a "
                              "real run and cannot be regenerated; restore it from git")
    if not generate:
        raise ValidationError(f"reference problem {name!r} not found at {path}; run problems/generate.py")
    problem = spec.build()
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        problem.save_npz(str(tmp))
        os.replace(tmp, path)
    return problem


def reference_path(name: str, root: Path | None = None) -> Path:
    """The JSON of certified optima: ``problems/NAME.json`` (committed instances) or
    ``problems/generated/NAME.json``."""
    p = problem_path(name, root)
    return p.with_suffix(".json")


def load_references(name: str, root: Path | None = None) -> dict[str, Any]:
    """The stored references: ``{"problem": ..., "l1_radius": ..., "optima": {spec: {...}},
    "infeasible": [...]}``; ``optima[spec]`` holds ``objective``, ``d_file``, ``solver``,
    ``fw_gap``, ``relative_gap``."""
    path = reference_path(name, root)
    if not path.exists():
        raise ValidationError(f"no reference optima for {name!r} at {path}; run problems/generate.py")
    damaged = f"reference optima of {name!r} at {path} are damaged"
    try:
        with open(path) as fh:
            refs = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValidationError(f"{damaged} ({type(exc).__name__}: {exc}); restore the file from git or rerun "
                              f"problems/generate.py") from None
    # the fields readers use: an object, a numeric l1 radius, objects of numeric objectives
    if not isinstance(refs, dict):
        raise ValidationError(f"{damaged}: a JSON object is expected, got {type(refs).__name__}")
    radius = refs.get("l1_radius")
    if radius is not None and (isinstance(radius, bool) or not isinstance(radius, (int, float))):
        raise ValidationError(f"{damaged}: l1_radius is {radius!r}, not a number")
    optima = refs.get("optima", {})
    if not isinstance(optima, dict):
        raise ValidationError(f"{damaged}: optima is {type(optima).__name__}, not an object")
    for spec, entry in optima.items():
        objective = entry.get("objective") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or (objective is not None and (isinstance(objective, bool)
                                                                      or not isinstance(objective, (int, float)))):
            raise ValidationError(f"{damaged}: optima[{spec!r}] has no numeric objective ({entry!r:.80})")
    return refs


def resolve_spec(spec: str, l1_radius: float | None = None) -> str:
    """Substitute the instance's L1 radius for the placeholder ``L1R`` in a spec."""
    if "L1R" in spec:
        if l1_radius is None:
            raise ValidationError(f"constraint {spec!r} needs the instance's l1 radius")
        spec = spec.replace("L1R", f"{l1_radius:g}")
    return spec


def constraint_from_spec(spec: str) -> ConstraintSet:
    """``"box:0,1 & simplex"`` -> the intersection (each part parsed by ``parse_constraint``)."""
    parts = [p.strip() for p in spec.split("&") if p.strip()]
    return as_constraint_set([parse_constraint(p) for p in parts])


# ---------------------------------------------------------------------- certified references
#: solvers tried for each reference optimum (the one with the smallest certified gap is kept;
#: the others' objectives are stored as a cross-check)
REFERENCE_SOLVERS = ("active_set", "clarabel", "cvxpy_clarabel")


def spec_slug(spec: str) -> str:
    """A file-name-safe spelling of a constraint spec (``box:0,1 & simplex`` -> ``box_0_1__simplex``)."""
    out = spec.replace(" & ", "__").replace("&", "__").replace(":", "_").replace(",", "_").replace(" ", "")
    return out.replace("-", "m").replace(".", "p")


def choose_l1_radius(problem: MergeQP) -> float:
    """Half the L1 norm of the box-[0, 1] optimum, to 2 significant digits (so the ball binds)."""
    d = solve(problem, constraint_from_spec("box:0,1"), solver="active_set", certify_result=False).d
    r = 0.5 * float(np.sum(np.abs(d)))
    if r <= 0:
        return 1.0
    digits = 1 - int(np.floor(np.log10(r)))
    return float(round(r, digits))


def build_references(name: str, *, root: Path | None = None, solvers: tuple[str, ...] = REFERENCE_SOLVERS,
                     rel_tol: float = 1e-9, progress: bool = True) -> dict[str, Any]:
    """Solve the instance under each of its constraint specs with ``solvers``, keep the best
    certified point (lowest objective among points certified at ``rel_tol``), write its ``d``
    as ``.npy`` and the JSON of optima; check that the ``infeasible`` specs raise
    :class:`~mergeqp.errors.InfeasibleError`. Returns the JSON dictionary."""
    spec = get_reference(name)
    problem = load_reference_problem(name, root=root)
    radius = choose_l1_radius(problem)
    json_path = reference_path(name, root)
    d_dir = json_path.parent / "refs" / name
    d_dir.mkdir(parents=True, exist_ok=True)
    optima: dict[str, Any] = {}
    specs = [resolve_spec(s, radius) for s in spec.constraints]
    try:
        from tqdm import tqdm  # optional: a progress bar when it is installed

        iterator = tqdm(specs, desc=f"references {name}", disable=not progress)
    except ImportError:  # pragma: no cover
        iterator = specs
    for s in iterator:
        cset = constraint_from_spec(s)
        tried: dict[str, Any] = {}
        best = None
        for solver in solvers:
            try:
                sol = solve(problem, cset, solver=solver, rel_tol=rel_tol)
            except MergeQPError as exc:
                tried[solver] = {"error": str(exc)}
                continue
            cert = sol.certificate
            assert cert is not None
            tried[solver] = {"objective": sol.objective, "relative_gap": cert.relative_gap,
                             "certified": cert.certified(rel_tol), "seconds": sol.timings["total"]}
            if cert.certified(rel_tol) and (best is None or sol.objective < best.objective):
                best = sol
        if best is None:
            raise ValidationError(f"{name} / {s}: no solver certified a point at rel_tol {rel_tol}: {tried}")
        d_file = d_dir / f"{spec_slug(s)}.npy"
        save_npy_atomic(d_file, best.d)
        cert = best.certificate
        assert cert is not None
        optima[s] = {
            "objective": best.objective, "d_file": str(d_file.relative_to(json_path.parent)),
            "solver": best.solver, "fw_gap": cert.fw_gap, "relative_gap": cert.relative_gap,
            "lower_bound": cert.lower_bound, "cross_check": tried,
        }
    infeasible = []
    for s in spec.infeasible:
        try:
            solve(problem, constraint_from_spec(s), solver="auto")
        except InfeasibleError as exc:
            infeasible.append({"constraints": s, "error": str(exc)})
            continue
        raise ValidationError(f"{name}: {s!r} was expected to be infeasible but solved")
    meta = dict(problem.metadata)
    out = {
        "problem": name, "description": spec.description, "n": problem.n, "shape": list(problem.shape),
        "file": problem_path(name, root).name, "committed": spec.committed, "c": problem.c,
        "generator": meta, "l1_radius": radius, "rel_tol": rel_tol, "optima": optima,
        "infeasible": infeasible,
    }
    write_json_atomic(json_path, out, indent=1, default=float)
    return out
