"""The language experiment on causal LMs other than Llama: the split forward of the fine-tuning and
the evaluation (cached hidden states entering a block, then the upper blocks, final norm and head)
equals the full model on eight architectures that keep their blocks under different names, with
absolute or rotary positions and tied or untied heads; the parameters only the upper part uses;
where the blocks are (``BlockLayout``); names that ``transformers`` changes between the file and
the module (GPT-NeoX's ``embed_out`` / ``lm_head``); and the whole experiment on a GPT-2."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mergeqp.errors import ValidationError  # noqa: E402
from mergeqp.experiments.corpora import Corpus  # noqa: E402
from mergeqp.experiments.finetune_lm import (  # noqa: E402
    DecoderSplit,
    block_layout,
    lower_states,
    pad_hidden,
    pad_ids,
    split_block,
)
from mergeqp.experiments.lm import LmConfig, LmMergeSettings, RECOMMENDED_RUN, run_lm_experiment  # noqa: E402
from mergeqp.experiments.lm_eval import file_names  # noqa: E402

V = 40
SMALL = {"vocab_size": V, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 3}
ARCHITECTURES = {
    # name: (config class, settings, the block stack's prefix, parameters only the upper part uses
    # besides the top block's)
    "gpt2": ("GPT2Config", {"n_embd": 16, "n_layer": 3, "n_head": 2, "n_positions": 64},
             "transformer.h", {"transformer.ln_f.weight", "transformer.ln_f.bias"}),
    "gpt_neox": ("GPTNeoXConfig", {"hidden_size": 16, "num_hidden_layers": 3, "num_attention_heads": 2,
                                   "intermediate_size": 32, "max_position_embeddings": 64},
                 "gpt_neox.layers", {"gpt_neox.final_layer_norm.weight", "gpt_neox.final_layer_norm.bias",
                                     "lm_head.weight"}),
    "opt": ("OPTConfig", {"hidden_size": 16, "num_hidden_layers": 3, "ffn_dim": 32, "num_attention_heads": 2,
                          "max_position_embeddings": 64, "word_embed_proj_dim": 8},
            "model.decoder.layers", {"model.decoder.final_layer_norm.weight", "model.decoder.final_layer_norm.bias",
                                     "model.decoder.project_out.weight"}),
    "qwen2": ("Qwen2Config", {"hidden_size": 16, "num_hidden_layers": 3, "intermediate_size": 32,
                              "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64},
              "model.layers", {"model.norm.weight", "lm_head.weight"}),
    "phi": ("PhiConfig", {"hidden_size": 16, "num_hidden_layers": 3, "intermediate_size": 32,
                          "num_attention_heads": 2, "max_position_embeddings": 64},
            "model.layers", {"model.final_layernorm.weight", "model.final_layernorm.bias", "lm_head.weight",
                             "lm_head.bias"}),
    "falcon": ("FalconConfig", {"hidden_size": 16, "num_hidden_layers": 3, "num_attention_heads": 2},
               "transformer.h", {"transformer.ln_f.weight", "transformer.ln_f.bias"}),
    "bloom": ("BloomConfig", {"hidden_size": 16, "n_layer": 3, "n_head": 2},
              "transformer.h", {"transformer.ln_f.weight", "transformer.ln_f.bias"}),
    "llama": ("LlamaConfig", {"hidden_size": 16, "num_hidden_layers": 3, "intermediate_size": 32,
                              "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64},
              "model.layers", {"model.norm.weight", "lm_head.weight"}),
}


def _model(arch: str):
    config_class, settings, _, _ = ARCHITECTURES[arch]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**settings, **SMALL))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)  # larger than the default init, so the blocks matter
    return model.eval()


def _texts():
    gen = torch.Generator().manual_seed(3)
    ids = [torch.randint(4, V, (n,), generator=gen) for n in (5, 9, 3, 12, 7)]
    return ids, pad_ids(ids, 0), pad_ids([t.new_ones(t.shape) for t in ids], 0)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_split_forward_equals_the_full_model(arch):
    model = _model(arch)
    ids, batch, mask = _texts()
    stack = DecoderSplit.stack(model)
    blocks = list(stack)
    with torch.no_grad():
        full = model(input_ids=batch, attention_mask=mask, use_cache=False).logits
        for first in range(3):
            split = DecoderSplit.of(model, first)
            hidden, hmask = pad_hidden(lower_states(split, ids, 2, "cpu"))
            logits = split.upper(hidden, hmask)
            real = mask.bool()
            np.testing.assert_allclose(logits[real].numpy(), full[real].numpy(), atol=1e-5, rtol=0)
            assert split.matches(batch, mask)
    assert list(stack) == blocks and not stack[0]._forward_pre_hooks  # the model is as it was
    _, _, prefix, top = ARCHITECTURES[arch]
    upper = DecoderSplit.of(model, 2).upper_parameter_names(batch, mask)
    assert {n for n in upper if not n.startswith(f"{prefix}.2.")} == top  # a tied head is the embedding's
    assert any(n.startswith(f"{prefix}.2.") for n in upper)
    assert split_block(model, [f"{prefix}.2.x.weight", f"{prefix}.1.y.weight"]) == 1
    assert split_block(model, [f"{prefix}.1.y.weight", "lm_head.weight"]) is None
    with pytest.raises(ValidationError, match=r"split block must be in \[0, 3\)"):
        DecoderSplit.of(model, 3)


def test_block_layout_and_the_modules_a_fine_tune_may_name(tmp_path):
    _model("opt").save_pretrained(str(tmp_path / "opt"))
    layout = block_layout(tmp_path / "opt")
    assert (layout.prefix, layout.blocks) == ("model.decoder.layers", 3)
    assert {"fc1", "fc2", "self_attn", "self_attn.out_proj"} <= set(layout.modules)
    assert layout.patterns(["fc1", "fc2"], 2) == ("model.decoder.layers.1.fc1.*", "model.decoder.layers.2.fc1.*",
                                                 "model.decoder.layers.1.fc2.*", "model.decoder.layers.2.fc2.*")
    with pytest.raises(ValidationError, match=r"\['mlp'\] are not modules of the model's blocks .*fc1, fc2"):
        layout.patterns(["mlp"], 1)
    with pytest.raises(ValidationError, match=r"outside linear layers \(final_layer_norm.weight"):
        layout.patterns(["final_layer_norm"], 1)  # a norm: no merge of the experiment would change it
    with pytest.raises(ValidationError, match="cannot build the causal LM"):
        block_layout(tmp_path / "missing")


def test_file_names_map_file_names_to_the_modules(tmp_path):
    model = _model("gpt_neox")
    model.save_pretrained(str(tmp_path))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "embed_out.weight" in set(f.keys())  # the file's name for the module lm_head
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert file_names(loaded) == {"embed_out.weight": "lm_head.weight"}
    assert file_names(_model("llama")) == {}


def test_the_experiment_runs_on_gpt2(tiny_hf, tmp_path):
    """End to end on a tiny random GPT-2 (absolute positions, a tied head, Conv1D layers): the
    fine-tunes train its MLPs, the recommended merge runs, and every method is evaluated."""
    tiny_hf.build_base(tmp_path / "base", "gpt2", seed=0)
    corpora = [Corpus(t, tuple(tiny_hf.sentences(t, 40, seed=i)), np.arange(40) % 2, ("a", "b"), "synthetic")
               for i, t in enumerate(("code", "math", "story"))]
    merge = LmMergeSettings(calibration_max_length=16, calibration_batch_size=4, ta_scalings=(0.5, 1.0),
                            outputs={"euclidean": {"restrict": "none"},
                                     "cross_entropy": {"restrict": "topk", "k": 8, "sketch": 16}},
                            runs=("single:euclidean", RECOMMENDED_RUN), metrics=("euclidean",), baselines=("ties",),
                            mergekit=(),
                            extra_runs=())
    config = LmConfig(train_texts=16, calibration_texts=6, test_texts=6, min_chars=5, finetune_blocks=1,
                      finetune_steps=12, finetune_batch=4, finetune_max_length=16, finetune_lr=1e-2,
                      eval_max_length=16, eval_batch=4, multitask=False, merge=merge)
    results = run_lm_experiment(tmp_path / "out", corpora=corpora, config=config, cache=tmp_path / "cache",
                                base_folder=tmp_path / "base", threads=1, progress=False)
    assert results["merged_layers"] == ["transformer.h.1.mlp.c_fc", "transformer.h.1.mlp.c_proj"]
    methods = results["methods"]
    rec = methods["qp_trust_region_cross_entropy"]
    assert rec["layers"] == ["transformer.h.1.mlp.c_proj"]  # module_outputs: the MLP's output projection
    for name in ("base", "ties", "qp_single_euclidean", "qp_trust_region_cross_entropy", "finetune:code"):
        assert np.isfinite(methods[name]["mean_test"]["ce"]), name
    # each fine-tune is its own domain's reference: zero logit MSE there
    assert methods["finetune:code"]["test"]["code"]["mse"] == pytest.approx(0.0, abs=1e-12)
    assert methods["base"]["mean_test"]["ce"] != pytest.approx(methods["ties"]["mean_test"]["ce"], abs=1e-9)
    assert not results["notes"]  # the split was exact: no model needed full forward passes


def test_evaluator_falls_back_to_full_passes_where_the_split_differs(tiny_hf, tmp_path, monkeypatch):
    """Where the split forward does not reproduce the model, every model is scored with full
    forward passes (and the evaluator says so); the numbers are those of the split where it holds."""
    from mergeqp.experiments.lm_eval import UpperEvaluator

    base = tiny_hf.build_base(tmp_path, "gpt2", seed=0)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    domains = {"math": tiny_hf.sentences("math", 6, seed=1), "code": tiny_hf.sentences("code", 6, seed=2)}
    kw = {"max_length": 16, "batch_size": 4, "device": "cpu"}
    split = UpperEvaluator(base, tok, 1, domains, **kw)
    state = {n: p.detach().clone() for n, p in base.named_parameters()}
    state["transformer.h.1.mlp.c_fc.weight"] += 0.1
    other = split.tensors_of(state)
    assert set(other.upper) == {"transformer.h.1.mlp.c_fc.weight"} and not other.other
    got = split.evaluate({"base": None, "other": other}, {"math": other, "code": other})
    assert split.split is not None and split.note is None
    monkeypatch.setattr(DecoderSplit, "matches", lambda self, ids, mask: False)
    full = UpperEvaluator(base, tok, 1, domains, **kw)
    assert full.split is None and "full forward passes" in full.note and not full.states
    again = full.evaluate({"base": None, "other": full.tensors_of(state)}, {"math": other, "code": other})
    for model in got:
        for domain in domains:
            for metric in ("ce", "mse", "kl"):
                assert again[model][domain][metric] == pytest.approx(got[model][domain][metric], rel=1e-5, abs=1e-9)
    assert got["other"]["math"]["mse"] == pytest.approx(0.0, abs=1e-12)  # its own reference


def test_a_folder_without_a_usable_tokenizer_is_named(tiny_hf, tmp_path):
    from mergeqp.experiments.finetune_lm import load_tokenizer_of

    _model("gpt2").save_pretrained(str(tmp_path / "bare"))  # weights, no tokenizer files
    with pytest.raises(ValidationError, match=r"tokenizer in .*bare (turns text into no tokens|cannot)|"
                                              r"cannot load a tokenizer from .*bare"):
        load_tokenizer_of(tmp_path / "bare")
    tiny_hf.build_tokenizer(tmp_path / "bare")
    tok = load_tokenizer_of(tmp_path / "bare")
    assert tok.pad_token is not None and tok("one two")["input_ids"]


def test_a_base_the_experiment_cannot_use_is_named_before_any_fine_tune(tiny_hf, tmp_path):
    """A QA review, stop 76: a base without weights ended with exit 4 (an I/O error), a one-block base
    was said to have no stack of blocks, and a tokenizer larger than the embedding failed inside torch
    (exit 70, "a bug in mergeqp")."""
    import json

    from mergeqp.experiments.finetune_lm import check_vocabulary, load_tokenizer_of

    base = tmp_path / "base"
    tiny_hf.build_base(base, "llama", seed=0)
    layout = block_layout(base)
    assert layout.blocks >= 2
    check_vocabulary(base, load_tokenizer_of(base))  # the kit's tokenizer fits its model
    assert layout.patterns(["mlp", "mlp"], 1) == layout.patterns(["mlp"], 1)  # a module named twice: once

    weightless = tmp_path / "weightless"
    weightless.mkdir()
    for f in base.iterdir():
        if not f.name.endswith(".safetensors"):
            (weightless / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ValidationError, match=r"weightless: no weights found; a model folder holds model.safetensors"):
        block_layout(weightless)

    one = tmp_path / "one"
    config = json.loads((base / "config.json").read_text())
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**{**config, "num_hidden_layers": 1})
                                                  ).save_pretrained(str(one))
    with pytest.raises(ValidationError, match=r"has 1 block \(num_hidden_layers 1\); .* a stack of at least 2"):
        block_layout(one)

    small = tmp_path / "small_vocab"
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**{**config, "vocab_size": 8})
                                                  ).save_pretrained(str(small))
    tiny_hf.build_tokenizer(small)
    with pytest.raises(ValidationError, match=r"tokenizer in .*small_vocab has \d+ tokens but the model's embedding "
                                              r"8 rows"):
        check_vocabulary(small, load_tokenizer_of(small))
    composite = tmp_path / "composite"  # (stop 77: a composite model's vocabulary sits in its text_config)
    composite.mkdir()
    (composite / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": {"vocab_size": 8}}))
    with pytest.raises(ValidationError, match=r"has 50 tokens but the model's embedding 8 rows \(config.json "
                                              r"text_config.vocab_size\)"):
        check_vocabulary(composite, ["t"] * 50)


def test_texts_are_cut_to_a_base_context_shorter_than_the_presets(tmp_path):
    from mergeqp.experiments.lm import _within_context

    folder = tmp_path / "short"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "gpt2", "n_positions": 8}')
    notes: list[str] = []
    config = LmConfig.quick()
    cut = _within_context(config, folder, notes, lambda msg: None)
    assert (cut.finetune_max_length, cut.eval_max_length, cut.merge.calibration_max_length) == (8, 8, 8)
    assert cut.merge.ta_scalings == config.merge.ta_scalings and cut.train_texts == config.train_texts
    assert notes == [f"the base's context (n_positions 8) is shorter than the experiment's texts (fine-tuning "
                     f"{config.finetune_max_length}, evaluation {config.eval_max_length}, calibration "
                     f"{config.merge.calibration_max_length} tokens): every text is cut to 8 tokens"]
    (folder / "config.json").write_text('{"model_type": "gpt2", "n_positions": 1024}')
    assert _within_context(config, folder, notes, lambda msg: None) is config and len(notes) == 1
    (folder / "config.json").write_text('{"model_type": "gpt2", "n_positions": 1}')
    with pytest.raises(ValidationError, match="holds fewer than 2 tokens"):
        _within_context(config, folder, notes, lambda msg: None)


def test_dropout_is_named():
    from mergeqp.experiments.finetune_lm import dropout_of

    assert dropout_of(_model("llama")) is None
    config_class, settings, _, _ = ARCHITECTURES["gpt2"]
    gpt2 = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(
        **settings, **SMALL, resid_pdrop=0.1))
    assert dropout_of(gpt2).startswith("p = 0.1 in 10 dropout modules; config ") and "resid_pdrop" in dropout_of(gpt2)
