"""PNG figures of an MNIST results dict (matplotlib, Agg backend: no display needed).

- ``mse_per_task.png``: held-out logit MSE per task (and the average) for every method;
- ``accuracy_per_task.png``: held-out accuracy per task (and the average);
- ``energy_vs_mse.png``: the geometry experiment, captured energy fraction against held-out
  MSE per basis as p grows;
- ``coefficients.png``: the learned coefficients ``d`` (models x rows) of qp, qp_adam, qp_tr.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..io.atomic import savefig_atomic

FIGURES = ("mse_per_task", "accuracy_per_task", "energy_vs_mse", "coefficients")
BASIS_STYLE = {"optimal": ("tab:green", "o"), "standard": ("tab:blue", "s"),
               "svd": ("tab:orange", "^"), "random": ("tab:gray", "x")}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _entries(results: dict[str, Any], include_reference: bool) -> dict[str, Any]:
    """Methods, plus the fine-tuned reference (each task by its own model) when asked."""
    entries = dict(results["methods"])
    if include_reference:
        entries.update({f"{k} (reference)": v for k, v in results.get("references", {}).items()})
    return entries


def _bars(results: dict[str, Any], metric: str, path: str, ylabel: str, log: bool,
          include_reference: bool) -> None:
    plt = _pyplot()
    entries = _entries(results, include_reference)
    methods = list(entries)
    tasks = list(results["methods"]["qp"]["tasks"])
    groups = tasks + ["average"]
    width = 0.8 / len(methods)
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(groups) + 2), 4.5))
    x = np.arange(len(groups))
    for i, m in enumerate(methods):
        entry = entries[m]
        vals = [entry["tasks"][t][metric] for t in tasks] + [entry["average"][metric]]
        ax.bar(x + (i - (len(methods) - 1) / 2) * width, vals, width, label=m, color=cmap(i % 20),
               edgecolor="black" if m.startswith("qp") else "none", linewidth=0.6)
    ax.set_xticks(x, groups)
    ax.set_xlabel("task (digit pair)")
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(ncol=2, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.set_title(f"MNIST MLP, merge at {results.get('layer', 'layer2')}: {ylabel} (held-out test)")
    fig.tight_layout()
    savefig_atomic(fig, path, dpi=120)
    plt.close(fig)


def energy_figure(results: dict[str, Any], path: str) -> None:
    plt = _pyplot()
    pts = results["geometry"]["points"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for basis in results["geometry"]["bases"]:
        color, marker = BASIS_STYLE.get(basis, ("black", "."))
        seeds = sorted({p["seed"] for p in pts if p["basis"] == basis}, key=lambda s: -1 if s is None else s)
        for j, seed in enumerate(seeds):
            sel = sorted((p for p in pts if p["basis"] == basis and p["seed"] == seed), key=lambda p: p["p"])
            label = basis if j == 0 else None
            ax.plot([p["energy_fraction"] for p in sel], [p["mse"] for p in sel], marker=marker,
                    color=color, label=label, alpha=0.6 if basis == "random" else 1.0)
            if basis == "optimal":
                for p in sel:
                    ax.annotate(f"p={p['p']}", (p["energy_fraction"], p["mse"]), fontsize=6,
                                textcoords="offset points", xytext=(3, 3))
    soup = results["methods"].get("soup", {}).get("average", {}).get("mse")
    if soup is not None:
        ax.axhline(soup, color="tab:red", ls="--", lw=1, label="soup")
    ax.set_xlabel("captured residual energy  tr(SP)/tr(S)  (calibration)")
    ax.set_ylabel("held-out logit MSE (average over tasks)")
    ax.set_title("Geometry: energy fraction vs MSE as the basis dimension p grows")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    savefig_atomic(fig, path, dpi=120)
    plt.close(fig)


def coefficients_figure(results: dict[str, Any], path: str) -> None:
    plt = _pyplot()
    coef = results["coefficients"]
    names = [k for k in ("qp", "qp_adam", "qp_tr") if k in coef]
    tasks = list(results["methods"]["qp"]["tasks"])
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 1.3 + 1.1 * len(names) * max(1, len(tasks) / 5)),
                             squeeze=False)
    im = None
    for ax, name in zip(axes[:, 0], names):
        d = np.asarray(coef[name], dtype=float)
        im = ax.imshow(d, aspect="auto", vmin=0.0, vmax=1.0, cmap="viridis", interpolation="nearest")
        ax.set_yticks(range(d.shape[0]), tasks)
        ax.set_ylabel(name)
    axes[-1, 0].set_xlabel(f"row of {results.get('layer', 'layer2')} (output feature)")
    axes[0, 0].set_title("merge coefficients d (model x row), box [0, 1]")
    if im is not None:
        fig.colorbar(im, ax=axes[:, 0].tolist(), fraction=0.03, pad=0.01)
    savefig_atomic(fig, path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def make_figures(results: dict[str, Any], out_dir: str) -> dict[str, str]:
    """Write the four figures into ``out_dir``; returns ``{figure: file name}``."""
    os.makedirs(out_dir, exist_ok=True)
    files = {name: f"{name}.png" for name in FIGURES}
    _bars(results, "mse", os.path.join(out_dir, files["mse_per_task"]),
          "logit MSE vs fine-tuned model (log scale)", log=True, include_reference=False)
    _bars(results, "accuracy", os.path.join(out_dir, files["accuracy_per_task"]), "accuracy",
          log=False, include_reference=True)
    energy_figure(results, os.path.join(out_dir, files["energy_vs_mse"]))
    coefficients_figure(results, os.path.join(out_dir, files["coefficients"]))
    return files
