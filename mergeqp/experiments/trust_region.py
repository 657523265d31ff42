"""``qp_tr``: sequential convex QPs with a trust region, for merges where the first-order
linearisation at the base model stops being accurate (e.g. a ReLU after the merge layer).

The merge QP ``J(d)`` linearises the model at the *base* weights. Its optimum can lie where the
linearisation is poor: its linearised objective falls while the merged model's true error
does not. :func:`sequential_trust_region` instead minimises the true objective ``F(d)`` (the
calibration squared error of the merged nonlinear model) by a sequence of QPs:

1. at the current point ``d_t``, build the QP ``J_t`` linearised at the merged model ``d_t``
   (residual directions ``delta_k = W_k - W_base`` and targets unchanged, so ``J_t(d_t) =
   F(d_t)`` and ``grad J_t(d_t) = grad F(d_t)``);
2. solve ``min J_t(d) (+ ridge ||d - d_ref||^2)`` over ``C intersect {||d - d_t||_inf <=
   Delta}`` (for a box ``C`` this is again a box) and certify the solution like any other QP;
3. ``rho = (F(d_t) - F(d_new)) / (J_t(d_t) - J_t(d_new))`` (true over predicted decrease);
   accept ``d_new`` when ``rho > accept``; double ``Delta`` when ``rho > expand_above`` and the
   step reached the trust-region boundary, halve it when ``rho < shrink_below``;
4. stop after ``max_qps`` QP solves, when the predicted decrease is below ``tol * F(d_t)``,
   or when ``Delta < delta_min``.

Every accepted step lowers ``F``: the result is never worse than the start (the soup by
default) on the calibration objective.

:func:`trust_region_merge` applies this to PyTorch models at one ``nn.Linear`` layer through
:func:`mergeqp.stats.collect_statistics` (``reference_model=base`` keeps the original deltas,
``targets="finetuned"`` the original targets, ``problem(offset=d_t)`` expresses the QP in
absolute ``d``). The loop itself only needs two callables, so other producers of linearised
QPs (multi-layer, Hugging Face) can reuse it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from ..constraints import Box, as_constraint_set
from ..errors import ValidationError
from ..problem import MergeQP
from ..solvers.registry import solve
from ..stats import apply_merge, collect_statistics
from ..stats.apply import layer_deltas
from ..stats.data import checked_call, iterate_batches, split_batch
from ..stats.linearise import flatten_output, resolve_output_fn
from ..stats.parametrisation import as_parametrisation


@dataclass(frozen=True)
class TrustRegionConfig:
    """Settings of :func:`sequential_trust_region` (defaults = the prototype in issue 5).

    ``delta0``: initial trust-region radius (units of ``d``, infinity norm); ``max_qps``: QP
    solves in all (accepted or not); ``accept``: smallest ``rho`` for accepting a step;
    ``expand_above`` / ``shrink_below``: ``rho`` thresholds for multiplying ``Delta`` by
    ``expand`` / ``shrink``; ``delta_min`` / ``delta_max``: radius limits; ``tol``: stop when
    the predicted decrease is below ``tol * F(d_t)``; ``ridge``: weight ``mu >= 0`` of a
    proximal term ``mu ||d - ridge_reference||^2`` added to both the QPs and the true objective
    (``ridge_reference`` ``None``: the soup ``1/K``).
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

    def to_dict(self) -> dict[str, Any]:
        return {k: _json_float(v) for k, v in asdict(self).items()}


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
) -> TrustRegionResult:
    """Minimise ``true_objective`` over ``constraints`` by trust-region QPs (module docstring).

    ``linearise(d)``: the QP linearised at the point ``d`` (``(K, n_atoms)``), in absolute ``d``
    (its value at ``d`` should equal ``true_objective(d)``); ``true_objective(d)``: the true
    objective (float). ``d0`` must be feasible. Each subproblem is solved with
    :func:`mergeqp.solve` (``solver``, ``solver_options``) and certified.
    """
    from tqdm.auto import tqdm


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

    t_start = time.perf_counter()
    f_d = merit(d)
    start = f_d
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
                                             sol.solver, time.perf_counter() - t0))
                stop = "predicted decrease below tol (stationary within the trust region)"
                bar.update(1)
                break
            f_new = merit(d_new)
            rho = (f_d - f_new) / predicted
            accepted = bool(rho > cfg.accept)
            step_norm = float(np.max(np.abs(d_new - d)))
            steps.append(TrustRegionStep(len(steps), delta, f_d, float(predicted), f_new, float(rho),
                                         accepted, step_norm, float(cert.fw_gap),
                                         bool(cert.certified()), sol.solver, time.perf_counter() - t0))
            bar.update(1)
            bar.set_postfix(F=f"{f_d:.5g}", rho=f"{rho:.2f}", delta=f"{delta:.3g}")
            on_boundary = step_norm >= delta * (1 - 1e-6)
            if rho < cfg.shrink_below:
                delta *= cfg.shrink
            elif rho > cfg.expand_above and on_boundary:
                delta = min(delta * cfg.expand, cfg.delta_max)
            if accepted:
                d, f_d = d_new, f_new
                problem = None
            if delta < cfg.delta_min:
                stop = f"trust-region radius below delta_min ({cfg.delta_min:g})"
                break
    finally:
        bar.close()
    return TrustRegionResult(d=d, objective=f_d, start_objective=start, steps=tuple(steps),
                             stop_reason=stop, seconds=time.perf_counter() - t_start, config=cfg,
                             last_problem=problem)


