"""Cached causal-LM fine-tunes: only the chosen parameters change, the loss falls, the folder loads,
a second call with the same key is served from the cache, and a new setting retrains."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mergeqp.errors import ValidationError
from mergeqp.experiments.finetune_lm import (
    FINETUNE_RECORD,
    FinetuneSettings,
    finetune_causal_lm,
    last_mlp_patterns,
)


@pytest.fixture(scope="module")
def tiny_base(tiny_hf, tmp_path_factory):
    folder = tmp_path_factory.mktemp("base")
    tiny_hf.build_base(folder, "llama", seed=0)
    return folder


def test_trains_only_matching_tensors_and_caches(tiny_hf, tiny_base, tmp_path):
    texts = tiny_hf.sentences("code", 24, seed=1)
    settings = FinetuneSettings(train_patterns=last_mlp_patterns(2, 1), steps=30, lr=3e-3, batch_size=4,
                                max_length=16, seed=0)
    out = tmp_path / "ft_code"
    res = finetune_causal_lm(tiny_base, texts, out, settings, progress=False)
    assert not res.cached and len(res.losses) == 30
    assert sum(res.losses[-5:]) / 5 < sum(res.losses[:5]) / 5  # it learns the domain
    assert set(res.trained) == {f"model.layers.1.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    before, after = load_file(tiny_base / "model.safetensors"), load_file(out / "model.safetensors")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == set(res.trained)
    record = json.loads((out / FINETUNE_RECORD).read_text())
    assert record["key"] == res.key and record["trained"] == list(res.trained)
    assert not list(tmp_path.glob(".ft_code.*"))  # no temporary folder left

    again = finetune_causal_lm(tiny_base, texts, out, settings, progress=False)
    assert again.cached and again.losses == res.losses and again.key == res.key
    # (stop 50) a cached folder whose weights were cut short is trained again, not a reader's raw error later
    weights = out / "model.safetensors"
    cut = out / "cut.tmp"  # a new file: `after` maps the old one
    cut.write_bytes(weights.read_bytes()[:1000])
    cut.replace(weights)
    said = []
    redone = finetune_causal_lm(tiny_base, texts, out, settings, progress=False, log=said.append)
    assert not redone.cached and redone.losses == res.losses and "is damaged" in said[0]
    (out / "config.json").write_text('{"model_ty')  # a config cut short: trained again too
    said.clear()
    assert not finetune_causal_lm(tiny_base, texts, out, settings, progress=False, log=said.append).cached
    assert "config.json" in said[0]
    assert torch.equal(load_file(weights)[res.trained[0]], after[res.trained[0]])
    other = finetune_causal_lm(tiny_base, texts, out, FinetuneSettings(**{**settings.__dict__, "steps": 3}),
                               progress=False)
    assert not other.cached and len(other.losses) == 3 and other.key != res.key


def test_bad_settings_and_patterns(tiny_base, tmp_path):
    with pytest.raises(ValidationError, match="steps"):
        FinetuneSettings(train_patterns=("x",), steps=0)
    with pytest.raises(ValidationError, match="lr"):
        FinetuneSettings(train_patterns=("x",), lr=float("nan"))
    with pytest.raises(ValidationError, match="blocks"):
        last_mlp_patterns(2, 3)
    with pytest.raises(ValidationError, match="matches no parameter"):
        finetune_causal_lm(tiny_base, ["a cat"], tmp_path / "o", FinetuneSettings(train_patterns=("nope.*",), steps=1),
                           progress=False)
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(ValidationError, match="never overwritten"):
        finetune_causal_lm(tiny_base, ["a cat"], foreign, FinetuneSettings(train_patterns=("x",), steps=1),
                           progress=False)
    assert (foreign / "keep.txt").read_text() == "mine"
    with pytest.raises(ValidationError, match="overlaps"):
        finetune_causal_lm(tiny_base, ["a cat"], tiny_base, FinetuneSettings(train_patterns=("x",), steps=1),
                           progress=False)


def test_split_forward_equals_full_model(tiny_hf, tiny_base):
    """The split forward (cached hidden states entering a block, then the upper blocks + norm + head)
    gives the full model's logits on right-padded texts of different lengths, at every cut."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mergeqp.experiments.finetune_lm import DecoderSplit, lower_states, pad_hidden, pad_ids, tokenize_each

    model = AutoModelForCausalLM.from_pretrained(str(tiny_base), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    ids = tokenize_each(tok, tiny_hf.sentences("math", 5, seed=3, length=(2, 12)), 16)
    assert len({int(t.shape[0]) for t in ids}) > 1  # padding is exercised
    batch = pad_ids(ids, tok.pad_token_id)
    mask = pad_ids([t.new_ones(t.shape) for t in ids], 0)
    with torch.no_grad():
        full = model(input_ids=batch, attention_mask=mask).logits
        for first in (0, 1):
            split = DecoderSplit.of(model, first)
            hidden, hmask = pad_hidden(lower_states(split, ids, 2, "cpu"))
            assert torch.equal(hmask, mask)
            logits = split.upper(hidden, hmask)
            real = mask.bool()
            assert torch.allclose(logits[real], full[real], atol=1e-5, rtol=0)
    assert len(model.model.layers) == 2 and not isinstance(model.model.norm, torch.nn.Identity)  # restored
    with pytest.raises(ValidationError, match="split block"):
        DecoderSplit.of(model, 2)


def test_split_training_matches_full_training(tiny_hf, tiny_base, tmp_path, monkeypatch):
    """Training through the split forward follows the same loss curve as full forward passes."""
    from mergeqp.experiments import finetune_lm

    texts = tiny_hf.sentences("math", 16, seed=2)
    settings = FinetuneSettings(train_patterns=last_mlp_patterns(2, 1), steps=6, lr=3e-3, batch_size=4,
                                max_length=16, seed=0)
    split = finetune_causal_lm(tiny_base, texts, tmp_path / "split", settings, progress=False)
    assert json.loads((tmp_path / "split" / FINETUNE_RECORD).read_text())["split_block"] == 1
    monkeypatch.setattr(finetune_lm, "split_block", lambda model, trained: None)
    full = finetune_causal_lm(tiny_base, texts, tmp_path / "full", settings, progress=False)
    assert json.loads((tmp_path / "full" / FINETUNE_RECORD).read_text())["split_block"] is None
    assert full.losses == pytest.approx(split.losses, rel=1e-4)


def test_training_step_refuses_a_non_finite_loss_before_stepping():
    """The one optimiser step both fine-tunes (LM and text encoder) take: a finite loss steps and is
    recorded; a non-finite one raises the caller's message and leaves the weights untouched."""
    from mergeqp.experiments.finetune_lm import training_step

    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.5)
    losses: list[float] = []
    training_step(opt, (w * w).sum(), losses, lambda v: f"never {v}")
    assert losses == [3.0] and torch.equal(w.detach(), torch.zeros(3))  # w - 0.5 * 2w
    before = w.detach().clone()
    with pytest.raises(ValidationError, match="fine-tune 'x': the loss became nan at step 4"):
        training_step(opt, (w * float("nan")).sum(), losses, lambda v: f"fine-tune 'x': the loss became {v} at step 4")
    assert losses == [3.0] and torch.equal(w.detach(), before)


