"""Mixture-of-experts checkpoints whose experts ``transformers`` fuses on load (stop 55 review):
Mixtral stores ``experts.E.w1 / w2 / w3`` per expert, and the live model holds them stacked in
``experts.gate_up_proj`` / ``experts.down_proj``. A merge of the stored tensors (a baseline on the
experts, or the default ``auto``, whose start merges every tensor) used to stop after its statistics
with "not a parameter of the loaded model"; now each stored tensor is placed in its block of the fused
parameter, and what the run measures is what the written folder holds."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from mergeqp.config import load_config
from mergeqp.errors import ValidationError
from mergeqp.io import open_checkpoint
from mergeqp.run.fused import FusedPlacer
from mergeqp.run.pipeline import run_merge

FUSED = "model.layers.1.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def moe(tiny_hf, tmp_path_factory):
    return tiny_hf.make_family(tmp_path_factory.mktemp("moe") / "mixtral", "mixtral", K=2, n_prompts=8,
                               perturbed=("model.layers.1.mlp.experts", "model.layers.*.self_attn.*"))


def _state(fam, folder):
    return fam.auto_class.from_pretrained(str(folder), dtype=torch.float32).state_dict()


def test_a_soup_of_stored_expert_tensors_fills_their_blocks_of_the_fused_parameter(moe, tmp_path):
    cfg = load_config(moe.write_config(tmp_path / "soup.yml", ["model.layers.1.block_sparse_moe.experts.*.w1"],
                                       {"name": "soup"}, dtype="float32"))
    run_merge(cfg, tmp_path / "out", progress=False)
    base, merged = _state(moe, moe.base), _state(moe, tmp_path / "out")
    fts = [_state(moe, f) for f in moe.finetuned]
    half = base[FUSED].shape[1] // 2  # w1 (gate) rows, then w3 (up) rows, per expert
    assert not torch.equal(fts[0][FUSED][:, :half], base[FUSED][:, :half])
    want = (fts[0][FUSED][:, :half] + fts[1][FUSED][:, :half]) / 2
    assert torch.allclose(merged[FUSED][:, :half], want, atol=1e-6)
    assert torch.equal(merged[FUSED][:, half:], base[FUSED][:, half:])  # w3 not selected: the base's


def test_the_default_auto_on_a_mixture_of_experts_measures_what_it_writes(moe, tiny_hf, tmp_path):
    """auto's start merges every changed tensor, the stored experts included; its calibration
    objective, measured on the live model, equals J recomputed from the written folder."""
    cfg = load_config(moe.write_config(tmp_path / "auto.yml", ["model.layers.*.self_attn.o_proj"], "auto",
                                       evaluate=False, dtype="float32",
                                       calibration={"max_length": 12, "batch_size": 4, "holdout": 0}))
    result = run_merge(cfg, tmp_path / "out", progress=False)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    measured = report["evaluation"]["merged"]["calibration_objective"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(moe.base))
    merged = moe.auto_class.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    J = 0.0
    with torch.no_grad():
        for ft, prompts in zip(moe.finetuned, moe.prompts):
            teacher = moe.auto_class.from_pretrained(str(ft), dtype=torch.float32).eval()
            lines = [json.loads(x)["text"] if prompts.suffix == ".jsonl" else x
                     for x in prompts.read_text().splitlines() if x.strip()]
            for text in lines:
                ids = tok(text, truncation=True, max_length=12, return_tensors="pt")["input_ids"]
                J += float(((merged(input_ids=ids).logits - teacher(input_ids=ids).logits) ** 2).sum())
    assert result is not None
    assert measured == pytest.approx(J, rel=1e-4)  # (float32: the experts' grouped kernels take no float64)
    base_state, out_state = _state(moe, moe.base), _state(moe, tmp_path / "out")
    assert not torch.equal(out_state[FUSED], base_state[FUSED])  # the start merged the experts


def test_identical_experts_cannot_be_placed_and_say_so(tiny_hf, tmp_path):
    """Placement is by value: where two experts hold the same stored values (an upcycled model), a
    stored tensor's block is not one, and the error says so instead of guessing."""
    from mergeqp.run.pipeline import load_model

    folder = tmp_path / "base"
    model = tiny_hf.build_base(folder, "mixtral")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                p.copy_(p[0:1].expand_as(p))
    model.save_pretrained(str(folder))
    ck = open_checkpoint(folder)
    live = load_model(ck, folder, torch.float32, "cpu")
    placer = FusedPlacer(ck)
    with pytest.raises(ValidationError, match="identical experts"):
        placer.view(live, "model.layers.1.block_sparse_moe.experts.0.w2.weight")
    assert placer.view(live, "model.layers.1.self_attn.o_proj.weight") is None  # a plain parameter: not fused
