"""Claims, goal, Markdown report and figures of a text-experiment results dict.

Claims of the paper's ViT section, evaluated as measured (nothing tuned; a claim that does not
hold is reported failing). "Baselines" are soup, task arithmetic (calibration-tuned weight),
TIES, DARE-TIES, Fisher and RegMean:

- (V1) the single-layer diagonal QP (``qp_single``, rows) has the lowest test output MSE on every task;
- (V2) ``qp_single`` has the highest mean test accuracy;
- (V3) the sequential multi-layer QP beats every baseline in both MSE and accuracy on every task;
- (V4) the test MSE falls as the captured energy fraction rises: Spearman correlation over all
  (basis, p) points negative with p-value < 0.05;
- (V5) at each basis dimension ``p`` the optimal basis has the lowest test MSE of the bases.

Goal (issue 15, text classifier): the recommended merge (chosen on calibration data) has a mean
test accuracy at least the best baseline's and a mean test MSE lower than every baseline's. With
every test text's result in the results (``per_text_test``), the goal also reports paired,
stratified bootstrap intervals (:mod:`.uncertainty`) of the recommended merge's accuracy minus the
best baseline's and of its MSE minus the lowest baseline MSE (those baselines fixed as measured):
how much of each half is the test sample. They inform; the verdict stays on the point estimates.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..io.atomic import savefig_atomic, write_text_atomic
from ..merge.report import start_selection_lines
from .claims import ACCURACY_TIE
from .report import _f, _table, invocation
from .uncertainty import DEFAULT_RESAMPLES, Interval, bootstrap, describe_level, group_mean

BASELINE_NAMES = ("soup", "task_arithmetic", "ties", "dare_ties", "fisher", "regmean")
SPEARMAN_ALPHA = 0.05
BASIS_STYLE = {"optimal": ("tab:green", "o"), "svd": ("tab:orange", "^"), "random": ("tab:gray", "x")}


def _claim(cid: str, statement: str, passed: bool, value: Any, detail: str) -> dict[str, Any]:
    return {"id": cid, "statement": statement, "passed": bool(passed), "value": value, "detail": detail}


def _baselines(results: dict[str, Any]) -> list[str]:
    return [m for m in BASELINE_NAMES if m in results["methods"]]


def _per_task_wins(results: dict[str, Any], method: str, metric: str) -> tuple[int, int, list[str]]:
    """Tasks where ``method`` beats every baseline on ``metric`` (MSE lower, accuracy higher or equal)."""
    ms = results["methods"]
    wins, lines = 0, []
    tasks = list(ms[method]["test"]["tasks"])
    for task in tasks:
        ours = ms[method]["test"]["tasks"][task][metric]
        vals = {b: ms[b]["test"]["tasks"][task][metric] for b in _baselines(results)}
        best = min(vals, key=vals.get) if metric == "mse" else max(vals, key=vals.get)
        ok = ours < vals[best] if metric == "mse" else ours >= vals[best]
        wins += ok
        lines.append(f"{task}: {_f(ours)} vs {best} {_f(vals[best])}")
    return wins, len(tasks), lines


def claim_v1(results: dict[str, Any]) -> dict[str, Any]:
    wins, n, lines = _per_task_wins(results, "qp_single", "mse")
    return _claim("V1", "single-layer diagonal QP has the lowest test output MSE on every task", wins == n,
                  f"{wins}/{n}", "; ".join(lines))


def claim_v2(results: dict[str, Any]) -> dict[str, Any]:
    ms = results["methods"]
    ours = ms["qp_single"]["test"]["mean"]["accuracy"]
    best = max(_baselines(results), key=lambda b: ms[b]["test"]["mean"]["accuracy"])
    theirs = ms[best]["test"]["mean"]["accuracy"]
    return _claim("V2", "single-layer diagonal QP has the best mean test accuracy", ours >= theirs - ACCURACY_TIE,
                  ours - theirs, f"qp_single {_f(ours)} vs best baseline {best} {_f(theirs)}")


def claim_v3(results: dict[str, Any]) -> dict[str, Any]:
    w_mse, n, l_mse = _per_task_wins(results, "qp_sequential", "mse")
    w_acc, _, l_acc = _per_task_wins(results, "qp_sequential", "accuracy")
    layers = len(results.get("layers", []))
    return _claim("V3", f"sequential multi-layer QP ({layers} layer(s)) beats every baseline in MSE and "
                        f"accuracy on every task", w_mse == n and w_acc == n,
                  f"MSE {w_mse}/{n}, accuracy {w_acc}/{n}", "MSE: " + "; ".join(l_mse) + " | accuracy: "
                  + "; ".join(l_acc))


def claim_v4(results: dict[str, Any]) -> dict[str, Any]:
    from scipy.stats import spearmanr  # scipy is a dependency; deferred to keep report imports light

    pts = [p for p in results.get("geometry", []) if p.get("energy_fraction") is not None]
    if len(pts) < 3:
        return _claim("V4", "test MSE falls as the captured energy fraction rises", False, None,
                      f"only {len(pts)} geometry points with an energy fraction")
    x = [p["energy_fraction"] for p in pts]
    y = [p["test"]["mse"] for p in pts]
    rho, pval = spearmanr(x, y)
    rho = float(rho) if np.isfinite(rho) else None
    passed = rho is not None and rho < 0 and float(pval) < SPEARMAN_ALPHA
    return _claim("V4", "test MSE falls as the captured energy fraction rises (Spearman < 0, p < 0.05)", passed,
                  rho, f"Spearman rho {_f(rho)}, p-value {_f(float(pval))} over {len(pts)} (basis, p) points")


def claim_v5(results: dict[str, Any]) -> dict[str, Any]:
    by_p: dict[int, dict[str, float]] = {}
    for p in results.get("geometry", []):
        by_p.setdefault(p["p"], {})[p["basis"]] = p["test"]["mse"]
    rows = {p: v for p, v in sorted(by_p.items()) if "optimal" in v and len(v) > 1}
    wins = sum(v["optimal"] <= min(v.values()) for v in rows.values())
    detail = "; ".join(f"p={p}: " + ", ".join(f"{b} {_f(m)}" for b, m in v.items()) for p, v in rows.items())
    return _claim("V5", "at each basis dimension p the optimal basis has the lowest test MSE",
                  bool(rows) and wins == len(rows), f"{wins}/{len(rows)}", detail or "no optimal-basis points")


def evaluate_text_claims(results: dict[str, Any]) -> list[dict[str, Any]]:
    return [c(results) for c in (claim_v1, claim_v2, claim_v3, claim_v4, claim_v5)]


def evaluate_goal(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's text-classifier goal for the recommended merge (see the module docstring)."""
    ms = results["methods"]
    rec = results["selection"]["recommended"]["chosen"]
    ours = ms[rec]["test"]["mean"]
    bl = _baselines(results)
    best_acc = max(bl, key=lambda b: ms[b]["test"]["mean"]["accuracy"])
    best_mse = min(bl, key=lambda b: ms[b]["test"]["mean"]["mse"])
    acc_ok = ours["accuracy"] >= ms[best_acc]["test"]["mean"]["accuracy"] - ACCURACY_TIE  # (a float64 tie is a tie)
    mse_ok = ours["mse"] < ms[best_mse]["test"]["mean"]["mse"]
    out = {"recommended": rec, "passed": bool(acc_ok and mse_ok), "accuracy_ok": bool(acc_ok),
           "mse_ok": bool(mse_ok), "accuracy": ours["accuracy"], "mse": ours["mse"],
           "best_baseline_accuracy": {"method": best_acc, "value": ms[best_acc]["test"]["mean"]["accuracy"]},
           "best_baseline_mse": {"method": best_mse, "value": ms[best_mse]["test"]["mean"]["mse"]}}
    acc_iv = paired_interval(results, rec, best_acc, "correct")
    mse_iv = paired_interval(results, rec, best_mse, "se")
    if acc_iv is not None and mse_iv is not None:
        out["intervals"] = {"accuracy_difference": acc_iv.to_dict(), "mse_difference": mse_iv.to_dict(),
                            "method": describe_level(acc_iv)}
        every_acc = paired_interval(results, rec, sorted(bl), "correct", best="max")
        every_mse = paired_interval(results, rec, sorted(bl), "se", best="min")
        if every_acc is not None and every_mse is not None and len(bl) > 1:
            out["intervals"]["every_baseline"] = {"accuracy_difference": every_acc.to_dict(),
                                                  "mse_difference": every_mse.to_dict(), "baselines": sorted(bl)}
    return out


