"""``output.sketch: auto``: a sketch where the exact statistics of one batch would cost more than
``STATISTICS_BUDGET`` multiply-adds (stop 57: docs/hf.md's example on two of SmolLM2's
``down_proj`` formed H from 124,928 rows per batch, half an hour per trust-region step), exact
otherwise; the plan says which. The thresholds are lowered here to the tiny model's sizes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from mergeqp.config import load_config
from mergeqp.errors import ConfigError
from mergeqp.run import plan as plan_module
from mergeqp.run import statistics_cost
from mergeqp.run.pipeline import run_merge

LAYER = "model.layers.1.mlp.down_proj"
METHOD = {"name": "qp", "mode": "single"}


@pytest.fixture(scope="module")
def fam(tiny_hf, tmp_path_factory):
    return tiny_hf.make_family(tmp_path_factory.mktemp("sketch_auto"), "llama", K=2, scale=0.3, n_prompts=12)


def _cfg(fam, tmp_path, name, sketch):
    return load_config(fam.write_config(tmp_path / f"{name}.yml", LAYER, METHOD,
                                        output={"restrict": "projection", "k": 8, "sketch": sketch}))


def test_below_the_budget_the_statistics_stay_exact_and_the_plan_says_so(fam, tmp_path):
    plan = plan_module.build_plan(_cfg(fam, tmp_path, "a", "auto"))
    assert plan.sketch is None and plan.output_spec().sketch is None
    assert any(n.startswith("output.sketch auto: the statistics are exact (about ") for n in plan.notes)
    assert "sketch auto -> none (exact)" in plan.render()
    assert not any("statistics cost" in n for n in plan.notes)


def test_a_sketch_not_below_the_prompts_outputs_is_not_taken(fam, tmp_path, monkeypatch):
    """Over the budget, but the prompt compares fewer numbers than the sketch (tiny: at most 12 x 8)."""
    monkeypatch.setattr(statistics_cost, "STATISTICS_BUDGET", 1.0)
    plan = plan_module.build_plan(_cfg(fam, tmp_path, "b", "auto"))
    assert plan.sketch is None
    outputs = plan.batch_length * 8  # positions x k
    assert any(f"a sketch of 256 is not below the {outputs} numbers each prompt compares" in n for n in plan.notes)


def test_above_the_budget_it_merges_as_the_explicit_sketch_would(fam, tmp_path, monkeypatch):
    """Sketched: the plan's spec, its memory design item and the run take the sketch; the merged
    weights equal those of ``sketch: 5`` written out (the same seeded sketch), and differ from the
    exact statistics' merge."""
    monkeypatch.setattr(statistics_cost, "STATISTICS_BUDGET", 1.0)
    monkeypatch.setattr(statistics_cost, "AUTO_SKETCH", 5)
    auto_cfg = _cfg(fam, tmp_path, "c", "auto")
    plan = plan_module.build_plan(auto_cfg)
    assert plan.sketch == 5 == plan.output_spec().sketch
    (note,) = [n for n in plan.notes if n.startswith("output.sketch auto: a sketch of 5 per prompt")]
    n = plan.groups[0].n_variables
    assert f"of n = {n:,} coefficients" in note and "output.sketch: none keeps" in note
    assert "sketch auto -> 5" in plan.render()
    design = next(v for k, v in plan.memory.items() if k.startswith("design (one batch"))
    explicit_plan = plan_module.build_plan(_cfg(fam, tmp_path, "d", 5))
    assert design == next(v for k, v in explicit_plan.memory.items() if k.startswith("design (one batch"))
    auto = run_merge(auto_cfg, tmp_path / "auto", progress=False, plan=plan)
    explicit = run_merge(_cfg(fam, tmp_path, "d", 5), tmp_path / "explicit", progress=False)
    exact = run_merge(_cfg(fam, tmp_path, "e", None), tmp_path / "exact", progress=False)
    key = f"{LAYER}.weight"
    w = {name: load_file(str(res.out_dir / "model.safetensors"))[key] for name, res in
         (("auto", auto), ("explicit", explicit), ("exact", exact))}
    np.testing.assert_array_equal(w["auto"], w["explicit"])
    assert not np.allclose(w["auto"], w["exact"], rtol=1e-6, atol=0)
    report = json.loads((auto.out_dir / "report.json").read_text())
    assert any(n.startswith("output.sketch auto: a sketch of 5") for n in report["notes"])
    assert report["plan"]["statistics_sketch"] == 5 and report["plan"]["output"]["sketch"] == "auto"
    assert "H from a sketch of 5 per prompt (`sketch: auto`)" in (auto.out_dir / "report.md").read_text()
    assert json.loads((exact.out_dir / "report.json").read_text())["plan"]["statistics_sketch"] is None
    assert "H from a sketch" not in (exact.out_dir / "report.md").read_text()


