"""What the plan (and so ``--dry-run``) refuses since the stop 55 review, where the run used to fail
after loading every model: an encoder-decoder base whose decoder needs inputs of its own (T5; BART
derives them from ``input_ids`` and passes the same probe, one forward pass of the ``meta``-device
skeleton), and a prompt that tokenises to nothing; since stop 56's, a float tensor a fine-tune stores as
integers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mergeqp.errors import ConfigError  # noqa: E402
from mergeqp.run.checkpoints import check_decoder_inputs  # noqa: E402


def _skeleton(cls, config):
    with torch.device("meta"):
        return cls(config)


def test_t5_is_refused_at_plan_time_and_bart_passes():
    t5 = transformers.T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                               pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    with pytest.raises(ConfigError, match="t5.*encoder-decoder.*not supported"):
        check_decoder_inputs(_skeleton(transformers.T5ForConditionalGeneration, t5), t5.to_dict())
    bart = transformers.BartConfig(vocab_size=32, d_model=16, encoder_layers=1, decoder_layers=1,
                                   encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                   decoder_ffn_dim=32, max_position_embeddings=32, pad_token_id=0,
                                   bos_token_id=2, eos_token_id=1, decoder_start_token_id=1)
    check_decoder_inputs(_skeleton(transformers.BartForConditionalGeneration, bart), bart.to_dict())
    llama = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2)
    check_decoder_inputs(_skeleton(transformers.LlamaForCausalLM, llama), llama.to_dict())  # not one: no probe


def test_a_prompt_that_tokenises_to_nothing_is_refused_by_the_plan(monkeypatch, tmp_path):
    """(stop 55 review) The dry run tokenised every prompt for the longest length and passed; the run
    refused the empty ones after loading every model. The plan now names the file."""
    from mergeqp.run import plan as plan_module

    class Dropping:  # a tokenizer that keeps only words it knows (transformers 5's Qwen2Tokenizer did)
        def __call__(self, texts, truncation, max_length):
            return {"input_ids": [[1 for w in t.split() if w == "known"][:max_length] for t in texts]}

    monkeypatch.setattr(plan_module, "load_tokenizer", lambda folder: Dropping())
    texts = ["known words", "known", "nothing here", "known again"]
    owners = ["models[a].calibration (a.txt)"] * 2 + ["models[b].calibration (b.txt)"] * 2
    with pytest.raises(ConfigError, match=r"models\[b\].calibration \(b.txt\): prompt\(s\) tokenise to nothing.*nothing here"):
        plan_module._longest_prompt(tmp_path, texts, 8, owners)
    assert plan_module._longest_prompt(tmp_path, ["known known", "known"], 8, owners[:2]) == 2


@pytest.mark.parametrize("key", ["model.layers.1.mlp.down_proj.weight", "model.norm.weight"],
                         ids=["selected", "not selected"])
def test_a_float_tensor_stored_as_integers_is_refused_by_the_plan(tiny_hf, tmp_path, key):
    """(stop 56 review) An integer copy of a float tensor passed --dry-run: selected, the run refused
    it after loading; not selected, the run read it into the fine-tune's targets and exited 0."""
    from safetensors.torch import load_file, save_file

    from mergeqp.config import load_config
    from mergeqp.run.plan import build_plan

    fam = tiny_hf.make_family(tmp_path / "llama", "llama", K=2, scale=0.3, n_prompts=6)
    path = fam.finetuned[1] / "model.safetensors"
    state = load_file(str(path))
    state[key] = (100 * state[key]).to(torch.int32)
    save_file(state, str(path), metadata={"format": "pt"})
    cfg = load_config(fam.write_config(tmp_path / "c.yml", ["model.layers.1.mlp.down_proj"], {"name": "soup"}))
    with pytest.raises(ConfigError, match=rf"tensor '{key}' is stored as int32 in model '{fam.tasks[1]}' but as "
                                          r"float32 in the base"):
        build_plan(cfg)


