"""``mode: trust_region`` of ``mergeqp merge`` on tiny Hugging Face checkpoints.

Checks: from the base (no start) and from TIES and RegMean starts, the merged model's true
calibration objective is at most the start's (from ``report.json``); every accepted step lowers
it, rejected steps leave it; the subproblems are certified; a hypothesis property on random
small families (seeds, perturbation scales, prompt counts); the ``mode_options`` block is
validated by the mode's own schema (unknown keys, bad values, options for another mode).
"""

from __future__ import annotations

import json

import numpy as np

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from mergeqp.config import load_config
from mergeqp.errors import ConfigError, ValidationError
from mergeqp.run.pipeline import run_merge
from mergeqp.run.plan import build_plan


@pytest.fixture(scope="module")
def llama(tiny_hf, tmp_path_factory):
    """A tiny Llama family whose block 1 is perturbed in both fine-tunes."""
    return tiny_hf.make_family(tmp_path_factory.mktemp("trust_region") / "llama", "llama", K=2, scale=0.3, n_prompts=10)


def _merge(fam, tmp_path, method, name="cfg", layers=("model.layers.1.mlp.*",)):
    cfg = load_config(fam.write_config(tmp_path / f"{name}.yml", list(layers), method))
    return run_merge(cfg, tmp_path / f"out_{name}", progress=False)


def _check_never_worse(report):
    tr = report["trust_region"]
    start = tr["start"]["calibration_objective"]
    result = tr["result"]["calibration_objective"]
    assert result <= start * (1 + 1e-12)
    assert report["evaluation"]["merged"]["calibration_objective"] == pytest.approx(result, rel=1e-12)
    current = start
    for step in tr["steps"]:
        assert step["objective_before"] == pytest.approx(current, rel=1e-9)
        if step["accepted"]:
            assert step["true_after"] < step["objective_before"]
            assert step["predicted_decrease"] > 0
            current = step["true_after"]
    assert result == pytest.approx(current, rel=1e-9)
    return tr


@pytest.mark.parametrize("start", [None, {"name": "ties"}, {"name": "regmean"}], ids=["base", "ties", "regmean"])
def test_trust_region_never_worse_than_its_start(llama, tmp_path, start):
    method = {"name": "qp", "mode": "trust_region", "mode_options": {"max_steps": 4}}
    if start is not None:
        method["start"] = start
    res = _merge(llama, tmp_path, method)
    rep = json.loads((res.out_dir / "report.json").read_text())
    tr = _check_never_worse(rep)
    assert tr["n_steps"] == len(tr["steps"]) >= 1
    assert tr["all_certified"] is True
    assert all(s["certified"] for s in tr["steps"])
    assert tr["n_accepted"] >= 1, tr  # the first-order model is accurate near the start
    assert tr["result"]["calibration_objective"] < tr["start"]["calibration_objective"]
    if start is None:  # D = 0 is the base model
        assert tr["start"]["calibration_objective"] == pytest.approx(
            rep["evaluation"]["base"]["calibration_objective"], rel=1e-9)
    else:
        assert rep["evaluation"]["start"]["method"] == start["name"]
        assert tr["start"]["calibration_objective"] == pytest.approx(
            rep["evaluation"]["start"]["calibration_objective"], rel=1e-9)
    assert set(tr["start"]["heldout_mse"]) == set(tr["result"]["heldout_mse"]) == set(llama.tasks)
    layers = rep["layers"]
    assert [r["layer"] for r in layers] == [s.name for s in res.plan.sites]
    assert len(layers) == 3 and all(r["mode"] == "trust_region" and r["certificate"]["certified"] for r in layers)
    assert tr["constraints"] == []
    # (stop 49) report.md shows the steps too (they were in report.json only): one row per step
    md = (res.out_dir / "report.md").read_text()
    assert f"## Trust-region steps\n\n{tr['n_accepted']} of {tr['n_steps']} QP steps accepted" in md
    rows = [line for line in md.split("## Trust-region steps")[1].splitlines() if line.startswith("| ")][1:]
    assert [r.split(" | ")[6] for r in rows] == ["yes" if s["accepted"] else "no" for s in tr["steps"]]


