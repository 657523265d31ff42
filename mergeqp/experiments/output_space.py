"""``output_space``: the full-matrix output-space merge of one layer of PyTorch models, by
damped Gauss-Newton steps from a start (RegMean's merge in the MNIST experiment).

Each step linearises the model at the current merged layer ``W_t`` (per-sample Jacobians of the
compared outputs and layer inputs from :func:`mergeqp.stats.collect_statistics` with
``keep_samples=True``; targets the fine-tunes' outputs, so the linearised error at ``W_t`` is
the true calibration error) and solves :func:`mergeqp.merge.output_space.output_space_solve`
for the free matrix ``W = W_t + E`` with the ridge ``mu ||W - W_start||_F^2`` toward the
start (``mu = ridge x`` the mean diagonal of the first step's normal operator). A step is
accepted only when the merged model's true calibration error falls; otherwise ``mu`` is
multiplied by 10 and the step retried (Levenberg-Marquardt). So the result's true calibration
error is never above the start's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ValidationError
from ..merge.output_space import samples_from_stats
from ..merge.output_space_damped import DampedStep, DampingOptions, damped_output_space
from ..stats import collect_statistics
from ..stats.apply import set_linear_weights
from ..stats.hooks import augmented_weight, resolve_linear
from .trust_region import calibration_error, calibration_targets


@dataclass(frozen=True)
class OutputSpaceConfig:
    """``ridge``: relative weight ``lambda`` of the ridge toward the start; ``prox``: the relative
    weight ``nu`` of the first step's proximal term toward the current point (Levenberg-Marquardt
    damping: divided by ``relax`` after an accepted step, multiplied by ``damping`` after a
    rejected one); ``steps``: Gauss-Newton solves at most (rejected ones included); ``tol``:
    stop when an accepted step lowers the regularised true error by less than ``tol`` times it;
    ``cg_tol`` / ``cg_iterations``: each solve's CG tolerance and iteration cap."""

    ridge: float = 0.1
    prox: float = 16.0
    steps: int = 60
    tol: float = 1e-4
    damping: float = 4.0
    relax: float = 1.5
    cg_tol: float = 1e-9
    cg_iterations: int = 1000

    def __post_init__(self) -> None:
        if (not self.ridge >= 0 or not self.prox > 0 or self.steps < 1 or not self.tol >= 0
                or not self.damping > 1 or not self.relax >= 1 or not self.cg_tol > 0 or self.cg_iterations < 1):
            raise ValidationError(f"output_space config: need ridge >= 0, prox > 0, steps >= 1, tol >= 0, "
                                  f"damping > 1, relax >= 1, cg_tol > 0, cg_iterations >= 1; got {self}")


@dataclass(frozen=True, eq=False)
class OutputSpaceResult:
    """The merged model, its augmented layer weight ``(r, m1)``, the start's and the final true
    calibration errors, the ridge scale (``mu = ridge x scale``) and the steps."""

    model: Any
    weight: np.ndarray
    start_error: float
    error: float
    ridge: float
    scale: float
    steps: tuple[DampedStep, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {"start_error": self.start_error, "error": self.error, "ridge": self.ridge, "scale": self.scale,
                "steps": [s.record("mu") for s in self.steps],
                "accepted": sum(s.accepted for s in self.steps)}


def _augmented(model: Any, layer: str) -> np.ndarray:
    return augmented_weight(resolve_linear(model, layer, "model"))


def output_space_merge(start_model: Any, finetuned_models: Sequence[Any], layer: str, calibration: Sequence[Any],
                       config: OutputSpaceConfig | None = None, *, task_weights: Any = None) -> OutputSpaceResult:
    """Levenberg-Marquardt output-space merge of ``layer`` (module docstring) from
    ``start_model`` (a model of the fine-tunes' architecture, e.g. RegMean's merge): minimises
    ``G(W) = F(W) + lambda ||W - W_start||_F^2`` (``F`` the true calibration error) by steps
    that each minimise the linearised ``F`` plus that ridge plus ``nu ||W - W_t||_F^2``.
    ``calibration``: K sets of inputs, one per fine-tuned model (as for
    :func:`mergeqp.stats.collect_statistics`). Never above the start's ``G`` (= its ``F``)."""
    cfg = config or OutputSpaceConfig()
    fts = list(finetuned_models)
    targets = calibration_targets(fts, calibration)
    weights = None if task_weights is None else list(task_weights)
    start_weight = _augmented(start_model, layer)
    has_bias = resolve_linear(start_model, layer, "model").bias is not None
    start_error = calibration_error(start_model, calibration, targets, task_weights=weights)

    def at(W: np.ndarray) -> Any:  # a copy of the start model with the layer at W
        return set_linear_weights(start_model, layer, W[:, :-1] if has_bias else W, W[:, -1] if has_bias else None)

    @contextmanager
    def linearised(W: np.ndarray) -> Iterator[tuple[Any, bool]]:
        model = start_model if np.array_equal(W, start_weight) else at(W)
        stats = collect_statistics(model, fts, layer, calibration, targets="finetuned", parametrisations=(),
                                   keep_samples=True, progress=False)
        yield samples_from_stats(stats, task_weights), True  # formed: valid after a rejected step too

    def true_error(W: np.ndarray) -> float:
        return calibration_error(at(W), calibration, targets, task_weights=weights)

    damped = damped_output_space(start_weight, start_error, linearised, true_error, DampingOptions(
        ridge=cfg.ridge, prox=cfg.prox, damping=cfg.damping, relax=cfg.relax, steps=cfg.steps, tol=cfg.tol,
        cg_tol=cfg.cg_tol, max_iter=cfg.cg_iterations))
    W = damped.W
    current = start_model if not damped.accepted else at(W)
    return OutputSpaceResult(model=current, weight=W, start_error=start_error, error=damped.error, ridge=cfg.ridge,
                             scale=float(damped.scale), steps=damped.steps)