def test_a_prompt_file_with_repeats_is_noted_when_prompts_are_held_out(tiny_hf, tmp_path):
    """(stop 56 review) A duplicated prompt file put 8 of 8 held-out prompts among the fitted ones,
    silently: the held-out metrics were not of unseen text."""
    from mergeqp.config import load_config
    from mergeqp.run.plan import build_plan

    from mergeqp.io.calibration import read_prompts, split_holdout

    fam = tiny_hf.make_family(tmp_path / "llama", "llama", K=2, scale=0.3, n_prompts=6)
    lines = fam.prompts[1].read_text().splitlines()
    fam.prompts[1].write_text("\n".join(lines + lines) + "\n")  # every prompt twice
    cfg = load_config(fam.write_config(tmp_path / "c.yml", ["model.layers.1.mlp.down_proj"], {"name": "soup"}))
    fitted, held = split_holdout(read_prompts(fam.prompts[1]), cfg.holdout_for(1), cfg.seed + 1)  # the run's split
    both = set(fitted) & set(held)
    assert both  # (this seed puts some prompt on both sides)
    notes = [n for n in build_plan(cfg).notes if "also stand among its fitted ones" in n]
    assert len(notes) == 1 and fam.tasks[1] in notes[0] and f"{len(both)} of the {len(held)} held-out" in notes[0]
    # a repeat whose copies are both fitted on is no leak: no note (the review of this very note)
    distinct = list(dict.fromkeys(lines))
    for j in range(len(distinct) + 1):  # a copy of the first prompt placed where the split fits on both
        texts = distinct[:j] + [distinct[0]] + distinct[j:]
        fitted, held = split_holdout(texts, cfg.holdout_for(1), cfg.seed + 1)
        if not set(fitted) & set(held):
            break
    else:
        raise AssertionError("no placement keeps both copies on one side")
    fam.prompts[1].write_text("\n".join(texts) + "\n")
    assert not any("also stand among" in n for n in build_plan(cfg).notes)
    quiet = build_plan(load_config(fam.write_config(tmp_path / "q.yml", ["model.layers.1.mlp.down_proj"],
                                                    {"name": "soup"}, evaluate=False)))
    assert not any("also stand among" in n for n in quiet.notes)


def test_a_fine_tune_untied_from_a_tied_base_is_refused_naming_tie_word_embeddings(tiny_hf, tmp_path):
    """(stop 56 review) The refusal named the extra lm_head.weight but not why it was there."""
    import json

    from safetensors.torch import load_file, save_file

    from mergeqp.config import load_config
    from mergeqp.run.plan import build_plan

    fam = tiny_hf.make_family(tmp_path / "gpt2", "gpt2", K=2, scale=0.3, n_prompts=6)
    folder = fam.finetuned[1]
    cfg = json.loads((folder / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(folder / "model.safetensors"))
    state["lm_head.weight"] = state["transformer.wte.weight"].clone() + 0.1
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = load_config(fam.write_config(tmp_path / "c.yml", [tiny_hf.MLP_LAYER["gpt2"]], {"name": "soup"}))
    with pytest.raises(ConfigError, match=r"has tensor 'lm_head.weight' that the base lacks.*tie_word_embeddings "
                                          r"is True in the base and False in this model"):
        build_plan(config)


def test_the_plan_says_what_a_batchs_statistics_cost_when_they_are_large(tiny_hf, tmp_path, monkeypatch):
    """(stop 56 review) A real two-layer merge ran 150-180 s per statistics batch with no word from
    --dry-run. The plan now notes rows x n^2 above a threshold (here lowered to the tiny model's size),
    with the sketch's advice; below it, nothing."""
    from mergeqp.config import load_config
    from mergeqp.run import plan as plan_module
    from mergeqp.run import statistics_cost

    fam = tiny_hf.make_family(tmp_path / "llama", "llama", K=2, scale=0.3, n_prompts=6)
    cfg = load_config(fam.write_config(tmp_path / "c.yml", ["model.layers.1.mlp.down_proj"],
                                       {"name": "qp", "mode": "sequential"}))
    assert not any("statistics cost" in n for n in plan_module.build_plan(cfg).notes)
    monkeypatch.setattr(statistics_cost, "STATISTICS_BUDGET", 1.0)
    plan = plan_module.build_plan(cfg)
    (note,) = [n for n in plan.notes if "statistics cost" in n]
    n = plan.groups[0].n_variables
    assert f"of n = {n:,} coefficients" in note and "output: {sketch: auto}" in note


def test_an_output_field_the_model_does_not_return_is_refused_by_the_plan(tiny_hf, tmp_path):
    """(stop 58 review) GPT-2's `last_hidden_state` passed the dry run and the run refused it at its
    first batch, after loading every model: the plan reads the output class the model's forward
    declares and names its fields; a field it declares passes."""
    from mergeqp.config import load_config
    from mergeqp.run.plan import build_plan

    fam = tiny_hf.make_family(tmp_path / "gpt2", "gpt2", K=2, scale=0.3, n_prompts=6)
    layer = tiny_hf.MLP_LAYER["gpt2"]
    cfg = load_config(fam.write_config(tmp_path / "c.yml", [layer], {"name": "qp", "mode": "single"},
                                       output={"field": "last_hidden_state"}))
    with pytest.raises(ConfigError, match=r"output.field 'last_hidden_state': GPT2LMHeadModel returns "
                                          r"CausalLMOutputWithCrossAttentions, which has no such field; it has logits"):
        build_plan(cfg)
    ok = load_config(fam.write_config(tmp_path / "d.yml", [layer], {"name": "qp", "mode": "single"},
                                      output={"field": "logits"}))
    assert build_plan(ok).config.output.field == "logits"
    # a baseline that is not evaluated compares no outputs: no check
    plain = load_config(fam.write_config(tmp_path / "e.yml", [layer], {"name": "ties"}, evaluate=False,
                                         output={"field": "last_hidden_state"}))
    build_plan(plain)
