"""Trust-region merging: the generic loop over linearised merge QPs (``qp_tr``), shared by the
MNIST experiment (:mod:`mergeqp.experiments.trust_region`), and its application to merge sites
of a live model (:func:`trust_region_sites`, behind the ``trust_region`` merge mode).

:func:`sequential_trust_region` minimises a true objective ``F(d)`` by a sequence of QPs:

1. at the current point ``d_t``, build the QP ``J_t`` linearised there (``linearise(d_t)``, in
   absolute ``d``, so ``J_t(d_t) = F(d_t)`` and ``grad J_t(d_t) = grad F(d_t)``);
2. solve ``min J_t(d) (+ ridge ||d - d_ref||^2)`` over ``C intersect {||d - d_t||_inf <=
   Delta}`` (:func:`trust_region_set`; for a box ``C`` this is again a box) and certify the
   solution like any other QP;
3. ``rho = (F(d_t) - F(d_new)) / (J_t(d_t) - J_t(d_new))`` (true over predicted decrease);
   accept ``d_new`` when ``rho > accept``; multiply ``Delta`` by ``expand`` when ``rho >
   expand_above`` and the step reached the trust-region boundary; when ``rho < shrink_below``
   set it to ``shrink`` times the smaller of ``Delta`` and the step's length (since stop 52: a
   radius shrunk only from ``Delta`` can still hold the rejected step, and the next QP repeats it),
   but not below ``delta_min`` while the step was longer than it (that radius is tried once);
4. stop after ``max_qps`` QP solves, when the predicted decrease is below ``tol * F(d_t)``, or
   when ``Delta < delta_min``.

Every accepted step lowers ``F`` (``accept >= 0``): the result is never worse than ``d0``.
The loop only needs two callables, so any producer of linearised QPs can use it.

:func:`trust_region_sites` runs it on merge sites of a live model in the coordinates ``D`` of
``W = W_start + sum_a D_a B_a`` (every site at once, atoms of the original residuals
``delta_k = W_k - W_base``), where ``W_start`` is the model's weight when it is called (a start
merge, or the base): ``D = 0`` is the start. Each QP is the joint first-order model
(:func:`~.firstorder.collect_first_order`) at the current ``W``, the offset ``W - W_start``
pushed forward, so the QP is in absolute ``D``; the true objective is the live model's
calibration objective (:func:`~.multilayer.calibration_objective`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ..constraints import Box, as_constraint_set
from ..errors import ValidationError
from ..formatting import format_number
from ..problem import MergeQP
from ..solvers.registry import solve
from ..stats.parametrisation import merged_update
from .firstorder import FirstOrderStats, TaskTargets, collect_first_order
from .multilayer import (
    LayerRecord,
    MergeContext,
    apply_weights,
    calibration_objective,
    constraint_sets,
    say,
    site_atoms,
)
from .sites import LayerSite, read_augmented


@dataclass(frozen=True)
class TrustRegionConfig:
    """Settings of :func:`sequential_trust_region` (defaults = the prototype in issue 5).

    ``delta0``: initial trust-region radius (units of ``d``, infinity norm); ``max_qps``: QP
    solves in all (accepted or not); ``accept``: smallest ``rho`` for accepting a step;
    ``expand_above`` / ``shrink_below``: ``rho`` thresholds for multiplying ``Delta`` by
    ``expand`` / ``shrink``; ``delta_min`` / ``delta_max``: radius limits; ``tol``: stop when
    the predicted decrease is below ``tol * F(d_t)``; ``ridge``: weight ``mu >= 0`` of a
    proximal term ``mu ||d - ridge_reference||^2`` added to both the QPs and the true objective
    (``ridge_reference`` ``None``: ``1/K`` on every atom, the soup of a parametrisation whose atoms
    are all task vectors; :func:`~mergeqp.experiments.trust_region.trust_region_merge` passes the soup
    of others, e.g. ``rows+baselines``, as its ``ridge_center``).
    """

    delta0: float = 0.1
    max_qps: int = 12
    accept: float = 0.1
    expand_above: float = 0.75
    shrink_below: float = 0.25
    expand: float = 2.0
    shrink: float = 0.5
    delta_min: float = 1e-4
    delta_max: float = 1.0
    tol: float = 1e-9
    ridge: float = 0.0
    ridge_reference: float | None = None

    def __post_init__(self) -> None:
        checks = {
            "delta0": self.delta0 > 0, "max_qps": self.max_qps >= 1,
            "accept": 0 <= self.accept < 1,
            "expand_above": self.accept <= self.expand_above,
            "shrink_below": 0 <= self.shrink_below <= self.expand_above,
            "expand": self.expand >= 1, "shrink": 0 < self.shrink < 1,
            "delta_min": self.delta_min > 0, "delta_max": self.delta_max >= self.delta_min,
            "tol": self.tol >= 0, "ridge": self.ridge >= 0,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValidationError(
                f"invalid trust-region setting(s) {', '.join(bad)} in {asdict(self)}: need delta0 > 0, "
                f"max_qps >= 1, 0 <= accept <= expand_above, 0 <= shrink_below <= expand_above, "
                f"expand >= 1, 0 < shrink < 1, 0 < delta_min <= delta_max, tol >= 0, ridge >= 0"
            )


@dataclass(frozen=True)
class TrustRegionStep:
    """One QP solve: radius ``delta``, objective at the current point ``true_before``, the QP's
    ``predicted`` decrease, the true objective at its solution ``true_after``, their ratio
    ``rho``, whether it was ``accepted``, the step's infinity norm, and the subproblem's
    certificate (``fw_gap``, ``certified``) and solver."""

    iteration: int
    delta: float
    true_before: float
    predicted: float
    true_after: float
    rho: float
    accepted: bool
    step_norm: float
    fw_gap: float
    certified: bool
    solver: str
    seconds: float
    #: the held-out objective at the accepted point (``None``: rejected, or no validation)
    validation: float | None = None
    #: why the QP's certificate did not certify (its first reason; ``None`` when it did)
    why_not_certified: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: _json_float(v) for k, v in asdict(self).items()
                if k not in ("validation", "why_not_certified") or v is not None}


@dataclass(frozen=True, eq=False)
class TrustRegionResult:
    """Final point ``d`` (``(K, n_atoms)``), its true objective, the start's, the steps taken,
    and whether every subproblem was certified."""

    d: np.ndarray
    objective: float
    start_objective: float
    steps: tuple[TrustRegionStep, ...]
    stop_reason: str
    seconds: float
    config: TrustRegionConfig
    last_problem: MergeQP | None = field(default=None, repr=False)
    ridge_selection: RidgeSelection | None = None
    #: with a validation objective: its value at the start and at the returned point (the accepted
    #: point where it was lowest: early stopping on held-out calibration data)
    validation_start: float | None = None
    validation: float | None = None
    #: the step whose candidate is the returned point (``None``: the start)
    chosen_step: int | None = None

    @property
    def n_qps(self) -> int:
        return len(self.steps)

    @property
    def n_accepted(self) -> int:
        return sum(s.accepted for s in self.steps)

    @property
    def all_certified(self) -> bool:
        return all(s.certified for s in self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {
            "objective": self.objective, "start_objective": self.start_objective,
            "n_qps": self.n_qps, "n_accepted": self.n_accepted,
            "all_certified": self.all_certified, "stop_reason": self.stop_reason,
            "seconds": self.seconds, "config": asdict(self.config),
            "steps": [s.to_dict() for s in self.steps],
            "ridge_selection": None if self.ridge_selection is None else self.ridge_selection.to_dict(),
            **({} if self.validation is None else {"validation_start": self.validation_start,
                                                   "validation": self.validation, "chosen_step": self.chosen_step}),
        }


@dataclass(frozen=True)
class RidgeSelection:
    """How :func:`trust_region_merge` chose the ridge weight on held-out calibration samples.

    ``relative``: the candidate weights relative to ``scale`` (the mean diagonal of the QP's
    ``H`` at the start point on the fitting part, so ``mu = relative * scale`` is comparable
    with the curvature of ``J``); ``weights``: the absolute ``mu`` tried; ``heldout_errors``:
    the true squared error (no ridge term) of each candidate's ``qp_tr`` merge on the held-out
    samples; ``chosen``: the ``mu`` with the lowest one (the smaller ``mu`` on a tie), used for
    the final run on all calibration samples; ``n_fit`` / ``n_heldout``: samples per task."""

    relative: tuple[float, ...]
    weights: tuple[float, ...]
    scale: float
    heldout_errors: tuple[float, ...]
    chosen: float
    holdout_fraction: float
    n_fit: tuple[int, ...]
    n_heldout: tuple[int, ...]
    seconds: float

    @property
    def chosen_relative(self) -> float:
        return self.relative[self.weights.index(self.chosen)]

    def to_dict(self) -> dict[str, Any]:
        out = {k: _json_float(v) if not isinstance(v, tuple) else [_json_float(x) for x in v]
               for k, v in asdict(self).items()}
        out["chosen_relative"] = self.chosen_relative
        return out


def _json_float(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def trust_region_set(constraints: Any, center: np.ndarray, delta: float) -> Any:
    """``C intersect {||d - center||_inf <= delta}``: one :class:`Box` when ``C`` is only bounds
    (a box, or no constraint), else the intersection. Raises :class:`ValidationError` if ``center``
    violates those bounds (the trust region would be empty)."""
    cset = as_constraint_set(constraints)
    lo_t, hi_t = center - delta, center + delta
    bounds = _bounds_only(cset, center.shape)
    if bounds is not None:
        lo_t, hi_t = np.maximum(bounds[0], lo_t), np.minimum(bounds[1], hi_t)
        if np.any(lo_t > hi_t):
            raise ValidationError("the current point lies outside the box constraints")
        return Box(lo_t, hi_t)
    return cset & Box(lo_t, hi_t)


def _bounds_only(cset: Any, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray] | None:
    """``(lo, hi)`` of shape ``shape`` when the set is nothing but bounds, else ``None`` (asked of
    the set's declared structure)."""
    st = cset.structure(shape)
    if st is None or not st.bounds_only:
        return None
    return st.lo.reshape(shape), st.hi.reshape(shape)


def sequential_trust_region(
    linearise: Callable[[np.ndarray], MergeQP],
    true_objective: Callable[[np.ndarray], float],
    constraints: Any,
    d0: np.ndarray,
    config: TrustRegionConfig | None = None,
    *,
    solver: str = "auto",
    solver_options: Mapping[str, Any] | None = None,
    progress: bool = True,
    validation: Callable[[np.ndarray], float] | None = None,
    patience: int = 1,
) -> TrustRegionResult:
    """Minimise ``true_objective`` over ``constraints`` by trust-region QPs (module docstring).

    ``linearise(d)``: the QP linearised at the point ``d`` (``(K, n_atoms)``), in absolute ``d``
    (its value at ``d`` should equal ``true_objective(d)``); ``true_objective(d)``: the true
    objective (float). ``d0`` must be feasible. Each subproblem is solved with
    :func:`mergeqp.solve` (``solver``, ``solver_options``) and certified.

    ``validation(d)``: an objective on held-out data, measured at the start and at every accepted
    point; the loop stops once it has not fallen below its lowest value for ``patience`` accepted
    steps in a row, and returns the accepted point (or the start) where it was lowest (early
    stopping). That point's ``true_objective`` is still no higher than the start's.
    """
    cfg = config or TrustRegionConfig()
    cset = as_constraint_set(constraints)
    d = np.array(d0, dtype=np.float64)
    viol = cset.violation(d)
    if viol > 1e-9 * max(1.0, float(np.max(np.abs(d)))):
        raise ValidationError(f"the trust-region start d0 violates the constraints by {viol:.3g}")
    ref = None
    if cfg.ridge > 0:
        ref = np.full(d.shape, 1.0 / d.shape[0] if cfg.ridge_reference is None else cfg.ridge_reference)

    def merit(x: np.ndarray) -> float:
        value = float(true_objective(x))
        if ref is not None:
            value += cfg.ridge * float(np.sum((x - ref) ** 2))
        return value

    if patience < 1:
        raise ValidationError(f"patience must be >= 1, got {patience}")
    t_start = time.perf_counter()
    f_d = merit(d)
    start = f_d
    v_start = None if validation is None else float(validation(d))
    best = (d, f_d, v_start, None)  # point, objective, validation, the step that reached it
    worse = 0
    delta = min(cfg.delta0, cfg.delta_max)
    steps: list[TrustRegionStep] = []
    problem: MergeQP | None = None
    stop = f"max_qps ({cfg.max_qps}) reached"
    bar = tqdm(total=cfg.max_qps, desc="qp_tr", unit="QP", disable=not progress, leave=False)
    try:
        while len(steps) < cfg.max_qps:
            t0 = time.perf_counter()
            if problem is None:
                problem = linearise(d)
                if problem.shape != d.shape:
                    raise ValidationError(
                        f"linearise() returned a problem of shape {problem.shape}, expected {d.shape}"
                    )
                if ref is not None:
                    problem = problem.regularised(cfg.ridge, ref)
            region = trust_region_set(cset, d, delta)
            sol = solve(problem, region, solver=solver, x0=np.clip(d, *_box_bounds(region, d)),
                        **dict(solver_options or {}))
            d_new = sol.d
            model_now = problem.objective(d)
            predicted = model_now - problem.objective(d_new)
            cert = sol.certificate
            if not predicted > cfg.tol * max(abs(f_d), 1e-30):
                steps.append(TrustRegionStep(len(steps), delta, f_d, float(predicted), f_d, float("nan"),
                                             False, 0.0, float(cert.fw_gap), bool(cert.certified()),
                                             sol.solver, time.perf_counter() - t0,
                                             why_not_certified=_first_reason(cert)))
                stop = "predicted decrease below tol (stationary within the trust region)"
                bar.update(1)
                break
            f_new = merit(d_new)
            rho = (f_d - f_new) / predicted
            accepted = bool(rho > cfg.accept)
            step_norm = float(np.max(np.abs(d_new - d)))
            steps.append(TrustRegionStep(len(steps), delta, f_d, float(predicted), f_new, float(rho),
                                         accepted, step_norm, float(cert.fw_gap),
                                         bool(cert.certified()), sol.solver, time.perf_counter() - t0,
                                         why_not_certified=_first_reason(cert)))
            bar.update(1)
            bar.set_postfix(F=f"{f_d:.5g}", rho=f"{rho:.2f}", delta=f"{delta:.3g}")
            on_boundary = step_norm >= delta * (1 - 1e-6)
            if rho < cfg.shrink_below:
                # below the step's own length: a radius halved while it still holds the rejected step
                # would give the same QP the same answer (stop 52 review: 7 of 10 QPs repeated one step)
                delta = cfg.shrink * min(delta, step_norm)
                if delta < cfg.delta_min < step_norm:  # the smallest radius allowed is still tried once
                    delta = cfg.delta_min
            elif rho > cfg.expand_above and on_boundary:
                delta = min(delta * cfg.expand, cfg.delta_max)
            if accepted:
                d, f_d = d_new, f_new
                problem = None
                if validation is not None:
                    v = float(validation(d))
                    steps[-1] = dataclasses.replace(steps[-1], validation=v)
                    if v < best[2]:
                        best, worse = (d, f_d, v, len(steps) - 1), 0
                    else:
                        worse += 1
                        if worse >= patience:
                            stop = f"validation objective not lowered for {patience} accepted step(s) (early stopping)"
                            break
            if delta < cfg.delta_min:
                stop = f"trust-region radius below delta_min ({cfg.delta_min:g})"
                break
        if len(steps) < cfg.max_qps:  # a rule stopped it: the bar ends full, not at 1/8 (stop 56 review)
            bar.total = len(steps)
            bar.refresh()
    finally:
        bar.close()
    chosen = max((i for i, s in enumerate(steps) if s.accepted), default=None)
    if validation is not None:  # the accepted point with the lowest held-out objective
        chosen = best[3]
        if best[0] is not d:
            d, f_d = best[0], best[1]
            problem = None
    return TrustRegionResult(d=d, objective=f_d, start_objective=start, steps=tuple(steps),
                             stop_reason=stop, seconds=time.perf_counter() - t_start, config=cfg,
                             last_problem=problem, validation_start=v_start,
                             validation=None if validation is None else best[2], chosen_step=chosen)


def _box_bounds(region: Any, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    bounds = _bounds_only(region, d.shape)
    if bounds is not None:
        return bounds
    return np.full(d.shape, -np.inf), np.full(d.shape, np.inf)


# ---------------------------------------------------------------------------- merge sites
@dataclass(frozen=True, eq=False)
class SitesTrustRegion:
    """What :func:`trust_region_sites` did: the loop's ``result`` (``result.d``: ``(K, N)``, the
    sites' ``D`` blocks side by side) and one report row per QP step (:meth:`step_rows`)."""

    result: TrustRegionResult
    #: with ``holdout`` and ``refit``: the run on the fitting part that chose the number of steps
    selection: TrustRegionResult | None = None

    def step_rows(self, which: TrustRegionResult | None = None) -> list[dict[str, Any]]:
        """Per step: ``radius`` (infinity norm in ``D``), the true objective at the current point
        ``objective_before``, the QP's value at the candidate ``linearised_after`` (the QP equals
        the true objective at the current point), the true objective there ``true_after``, the
        ``predicted_decrease``, ``rho`` (true over predicted), ``accepted``, ``step_norm``, the
        subproblem's certificate (``certified``, ``fw_gap``), ``solver`` and ``seconds``. Objectives
        in the units of ``J`` (sum of squared compared outputs, task-weighted)."""
        return [{"step": s.iteration, "radius": s.delta, "objective_before": s.true_before,
                 "linearised_after": _json_float(s.true_before - s.predicted),
                 "true_after": _json_float(s.true_after), "predicted_decrease": _json_float(s.predicted),
                 "rho": _json_float(s.rho), "accepted": s.accepted, "step_norm": s.step_norm,
                 "certified": s.certified, "fw_gap": _json_float(s.fw_gap), "solver": s.solver,
                 "seconds": s.seconds, **({} if s.validation is None else {"validation": s.validation})}
                for s in (which or self.result).steps]


@dataclass(frozen=True)
class TrustRegionLayerRecord(LayerRecord):
    """A site's record in ``trust_region`` mode (``d``: its final ``D`` block); ``outcome`` (the
    same object on every site's record, not in the per-layer JSON) holds the whole run."""

    outcome: SitesTrustRegion | None = field(default=None, repr=False)


def holdout_count(n: int, holdout: float) -> int:
    """How many of a task's ``n`` calibration batches :func:`split_tasks` holds out: ``round(holdout
    * n)``, at least one and at most ``n - 1`` (none of a task with one batch)."""
    return min(max(1, round(holdout * n)), n - 1) if n >= 2 else 0


def no_holdout_error(what: str, holdout: float) -> ValidationError:
    """The error of a split that holds out no batch at all (``what``: whose ``holdout``)."""
    return ValidationError(f"{what} {holdout:g}: every task has a single calibration batch, so none can be held "
                           f"out; use more prompts or a smaller calibration.batch_size")


def split_tasks(tasks: Sequence[TaskTargets], holdout: float) -> tuple[list[TaskTargets], list[TaskTargets]]:
    """``(fit, held)``: each task's last :func:`holdout_count` calibration batches are held out.
    Raises :class:`ValidationError` when no task has a batch to hold out."""
    fit, held = [], []
    for t in tasks:
        n = len(t.batches)
        m = holdout_count(n, holdout)
        fit.append(dataclasses.replace(t, batches=list(t.batches[:n - m])))
        if m:
            held.append(dataclasses.replace(t, batches=list(t.batches[n - m:])))
    if not held:
        raise no_holdout_error("trust_region holdout", holdout)
    return fit, held


@dataclass(frozen=True, eq=False)
class _Frame:
    """The start of a trust-region run over ``sites`` (each site's augmented weight as the model
    holds it) and the sites' atoms there (``W = start + sum_a D_a B_a``), with the column block of
    ``D`` of each site."""

    start: dict[str, Any]
    built: list[Any]
    blocks: dict[str, slice]

    @classmethod
    def at(cls, ctx: MergeContext, sites: Sequence[LayerSite]) -> _Frame:
        start = {s.name: read_augmented(ctx.model, s) for s in sites}
        built = [site_atoms(ctx, s, start[s.name]) for s in sites]
        bounds = np.cumsum([0] + [b.atoms.n_atoms for b in built])
        blocks = {b.atoms.site.name: slice(int(lo), int(hi)) for b, lo, hi in zip(built, bounds[:-1], bounds[1:])}
        return cls(start, built, blocks)

    @property
    def atoms(self) -> list[Any]:
        return [b.atoms for b in self.built]

    @property
    def K(self) -> int:
        return int(self.built[0].atoms.K)

    @property
    def n(self) -> int:
        return sum(b.atoms.n_atoms for b in self.built)

    def updates(self, D: np.ndarray) -> dict[str, Any]:
        """Each site's weight change for the coefficients ``D`` (``(K, n)``)."""
        import torch  # optional heavy dependency (the merge needs it; importing this module does not)

        return {a.site.name: torch.from_numpy(merged_update(a.param, D[:, self.blocks[a.site.name]],
                                                            a.deltas.numpy()))
                for a in self.atoms}


def trust_region_sites(ctx: MergeContext, sites: Sequence[LayerSite], config: TrustRegionConfig,
                       *, mode: str = "trust_region", holdout: float = 0.0,
                       patience: int = 1, refit: bool = False) -> list[TrustRegionLayerRecord]:
    """Trust-region QPs over ``sites`` of the live ``ctx.model`` jointly (module docstring), from
    the weights the model holds now (``D = 0``); the model is left at the result, which is never
    worse than the start on the calibration objective. ``config.ridge`` (``ctx.settings``'s
    ``regularisation``) pulls toward the start, ``mu ||D||^2``. Constraints
    (``ctx.settings.constraints``) apply to ``D`` and must contain ``D = 0``. One record per
    site, in ``sites`` order.

    ``holdout`` > 0: that fraction of each task's calibration batches (:func:`split_tasks`) is
    held out; the QPs and the acceptance use the rest, and the result is the accepted point with
    the lowest held-out objective (early stopping after ``patience`` accepted steps without a
    new lowest). It is never worse than the start on either part, so on the whole set neither.
    ``refit``: then run again from the start on every calibration batch for as many QP steps as
    the held-out objective chose (early stopping's usual last step), unless it chose the start.
    With ``refit`` and a ``ctx.held_out_start`` (a start fitted to calibration data, e.g. RegMean
    chosen by ``start: auto``), early stopping runs from that start fitted on the fitting part only
    (so the held-out batches are held out from the start too) and the refit, or the kept start,
    from the start fitted on every batch that the model holds when called."""
    t0 = time.perf_counter()
    full_ctx = ctx
    held_ctx = None
    if holdout > 0:
        fit_tasks, held_tasks = split_tasks(ctx.tasks, holdout)
        ctx = dataclasses.replace(full_ctx, tasks=fit_tasks)
        held_ctx = dataclasses.replace(full_ctx, tasks=held_tasks)
    clean = ctx.held_out_start if held_ctx is not None and refit else None
    if clean is not None:  # early stopping from the start fitted without the held-out batches
        clean.load_fit()
    frame = [_Frame.at(ctx, sites)]  # the start and its atoms (read again when the start is reloaded)

    def move_to(D: np.ndarray) -> dict[str, Any]:
        f = frame[0]
        up = f.updates(D)
        apply_weights(ctx, sites, {name: f.start[name] + u for name, u in up.items()})
        return up

    first: list[FirstOrderStats] = []

    fitting = [ctx]  # the calibration part the QPs and the acceptance use (all of it when refitting)

    def linearise(D: np.ndarray) -> MergeQP:
        f = frame[0]
        up = move_to(D)
        now = [dataclasses.replace(a, offset=up[a.site.name] if np.any(D[:, f.blocks[a.site.name]]) else None)
               for a in f.atoms]
        stats = collect_first_order(ctx.model, now, fitting[0].tasks, ctx.spec, ctx.device, model_names=ctx.model_names,
                                    chunk_size=ctx.settings.chunk_size, progress=ctx.progress,
                                    jacobian_mode=ctx.settings.jacobian_mode)
        if not first:
            first.append(stats)
        return stats.problem()

    def true_objective(D: np.ndarray) -> float:
        move_to(D)
        return calibration_objective(fitting[0])

    cset = as_constraint_set(constraint_sets(ctx.settings, frame[0].atoms) or None)
    d0 = np.zeros((frame[0].K, frame[0].n))
    viol = cset.violation(d0)
    if viol > 1e-9:
        raise ValidationError(
            f"mode: {mode}: the start (D = 0, the coefficients of W = W_start + sum_a D_a B_a) violates the "
            f"constraints {list(ctx.settings.constraints)} by {viol:.3g}; use a set that contains 0 (e.g. "
            f"box:-1,1 or none)")
    def validation(D: np.ndarray) -> float:
        move_to(D)
        return calibration_objective(held_ctx)

    result = sequential_trust_region(linearise, true_objective, cset, d0, config, solver=ctx.settings.solver,
                                     solver_options=ctx.settings.solver_options, progress=ctx.progress,
                                     validation=None if held_ctx is None else validation, patience=patience)
    # the whole calibration set's objective at the start (D = 0: no ridge term; the parts add up)
    start_full = result.start_objective + (result.validation_start or 0.0)
    selection = None
    if clean is not None:  # back to the start fitted on every batch: the refit (or the result) begins there
        clean.load_full()
        frame[0] = _Frame.at(ctx, sites)
        start_full = calibration_objective(full_ctx)
    if held_ctx is not None and refit and result.chosen_step is not None:
        # early stopping chose how many QP steps to take; take that many on every calibration batch
        selection, fitting[0], first[:] = result, full_ctx, []
        result = sequential_trust_region(linearise, true_objective, cset, d0,
                                         dataclasses.replace(config, max_qps=result.chosen_step + 1),
                                         solver=ctx.settings.solver, solver_options=ctx.settings.solver_options,
                                         progress=ctx.progress)
        start_full = result.start_objective
    move_to(result.d)
    exact = calibration_objective(full_ctx)
    outcome = SitesTrustRegion(result, selection)
    for row in outcome.step_rows():
        say(ctx, f"[{mode} step {row['step'] + 1}] radius {row['radius']:.3g}: J {row['objective_before']:.6g} -> "
                 f"linearised {format_number(row['linearised_after'])} true {format_number(row['true_after'])} "
                 f"({'accepted' if row['accepted'] else 'rejected'}, certified {row['certified']})")
    step = result.steps[result.chosen_step] if result.chosen_step is not None else None
    linearised = step.true_before - step.predicted if step is not None else result.start_objective
    if held_ctx is not None and selection is None:  # the QP modelled the fitting part; the held-out part is exact
        linearised += float(result.validation)
    if clean is not None and selection is None:  # early stopping kept the start: the one fitted on every batch
        linearised = start_full
    certificate = _steps_certificate(result)
    stats = first[0]
    atoms, built, blocks = frame[0].atoms, frame[0].built, frame[0].blocks
    seconds = time.perf_counter() - t0
    return [TrustRegionLayerRecord(
        layer=a.site.name, mode=mode, objective_before=start_full, objective_after=float(linearised),
        objective_after_exact=exact, certificate=certificate, energy_fraction=stats.energy_fraction(a.site.name),
        seconds=seconds, solver=result.steps[-1].solver if result.steps else "",
        status=_status(result, selection),
        n_variables=int(d0.size), group=0,
        points={"start": start_full, "result": result.objective if held_ctx is None else exact},
        d=result.d[:, blocks[a.site.name]], timings={"trust_region": seconds}, basis=b.basis,
        group_energy_fraction=stats.energy_fraction(None) if len(atoms) > 1 else None,
        residual_norms=b.residual_norms, atoms=a.param.solution_record(result.d[:, blocks[a.site.name]]),
        head_not_folded=stats.metadata.get("head_not_folded"), outcome=outcome) for a, b in zip(atoms, built)]


def _status(result: TrustRegionResult, selection: TrustRegionResult | None) -> str:
    """One line on the run: with early stopping and a refit (``selection``: the run on the fitting
    part), which step that run kept and that the refit took as many."""
    line = f"{result.n_accepted} of {result.n_qps} steps accepted; {result.stop_reason}"
    if selection is None:
        if result.validation is not None:  # early stopping without a refit: the kept point
            kept = "the start" if result.chosen_step is None else f"step {result.chosen_step + 1}"
            line += f"; kept {kept} (the lowest held-out objective)"
        return line
    if selection.chosen_step is None:
        return line
    return (f"early stopping on the held-out batches kept step {selection.chosen_step + 1} of {selection.n_qps} "
            f"({selection.n_accepted} accepted; {selection.stop_reason}); the refit on every batch ran as many: "
            + line)


def _steps_certificate(result: TrustRegionResult) -> dict[str, Any]:
    """A run's certificate entry: certified when every step's QP was; ``fw_gap`` the largest."""
    gaps = [s.fw_gap for s in result.steps if math.isfinite(s.fw_gap)]
    failed = [s.iteration + 1 for s in result.steps if not s.certified]  # counted from 1, as the progress lines
    out: dict[str, Any] = {"certified": bool(result.steps) and not failed, "fw_gap": max(gaps) if gaps else None,
                           "relative_gap": None, "gap_method": "every trust-region step's QP certified on its own",
                           "infeasibility": None}
    if failed:
        first = next(s for s in result.steps if not s.certified)
        why = f" (step {first.iteration + 1}: {first.why_not_certified})" if first.why_not_certified else ""
        out["reasons"] = [f"trust-region step(s) {failed} not certified{why}"]
    return out


def _first_reason(cert: Any) -> str | None:
    """The certificate's first reason not to certify, with its hint that an absolute tolerance could
    accept ``J* ~ 0`` where it gives one (``None`` when it certifies)."""
    reasons = cert.reasons()
    if not reasons:
        return None
    hint = next((r for r in reasons[1:] if "abs_tol" in r), None)
    return reasons[0] + (f"; {hint}" if hint else "")


__all__ = ["RidgeSelection", "SitesTrustRegion", "TrustRegionConfig", "TrustRegionLayerRecord", "TrustRegionResult",
           "TrustRegionStep", "holdout_count", "no_holdout_error", "sequential_trust_region", "split_tasks", "trust_region_set", "trust_region_sites"]
