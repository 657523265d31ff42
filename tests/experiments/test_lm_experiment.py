"""The language experiment (``mergeqp experiment lm``) on a tiny random Llama with tiny synthetic
corpora: the whole pipeline end to end (fine-tunes, run-layer merges, evaluation, report), the
evaluator against plain full-model forwards, disjoint splits, the cache, the calibration-only
choices, claims / goal rendering and CLI errors."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from mergeqp.cli import main  # noqa: E402
from mergeqp.errors import UnknownNameError, ValidationError  # noqa: E402
from mergeqp.experiments.corpora import Corpus  # noqa: E402
from mergeqp.experiments.lm import (  # noqa: E402
    LmConfig,
    MODULE_OUTPUTS,
    RECOMMENDED_RUN,
    LmMergeSettings,
    mergekit_yaml,
    run_lm_experiment,
    select_layers,
    split_domains,
    with_overrides,
)
from mergeqp.experiments.lm_claims import evaluate_lm_claims, lm_goal, recommended_merge  # noqa: E402
from mergeqp.experiments.lm_report import console_summary, render_report  # noqa: E402

DOMAINS = ("code", "math", "story")


def _corpora(tiny_hf, n=40):
    return [Corpus(t, tuple(tiny_hf.sentences(t, n, seed=i)), np.arange(n) % 2, ("a", "b"), "synthetic")
            for i, t in enumerate(DOMAINS)]


def _config(**merge):
    settings = {"calibration_max_length": 16, "calibration_batch_size": 4, "ta_scalings": (0.5, 1.0),
                "outputs": {"euclidean": {"restrict": "none"}, "kl": {"restrict": "topk", "k": 8},
                            "cross_entropy": {"restrict": "topk", "k": 8, "sketch": 16}},
                "modes": ("single", "sequential"), "metrics": ("euclidean",), "baselines": ("ties", "regmean"),
                "regmean_alphas": (0.1, 0.9),
                "mergekit": ("ties",) if importlib.util.find_spec("mergekit") else (), **merge}
    return LmConfig(train_texts=16, calibration_texts=6, test_texts=6, min_chars=5, finetune_blocks=1,
                    finetune_steps=12, finetune_batch=4, finetune_max_length=16, finetune_lr=1e-2,
                    eval_max_length=16, eval_batch=4, merge=LmMergeSettings(**settings))


@pytest.fixture(scope="module")
def tiny_base(tiny_hf, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_base")
    tiny_hf.build_base(folder, "llama", seed=0)
    return folder


@pytest.fixture(scope="module")
def lm_run(tiny_hf, tiny_base, tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_run")
    out = root / "out"
    results = run_lm_experiment(out, corpora=_corpora(tiny_hf), config=_config(), cache=root / "cache",
                                base_folder=tiny_base, threads=1, progress=False)
    return results, out, root


def test_pipeline_end_to_end(lm_run):
    results, out, root = lm_run
    on_disk = json.loads((out / "results.json").read_text())
    assert set(on_disk["domains"]) == set(DOMAINS)
    for name in ("mean_ce.png", "domain_ce.png", "ce_vs_mse.png", "report.md"):
        assert (out / name).is_file()
    assert not list(root.glob(".lm-work-*"))  # the work folder (merged models, prompt files) is removed
    methods = results["methods"]
    expected = {"base", *(f"finetune:{d}" for d in DOMAINS), "multitask", "task_arithmetic", "ties", "regmean",
                "qp_single_euclidean",
                "qp_sequential_euclidean", "qp_atoms", "output_space"}
    if importlib.util.find_spec("mergekit"):
        expected.add("mergekit_ties")
    assert set(methods) == expected
    for name, m in methods.items():
        for d in DOMAINS:
            assert all(math.isfinite(m["test"][d][k]) for k in ("ce", "mse", "kl")), name
        assert m["changed_outside_upper_blocks"] == []
        if m["kind"] != "reference":
            assert m["seconds"] > 0 and m["peak_rss_mb"] > 0
    # each fine-tune is its own domain's reference: zero distance there, not elsewhere
    for d in DOMAINS:
        own = methods[f"finetune:{d}"]["test"][d]
        assert own["mse"] == 0 and abs(own["kl"]) < 1e-9
        assert methods["base"]["test"][d]["mse"] > 0
    # the multitask reference: one fine-tune on every domain's train texts, each once, by the same recipe
    record = results["finetunes"]["multitask"]
    saved = json.loads((Path(record["folder"]) / "finetune.json").read_text())
    assert record["steps"] == 3 * 12 and saved["texts"] == 3 * 16 and saved["settings"]["lr"] == 1e-2
    assert methods["multitask"]["kind"] == "reference"
    assert all(methods["multitask"]["test"][d]["mse"] > 0 for d in DOMAINS)
    goal = results["goal"]
    assert goal["multitask_ce"] == methods["multitask"]["mean_test"]["ce"] and "multitask" in goal["detail"]
    # every test text's NLL, per model and domain, and the goal's paired intervals from them
    texts = on_disk["per_text_test"]
    assert set(texts) == set(methods)
    for name, m in methods.items():
        for d in DOMAINS:
            t = texts[name][d]
            assert len(t["nll"]) == len(t["predicted"]) == results["domains"][d]["test"]
            assert sum(t["nll"]) / sum(t["predicted"]) == pytest.approx(m["test"][d]["ce"], rel=1e-9)
            assert "text_nll" not in m["test"][d]
    diff = goal["intervals"]["ce_difference"]
    assert diff["estimate"] == pytest.approx(goal["best_rival_ce"] - goal["recommended_ce"], rel=1e-9)
    assert diff["low"] <= diff["high"] and "paired bootstrap" in goal["detail"]
    assert goal["passed"] == (goal["beats_every_rival"] and goal["gap_closed"] >= 0.5)  # context only
    # the merges changed something and are not the base
    seq = methods["qp_sequential_euclidean"]
    assert seq["test"]["code"]["mse"] != methods["base"]["test"]["code"]["mse"]
    # the single-layer QP merged only the last fine-tuned layer
    assert methods["qp_single_euclidean"]["layers"] == ["model.layers.1.mlp.down_proj"]
    assert seq["layers"] == [f"model.layers.1.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    assert seq["metric"] == "euclidean" and seq["method"]["parametrisation"] == "scalar"
    assert all(layer["certified"] for layer in seq["report"]["layers"])
    # each domain's objective divided by its compared tokens (the metric averages per-domain means)
    (note,) = [n for n in seq["report"]["notes"] if n.startswith("calibration.balance tokens")]
    assert all(f"{d} " in note for d in DOMAINS)
    # every baseline a feasible point of the trust region's QPs (RegMean and Fisher with statistics)
    atoms = methods["qp_atoms"]
    assert atoms["kind"] == "qp" and atoms["method"]["parametrisation"] == "rows+baselines"
    assert [b["name"] for b in atoms["method"]["baselines"]] == ["regmean", "fisher", "ties", "task_arithmetic"]
    assert atoms["method"]["baselines"][3]["params"]["scaling"] == results["task_arithmetic_tuning"]["chosen"]
    assert atoms["method"]["baselines"][0]["params"]["alpha"] == results["regmean_tuning"]["chosen"]
    assert atoms["layers"] == ["model.layers.1.mlp.down_proj"] and atoms["metric"] == "cross_entropy"
    # the output-space merge of the same layer, fitted to the fine-tunes' top-k outputs
    space = methods["output_space"]
    assert space["kind"] == "output_space" and space["metric"] == "kl" and space["layers"] == atoms["layers"]
    assert space["test"]["code"]["mse"] != methods["base"]["test"]["code"]["mse"]


def test_choices_use_calibration_texts_only(lm_run):
    results, _, _ = lm_run
    tuning = results["task_arithmetic_tuning"]
    ce = {float(k): v for k, v in tuning["scalings"].items()}
    assert tuning["chosen"] == min(ce, key=ce.get)
    ta = results["methods"]["task_arithmetic"]
    assert ta["method"]["params"]["scaling"] == tuning["chosen"]
    # the tuning criterion is the calibration evaluation of the chosen merge, not its test evaluation
    assert ce[tuning["chosen"]] == pytest.approx(ta["mean_calibration_ce"], rel=1e-9)
    assert ce[tuning["chosen"]] != pytest.approx(ta["mean_test"]["ce"], rel=1e-6)
    # RegMean's alpha alike (stop 78: the RegMean paper tunes it on validation data), but scored on calibration
    # texts its fit did not see (stop 79: in-sample scores favour the least shrinkage), 4-fold by default
    tuning = results["regmean_tuning"]
    ce = {float(k): v for k, v in tuning["alphas"].items()}
    assert set(ce) == {0.1, 0.9} and tuning["chosen"] == min(ce, key=ce.get)
    assert "held-out" in tuning["criterion"] and "4-fold" in tuning["criterion"]
    assert len(tuning["held_out_texts"]) == 4
    for d in DOMAINS:  # 6 calibration texts: contiguous folds of 2, 2, 1, 1, every text held out once
        assert [f[d] for f in tuning["held_out_texts"]] == [2, 2, 1, 1]
    regmean = results["methods"]["regmean"]
    assert regmean["method"]["params"]["alpha"] == regmean["alpha"] == tuning["chosen"]
    # the row is the chosen alpha fitted on every calibration text: its calibration CE is in-sample, not the score
    assert ce[tuning["chosen"]] != pytest.approx(regmean["mean_calibration_ce"], rel=1e-6)
    assert ce[0.1] != pytest.approx(ce[0.9], rel=1e-9)  # two merges, not one twice
    rec = results["recommended"]
    qps = {n: m for n, m in results["methods"].items() if m["kind"] == "qp"}
    assert rec["method"] == min(qps, key=lambda n: qps[n]["mean_calibration_ce"])


def test_regmeans_alpha_is_scored_on_texts_its_fit_did_not_see(tiny_hf, tiny_base, lm_run, tmp_path, monkeypatch):
    """Every fold's RegMean is fitted on prompt files without the texts that fold scores, every calibration
    text is scored once, and the row is refitted on all of them; ``tuning_folds: 1`` is the in-sample rule."""
    import mergeqp.experiments.lm as lm_module

    results, _, root = lm_run
    fitted, scored = [], []
    merge, evaluator = lm_module.run_layer_merge, lm_module.UpperEvaluator

    def recording_merge(ctx, label, method, layers, metric="euclidean"):
        if method["name"] == "regmean":
            fitted.append((label, {f.name: [json.loads(x)["text"] for x in f.read_text().splitlines()]
                                   for f in ctx.calibration_files}))
        return merge(ctx, label, method, layers, metric)

    class RecordingEvaluator(evaluator):
        def __init__(self, base, tokenizer, first, domains, **kw):
            scored.append({d: list(t) for d, t in domains.items()})
            super().__init__(base, tokenizer, first, domains, **kw)

    monkeypatch.setattr(lm_module, "run_layer_merge", recording_merge)
    monkeypatch.setattr(lm_module, "UpperEvaluator", RecordingEvaluator)
    small = _config(modes=("single",), metrics=("euclidean",), baselines=("regmean",), mergekit=(), extra_runs=(),
                    ta_scalings=(1.0,), regmean_alphas=(0.1, 0.9), tuning_folds=3)
    run = run_lm_experiment(tmp_path / "cv", corpora=_corpora(tiny_hf), cache=root / "cache", base_folder=tiny_base,
                            config=small, threads=1, progress=False, multitask=False)
    test_texts, calibration = scored[0], scored[1]  # the run's two evaluators, then one per fold
    folds = scored[2:]
    assert len(folds) == 3 and len(fitted) == 3 * 2 + 1
    for i, held in enumerate(folds):
        fits = [f for label, f in fitted if f"(fold {i + 1} of 3)" in label]
        assert len(fits) == 2  # both alphas fitted on the same texts
        for d in DOMAINS:
            fit_texts = next(t for name, t in fits[0].items() if name.startswith(f"calibration_{d}_"))
            assert not set(fit_texts) & set(held[d])  # nothing the fold scores was fitted on
            assert sorted(fit_texts + held[d]) == sorted(calibration[d])
    for d in DOMAINS:
        assert sorted(x for held in folds for x in held[d]) == sorted(calibration[d])  # each text scored once
        assert not set(calibration[d]) & set(test_texts[d])
    label, final = fitted[-1]
    assert label == "regmean" and all(sorted(final[f"calibration_{d}.jsonl"]) == sorted(calibration[d])
                                      for d in DOMAINS)
    assert run["methods"]["regmean"]["alpha"] == run["regmean_tuning"]["chosen"]
    # one fold: each alpha fitted on every calibration text and scored on them (stop 78's rule)
    fitted.clear()
    insample = run_lm_experiment(tmp_path / "in", corpora=_corpora(tiny_hf), cache=root / "cache",
                                 base_folder=tiny_base, config=dataclasses.replace(
                                     small, merge=dataclasses.replace(small.merge, tuning_folds=1)),
                                 threads=1, progress=False, multitask=False)
    tuning = insample["regmean_tuning"]
    ce = {float(k): v for k, v in tuning["alphas"].items()}
    assert tuning["criterion"] == "mean calibration cross-entropy" and "held_out_texts" not in tuning
    assert ce[tuning["chosen"]] == pytest.approx(insample["methods"]["regmean"]["mean_calibration_ce"], rel=1e-9)
    assert [label for label, _ in fitted] == ["regmean_0.1", "regmean_0.9"]


def test_sequential_regmean_is_a_cross_validated_rival(tiny_hf, tiny_base, lm_run, tmp_path, monkeypatch):
    """(stop 80) RegMean with each layer's Grams at the merged model (RegMean++, in FusionBench too) is a
    baseline row: its alpha chosen by the same held-out folds as RegMean's (every fold fitted without the
    texts it scores), run through the run layer's model method, counted among the goal's rivals and named
    in the report's settings; it cannot be an atom of the rows+baselines trust region."""
    import mergeqp.experiments.lm as lm_module

    results, _, root = lm_run
    fitted = []
    merge = lm_module.run_layer_merge

    def recording_merge(ctx, label, method, layers, metric="euclidean"):
        if method["name"] == "regmean_sequential":
            fitted.append((label, dict(method["params"]), len(ctx.calibration_files)))
        return merge(ctx, label, method, layers, metric)

    monkeypatch.setattr(lm_module, "run_layer_merge", recording_merge)
    small = _config(modes=("single",), metrics=("euclidean",), baselines=("regmean_sequential",), mergekit=(),
                    extra_runs=(), ta_scalings=(1.0,), regmean_alphas=(0.1, 0.9), tuning_folds=2)
    run = run_lm_experiment(tmp_path / "seq", corpora=_corpora(tiny_hf), cache=root / "cache", base_folder=tiny_base,
                            config=small, threads=1, progress=False, multitask=False)
    tuning = run["regmean_sequential_tuning"]
    ce = {float(k): v for k, v in tuning["alphas"].items()}
    assert tuning["chosen"] == min(ce, key=ce.get) and "2-fold" in tuning["criterion"]
    assert [(label, p["alpha"]) for label, p, _ in fitted] == [
        ("regmean_sequential_0.1 (fold 1 of 2)", 0.1), ("regmean_sequential_0.9 (fold 1 of 2)", 0.9),
        ("regmean_sequential_0.1 (fold 2 of 2)", 0.1), ("regmean_sequential_0.9 (fold 2 of 2)", 0.9),
        ("regmean_sequential", tuning["chosen"])]
    row = run["methods"]["regmean_sequential"]
    assert row["kind"] == "baseline" and row["alpha"] == tuning["chosen"]
    assert row["method"] == {"name": "regmean_sequential", "params": {"alpha": tuning["chosen"]}}
    assert "regmean_sequential" in {n for n, m in run["methods"].items() if m["kind"] == "baseline"}
    goal = lm_goal(run)
    rivals = {n: m["mean_test"]["ce"] for n, m in run["methods"].items() if m["kind"] in ("baseline", "mergekit")}
    assert goal["best_rival"] == min(rivals, key=rivals.get)
    assert "Sequential RegMean (RegMean++) alpha" in render_report(run)
    with pytest.raises(UnknownNameError, match="unknown atoms baseline 'regmean_sequential'"):
        LmMergeSettings(atoms={"baselines": ("regmean_sequential",), "metric": "cross_entropy"})


