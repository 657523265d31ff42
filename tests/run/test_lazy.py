"""``lazy: true``: the blocks off a QP merge's linearised path stay on disk until they run
(:mod:`mergeqp.io.lazy_model`). A lazily loaded model computes what ``from_pretrained``'s does,
and a lazy merge equals the resident one (every mode family, a start merge loaded into the
blocks on disk, the joint mode's model copy), while the blocks below the sites hold no tensor
between their runs."""

from __future__ import annotations

import copy
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import mergeqp
from mergeqp.config import load_config
from mergeqp.errors import ConfigError
from mergeqp.io.lazy_model import lazy_of
from mergeqp.run.architectures import every_block, lower_blocks
from mergeqp.run.auto import DEFAULT_CANDIDATES
from mergeqp.run.models import load_lazy, load_model
from mergeqp.run.pipeline import run_merge
from mergeqp.run.plan import build_plan


@pytest.fixture(scope="module")
def families(tiny_hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("lazy")
    return {arch: tiny_hf.make_family(root / arch, arch, K=2, scale=0.3, n_prompts=10,
                                      perturbed=("*",))  # every block differs from the base
            for arch in ("llama", "gpt2", "bert")}


def _inputs(tiny_hf, arch):
    ids = torch.tensor([[3, 5, 7, 9, 11, 4], [6, 8, 10, 12, 3, 5]])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_lazy_model_computes_what_from_pretrained_computes(tiny_hf, families, arch):
    fam = families[arch]
    ck = mergeqp.open_checkpoint(fam.finetuned[0])
    whole = load_model(ck, fam.base, torch.float64, "cpu")
    lazy = load_lazy(ck, fam.base, torch.float64, "cpu", every_block)
    assert len(lazy.blocks) == 2 and lazy.lazy_bytes > 0
    for block in lazy.blocks:  # nothing of a lazy block is in memory between runs
        assert all(p.is_meta for p in block.module.parameters())
    x = _inputs(tiny_hf, arch)
    with torch.no_grad():
        a = whole(**x)[0]
        b = lazy.model(**x)[0]
    assert torch.equal(a, b)
    assert lazy.loads == 2  # each block read once for the forward
    for block in lazy.blocks:
        assert all(p.is_meta for p in block.module.parameters())
    # resident tensors are the checkpoint's, tied ones tied
    ws, ls = whole.state_dict(), lazy.model.state_dict()
    for name, t in ls.items():
        if not t.is_meta:
            assert torch.equal(t, ws[name]), name
    # a deep copy runs on its own copy of the state
    twin = copy.deepcopy(lazy.model)
    with torch.no_grad():
        assert torch.equal(twin(**x)[0], a)
    assert all(lazy_of(m) is not None for m in every_block(twin))


def _merge(fam, tmp_path, name, layers, method, lazy):
    cfg = load_config(fam.write_config(tmp_path / f"{name}.yml", layers, method, lazy=lazy))
    result = run_merge(cfg, tmp_path / name, progress=False)
    report = json.loads((tmp_path / name / "report.json").read_text())
    return result, report, mergeqp.open_checkpoint(tmp_path / name)


@pytest.mark.parametrize("arch, method", [
    ("llama", {"name": "qp", "mode": "single"}),
    ("llama", {"name": "qp", "mode": "trust_region", "start": {"name": "soup"}, "mode_options": {"max_steps": 2}}),
    ("llama", {"name": "qp", "mode": "joint", "mode_options": {"compare_sequential": True}}),
    ("gpt2", {"name": "qp", "mode": "hybrid", "start": {"name": "task_arithmetic", "params": {"scaling": 0.5}}}),
    ("bert", {"name": "qp", "mode": "sequential"}),
    ("llama", {"name": "auto"}),  # the default: start candidates (RegMean's statistics) loaded into lazy blocks
])
def test_lazy_merge_equals_the_resident_one(tiny_hf, families, tmp_path, arch, method):
    fam = families[arch]
    layers = [tiny_hf.MLP_LAYER[arch]]
    resident_method = method
    if method == {"name": "auto"}:  # lazy skips the default candidates that would load the fine-tunes whole
        kept = [c for c in DEFAULT_CANDIDATES if c["name"] != "fisher"]
        resident_method = {"name": "auto", "params": {"candidates": kept}}
    _, resident, rck = _merge(fam, tmp_path, "resident", layers, resident_method, False)
    _, lazy, lck = _merge(fam, tmp_path, "lazy", layers, method, True)
    for a, b in zip(resident["layers"], lazy["layers"]):
        for key in ("objective_before", "objective_after", "objective_after_exact"):
            assert b[key] == pytest.approx(a[key], rel=1e-12, abs=1e-12), key
    ev_a, ev_b = resident["evaluation"]["merged"], lazy["evaluation"]["merged"]
    assert ev_b["calibration_objective"] == pytest.approx(ev_a["calibration_objective"], rel=1e-12)
    for name in rck.names():  # the same merged checkpoint, start merge included
        assert torch.allclose(lck.get(name), rck.get(name), rtol=0, atol=1e-12), name
    note = next(n for n in lazy["notes"] if n.startswith("lazy:"))
    assert "1 block(s) below the merge sites stayed on disk" in note
    assert "each fine-tuned model ran with all 2 blocks on disk" in note
    assert not any(n.startswith("lazy:") for n in resident["notes"])
    if method == {"name": "auto"}:
        skipped = {c["label"]: c.get("skipped") for c in lazy["start_selection"]["candidates"]}
        assert "lazy: true" in skipped["fisher"] and "loaded whole" not in " ".join(lazy["notes"])
        assert lazy["start_selection"]["chosen"] == resident["start_selection"]["chosen"]


def test_lazy_blocks_are_the_ones_below_every_site(tiny_hf, families, tmp_path):
    fam = families["llama"]
    single = {"name": "qp", "mode": "single"}
    plan = build_plan(load_config(fam.write_config(tmp_path / "a.yml", ["model.layers.1.mlp.down_proj"], single)))
    (block,) = lower_blocks(plan.sites)(plan.skeleton)
    assert block is plan.skeleton.model.layers[0]
    low = build_plan(load_config(fam.write_config(tmp_path / "b.yml", ["model.layers.0.mlp.down_proj",
                                                                       "model.layers.1.mlp.down_proj"], single)))
    assert lower_blocks(low.sites)(low.skeleton) == []  # a site in the first block: nothing below it


def test_lazy_memory_estimate_and_refusals(tiny_hf, families, tmp_path):
    fam = families["llama"]
    layer = tiny_hf.MLP_LAYER["llama"]
    whole = build_plan(load_config(fam.write_config(tmp_path / "a.yml", [layer], {"name": "qp", "mode": "single"})))
    lazy = build_plan(load_config(fam.write_config(tmp_path / "b.yml", [layer], {"name": "qp", "mode": "single"},
                                                   lazy=True)))
    assert lazy.memory["models (resident: lazy)"] <= whole.memory["models"]
    assert "lazy: 1 block(s) below the merge sites stay on disk" in lazy.render()
    assert "lazy:" not in whole.render()
    with pytest.raises(ConfigError, match="lazy: true keeps the blocks off a QP merge's linearised path"):
        build_plan(load_config(fam.write_config(tmp_path / "c.yml", [layer], {"name": "ties"}, lazy=True)))
    # Fisher's statistics need gradients of every weight: its fine-tunes are loaded whole, and said so
    method = {"name": "qp", "mode": "trust_region", "start": {"name": "fisher"}, "mode_options": {"max_steps": 1}}
    _, report, _ = _merge(fam, tmp_path, "fisher", [layer], method, True)
    assert any("the fine-tuned models were loaded whole: the fisher statistics" in n for n in report["notes"])
    # method: auto skips its default Fisher candidate under lazy (said in the plan), keeps a listed one
    auto = build_plan(load_config(fam.write_config(tmp_path / "d.yml", [layer], "auto", lazy=True)))
    assert "start auto: fisher skipped: lazy: true" in auto.render()
    assert not any(k.startswith("fisher statistics") for k in auto.memory)
    listed = {"name": "auto", "params": {"candidates": ["soup", "fisher"], "folds": 3}}
    _, report, _ = _merge(fam, tmp_path, "listed", [layer], listed, True)
    assert all(c.get("skipped") is None for c in report["start_selection"]["candidates"])
    assert any("the fine-tuned models were loaded whole: the fisher statistics" in n for n in report["notes"])
