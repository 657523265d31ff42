"""``report.md``, PNG figures and the console summary of the language experiment's results.

Figures (matplotlib, Agg backend): ``mean_ce.png`` (mean held-out cross-entropy per method, the
ceiling and the base as lines), ``domain_ce.png`` (held-out cross-entropy per domain and method),
``ce_vs_mse.png`` (mean held-out cross-entropy against mean logit MSE to the fine-tunes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..io.atomic import savefig_atomic, write_text_atomic
from .lm_claims import MULTITASK, ceiling_ce
from .plots import _pyplot
from ..merge.report import start_selection_lines
from .report import _f, _table, invocation

KIND_COLOUR = {"qp": "tab:green", "baseline": "tab:blue", "mergekit": "tab:orange", "reference": "tab:gray"}


def _merges(results: dict[str, Any]) -> dict[str, Any]:
    return {n: m for n, m in results["methods"].items() if m.get("kind") != "reference" or n == "base"}


def methods_table(results: dict[str, Any]) -> str:
    """One row per model: mean held-out CE / MSE / KL, calibration CE, time, memory."""
    rows = []
    for name, m in results["methods"].items():
        t = m["mean_test"]
        star = name == (results.get("recommended") or {}).get("method")
        rows.append([f"**{name}**" if star else name, m.get("kind", ""), _f(t["ce"]), _f(t["mse"]), _f(t["kl"]),
                     _f(m["mean_calibration_ce"]), _f(m.get("seconds")), _f(m.get("peak_rss_mb"))])
    return _table(["method", "kind", "test CE", "test logit MSE", "test KL", "calibration CE", "merge s",
                   "peak RSS MB"], rows)


def domain_table(results: dict[str, Any], metric: str) -> str:
    domains = list(results["domains"])
    rows = [[name] + [_f(m["test"][d][metric]) for d in domains] for name, m in results["methods"].items()]
    return _table(["method", *domains], rows)


def claims_markdown(claims: list[dict[str, Any]]) -> str:
    return _table(["claim", "statement", "measured", "verdict"],
                  [[c["id"], c["statement"], c["detail"], "PASS" if c["passed"] else "FAIL"] for c in claims])


def render_report(results: dict[str, Any]) -> str:
    """The Markdown of ``report.md``."""
    goal = results["goal"]
    rec = results.get("recommended") or {}
    ta = results["task_arithmetic_tuning"]
    timings = results["timings"]
    ft_rows = [[d, _f(r["loss_first"]), _f(r["loss_last"]), "yes" if r["cached"] else "no", _f(r["seconds"])]
               for d, r in results["finetunes"].items()]
    lines = [
        "# Language-model merging experiment (`mergeqp experiment lm`)", "",
        f"{invocation(results)} -- base `{results['base']}`, device {results['device']}, "
        f"{results['environment']['threads']} torch threads, total {timings['total']:.0f} s wall, "
        f"{timings.get('total_cpu', float('nan')):.0f} s CPU (this process; mergekit subprocesses not included).", "",
        f"Fine-tuned tensors: {', '.join(results['finetuned_tensors'])}. Texts per domain (train / calibration / "
        f"test): " + ", ".join(f"{d} {v['train']}/{v['calibration']}/{v['test']}"
                               for d, v in results['domains'].items())
        + ".", "",
        "## Goal (issue 15, language models)", "",
        f"**{'PASS' if goal['passed'] else 'FAIL'}**: {goal['detail']}.", "",
        f"Recommended merge: `{rec.get('method')}`, chosen by the rule: {rec.get('rule')} "
        f"(calibration CE {_f(rec.get('mean_calibration_ce'))}).", "",
        *start_selection_lines(rec),
        "## Methods (means over domains; held-out test texts)", "",
        "CE: next-token cross-entropy (nats per predicted token); logit MSE and KL: teacher-forced, to the "
        "domain's fine-tune (MSE per logit, KL(fine-tune || model) per token). `merge s`: wall time of the "
        "merge (run layer or mergekit subprocess); `peak RSS MB`: peak resident memory sampled every 20 ms "
        "during it (run layer: the whole experiment process, which also holds the base model and the cached "
        "hidden states; mergekit: its subprocess during that merge). The fine-tunes are the ceiling on their own domain "
        f"(mean {_f(ceiling_ce(results))})." + multitask_sentence(results), "",
        methods_table(results), "",
        *twin_lines(results),
        "### Held-out cross-entropy per domain", "", domain_table(results, "ce"), "",
        "### Held-out logit MSE per domain", "", domain_table(results, "mse"), "",
        *atoms_lines(results),
        "## Paper's LLM claims, as measured", "", claims_markdown(results["claims"]), "",
        "## Settings", "",
        f"Task arithmetic scaling {ta['chosen']:g}, chosen by the {ta['criterion']} among "
        + ", ".join(f"{k} ({_f(v)})" for k, v in ta["scalings"].items()) + ".", "",
        *[line for key, what in (("regmean_tuning", "RegMean"),
                                 ("regmean_sequential_tuning", "Sequential RegMean (RegMean++)"))
          if (rm := results.get(key))
          for line in (f"{what} alpha {rm['chosen']:g}, chosen by the {rm['criterion']} among "
                       + ", ".join(f"{k} ({_f(v)})" for k, v in rm["alphas"].items()) + " (the RegMean paper tunes "
                       "alpha on validation data).", "")],
        _table(["domain", "fine-tune loss (first 5 steps)", "(last 5 steps)", "cached", "seconds"], ft_rows), "",
        "```", _settings_text(results["config"]), "```", "",
        "Timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()) + ".",
    ]
    if results.get("notes"):
        lines += ["", "Notes:", *[f"- {n}" for n in results["notes"]]]
    if results.get("figures"):
        lines += ["", "## Figures", ""] + [f"![{Path(f).stem}]({Path(f).name})" for f in results["figures"]]
    return "\n".join(lines) + "\n"


def multitask_sentence(results: dict[str, Any]) -> str:
    """What the ``multitask`` reference row is (empty when it did not run)."""
    m = results["methods"].get(MULTITASK)
    if m is None:
        return ""
    steps = (results.get("finetunes") or {}).get(MULTITASK, {}).get("steps")
    return (f" `{MULTITASK}` is one model fine-tuned by the same recipe on every domain's train texts, each text "
            f"once ({steps} steps): what training on all the data, instead of merging, reaches (mean "
            f"{_f(m['mean_test']['ce'])}).")


def twin_lines(results: dict[str, Any]) -> list[str]:
    """A note naming the models whose tensors equal another's to float rounding (evaluated once)."""
    twins = [f"`{name}` = `{m['evaluated_as']['model']}` (largest relative difference of a tensor "
             f"{m['evaluated_as']['max_relative_difference']:.1e})"
             for name, m in results["methods"].items() if m.get("evaluated_as")]
    if not twins:
        return []
    return ["Evaluated once for both (their tensors are equal to float rounding, so are their numbers): "
            + "; ".join(twins) + ".", ""]


