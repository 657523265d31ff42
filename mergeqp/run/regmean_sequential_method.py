"""``method: {name: regmean_sequential}``: RegMean whose Gram matrices are taken where the merged model runs.

RegMean (Jin et al., 2023) solves each linear layer for the weight whose outputs best match every
fine-tune's on that fine-tune's own inputs: ``W = (sum_k c_k W_k G_k)(sum_k c_k G_k)^(-1)`` with
``G_k`` the (shrunk) Gram matrix of the layer's inputs *as fine-tune k computes them* on its task's
prompts. Once the layers below are merged, the merged model feeds a layer other inputs than any
fine-tune did. This model method takes each ``G_k`` at the inputs the **merged model** gives the
layer on task k's prompts, merging the layers in the order the model runs them (the idea of
RegMean++, Nguyen et al., 2025): a layer's merge is the same closed-form least squares (a convex
QP without constraints), only over the inputs the merged model will see.

How it runs (:func:`sequential_statistics`): one forward pass on one batch finds the order in which
the model calls the merged layers and which of them read the same input tensor (a block's gate and
up projections, its query, key and value): those form a stage. Stage by stage, each task's
calibration batches (padding removed, as RegMean's statistics) run through the model with every
earlier stage merged, each pass stopped as soon as the stage's input is seen (the blocks above and
the output head never run; the blocks below every merged layer are computed once per batch, see
:mod:`mergeqp.stats.prefix`), and the stage is merged by RegMean with those Gram matrices
(:class:`~mergeqp.merge.calibrated.StatisticsCollector`, the run layer's own RegMean merge). Tensors
that are not weights of a linear layer (a norm a fine-tune changed) are averaged, as RegMean does,
and loaded before the first stage. With one merged layer, or layers whose inputs no other merged
layer changes, the result is RegMean's.

Also a candidate of ``start: auto`` (:data:`REGMEAN_SEQUENTIAL_RUN`'s ``start``), fitted on each
split's batches like RegMean. A layer the model calls more than once per forward pass (a module shared
across depth) is refused: its inputs depend on its own merge.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..errors import ValidationError, parse_params
from ..io.calibration import unpadded_inputs
from ..merge.batches import map_tensors, model_device, run_model
from ..merge.calibrated import StatisticsCollector
from ..merge.calibration_statistics import GRAM_ROWS
from ..merge.regmean import gram_rows
from ..merge.sites import LayerSite, model_sites, site_module
from ..stats.prefix import frozen_prefix
from .auto import SEQUENTIAL_MAX_STAGES, CandidateSkipped
from .model_method import CandidateContext, MethodOutcome, ModelMethod, RunContext, StartFit
from .report import Evaluation

NAME = "regmean_sequential"

#: the ``max_stages`` of ``method: auto``'s default candidates (:data:`mergeqp.run.auto.SEQUENTIAL_MAX_STAGES`)
DEFAULT_MAX_STAGES = SEQUENTIAL_MAX_STAGES

#: bytes of base tensors merged at once (the run layer's ``settings.CHUNK_BYTES``; the settings
#: import the config schema, which imports this method's registry)
CHUNK_BYTES = 512 * 2**20


class RegMeanSequentialParams(BaseModel):
    """``alpha``: the share of each Gram matrix kept off its diagonal (RegMean's, default 0.9).
    ``max_stages``: the most stages it runs (``None``: any number); with more, the merge is refused and a
    ``start: auto`` candidate skipped. Each stage passes every calibration batch through the model up to
    the stage (for a whole language model: about half a forward pass per stage, four stages per block),
    so ``method: auto``'s default candidates keep it to :data:`DEFAULT_MAX_STAGES`."""

    model_config = ConfigDict(extra="forbid")
    alpha: float = Field(0.9, ge=0.0, le=1.0)
    max_stages: int | None = Field(None, ge=1)


@dataclass(frozen=True)
class Stage:
    """Merged layers that read one input tensor (``sites``, in the order the model calls them)."""

    sites: tuple[LayerSite, ...]

    @property
    def keys(self) -> list[str]:
        return [k for s in self.sites for k in s.keys]

    @property
    def label(self) -> str:
        return ", ".join(s.name for s in self.sites)


def _first_inputs(inputs_per_task: Sequence[Sequence[Mapping[str, Any]]]) -> tuple[Mapping[str, Any], str]:
    for k, inputs in enumerate(inputs_per_task):
        if inputs:
            return inputs[0], f"{NAME}: task {k} calibration batch 0"
    raise ValidationError(f"{NAME}: no calibration batch to run the model on")


def stages_of(model: Any, sites: Sequence[LayerSite], inputs_per_task: Sequence[Sequence[Mapping[str, Any]]]
              ) -> list[Stage]:
    """The merged layers ``sites`` grouped into :class:`Stage` s in the order the model calls them, from
    one forward pass on the first batch: consecutive layers that receive the same input tensor share a
    stage. A layer called more than once per pass, or never, is refused (naming it)."""
    import torch

    calls: dict[str, list[Any]] = {s.name: [] for s in sites}
    order: list[str] = []

    def hook_for(name: str) -> Any:
        def hook(module: Any, args: tuple, kwargs: dict | None = None) -> None:
            x = args[0] if args else next(iter((kwargs or {}).values()))
            calls[name].append(x)
            order.append(name)
        return hook

    handles = [site_module(model, s).register_forward_pre_hook(hook_for(s.name)) for s in sites]
    inputs, where = _first_inputs(inputs_per_task)
    device = model_device(model)
    try:
        with torch.no_grad():
            run_model(model, None, map_tensors(inputs, lambda t: t.to(device)), where)
    finally:
        for h in handles:
            h.remove()
    for s in sites:
        n = len(calls[s.name])
        if n != 1:
            why = ("never runs on the calibration prompts" if n == 0 else
                   f"runs {n} times per forward pass (a module shared across the model): its inputs depend on its "
                   f"own merge")
            raise ValidationError(f"{NAME}: layer {s.name!r} {why}; merge it with regmean, or leave it out of "
                                  f"'layers'")
    by_name = {s.name: s for s in sites}
    stages: list[list[LayerSite]] = []
    previous = None
    for name in order:
        x = calls[name][0]
        if stages and x is previous:
            stages[-1].append(by_name[name])
        else:
            stages.append([by_name[name]])
        previous = x
    return [Stage(tuple(group)) for group in stages]


def stage_grams(model: Any, stage: Stage, inputs: Sequence[Mapping[str, Any]], where: str) -> dict[str, Any]:
    """RegMean's statistics of ``stage``'s layers on ``inputs`` as the live ``model`` computes them
    (:func:`mergeqp.merge.regmean.gram_rows`, each pass stopped at the stage's input): per layer the
    Gram matrix and its row count under ``name + "#rows"``, as the run layer's RegMean collects them."""
    import torch

    grams, rows = gram_rows(model, inputs, layers=[s.name for s in stage.sites], label=where, stop_early=True)
    return {**grams, **{n + GRAM_ROWS: torch.tensor(float(r), dtype=torch.float64) for n, r in rows.items()}}


def too_many_stages(stages: Sequence[Stage], max_stages: int | None) -> str | None:
    """Why ``stages`` exceed ``max_stages`` (``None``: they do not)."""
    if max_stages is None or len(stages) <= max_stages:
        return None
    return (f"its {len(stages)} stages (linear layers merged one input at a time, each a pass of every calibration "
            f"batch up to it) exceed max_stages {max_stages}")


def sequential_statistics(model: Any, plan: Any, collector: StatisticsCollector, keys: Sequence[str],
                          inputs_per_task: Sequence[Sequence[Mapping[str, Any]]],
                          load: Callable[[Mapping[str, Any]], None], say: Callable[[str], None] = lambda m: None,
                          max_stages: int | None = None, refuse: Callable[[str], Exception] = ValidationError
                          ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The sequential RegMean merge of ``keys`` (module docstring): ``{key: tensor}`` and a record per
    stage. ``collector``: a RegMean :class:`StatisticsCollector` over ``keys`` (its ``alpha``, its merge);
    ``inputs_per_task[k]``: model k's task's calibration inputs (padding removed); ``load(tensors)``: put
    merged tensors into the live ``model`` (the others at the base's values); more stages than
    ``max_stages`` raise ``refuse(reason)`` before any is merged."""
    K = len(inputs_per_task)
    layers = set(collector.layers)
    sites = [s for s in model_sites(model) if s.name in layers]
    stages = stages_of(model, sites, inputs_per_task) if sites else []
    why = too_many_stages(stages, max_stages)
    if why is not None:
        raise refuse(f"{NAME}: {why}")
    site_keys = {k for s in sites for k in s.keys}
    merged: dict[str, Any] = {}
    collector.statistics = [{} for _ in range(K)]
    others = [k for k in keys if k not in site_keys]
    if others:  # not a linear layer's weight: averaged as RegMean does, and in place before the first stage
        merged.update(collector.merge(plan, others, CHUNK_BYTES))
        load(merged)
    records = []
    for stage in stages:
        t = time.perf_counter()
        for k, inputs in enumerate(inputs_per_task):
            collector.statistics[k].update(stage_grams(model, stage, inputs, f"{NAME}: task {k}"))
        merged.update(collector.merge(plan, stage.keys, CHUNK_BYTES))
        load(merged)
        records.append({"layers": [s.name for s in stage.sites], "seconds": time.perf_counter() - t})
        say(f"{NAME}: {stage.label} merged at the inputs of the model merged below it "
            f"({time.perf_counter() - t:.1f} s)")
    return merged, records


def _inputs(task_batches: Sequence[Any], batch_size: int) -> list[dict[str, Any]]:
    return unpadded_inputs([getattr(b, "batch", b) for b in task_batches], batch_size)


def _parse(params: Mapping[str, Any], where: str) -> RegMeanSequentialParams:
    return parse_params(RegMeanSequentialParams, params, where, repr(NAME))


def _describe(p: RegMeanSequentialParams) -> list[str]:
    return [f"RegMean (alpha {p.alpha:g}) layer by layer in the order the model runs them, each layer's Gram "
            "matrices taken at the inputs of the model merged below it (each task's calibration prompts)"
            + (f"; at most {p.max_stages} stages" if p.max_stages is not None else "")]


def _memory(p: RegMeanSequentialParams, statistics_bytes: Callable[[str], int]) -> dict[str, int]:
    return {"regmean statistics (one Gram matrix per model and layer)": statistics_bytes("regmean")}


def _run(ctx: RunContext, p: RegMeanSequentialParams) -> MethodOutcome:
    plan, cfg = ctx.plan, ctx.cfg
    keys = plan.merged_keys()
    # evaluate: false (no evaluation, as a baseline's): the prompts alone, no fine-tune loaded for targets
    tasks = ctx.prepare_tasks() if cfg.evaluate else None
    model = ctx.load_base_model()
    base_eval = ctx.evaluate(model, tasks) if tasks is not None else None
    t = time.perf_counter()
    collector = ctx.statistics_collector("regmean", {"alpha": p.alpha}, keys)
    batches = [task.calibration for task in tasks] if tasks is not None else ctx.calibration_batches()
    inputs = [_inputs(b, cfg.calibration.batch_size) for b in batches]
    sites = [site_module(model, s) for s in plan.sites]
    with frozen_prefix(model, sites):
        merged, records = sequential_statistics(model, plan, collector, keys, inputs,
                                                lambda tensors: ctx.load(model, tensors), ctx.say, p.max_stages)
    seconds = time.perf_counter() - t
    evaluation = (Evaluation(base=base_eval, merged=ctx.evaluate(model, tasks, method=NAME, seconds=seconds))
                  if tasks is not None else None)
    return MethodOutcome(merged, model, p.model_dump(), seconds, evaluation, {"regmean_sequential_stages": records})


def _report_markdown(report: Mapping[str, Any]) -> list[str]:
    stages = report.get("regmean_sequential_stages") or []
    if not stages:
        return []
    lines = ["## Sequential RegMean stages", "",
             "In the order the model runs them; each stage's Gram matrices at the inputs of the model merged below it.",
             "", "| stage | layers | s |", "|---|---|---|"]
    lines += [f"| {i + 1} | {', '.join(f'`{n}`' for n in r['layers'])} | {r['seconds']:.2f} |"
              for i, r in enumerate(stages)]
    return ["\n".join(lines)]


def _start_fit(ctx: CandidateContext, p: RegMeanSequentialParams, fit: Sequence[Any]) -> dict[str, Any]:
    """As a ``start: auto`` candidate: fitted on the split's ``fit`` batches (one task per model, in order),
    every tensor a candidate merges (``ctx.floats``)."""
    plan = ctx.plan
    collector = StatisticsCollector("regmean", {"alpha": p.alpha}, plan.skeleton, ctx.floats, len(plan.tasks),
                                    plan.config.calibration.batch_size, ctx.say)
    by_name = {t.name: t for t in fit}
    inputs = [_inputs(by_name[t.name].batches, plan.config.calibration.batch_size) if t.name in by_name else []
              for t in plan.tasks]
    try:
        merged, _ = sequential_statistics(ctx.model, plan, collector, ctx.floats, inputs, ctx.load,
                                          max_stages=p.max_stages, refuse=CandidateSkipped)
    except ValidationError as exc:  # a layer run twice or never: this candidate cannot run here, the others go on
        raise CandidateSkipped(str(exc)) from None
    return merged


REGMEAN_SEQUENTIAL_RUN = ModelMethod(
    name=NAME,
    summary="RegMean layer by layer, each layer's Gram matrices at the inputs of the model merged below it "
            "(RegMean++'s idea)",
    parse=_parse,
    run=_run,
    describe=_describe,
    memory=_memory,
    fits_outputs=False,
    report_markdown=_report_markdown,
    start=StartFit(fit=_start_fit),
)

__all__ = ["DEFAULT_MAX_STAGES", "NAME", "REGMEAN_SEQUENTIAL_RUN", "RegMeanSequentialParams", "Stage", "sequential_statistics", "stage_grams",
           "stages_of", "too_many_stages"]