def paired_interval(results: dict[str, Any], method: str, other: str | Sequence[str], key: str, *,
                    best: str = "max", resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> Interval | None:
    """Paired bootstrap interval (:mod:`.uncertainty`) of ``method``'s mean over tasks of the
    per-text ``key`` (``correct``: accuracy, ``se``: MSE) minus ``other``'s; ``None`` when the
    results lack any model's test texts. With several ``others``, the reference in each resample is
    the best of them on that resample (``best``: ``"max"`` for accuracy, ``"min"`` for MSE), so the
    choice of the best baseline is part of what the interval varies."""
    texts = results.get("per_text_test") or {}
    tasks = [t["name"] for t in results["tasks"]]
    others = [other] if isinstance(other, str) else list(other)
    if best not in ("max", "min"):
        raise ValueError(f"best must be 'max' or 'min', got {best!r}")
    if method not in texts or not others or any(o not in texts for o in others) or not tasks:
        return None
    try:
        a = [np.asarray(texts[method][t][key], dtype=np.float64) for t in tasks]
        bs = [[np.asarray(texts[o][t][key], dtype=np.float64) for t in tasks] for o in others]
    except KeyError:
        return None
    if any(len(x) != len(y) or not len(x) for b in bs for x, y in zip(a, b)):
        return None
    if len(bs) == 1:
        diff = [x - y for x, y in zip(a, bs[0])]
        return bootstrap(lambda idx: group_mean(diff, idx), [len(d) for d in diff], resamples=resamples, seed=seed)
    reduce = np.max if best == "max" else np.min

    def statistic(idx: Any) -> np.ndarray:
        return group_mean(a, idx) - reduce([group_mean(b, idx) for b in bs], axis=0)

    return bootstrap(statistic, [len(x) for x in a], resamples=resamples, seed=seed)


# ---------------------------------------------------------------------- report
def methods_table(results: dict[str, Any]) -> str:
    rows = []
    entries = {**results["methods"], **{f"{k} (reference)": v for k, v in results["references"].items()}}
    rec = results["selection"]["recommended"]["chosen"]
    for name, m in entries.items():
        label = f"**{name}** (recommended)" if name == rec else name
        if m.get("same_as"):  # not run again: over one layer the mode is that QP itself
            label += f" (= {m['same_as']}: one merged layer)"
        rows.append([label, _f(m["test"]["mean"]["accuracy"]), _f(m["test"]["mean"]["mse"]),
                     _f(m["calibration"]["mean"]["accuracy"]), _f(m["calibration"]["mean"]["mse"]),
                     "-" if m.get("same_as") else _f(m.get("seconds"), 3)])
    return _table(["method", "test accuracy", "test MSE", "calibration accuracy", "calibration MSE", "merge s"], rows)


def per_task_table(results: dict[str, Any], metric: str) -> str:
    entries = {**results["methods"], **{f"{k} (reference)": v for k, v in results["references"].items()}}
    tasks = [t["name"] for t in results["tasks"]]
    rows = [[name] + [_f(m["test"]["tasks"][t][metric]) for t in tasks] for name, m in entries.items()]
    return _table(["method"] + tasks, rows)


def geometry_table(results: dict[str, Any]) -> str:
    rows = [[p["basis"], str(p["p"]), _f(p["energy_fraction"]), _f(p["test"]["mse"]), _f(p["test"]["accuracy"])]
            for p in results.get("geometry", [])]
    return _table(["basis", "p", "energy fraction", "test MSE", "test accuracy"], rows)


def claims_table(claims: list[dict[str, Any]]) -> str:
    rows = [[c["id"], c["statement"], "PASS" if c["passed"] else "FAIL", _f(c["value"]) if not isinstance(
        c["value"], str) else c["value"], c["detail"]] for c in claims]
    return _table(["claim", "statement", "verdict", "value", "detail"], rows)


def goal_line(goal: dict[str, Any]) -> str:
    return (f"**Goal (issue 15, text classifier): {'PASS' if goal['passed'] else 'FAIL'}** -- recommended "
            f"`{goal['recommended']}`: mean test accuracy {_f(goal['accuracy'])} vs best baseline "
            f"{goal['best_baseline_accuracy']['method']} {_f(goal['best_baseline_accuracy']['value'])} "
            f"({'ok' if goal['accuracy_ok'] else 'lower'}); mean test MSE {_f(goal['mse'])} vs lowest baseline "
            f"{goal['best_baseline_mse']['method']} {_f(goal['best_baseline_mse']['value'])} "
            f"({'lower' if goal['mse_ok'] else 'not lower'})." + _interval_note(goal))


def _interval_note(goal: dict[str, Any]) -> str:
    iv = goal.get("intervals")
    if not iv:
        return ""
    acc, mse = (Interval(**iv[k]) for k in ("accuracy_difference", "mse_difference"))
    note = (f" {describe_level(acc)}: accuracy minus the best baseline's {acc.describe()} ({acc.relation()} zero), "
            f"MSE minus the lowest baseline's {mse.describe('.3g')} ({mse.relation()} zero).")
    every = iv.get("every_baseline")
    if every:
        e_acc, e_mse = (Interval(**every[k]) for k in ("accuracy_difference", "mse_difference"))
        note += (f" With the best of the {len(every['baselines'])} baselines chosen again in every resample: "
                 f"accuracy {e_acc.describe()} ({e_acc.relation()} zero), MSE {e_mse.describe('.3g')} "
                 f"({e_mse.relation()} zero).")
    return note


def _left_out(dropped: dict[str, int] | None) -> str:
    """The texts a task's split left out (``text_tasks.distinct_texts``), e.g. ``100 repeated``."""
    if dropped is None:
        return "-"  # (results of a run before stop 41)
    parts = [f"{dropped.get(k, 0)} {label}" for k, label in (("duplicates", "repeated"), ("conflicting", "two-label"),
                                                               ("blank", "blank")) if dropped.get(k, 0)]
    return ", ".join(parts) or "0"


def render_text_report(results: dict[str, Any]) -> str:
    sel = results["selection"]
    tasks = [[t["name"], str(len(t["labels"])), str(t["sizes"]["train"]), str(t["sizes"]["calibration"]),
              str(t["sizes"]["test"]), _left_out(t.get("dropped")), _f(t["finetune"]["loss_first"]),
              _f(t["finetune"]["loss_last"]), "yes" if t["finetune"]["cached"] else "no"] for t in results["tasks"]]
    timings = [[k, _f(v, 3)] for k, v in results.get("timings", {}).items()]
    lines = [
        "# Text experiment: merging fine-tuned sentence encoders (the paper's ViT section)", "",
        f"{invocation(results)}  ", f"Base model: `{results['base_model']}`; device `{results['device']}`"
        + (f" ({results['device_note']})" if results.get("device_note") else ""), "",
        f"Fine-tuned and merged tensors: {', '.join('`' + n + '`' for n in results['trained'])}, plus a linear "
        f"head per task on the mean-pooled embedding. Compared output in the merge QPs: "
        f"{results['compared_output']}. Output MSE: {results['mse_definition']}.", "",
        "## Tasks", "",
        _table(["task", "classes", "train", "calibration", "test", "left out", "loss first", "loss last", "cached"],
               tasks), "",
        "## Methods (mean over tasks)", "", methods_table(results), "",
        f"Task arithmetic's weight: {sel['task_arithmetic']['chosen']} ({sel['task_arithmetic']['criterion']}).  ",
        *([f"RegMean's alpha: {sel['regmean']['chosen']:g} ({sel['regmean']['criterion']}; the RegMean paper tunes "
           f"it on validation data).  "] if "regmean" in sel else []),
        f"Recommended merge: `{sel['recommended']['chosen']}` ({sel['recommended']['criterion']}).", "",
        *start_selection_lines(results["methods"].get(sel["recommended"]["chosen"], {})),
        goal_line(results["goal"]), "",
        "## Test accuracy per task", "", per_task_table(results, "accuracy"), "",
        "## Test output MSE per task", "", per_task_table(results, "mse"), "",
        "## Energy fraction vs MSE across bases (single mode, parametrisation basis)", "",
        f"Layers merged: {', '.join(f'`{x}`' for x in results.get('geometry_layers', results['layers']))}.", "",
        geometry_table(results), "",
        "## Claims of the paper's ViT section, as measured", "", claims_table(results["claims"]), "",
        "## Timings (s)", "", _table(["step", "seconds"], timings), "",
    ]
    if results.get("figures"):
        lines += ["## Figures", ""] + [f"![{k}]({v})" for k, v in results["figures"].items()] + [""]
    return "\n".join(lines)


def write_text_report(results: dict[str, Any], path: str) -> None:
    write_text_atomic(path, render_text_report(results))


def console_text_summary(results: dict[str, Any]) -> str:
    return "\n\n".join([methods_table(results), claims_table(results["claims"]), goal_line(results["goal"])])


# ---------------------------------------------------------------------- figures
def _pyplot() -> Any:
    import matplotlib  # optional heavy dependency: only the figures need it

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _bars(results: dict[str, Any], metric: str, path: str, ylabel: str) -> None:
    plt = _pyplot()
    entries = {**results["methods"], "finetuned (reference)": results["references"]["finetuned"]}
    tasks = [t["name"] for t in results["tasks"]] + ["mean"]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(tasks)), 4.5))
    width = 0.8 / len(entries)
    for i, (name, m) in enumerate(entries.items()):
        vals = [m["test"]["tasks"][t][metric] for t in tasks[:-1]] + [m["test"]["mean"][metric]]
        ax.bar(np.arange(len(tasks)) + i * width, vals, width, label=name)
    ax.set_xticks(np.arange(len(tasks)) + 0.4 - width / 2)
    ax.set_xticklabels(tasks)
    ax.set_ylabel(ylabel)
    if metric == "mse":
        ax.set_yscale("log")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    savefig_atomic(fig, path)
    plt.close(fig)


