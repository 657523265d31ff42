"""Targets kept as the fine-tune's final hidden states and its head (:class:`mergeqp.lm.HeadTargets`):
a target batch of every logit (Euclidean, per position) holds ``(B, T, H)`` instead of ``(B, T, V)``
and forms its logits when read. Checked against the targets held whole: the same tensors entry for
entry, the same merges and reports to the last digit, one head copy for fine-tunes that share it,
and the whole targets wherever the logits are not the head of the captured input."""

from __future__ import annotations

import dataclasses
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import mergeqp.lm as lm  # noqa: E402
from mergeqp.config import load_config  # noqa: E402
from mergeqp.io.calibration import load_tokenizer, tokenize_batches  # noqa: E402
from mergeqp.io.checkpoint import open_checkpoint  # noqa: E402
from mergeqp.lm import OutputSpec, target_bytes, teacher_forced_metrics, teacher_forced_targets  # noqa: E402
from mergeqp.run.pipeline import load_model, run_merge  # noqa: E402

WHOLE = 10**9  # a ratio no model reaches: every target held whole


@pytest.fixture(scope="module")
def fam(tiny_hf, tmp_path_factory):
    return tiny_hf.make_family(tmp_path_factory.mktemp("headtargets") / "llama", "llama", K=2, scale=0.3,
                               n_prompts=10)


def _models(fam, dtype=torch.float32):
    base = load_model(open_checkpoint(fam.base), fam.base, dtype, "cpu")
    fts = [load_model(open_checkpoint(f), fam.base, dtype, "cpu") for f in fam.finetuned]
    tok = load_tokenizer(fam.base)
    prompts = [p for p in fam.prompts[0].read_text().splitlines() if p.strip()]
    return base, fts, tokenize_batches(tok, prompts, 10, 4)


