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
   step reached the trust-region boundary, halve the smaller of it and the step's length when
   ``rho < shrink_below``;
4. stop after ``max_qps`` QP solves, when the predicted decrease is below ``tol * F(d_t)``,
   or when ``Delta < delta_min``.

Every accepted step lowers ``F``: the result is never worse than the start (the soup by
default) on the calibration objective.

:func:`trust_region_merge` applies this to PyTorch models at one ``nn.Linear`` layer through
:func:`mergeqp.stats.collect_statistics` (``reference_model=base`` keeps the original deltas,
``targets="finetuned"`` the original targets, ``problem(offset=d_t)`` expresses the QP in
absolute ``d``). The loop itself (:func:`sequential_trust_region`, its config, result and step
records, :func:`trust_region_set`) lives in :mod:`mergeqp.merge.trust_region`, where the
``trust_region`` merge mode of Hugging Face merges uses it too; it is re-exported here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from ..constraints import Box, as_constraint_set
from ..errors import ValidationError
from ..merge.trust_region import (
    RidgeSelection,
    TrustRegionConfig,
    TrustRegionResult,
    TrustRegionStep,
    sequential_trust_region,
    trust_region_set,
)
from ..problem import MergeQP
from ..stats import apply_merge, collect_statistics
from ..stats.apply import layer_deltas
from ..stats.data import checked_call, iterate_batches, split_batch
from ..stats.linearise import flatten_output, resolve_output_fn
from ..stats.parametrisation import as_parametrisation


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
    ridge_center: np.ndarray | None = None,
) -> TrustRegionResult:
    """``qp_tr`` on PyTorch models: trust-region QPs at ``layer`` (module docstring).

    ``parametrisation``: ``rows`` (default), ``scalar``, ``columns`` or a basis (``(r, p)``
    array or :class:`~mergeqp.stats.Basis`); ``constraints``: default ``Box(0, 1)``; ``d0``:
    default the soup (below); ``task_weights``: one weight per task (default 1, the plain sum).
    The true objective is the calibration squared error of the merged model against the
    fine-tuned models' outputs (``output_fn`` selects the compared output). Inputs are
    untouched; apply ``result.d`` with :func:`mergeqp.apply_merge`. "The soup" is the soup in the
    parametrisation's coordinates (``Parametrisation.task_vector_point``: ``1/K`` on every atom,
    but 0 on the baseline atoms of ``rows+baselines``, whose ``1/K`` would add the mean baseline
    residual; before stop 48 both defaults below were ``1/K`` on every atom there).

    ``ridge_candidates``: choose the ridge weight toward the soup instead of using
    ``config.ridge``: each task's calibration samples are split at random (``seed``) into a
    fitting part and a held-out ``holdout_fraction``; ``qp_tr`` runs on the fitting part once
    per candidate ``mu = relative * scale`` (``scale``: the mean diagonal of ``H`` at ``d0`` on
    the fitting part; include 0 for no ridge), and the ``mu`` whose merge has the lowest true
    error on the held-out part is used for the final run on all samples
    (``result.ridge_selection`` records the table). Cost: one ``qp_tr`` run per candidate.

    ``ridge_center``: the point (``(K, n_atoms)``) the ridge pulls toward, e.g. the start ``d0``
    (a baseline point of ``rows+baselines``); ``None``: ``config.ridge_reference``, or the soup
    when that is ``None``. The held-out ridge choice pulls toward the same point.
    Then ``mu ||d - ridge_center||^2`` is added to every QP and to the true objective (so the
    reported objectives include it, as with the built-in ridge).
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

    cfg = config or TrustRegionConfig()
    if d0 is None or (ridge_center is None and cfg.ridge_reference is None):
        # the soup in this parametrisation's coordinates (rows+baselines: rows 1/K, baseline atoms 0)
        _, deltas, _ = layer_deltas(base_model, finetuned_models, layer)
        soup = param.task_vector_point(K, deltas.shape[1], deltas.shape[2], 1.0 / K)
        if d0 is None:
            d0 = soup
        if ridge_center is None and cfg.ridge_reference is None and not np.all(soup == 1.0 / K):
            ridge_center = soup  # (1/K on every atom is sequential_trust_region's own default)
    d0 = np.asarray(d0, dtype=np.float64)
    selection = None
    if ridge_candidates is not None:
        selection = _select_ridge(base_model, finetuned_models, layer, calibration, cfg, d0,
                                  ridge_candidates, holdout_fraction, seed, param=param, cset=cset,
                                  output_fn=output_fn, task_weights=task_weights, solver=solver,
                                  batch_size=batch_size, progress=progress, ridge_center=ridge_center)
        cfg = replace(cfg, ridge=selection.chosen)
    if ridge_center is not None and cfg.ridge > 0:
        linearise, true_objective = _ridge_toward(linearise, true_objective, ridge_center, cfg.ridge)
        cfg = replace(cfg, ridge=0.0)
    result = sequential_trust_region(linearise, true_objective, cset, d0, cfg, solver=solver,
                                     progress=progress)
    return result if selection is None else replace(result, ridge_selection=selection)


def _ridge_toward(linearise: Callable[[np.ndarray], MergeQP], true_objective: Callable[[np.ndarray], float],
                  center: np.ndarray, mu: float) -> tuple[Callable[[np.ndarray], MergeQP], Callable[[np.ndarray], float]]:
    """``linearise`` and ``true_objective`` plus ``mu ||d - center||^2`` (``center`` ``(K, n_atoms)``)."""
    c0 = np.asarray(center, dtype=np.float64)

    def linearise_ridge(d: np.ndarray) -> MergeQP:
        return linearise(d).regularised(mu, c0)

    def true_ridge(d: np.ndarray) -> float:
        return true_objective(d) + mu * float(np.sum((np.asarray(d) - c0) ** 2))

    return linearise_ridge, true_ridge


def _select_ridge(base_model: Any, finetuned_models: list[Any], layer: str, calibration: Sequence[Any],
                  cfg: TrustRegionConfig, d0: np.ndarray, candidates: Sequence[float],
                  holdout_fraction: float, seed: int, *, param: Any, cset: Any,
                  output_fn: Callable[..., Any] | None, task_weights: Sequence[float] | None,
                  solver: str, batch_size: int, progress: bool,
                  ridge_center: np.ndarray | None = None) -> RidgeSelection:
    """The held-out choice of the ridge weight (see :func:`trust_region_merge`), each candidate
    pulling toward the same ``ridge_center`` as the final run."""

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
                                 batch_size=batch_size, progress=progress, ridge_center=ridge_center)
        merged = apply_merge(base_model, finetuned_models, layer, run.d, param)
        errors.append(calibration_error(merged, held, held_targets, output_fn, task_weights, batch_size))
    best = min(range(len(weights)), key=lambda i: (errors[i], weights[i]))
    return RidgeSelection(relative=relative, weights=weights, scale=scale, heldout_errors=tuple(errors),
                          chosen=weights[best], holdout_fraction=float(holdout_fraction),
                          n_fit=tuple(int(x.shape[0]) for x in fit),
                          n_heldout=tuple(int(x.shape[0]) for x in held),
                          seconds=time.perf_counter() - t0)


__all__ = ["RidgeSelection", "TrustRegionConfig", "TrustRegionResult", "TrustRegionStep", "calibration_error",
           "calibration_targets", "sequential_trust_region", "split_calibration", "trust_region_merge",
           "trust_region_set"]
