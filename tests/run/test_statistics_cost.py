"""What the plan says a calibration batch's statistics cost (`statistics_cost.statistics_work`): forming H and
the derivative passes from each site to the compared output. Stop 57: the README's merge of four
``down_proj`` spent 214 s per trust-region step in VJPs through the blocks while H's formation, the
one cost the plan counted, was a tenth of its note's threshold. The count is checked here against
torch's own FLOP counter around the run's statistics."""

from __future__ import annotations

import pytest

from mergeqp.config import load_config
from mergeqp.merge import multilayer
from mergeqp.run import pipeline
from mergeqp.run import plan as plan_module
from mergeqp.run import statistics_cost

LAYERS = {"llama": "model.layers.0.mlp.down_proj", "gpt2": "transformer.h.0.mlp.c_proj",
          "bert": "bert.encoder.layer.0.output.dense", "mixtral": "model.layers.0.self_attn.o_proj"}


@pytest.mark.parametrize("arch, mode, output", [
    ("llama", "forward", {}), ("llama", "reverse", {}), ("llama", "reverse", {"restrict": "projection", "k": 4}),
    ("gpt2", "forward", {"restrict": "projection", "k": 4}), ("bert", "reverse", {}),
    # (stop 58 review) a pooled output was counted as positions x vocabulary (0.05x), a mixture's
    # fused experts not at all (7.7x)
    ("bert", "reverse", {"pool": "mean"}), ("mixtral", "forward", {})])
def test_the_plans_count_agrees_with_a_flop_counter(tiny_hf, tmp_path, monkeypatch, arch, mode, output):
    """The multiply-adds of one batch's statistics as counted by the plan (H's formation and the
    derivative passes, every prompt at the longest length) against what torch's FlopCounterMode counts
    (matrix products, 2 FLOPs per multiply-add) around the run's `collect_first_order` (one batch per
    task here): within 2x either way. Measured 0.8-1.7x the plan (attention's own products and
    the primal passes of vectorised JVPs are not in its count). Reverse mode on all logits costs one
    VJP per compared output, several times forward mode's count: the plan sees that difference."""
    from torch.utils.flop_counter import FlopCounterMode

    fam = tiny_hf.make_family(tmp_path / arch, arch, K=2, scale=0.3, n_prompts=8)
    cfg = load_config(fam.write_config(tmp_path / "c.yml", LAYERS[arch], {"name": "qp", "mode": "single",
                                                                         "jacobian_mode": mode},
                                       output=output, calibration={"batch_size": 8},
                                       **({"dtype": "float32"} if arch == "mixtral" else {})))
    plan = plan_module.build_plan(cfg)
    cost = statistics_cost.statistics_work(plan, plan.sketch)
    assert cost is not None and cost.derivatives is not None and cost.derivatives > 0
    counted = []
    collect = multilayer.collect_first_order

    def counting(*args, **kwargs):
        with FlopCounterMode(display=False) as counter:
            out = collect(*args, **kwargs)
        counted.append(counter.get_total_flops() / 2)
        return out

    monkeypatch.setattr(multilayer, "collect_first_order", counting)
    pipeline.run_merge(cfg, tmp_path / "out", progress=False, plan=plan)
    (madds,) = counted
    per_batch = madds / len(plan.tasks)  # 8 prompts per task, batches of 8
    assert 0.5 * cost.total <= per_batch <= 2.0 * cost.total
    if output == {} and arch == "llama":
        other = "forward" if mode == "reverse" else "reverse"
        cfg2 = load_config(fam.write_config(tmp_path / "d.yml", LAYERS[arch], {"name": "qp", "mode": "single",
                                                                              "jacobian_mode": other},
                                            calibration={"batch_size": 8}))
        cost2 = statistics_cost.statistics_work(plan_module.build_plan(cfg2), None)
        reverse, forward = (cost, cost2) if mode == "reverse" else (cost2, cost)
        assert reverse.derivatives > 3 * forward.derivatives  # 10 positions x 32 logits VJPs vs 2 x 16 JVPs


