"""Multi-layer merging with the QP (the paper's appendix "Multi-layer merging", and a joint QP).

Every mode works on a *live* model (modified in place: the caller owns a copy) whose merge
sites start at the base weights (``single``, ``sequential``, ``joint``) or at a baseline merge
(``hybrid``). The residual directions are always the *original* ones,
``delta_k = W_k - W_base`` read from the checkpoints, and the targets always the original
fine-tuned models' outputs; only the linearisation point moves.

- ``single``: every site is linearised at the base model and solved on its own; all solutions
  are applied at the end (exact for one site; ignores cross-layer effects for several).
- ``sequential`` (paper): sites in model order; at each step the statistics are recomputed on the
  partially merged model (earlier sites merged), the site's QP is solved and applied. Greedy.
- ``hybrid`` (paper): the model already holds a baseline merge of all layers; the selected sites
  are refined sequentially, linearised at the baseline's weights (the baseline's own update is
  pushed forward and subtracted so that the QP is in the absolute coefficients ``d``).
- ``joint`` (beyond the paper): ONE QP over all sites' coefficients, linearised at the base in
  every site's update at once (:mod:`.firstorder`): convex, with cross-layer Hessian blocks; it
  accounts for how sites interact to first order, but not for the second-order products of
  updates (``delta_2 delta_1``) that the sequential scheme sees through its re-linearisation.

For each solved group the record holds ``objective_before`` (the calibration objective of the
model before the step; exact), ``objective_after`` (the QP objective at the solution: what the
certificate bounds; with ``regularisation`` the objective without its penalty, the bounded one being
``objective_regularised``), ``objective_after_exact`` (the model's calibration objective after applying
the step: the gap to ``objective_after`` is the linearisation error), the certificate, the
captured-energy fraction and timings.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..constraints import layer_constraint, layer_context, parse_constraint
from ..errors import SolverError, ValidationError
from ..lm import OutputSpec, squared_error
from ..solvers.registry import solve
from ..stats.parametrisation import Parametrisation, SiteInputs, get_parametrisation, merged_update
from .baseline_residuals import BaselineChoice, site_baseline_residuals
from .firstorder import FirstOrderStats, SiteAtoms, TaskTargets, collect_first_order
from .outputbasis import collect_output_basis
from .sites import LayerSite, read_augmented, weight_from_tensors, write_augmented


@dataclass(frozen=True)
class QPSettings:
    """How each QP is built and solved.

    ``parametrisation``: ``scalar`` | ``rows`` | ``columns`` | ``basis`` (with ``basis`` =
    ``svd`` (top singular vectors of ``[delta_1 ... delta_K]``), ``random`` (seeded) or
    ``optimal`` (Corollary 4.2 with the calibration-mean output Jacobian, computed per site at
    the linearisation point, :mod:`.outputbasis`; its ``(c, r)`` Jacobian must fit
    ``basis_max_bytes``), and ``rank`` p); ``constraints``: ``mergeqp solve`` spellings (intersected); ``solver`` and
    ``solver_options`` for :func:`mergeqp.solve`; ``regularisation`` ``mu`` adds
    ``mu ||d - d_ref||^2`` (``reference``: ``soup``, each parametrisation's ``task_vector_point`` at 1/K, or ``zero``); ``chunk_size``: atoms per
    vectorised JVP call; ``mode_options``: the merge mode's own options (e.g. ``joint``'s
    ``compare_sequential``; validated
    by its entry, :meth:`mergeqp.merge.modes.MergeMode.check_options`); ``jacobian_mode``: of the
    statistics' derivatives (:func:`~.firstorder.collect_first_order`).
    """

    parametrisation: str = "rows"
    basis: str | None = None
    rank: int | None = None
    constraints: tuple[str, ...] = ("box:0,1",)
    solver: str = "auto"
    solver_options: Mapping[str, Any] = field(default_factory=dict)
    regularisation: float = 0.0
    reference: str = "soup"
    chunk_size: int = 256
    seed: int = 0
    basis_max_bytes: int = 2 * 2**30
    mode_options: Mapping[str, Any] = field(default_factory=dict)
    #: ``rows+baselines``: the baselines whose merged residuals are atoms (name, params)
    baselines: tuple[BaselineChoice, ...] = ()
    #: ``{baseline name: {checkpoint key: merged tensor}}``: the merges of the ``baselines`` that
    #: need calibration statistics (RegMean, Fisher), made by the run layer before the QP
    baseline_merges: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    jacobian_mode: str = "auto"
    #: a user parametrisation's own options (keys of its ``config_options`` other than the fields above)
    parametrisation_extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def parametrisation_options(self) -> dict[str, Any]:
        """The options the parametrisation entry reads (:meth:`Parametrisation.for_site`)."""
        return {**self.parametrisation_extra, "basis": self.basis, "rank": self.rank,
                "baselines": tuple(n for n, _ in self.baselines)}


class WeightSource:
    """Base weights and original residuals of merge sites, read lazily from checkpoints.

    ``base``: a :class:`~mergeqp.io.checkpoint.Checkpoint` (or any object with ``get(name)``);
    ``finetuned``: K of them. Only the tensors of the requested site are read; results are
    float64 CPU tensors, augmented with the bias column: ``base_weight`` ``(r, m1)``,
    ``deltas`` ``(K, r, m1)``.
    """

    def __init__(self, base: Any, finetuned: Sequence[Any]):
        self.base = base
        self.finetuned = list(finetuned)

    @property
    def K(self) -> int:
        return len(self.finetuned)

    def _augmented(self, ckpt: Any, site: LayerSite) -> Any:
        bias = ckpt.get(site.bias_key) if site.bias_key else None
        return weight_from_tensors(site, ckpt.get(site.weight_key), bias)

    def base_weight(self, site: LayerSite) -> Any:
        return self._augmented(self.base, site)

    def deltas(self, site: LayerSite) -> Any:
        import torch  # optional heavy dependency (the merge needs it; importing this module does not)

        W0 = self.base_weight(site)
        return torch.stack([self._augmented(ft, site) - W0 for ft in self.finetuned])


@dataclass
class MergeContext:
    """What every mode needs: the live ``model`` (modified in place), the ``weights`` source,
    the ``tasks`` with their targets, the compared-output ``spec``, the ``device``, the QP
    ``settings`` and model names."""

    model: Any
    weights: WeightSource
    tasks: Sequence[TaskTargets]
    spec: OutputSpec
    settings: QPSettings
    device: Any = "cpu"
    model_names: Sequence[str] | None = None
    progress: bool = False
    log: Callable[[str], None] | None = None
    #: a start fitted to calibration data (the model holds its fit on every batch when a mode
    #: begins): the trust region's early stopping reloads its fit without the held-out batches
    held_out_start: HeldOutStart | None = None


@dataclass(frozen=True)
class HeldOutStart:
    """A start merge that was fitted to calibration data, as two loaders into the live model:
    ``load_fit`` its fit on the trust region's fitting batches only (every task's calibration
    batches but the last :func:`~.trust_region.holdout_count`), ``load_full`` its fit on every
    batch. ``label`` names it in the report."""

    label: str
    load_fit: Callable[[], None]
    load_full: Callable[[], None]


@dataclass(frozen=True)
class LayerRecord:
    """The outcome of one merged site (shared fields for a joint group)."""

    layer: str
    mode: str
    objective_before: float
    objective_after: float
    objective_after_exact: float
    certificate: dict[str, Any]
    energy_fraction: float
    seconds: float
    solver: str
    status: str
    n_variables: int
    group: int
    points: dict[str, float]
    d: np.ndarray
    timings: dict[str, float]
    basis: dict[str, Any] | None = None
    group_energy_fraction: float | None = None
    #: the parametrisation's own record of the solution (:meth:`Parametrisation.solution_record`)
    atoms: dict[str, Any] | None = None
    #: Frobenius norm of each model's residual ``delta_k`` at this site (not in the JSON record;
    #: the run layer turns zeros into report notes)
    residual_norms: tuple[float, ...] = ()
    #: why ``fold_head: auto`` compared the vocabulary-size logits (``None``: folded, or not a
    #: foldable output; not in the JSON record: the run layer turns it into a report note)
    head_not_folded: str | None = None
    #: the step raised the exact calibration objective and the layer kept its weights from before it
    #: (``mode: hybrid``'s ``keep_start``); ``objective_after_exact`` is then the step's, not kept
    kept_start: bool = False
    #: with ``regularisation`` (``mu > 0``): the solved QP's objective ``J + mu ||d - d_ref||^2`` at the
    #: solution, which the certificate bounds (``objective_after`` is ``J`` alone); ``None`` without
    objective_regularised: float | None = None

    def to_json(self) -> dict[str, Any]:
        cert = self.certificate
        extra = {} if self.basis is None else {"basis": self.basis}
        if self.group_energy_fraction is not None:
            extra["group_energy_fraction"] = self.group_energy_fraction
        extra.update(self.atoms or {})
        if self.kept_start:
            extra["kept_start"] = True
        if self.objective_regularised is not None:
            extra["objective_after_regularised"] = self.objective_regularised
        return {**extra,
            "layer": self.layer, "mode": self.mode, "group": self.group,
            "objective_before": self.objective_before, "objective_after": self.objective_after,
            "objective_after_exact": self.objective_after_exact,
            "certificate": {"fw_gap": cert.get("fw_gap"), "certified": cert.get("certified"),
                            "relative_gap": cert.get("relative_gap"),
                            "gap_method": cert.get("gap_method"), "bound_method": cert.get("bound_method"),
                            "infeasibility": cert.get("infeasibility"),
                            **({"reasons": list(cert["reasons"])} if cert.get("reasons") else {})},
            "energy_fraction": self.energy_fraction, "seconds": self.seconds,
            "solver": self.solver, "status": self.status, "n_variables": self.n_variables,
            "objective_at": self.points,
            "coefficients": {"mean": float(np.mean(self.d)), "min": float(np.min(self.d)),
                             "max": float(np.max(self.d))},
            "timings": self.timings,
        }


def make_parametrisation(settings: QPSettings, site: LayerSite, deltas: Any, optimal: Any = None,
                         base_weight: Any = None, inputs: SiteInputs | None = None) -> Parametrisation:
    """The parametrisation of ``site`` (the registered entry's :meth:`~Parametrisation.for_site`:
    a basis is built from the site's deltas, or from ``optimal``, its
    :class:`~.outputbasis.OutputBasisStats`; baselines' residuals from ``base_weight``, the
    site's augmented base weight; ``inputs``: the layer's :class:`SiteInputs`, handed to the entry as
    ``options["site_inputs"]``)."""
    entry = get_parametrisation(settings.parametrisation)
    options = settings.parametrisation_options
    if inputs is not None:
        options["site_inputs"] = inputs
    if settings.baselines and base_weight is not None:
        options["baseline_residuals"] = functools.partial(site_baseline_residuals, settings.baselines, base_weight,
                                                          merged=settings.baseline_merges)
    return entry.for_site(site, deltas.numpy(), options, seed=settings.seed, output_stats=optimal)


def _optimal_basis_stats(ctx: MergeContext, site: LayerSite, offset: Any) -> Any:
    return collect_output_basis(ctx.model, site, ctx.tasks, ctx.spec, ctx.device, offset=offset,
                                chunk_size=ctx.settings.chunk_size, max_bytes=ctx.settings.basis_max_bytes,
                                progress=ctx.progress)


def calibration_objective(ctx: MergeContext) -> float:
    """``sum_t w_t sum_j ||h_j - y_j||^2`` of the live model on the calibration batches (exact)."""
    total = 0.0
    for task in ctx.tasks:
        sse, _ = squared_error(ctx.model, task.batches, ctx.spec, ctx.device)
        total += task.weight * sse
    return total


def constraint_sets(settings: QPSettings, atoms: Sequence[SiteAtoms]) -> list[Any]:
    """The parsed ``settings.constraints`` for a QP over ``atoms`` (a per-layer spelling such as
    ``sign`` needs exactly one site)."""
    out = []
    for spec in settings.constraints:
        name = layer_constraint(spec)
        if name is not None and len(atoms) != 1:
            raise ValidationError(f"the {name!r} constraint is per layer; it cannot be used in a QP over "
                                  f"{len(atoms)} layers (a mode that solves layers together, e.g. mode: joint)")
        if name is not None:
            D, param = atoms[0].deltas.numpy(), atoms[0].param
            context = layer_context(D, param.name, lambda: param.parameter_atoms(*D.shape[1:]))
        else:
            context = None
        out.append(parse_constraint(spec, context))
    return out


def _task_vector_point(K: int, atoms: Sequence[SiteAtoms], lam: float) -> np.ndarray:
    """Task arithmetic with weight ``lam`` in the coefficients of every site (``1/K``: the soup), each
    site's point from its parametrisation (rows+baselines: rows ``lam``, baseline atoms 0; a basis:
    the projection onto it)."""
    return np.concatenate([a.param.task_vector_point(K, int(a.deltas.shape[1]), int(a.deltas.shape[2]), lam)
                           for a in atoms], axis=1)


def _reference_points(stats: FirstOrderStats, atoms: Sequence[SiteAtoms]) -> dict[str, np.ndarray]:
    """The points the report evaluates beside the optimum: zero (the start), the soup and task
    arithmetic where every site's family contains them (not a basis: its ``1/K`` is the soup's
    projection, which is no soup), and the parametrisations' own (the baselines of rows+baselines)."""
    points = {"zero": np.zeros((stats.K, stats.N))}
    if all(a.param.contains_task_vectors for a in atoms):
        points["soup"] = _task_vector_point(stats.K, atoms, 1.0 / stats.K)
        points["task_arithmetic"] = _task_vector_point(stats.K, atoms, 1.0)
    own = [a.param.reference_points(stats.K) for a in atoms]  # e.g. the baselines of rows+baselines
    for name in sorted(set.intersection(*(set(p) for p in own)) if own else ()):
        points[name] = np.concatenate([p[name] for p in own], axis=1)
    return points