def test_trust_region_dry_run_plan_says_what_it_does(llama, tmp_path):
    cfg = load_config(llama.write_config(tmp_path / "plan.yml", ["model.layers.1.mlp.down_proj"],
                                         {"name": "qp", "mode": "trust_region", "start": {"name": "ties"},
                                          "mode_options": {"radius": 0.25, "max_steps": 3}}))
    text = build_plan(cfg).render()
    assert "trust_region start: ties" in text
    assert "initial 0.25" in text and "up to 3 QPs" in text and "constraints none" in text


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.integers(0, 1000), scale=st.floats(0.05, 1.0), n_prompts=st.integers(6, 9), K=st.sampled_from([2, 3]),
       start=st.sampled_from([None, "soup", "ties"]), radius=st.sampled_from([0.1, 1.0, 3.0]))
def test_trust_region_never_worse_on_random_networks(tiny_hf, tmp_path_factory, seed, scale, n_prompts, K, start,
                                                     radius):
    """Random tiny Llama families (weights, perturbation scale, prompts, K, start, radius): the
    result's true calibration objective is never above the start's."""
    root = tmp_path_factory.mktemp("tr_random")
    fam = tiny_hf.make_family(root / "fam", "llama", K=K, scale=scale, n_prompts=n_prompts, seed=seed)
    method = {"name": "qp", "mode": "trust_region", "constraints": ["box:-1,1"],
              "mode_options": {"max_steps": 3, "radius": radius}}
    if start is not None:
        method["start"] = {"name": start}
    res = _merge(fam, root, method, layers=("model.layers.1.mlp.down_proj",))
    _check_never_worse(res.report)


@pytest.mark.parametrize("method, match", [
    ({"mode": "trust_region", "mode_options": {"radious": 1.0}}, "unknown key 'radious'.*valid keys: .*radius"),
    ({"mode": "trust_region", "mode_options": {"radius": -1.0}}, "radius"),
    ({"mode": "trust_region", "mode_options": {"shrink": 1.5}}, "shrink"),
    ({"mode": "trust_region", "mode_options": {"max_steps": 0}}, "max_steps"),
    ({"mode": "trust_region", "mode_options": {"eta": 0.9, "grow_above": 0.5}}, "eta"),
    ({"mode": "trust_region", "mode_options": {"min_radius": 2.0, "max_radius": 1.0}}, "min_radius"),
    ({"mode": "trust_region", "mode_options": {"radius": 8.0}}, r"radius \(8\) must lie between min_radius .* and "
                                                                r"max_radius \(4\)"),
    ({"mode": "trust_region", "mode_options": {"radius": 1e-5}}, "must lie between"),
    ({"mode": "trust_region", "mode_options": {"max_steps": "3"}}, "max_steps"),
    ({"mode": "single", "mode_options": {"radius": 1.0}}, "takes no options.*trust_region"),
    # (stop 73, a QA review: accepted and silently ignored)
    ({"mode": "trust_region", "reference": "zero", "regularisation": 0.1}, "reference is not used with mode: "
                                                                          "trust_region.*toward the start"),
    ({"mode": "sequential", "mode_options": {"radius": 1.0}}, "unknown key 'radius'.*valid keys: by_depth"),
    ({"mode": "hybrid", "start": {"name": "soup"}, "mode_options": {"radius": 1.0}}, "unknown key 'radius'"),
])
def test_mode_options_are_validated_by_the_mode(llama, tmp_path, method, match):
    path = llama.write_config(tmp_path / "bad.yml", ["model.layers.1.mlp.down_proj"], {"name": "qp", **method})
    with pytest.raises(ConfigError, match=match):
        load_config(path)


