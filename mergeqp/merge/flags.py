"""Warnings a merge report must carry (issue #14): a merged model that is worse than the base on
a held-out metric, and layers whose residuals are zero.

Both functions return notes (plain sentences) for the report's ``notes`` list; they never
raise for a bad merge -- the model is still written, the report says what is wrong with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ..output_metrics import OUTPUT_METRICS


def _finite(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def heldout_regression_notes(evaluation: Mapping[str, Any], metric: str = "euclidean") -> list[str]:
    """Notes for every task whose held-out MSE is higher (worse) for the merged model than for
    the base, and for a calibration objective that rose. ``evaluation``: the report's
    ``{"base": {"heldout_mse": {task: mse}, "calibration_objective": J}, "merged": {...}}``
    (MSE per logit, objective in units of squared output). For classifiers (``heldout_accuracy``
    of each task's head in both) the held-out accuracy is compared instead of the MSE: lower is
    worse. A merge optimised for another output ``metric`` is judged by that metric's held-out
    measure where both have it (``cross_entropy``: the held-out cross-entropy; ``kl``: the held-out
    KL divergence from the fine-tunes), not by an MSE its user did not ask for. Missing entries give
    no note."""
    base, merged = evaluation.get("base") or {}, evaluation.get("merged") or {}
    notes: list[str] = []
    entry = OUTPUT_METRICS.get(metric)  # its ``regression``: the held-out measure that judges its merges
    key_of_metric = None if entry is None else entry.regression
    if base.get("heldout_accuracy") and merged.get("heldout_accuracy"):
        key, what, sign = "heldout_accuracy", "held-out accuracy is lower", -1.0
    elif key_of_metric is not None and base.get(key_of_metric[0]) and merged.get(key_of_metric[0]):
        (key, what), sign = key_of_metric, 1.0
    else:
        key, what, sign = "heldout_mse", "held-out MSE is higher", 1.0
    b_val, m_val = base.get(key) or {}, merged.get(key) or {}
    worse = []
    for task, b in b_val.items():
        bv, mv = _finite(b), _finite(m_val.get(task))
        if bv is not None and mv is not None and sign * (mv - bv) > 0:
            worse.append(f"{task} {bv:.4g} -> {mv:.4g}")
    if worse:
        notes.append(f"WORSE THAN THE BASE: the merged model's {what} than the base model's "
                     f"on {len(worse)} of {len(b_val)} task(s): {'; '.join(worse)}")
    classifier_ce = key == "heldout_accuracy" and metric == "cross_entropy"
    if key == "heldout_cross_entropy" or classifier_ce:
        # the data (next tokens, or a classifier's labels) judged it: say where it left the fine-tunes (a classifier's
        # merge had no such note, a review of stop 75)
        bm, mm = base.get("heldout_mse") or {}, merged.get("heldout_mse") or {}
        apart = [t for t in bm if _finite(bm[t]) is not None and _finite(mm.get(t)) is not None
                 and float(mm[t]) > float(bm[t])]
        if apart:
            fits, judge, other = (("the calibration labels through each task's head", "accuracy", "euclidean")
                                  if classifier_ce else ("the prompts' own next tokens", "cross-entropy", "kl"))
            notes.append(f"the merged model's held-out MSE to the fine-tunes is above the base's on {len(apart)} of "
                         f"{len(bm)} task(s) ({', '.join(apart)}): metric cross_entropy fits {fits}, not the "
                         f"fine-tunes' outputs, and may move the model away from them (judge it by the held-out "
                         f"{judge}, or use metric {other} to stay near the fine-tunes)")
    bj, mj = _finite(base.get("calibration_objective")), _finite(merged.get("calibration_objective"))
    if bj is not None and mj is not None and mj > bj:
        notes.append(f"WORSE THAN THE BASE: the merged model's calibration objective is higher than the base "
                     f"model's ({bj:.6g} -> {mj:.6g})")
    return notes


def zero_residual_notes(layer: str, residual_norms: Sequence[float], model_names: Sequence[str]) -> list[str]:
    """Notes for a layer whose residuals ``delta_k = W_k - W_base`` are zero: for every model
    (the layer has nothing to merge: it keeps the base weight and its coefficients mean
    nothing), or for some models (their coefficients have no effect). ``residual_norms``: the
    Frobenius norm of each model's residual at ``layer``, in the order of ``model_names``."""
    if len(residual_norms) != len(model_names):
        raise ValueError(f"{len(residual_norms)} residual norms for {len(model_names)} models")
    zero = [name for name, norm in zip(model_names, residual_norms) if float(norm) == 0.0]
    if not zero:
        return []
    if len(zero) == len(model_names):
        return [f"layer {layer}: every model's residual is zero (the fine-tuned weights equal the base's): "
                f"there is nothing to merge; the layer keeps the base weight and its coefficients d are arbitrary"]
    return [f"layer {layer}: the residual of {', '.join(repr(z) for z in zero)} is zero (its weight equals the "
            f"base's), so its coefficients have no effect"]


__all__ = ["heldout_regression_notes", "zero_residual_notes"]