def _targets(model, batches, spec, monkeypatch, ratio):
    monkeypatch.setattr(lm.targets, "HEAD_TARGETS_MIN_RATIO", ratio)
    return teacher_forced_targets(model, batches, spec, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kept_targets_are_the_whole_targets_entry_for_entry(fam, monkeypatch, dtype):
    base, (ft, _), batches = _models(fam, dtype)
    spec = OutputSpec()
    kept = _targets(ft, batches, spec, monkeypatch, 1)
    whole = _targets(ft, batches, spec, monkeypatch, WHOLE)
    assert all(tb.source is not None and tb.stored is None and tb.hidden is not None for tb in kept)
    assert all(tb.source is None for tb in whole)
    for a, b in zip(kept, whole):
        assert a.target_shape == tuple(b.target.shape) and a.sample_size == b.sample_size
        assert a.count == b.count and a.entries == b.entries
        assert torch.equal(a.target, b.target)  # formed again by the head: the same float64 entries
        assert a.target.dtype == torch.float64 and a.target.device.type == "cpu"
        # masked positions are zero, as in the whole target
        mask = a.batch.mask
        assert mask is not None and float(a.target[mask == 0].abs().sum()) == 0.0
    V = int(whole[0].target.shape[-1])
    H = int(kept[0].hidden.shape[-1])
    assert sum(map(target_bytes, kept)) * V < sum(map(target_bytes, whole)) * (H + 1)  # hidden, not vocabulary
    # the report's metrics read the same targets
    m_kept, m_whole = (teacher_forced_metrics(base, t, spec, "cpu") for t in (kept, whole))
    assert m_kept == m_whole


def test_fine_tunes_that_share_a_head_share_one_copy(fam, monkeypatch):
    _, (ft1, ft2), batches = _models(fam)
    spec = OutputSpec()
    a = _targets(ft1, batches, spec, monkeypatch, 1)
    b = _targets(ft2, batches, spec, monkeypatch, 1)
    assert len({id(tb.source) for tb in a + b}) == 1  # the fine-tunes changed blocks, not the head
    head = a[0].source
    assert head.weight.data_ptr() != ft1.get_output_embeddings().weight.data_ptr()  # a copy, not the model's
    with torch.no_grad():
        ft2.get_output_embeddings().weight.mul_(1.5)  # another head: its own copy, its own logits
    c = _targets(ft2, batches, spec, monkeypatch, 1)
    assert c[0].source is not head and not torch.equal(c[0].target, b[0].target)
    assert torch.equal(a[0].target, _targets(ft1, batches, spec, monkeypatch, WHOLE)[0].target)  # unchanged


@pytest.mark.parametrize("spec", [OutputSpec(restrict="topk", k=5), OutputSpec(restrict="projection", k=7),
                                  OutputSpec(metric="kl", restrict="topk", k=5), OutputSpec(metric="kl")],
                         ids=lambda s: f"{s.metric}-{s.restrict}")
def test_restricted_or_whitened_outputs_are_held_whole(fam, monkeypatch, spec):
    _, (ft, _), batches = _models(fam)
    assert all(tb.source is None and tb.stored is not None for tb in _targets(ft, batches, spec, monkeypatch, 1))


def test_logits_that_are_not_the_head_of_its_input_are_held_whole(fam, monkeypatch):
    """A model that scales its logits after the head (as soft-capping or a logit scale does): the
    check finds the formed logits are not the model's and keeps the target whole."""
    _, (ft, _), batches = _models(fam)
    forward = ft.forward

    def scaled(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out

    monkeypatch.setattr(ft, "forward", scaled)
    targets = _targets(ft, batches, OutputSpec(), monkeypatch, 1)
    assert all(tb.source is None for tb in targets)
    # and the fold's hidden state is kept only where the spec may fold
    assert _targets(ft, batches, OutputSpec(fold_head=False), monkeypatch, 1)[0].hidden is None


def test_a_target_batch_holds_one_of_its_target_or_its_head(fam, monkeypatch):
    _, (ft, _), batches = _models(fam)
    tb = _targets(ft, batches, OutputSpec(), monkeypatch, 1)[0]
    with pytest.raises(ValueError, match="one of them"):
        lm.TargetBatch(tb.batch)
    with pytest.raises(ValueError, match="one of them"):
        lm.TargetBatch(tb.batch, tb.target, source=tb.source)
    with pytest.raises(ValueError, match="hidden"):
        lm.TargetBatch(tb.batch, source=tb.source)
    with pytest.raises(dataclasses.FrozenInstanceError):
        tb.stored = None


@pytest.mark.parametrize("method", [{"name": "soup"}, {"name": "qp", "mode": "sequential"},
                                    {"name": "qp", "mode": "trust_region"}], ids=lambda m: m.get("mode", m["name"]))
def test_merges_and_reports_are_the_same_with_kept_targets(fam, tmp_path, monkeypatch, method):
    """One config merged with every target held whole and with kept targets: the same written
    tensors and the same report numbers (evaluation, and the QP's objectives), to the last digit."""
    from safetensors.torch import load_file

    reports, tensors, kept = [], [], []
    shared_head = lm.targets._shared_head
    monkeypatch.setattr(lm.targets, "_shared_head", lambda *a: kept.append(1) or shared_head(*a))
    for ratio in (WHOLE, 1):
        monkeypatch.setattr(lm.targets, "HEAD_TARGETS_MIN_RATIO", ratio)
        cfg = load_config(fam.write_config(tmp_path / f"cfg{ratio}.yml", "model.layers.1.mlp.*", method))
        res = run_merge(cfg, tmp_path / f"out{ratio}", progress=False)
        assert bool(kept) == (ratio == 1)  # the first merge held every target whole, the second kept them
        rep = json.loads((res.out_dir / "report.json").read_text())
        reports.append({k: rep[k] for k in ("evaluation", "layers", "groups", "trust_region") if k in rep})
        files = sorted(res.out_dir.glob("*.safetensors"))
        tensors.append({f.name: load_file(str(f)) for f in files})
    assert kept and reports[0]["evaluation"]["merged"]["heldout_mse"]  # evaluated
    _same(reports[0], reports[1])
    assert tensors[0].keys() == tensors[1].keys()
    for name in tensors[0]:
        for key, value in tensors[0][name].items():
            assert torch.equal(value, tensors[1][name][key]), key


def test_kept_targets_that_do_not_fit_are_refused_as_hidden_states(tiny_hf, fam, tmp_path, capsys, monkeypatch):
    """The memory check counts what kept targets hold (hidden states) and names them; its advice
    is then what lowers them (shorter or fewer prompts), not fewer compared outputs."""
    from mergeqp.cli import main
    from mergeqp.run import tasks

    monkeypatch.setattr(lm.targets, "HEAD_TARGETS_MIN_RATIO", 1)
    cfg = fam.write_config(tmp_path / "big.yml", tiny_hf.MLP_LAYER["llama"],
                           {"name": "qp", "mode": "single", "parametrisation": "scalar"},
                           calibration={"batch_size": 2, "holdout": 0})
    monkeypatch.setattr(tasks, "available_memory_bytes", lambda: tasks.TARGETS_MARGIN_BYTES + 100)
    assert main(["merge", str(cfg), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert lm.KEPT_AS_HIDDEN in err and "output.restrict" not in err and "calibration.max_length" in err
    assert not (tmp_path / "o").exists()


def _same(a, b, path="report"):
    """``a == b`` but for times, failing with the first path that differs."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            if "seconds" not in k and k != "timings":  # wall time is the one thing allowed to differ
                _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b)):
            _same(u, v, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def test_the_dry_run_counts_kept_targets_as_hidden_states(tiny_hf, fam, tmp_path, monkeypatch):
    from mergeqp.run.memory_estimate import estimate_memory
    from mergeqp.run.plan import build_plan

    plan = build_plan(load_config(fam.write_config(tmp_path / "c.yml", tiny_hf.MLP_LAYER["llama"], {"name": "qp"})))
    head = plan.skeleton.get_output_embeddings()
    V, H = int(head.out_features), int(head.in_features)
    monkeypatch.setattr(lm.targets, "HEAD_TARGETS_MIN_RATIO", WHOLE)
    whole = estimate_memory(plan)["targets"]
    monkeypatch.setattr(lm.targets, "HEAD_TARGETS_MIN_RATIO", 1)
    kept = estimate_memory(plan)["targets"]
    assert whole > 0 and kept * V == whole * H


@pytest.mark.parametrize("spec", [OutputSpec(), OutputSpec(restrict="topk", k=5), OutputSpec(metric="kl", restrict="topk", k=5),
                                  OutputSpec(pool="mean")], ids=lambda s: f"{s.metric}-{s.restrict}-{s.pool}")
def test_outputs_compared_a_few_samples_at_a_time_give_the_whole_batch_numbers(fam, monkeypatch, spec):
    """:func:`mergeqp.lm.compared_rows` with room for one sample at a time: the squared error and
    the held-out metrics equal the whole batch's (to summation order), and the samples covered
    are every sample once."""
    base, (ft, _), batches = _models(fam, torch.float64)
    targets = teacher_forced_targets(ft, batches, spec, "cpu")
    whole = (lm.squared_error(base, targets, dataclasses.replace(spec, fold_head=False), "cpu"),
             teacher_forced_metrics(base, targets, spec, "cpu"))
    monkeypatch.setattr(lm.objective, "COMPARED_CHUNK_BYTES", 1)
    chunks = list(lm.compared_rows(base, targets[0], spec, "cpu"))
    assert [c[0] for c in chunks] == [slice(i, i + 1) for i in range(targets[0].batch.size)]
    # (a kept target formed one sample at a time: the head's product of fewer rows, equal to rounding)
    assert torch.allclose(torch.cat([c[2] for c in chunks]), targets[0].target, rtol=1e-13, atol=1e-13)
    rows = (lm.squared_error(base, targets, dataclasses.replace(spec, fold_head=False), "cpu"),
            teacher_forced_metrics(base, targets, spec, "cpu"))
    assert rows[0][1] == whole[0][1] and rows[0][0] == pytest.approx(whole[0][0], rel=1e-12)
    for a, b in zip(dataclasses.astuple(rows[1]), dataclasses.astuple(whole[1])):
        assert (a is None) == (b is None) and (a is None or a == pytest.approx(b, rel=1e-12))


def test_formed_logits_must_be_the_models_own_entry_for_entry_on_the_cpu_to_rounding_elsewhere(fam, monkeypatch):
    """(A GPU's head product may differ from the CPU's in the last bits: there the check allows
    float32 rounding; on the CPU, where the same product runs, it asks for equal entries.) The head
    copy lives on the model's device."""
    _, (ft, _), batches = _models(fam)
    tb = _targets(ft, batches, OutputSpec(), monkeypatch, 1)[0]
    assert tb.source.weight.device == ft.get_output_embeddings().weight.device
    y = tb.target
    nudged = y * (1 + 1e-9)
    assert lm.targets._same_target(y, y.clone(), "cpu") and not lm.targets._same_target(nudged, y, "cpu")
    assert lm.targets._same_target(nudged, y, "cuda") and not lm.targets._same_target(y * 1.01, y, "cuda")
