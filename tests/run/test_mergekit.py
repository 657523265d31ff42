"""mergeqp's QP merge against mergekit's TIES / DARE-TIES / task arithmetic on the same checkpoints.

All models are evaluated with the same metric: teacher-forced MSE per logit against each
task's fine-tuned model on held-out prompts, and the calibration objective (the QP's, evaluated
exactly on the merged model). The fine-tuned models differ from the base only in the MLP of
block 1, so every merge (mergekit merges all tensors) differs from the base only at the layers
the QP merges. The comparison is written to a JSON and a Markdown report (printed).
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("mergekit", reason="mergekit (a test-only peer) is not installed")


from mergeqp.config import load_config
from mergeqp.io.checkpoint import open_checkpoint

MERGED = "model.layers.1.mlp.*"
MERGEKIT = {  # mergekit method -> per-model parameters (2 models)
    "ties": {"density": 0.5, "weight": 0.5},
    "dare_ties": {"density": 0.5, "weight": 0.5},
    "task_arithmetic": {"weight": 1.0},
}


def _mergekit(fam, method, params, out):
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    cfg = {"models": [{"model": str(p), "parameters": params} for p in fam.finetuned],
           "merge_method": method, "base_model": str(fam.base), "dtype": "float32"}
    run_merge(MergeConfiguration.model_validate(cfg), str(out),
              MergeOptions(copy_tokenizer=False, random_seed=0, quiet=True, lazy_unpickle=False))
    return out


def test_qp_vs_mergekit_teacher_forced_mse(tiny_hf, tmp_path):
    from mergeqp.lm import OutputSpec, squared_error, teacher_forced_mse
    from mergeqp.run.pipeline import load_model, prepare_tasks, run_merge
    from mergeqp.run.plan import build_plan
    from mergeqp.merge.report import jsonable

    fam = tiny_hf.make_family(tmp_path / "fam", "llama", K=2, perturbed=(MERGED,), scale=0.3, n_prompts=16)
    cfg_path = fam.write_config(tmp_path / "qp.yml", MERGED, {"name": "qp", "mode": "sequential"},
                              calibration={"max_length": 12, "batch_size": 4, "holdout": 6})
    cfg = load_config(cfg_path)
    qp = run_merge(cfg, tmp_path / "qp", progress=False)
    merged_keys = {k for s in qp.plan.sites for k in s.keys}
    assert len(qp.plan.sites) == 3

    folders = {"base": fam.base, "qp (sequential)": tmp_path / "qp"}
    for method, params in MERGEKIT.items():
        folders[f"mergekit {method}"] = _mergekit(fam, method, params, tmp_path / f"mk_{method}")
    base_ck = open_checkpoint(fam.base)
    for label, folder in folders.items():  # every merge differs from the base only at the merged layers
        ck = open_checkpoint(folder)
        changed = {n for n in base_ck.names() if not torch.equal(base_ck.get(n), ck.get(n))}
        assert changed <= merged_keys, (label, changed - merged_keys)
        if label != "base":
            assert changed, label
    # mergekit's task arithmetic (weights 1, lambda 1) is the QP's point d = 1
    ta = open_checkpoint(folders["mergekit task_arithmetic"])
    fts = [open_checkpoint(p) for p in fam.finetuned]
    for k in merged_keys:
        expect = base_ck.get(k) + sum(f.get(k) - base_ck.get(k) for f in fts)
        assert torch.allclose(ta.get(k), expect, atol=1e-6)

    # the same calibration / held-out split and targets as the QP run
    plan = build_plan(cfg)
    spec, eval_spec = OutputSpec(), OutputSpec()
    tasks = prepare_tasks(plan, spec, eval_spec, torch.float64, "cpu", lambda m: None)
    rows = {}
    for label, folder in folders.items():
        model = load_model(open_checkpoint(folder), fam.base, torch.float64, "cpu")
        calib = sum(t.weight * squared_error(model, t.calibration, spec, "cpu")[0] for t in tasks)
        mse = {t.name: teacher_forced_mse(model, t.heldout, eval_spec, "cpu") for t in tasks}
        rows[label] = {"calibration_objective": calib, "heldout_mse": mse,
                       "heldout_mse_mean": sum(mse.values()) / len(mse)}
    report = {"checkpoints": {"base": str(fam.base), "finetuned": [str(p) for p in fam.finetuned]},
              "merged_layers": sorted(merged_keys), "metric": "teacher-forced MSE per logit vs the task's "
              "fine-tuned model on held-out prompts; calibration objective = the QP's J, exact",
              "mergekit": MERGEKIT, "results": rows}
    (tmp_path / "comparison.json").write_text(json.dumps(jsonable(report), indent=2))
    lines = ["| model | calibration J | " + " | ".join(f"held-out MSE {t}" for t in fam.tasks) + " | mean |",
             "|---|---|" + "---|" * (len(fam.tasks) + 1)]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['calibration_objective']:.5g} | "
                     + " | ".join(f"{r['heldout_mse'][t]:.5g}" for t in fam.tasks) + f" | {r['heldout_mse_mean']:.5g} |")
    (tmp_path / "comparison.md").write_text("\n".join(lines) + "\n")
    print(f"\nQP vs mergekit on a tiny Llama (merged: {MERGED}); report {tmp_path / 'comparison.md'}\n"
          + "\n".join(lines))

    # the QP run's own bookkeeping agrees with the independent evaluation (of the float32 folder)
    assert rows["qp (sequential)"]["calibration_objective"] == pytest.approx(
        qp.report["evaluation"]["merged"]["calibration_objective"], rel=1e-6)
    assert rows["base"]["calibration_objective"] == pytest.approx(
        qp.report["evaluation"]["base"]["calibration_objective"], rel=1e-9)
    # the QP's calibration objective is never above the baselines' at the merged layers
    ours = rows["qp (sequential)"]["calibration_objective"]
    for label, r in rows.items():
        if label.startswith("mergekit"):
            assert ours <= r["calibration_objective"], (label, ours, r["calibration_objective"])
    assert ours < rows["base"]["calibration_objective"]