def test_report_and_claims_render(lm_run):
    results, out, _ = lm_run
    text = (out / "report.md").read_text()
    assert text == render_report(results)
    assert "## Goal" in text and ("**PASS**" in text or "**FAIL**" in text)
    # (stop 50) a run from Python with a custom configuration printed a `mergeqp experiment lm --quick --domains ...`
    # command that the CLI would refuse (its domains are not registered) or that would run other sizes
    assert results["command"] is None and "Run from Python (`mergeqp.experiments.run_lm_experiment`" in text
    assert "| qp_sequential_euclidean |" in text or "| **qp_sequential_euclidean** |" in text
    ids = [c["id"] for c in results["claims"]]
    assert ids == ["F", "L1", "L2", "L3", "L4"]
    summary = console_summary(results)
    assert "goal:" in summary and "qp_single_euclidean" in summary
    # the notes (a device fallback, mergekit missing ...) reach the console too, not only report.md (stop 50)
    assert all(f"note: {n}" in summary for n in results["notes"])
    assert "note: a test note" in console_summary({**results, "notes": ["a test note"]})


def test_attention_finetunes_merge_their_output_projections(tiny_hf, tiny_base, tmp_path):
    """Fine-tunes of the attention instead of the MLP (``finetune_modules``): the recommended merge
    takes the rows of each fine-tuned module's last layer, here ``o_proj``, not ``down_proj``."""
    config = dataclasses.replace(_config(runs=(RECOMMENDED_RUN,), baselines=("soup",), mergekit=(), extra_runs=(),
                             ta_scalings=(1.0,), trust_region={"max_steps": 1}),
                     finetune_modules=("self_attn",), multitask=False)
    results = run_lm_experiment(tmp_path / "out", corpora=_corpora(tiny_hf), config=config, cache=tmp_path / "cache",
                                base_folder=tiny_base, threads=1, progress=False)
    saved = json.loads((Path(results["finetunes"]["code"]["folder"]) / "finetune.json").read_text())
    assert saved["settings"]["train_patterns"] == ["model.layers.1.self_attn.*"]
    rec = results["methods"]["qp_trust_region_cross_entropy"]
    assert rec["layers"] == ["model.layers.1.self_attn.o_proj"]
    assert all(layer["certified"] for layer in rec["report"]["layers"])
    assert rec["test"]["code"]["ce"] != results["methods"]["base"]["test"]["code"]["ce"]


