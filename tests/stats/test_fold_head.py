"""Folding a linear head into the output metric (``OutputSpec.fold_head``, :class:`mergeqp.lm.FoldedHead`):
on a tiny float64 Llama the first-order statistics through the folded head equal those of the
unfolded ``(B, T, V)`` logits for every foldable output (Euclidean none / projection / topk, KL
topk); what cannot be folded is refused with ``fold_head: true`` and falls back under auto."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from mergeqp.errors import ValidationError  # noqa: E402
from mergeqp.lm import OutputSpec, teacher_forced_targets  # noqa: E402
from mergeqp.merge.firstorder import SiteAtoms, TaskTargets, collect_first_order  # noqa: E402


@pytest.fixture(scope="module")
def llama(tiny_hf, tmp_path_factory):
    from mergeqp.io.calibration import load_tokenizer, read_prompts, tokenize_batches
    from mergeqp.io.checkpoint import open_checkpoint
    from mergeqp.merge.multilayer import WeightSource
    from mergeqp.merge.sites import match_sites, model_sites
    from mergeqp.stats.parametrisation import as_parametrisation

    fam = tiny_hf.make_family(tmp_path_factory.mktemp("fold") / "llama", "llama", K=2, n_prompts=6)
    cls = tiny_hf.auto_class("llama")
    model = cls.from_pretrained(str(fam.base), dtype=torch.float64).eval()
    fts = [cls.from_pretrained(str(p), dtype=torch.float64).eval() for p in fam.finetuned]
    batches = tokenize_batches(load_tokenizer(fam.base), read_prompts(fam.prompts[0])[:5], 10, 3)
    sites = match_sites(model_sites(model), [tiny_hf.MLP_LAYER["llama"]])
    src = WeightSource(open_checkpoint(fam.base), [open_checkpoint(p) for p in fam.finetuned])
    atoms = [SiteAtoms(s, as_parametrisation("rows"), src.deltas(s), 0.01 * src.deltas(s)[0]) for s in sites]
    return model, fts, batches, atoms


def _stats(llama, spec, jacobian_mode="forward"):
    model, fts, batches, atoms = llama
    tasks = [TaskTargets(f"t{i}", 1.0, teacher_forced_targets(ft, batches, spec, "cpu")) for i, ft in enumerate(fts)]
    return collect_first_order(model, atoms, tasks, spec, jacobian_mode=jacobian_mode)


def _same(got, ref):
    np.testing.assert_allclose(got.H, ref.H, rtol=1e-9, atol=1e-11 * np.abs(ref.H).max())
    np.testing.assert_allclose(got.g, ref.g, rtol=1e-9, atol=1e-11 * np.abs(ref.g).max())
    np.testing.assert_allclose(got.c, ref.c, rtol=1e-10)
    for e_got, e_ref in zip(got.energy, ref.energy):
        assert e_got.keys() == e_ref.keys()
        for key in e_ref:
            assert e_got[key] == pytest.approx(e_ref[key], rel=1e-8, abs=1e-12 * e_ref["total"])


@pytest.mark.parametrize("restrict, k, metric", [("none", None, "euclidean"), ("projection", 5, "euclidean"),
                                                 ("projection", 24, "euclidean"), ("topk", 4, "euclidean"),
                                                 ("topk", 4, "kl")])
def test_folded_statistics_equal_the_unfolded_ones(llama, restrict, k, metric):
    model = llama[0]
    H = int(model.config.hidden_size)
    ref = _stats(llama, OutputSpec(restrict=restrict, k=k, metric=metric, seed=3, fold_head=False))
    got = _stats(llama, OutputSpec(restrict=restrict, k=k, metric=metric, seed=3, fold_head=True))
    assert "folded_head_width" not in ref.metadata
    width = got.metadata["folded_head_width"]
    assert width == (min(k, H) if k is not None else H)  # the tiny head has full column rank
    _same(got, ref)
    auto = _stats(llama, OutputSpec(restrict=restrict, k=k, metric=metric, seed=3))
    assert auto.metadata["folded_head_width"] == width
    _same(auto, ref)


def test_folded_statistics_agree_in_reverse_mode(llama):
    """Forward and reverse mode agree to float32 rounding (Llama's RMSNorm computes in float32
    even in a float64 model, so its derivatives carry float32 rounding)."""
    spec = OutputSpec(restrict="projection", k=3, fold_head=True)
    got, ref = _stats(llama, spec, "reverse"), _stats(llama, spec, "forward")
    assert got.metadata["folded_head_width"] == ref.metadata["folded_head_width"] == 3
    for a, b in ((got.H, ref.H), (got.g, ref.g), (got.c, ref.c)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())


def test_kl_over_the_whole_vocabulary_is_not_folded(llama):
    with pytest.raises(ValidationError, match="fold_head: true.*kl metric"):
        _stats(llama, OutputSpec(metric="kl", fold_head=True))
    assert "folded_head_width" not in _stats(llama, OutputSpec(metric="kl")).metadata


def test_a_fine_tune_with_another_head_is_refused_or_not_folded(llama):
    model, fts, batches, atoms = llama
    other = type(fts[0])(fts[0].config).to(torch.float64).eval()
    other.load_state_dict(fts[0].state_dict())
    with torch.no_grad():
        other.lm_head.weight.add_(0.01 * torch.randn_like(other.lm_head.weight))
        other.model.embed_tokens.weight.copy_(fts[0].model.embed_tokens.weight)  # untie: only the head differs
    spec = OutputSpec(fold_head=True)
    tasks = [TaskTargets("t", 1.0, teacher_forced_targets(other, batches, spec, "cpu"))]
    with pytest.raises(ValidationError, match="head differs"):
        collect_first_order(model, atoms, tasks, spec)
    auto = OutputSpec()
    tasks = [TaskTargets("t", 1.0, teacher_forced_targets(other, batches, auto, "cpu"))]
    got = collect_first_order(model, atoms, tasks, auto)
    assert "folded_head_width" not in got.metadata
    assert got.metadata["head_not_folded"].startswith("target batch 0 of model 't':")  # names the model (stop 50)
    assert "head differs" in got.metadata["head_not_folded"]  # the run layer's note says why
    _same(got, collect_first_order(model, atoms, tasks, OutputSpec(fold_head=False)))


def _with_head(fine_tune, weight):
    other = type(fine_tune)(fine_tune.config).to(torch.float64).eval()
    other.load_state_dict(fine_tune.state_dict())
    with torch.no_grad():
        other.lm_head.weight.copy_(weight)
        other.model.embed_tokens.weight.copy_(fine_tune.model.embed_tokens.weight)  # untie: only the head differs
    return other


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
@pytest.mark.parametrize("restrict, k", [("none", None), ("topk", 4)])
def test_a_fine_tune_saved_in_lower_precision_shares_the_bases_head(llama, low, restrict, k):
    """(stop 50) A fine-tune saved in bfloat16 from a float32 base holds the base's head rounded: folding
    was silently abandoned under auto (the unfolded statistics were then refused for memory, 43.9 GiB,
    without saying why). The rounded head now counts as the base's, for targets kept as hidden states
    and for targets held whole (top-k)."""
    model, fts, batches, atoms = llama
    spec = OutputSpec(restrict=restrict, k=k)
    rounded = _with_head(fts[0], model.lm_head.weight.to(getattr(torch, low)).to(torch.float64))
    assert not torch.equal(rounded.lm_head.weight, model.lm_head.weight)
    tasks = [TaskTargets("t", 1.0, teacher_forced_targets(rounded, batches, spec, "cpu"))]
    got = collect_first_order(model, atoms, tasks, spec)
    assert "folded_head_width" in got.metadata and "head_not_folded" not in got.metadata
    # a head that differs by more than a rounding is still another head
    nudged = _with_head(fts[0], model.lm_head.weight.to(getattr(torch, low)).to(torch.float64) * (1 + 2 ** -6))
    tasks = [TaskTargets("t", 1.0, teacher_forced_targets(nudged, batches, spec, "cpu"))]
    assert "folded_head_width" not in collect_first_order(model, atoms, tasks, spec).metadata


def test_a_memory_refusal_of_unfolded_statistics_says_why_the_head_was_not_folded(llama, monkeypatch):
    from mergeqp.io import memory

    model, fts, batches, atoms = llama
    other = _with_head(fts[0], model.lm_head.weight + 0.01)
    tasks = [TaskTargets("t", 1.0, teacher_forced_targets(other, batches, OutputSpec(), "cpu"))]
    monkeypatch.setattr(memory, "available_memory_bytes", lambda *a, **k: 200_000)
    with pytest.raises(ValidationError, match=r"fold_head: auto did not fold the model's head .*head differs"):
        collect_first_order(model, atoms, tasks, OutputSpec())


def test_the_fold_is_checked_once_per_model_head_and_target_and_again_after_the_head_changes(llama, monkeypatch):
    """Sequential, hybrid and trust-region merges collect statistics many times on one model with
    the same targets: the fold's check (two full forward passes) runs once; a head written in
    place is checked again, so a head that no longer matches the targets is still refused."""
    import copy

    import mergeqp.lm as lm

    model, fts, batches, atoms = llama
    model = copy.deepcopy(model)
    spec = OutputSpec(fold_head=True)
    tasks = [TaskTargets("t", 1.0, teacher_forced_targets(fts[0], batches, spec, "cpu"))]
    checks = []
    real, same = lm.fold.agree, lm.HeadTargets.same_as
    monkeypatch.setattr(lm.fold, "agree", lambda *a: checks.append(1) or real(*a))
    # (a target kept as hidden states is checked by comparing its head with the model's)
    monkeypatch.setattr(lm.HeadTargets, "same_as", lambda *a, **k: checks.append(1) or same(*a, **k))
    first = collect_first_order(model, atoms, tasks, spec)
    n_first = len(checks)
    # the model's logits, then every target batch held whole, and one head comparison per head copy of
    # the targets kept as hidden states
    kept = {id(tb.source) for tb in tasks[0].batches if tb.source is not None}
    assert n_first == 1 + sum(tb.source is None for tb in tasks[0].batches) + len(kept)
    again = collect_first_order(model, atoms, tasks, spec)
    assert len(checks) == n_first
    _same(again, first)
    with torch.no_grad():
        model.lm_head.weight.add_(0.01 * torch.randn_like(model.lm_head.weight))
    with pytest.raises(ValidationError, match="head differs"):
        collect_first_order(model, atoms, tasks, spec)
    assert len(checks) > n_first


def test_a_merge_site_in_the_head_is_not_folded(llama):
    from mergeqp.merge.sites import match_sites, model_sites
    from mergeqp.stats.parametrisation import as_parametrisation

    model, fts, batches, _ = llama
    site = match_sites(model_sites(model), ["lm_head"])[0]
    deltas = torch.stack([ft.lm_head.weight.detach() - model.lm_head.weight.detach() for ft in fts]).double()
    atoms = [SiteAtoms(site, as_parametrisation("scalar"), deltas)]
    spec = OutputSpec(fold_head=True)
    tasks = [TaskTargets("t", 1.0, teacher_forced_targets(fts[0], batches, spec, "cpu"))]
    with pytest.raises(ValidationError, match="outside the backbone"):
        collect_first_order(model, atoms, tasks, spec)


def test_fold_head_values_are_checked():
    with pytest.raises(ValidationError, match="fold_head"):
        OutputSpec(fold_head="sometimes")


def test_sketch_keeps_g_and_c_exact_and_estimates_h_without_bias(llama):
    """With ``sketch: s`` each sample's outputs are combined by its own Gaussian ``S_j``: g and c
    are those of the unsketched statistics, and H is an unbiased estimate: the mean over 16
    seeds is much closer to the unsketched H than a single draw (about 1/4 as far)."""
    ref = _stats(llama, OutputSpec(fold_head=True))
    singles, draws = [], []
    scale = np.linalg.norm(ref.H)
    for seed in range(16):
        got = _stats(llama, OutputSpec(fold_head=True, sketch=6, seed=seed), "reverse" if seed % 2 else "forward")
        assert got.metadata["sketch"] == 6
        np.testing.assert_allclose(got.g, ref.g, rtol=0, atol=1e-6 * np.abs(ref.g).max())
        np.testing.assert_allclose(got.c, ref.c, rtol=1e-10)
        singles.append(np.linalg.norm(got.H - ref.H) / scale)
        draws.append(got.H)
    single = float(np.mean(singles))
    assert single > 1e-3  # a sketch, not the exact Hessian
    assert np.linalg.norm(np.mean(draws, axis=0) - ref.H) / scale < 0.5 * single


def test_sketched_statistics_agree_in_forward_and_reverse_mode(llama):
    """The same seed draws the same sketch: reverse mode (its rows pulled back as cotangents) and
    forward mode (JVPs, then the rows) agree to float32 rounding, as unsketched (RMSNorm)."""
    spec = OutputSpec(fold_head=True, sketch=6, seed=3)
    got, ref = _stats(llama, spec, "reverse"), _stats(llama, spec, "forward")
    for a, b in ((got.H, ref.H), (got.g, ref.g), (got.c, ref.c)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())


def test_sketch_values_are_checked():
    for bad in (0, 2.5, True):
        with pytest.raises(ValidationError, match="sketch"):
            OutputSpec(sketch=bad)


def test_a_design_larger_than_the_available_memory_is_refused_before_it_is_built(llama, monkeypatch):
    """The first batch's design A (prompts x compared outputs x atoms, with its float64 copies) is
    checked against the machine's available memory before any derivative is taken."""
    import mergeqp.merge.firstorder as fo

    spec = OutputSpec()
    monkeypatch.setattr(fo, "available_memory_bytes", lambda: 10_000)
    # 9.8 KiB: not one prompt's 160 outputs x 32 atoms, nor 3 prompts sketched to one output each
    # (the sketch's own 3 x 160 float64 entries and their copy): the advice without numbers
    with pytest.raises(ValidationError, match=r"needs about .* [KMGT]?i?B, more than the 9.8 KiB of memory available\. "
                                              r"Lower calibration.batch_size, compare fewer outputs \(.*sketch: s\}\), "):
        _stats(llama, spec)
    monkeypatch.setattr(fo, "available_memory_bytes", lambda: None)  # unknown: no check
    assert np.isfinite(_stats(llama, spec).H).all()