def _box_bounds(region: Any, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    bounds = _bounds_only(region, d.shape)
    if bounds is not None:
        return bounds
    return np.full(d.shape, -np.inf), np.full(d.shape, np.inf)


# ---------------------------------------------------------------------------- models
def calibration_targets(finetuned_models: Sequence[Any], calibration: Sequence[Any],
                        output_fn: Callable[..., Any] | None = None, batch_size: int = 256) -> list[list[Any]]:
    """Per task, per batch: the task's fine-tuned model's compared output (``(B, c)`` float64).

    ``calibration`` as for :func:`mergeqp.stats.collect_statistics` (K sets; each must be
    re-iterable: a tensor or a list of batches)."""
    import torch

    out_fn = resolve_output_fn(output_fn)
    targets = []
    for t, (model, source) in enumerate(zip(finetuned_models, calibration)):
        per_batch = []
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for i, batch in enumerate(iterate_batches(source, batch_size, f"task {t}")):
                    inputs, _ = split_batch(batch, f"task {t} batch {i}")
                    out = out_fn(checked_call(model, inputs, f"task {t} batch {i}"), t)
                    per_batch.append(flatten_output(out, out.shape[0], f"task {t}").to(torch.float64))
        finally:
            model.train(was_training)
        targets.append(per_batch)
    return targets


def calibration_error(model: Any, calibration: Sequence[Any], targets: Sequence[Sequence[Any]],
                      output_fn: Callable[..., Any] | None = None, task_weights: Sequence[float] | None = None,
                      batch_size: int = 256) -> float:
    """``sum_t w_t sum_j ||h(x_j) - y_j||^2``: the true (nonlinear) calibration objective of
    ``model`` against ``targets`` (from :func:`calibration_targets`), in the units of ``J``."""
    import torch

    out_fn = resolve_output_fn(output_fn)
    w = [1.0] * len(targets) if task_weights is None else [float(x) for x in task_weights]
    total = 0.0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for t, source in enumerate(calibration):
                for i, batch in enumerate(iterate_batches(source, batch_size, f"task {t}")):
                    inputs, _ = split_batch(batch, f"task {t} batch {i}")
                    out = out_fn(checked_call(model, inputs, f"task {t} batch {i}"), t)
                    h = flatten_output(out, out.shape[0], f"task {t}").to(torch.float64)
                    total += w[t] * float(((h - targets[t][i]) ** 2).sum())
    finally:
        model.train(was_training)
    return total


def split_calibration(calibration: Sequence[Any], holdout_fraction: float, seed: int = 0,
                      batch_size: int = 256) -> tuple[list[Any], list[Any]]:
    """Split each task's calibration inputs at random into a fitting and a held-out part.

    Each set must yield tensor inputs (a tensor, or batches whose inputs are tensors; labels
    are dropped: ``qp_tr`` compares with the fine-tuned models' outputs). Returns two lists of
    K tensors; each part keeps at least one sample (so a set needs >= 2)."""
    import torch

    if not 0 < holdout_fraction < 1:
        raise ValidationError(f"holdout_fraction must lie in (0, 1), got {holdout_fraction}")
    gen = torch.Generator().manual_seed(int(seed))
    fit, held = [], []
    for t, source in enumerate(calibration):
        parts = []
        for i, batch in enumerate(iterate_batches(source, batch_size, f"task {t}")):
            inputs, _ = split_batch(batch, f"task {t} batch {i}")
            if not isinstance(inputs, torch.Tensor):
                raise ValidationError(
                    f"task {t} batch {i}: choosing the ridge weight on held-out samples needs tensor "
                    f"inputs, got {type(inputs).__name__}; pass ridge_candidates=None and a fixed "
                    "TrustRegionConfig.ridge instead")
            parts.append(inputs)
        x = torch.cat(parts) if parts else None
        n = 0 if x is None else int(x.shape[0])
        if n < 2:
            raise ValidationError(f"task {t}: {n} calibration sample(s); a held-out split needs >= 2")
        n_held = min(max(1, round(holdout_fraction * n)), n - 1)
        perm = torch.randperm(n, generator=gen)
        held.append(x[perm[:n_held]])
        fit.append(x[perm[n_held:]])
    return fit, held


def trust_region_merge(
    base_model: Any,
    finetuned_models: Sequence[Any],
    layer: str,
    calibration: Sequence[Any],
    *,
    parametrisation: Any = "rows",
    constraints: Any = None,
    d0: np.ndarray | None = None,
    config: TrustRegionConfig | None = None,
    output_fn: Callable[..., Any] | None = None,
    task_weights: Sequence[float] | None = None,
    solver: str = "auto",
    batch_size: int = 256,
    progress: bool = True,
    ridge_candidates: Sequence[float] | None = None,
    holdout_fraction: float = 0.25,
    seed: int = 0,
) -> TrustRegionResult:
    """``qp_tr`` on PyTorch models: trust-region QPs at ``layer`` (module docstring).

    ``parametrisation``: ``rows`` (default), ``scalar``, ``columns`` or a basis (``(r, p)``
    array or :class:`~mergeqp.stats.Basis`); ``constraints``: default ``Box(0, 1)``; ``d0``:
    default the soup ``1/K``; ``task_weights``: one weight per task (default 1, the plain sum).
    The true objective is the calibration squared error of the merged model against the
    fine-tuned models' outputs (``output_fn`` selects the compared output). Inputs are
    untouched; apply ``result.d`` with :func:`mergeqp.apply_merge`.

    ``ridge_candidates``: choose the ridge weight toward the soup instead of using
    ``config.ridge``: each task's calibration samples are split at random (``seed``) into a
    fitting part and a held-out ``holdout_fraction``; ``qp_tr`` runs on the fitting part once
    per candidate ``mu = relative * scale`` (``scale``: the mean diagonal of ``H`` at ``d0`` on
    the fitting part; include 0 for no ridge), and the ``mu`` whose merge has the lowest true
    error on the held-out part is used for the final run on all samples
    (``result.ridge_selection`` records the table). Cost: one ``qp_tr`` run per candidate.
    """

    finetuned_models = list(finetuned_models)
    K = len(finetuned_models)
    if len(calibration) != K:
        raise ValidationError(f"calibration has {len(calibration)} sets for {K} fine-tuned models")
    cset = as_constraint_set(Box(0.0, 1.0) if constraints is None else constraints)
    param = as_parametrisation(parametrisation)
    targets = calibration_targets(finetuned_models, calibration, output_fn, batch_size)

    def model_at(d: np.ndarray) -> Any:
        return apply_merge(base_model, finetuned_models, layer, d, param)

    def linearise(d: np.ndarray) -> MergeQP:
        stats = collect_statistics(
            model_at(d), finetuned_models, layer, calibration, targets="finetuned",
            output_fn=output_fn, parametrisations=[param], reference_model=base_model,
            batch_size=batch_size, progress=False,
        )
        return stats.problem(param, task_weights=task_weights, offset=d)

    def true_objective(d: np.ndarray) -> float:
        return calibration_error(model_at(d), calibration, targets, output_fn, task_weights, batch_size)

    if d0 is None:

        _, deltas, _ = layer_deltas(base_model, finetuned_models, layer)
        d0 = np.full((K, param.n_atoms(deltas.shape[1], deltas.shape[2])), 1.0 / K)
    d0 = np.asarray(d0, dtype=np.float64)
    cfg = config or TrustRegionConfig()
    selection = None
    if ridge_candidates is not None:
        selection = _select_ridge(base_model, finetuned_models, layer, calibration, cfg, d0,
                                  ridge_candidates, holdout_fraction, seed, param=param, cset=cset,
                                  output_fn=output_fn, task_weights=task_weights, solver=solver,
                                  batch_size=batch_size, progress=progress)
        cfg = replace(cfg, ridge=selection.chosen)
    result = sequential_trust_region(linearise, true_objective, cset, d0, cfg, solver=solver,
                                     progress=progress)
    return result if selection is None else replace(result, ridge_selection=selection)


def _select_ridge(base_model: Any, finetuned_models: list[Any], layer: str, calibration: Sequence[Any],
                  cfg: TrustRegionConfig, d0: np.ndarray, candidates: Sequence[float],
                  holdout_fraction: float, seed: int, *, param: Any, cset: Any,
                  output_fn: Callable[..., Any] | None, task_weights: Sequence[float] | None,
                  solver: str, batch_size: int, progress: bool) -> RidgeSelection:
    """The held-out choice of the ridge weight (see :func:`trust_region_merge`)."""

    relative = tuple(float(r) for r in candidates)
    if not relative or not all(math.isfinite(r) and r >= 0 for r in relative):
        raise ValidationError(f"ridge_candidates must be a non-empty list of finite numbers >= 0, got {list(candidates)}")
    t0 = time.perf_counter()
    fit, held = split_calibration(calibration, holdout_fraction, seed, batch_size)
    held_targets = calibration_targets(finetuned_models, held, output_fn, batch_size)
    start = collect_statistics(
        apply_merge(base_model, finetuned_models, layer, d0, param), finetuned_models, layer, fit,
        targets="finetuned", output_fn=output_fn, parametrisations=[param], reference_model=base_model,
        batch_size=batch_size, progress=False,
    ).problem(param, task_weights=task_weights, offset=d0)
    assert start.H is not None
    scale = float(np.mean(np.diag(start.H))) if start.n else 0.0
    weights = tuple(r * scale for r in relative)
    errors = []
    for mu in weights:
        run = trust_region_merge(base_model, finetuned_models, layer, fit, parametrisation=param,
                                 constraints=cset, d0=d0, config=replace(cfg, ridge=mu),
                                 output_fn=output_fn, task_weights=task_weights, solver=solver,
                                 batch_size=batch_size, progress=progress)
        merged = apply_merge(base_model, finetuned_models, layer, run.d, param)
        errors.append(calibration_error(merged, held, held_targets, output_fn, task_weights, batch_size))
    best = min(range(len(weights)), key=lambda i: (errors[i], weights[i]))
    return RidgeSelection(relative=relative, weights=weights, scale=scale, heldout_errors=tuple(errors),
                          chosen=weights[best], holdout_fraction=float(holdout_fraction),
                          n_fit=tuple(int(x.shape[0]) for x in fit),
                          n_heldout=tuple(int(x.shape[0]) for x in held),
                          seconds=time.perf_counter() - t0)
