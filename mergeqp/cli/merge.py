"""``mergeqp merge CONFIG.yaml --out DIR [--dry-run]``: merge Hugging Face checkpoints from a config.

``--dry-run`` validates the config against its inputs and prints the plan (layers, statistics
to collect, solver per layer, memory estimate) without loading any weight. Otherwise the merged
model is written to ``DIR`` (safetensors, config, tokenizer files) with ``DIR/report.json`` and
``DIR/report.md``. The config format is documented in ``docs/hf.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..config import load_config
from ..errors import ConfigError, MergeQPError, ValidationError
from ..io.distributed import Ranks, agree_exit_code, launched, other_rank
from ..io.memory import available_memory_bytes, human_bytes, memory_budget, memory_limit
from ..io.writer import parse_size
from ..merge.report import by_qp, format_number, jsonable
from ..output_metrics import OUTPUT_METRICS
from ..run import build_plan, run_merge
from ..run.pipeline import check_groups_fit, resolve_device
from ..run.memory_estimate import basis_pass_tangent, qp_site_memory


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "merge",
        help="merge Hugging Face checkpoints as a YAML config says (QP or a baseline)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("config", help="YAML config file (see docs/hf.md)")
    p.add_argument("--out", help="output folder for the merged model and its report (required unless --dry-run)")
    p.add_argument("--dry-run", action="store_true", help="validate and print the plan; load no weights")
    p.add_argument("--overwrite", action="store_true", help="replace the contents of a non-empty --out folder")
    p.add_argument("--json", action="store_true",
                   help="print the plan (with --dry-run) or, after a merge, the report as JSON on stdout")
    p.add_argument("--max-memory",
                   help="cap on each merge site's statistics and solve, e.g. 8GB (overrides the config's "
                        "max_memory); a site estimated above it, or above the available memory, is refused "
                        "before it is collected")
    p.add_argument("--quiet", action="store_true", help="no progress messages")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = load_config(args.config)
    if args.max_memory is not None:
        try:
            parse_size(args.max_memory)
        except MergeQPError as exc:
            raise ConfigError(f"--max-memory: {exc}") from None
        cfg = cfg.model_copy(update={"max_memory": args.max_memory})
    if not args.dry_run and not args.out:
        raise ConfigError("--out DIR is required (or pass --dry-run to validate only)")
    plan = build_plan(cfg)
    if args.dry_run:
        if not other_rank():  # (under torchrun: rank 0 prints the plan once)
            print(json.dumps(jsonable(plan.to_json()), indent=2) if args.json else plan.render())
            _fits_here(cfg, plan)
        return 0
    # under torchrun: the ranks share the statistics' batches; rank 0 writes and prints
    with launched(resolve_device(cfg.device)[0]) as group:
        code, result = _merge(args, cfg, plan, group)
        code = agree_exit_code(group, code)
    # printed once every rank has agreed: a reader that stops early (`| head`) strands no rank
    if group.is_writer():
        _report(args, result)
    return code


def _fits_here(cfg: Any, plan: Any) -> None:
    """The dry run validates a config that may be run elsewhere: a QP that the run would refuse
    on this machine (:func:`mergeqp.run.pipeline.check_groups_fit`), or an optimal basis's pass of
    which not one tangent fits (at the plan's upper bounds), is a warning, not an error."""
    if not cfg.method.is_qp:
        return
    with memory_limit(cfg.max_memory_bytes()):
        warned = False
        try:
            check_groups_fit(plan)
        except ValidationError as exc:
            _warn_groups(plan, exc)
            warned = True
        budget, what = memory_budget(available_memory_bytes())
    for site in [] if warned else qp_site_memory(plan):
        if budget is not None and site.peak > budget:
            # (stop 52 review) the run checks each QP again at its first batch, with the sizes it measures:
            # the dry run said nothing, and the run stopped there after the start and targets had run
            print(f"warning: QP over {site.site}: at the plan's upper bounds (batches of {plan.batch_prompts} prompts "
                  f"of {plan.batch_length} tokens) its statistics and first batch need about {human_bytes(site.peak)} "
                  f"({site.describe()}), more than {what}: the run checks this again at the first batch, with its "
                  f"measured sizes, and stops there if they confirm it; use smaller batches "
                  f"(calibration.batch_size, calibration.max_length), fewer atoms, or raise max_memory",
                  file=sys.stderr)
    one = basis_pass_tangent(plan)
    if one is not None and budget is not None and one > budget:
        print(f"warning: basis: optimal: one JVP of the basis pass needs up to {human_bytes(one)} (every prompt "
              f"at the longest length), more than {what}: the run would stop at the first layer's pass unless "
              f"its batches are shorter; use fewer tokens per batch (calibration.batch_size, "
              f"calibration.max_length) or basis: svd", file=sys.stderr)


def _warn_groups(plan: Any, exc: ValidationError) -> None:
    """The dry run's warning that a QP would not fit on this machine."""
    n = len(plan.sites)
    if n > 1:  # the run leaves out the unchanged layers first, which only the weights show
        print(f"warning: if the fine-tunes change all {n} selected layers, the run would stop on this machine "
              f"before loading any weight (it first leaves out the selected layers that no fine-tune changed, "
              f"which the dry run, reading no weights, cannot see): {exc}", file=sys.stderr)
    else:
        print(f"warning: on this machine the run would stop before loading any weight: {exc}", file=sys.stderr)


def _merge(args: argparse.Namespace, cfg: Any, plan: Any, group: Ranks) -> tuple[int, Any]:
    """The merge; ``(exit code, result)`` (1 when a layer's QP is not certified)."""
    quiet = args.quiet or not group.is_writer()
    log = (lambda msg: None) if quiet else (lambda msg: print(msg, file=sys.stderr))
    if quiet:  # transformers' own "Loading weights" bars too
        quiet_transformers()
    else:
        print(plan.render(), file=sys.stderr)
    result = run_merge(cfg, args.out, overwrite=args.overwrite, progress=not quiet, log=log, plan=plan)
    return (1 if result.summary.uncertified_layers else 0), result


def _report(args: argparse.Namespace, result: Any) -> None:
    """The summary (or ``--json`` report) on stdout, and why the exit code is 1 where it is."""
    if args.json:
        print(json.dumps(jsonable(result.report), indent=2))
    else:
        _print_summary(result)
    failed = result.summary.uncertified_layers
    if failed:
        print(f"mergeqp merge: the QP solution is not certified at {len(failed)} layer(s) "
              f"({', '.join(failed[:5])}{', ...' if len(failed) > 5 else ''}); the model was "
              f"written, but its coefficients are not proven optimal (see the report's notes)", file=sys.stderr)


def quiet_transformers() -> None:
    """No progress bars from ``transformers`` (its models' loading), for ``--quiet``."""
    try:
        from transformers.utils import logging as hf_logging  # optional heavy dependency
    except ImportError:
        return
    hf_logging.disable_progress_bar()


def _print_summary(result: Any) -> None:
    """One line per merged layer, the evaluation and the notes (stdout)."""
    rep = result.summary
    print(f"merged model written to {result.out_dir} ({rep.output.tensors} tensors); "
          f"report: {result.out_dir / 'report.json'}, {result.out_dir / 'report.md'}")
    for members in by_qp(rep.layers or (), lambda i, layer: layer.group):
        layer = members[0]
        cert = layer.certificate
        basis = layer.basis or {}
        mj = basis.get("mean_jacobian_energy")
        extra = (f"; {basis['name']} basis p={basis['rank']}, mean-Jacobian energy "
                 + ", ".join(f"{k} {v:.3f}" for k, v in mj.items())) if mj else ""
        names = (layer.layer if len(members) == 1 else
                 f"{', '.join(m.layer for m in members)} (one QP, n = {layer.n_variables})")
        energy = (f"{layer.energy_fraction:.3f}" if len(members) == 1 else
                  ", ".join(f"{m.energy_fraction:.3f}" for m in members) + " (per layer)")
        kept = "; step not kept: the start's weights stay" if layer.kept_start else ""
        print(f"  {names}: J {layer.objective_before:.6g} -> {layer.objective_after:.6g} "
              f"(exact {layer.objective_after_exact:.6g}{kept}); fw_gap {format_number(cert.get('fw_gap'), 4)}, "
              f"certified {cert.get('certified')}; energy {energy}{extra}")
    ev = rep.evaluation
    if ev is not None:
        models = [("base", ev.base), *([("start", ev.start)] if ev.start is not None else []), ("merged", ev.merged)]
        print("  calibration objective: " + " -> ".join(f"{n} {m.calibration_objective:.6g}" for n, m in models))
        metric = ((result.report.get("plan") or {}).get("output") or {}).get("metric", "euclidean")
        entry = OUTPUT_METRICS.get(metric)
        shown = [] if entry is None else list(entry.heldout)
        # then the prompts' cross-entropy where it was measured (what language-model users compare,
        # also for a baseline or a Euclidean merge), and the MSE to the fine-tunes
        shown += [x for x in [("cross-entropy", "heldout_cross_entropy"), ("MSE", "heldout_mse")] if x not in shown]
        for label, key in shown:  # the optimised metric first
            values = [getattr(m, key) or {} for _, m in models]
            if not values[-1]:
                continue
            # (#: trailing zeros kept, so that every task shows 4 digits: 3.7996 printed as "3.8")
            tasks = ", ".join(f"{t} {v:#.4g}" for t, v in values[-1].items())
            means = " -> ".join(f"{n} {sum(v.values()) / len(v):#.4g}" for (n, _), v in zip(models, values) if v)
            print(f"  held-out {label} (mean over tasks): {means}; merged per task: {tasks}")
    for note in rep.notes:
        print(f"  note: {note}")