def test_module_outputs_selects_each_modules_last_layer():
    layers = [f"model.layers.{i}.{m}" for i in (4, 5) for m in ("self_attn.q_proj", "self_attn.k_proj",
                                                                "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")]
    assert select_layers(layers, MODULE_OUTPUTS) == [
        "model.layers.4.self_attn.o_proj", "model.layers.4.mlp.down_proj",
        "model.layers.5.self_attn.o_proj", "model.layers.5.mlp.down_proj"]
    assert select_layers(["h.0.mlp.c_fc", "h.0.mlp.c_proj"], MODULE_OUTPUTS) == ["h.0.mlp.c_proj"]
    assert select_layers(layers[:2], "*.k_proj") == ["model.layers.4.self_attn.k_proj"]
    with pytest.raises(ValidationError, match="matches none of the fine-tuned layers"):
        select_layers(layers, "*.gate_proj")


def test_cached_finetunes_are_reused(tiny_hf, tiny_base, lm_run, tmp_path, monkeypatch):
    results, _, root = lm_run
    again = run_lm_experiment(tmp_path / "again", corpora=_corpora(tiny_hf), cache=root / "cache",
                              base_folder=tiny_base,
                              config=_config(modes=("single",), metrics=("kl",), baselines=(), mergekit=(), extra_runs=(),
                                             ta_scalings=(1.0,)), threads=1, progress=False)
    for d in DOMAINS:
        assert again["finetunes"][d]["cached"] and again["finetunes"][d]["folder"] == results["finetunes"][d]["folder"]
        # same fine-tunes, same test texts: the same reference numbers
        for e in DOMAINS:
            assert again["methods"][f"finetune:{d}"]["test"][e] == pytest.approx(
                results["methods"][f"finetune:{d}"]["test"][e])
    assert again["methods"]["qp_single_kl"]["metric"] == "kl"
    assert again["finetunes"]["multitask"]["cached"]
    assert set(again["methods"]) == {"base", *(f"finetune:{d}" for d in DOMAINS), "multitask", "task_arithmetic",
                                     "qp_single_kl"}
    for d in DOMAINS:
        assert again["methods"]["multitask"]["test"][d] == pytest.approx(results["methods"]["multitask"]["test"][d])
    corpora = _corpora(tiny_hf)
    named = [dataclasses.replace(corpora[0], name="multitask"), *corpora[1:]]
    with pytest.raises(ValidationError, match="a domain is named 'multitask'"):
        run_lm_experiment(tmp_path / "named", corpora=named, cache=root / "cache",
                          base_folder=tiny_base, config=_config(), threads=1, progress=False)
    # without the reference, a domain may take that name
    small = _config(modes=("single",), metrics=("kl",), baselines=(), mergekit=(), extra_runs=(), ta_scalings=(1.0,))
    # (stop 50) relative cache and base folders are the caller's: they were resolved against the run's temporary
    # work folder, and the first merge failed after the fine-tunes
    monkeypatch.chdir(root)
    plain = run_lm_experiment(tmp_path / "named2", corpora=named, cache="cache", base_folder=os.path.relpath(tiny_base),
                              config=small, threads=1, progress=False, multitask=False)
    assert plain["finetunes"]["multitask"]["folder"].startswith(str((root / "cache").resolve()))
    assert "multitask" in plain["domains"] and plain["finetunes"]["multitask"]["steps"] == 12  # the domain's own
    assert "multitask" not in plain["methods"] and "finetune:multitask" in plain["methods"]
    assert "multitask_ce" not in plain["goal"]