def test_trust_region_config_defaults(llama, tmp_path):
    path = llama.write_config(tmp_path / "ok.yml", ["model.layers.1.mlp.down_proj"], {"name": "qp", "mode": "trust_region"})
    m = load_config(path).method
    assert m.start is None and m.constraints == [] and m.mode_options == {}
    path = llama.write_config(tmp_path / "hyb.yml", ["model.layers.1.mlp.down_proj"], {"name": "qp", "mode": "hybrid"})
    with pytest.raises(ConfigError, match="needs 'start'"):
        load_config(path)
    path = llama.write_config(tmp_path / "bl.yml", ["model.layers.1.mlp.down_proj"],
                              {"name": "ties", "mode_options": {"radius": 1.0}})
    with pytest.raises(ConfigError, match="mode_options"):
        load_config(path)


def test_trust_region_constraints_must_contain_the_start(llama, tmp_path):
    """Refused by the plan, before any weight is loaded (the dry run too)."""
    path = llama.write_config(tmp_path / "simplex.yml", ["model.layers.1.mlp.down_proj"],
                              {"name": "qp", "mode": "trust_region", "constraints": ["simplex"]})
    with pytest.raises(ConfigError, match=r"corrections D from the start \(D = 0\).*\['simplex'\] exclude"):
        build_plan(load_config(path))
    with pytest.raises(ConfigError, match="exclude"):
        _merge(llama, tmp_path, {"name": "qp", "mode": "trust_region", "constraints": ["simplex"]},
               layers=("model.layers.1.mlp.down_proj",))
    ok = llama.write_config(tmp_path / "box.yml", ["model.layers.1.mlp.down_proj"],
                            {"name": "qp", "mode": "trust_region", "constraints": ["box:-1,1"]})
    build_plan(load_config(ok))


def test_early_stopping_returns_the_accepted_point_with_the_lowest_validation():
    """The loop on a 1-D problem whose fit objective keeps falling while the validation objective
    turns up: it stops after ``patience`` worse steps and returns the best validated point, whose
    fit objective is still below the start's."""
    from mergeqp.merge.trust_region import TrustRegionConfig, sequential_trust_region
    from mergeqp.problem import MergeQP

    def true(d):
        return float((d[0, 0] - 3.0) ** 2)

    def linearise(d):  # exact quadratic
        return MergeQP(H=np.array([[2.0]]), g=np.array([-6.0]), c=9.0, shape=(1, 1))

    seen = []

    def validation(d):
        seen.append(float(d[0, 0]))
        return float((d[0, 0] - 0.35) ** 2)

    cfg = TrustRegionConfig(delta0=0.1, max_qps=20, expand=1.0, delta_max=0.1)
    res = sequential_trust_region(linearise, true, None, np.zeros((1, 1)), cfg, progress=False,
                                  validation=validation, patience=2)
    assert res.stop_reason.startswith("validation objective not lowered for 2")
    assert res.d[0, 0] == pytest.approx(0.3)  # steps of 0.1: 0.3 is nearest 0.35 among 0.1, 0.2, 0.3, 0.4, 0.5
    assert res.chosen_step == 2 and res.validation == pytest.approx(0.05 ** 2)
    assert res.objective < res.start_objective and res.validation < res.validation_start
    assert seen[0] == 0.0 and [s.validation is not None for s in res.steps] == [True] * len(res.steps)
    with pytest.raises(ValidationError, match="patience"):
        sequential_trust_region(linearise, true, None, np.zeros((1, 1)), cfg, progress=False,
                                validation=validation, patience=0)