def atoms_lines(results: dict[str, Any]) -> list[str]:
    """The ``qp_atoms`` section: per layer, the weight its result gives each baseline's merged
    residual (``rows+baselines``; 1 = the baseline itself) and that residual's norm."""
    m = results["methods"].get("qp_atoms")
    layers = [x for x in ((m or {}).get("report") or {}).get("layers", []) if x.get("baselines")]
    if not layers:
        return []
    names = list(layers[0]["baselines"])
    rows = [[f"`{x.get('layer')}`", *(f"{_f(x['baselines'][n]['weight'])} ({_f(x['baselines'][n]['residual_norm'])})"
                                      for n in names)] for x in layers]
    return ["## Baselines as feasible points (`qp_atoms`)", "",
            ("A trust region like the recommended merge's, whose QPs have each baseline's merged residual as an "
             "atom next to the rows (`rows+baselines`), so every baseline is a feasible point of every step. "
             "How much of each baseline's residual the result adds to its start (the trust region's coefficients "
             "are its step from the start; the residual's Frobenius norm in brackets):"), "",
            _table(["layer", *names], rows), ""]


def _settings_text(config: dict[str, Any]) -> str:
    merge = config["merge"]
    top = {k: v for k, v in config.items() if k != "merge"}
    return "\n".join([*(f"{k}: {v}" for k, v in top.items()), *(f"merge.{k}: {v}" for k, v in merge.items())])