@pytest.mark.parametrize("device", ["mps", "tpu", "CUDA"])
def test_an_unknown_device_is_refused_before_any_work(tiny_hf, tiny_base, tmp_path, device):
    """(stop 50) From Python any string passed: a raw torch traceback after the fine-tunes."""
    with pytest.raises(ValidationError, match=f"unknown device '{device}'; valid: cpu, cuda, auto"):
        run_lm_experiment(tmp_path / "o", corpora=_corpora(tiny_hf), config=_config(), cache=tmp_path / "cache",
                          base_folder=tiny_base, device=device, threads=1, progress=False)
    assert not (tmp_path / "cache").exists()


def test_too_few_calibration_texts_for_autos_folds_are_refused_before_the_fine_tunes(tiny_hf, tiny_base, tmp_path):
    """(stop 50) The run layer refused it, clearly, but after the fine-tunes, the grid and the baselines."""
    from mergeqp.experiments.lm import RECOMMENDED_RUN

    config = _config(runs=(RECOMMENDED_RUN,))  # start: auto with folds; 6 texts in batches of 4 make 2 batches
    config = dataclasses.replace(config, calibration_texts=4)
    with pytest.raises(ValidationError, match=r"start auto with \d+ folds needs 2 or more calibration batches per "
                                              r"domain, but calibration_texts 4 in batches of 4 make 1"):
        run_lm_experiment(tmp_path / "o", corpora=_corpora(tiny_hf), config=config, cache=tmp_path / "cache",
                          base_folder=tiny_base, threads=1, progress=False)
    assert not (tmp_path / "cache" / "lm-finetunes").exists()


def test_one_calibration_text_cannot_cross_validate_regmeans_alpha_and_is_refused_first(tiny_hf, tiny_base, tmp_path):
    """(stop 79) The k-fold choice of RegMean's alpha needs a text to fit on and one to score, per domain."""
    config = dataclasses.replace(_config(modes=("single",), baselines=("regmean",), mergekit=(), extra_runs=()),
                                 calibration_texts=1)
    with pytest.raises(ValidationError, match=r"RegMean's alpha is chosen among \[0.1, 0.9\] by 4-fold "
                                              r"cross-validation .* \(calibration_texts is 1\); .* tuning_folds=1"):
        run_lm_experiment(tmp_path / "o", corpora=_corpora(tiny_hf), config=config, cache=tmp_path / "cache",
                          base_folder=tiny_base, threads=1, progress=False)
    assert not (tmp_path / "cache" / "lm-finetunes").exists()
    import mergeqp.experiments.lm as lm_module

    for ok in (dataclasses.replace(config.merge, tuning_folds=1), dataclasses.replace(config.merge, regmean_alphas=(0.5,))):
        lm_module._check_tuning_folds(dataclasses.replace(config, merge=ok))  # no choice, or the in-sample rule