def test_trust_region_holdout_from_yaml(llama, tmp_path):
    """``holdout`` in mode_options: the report says which step was kept and both parts' objectives;
    the whole calibration objective is no higher than the start's."""
    method = {"name": "qp", "mode": "trust_region", "mode_options": {"max_steps": 4, "holdout": 0.5}}
    out = _merge(llama, tmp_path, method).out_dir
    rep = json.loads((out / "report.json").read_text())
    tr = rep["trust_region"]
    hold = tr["holdout"]
    assert hold["fraction"] == 0.5 and hold["validation_result"] <= hold["validation_start"]
    # (stop 52 review) report.md says the steps are the fit on the fitting part, with the held-out column
    md = (out / "report.md").read_text().split("## Trust-region steps")[1]
    assert "Early stopping: 0.5 of each task's calibration batches held out" in md
    assert "Fit on the fitting part (the result is its kept point):" in md and "| held-out |" in md
    assert tr["result"]["calibration_objective"] <= tr["start"]["calibration_objective"] * (1 + 1e-12)
    layer = rep["layers"][0]
    assert layer["objective_before"] == pytest.approx(tr["start"]["calibration_objective"], rel=1e-9)
    assert layer["objective_after_exact"] == pytest.approx(tr["result"]["calibration_objective"], rel=1e-9)
    accepted = [s for s in tr["steps"] if s["accepted"]]
    assert all("validation" in s for s in accepted)
    if hold["chosen_step"] is not None:
        assert tr["steps"][hold["chosen_step"]]["validation"] == pytest.approx(hold["validation_result"])


def test_holdout_needs_a_batch_to_hold_out():
    from mergeqp.merge.firstorder import TaskTargets
    from mergeqp.merge.trust_region import split_tasks

    fit, held = split_tasks([TaskTargets("a", 1.0, [1, 2, 3, 4]), TaskTargets("b", 1.0, [5])], 0.25)
    assert [t.batches for t in fit] == [[1, 2, 3], [5]] and [t.batches for t in held] == [[4]]
    with pytest.raises(ValidationError, match="single calibration batch"):
        split_tasks([TaskTargets("a", 1.0, [1])], 0.5)


def test_trust_region_refit_takes_the_chosen_number_of_steps_on_every_batch(llama, tmp_path):
    method = {"name": "qp", "mode": "trust_region",
              "mode_options": {"max_steps": 4, "holdout": 0.5, "refit": True, "radius": 0.05}}
    out = _merge(llama, tmp_path, method).out_dir
    rep = json.loads((out / "report.json").read_text())
    tr = rep["trust_region"]
    hold = tr["holdout"]
    md = (out / "report.md").read_text().split("## Trust-region steps")[1]
    fit, refit = md.split("Fit on the fitting part (it chose the number of steps):")[1].split("Refit on every calibration batch")
    fit_rows = [line for line in fit.splitlines() if line.startswith("| ")][1:]
    refit_rows = [line for line in refit.splitlines() if line.startswith("| ")][1:]
    assert len(fit_rows) == len(hold["selection_steps"]) and len(refit_rows) == len(tr["steps"])
    assert tr["result"]["calibration_objective"] <= tr["start"]["calibration_objective"] * (1 + 1e-12)
    assert hold["chosen_step"] is not None  # a step lowered the held-out objective (small radius)
    assert hold["refit"] is True and len(hold["selection_steps"]) >= hold["chosen_step"] + 1
    assert tr["n_steps"] <= hold["chosen_step"] + 1
    # (stop 53 review) report.md counts steps from 1 as the progress lines and notes do (it said "kept
    # step 7" beside a note's "kept step 8 of 8")
    assert [r.split(" | ")[0] for r in fit_rows] == [f"| {i + 1}" for i in range(len(fit_rows))]
    assert f"kept step {hold['chosen_step'] + 1}" in md
    assert any(f"kept step {hold['chosen_step'] + 1} of" in n for n in rep["notes"])
    _check_never_worse(rep)  # the refit run's steps start from the start's objective on every batch
    assert rep["layers"][0]["objective_before"] == pytest.approx(tr["start"]["calibration_objective"], rel=1e-9)