def make_lm_figures(results: dict[str, Any], out_dir: Path) -> list[str]:
    """Write the three figures into ``out_dir``; returns their file names."""
    plt = _pyplot()
    merges = _merges(results)
    names = list(merges)
    colours = [KIND_COLOUR.get(merges[n].get("kind"), "tab:gray") for n in names]
    written = []

    fig, ax = plt.subplots(figsize=(max(8, 0.5 * len(names) + 2), 4.5))
    ax.bar(np.arange(len(names)), [merges[n]["mean_test"]["ce"] for n in names], color=colours)
    ax.axhline(ceiling_ce(results), color="black", linestyle="--", linewidth=1, label="ceiling (fine-tunes)")
    ax.set_xticks(np.arange(len(names)), names, rotation=70, ha="right", fontsize=8)
    ax.set_ylabel("mean held-out cross-entropy (nats)")
    lo = min(ceiling_ce(results), *(merges[n]["mean_test"]["ce"] for n in names))
    hi = max(merges[n]["mean_test"]["ce"] for n in names)
    ax.set_ylim(lo - 0.05 * (hi - lo + 1e-9), hi + 0.05 * (hi - lo + 1e-9))
    ax.legend()
    fig.tight_layout()
    savefig_atomic(fig, out_dir / "mean_ce.png", dpi=110)
    plt.close(fig)
    written.append("mean_ce.png")

    domains = list(results["domains"])
    all_models = list(results["methods"])
    width = 0.8 / len(all_models)
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(max(8, 2.5 * len(domains) + 2), 4.8))
    for i, n in enumerate(all_models):
        vals = [results["methods"][n]["test"][d]["ce"] for d in domains]
        ax.bar(np.arange(len(domains)) + (i - (len(all_models) - 1) / 2) * width, vals, width, label=n,
               color=cmap(i % 20))
    ax.set_xticks(np.arange(len(domains)), domains)
    ax.set_ylabel("held-out cross-entropy (nats)")
    ax.legend(fontsize=6, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    savefig_atomic(fig, out_dir / "domain_ce.png", dpi=110)
    plt.close(fig)
    written.append("domain_ce.png")

    fig, ax = plt.subplots(figsize=(7, 5))
    for n, c in zip(names, colours):
        t = merges[n]["mean_test"]
        ax.scatter(t["mse"], t["ce"], color=c)
        ax.annotate(n, (t["mse"], t["ce"]), fontsize=6, xytext=(3, 2), textcoords="offset points")
    ax.set_xlabel("mean held-out logit MSE to the fine-tunes")
    ax.set_ylabel("mean held-out cross-entropy (nats)")
    fig.tight_layout()
    savefig_atomic(fig, out_dir / "ce_vs_mse.png", dpi=110)
    plt.close(fig)
    written.append("ce_vs_mse.png")
    return written


def write_lm_outputs(results: dict[str, Any], out_dir: Path, figures: bool = True) -> list[str]:
    """Figures (when ``figures``) and ``report.md`` into ``out_dir``; returns the figure names."""
    names = make_lm_figures(results, Path(out_dir)) if figures else []
    results["figures"] = names
    write_text_atomic(Path(out_dir) / "report.md", render_report(results))
    return names


def console_summary(results: dict[str, Any]) -> str:
    """What the CLI prints: mean held-out metrics per method, the goal and the claims."""
    rows = [f"{'method':32s} {'test CE':>9s} {'logit MSE':>10s} {'KL':>8s} {'cal CE':>8s} {'s':>7s}"]
    for name, m in results["methods"].items():
        t = m["mean_test"]
        sec = m.get("seconds")
        rows.append(f"{name:32s} {t['ce']:9.4f} {t['mse']:10.4g} {t['kl']:8.4f} {m['mean_calibration_ce']:8.4f} "
                    f"{'-' if sec is None else f'{sec:.1f}':>7s}")
    goal = results["goal"]
    rows += ["", f"goal: {'PASS' if goal['passed'] else 'FAIL'}: {goal['detail']}", ""]
    rows += [f"{c['id']:3s} {'PASS' if c['passed'] else 'FAIL'}  {c['statement']} ({c['detail']})"
             for c in results["claims"]]
    if results.get("notes"):  # (a device fallback, mergekit not importable, a run left out: report.md's notes)
        rows += ["", *(f"note: {n}" for n in results["notes"])]
    return "\n".join(rows)


__all__ = ["console_summary", "make_lm_figures", "render_report", "write_lm_outputs"]