def test_a_users_registered_mode_runs_in_the_experiment(tiny_hf, tiny_base, lm_run, tmp_path):
    """(stop 50) The experiment's modes were a fixed list: a mode registered by a user was refused."""
    from mergeqp.merge.modes import MERGE_MODES, SingleMode, register_merge_mode

    class Mine(SingleMode):
        name = "mine_lm_test"
        description = "the single mode under another name"

    _, _, root = lm_run
    register_merge_mode(Mine())
    try:
        small = _config(modes=("mine_lm_test",), metrics=("euclidean",), baselines=(), mergekit=(), extra_runs=(),
                        ta_scalings=(1.0,), parametrisation={"mine_lm_test": {"parametrisation": "scalar"}})
        run = run_lm_experiment(tmp_path / "mine", corpora=_corpora(tiny_hf), cache=root / "cache",
                                base_folder=tiny_base, config=small, threads=1, progress=False, multitask=False)
    finally:
        MERGE_MODES.pop("mine_lm_test", None)
    record = run["methods"]["qp_mine_lm_test_euclidean"]
    assert record["kind"] == "qp" and all(layer["certified"] for layer in record["report"]["layers"])


def test_a_users_modes_get_what_their_entries_declare(tiny_hf, tiny_base, lm_run, tmp_path):
    """(stop 58, an architecture review's find) The experiment gave the tuned task-arithmetic start to
    the mode named ``hybrid`` and the trust-region options to the one named ``trust_region``: a user's
    mode that requires a start (a hybrid under another name) failed, and a trust region under another
    name lost its options. Both now follow the entry (``uses_start`` / ``start_required``, the
    trust-region class)."""
    from mergeqp.merge.modes import MERGE_MODES, HybridMode, TrustRegionMode, register_merge_mode

    class MyHybrid(HybridMode):
        name = "my_hybrid_lm_test"

    class MyRegion(TrustRegionMode):
        name = "my_region_lm_test"

    _, _, root = lm_run
    register_merge_mode(MyHybrid())
    register_merge_mode(MyRegion())
    try:
        small = _config(modes=("my_hybrid_lm_test", "my_region_lm_test"), metrics=("euclidean",), baselines=(),
                        mergekit=(), extra_runs=(), ta_scalings=(0.5,), trust_region={"max_steps": 1},
                        parametrisation={m: {"parametrisation": "scalar"}
                                         for m in ("my_hybrid_lm_test", "my_region_lm_test")})
        run = run_lm_experiment(tmp_path / "mine", corpora=_corpora(tiny_hf), cache=root / "cache",
                                base_folder=tiny_base, config=small, threads=1, progress=False, multitask=False)
    finally:
        MERGE_MODES.pop("my_hybrid_lm_test", None)
        MERGE_MODES.pop("my_region_lm_test", None)
    hybrid = run["methods"]["qp_my_hybrid_lm_test_euclidean"]
    assert hybrid["method"]["start"] == {"name": "task_arithmetic", "params": {"scaling": 0.5}}
    assert all(layer["certified"] for layer in hybrid["report"]["layers"])
    region = run["methods"]["qp_my_region_lm_test_euclidean"]
    assert region["method"]["mode_options"]["max_steps"] == 1


def test_device_cuda_runs_there_or_on_cpu_with_a_note(tiny_hf, tiny_base, lm_run, tmp_path):
    """``device="cuda"``: on a CUDA machine the merges and the evaluation run there and the
    reference rows (the cached fine-tunes, evaluated again) agree with the CPU run's; without CUDA
    it runs on the CPU and says so."""
    results, _, root = lm_run
    small = _config(modes=("single",), metrics=("euclidean",), baselines=("soup",), mergekit=(), extra_runs=(),
                    ta_scalings=(1.0,))
    run = run_lm_experiment(tmp_path / "dev", corpora=_corpora(tiny_hf), cache=root / "cache", base_folder=tiny_base,
                            config=small, device="cuda", threads=1, progress=False)
    if torch.cuda.is_available():
        assert run["device"] == "cuda" and not any("CUDA" in n for n in run["notes"])
    else:
        assert run["device"] == "cpu" and any("CUDA is not available" in n for n in run["notes"])
    for name in ("base", "multitask", *(f"finetune:{d}" for d in DOMAINS)):
        for d in DOMAINS:
            assert run["methods"][name]["test"][d]["ce"] == pytest.approx(results["methods"][name]["test"][d]["ce"],
                                                                          rel=1e-4), (name, d)
    qp = run["methods"]["qp_single_euclidean"]
    assert all(layer["certified"] for layer in qp["report"]["layers"])
    assert all(math.isfinite(qp["test"][d]["ce"]) for d in DOMAINS)


