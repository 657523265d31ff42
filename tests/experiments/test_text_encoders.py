"""The text experiment's cached-block shortcut on encoders other than BERT: the pooled embedding
from cached inputs of a block (with every argument the block received) equals the full model's
mean-pooled last hidden state, batch by batch and text by text, on BERT, DistilBERT
(``transformer.layer``), RoBERTa, ELECTRA, MPNet (a position bias given to every block) and
DeBERTa-v2."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mergeqp.errors import ValidationError  # noqa: E402
from mergeqp.experiments.text_encoder import (  # noqa: E402
    block_inputs,
    block_prefix,
    first_trained_block,
    run_top,
)

ENCODERS = {
    "bert": ("BertConfig", {"hidden_size": 16, "num_hidden_layers": 3, "num_attention_heads": 2,
                            "intermediate_size": 32}, "encoder.layer"),
    "distilbert": ("DistilBertConfig", {"dim": 16, "n_layers": 3, "n_heads": 2, "hidden_dim": 32},
                   "transformer.layer"),
    "roberta": ("RobertaConfig", {"hidden_size": 16, "num_hidden_layers": 3, "num_attention_heads": 2,
                                  "intermediate_size": 32, "pad_token_id": 0}, "encoder.layer"),
    "electra": ("ElectraConfig", {"hidden_size": 16, "embedding_size": 16, "num_hidden_layers": 3,
                                  "num_attention_heads": 2, "intermediate_size": 32}, "encoder.layer"),
    "mpnet": ("MPNetConfig", {"hidden_size": 16, "num_hidden_layers": 3, "num_attention_heads": 2,
                              "intermediate_size": 32, "pad_token_id": 0}, "encoder.layer"),
    "deberta_v2": ("DebertaV2Config", {"hidden_size": 16, "num_hidden_layers": 3, "num_attention_heads": 2,
                                       "intermediate_size": 32, "relative_attention": True,
                                       "position_buckets": 8, "max_relative_positions": 16}, "encoder.layer"),
}


@pytest.fixture(scope="module")
def tokenizer(tiny_hf, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    tiny_hf.build_tokenizer(folder)
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def _encoder(name: str, vocab: int):
    config_class, settings, _ = ENCODERS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(vocab_size=vocab, max_position_embeddings=64, **settings)
    model = transformers.AutoModel.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    return model


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_cached_block_inputs_give_the_full_models_embedding(name, tiny_hf, tokenizer):
    model = _encoder(name, len(tiny_hf.vocab()))
    assert block_prefix(model) == ENCODERS[name][2]
    texts = tiny_hf.sentences("story", 7, seed=4, length=(2, 11))
    labels = np.arange(7) % 2
    with torch.no_grad():
        enc = tokenizer(texts, return_tensors="pt", padding=True)
        hidden = model(**enc).last_hidden_state
        m = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        full = (hidden * m).sum(1) / m.sum(1)
        for first in (1, 2):
            batches = block_inputs(model, tokenizer, texts, labels, first, max_length=16, batch_size=3)
            assert len({int(b.attention_mask.shape[1]) for b in batches}) > 1  # padding differs per batch
            for b in batches:
                got = run_top(model, b, first)
                np.testing.assert_allclose(got.numpy(), full[b.rows].numpy(), atol=1e-5, rtol=0)
                for i in range(b.size):  # one text alone, cut to its own tokens (the Fisher's per-text pass)
                    np.testing.assert_allclose(run_top(model, b.sample(i), first).numpy(), got[i:i + 1].numpy(),
                                               atol=1e-5, rtol=0)


def test_first_trained_block_reads_the_models_prefix():
    assert first_trained_block(["transformer.layer.4.ffn.lin2.weight", "transformer.layer.5.ffn.lin1.bias"],
                               "transformer.layer") == 4
    assert first_trained_block(["encoder.layer.2.output.dense.weight"]) == 2
    with pytest.raises(ValidationError, match=r"not inside transformer.layer.<i>"):
        first_trained_block(["encoder.layer.2.output.dense.weight"], "transformer.layer")


def test_the_text_experiment_runs_on_distilbert(tiny_hf, tmp_path):
    """End to end on a tiny DistilBERT (blocks ``transformer.layer``, MLP ``ffn.lin1`` / ``ffn.lin2``),
    its last block's output projection named with ``{last}``."""
    from dataclasses import replace

    from mergeqp.experiments.text import run_text_experiment

    from .test_text_experiment import synthetic_tasks, tiny_config

    config = transformers.DistilBertConfig(vocab_size=len(tiny_hf.vocab()), dim=16, n_layers=2, n_heads=2,
                                           hidden_dim=32, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    transformers.DistilBertModel(config).save_pretrained(str(tmp_path / "base"))
    tiny_hf.build_tokenizer(tmp_path / "base")
    cfg = replace(tiny_config(), train_patterns=("transformer.layer.{last}.ffn.lin2.*",), ranks=(1,), bases=("svd",))
    results = run_text_experiment(str(tmp_path / "out"), tasks=synthetic_tasks(tiny_hf), base_folder=tmp_path / "base",
                                  cache_dir=str(tmp_path / "cache"), config=cfg, threads=1, figures=False,
                                  progress=False)
    assert results["layers"] == ["transformer.layer.1.ffn.lin2"]
    for name, m in results["methods"].items():
        assert 0 <= m["test"]["mean"]["accuracy"] <= 1 and np.isfinite(m["test"]["mean"]["mse"]), name
    assert results["references"]["finetuned"]["test"]["mean"]["mse"] == pytest.approx(0.0, abs=1e-12)


def test_a_folder_that_is_not_an_encoder_is_named(tmp_path):
    from mergeqp.experiments.text_encoder import load_encoder

    (tmp_path / "config.json").write_text('{"model_type": "no-such-model"}')
    with pytest.raises(ValidationError, match=r"cannot load an encoder from .*no-such-model|cannot load an encoder"):
        load_encoder(tmp_path)