@dataclass(frozen=True)
class BuiltSite:
    """One site's atoms at the live model (:func:`site_atoms`), with the report's ``basis``
    entry, the Frobenius norm of each residual and the seconds spent on an optimal basis."""

    atoms: SiteAtoms
    basis: dict[str, Any] | None
    residual_norms: tuple[float, ...]
    basis_seconds: float


def site_atoms(ctx: MergeContext, site: LayerSite, reference: Any = None) -> BuiltSite:
    """The atoms of ``site`` (original residuals ``delta_k = W_k - W_base``, the configured
    parametrisation built at the live model) for a QP in the coefficients of ``W = W_ref +
    sum_a d_a B_a``. ``reference``: ``W_ref`` (augmented ``(r, m1)``, float64); the offset
    ``W_current - W_ref`` of the live model is pushed forward (``None``: no offset, the model is
    taken to hold ``W_ref``; a zero offset is dropped)."""
    deltas = ctx.weights.deltas(site)
    current = read_augmented(ctx.model, site)
    offset = None
    if reference is not None:
        diff = current - reference
        if float(diff.abs().max()) > 0.0:
            offset = diff
    optimal = None
    entry = get_parametrisation(ctx.settings.parametrisation)
    options = ctx.settings.parametrisation_options
    entry.check_site(site, options)
    if entry.needs_output_jacobian(options):
        optimal = _optimal_basis_stats(ctx, site, offset)
    inputs = SiteInputs.at(functools.partial(ctx.weights.base_weight, site), current)
    base_weight = inputs.base_weight() if ctx.settings.baselines else None
    param = make_parametrisation(ctx.settings, site, deltas, optimal, base_weight, inputs)
    norms = tuple(float(x) for x in deltas.reshape(deltas.shape[0], -1).norm(dim=1))
    return BuiltSite(SiteAtoms(site, param, deltas, offset),
                     param.site_record(deltas.numpy(), optimal, seed=ctx.settings.seed),
                     norms, optimal.seconds if optimal is not None else 0.0)


