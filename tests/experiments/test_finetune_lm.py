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