def test_trainable_names_follow_the_models_order():
    """Names come in the model's order whatever the patterns' order (the experiments take the
    last one as the deepest layer), each once."""
    from mergeqp.experiments.finetune_lm import trainable_names

    model = torch.nn.ModuleDict({"attn": torch.nn.Linear(2, 2), "mlp": torch.nn.Linear(2, 3)})
    assert trainable_names(model, ["mlp.*", "attn.*", "*.weight"]) == ["attn.weight", "attn.bias", "mlp.weight",
                                                                       "mlp.bias"]
    with pytest.raises(ValidationError, match="'norm.*' matches no parameter"):
        trainable_names(model, ["mlp.*", "norm.*"])


@pytest.mark.parametrize("weights_name", ["pytorch_model.bin", "model.pt", "model.safetensors"])
def test_cache_key_covers_every_weight_format(tmp_path, weights_name):
    """Two different checkpoints in folders of the same name get different keys whatever their weight
    format (a ``pytorch_model.bin`` base once had an empty identity: fine-tunes of another base were reused)."""
    from mergeqp.experiments.finetune_lm import finetune_key, weights_identity

    settings = FinetuneSettings(train_patterns=("model.layers.1.*",), steps=1)
    keys = []
    for run, payload in (("run1", b"weights of A"), ("run2", b"other weights of model B")):
        folder = tmp_path / run / "checkpoint-500"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        (folder / weights_name).write_bytes(payload)
        assert weights_name in weights_identity(folder)
        keys.append(finetune_key(folder, ["a text"], settings))
    assert keys[0] != keys[1]