def test_evaluator_matches_full_forward(tiny_hf, tiny_base, tmp_path):
    """CE, logit MSE and KL of the split evaluator equal those computed from plain full-model
    forwards, one text at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mergeqp.experiments.lm import read_folder_state
    from mergeqp.experiments.lm_eval import UpperEvaluator

    ft = tmp_path / "ft"
    tiny_hf.perturb(tiny_base, ft, "llama", ("model.layers.1.mlp.*",), 0.5, seed=3)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_base), dtype=torch.float32).eval()
    ref_model = AutoModelForCausalLM.from_pretrained(str(ft), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    texts = tiny_hf.sentences("code", 5, seed=9, length=(2, 12))
    ev = UpperEvaluator(base, tok, 1, {"code": texts}, max_length=16, batch_size=2, device="cpu")
    ref = ev.tensors_of(read_folder_state(ft))
    assert set(ref.upper) == {f"model.layers.1.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    got = ev.evaluate({"base": None, "ft": ref}, {"code": ref}, per_text=True)
    nll = se = kl = 0.0
    pred = tok_count = 0
    per_text = []
    for text in texts:
        ids = torch.tensor([tok(text, truncation=True, max_length=16)["input_ids"]])
        with torch.no_grad():
            x = base(input_ids=ids).logits[0].double()
            y = ref_model(input_ids=ids).logits[0].double()
        one = -float(torch.log_softmax(x[:-1], -1).gather(-1, ids[0, 1:, None]).sum())
        nll += one
        per_text.append((ids.shape[1] - 1, one))
        pred += ids.shape[1] - 1
        se += float(((x - y) ** 2).sum())
        log_p, log_q = torch.log_softmax(y, -1), torch.log_softmax(x, -1)
        kl += float((log_p.exp() * (log_p - log_q)).sum())
        tok_count += ids.shape[1]
    assert got["base"]["code"]["ce"] == pytest.approx(nll / pred, rel=1e-5)
    assert got["base"]["code"]["mse"] == pytest.approx(se / (tok_count * x.shape[-1]), rel=1e-4)
    assert got["base"]["code"]["kl"] == pytest.approx(kl / tok_count, rel=1e-4)
    assert got["ft"]["code"]["mse"] == 0
    # per text (for paired comparisons): every text's NLL and predicted tokens, one order for all models
    mine = got["base"]["code"]
    assert len(mine["text_nll"]) == len(texts) and sum(mine["text_predicted"]) == pred
    assert sum(mine["text_nll"]) == pytest.approx(nll, rel=1e-5)
    pairs = sorted(zip(mine["text_predicted"], mine["text_nll"]))
    for (n_got, v_got), (n_want, v_want) in zip(pairs, sorted(per_text)):
        assert n_got == n_want and v_got == pytest.approx(v_want, rel=1e-4)
    assert got["ft"]["code"]["text_predicted"] == mine["text_predicted"]
    assert "text_nll" not in ev.evaluate({"base": None}, {"code": ref})["base"]["code"]
    # the working model is the base again afterwards
    for n, p in base.named_parameters():
        assert torch.equal(p, ev.base_state[n])


def test_splits_are_disjoint_and_seeded(tiny_hf):
    corpora = _corpora(tiny_hf)
    dup = Corpus("dup", corpora[0].texts + corpora[0].texts[:5] + ("x",), np.zeros(46, int), ("all",), "s")
    cfg = LmConfig(train_texts=20, calibration_texts=6, test_texts=8, min_chars=5)
    splits = split_domains([dup, corpora[1]], cfg, seed=0)
    for s in splits:
        parts = [set(s.train), set(s.calibration), set(s.test)]
        assert [len(p) for p in parts] == [20, 6, 8]
        assert not (parts[0] & parts[1] or parts[0] & parts[2] or parts[1] & parts[2])
    assert "x" not in splits[0].train + splits[0].calibration + splits[0].test  # below min_chars
    assert split_domains([dup, corpora[1]], cfg, seed=0) == splits
    assert split_domains([dup, corpora[1]], cfg, seed=1) != splits
    with pytest.raises(ValidationError, match="needs 60"):
        split_domains(corpora, LmConfig(train_texts=50, calibration_texts=5, test_texts=5, min_chars=5), seed=0)
    with pytest.raises(ValidationError, match="two or more"):
        split_domains(corpora[:1], cfg, seed=0)
    with pytest.raises(ValidationError, match="distinct"):
        split_domains([corpora[0], corpora[0]], cfg, seed=0)


def test_settings_validation():
    with pytest.raises(UnknownNameError, match="unknown QP mode 'nope'"):
        LmMergeSettings(modes=("nope",))
    with pytest.raises(UnknownNameError, match="unknown output metric"):
        LmMergeSettings(metrics=("cosine",))
    with pytest.raises(UnknownNameError, match="unknown mergekit method"):
        LmMergeSettings(mergekit=("slerp",))
    with pytest.raises(ValidationError, match="ta_scalings"):
        LmMergeSettings(ta_scalings=(0.0,))
    for bad in ((1.5,), (), 0.5, (True,), ("0.5",), (-0.1,)):
        with pytest.raises(ValidationError, match=r"regmean_alphas \(RegMean's alpha\) must be one or more numbers"):
            LmMergeSettings(regmean_alphas=bad)
    for bad in (0, 2.0, True, "4"):
        with pytest.raises(ValidationError, match=r"tuning_folds must be an integer >= 1"):
            LmMergeSettings(tuning_folds=bad)
    assert LmMergeSettings(regmean_alphas=[0, 1]).regmean_alphas == (0.0, 1.0)
    with pytest.raises(UnknownNameError, match="unknown extra run 'slerp'"):
        LmMergeSettings(extra_runs=("slerp",))
    with pytest.raises(ValidationError, match="atoms: metric 'cross_entropy' has no 'outputs' entry"):
        LmMergeSettings(outputs={"euclidean": {}, "kl": {}}, metrics=("euclidean",), extra_runs=("qp_atoms",))
    LmMergeSettings(outputs={"euclidean": {}, "kl": {}}, metrics=("euclidean",), extra_runs=())
    with pytest.raises(ValidationError, match="outputs: no entry for metric 'kl'"):
        LmMergeSettings(outputs={"euclidean": {"restrict": "none"}})
    with pytest.raises(ValidationError, match="the key is the metric"):
        LmMergeSettings(outputs={"euclidean": {"metric": "kl"}, "kl": {}})
    with pytest.raises(UnknownNameError, match="unknown calibration balance 'words'"):
        LmMergeSettings(balance="words")
    assert LmMergeSettings().balance == "tokens"
    with pytest.raises(ValidationError, match="test_texts"):
        LmConfig(test_texts=0)
    assert LmConfig(finetune_modules="self_attn").finetune_modules == ("self_attn",)
    for bad in ((), ("mlp.*",), ("",), (" mlp",)):
        with pytest.raises(ValidationError, match="finetune_modules"):
            LmConfig(finetune_modules=bad)
    cfg = with_overrides(LmConfig.quick(), test_texts=5, ties_density=0.3)
    assert cfg.test_texts == 5 and cfg.merge.ties_density == 0.3
    with pytest.raises(UnknownNameError, match="unknown LM experiment setting"):
        with_overrides(cfg, nope=1)
    text = mergekit_yaml("task_arithmetic", __import__("pathlib").Path("/b"), [("a", "/fa"), ("c", "/fc")], 0.7, 0.5)
    assert "weight: 0.7" in text and "base_model: /b" in text and "merge_method: task_arithmetic" in text


def _fake_results(rec_ce: float) -> dict:
    def m(kind, ce, mse=1.0, cal=None, **extra):
        return {"kind": kind, "mean_test": {"ce": ce, "mse": mse, "kl": 0.1}, "mean_calibration_ce": cal or ce,
                "test": {"a": {"ce": ce, "mse": mse, "kl": 0.1}}, **extra}

    methods = {"base": m("reference", 4.0), "finetune:a": m("reference", 3.0),
               "ties": m("baseline", 3.6, 0.5), "mergekit_ties": m("mergekit", 3.8, 0.4),
               "qp_single_euclidean": m("qp", 3.9, 0.8, cal=3.95, mode="single", metric="euclidean"),
               "qp_sequential_kl": m("qp", rec_ce, 0.3, cal=3.1, mode="sequential", metric="kl")}
    return {"domains": {"a": {}}, "methods": methods}


def test_goal_and_recommendation_rules():
    res = _fake_results(3.2)
    res["recommended"] = recommended_merge(res)
    assert res["recommended"]["method"] == "qp_sequential_kl"  # lowest calibration CE among QP runs
    fixed = {**res, "config": {"merge": {"recommended": "single:euclidean"}}}
    assert recommended_merge(fixed)["method"] == "qp_single_euclidean"  # the configured one, when it ran
    missing = {**res, "config": {"merge": {"recommended": "joint:kl"}}}
    rec = recommended_merge(missing)
    assert rec["method"] == "qp_sequential_kl" and "did not run" in rec["rule"]
    goal = lm_goal(res)
    assert goal["passed"] and goal["best_rival"] == "ties" and goal["gap_closed"] == pytest.approx(2 / 3)
    res = _fake_results(3.4)  # beats every rival but closes only a third of the gap
    res["recommended"] = recommended_merge(res)
    assert not lm_goal(res)["passed"] and lm_goal(res)["beats_every_rival"]
    res = _fake_results(3.7)
    res["recommended"] = recommended_merge(res)
    assert not lm_goal(res)["beats_every_rival"]
    claims = {c["id"]: c for c in evaluate_lm_claims(res)}
    assert claims["F"]["passed"] and not claims["L1"]["passed"] and claims["L4"]["passed"]
    assert "multitask_ce" not in lm_goal(res)
    # the multitask reference is placed on the same scale; it does not change the verdict
    res = _fake_results(3.2)
    res["methods"]["multitask"] = {**res["methods"]["base"], "mean_test": {"ce": 3.45, "mse": 1.0, "kl": 0.1}}
    res["recommended"] = recommended_merge(res)
    goal = lm_goal(res)
    assert goal["passed"] and goal["multitask_gap_closed"] == pytest.approx(0.25) and "25.0%" in goal["detail"]


def test_cli_errors(tmp_path, capsys):
    assert main(["experiment", "lm", "--domains", "nope", "fortunes", "--out", str(tmp_path / "o")]) == 2
    assert "unknown domain 'nope'" in capsys.readouterr().err
    assert main(["experiment", "lm", "--domains", "fortunes", "--out", str(tmp_path / "o")]) == 2
    assert "two or more" in capsys.readouterr().err
    assert main(["experiment", "lm", "--threads", "0", "--out", str(tmp_path / "o")]) == 2
    assert "--threads" in capsys.readouterr().err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    assert main(["experiment", "lm", "--out", str(busy)]) == 2
    assert "not empty" in capsys.readouterr().err and (busy / "keep.txt").read_text() == "mine"
    with pytest.raises(SystemExit):
        main(["experiment", "lm", "--device", "tpu", "--out", str(tmp_path / "o")])
    assert main(["experiment", "lm", "--finetune-modules", "mlp.*", "--out", str(tmp_path / "o")]) == 2
    assert "finetune_modules must be one or more module names" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_cli_passes_the_multitask_switch(tmp_path, capture_run):
    import mergeqp.experiments.lm as lm

    from .conftest import StopRun as Stop

    seen = capture_run(lm, "run_lm_experiment")
    for extra, want in (([], True), (["--no-multitask"], False)):
        with pytest.raises(Stop):
            main(["experiment", "lm", "--quick", *extra, "--out", str(tmp_path / "o")])
        assert seen[-1]["multitask"] is want and seen[-1]["quick"]
        assert seen[-1]["finetune_modules"] == ["mlp"]
    with pytest.raises(Stop):
        main(["experiment", "lm", "--finetune-modules", "mlp", "self_attn", "--out", str(tmp_path / "o")])
    assert seen[-1]["finetune_modules"] == ["mlp", "self_attn"] and seen[-1]["base_folder"] is None
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(Stop):
        main(["experiment", "lm", "--base", str(tmp_path / "model"), "--out", str(tmp_path / "o")])
    assert seen[-1]["base_folder"] == tmp_path / "model"
    # a folder that is not a model is refused before anything runs, naming the option
    assert main(["experiment", "lm", "--base", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    # domains of your own from files, with or without registered ones
    (tmp_path / "legal.txt").write_text("the court held that\nthe appeal was dismissed\n")
    (tmp_path / "med.jsonl").write_text('{"text": "the patient was given"}\n')
    with pytest.raises(Stop):
        main(["experiment", "lm", "--domain-file", f"legal={tmp_path / 'legal.txt'}", "--domain-file",
              f"med={tmp_path / 'med.jsonl'}", "--out", str(tmp_path / "o")])
    corpora = seen[-1]["corpora"]
    assert [c.name for c in corpora] == ["legal", "med"] and corpora[0].texts[1] == "the appeal was dismissed"
    lm.register_domain("tiny_registered", lambda: Corpus("x", ("a text",), np.zeros(1), ("text",), "test"))
    try:
        with pytest.raises(Stop):
            main(["experiment", "lm", "--domains", "tiny_registered", "--domain-file",
                  f"legal={tmp_path / 'legal.txt'}", "--out", str(tmp_path / "o")])
        assert [c.name for c in seen[-1]["corpora"]] == ["tiny_registered", "legal"]
    finally:
        del lm.DOMAINS["tiny_registered"]
    for bad in (["--domain-file", "legal"], ["--domain-file", f"legal={tmp_path / 'legal.txt'}"],
                ["--domain-file", f"a={tmp_path / 'legal.txt'}", "--domain-file", f"a={tmp_path / 'med.jsonl'}"],
                ["--domain-file", f"a={tmp_path / 'nothing.txt'}", "--domain-file", f"b={tmp_path / 'med.jsonl'}"]):
        assert main(["experiment", "lm", *bad, "--out", str(tmp_path / "o")]) == 2, bad
    assert not (tmp_path / "o").exists()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # mergekit's own import of numpy.core
def test_mergekit_driver_usage_and_a_failing_merge(tmp_path):
    """The one-process mergekit step: bad arguments are a usage error; a merge mergekit refuses
    stops the driver with exit 1 and mergekit's own message in the result file, naming the spec."""
    from mergeqp.experiments import mergekit_driver

    assert mergekit_driver.main([str(tmp_path / "r.json")]) == 2
    assert mergekit_driver.main([str(tmp_path / "r.json"), "a.yml"]) == 2
    if importlib.util.find_spec("mergekit") is None:
        pytest.skip("mergekit is not installed")
    spec = tmp_path / "bad.yml"
    spec.write_text("merge_method: linear\nmodels: []\ndtype: float32\n")
    result = tmp_path / "r.json"
    assert mergekit_driver.main([str(result), str(spec), str(tmp_path / "out"), "--", "--no-copy-tokenizer"]) == 1
    done = json.loads(result.read_text())
    assert done["merges"] == [] and str(spec) in done["error"]
    assert not (tmp_path / "out").exists()


