"""``method: {name: output_space}`` of ``mergeqp merge``: the model method of the output-space merge.

The reference merge (RegMean from statistics collected while each fine-tune is loaded for its
targets, or the soup) is evaluated; every selected linear site is solved at the reference, one at a
time (:func:`mergeqp.merge.output_space_hf.solve_sites`); the solutions are loaded together and
evaluated; the report gets a per-layer record (``output_space_layers`` in ``report.json``). The
registered :class:`~.model_method.ModelMethod` is :data:`OUTPUT_SPACE_RUN`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..formatting import format_number
from ..io.memory import human_bytes
from ..merge.firstorder import TaskTargets
from ..merge.output_space_hf import SUPPORTED_KINDS, JacobianTooLarge, OutputSpaceRunParams, check_sites
from ..merge.output_space_hf import parse_run_params, solve_sites, uncertified_notes
from .auto import CandidateSkipped
from .model_method import CandidateContext, MethodOutcome, ModelMethod, RunContext, StartFit
from .report import Evaluation


def _describe(p: OutputSpaceRunParams) -> list[str]:
    return [f"per selected linear layer, one at a time at the {p.reference} merge: the free weight change minimising "
            f"the linearised compared-output error, ridge {p.ridge:g} (relative)"
            + (f", radius {p.radius:g}" if p.radius is not None else "")
            + "; CG through JVP/VJP of the model (per-sample Jacobians formed when at most "
            f"{p.jacobian_max_bytes:.0f} bytes)"]


def _memory(p: OutputSpaceRunParams, statistics_bytes: Callable[[str], int]) -> dict[str, int]:
    out = {}
    if p.reference == "regmean":
        out["regmean statistics (reference)"] = statistics_bytes("regmean")
    out["output-space Jacobians (one layer, formed only below the cap)"] = int(p.jacobian_max_bytes)
    return out


def _run(ctx: RunContext, params: OutputSpaceRunParams) -> MethodOutcome:
    plan, cfg = ctx.plan, ctx.cfg
    keys = plan.merged_keys()
    t = time.perf_counter()
    collector = (ctx.statistics_collector("regmean", {"alpha": params.alpha}, keys)
                 if params.reference == "regmean" else None)
    tasks = ctx.prepare_tasks(visit=collector)
    reference = (ctx.collected_merge(collector, keys) if collector is not None
                 else ctx.baseline_merge("soup", {}, keys))
    t_reference = time.perf_counter() - t
    model = ctx.load_base_model()
    base_eval = ctx.evaluate(model, tasks)
    ctx.load(model, reference)
    start_eval = ctx.evaluate(model, tasks, method=params.reference,
                              params={"alpha": params.alpha} if collector is not None else {}, seconds=t_reference,
                              statistics=collector.summary() if collector is not None else None)
    t = time.perf_counter()
    task_targets = [TaskTargets(x.name, x.weight, x.calibration) for x in tasks]
    layers, solved = solve_sites(model, plan.sites, task_targets, ctx.spec, ctx.device, params, ctx.say)
    merged = dict(reference)
    merged.update({k: v.to(reference[k].dtype) if k in reference and cfg.output_dtype is None else v
                   for k, v in solved.items()})
    ctx.notes.extend(uncertified_notes(layers))
    merged_eval = ctx.evaluate(model, tasks, method=cfg.method.name)
    return MethodOutcome(merged, model, params.model_dump(), t_reference + time.perf_counter() - t,
                         Evaluation(base=base_eval, merged=merged_eval, start=start_eval),
                         {"output_space_layers": [x.record for x in layers]})


def _report_markdown(report: Mapping[str, Any]) -> list[str]:
    """``report.md``'s table of the solved layers (``output_space_layers``), before the evaluation."""
    layers = report.get("output_space_layers") or []
    if not layers:
        return []
    lines = ["## Output-space layers", "",
             ("Per layer, in order: the linearised objective at the weights it was linearised at and at "
              "the solution (with the ridge term), the relative normal-equation / KKT residual, CG "
              "iterations, the accepted step and the true calibration error before and after it."), "",
             "| layer | operator | J before | J after (lin.) | residual | certified | CG it. | step | "
             "calibration before | calibration after | s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in layers:
        # damped steps (steps > 1): J after is the true error plus the ridge term, the step column the solves kept
        step = f"{r['accepted_steps']} of {len(r['steps'])} damped" if r.get("steps") else format_number(r["step"])
        lines.append(f"| `{r['layer']}` | {r['operator']} | {format_number(r['objective_before'])} | "
                     f"{format_number(r['objective_after'])} | {format_number(r['normal_residual'], 3)} | "
                     f"{format_number(r['certified'])} | {r['iterations']} | {step} | "
                     f"{format_number(r['calibration_before'])} | {format_number(r['calibration_after'])} | "
                     f"{format_number(r['seconds'], 3)} |")
    return ["\n".join(lines)]


def _parse(params: Mapping[str, Any], where: str) -> OutputSpaceRunParams:
    return parse_run_params(params, where)


def _start_statistics(p: OutputSpaceRunParams) -> list[tuple[str, dict[str, Any]]]:
    """The reference RegMean's statistics, fitted per split (none for the soup)."""
    return [("regmean", {"alpha": p.alpha})] if p.reference == "regmean" else []


def _start_fit(ctx: CandidateContext, p: OutputSpaceRunParams, fit: Sequence[TaskTargets]) -> dict[str, Any]:
    """As a ``start: auto`` candidate: its reference (RegMean from the split's fit batches, or the soup)
    loaded, every changed site solved on the fit batches with formed Jacobians only."""
    if ctx.spec.scores_data:
        raise CandidateSkipped(f"it fits the fine-tunes' outputs, not metric {ctx.spec.metric!r}")
    kinds = sorted({s.kind for s in ctx.plan.sites if s.kind not in SUPPORTED_KINDS})
    if kinds:
        raise CandidateSkipped(f"it solves {', '.join(SUPPORTED_KINDS)} sites only, not {', '.join(kinds)}")
    reference = (ctx.merge("regmean", {"alpha": p.alpha}, "RegMean") if p.reference == "regmean"
                 else ctx.merge("soup", {}))
    ctx.load(reference)
    # the sites some fine-tune changed: a layer none changed has nothing to merge and keeps the
    # base weight in every candidate (the report's note on it says so)
    sites = ctx.changed_sites()
    if not sites:
        return reference
    try:
        layers, solved = solve_sites(ctx.model, sites, fit, ctx.spec, ctx.device, p, ctx.say, matrix_free=False)
    except JacobianTooLarge as exc:
        raise CandidateSkipped(str(exc)) from None
    ctx.notes.extend(n for n in uncertified_notes(layers) if n not in ctx.notes)
    reference.update({k: v.to(reference[k].dtype) if k in reference else v for k, v in solved.items()})
    return reference


def _start_skip(plan: Any, p: OutputSpaceRunParams, auto: Any) -> str | None:
    """Why the run will skip this candidate for the size of its per-sample Jacobians (``None``: they
    may fit): it forms them, float64, ``prompts x compared outputs x positions x r`` per site on a
    fold's fit batches, and skips the candidate above ``jacobian_max_bytes``. Counted at a lower bound
    (every prompt one token long, the smallest fit, the narrowest site, the fewer of the folded and
    unfolded outputs), so that the plan never names a skip the run would not make (stop 57 review:
    listed, and skipped by every real language model's run)."""
    if not plan.sites:
        return None
    per_token = plan.fewest_outputs_per_token()
    share = 1 / auto.folds if auto.folds >= 2 else auto.holdout
    size = plan.config.calibration.batch_size
    prompts = 0
    for t in plan.tasks:
        batches = -(-t.n_calibration // size)
        prompts += max(t.n_calibration - math.ceil(batches * share) * size, 0)  # less its largest held-out part
    need = 8 * prompts * per_token * min(s.r for s in plan.sites)
    if need <= p.jacobian_max_bytes:
        return None
    return (f"its per-sample Jacobians take at least {human_bytes(need)} (every prompt one token long), above "
            f"jacobian_max_bytes ({human_bytes(p.jacobian_max_bytes)}): the run skips it")


OUTPUT_SPACE_RUN = ModelMethod(
    name="output_space",
    summary="per selected linear layer, the free weight change minimising the linearised compared-output error "
            "at a reference merge (RegMean or the soup), accepted on the true calibration error",
    parse=_parse,
    run=_run,
    describe=_describe,
    check_sites=check_sites,
    memory=_memory,
    report_markdown=_report_markdown,
    start=StartFit(fit=_start_fit, statistics=_start_statistics, skip=_start_skip),
)
