"""The calibration objective through the folded head (:func:`mergeqp.lm.objective_fold`): the
squared error of the compared outputs taken from the final hidden states equals the one from the
vocabulary-size logits (every logit, a projection, the top-k, the whitened top-k of the KL
metric), is used only where the fold was verified, and falls back to the logits otherwise."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import mergeqp.lm as lm  # noqa: E402
from mergeqp.io.calibration import load_tokenizer, tokenize_batches  # noqa: E402
from mergeqp.io.checkpoint import open_checkpoint  # noqa: E402
from mergeqp.lm import OutputSpec, squared_error, teacher_forced_targets  # noqa: E402
from mergeqp.run.pipeline import load_model  # noqa: E402

SPECS = [OutputSpec(), OutputSpec(restrict="projection", k=7), OutputSpec(restrict="topk", k=5),
         OutputSpec(metric="kl", restrict="topk", k=5)]


@pytest.fixture(scope="module")
def fam(tiny_hf, tmp_path_factory):
    return tiny_hf.make_family(tmp_path_factory.mktemp("fold") / "llama", "llama", K=1, scale=0.3, n_prompts=8)


def _setup(fam, dtype):
    base = load_model(open_checkpoint(fam.base), fam.base, dtype, "cpu")
    ft = load_model(open_checkpoint(fam.finetuned[0]), fam.base, dtype, "cpu")
    tok = load_tokenizer(fam.base)
    prompts = [p for p in fam.prompts[0].read_text().splitlines() if p.strip()]
    return base, ft, tokenize_batches(tok, prompts, 10, 4)


@pytest.mark.parametrize("dtype, rel", [(torch.float64, 1e-11), (torch.float32, 1e-5)])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.metric}-{s.restrict}")
def test_folded_objective_equals_the_logits_objective(fam, monkeypatch, spec, dtype, rel):
    base, ft, batches = _setup(fam, dtype)
    targets = teacher_forced_targets(ft, batches, spec, "cpu")
    assert all(tb.hidden is not None for tb in targets)
    unfolded = squared_error(base, targets, dataclasses.replace(spec, fold_head=False), "cpu")
    calls = []
    monkeypatch.setattr(lm.objective, "compared_rows", lambda *a: calls.append(1) or [])  # the logits path is not taken
    folded = squared_error(base, targets, spec, "cpu")
    assert not calls and lm.objective_fold(base, spec, targets, "cpu") is not None
    assert folded[1] == unfolded[1]  # the same compared entries
    assert folded[0] == pytest.approx(unfolded[0], rel=rel)
    assert folded[0] > 0


def test_a_head_that_does_not_match_the_targets_is_not_folded(fam):
    """Targets of a model whose head differs from this model's: the fold's check refuses, the
    objective comes from the logits (and the refusal is remembered, not re-checked)."""
    base, ft, batches = _setup(fam, torch.float64)
    spec = OutputSpec()
    with torch.no_grad():
        ft.get_output_embeddings().weight.mul_(1.5)
    targets = teacher_forced_targets(ft, batches, spec, "cpu")
    assert lm.objective_fold(base, spec, targets, "cpu") is None
    value = squared_error(base, targets, spec, "cpu")
    assert value == squared_error(base, targets, dataclasses.replace(spec, fold_head=False), "cpu")
    assert len(lm.objective._OBJECTIVE_FOLD_REFUSED[base]) == 1


def test_the_reason_a_vit_head_is_not_folded_is_the_true_one():
    """(stop 55 review) ViT's classifier is an nn.Linear, but the model declares no output embeddings:
    the note said "the model's output head is not an nn.Linear"."""
    import transformers

    from mergeqp.lm import OutputSpec, fold_decision

    cfg = transformers.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                 image_size=8, patch_size=4, num_channels=1, num_labels=3)
    model = transformers.ViTForImageClassification(cfg).eval()
    assert isinstance(model.classifier, torch.nn.Linear)
    fold, reason = fold_decision(model, OutputSpec(field="logits"), [], "cpu")
    assert fold is None and reason == "the model declares no output head (get_output_embeddings() is None)"
