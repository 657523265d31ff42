"""Evaluation of merged classifiers per task: logit MSE against the task's fine-tuned model,
accuracy and cross-entropy on held-out data, and the calibration objective (true and
linearised).

Units: ``mse`` is the mean over samples *and* logits of ``(h_merged - h_finetuned)^2``;
``cross_entropy`` the mean negative log-likelihood of the true label (nats); ``accuracy`` the
fraction of samples whose arg-max logit (over all classes) is the label. The calibration
``true`` error is ``sum_j ||h_merged(x_j) - y_j||^2`` over every calibration sample (the units
of the QP objective ``J``), and ``linearised`` is ``J(d)`` of the QP for points of the QP.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .models import logits_of


def task_metrics(logits: torch.Tensor, reference_logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """``{mse, accuracy, cross_entropy}`` of ``logits`` ``(n, c)`` against the fine-tuned
    model's ``reference_logits`` ``(n, c)`` and the integer ``labels`` ``(n,)``."""
    logits = logits.to(torch.float64)
    reference_logits = reference_logits.to(torch.float64)
    return {
        "mse": float(((logits - reference_logits) ** 2).mean()),
        "accuracy": float((logits.argmax(1) == labels).to(torch.float64).mean()),
        "cross_entropy": float(torch.nn.functional.cross_entropy(logits, labels)),
    }


def evaluate_model(model: torch.nn.Module, task_names: Sequence[str], inputs: Sequence[torch.Tensor],
                   labels: Sequence[torch.Tensor], reference_logits: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Per-task metrics and their unweighted average over tasks:
    ``{"tasks": {task: {mse, accuracy, cross_entropy}}, "average": {...}}``."""
    tasks = {
        name: task_metrics(logits_of(model, x), ref, y)
        for name, x, y, ref in zip(task_names, inputs, labels, reference_logits)
    }
    return {"tasks": tasks, "average": average_metrics(tasks)}


def average_metrics(tasks: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    keys = next(iter(tasks.values())).keys()
    return {k: float(np.mean([m[k] for m in tasks.values()])) for k in keys}


def per_model_reference(finetuned: Sequence[torch.nn.Module], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each task's fine-tuned model's logits on that task's inputs."""
    return [logits_of(m, x) for m, x in zip(finetuned, inputs)]


def finetuned_metrics(task_names: Sequence[str], finetuned: Sequence[torch.nn.Module],
                      inputs: Sequence[torch.Tensor], labels: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The reference point: every task evaluated with its own fine-tuned model (MSE 0)."""
    tasks = {}
    for name, m, x, y in zip(task_names, finetuned, inputs, labels):
        logits = logits_of(m, x)
        tasks[name] = task_metrics(logits, logits, y)
    return {"tasks": tasks, "average": average_metrics(tasks)}