def test_same_model_compares_every_changed_tensor():
    """Twins (evaluated once): every changed tensor within the relative tolerance, the same tensors
    changed; ``None`` stands for the base (no tensor changed)."""
    from mergeqp.experiments.lm_eval import ModelTensors, same_model

    w = torch.linspace(-1.0, 1.0, 12, dtype=torch.float64).reshape(3, 4)
    a = ModelTensors({"w": w, "v": torch.ones(2)}, {})
    close = ModelTensors({"w": w * (1 + 1e-8), "v": torch.ones(2)}, {})
    far = ModelTensors({"w": w + 1e-3, "v": torch.ones(2)}, {})
    assert same_model(None, None) == 0.0
    assert same_model(a, a) == 0.0
    assert 0 < same_model(a, close) <= 1e-6
    assert same_model(a, far) is None
    assert same_model(a, ModelTensors({"w": w}, {})) is None  # a different set of changed tensors
    assert same_model(a, None) is None
    assert same_model(a, ModelTensors({"w": w, "v": torch.ones(3)}, {})) is None


def test_goal_says_when_there_is_no_gap_to_close():
    """When the best rival is already at or below the ceiling (the fine-tunes do not beat it on
    their own domains), the goal fails and says so instead of printing a NaN share of the gap."""
    def row(kind, ce, **extra):
        return {"kind": kind, "mean_test": {"ce": ce}, **extra}

    methods = {"finetune:a": {"kind": "finetune", "test": {"a": {"ce": 4.0}}},
               "finetune:b": {"kind": "finetune", "test": {"b": {"ce": 4.2}}},
               "soup": row("baseline", 4.05), "multitask": row("reference", 4.0)}
    results = {"domains": ["a", "b"], "methods": methods,
               "recommended": {"method": "qp_x", "mean_test_ce": 4.0}}
    goal = lm_goal(results)
    assert not goal["passed"] and goal["beats_every_rival"]
    assert "no gap to close" in goal["detail"] and "nan" not in goal["detail"]
    methods["soup"]["mean_test"]["ce"] = 4.3  # now a gap of 0.2 nats to the ceiling 4.1, 55% of it closed
    results["recommended"]["mean_test_ce"] = 4.19
    goal = lm_goal(results)
    assert goal["gap_closed"] == pytest.approx(0.55) and goal["passed"] and "closes 55.0%" in goal["detail"]