@pytest.mark.parametrize("bad", ["always", 0, -3])
def test_sketch_takes_a_positive_count_auto_or_null(fam, tmp_path, bad):
    with pytest.raises(ConfigError, match=r"output.sketch: takes a whole number of outputs per prompt >= 1, auto, "
                                          r"or null \(got "):
        _cfg(fam, tmp_path, "f", bad)


def test_a_sketch_too_large_to_draw_is_not_taken(fam, tmp_path, monkeypatch):
    """A sketch whose matrices the run would refuse (prompts x s x outputs over the limit) is not
    chosen: exact statistics, and the note says what to change."""
    monkeypatch.setattr(statistics_cost, "STATISTICS_BUDGET", 1.0)
    monkeypatch.setattr(statistics_cost, "AUTO_SKETCH", 5)
    monkeypatch.setattr(statistics_cost, "MAX_SKETCH_ENTRIES", 10)
    plan = plan_module.build_plan(_cfg(fam, tmp_path, "g", "auto"))
    assert plan.sketch is None
    assert any("entries per batch, above 10: restrict the output first" in n for n in plan.notes)


def test_the_run_decides_again_on_the_layers_it_merges(fam, tmp_path, monkeypatch):
    """(stop 57 review) The plan sees two selected layers, the run merges the one the fine-tunes
    changed (block 1): a sketch chosen for the QP of both was kept for the QP of one, whose exact
    statistics are within the budget; the run now decides again, and says so."""
    monkeypatch.setattr(statistics_cost, "AUTO_SKETCH", 5)
    layers = ["model.layers.0.mlp.down_proj", LAYER]
    cfg = load_config(fam.write_config(tmp_path / "two.yml", layers, {"name": "qp", "mode": "joint"},
                                       output={"restrict": "projection", "k": 8, "sketch": "auto"}))
    exact = statistics_cost.statistics_work(plan_module.build_plan(cfg), None)
    one_cfg = load_config(fam.write_config(tmp_path / "one.yml", [LAYER], {"name": "qp", "mode": "joint"},
                                           output={"restrict": "projection", "k": 8, "sketch": "auto"}))
    one = statistics_cost.statistics_work(plan_module.build_plan(one_cfg), None)  # the QP of the changed layer alone
    assert one.total < exact.total
    monkeypatch.setattr(statistics_cost, "STATISTICS_BUDGET", (exact.total + one.total) / 2)
    plan = plan_module.build_plan(cfg)
    assert plan.sketch == 5 and plan.groups[0].n_variables == exact.n
    res = run_merge(cfg, tmp_path / "two", progress=False, plan=plan)
    report = json.loads((res.out_dir / "report.json").read_text())
    assert report["plan"]["statistics_sketch"] is None
    (note,) = [n for n in report["notes"] if n.startswith("output.sketch auto:")]
    assert note.startswith("output.sketch auto: the statistics are exact (about ")
    assert any("left so (not merged, no coefficients): model.layers.0.mlp.down_proj" in n for n in report["notes"])


@pytest.mark.parametrize("output", [{"pool": "mean"}])
def test_outputs_the_plan_cannot_count_stay_exact(fam, tmp_path, monkeypatch, output):
    """(stop 57 review) A pooled output or another field than the logits: the plan's count (the
    vocabulary per position) is not the output's width, and a sketch wider than the output was
    chosen; auto keeps such statistics exact, and says how to sketch them. (Until stop 58 also with
    `field: last_hidden_state`, which a causal LM does not return: the plan now refuses that field.)"""
    monkeypatch.setattr(statistics_cost, "STATISTICS_BUDGET", 1.0)
    monkeypatch.setattr(statistics_cost, "AUTO_SKETCH", 5)
    plan = plan_module.build_plan(load_config(fam.write_config(tmp_path / "p.yml", LAYER, METHOD,
                                                               output={**output, "sketch": "auto"})))
    assert plan.sketch is None
    assert any("a language model's logits only, and this output is another: give output.sketch: s" in n
               for n in plan.notes)