def test_design_memory_counts_the_design_and_its_copies():
    from mergeqp.merge.firstorder import DESIGN_COPIES_FLOAT64, check_design_memory

    need = 32 * 18432 * 1536 * (4 + 8 * DESIGN_COPIES_FLOAT64)  # the text experiment's exact objective: ~25 GB
    check_design_memory(32, 18432, 1536, 4, ["encoder.layer.5.output.dense"], available=need)
    with pytest.raises(ValidationError, match=r"encoder.layer.5.output.dense: .*32 prompts x 18432 compared outputs"):
        check_design_memory(32, 18432, 1536, 4, ["encoder.layer.5.output.dense"], available=need - 1)
    # what fits, each changed alone: a quarter of the memory holds 8 prompts' designs; a sketch of s
    # outputs needs the design (32 x s x 1536) and the sketch (32 x s x 18432, float64 and float32),
    # 750 by memory, and at most 2^28 sketch entries per batch: 455
    free = need // 4
    with pytest.raises(ValidationError, match=r"batch_size \(the design alone fits with at most 8\).*"
                                              r"sketch: s\}: the design and the sketch fit with s at most 455\)"):
        check_design_memory(32, 18432, 1536, 4, ["encoder.layer.5.output.dense"], available=free)
    check_design_memory(8, 18432, 1536, 4, ["x"], available=free)  # 8 prompts fit, 9 do not
    with pytest.raises(ValidationError):
        check_design_memory(9, 18432, 1536, 4, ["x"], available=free)
    assert free // (32 * (1536 * 28 + 18432 * 12)) == 750 and 32 * 455 * 18432 <= 2**28 < 32 * 456 * 18432
    # not even one prompt with one output fits: no numbers, the advice alone
    with pytest.raises(ValidationError, match=r"than the .* available\. Lower calibration.batch_size, compare"):
        check_design_memory(32, 18432, 1536, 4, ["x"], available=1536 * 28 - 1)
