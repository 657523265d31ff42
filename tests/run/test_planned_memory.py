"""A QP whose statistics and solve cannot fit is refused before any weight is loaded
(:func:`mergeqp.run.pipeline.check_groups_fit`), with the plan's sizes, which are the run's."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import mergeqp.io.memory as memory  # noqa: E402
from mergeqp.config import load_config  # noqa: E402
from mergeqp.errors import ValidationError  # noqa: E402
from mergeqp.run import pipeline  # noqa: E402
from mergeqp.run.plan import build_plan  # noqa: E402


@pytest.fixture(scope="module")
def fam(tiny_hf, tmp_path_factory):
    return tiny_hf.make_family(tmp_path_factory.mktemp("planned") / "llama", "llama", K=2, scale=0.3, n_prompts=10)


def test_a_qp_that_cannot_fit_is_refused_before_any_weight_is_loaded(tiny_hf, fam, tmp_path, monkeypatch):
    cfg = load_config(fam.write_config(tmp_path / "c.yml", "model.layers.1.mlp.*",
                                       {"name": "qp", "mode": "joint"}))
    plan = build_plan(cfg)
    (group,) = plan.groups
    need = memory.estimate_site_memory("g", group.n_variables, len(cfg.models)).peak
    loads = []
    monkeypatch.setattr(pipeline, "load_model", lambda *a, **k: loads.append(1))
    monkeypatch.setattr(pipeline, "load_lazy", lambda *a, **k: loads.append(1))
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: need - 1)
    with pytest.raises(ValidationError, match=r"model\.layers\.1\.mlp\.down_proj.*statistics and solve need about") as e:
        pipeline.run_merge(cfg, tmp_path / "out", progress=False, plan=plan)
    assert f"n = {group.n_variables}" in str(e.value) and not loads and not (tmp_path / "out").exists()
    # max_memory caps it the same way, whatever the machine has
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: None)
    with memory.memory_limit(need - 1), pytest.raises(ValidationError, match="max_memory"):
        pipeline.check_groups_fit(plan)
    with memory.memory_limit(need):
        pipeline.check_groups_fit(plan)  # exactly enough: no refusal


@pytest.mark.parametrize("method", [{"name": "qp", "mode": "single"}, {"name": "qp", "mode": "sequential"},
                                    {"name": "qp", "mode": "joint", "parametrisation": "scalar"},
                                    {"name": "qp", "mode": "hybrid", "start": "soup"},
                                    {"name": "qp", "mode": "trust_region", "start": "soup",
                                     "parametrisation": "rows+baselines", "baselines": ["ties", "task_arithmetic"]}],
                         ids=lambda m: f"{m['mode']}-{m.get('parametrisation', 'rows')}")
def test_the_plans_qp_sizes_are_the_runs(tiny_hf, fam, tmp_path, method):
    """The early refusal uses the plan's variable counts: each QP the run solves has the plan's n
    (a larger plan would refuse merges that fit)."""
    cfg = load_config(fam.write_config(tmp_path / "c.yml", "model.layers.1.mlp.*", method))
    plan = build_plan(cfg)
    res = pipeline.run_merge(cfg, tmp_path / "out", progress=False, plan=plan)
    report = json.loads((res.out_dir / "report.json").read_text())
    planned = {tuple(g.sites): g.n_variables for g in plan.groups}
    solved = {}
    for layer in report["layers"]:
        solved.setdefault(layer["group"], set()).add(layer["n_variables"])
    assert solved and all(len(v) == 1 for v in solved.values())
    assert sorted(v.pop() for v in solved.values()) == sorted(planned.values())


def test_the_dry_run_warns_when_a_qp_would_not_fit_here(tiny_hf, fam, tmp_path, monkeypatch, capsys):
    """--dry-run validates a config that may run on another machine: exit 0, a warning on stderr."""
    from mergeqp.cli import main

    cfg = fam.write_config(tmp_path / "c.yml", "model.layers.1.mlp.*", {"name": "qp", "mode": "joint"})
    assert main(["merge", str(cfg), "--dry-run"]) == 0
    assert "warning" not in capsys.readouterr().err
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 1000)
    assert main(["merge", str(cfg), "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "warning: on this machine the run would stop before loading any weight" in err and "statistics and solve" in err
    assert main(["merge", str(cfg), "--out", str(tmp_path / "o"), "--quiet"]) == 2  # and the run stops
    assert "statistics and solve need about" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_a_first_batch_design_that_cannot_fit_is_refused_before_the_fine_tunes_load(tiny_hf, fam, tmp_path,
                                                                                    monkeypatch):
    """The statistics' check of their first batch's design, made when the run starts with the base
    standing in for the first fine-tune: refused with the message the statistics give, after loading
    only the base (not the fine-tunes, not a start selection), and the same sizes as that check."""
    import mergeqp.merge.firstorder as fo

    cfg = load_config(fam.write_config(tmp_path / "c.yml", "model.layers.1.mlp.*",
                                       {"name": "qp", "mode": "trust_region", "start": "soup"}))
    plan = build_plan(cfg)
    seen = []
    check = fo.check_design_memory
    monkeypatch.setattr(fo, "check_design_memory", lambda *a, **k: seen.append(a[:4]) or check(*a, **k))
    pipeline.run_merge(cfg, tmp_path / "ok", progress=False, plan=plan)  # fits: the early and the run's checks agree
    # the early check (the first task's largest batch) is one the run makes; the run checks its
    # first batch's design and each larger one, before building it
    assert len(seen) >= 2 and seen[0] in seen[1:], seen
    # the plan's (and --dry-run's) design item: the same formula at the longest batch the plan allows
    design = next(v for k, v in plan.memory.items() if k.startswith("design (one batch"))
    assert design >= max(memory.design_bytes(*s) for s in seen)
    if plan.batch_length * 16 == seen[0][1]:  # prompts as long as the plan's longest: equal (hidden 16: folded)
        assert design == memory.design_bytes(*seen[0])
    samples, outputs, n, itemsize = seen[0]
    need = memory.design_bytes(samples, outputs, n, itemsize)
    loads = []
    load = pipeline.load_model
    monkeypatch.setattr(pipeline, "load_model", lambda *a, **k: loads.append(a[0]) or load(*a, **k))
    monkeypatch.setattr(fo, "available_memory_bytes", lambda: need - 1)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: need - 1)
    with pytest.raises(ValidationError, match=r"one calibration batch's design \(\d+ prompts x \d+ compared outputs"):
        pipeline.run_merge(cfg, tmp_path / "out", progress=False, plan=plan)
    assert loads == [plan.base] and not (tmp_path / "out").exists()


def test_a_later_larger_batch_is_checked_before_its_design_is_built(tiny_hf, fam, tmp_path, monkeypatch):
    """Batches are padded to their longest prompt, so a later task's batch can hold a larger design
    than the first: the statistics check each design larger than any checked before (here the
    second task's longer prompts), and refuse it, naming what fits, before building it."""
    import mergeqp.merge.firstorder as fo

    short, long_ = tmp_path / "short.txt", tmp_path / "long.txt"
    short.write_text("\n".join(["cat dog"] * 8) + "\n")
    long_.write_text("\n".join(["the cat runs on the mat and the dog sits"] * 8) + "\n")
    cfg_path = fam.write_config(tmp_path / "c.yml", "model.layers.1.mlp.down_proj", {"name": "qp", "mode": "single"},
                                models=[{"name": t, "path": str(ft), "calibration": str(p)}
                                        for t, ft, p in zip(fam.tasks, fam.finetuned, (short, long_))])
    cfg = load_config(cfg_path)
    seen = []
    check = fo.check_design_memory
    monkeypatch.setattr(fo, "check_design_memory", lambda *a, **k: seen.append(a[:4]) or check(*a, **k))
    pipeline.run_merge(cfg, tmp_path / "ok", progress=False)
    early, first, later = seen  # the early check (the first task's largest batch), then the run's two
    assert early == first and later[0] * later[1] > first[0] * first[1] and later[2:] == first[2:]
    # enough memory for the first task's design, not the second's: refused at the second, before it is built
    monkeypatch.setattr(fo, "available_memory_bytes", lambda: memory.design_bytes(*first))
    with pytest.raises(ValidationError, match=rf"{later[0]} prompts x {later[1]} compared outputs.*fits with "
                                              rf"output: \{{sketch: {first[0] * first[1] // later[0]}\}}"):
        pipeline.run_merge(cfg, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