def test_a_costly_derivative_pass_is_noted_where_h_is_cheap(tiny_hf, tmp_path, monkeypatch):
    """The note and the dry run's line name both parts; a cost above the budget from the derivative
    passes alone (H's formation below it) is noted, as the four-block merge's should have been."""
    fam = tiny_hf.make_family(tmp_path / "llama", "llama", K=2, scale=0.3, n_prompts=8)
    cfg = load_config(fam.write_config(tmp_path / "c.yml", LAYERS["llama"], {"name": "qp", "mode": "single",
                                                                            "jacobian_mode": "reverse"}))
    cost = statistics_cost.statistics_work(plan_module.build_plan(cfg), None)
    assert cost.derivatives > cost.work
    monkeypatch.setattr(statistics_cost, "STATISTICS_BUDGET", (cost.work + cost.total) / 2)
    plan = plan_module.build_plan(cfg)
    (note,) = [n for n in plan.notes if n.startswith("statistics cost:")]
    assert f"about {cost.total:.2g} multiply-adds" in note
    assert f"{cost.derivatives:.2g} in the derivative passes" in note and f"{cost.work:.2g} to form H" in note
    assert any(line.startswith("  statistics cost per calibration batch") for line in plan.render().splitlines())


def test_auto_does_not_sketch_where_the_sketch_would_not_halve_the_cost(tiny_hf, tmp_path, monkeypatch):
    """Forward mode's JVPs, one per coefficient direction, do not shrink with a sketch: where they are
    most of a batch's cost, `sketch: auto` keeps the statistics exact and says why; where the rows
    dominate (reverse mode, one VJP per compared output, which the sketch also cuts) it sketches."""
    fam = tiny_hf.make_family(tmp_path / "llama", "llama", K=2, scale=0.3, n_prompts=8)
    monkeypatch.setattr(statistics_cost, "AUTO_SKETCH", 5)
    monkeypatch.setattr(statistics_cost, "STATISTICS_BUDGET", 1.0)

    def plan_for(mode):
        cfg = load_config(fam.write_config(tmp_path / f"{mode}.yml", LAYERS["llama"],
                                           {"name": "qp", "mode": "single", "jacobian_mode": mode},
                                           output={"sketch": "auto"}))
        return plan_module.build_plan(cfg)

    forward = plan_for("forward")
    exact, sketched = (statistics_cost.statistics_work(forward, s) for s in (None, 5))
    assert sketched.total > 0.5 * exact.total  # (the tiny model: JVPs most of the cost)
    assert forward.sketch is None
    assert any("would cut a batch's" in n and "do not shrink with it" in n for n in forward.notes)
    reverse = plan_for("reverse")
    assert reverse.sketch == 5
    assert any(n.startswith("output.sketch auto: a sketch of 5 per prompt") for n in reverse.notes)


@pytest.mark.parametrize("config, width", [
    ({"hidden_size": 64, "vocab_size": 100}, 64),
    ({"n_embd": 48}, 48),
    ({"dim": 32, "hidden_dim": 128}, 32),                                     # DistilBERT
    ({"d_model": 24, "text_config": {"hidden_size": 99}}, 24),                # the top level first
    ({"model_type": "llava", "vision_config": {"hidden_size": 1024},
      "text_config": {"hidden_size": 4096}}, 4096),                           # never the vision tower's
    ({"llm_config": {"n_embd": 16}}, 16),
    ({"hidden_size": True}, None),                                            # a bool is no width
    ({"hidden_size": 0}, None),
    ({"hidden_size": "64"}, None),
    ({}, None),
])
def test_the_hidden_width_is_read_also_from_a_composite_models_text_config(config, width):
    """(Stop 78: the dry run's width of a composite model's hidden states was read at the top level only.)"""
    from mergeqp.run.merge_plan import hidden_width

    assert hidden_width(config) == width