def _energy(results: dict[str, Any], path: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for basis in dict.fromkeys(p["basis"] for p in results["geometry"]):
        pts = sorted((p for p in results["geometry"] if p["basis"] == basis and p["energy_fraction"] is not None),
                     key=lambda p: p["p"])
        color, marker = BASIS_STYLE.get(basis, (None, "o"))
        ax.plot([p["energy_fraction"] for p in pts], [p["test"]["mse"] for p in pts], marker=marker, color=color,
                label=basis)
        for p in pts:
            ax.annotate(f"p={p['p']}", (p["energy_fraction"], p["test"]["mse"]), fontsize=6)
    ax.set_xlabel("captured energy fraction (calibration)")
    ax.set_ylabel("test output MSE (pooled embedding)")
    ax.legend()
    fig.tight_layout()
    savefig_atomic(fig, path)
    plt.close(fig)


def make_text_figures(results: dict[str, Any], out_dir: str) -> dict[str, str]:
    """Write ``accuracy_per_task.png``, ``mse_per_task.png`` and ``energy_vs_mse.png``; returns name -> file."""
    out = {}
    _bars(results, "accuracy", os.path.join(out_dir, "accuracy_per_task.png"), "test accuracy")
    out["accuracy_per_task"] = "accuracy_per_task.png"
    _bars(results, "mse", os.path.join(out_dir, "mse_per_task.png"), "test output MSE")
    out["mse_per_task"] = "mse_per_task.png"
    if results.get("geometry"):
        _energy(results, os.path.join(out_dir, "energy_vs_mse.png"))
        out["energy_vs_mse"] = "energy_vs_mse.png"
    return out


__all__ = ["console_text_summary", "evaluate_goal", "evaluate_text_claims", "make_text_figures",
           "render_text_report", "write_text_report"]
