"""Markdown report of an MNIST results dict (what ``report.md`` holds)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..io.atomic import write_text_atomic
from ..merge.report import start_selection_lines
from .claims import claims_table


def _f(x: Any, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, np.integer)):
        return str(x)
    x = float(x)
    if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def invocation(results: dict[str, Any]) -> str:
    """How the run was started, for a report's first lines: the command line of a CLI run (as typed),
    else the Python function (whose configuration, corpora and sizes a command line need not
    reproduce: results.json's ``config`` holds the settings)."""
    if results.get("command"):
        return f"Command: `{results['command']}`"
    return (f"Run from Python (`mergeqp.experiments.run_{results.get('experiment', '?')}_experiment`, "
            f"{results.get('mode', '?')} preset or a custom configuration: its settings are results.json's `config`)")


def _with_references(results: dict[str, Any]) -> dict[str, Any]:
    out = dict(results["methods"])
    out.update({f"{k} (reference)": v for k, v in results.get("references", {}).items()})
    return out


def methods_table(results: dict[str, Any]) -> str:
    rows = []
    for name, m in _with_references(results).items():
        cal = m.get("calibration", {})
        rows.append([
            (f"**{name} (recommended)**" if name == results.get("recommended")
             else f"**{name}**" if name.startswith("qp") else name),
            _f(m["average"]["mse"]), _f(m["average"]["accuracy"]), _f(m["average"]["cross_entropy"]),
            _f(cal.get("linearised"), 6), _f(cal.get("true"), 6),
        ])
    return _table(["method", "test MSE", "test accuracy", "test cross-entropy",
                   "calibration J(d) (linearised)", "calibration true error"], rows)


def regmean_lines(results: dict[str, Any]) -> list[str]:
    """How RegMean's alpha was set (the baseline's and every RegMean-started merge's): given, or
    chosen by k-fold held-out calibration error (each candidate's mean), when the run recorded it."""
    sel = results.get("regmean_selection")
    if not sel:
        return []
    if not sel.get("mean_errors"):
        return ["", f"RegMean's alpha: {_f(sel['chosen'])} ({sel['criterion']})."]
    scores = ", ".join(f"{_f(a)}: {_f(e, 7)}" for a, e in zip(sel["candidates"], sel["mean_errors"], strict=True))
    return ["", (f"RegMean's alpha (the baseline's and that of every merge started from RegMean): "
                 f"**{_f(sel['chosen'])}**, chosen by the {sel['criterion']}: {scores}.")]


def per_task_table(results: dict[str, Any], metric: str) -> str:
    tasks = list(results["methods"]["qp"]["tasks"])
    rows = []
    for name, m in _with_references(results).items():
        rows.append([name] + [_f(m["tasks"][t][metric]) for t in tasks] + [_f(m["average"][metric])])
    return _table(["method"] + tasks + ["average"], rows)


def geometry_table(results: dict[str, Any]) -> str:
    geo = results["geometry"]
    rows = []
    for p in geo["p"]:
        row = [str(p)]
        for b in geo["bases"]:
            pts = [q for q in geo["points"] if q["p"] == p and q["basis"] == b]
            if not pts:
                row.append("-")
                continue
            e = np.mean([q["energy_fraction"] for q in pts])
            mse = np.mean([q["mse"] for q in pts])
            suffix = f" (mean of {len(pts)})" if len(pts) > 1 else ""
            row.append(f"{e:.3f} / {mse:.4g}{suffix}")
        rows.append(row)
    return _table(["p"] + [f"{b}: energy / MSE" for b in geo["bases"]], rows)


def trust_region_table(results: dict[str, Any]) -> str:
    rows = []
    for s in results["qp_tr"]["steps"]:
        rows.append([str(s["iteration"]), _f(s["delta"], 3), _f(s["true_before"], 7), _f(s["predicted"], 4),
                     _f(s["true_after"], 7), _f(s["rho"], 3), "yes" if s["accepted"] else "no",
                     _f(s["fw_gap"], 3), "yes" if s["certified"] else "no"])
    return _table(["QP", "Delta", "F(d_t)", "predicted decrease", "F(d_new)", "rho", "accepted",
                   "FW gap", "certified"], rows)


def ridge_selection_lines(results: dict[str, Any]) -> list[str]:
    """The held-out choice of ``qp_tr``'s ridge weight, when it was made (else nothing)."""
    sel = results["qp_tr"].get("ridge_selection")
    if not sel:
        return []
    rows = [[_f(r, 3), _f(w, 4), _f(e, 7), "yes" if w == sel["chosen"] else ""]
            for r, w, e in zip(sel["relative"], sel["weights"], sel["heldout_errors"], strict=True)]
    return [
        "",
        (f"Ridge weight toward the soup chosen on held-out calibration samples ({sel['n_heldout'][0]} "
         f"of {sel['n_heldout'][0] + sel['n_fit'][0]} per task; qp_tr fitted on the rest; mu = relative "
         f"x mean diag H = {_f(sel['scale'], 4)}), then qp_tr rerun on all samples with the chosen mu:"),
        "",
        _table(["relative", "mu", "held-out true error", "chosen"], rows),
    ]


def atoms_lines(results: dict[str, Any]) -> list[str]:
    """The rows+baselines section: each baseline's linearised objective beside the certified
    optimum (``qp_atoms``), the k-fold choice and the trust region from RegMean (``qp_tr_regmean``)."""
    atoms = results.get("atoms")
    if not atoms:
        return []
    qa, tr = atoms["qp_atoms"], atoms["qp_tr_regmean"]
    sel = tr["kfold_selection"]
    objective_rows = [["**qp_atoms** (certified optimum)", _f(qa["objective"], 8)]]
    objective_rows += [[f"{n} (rows 0, its atoms 1/K)", _f(j, 8)] for n, j in atoms["baseline_objectives"].items()]
    fold_rows = [[_f(v, 3), _f(v * tr["ridge_scale"], 4)] + [_f(e, 7) for e in errs] + [_f(m, 7),
                 "yes" if v == sel["chosen"] else ""]
                 for v, errs, m in zip(sel["candidates"], sel["fold_errors"], sel["mean_errors"], strict=True)]
    return [
        "## Baselines as feasible points: rows+baselines",
        "",
        (
            f"Atoms: the {atoms['shape'][1] - len(atoms['baseline_objectives'])} row atoms of each fine-tune's "
            f"residual plus the merged residual W_baseline - W_base of {', '.join(atoms['baseline_objectives'])} "
            f"(d is {atoms['shape'][0]} x {atoms['shape'][1]}, box [0, 1]); each baseline is the point with rows 0 "
            f"and its atoms 1/K, so the certified optimum is never above it on the linearised objective "
            f"(solver `{qa['solver']}`, certified {_f(qa['certified'])}, Frank-Wolfe gap <= {_f(qa['fw_gap'], 3)}):"
        ),
        "",
        _table(["point", "linearised J(d)"], objective_rows),
        "",
        (
            f"`qp_tr_regmean`: trust-region QPs in the same atoms from the RegMean point ({tr['n_qps']} QPs, "
            f"{tr['n_accepted']} accepted; true calibration error {_f(tr['start_objective'], 7)} -> "
            f"{_f(tr['objective'], 7)}; stop: {tr['stop_reason']}), with a ridge toward RegMean whose weight "
            f"was chosen by {sel['folds']}-fold splits of the calibration set (mean held-out true error; mu = "
            f"relative x mean diag H = {_f(tr['ridge_scale'], 4)}):"
        ),
        "",
        _table(["relative", "mu"] + [f"fold {i + 1}" for i in range(sel["folds"])] + ["mean", "chosen"], fold_rows),
        "",
    ]


def output_space_lines(results: dict[str, Any]) -> list[str]:
    """The full-matrix output-space merge from RegMean: its k-fold ridge choice and its steps."""
    osm = results.get("output_space")
    if not osm:
        return []
    sel = osm["kfold_selection"]
    fold_rows = [[_f(v, 3)] + [_f(e, 7) for e in errs] + [_f(m, 7), "yes" if v == sel["chosen"] else ""]
                 for v, errs, m in zip(sel["candidates"], sel["fold_errors"], sel["mean_errors"], strict=True)]
    step_rows = [[str(i), _f(st["mu"] / osm["scale"], 3) if osm["scale"] else "-", _f(st["error_before"], 7),
                  _f(st["predicted"], 7), _f(st["error_after"], 7), "yes" if st["accepted"] else "no",
                  _f(st["normal_residual"], 2), str(st["iterations"])]
                 for i, st in enumerate(osm["steps"])]
    return [
        "## output_space: full-matrix output-space merge from RegMean",
        "",
        (
            f"The whole `{results['layer']}` weight and bias as a free matrix, minimising the true calibration error "
            f"of the logits plus lambda ||W - W_RegMean||_F^2 by Levenberg-Marquardt steps (each step linearised at "
            f"the current merge, solved by conjugate gradients on the normal equations, accepted only when the true "
            f"objective falls). lambda = relative x {_f(osm['scale'], 4)} (the mean diagonal of the normal "
            f"operator), chosen by {sel['folds']}-fold splits of the calibration set (RegMean recomputed on each "
            f"fitted part; mean held-out true error):"
        ),
        "",
        _table(["relative"] + [f"fold {i + 1}" for i in range(sel["folds"])] + ["mean", "chosen"], fold_rows),
        "",
        (f"Final run: true calibration error {_f(osm['start_error'], 7)} (RegMean) -> {_f(osm['error'], 7)}, "
         f"{osm['accepted']} of {len(osm['steps'])} steps accepted (nu: the step's proximal weight, relative):"),
        "",
        _table(["step", "nu", "F before", "linearised F", "F after", "accepted", "normal residual", "CG its"],
               step_rows),
        "",
        *held_out_comparison_lines(results),
    ]


def held_out_comparison_lines(results: dict[str, Any]) -> list[str]:
    """The held-out calibration errors of the RegMean-started merges (same folds for each)."""
    rec = results.get("held_out_comparison")
    if not rec:
        return []
    rows = [[f"**{n}**" if n == rec["lowest"] else n] + [_f(e, 7) for e in errs] + [_f(rec["mean_errors"][n], 7)]
            for n, errs in rec["fold_errors"].items()]
    return [
        (f"The merges started from RegMean, held-out calibration error on the same {rec['folds']} folds "
         f"(each fitted on the other folds, RegMean refitted there; lowest mean: `{rec['lowest']}`):"),
        "",
        _table(["method"] + [f"fold {i + 1}" for i in range(rec["folds"])] + ["mean"], rows),
        "",
    ]


def auto_lines(results: dict[str, Any]) -> list[str]:
    """The recommended merge ``auto`` (``mergeqp merge``'s default): its start selection and trust region."""
    auto = results.get("auto")
    if not auto:
        return []
    tr = auto.get("trust_region") or {}
    return [
        "## auto: the recommended merge (`mergeqp merge`'s default, `method: auto`)",
        "",
        (f"The run layer's own default merge on the same calibration digits (the models written as Hugging Face "
         f"folders, {auto['seconds']:.0f} s), then trust-region QPs (rows, no constraint) with early stopping on "
         f"held-out calibration batches. Test digits are never seen."),
        "",
        *start_selection_lines(auto),
        (f"Chosen start `{(auto.get('start_selection') or {}).get('chosen')}`: true calibration error "
         f"{_f(auto['start_objective'], 7)}; after the trust region {_f(auto['objective'], 7)} "
         f"({tr.get('n_accepted')} of {tr.get('n_steps')} steps accepted; {tr.get('stop_reason')})."),
        "",
    ]


def render_report(results: dict[str, Any]) -> str:
    d = results["data"]
    claims = results["claims"]
    n_pass = sum(c["passed"] for c in claims)
    lines = [
        "# MNIST merge experiment",
        "",
        (
            f"{invocation(results)} ({results['mode']} mode). Data: `{d['source']}` "
            f"({d['n_classes']} classes, {d['n_features']} pixels)."
        ),
        "",
        (
            f"Base MLP {d['n_features']}-256-128-{d['n_classes']} trained on every task's training digits; one copy fine-tuned per "
            f"task with **{'only layer2 (weight and bias)' if results['finetune'] == 'layer2' else 'every layer'}** "
            f"trainable (tensors changed: {', '.join(results['training']['changed_tensors'])}). "
            f"Merge at `{results['layer']}` (rows parametrisation, d is {results['problem']['shape'][0]} x "
            f"{results['problem']['shape'][1]}, box [0, 1]); other layers come from the base."
        ),
        "",
        (
            "Samples per task (train / calibration / test): "
            + ", ".join(f"{t}: {v['train']}/{v['calibration']}/{v['test']}" for t, v in d["tasks"].items()) + "."
        ),
        "",
        f"## Claims: {n_pass}/{len(claims)} pass (as measured)",
        "",
        _table(["claim", "result", "value", "statement", "detail"],
               [[c["id"], "PASS" if c["passed"] else "**FAIL**", str(c["value"]), c["statement"], c["detail"]]
                for c in claims]),
        "",
        "## Methods (held-out test averages over tasks; calibration sums over all calibration samples)",
        "",
        (
            "MSE: logits against the task's fine-tuned model. `J(d)` is the QP objective linearised at "
            "the base (for points of the QP); the true error is the same sum of squares for the merged "
            "nonlinear model, so their difference is the linearisation error. `finetuned (reference)` "
            "evaluates each task with its own fine-tuned model (not a merge)."
        ),
        "",
        methods_table(results),
        *regmean_lines(results),
        "",
        "### Per-task MSE",
        "",
        per_task_table(results, "mse"),
        "",
        "### Per-task accuracy",
        "",
        per_task_table(results, "accuracy"),
        "",
        "## Solvers",
        "",
    ]
    s = results["solvers"]
    lines += [
        (
            f"- exact QP: `{s['qp']['solver']}`, J = {s['qp']['objective']:.10g}, certified: "
            f"{_f(s['qp']['certified'])} (Frank-Wolfe gap <= {_f(s['qp']['fw_gap'], 3)}), {_f(s['qp']['seconds'], 3)} s"
        ),
        (
            f"- the paper's Adam (lr {s['qp_adam']['lr']}, {s['qp_adam']['steps']} steps from the soup, clamped): "
            f"J = {s['qp_adam']['objective']:.10g}, certified: {_f(s['qp_adam']['certified'])} "
            f"(gap <= {_f(s['qp_adam']['fw_gap'], 3)})"
        ),
        (
            f"- J(0) = tr(S) = {_f(results['problem']['total_energy'], 7)}; unconstrained lower bound "
            f"c - g'H^+g/2 = {_f(results['problem']['unconstrained_bound'], 7)}"
        ),
        "",
        "## qp_tr: trust-region QPs re-linearised at the merged model",
        "",
        (
            f"{results['qp_tr']['n_qps']} QPs, {results['qp_tr']['n_accepted']} accepted, every subproblem "
            f"certified: {_f(results['qp_tr']['all_certified'])}; stop: {results['qp_tr']['stop_reason']}. "
            f"F is the true calibration error."
        ),
        *ridge_selection_lines(results),
        "",
        trust_region_table(results),
        "",
        *auto_lines(results),
        *atoms_lines(results),
        *output_space_lines(results),
        "## Geometry: captured energy vs MSE",
        "",
        (
            f"Box [0, 1] QPs in each basis; energy fraction tr(SP)/tr(S) on the calibration set "
            f"(per-sample Jacobians), MSE on the held-out test set. Random bases: seeds "
            f"{results['geometry']['random_seeds']}."
        ),
        "",
        geometry_table(results),
        "",
    ]
    if results.get("figures"):
        lines += ["## Figures", ""]
        for name, file in results["figures"].items():
            lines += [f"![{name}]({file})", ""]
    t = results.get("timings", {})
    lines += ["## Timings (seconds)", "",
              ", ".join(f"{k} {v:.1f}" for k, v in t.items()) + f"; torch threads {results['environment']['threads']}.",
              ""]
    return "\n".join(lines)


def write_report(results: dict[str, Any], path: str) -> None:
    write_text_atomic(path, render_report(results))


def console_summary(results: dict[str, Any]) -> str:
    """What the CLI prints: a method table and the claims table."""
    rows = [f"{'method':22s} {'test MSE':>10s} {'accuracy':>9s} {'J(d) cal':>12s} {'true cal':>12s}"]
    for name, m in _with_references(results).items():
        cal = m.get("calibration", {})
        lin = cal.get("linearised")
        rows.append(f"{name:22s} {m['average']['mse']:10.4f} {m['average']['accuracy']:9.4f} "
                    f"{'-' if lin is None else f'{lin:.6g}':>12s} {cal.get('true', float('nan')):12.6g}")
    return "\n".join(rows) + "\n\n" + claims_table(results["claims"])
