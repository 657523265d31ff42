"""The calibration-statistics capability of Fisher and RegMean (what ``mergeqp merge`` collects for them).

Each is a :class:`~mergeqp.merge.method.CalibrationStatistics` attached to the registered method
(:mod:`.registry`); :class:`~mergeqp.merge.calibrated.StatisticsCollector` drives it. See
:mod:`.calibrated` for why Fisher uses ``argmax`` labels and which tokens count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ValidationError
from .fisher import compute_fisher
from .method import CalibrationStatistics
from .batches import n_examples
from .regmean import gram_rows


#: the entry of a Fisher statistics dict holding its number of examples (the unit it averages over)
FISHER_COUNT = "#examples"
#: suffix of the entry holding a RegMean Gram matrix's number of rows
GRAM_ROWS = "#rows"


def _fisher_collect(collector: Any, model: Any, inputs: list[dict[str, Any]], label: str) -> tuple[dict[str, Any], str]:
    import torch  # optional heavy dependency: only called with a loaded model

    stats = _fisher(collector, model, inputs, label) if collector.fisher_names else {}
    what = f"diagonal Fisher of {len(stats)} tensor(s)"
    if stats:  # what compute_fisher divides by: examples, or batches for the batch estimator
        units = len(inputs) if collector.parsed.estimator == "batch" else \
            sum(n_examples(b, f"{label} calibration batch {i}") for i, b in enumerate(inputs))
        stats[FISHER_COUNT] = torch.tensor(float(units), dtype=torch.float64)
    return stats, what


#: the start of the note of a Fisher whose per-example gradients fell back from vmap to a loop
VMAP_FALLBACK = "fisher: torch.func.vmap cannot trace "


def _fisher(collector: Any, model: Any, inputs: list[dict[str, Any]], label: str) -> dict[str, Any]:
    p = collector.parsed
    kwargs = {"names": collector.fisher_names, "estimator": p.estimator, "chunk_size": p.chunk_size, "label": label,
              "log_likelihood": collector.heads.get(label)}
    if p.per_example != "vmap" or p.estimator != "per_example":
        return compute_fisher(model, inputs, per_example=p.per_example, **kwargs)
    # torch.func.vmap trips over data-dependent checks in some models: BERT's with an attention
    # mask, GPT-2's without one (the masks are all ones here, so either form is the same model)
    unmasked = [{k: v for k, v in b.items() if k != "attention_mask"} for b in inputs]
    errors = []
    for attempt in (inputs, unmasked):
        try:
            return compute_fisher(model, attempt, per_example="vmap", **kwargs)
        except RuntimeError as exc:
            errors.append(str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__)
    if "per_example" in collector.params:
        raise ValidationError(f"Fisher of model {label!r}: torch.func.vmap cannot trace the model "
                              f"({errors[-1]}); set per_example: loop") from None
    note = (f"{VMAP_FALLBACK}this model ({errors[-1]}); per-example gradients "
            f"computed in a loop (per_example: loop)")
    if note not in collector.notes:
        collector.notes.append(note)
        collector.log(note)
    return compute_fisher(model, inputs, per_example="loop", **kwargs)


def _fisher_prepare(collector: Any, stats: list[dict[str, Any]], params: dict[str, Any]
                    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``normalize_fisher`` over all selected tensors at once (the result does not depend on the chunks)."""
    import torch  # optional heavy dependency: only the merge itself runs this

    stats = [{n: v for n, v in F.items() if n != FISHER_COUNT} for F in stats]
    if not collector.parsed.normalize_fisher:
        return stats, params
    out = []
    for F in stats:
        norm = float(torch.sqrt(sum((v ** 2).sum() for v in F.values()))) if F else 0.0
        out.append({n: v / norm for n, v in F.items()} if norm > 0 else F)
    return out, {**params, "normalize_fisher": False}


def _fisher_kwargs(collector: Any, stats: Sequence[dict[str, Any]], names: set[str]) -> dict[str, Any]:
    return {"fishers": [{n: F[n] for n in F if n in names} for F in stats]}


def _fisher_summary(collector: Any) -> dict[str, Any]:
    p = collector.parsed
    return {"statistic": "diagonal empirical Fisher, per example (one prompt), of the selected tensors",
            "labels": ("argmax of each task's classifier head on the fine-tuned model's pooled output" if collector.heads
                       else "argmax of the fine-tuned model's own logits at every real token (teacher forced)"),
            "estimator": p.estimator, "tensors": len(collector.fisher_names),
            # as computed: the parameters say vmap where the run fell back to a loop (stop 57 review)
            "per_example": ("loop (vmap could not trace the model)"
                            if any(n.startswith(VMAP_FALLBACK) for n in collector.notes) else p.per_example)}


def _fisher_nbytes(K: int, keys: Sequence[str], numel: Callable[[str], int], sites: Sequence[Any]) -> int:
    return K * 8 * sum(numel(k) for k in keys)


def _regmean_collect(collector: Any, model: Any, inputs: list[dict[str, Any]], label: str) -> tuple[dict[str, Any], str]:
    import torch  # optional heavy dependency: only called with a loaded model

    grams, rows = gram_rows(model, inputs, layers=collector.layers, label=label) if collector.layers else ({}, {})
    what = f"input Gram matrices of {len(grams)} linear layer(s)"
    return {**grams, **{n + GRAM_ROWS: torch.tensor(float(r), dtype=torch.float64) for n, r in rows.items()}}, what


def _regmean_kwargs(collector: Any, stats: Sequence[dict[str, Any]], names: set[str]) -> dict[str, Any]:
    return {"model": collector.skeleton, "grams": [{n: G[n] for n in G if f"{n}.weight" in names} for G in stats]}


def _regmean_summary(collector: Any) -> dict[str, Any]:
    return {"statistic": "input Gram matrices X'X/N of the selected linear layers (real tokens only)",
            "layers": list(collector.layers)}


def _regmean_nbytes(K: int, keys: Sequence[str], numel: Callable[[str], int], sites: Sequence[Any]) -> int:
    chosen = set(keys)
    return K * 8 * sum(s.m1 * s.m1 for s in sites if s.weight_key in chosen)


FISHER_STATISTICS = CalibrationStatistics(
    supplied=("model", "calibration", "fishers", "log_likelihood"),
    what="Fisher information",
    plan_line=("statistics: diagonal Fisher of the selected tensors per model on its calibration prompts "
               "(per prompt; labels = the model's own argmax at each real token)"),
    collect=_fisher_collect, merge_kwargs=_fisher_kwargs, summary=_fisher_summary, nbytes=_fisher_nbytes,
    prepare=_fisher_prepare, count_key=lambda name: FISHER_COUNT,
    # the batch estimator squares each batch's summed gradient: its value depends on the grouping
    pools=lambda collector: collector.parsed.estimator != "batch",
)

REGMEAN_STATISTICS = CalibrationStatistics(
    supplied=("model", "calibration", "grams"),
    what="Gram matrices",
    plan_line=("statistics: input Gram matrices of the selected linear layers per model on its calibration "
               "prompts (real tokens)"),
    collect=_regmean_collect, merge_kwargs=_regmean_kwargs, summary=_regmean_summary, nbytes=_regmean_nbytes,
    forward_only=True, count_key=lambda layer: layer + GRAM_ROWS,
)

__all__ = ["FISHER_STATISTICS", "REGMEAN_STATISTICS"]
