"""``report.json`` and ``report.md`` of ``mergeqp merge``.

The JSON holds the plan, one entry per merged layer (``objective_before``, ``objective_after``,
``objective_after_exact``, ``certificate`` {``fw_gap``, ``certified``, ...}, ``energy_fraction``,
``seconds``, the QP objective at reference points, and for a basis parametrisation its ``basis``
entry), the evaluation (calibration objective and held-out teacher-forced MSE per task, for the
base, the hybrid start and the merged model; for the QP and for baselines alike) and, for a joint
QP, its comparison with the sequential QP on the same layers. Non-finite numbers are written as
the strings ``"inf"``, ``"-inf"``, ``"nan"``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from ..formatting import format_number
from ..jsonutil import to_jsonable
from ..output_metrics import OUTPUT_METRICS


def jsonable(x: Any) -> Any:
    """Plain JSON types (numpy scalars/arrays -> numbers/lists, non-finite floats -> strings)."""
    return to_jsonable(x, nonfinite="string")


def start_selection_table(selection: dict[str, Any]) -> list[str]:
    """A report's ``start_selection`` (``start: auto``) as Markdown table lines: every candidate
    with its held-out objective, seconds and why it was skipped, the chosen one in bold."""
    lines = ["| candidate | held-out objective | s | skipped because |", "|---|---|---|---|"]
    for c in selection.get("candidates", []):
        mark = "**" if c.get("label") == selection.get("chosen") else ""
        lines.append(f"| {mark}`{c.get('label')}`{mark} | {format_number(c.get('validation'))} | {format_number(c.get('seconds'), 3)} | "
                     f"{c.get('skipped') or ''} |")
    return lines


def start_selection_lines(entry: dict[str, Any]) -> list[str]:
    """A merge's start selection (``start: auto``: ``entry["start_selection"]``) as Markdown lines:
    the criterion, what the trust region's early stopping made of the start
    (``entry["trust_region"]["holdout"]``, when there is one) and :func:`start_selection_table`;
    none when the merge has no start selection."""
    sel = entry.get("start_selection")
    if not sel:
        return []
    tr = entry.get("trust_region") or {}
    held = tr.get("holdout") or {}
    steps = ""
    if held:
        chosen = held.get("chosen_step")
        steps = (f" From it, early stopping on those batches chose {0 if chosen is None else chosen + 1} "
                 f"trust-region step(s) (held-out objective {format_number(held.get('validation_start'))} -> "
                 f"{format_number(held.get('validation_result'))})")
        steps += (f"; the refit on every batch accepted {tr.get('n_accepted')} of {tr.get('n_steps')}."
                  if held.get("refit") else ".")
    return [f"Its start, chosen by the {sel['criterion']}.{steps}", "", *start_selection_table(sel), ""]


def by_qp(layers: Sequence[Any], group: Callable[[int, Any], Any]) -> list[list[Any]]:
    """Layer records grouped by their QP (``group(index, record)``; a joint or trust-region QP's
    layers share its objective, certificate and time), in order of first appearance: the console
    summary and report.md give one line per QP (stop 57 review: they repeated a QP's numbers on
    each of its layers, as if each had reached them alone)."""
    qps: dict[Any, list[Any]] = {}
    for i, r in enumerate(layers):
        qps.setdefault(group(i, r), []).append(r)
    return list(qps.values())


def render_markdown(report: dict[str, Any], sections: Sequence[str] = (), layer_sections: Sequence[str] = (),
                    method_sections: Sequence[str] = ()) -> str:
    """``report.md`` of a ``report.json`` mapping; ``sections``: Markdown the merge mode adds of its
    own fields (:meth:`mergeqp.merge.modes.MergeMode.report_markdown`), after the evaluation;
    ``layer_sections``: the parametrisation's of its layers' fields
    (:meth:`mergeqp.stats.parametrisation.Parametrisation.report_markdown`), after the layers;
    ``method_sections``: a model method's (``mergeqp.run.model_method.ModelMethod.report_markdown``,
    e.g. ``output_space``'s per-layer table), before the evaluation."""
    plan = report.get("plan", {})
    method = plan.get("method", {})
    lines = ["# mergeqp merge report", ""]
    lines.append(f"- base: `{plan.get('base')}` ({plan.get('architecture')})")
    for m in plan.get("models", []):
        lines.append(f"- model `{m['name']}`: `{m['checkpoint']}`, {m['n_calibration']} calibration + "
                     f"{m['n_heldout']} held-out prompts, weight {m['weight']}")
    name = method.get("name")
    if name == "qp":
        lines.append(f"- method: QP, mode `{method.get('mode')}`, parametrisation `{method.get('parametrisation')}`, "
                     f"constraints `{', '.join(method.get('constraints') or []) or 'none'}`, solver `{method.get('solver')}`, "
                     f"regularisation {method.get('regularisation')}")
        out = plan.get("output", {})
        every = "all logits" if out.get("field", "logits") == "logits" else "every feature"
        restrict = every if out.get("restrict") == "none" else f"{out.get('restrict')} (k = {out.get('k')})"
        if out.get("metric", "euclidean") != "euclidean":
            restrict += f", metric `{out['metric']}`"
        if out.get("pool", "none") != "none":
            entry = OUTPUT_METRICS.get(out.get("metric", "euclidean"))
            restrict += f", pooled `{out['pool']}`" + (" (class labels through each model's head)"
                                                      if entry is not None and entry.scores_data else "")
        if plan.get("statistics_sketch"):
            restrict += (f"; H from a sketch of {plan['statistics_sketch']} per prompt"
                         + (" (`sketch: auto`)" if out.get("sketch") == "auto" else ""))
        lines.append(f"- compared output: `{out.get('field')}`, {restrict}; device `{report.get('device')}`, "
                     f"dtype `{plan.get('dtype')}`")
    else:
        kind = "model method" if (report.get("baseline") or {}).get("kind") == "model method" else "baseline"
        ran = (report.get("baseline") or {}).get("params")  # every parameter, defaults included
        params = ran if ran is not None else method.get("params") or {}
        lines.append(f"- method: {kind} `{name}` with "
                     + (", ".join(f"{k} {v}" for k, v in params.items() if v is not None) or "its defaults"))
        stats = (report.get("baseline") or {}).get("statistics")
        if stats:
            lines.append(f"- statistics: {stats.get('statistic')}"
                         + (f"; labels: {stats['labels']}" if stats.get("labels") else "")
                         + "; " + ", ".join(f"`{m.get('model')}` {m.get('examples')} examples" for m in stats.get("models", [])))
    stored = plan.get("stored_dtypes") or {}
    if plan.get("output_dtype") or len({tuple(v) for v in stored.values()}) > 1:
        lines.append("- stored dtypes: " + "; ".join(f"`{k}` {'/'.join(v) or '-'}" for k, v in stored.items())
                     + f"; written as {plan.get('output_dtype') or 'the base stores each tensor'}")
    seconds = report.get("seconds")  # (3 significant digits printed 1001 s as "1e+03 s")
    lines.append(f"- total time: {f'{seconds:.1f}' if isinstance(seconds, (int, float)) else format_number(seconds)} s")
    for entry in report.get("imports", []):
        digest = entry.get("sha256")
        lines.append(f"- imported module: `{entry.get('import')}` ({entry.get('file') or 'no file'}"
                     + (f", sha256 `{digest[:16]}...`" if digest else "") + ")")
    for n in report.get("notes", []):
        lines.append(f"- note: {n}")

    selection = report.get("start_selection")
    if selection:
        lines += ["", "## Start selection", "",
                  (f"Each candidate merged on every tensor and scored by the merge objective: "
                   f"{selection.get('criterion')}; chosen: `{selection.get('chosen')}`."), "",
                  *start_selection_table(selection)]

    layers = report.get("layers") or []
    if layers:
        lines += ["", "## Merged layers", "",
                  "| layer | mode | J before | J after (QP) | J after (exact) | fw gap | certified | energy | solver | s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for members in by_qp(layers, lambda i, r: r.get("group", f"layer {i}")):
            r, c = members[0], members[0].get("certificate", {})
            names = "<br>".join(f"`{m['layer']}`" for m in members)
            energy = " / ".join(format_number(m["energy_fraction"], 4) for m in members)
            # (a hybrid layer that kept its start: the step's numbers, marked as not applied)
            kept = " (step not kept: the start's weights stay)" if r.get("kept_start") else ""
            lines.append(f"| {names} | {r['mode']} | {format_number(r['objective_before'])} | {format_number(r['objective_after'])} | "
                         f"{format_number(r['objective_after_exact'])}{kept} | {format_number(c.get('fw_gap'), 3)} | {format_number(c.get('certified'))} | "
                         f"{energy} | {r.get('solver')} | {format_number(r['seconds'], 3)} |")
        lines += ["", ("QP objective at points of the same problem (soup and task arithmetic: the task vectors at 1/K and 1; start and result: "
                       "the merge's start and its result) and at the QP's optimum:"), "",
                  "| layer | " + " | ".join(sorted(layers[0].get("objective_at", {}))) + " | optimum |",
                  "|---|" + "---|" * (len(layers[0].get("objective_at", {})) + 1)]
        for r in layers:
            pts = r.get("objective_at", {})
            lines.append(f"| `{r['layer']}` | " + " | ".join(format_number(pts[k]) for k in sorted(pts)) + f" | {format_number(r['objective_after'])} |")
        for section in layer_sections:  # the parametrisation's own (Parametrisation.report_markdown)
            lines += ["", *section.rstrip("\n").split("\n")]

    for section in method_sections:  # a model method's own (ModelMethod.report_markdown)
        lines += ["", *section.rstrip("\n").split("\n")]

    ev = report.get("evaluation")
    if ev:
        metric = (plan.get("output") or {}).get("metric", "euclidean")
        entry = OUTPUT_METRICS.get(metric)  # (a report of a user's metric read where it is not registered: generic words)
        objective = (entry.objective if entry is not None and entry.objective
                     else f"sum of squared compared-output errors under the {metric} metric")
        lines += ["", "## Evaluation", "",
                  (f"Calibration objective ({objective}) and held-out teacher-forced "
                   "MSE per logit against each task's fine-tuned model (KL: mean KL from the fine-tune's "
                   "next-token distribution per real token; CE: next-token cross-entropy, or for classifiers "
                   "the class cross-entropy per prompt; Acc: accuracy of each task's head; nats)."), ""]
        tasks = sorted({t for v in ev.values() if isinstance(v, dict) for t in v.get("heldout_mse", {})})
        columns = [(key, label, t) for key, label in (("heldout_mse", "MSE"), ("heldout_kl", "KL"),
                                                      ("heldout_cross_entropy", "CE"), ("heldout_accuracy", "Acc"))
                   if any(isinstance(v, dict) and v.get(key) for v in ev.values()) for t in tasks]
        # (without held-out columns, `evaluate: false`, the header had a third, empty cell: not a table, stop 74)
        lines.append("| " + " | ".join(["model", "calibration J", *(f"{label} {t}" for _, label, t in columns)]) + " |")
        lines.append("|---|---|" + "---|" * len(columns))
        for key, v in ev.items():
            label = f"{key} ({v.get('method')})" if v.get("method") else key
            cells = [label, format_number(v.get("calibration_objective")),
                     *(format_number((v.get(k) or {}).get(t)) for k, _, t in columns)]
            lines.append("| " + " | ".join(cells) + " |")

    for section in sections:  # the merge mode's own (MergeMode.report_markdown)
        lines += ["", *section.rstrip("\n").split("\n")]

    out = report.get("output")
    if out:
        lines += ["", (f"Written: `{out['folder']}`: {', '.join(out['weight_files'])} ({out['tensors']} tensors, "
                       f"{out['bytes']} bytes); copied {', '.join(out['copied']) or 'nothing'}.")]
    return "\n".join(lines) + "\n"


def report_files(report: dict[str, Any], sections: Callable[[dict[str, Any]], Sequence[str]] | None = None,
                 layer_sections: Callable[[Sequence[dict[str, Any]]], Sequence[str]] | None = None,
                 method_sections: Callable[[dict[str, Any]], Sequence[str]] | None = None) -> dict[str, str]:
    """``{"report.json": text, "report.md": text}`` for ``save_hf_folder(..., extra_files=...)`` (the folder then
    appears with its report, or not at all); ``sections(data)``: the merge mode's own Markdown
    sections of the JSON-able report, ``layer_sections(layers)`` the parametrisation's of its
    ``layers`` records, ``method_sections(data)`` a model method's (:func:`render_markdown`)."""
    data = jsonable(report)
    layers = data.get("layers") or []
    return {"report.json": json.dumps(data, indent=2),
            "report.md": render_markdown(data, sections(data) if sections is not None else (),
                                         layer_sections(layers) if layer_sections is not None and layers else (),
                                         method_sections(data) if method_sections is not None else ())}
