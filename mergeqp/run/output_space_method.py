"""``method: {name: output_space}`` of ``mergeqp merge``: the model method of the output-space merge.

The reference merge (RegMean from statistics collected while each fine-tune is loaded for its
targets, or the soup) is evaluated; every selected linear site is solved at the reference, one at a
time (:func:`mergeqp.merge.output_space_hf.solve_sites`); the solutions are loaded together and
evaluated; the report gets a per-layer record (``output_space_layers`` in ``report.json``). The
registered :class:`~.model_method.ModelMethod` is :data:`OUTPUT_SPACE_RUN`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from ..formatting import format_number
from ..merge.firstorder import TaskTargets
from ..merge.output_space_hf import OutputSpaceRunParams, check_sites, parse_run_params, solve_sites, uncertified_notes
from .model_method import MethodOutcome, ModelMethod, RunContext
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
)
