"""What output of a Hugging Face model a merge compares, its targets, and the objective measured on
a model (the output metrics themselves are entries of :mod:`mergeqp.output_metrics`).

One responsibility per module:

- :mod:`.spec`: :class:`OutputSpec`, which output is compared, restricted (``topk``,
  ``projection``), pooled and sketched, and through which metric (the module's docstring
  derives each metric);
- :mod:`.heads`: the models' parts (the linear output head and the backbone that feeds it, a
  task's :class:`ClassifierHead`), running a batch, stored precisions;
- :mod:`.targets`: teacher-forced targets (:class:`TargetBatch`, :func:`teacher_forced_targets`,
  :class:`HeadTargets`) and the labels of a data metric;
- :mod:`.fold`: folding the linear head into the metric (:class:`FoldedHead`, :func:`fold_decision`);
- :mod:`.objective`: the calibration objective measured exactly (:func:`squared_error`) and the
  held-out metrics (:func:`teacher_forced_metrics`, :func:`classification_metrics`);
- :mod:`.expansion`: the cross-entropy's Gauss-Newton model at the current model
  (:class:`CrossEntropyExpansion`).

Every public name is re-exported here (``from mergeqp.lm import OutputSpec``).
"""

from __future__ import annotations

from ..output_metrics import POOLS, kl_whiten
from .expansion import CrossEntropyExpansion
from .fold import FoldedHead, fold_decision, head_identity, prepare_fold
from .heads import (
    ClassifierHead,
    agree,
    backbone,
    forward,
    last_hidden,
    linear_head,
    narrower_floats,
    stored_precision,
)
from .objective import (
    COMPARED_CHUNK_BYTES,
    HeldoutMetrics,
    classification_metrics,
    compared_rows,
    data_logits,
    head_log_likelihood,
    head_logits,
    objective_fold,
    squared_error,
    teacher_forced_metrics,
    teacher_forced_mse,
    token_nll,
)
from .spec import MAX_SKETCH_ENTRIES, RESTRICTIONS, OutputSpec, apply_mask, mean_pool
from .targets import (
    HEAD_TARGETS_MIN_RATIO,
    KEPT_AS_HIDDEN,
    HeadTargets,
    TargetBatch,
    TargetsNeed,
    class_labels,
    keeps_head_targets,
    label_targets,
    next_token_labels,
    target_bytes,
    teacher_forced_targets,
)

__all__ = [
    "COMPARED_CHUNK_BYTES", "HEAD_TARGETS_MIN_RATIO", "KEPT_AS_HIDDEN", "MAX_SKETCH_ENTRIES", "POOLS", "RESTRICTIONS",
    "ClassifierHead", "CrossEntropyExpansion", "FoldedHead", "HeadTargets", "HeldoutMetrics", "OutputSpec",
    "TargetBatch", "TargetsNeed", "agree", "apply_mask", "backbone", "class_labels", "classification_metrics",
    "compared_rows", "data_logits", "fold_decision", "forward", "head_identity", "head_log_likelihood",
    "head_logits", "keeps_head_targets", "kl_whiten", "label_targets", "last_hidden", "linear_head", "mean_pool",
    "narrower_floats", "next_token_labels", "objective_fold", "prepare_fold", "squared_error", "stored_precision",
    "target_bytes", "teacher_forced_metrics", "teacher_forced_mse", "teacher_forced_targets", "token_nll",
]