def test_inputs_are_never_overwritten_and_the_base_must_be_a_causal_lm(tiny_hf, tiny_base, tmp_path, monkeypatch):
    """--out over a domain's text file or inside the default cache (the fine-tunes and SmolLM2 live
    there) is refused even with --overwrite; an encoder as --base is refused before any
    fine-tune, naming why; a Corpus name that would be a path is refused; one module as a string."""
    from mergeqp.experiments import lm as lm_mod
    from mergeqp.experiments.corpora import file_corpus
    from mergeqp.experiments.finetune_lm import block_layout

    data = tmp_path / "data"
    data.mkdir()
    for d in DOMAINS[:2]:
        (data / f"{d}.txt").write_text("\n".join(tiny_hf.sentences(d, 30, seed=1)) + "\n")
    corpora = [file_corpus(d, data / f"{d}.txt") for d in DOMAINS[:2]]
    with pytest.raises(ValidationError, match="overlaps input"):
        run_lm_experiment(data, corpora=corpora, config=_config(), cache=tmp_path / "cache", base_folder=tiny_base,
                          overwrite=True, progress=False)
    assert sorted(p.name for p in data.iterdir()) == ["code.txt", "math.txt"]
    cache = tmp_path / "default-cache"
    (cache / "lm-finetunes").mkdir(parents=True)
    monkeypatch.setattr(lm_mod, "default_cache", lambda: cache)
    with pytest.raises(ValidationError, match="overlaps input"):
        run_lm_experiment(cache / "lm-finetunes", corpora=_corpora(tiny_hf), config=_config(), base_folder=tiny_base,
                          overwrite=True, progress=False)
    encoder = tmp_path / "bert"
    encoder.mkdir()
    (encoder / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(ValidationError, match="not a causal language model .*bidirectional attention"):
        block_layout(encoder)
    # (stop 60 review) refused before any text is read: a missing corpus was reported for an encoder base
    monkeypatch.setitem(lm_mod.DOMAINS, "absent", lambda: (_ for _ in ()).throw(ValidationError("no texts here")))
    with pytest.raises(ValidationError, match=f"base folder {encoder}: .* causal language model, and this one is not"):
        run_lm_experiment(tmp_path / "o", domains=["absent", "code"], config=_config(), cache=tmp_path / "cache",
                          base_folder=encoder, progress=False)
    from mergeqp.cli import main

    assert main(["experiment", "lm", "--domains", "absent", "code", "--base", str(encoder), "--out",
                 str(tmp_path / "o")]) == 2
    with pytest.raises(ValidationError, match="domain 'absent': no texts here; or use texts of your own instead: "
                                              "--domain-file NAME=FILE"):
        lm_mod.load_domains(["absent"])
    odd = [dataclasses.replace(c, name="../escape") for c in _corpora(tiny_hf)]
    with pytest.raises(ValidationError, match="domain names are letters"):
        run_lm_experiment(tmp_path / "o", corpora=odd, config=_config(), cache=tmp_path / "cache",
                          base_folder=tiny_base, progress=False)
    with pytest.raises(ValidationError, match="each entry must be a Corpus"):
        run_lm_experiment(tmp_path / "o", corpora=["code"], config=_config(), cache=tmp_path / "cache",
                          base_folder=tiny_base, progress=False)
    assert not (tmp_path / "o").exists()


def test_lm_settings_of_the_wrong_kind_are_refused():
    for bad in ({"train_texts": 2.7}, {"min_chars": -5}, {"finetune_lr": float("nan")}, {"eval_batch": True}):
        with pytest.raises(ValidationError):
            LmConfig(**bad)
    assert LmConfig(finetune_modules="mlp").finetune_modules == ("mlp",)