@dataclass(frozen=True)
class GroupResult:
    """A solved group: its statistics, the solution, new augmented weights per site."""

    stats: FirstOrderStats
    solution: Any
    new_weights: dict[str, Any]
    records: tuple[LayerRecord, ...]


def solve_group(ctx: MergeContext, sites: Sequence[LayerSite], *, mode: str, group: int,
                relinearise_offsets: bool) -> GroupResult:
    """Linearise the live model at ``sites`` jointly, solve the QP, return new weights (not yet
    applied). ``relinearise_offsets``: the model's site weights may differ from the base
    (hybrid); their offset is accounted for."""
    import torch  # optional heavy dependency (the merge needs it; importing this module does not)

    t0 = time.perf_counter()
    atoms = []
    bases: dict[str, dict[str, Any] | None] = {}
    norms: dict[str, tuple[float, ...]] = {}
    basis_seconds = 0.0
    for site in sites:
        built = site_atoms(ctx, site, ctx.weights.base_weight(site) if relinearise_offsets else None)
        atoms.append(built.atoms)
        bases[site.name] = built.basis
        norms[site.name] = built.residual_norms
        basis_seconds += built.basis_seconds
    t1 = time.perf_counter()
    stats = collect_first_order(ctx.model, atoms, ctx.tasks, ctx.spec, ctx.device,
                                model_names=ctx.model_names, chunk_size=ctx.settings.chunk_size,
                                progress=ctx.progress, jacobian_mode=ctx.settings.jacobian_mode)
    t2 = time.perf_counter()
    qp = stats.problem()
    mu = ctx.settings.regularisation
    solved_problem = qp
    if mu > 0:
        solved_problem = qp.regularised(mu, _task_vector_point(stats.K, atoms, 1.0 / stats.K)
                                        if ctx.settings.reference == "soup" else 0.0)
    cset = constraint_sets(ctx.settings, atoms)
    solution = solve(solved_problem, cset or None, solver=ctx.settings.solver, **dict(ctx.settings.solver_options))
    t3 = time.perf_counter()
    if solution.certificate is not None and not solution.certificate.feasible:
        cert_ = solution.certificate
        raise SolverError(
            f"layer(s) {[a.site.name for a in atoms]}: the {solution.solver} solution violates the "
            f"constraints {solution.constraints} by {cert_.infeasibility:.3g} (status "
            f"{getattr(solution.status, 'value', solution.status)}); no model was written. "
            + ("No registered solver that takes this set reached a feasible point (tried: "
               + (", ".join(t["solver"] for t in solution.info.get("auto_tried", [])) or solution.solver) + ")"
               if ctx.settings.solver == "auto" else
               "Give the solver more iterations (solver_options) or use solver: auto")
        )
    d = solution.d
    new_weights = {}
    for a in atoms:
        block = d[:, stats.site_slice(a.site.name)]
        update = merged_update(a.param, block, a.deltas.numpy())
        new_weights[a.site.name] = ctx.weights.base_weight(a.site) + torch.from_numpy(update)
    current = float(sum(w * e["current"] for w, e in zip(stats.task_weights, stats.energy)))
    points = {name: qp.objective(p) for name, p in _reference_points(stats, atoms).items()}
    cert = solution.certificate.to_dict() if solution.certificate is not None else {}
    common: dict[str, Any] = {
        "mode": mode, "objective_before": current, "objective_after": qp.objective(d), "certificate": cert,
        "objective_regularised": solved_problem.objective(d) if solved_problem is not qp else None,
        "solver": solution.solver, "status": str(getattr(solution.status, "value", solution.status)),
        "n_variables": qp.n, "group": group, "points": points,
        "timings": {"weights": t1 - t0 - basis_seconds, **({"basis": basis_seconds} if basis_seconds else {}),
                    "statistics": t2 - t1, "solve": t3 - t2},
    }
    records = tuple(
        LayerRecord(layer=a.site.name, objective_after_exact=math.nan,
                    energy_fraction=stats.energy_fraction(a.site.name), seconds=t3 - t0,
                    d=d[:, stats.site_slice(a.site.name)], basis=bases.get(a.site.name),
                    group_energy_fraction=stats.energy_fraction(None) if len(atoms) > 1 else None,
                    residual_norms=norms[a.site.name], head_not_folded=stats.metadata.get("head_not_folded"),
                    atoms=a.param.solution_record(d[:, stats.site_slice(a.site.name)]), **common)
        for a in atoms
    )
    return GroupResult(stats, solution, new_weights, records)


def apply_weights(ctx: MergeContext, sites: Sequence[LayerSite], weights: Mapping[str, Any]) -> None:
    """Write the new augmented ``weights`` of ``sites`` into the live model."""
    for site in sites:
        write_augmented(ctx.model, site, weights[site.name])


def with_exact(records: Sequence[LayerRecord], exact: float, extra_seconds: float) -> list[LayerRecord]:
    """``records`` with the measured exact objective after the step and its evaluation time."""
    return [dataclasses.replace(r, objective_after_exact=exact, seconds=r.seconds + extra_seconds,
                                timings={**r.timings, "evaluate": extra_seconds}) for r in records]


def say(ctx: MergeContext, msg: str) -> None:
    """A progress message through the context's ``log`` (if any)."""
    if ctx.log is not None:
        ctx.log(msg)
