"""A merge with ``output: {metric: kl}`` (the softmax Gauss-Newton metric): a tiny Llama QP merge
runs and certifies, its calibration objective is the whitened squared error recomputed here from
the merged model's logits, and the held-out KL / cross-entropy in its report are those measured
here; config validation of the metric."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from mergeqp.config import load_config, parse_config  # noqa: E402
from mergeqp.errors import ConfigError  # noqa: E402


def _logits(model, batch):
    with torch.no_grad():
        return model(**batch.inputs).logits.to(torch.float64)


def _whitened_sse(x, y, mask):
    """``sum over real tokens of ||F x - F y||^2`` with ``F z = sqrt(p) (z - p'z)``, ``p = softmax(y)``,
    written out here independently of :func:`mergeqp.lm.kl_whiten`."""
    x, y = x[mask.bool()], y[mask.bool()]
    p = torch.softmax(y, dim=-1)
    d = x - y
    fd = p.sqrt() * (d - (p * d).sum(-1, keepdim=True))
    return float((fd * fd).sum())


@pytest.fixture(scope="module")
def llama(tiny_hf, tmp_path_factory):
    return tiny_hf.make_family(tmp_path_factory.mktemp("kl") / "llama", "llama", K=2,
                               perturbed=(tiny_hf.BLOCK_PATTERN["llama"],), scale=0.3, n_prompts=10)


def test_kl_metric_qp_merge(tiny_hf, llama, tmp_path):
    from mergeqp.lm import OutputSpec
    from mergeqp.run.pipeline import load_model, prepare_tasks, run_merge
    from mergeqp.run.plan import build_plan

    fam = llama
    cfg = load_config(fam.write_config(tmp_path / "kl.yml", tiny_hf.MLP_LAYER["llama"],
                                       {"name": "qp", "mode": "single"}, output={"metric": "kl"}))
    assert cfg.output.metric == "kl"
    res = run_merge(cfg, tmp_path / "out", progress=False)
    rep = json.loads((res.out_dir / "report.json").read_text())
    layer = rep["layers"][0]
    assert layer["certificate"]["certified"] is True
    ev = rep["evaluation"]
    assert ev["merged"]["calibration_objective"] < ev["base"]["calibration_objective"]
    assert layer["objective_after_exact"] == pytest.approx(ev["merged"]["calibration_objective"], rel=1e-9)

    # the same prompts, split as the run splits them; logits recomputed here
    plan = build_plan(cfg)
    tasks = prepare_tasks(plan, OutputSpec(), OutputSpec(), torch.float64, "cpu", lambda m: None)
    objective = 0.0
    kl = {}
    ce = {}
    for i, t in enumerate(tasks):
        ft = load_model(plan.finetuned[i], fam.base, torch.float64, "cpu")
        objective += t.weight * sum(_whitened_sse(_logits(res.model, tb.batch), _logits(ft, tb.batch), tb.batch.mask)
                                    for tb in t.calibration)
        total_kl = total_nll = 0.0
        tokens = predicted = 0
        for tb in t.heldout:
            m = tb.batch.mask.bool()
            x, y = _logits(res.model, tb.batch), _logits(ft, tb.batch)
            log_p, log_q = torch.log_softmax(y[m], -1), torch.log_softmax(x[m], -1)
            total_kl += float((log_p.exp() * (log_p - log_q)).sum())
            tokens += int(m.sum())
            ids = tb.batch.inputs["input_ids"]
            for b in range(ids.shape[0]):
                for i in range(ids.shape[1] - 1):
                    if m[b, i] and m[b, i + 1]:
                        total_nll -= float(torch.log_softmax(x[b, i], -1)[ids[b, i + 1]])
                        predicted += 1
        kl[t.name], ce[t.name] = total_kl / tokens, total_nll / predicted
    assert ev["merged"]["calibration_objective"] == pytest.approx(objective, rel=1e-9)
    assert ev["merged"]["heldout_kl"] == pytest.approx(kl, rel=1e-9)
    assert ev["merged"]["heldout_cross_entropy"] == pytest.approx(ce, rel=1e-9)
    for key in ("base", "merged"):
        assert set(ev[key]["heldout_kl"]) == set(ev[key]["heldout_cross_entropy"]) == set(fam.tasks)
    assert "KL " in (res.out_dir / "report.md").read_text()


@pytest.mark.parametrize("output", [{"metric": "kl", "restrict": "topk", "k": 6},
                                    {"metric": "kl", "restrict": "projection", "k": 8}])
def test_kl_metric_with_a_restriction_merges_and_certifies(tiny_hf, llama, tmp_path, output):
    """The restricted KL objectives linearise consistently: the QP's exact objective after the
    merge is the evaluation's calibration objective, and the merge is certified."""
    from mergeqp.run.pipeline import run_merge

    cfg = load_config(llama.write_config(tmp_path / "kl.yml", tiny_hf.MLP_LAYER["llama"],
                                         {"name": "qp", "mode": "single"}, output=output))
    rep = run_merge(cfg, tmp_path / "out", progress=False).report
    layer, ev = rep["layers"][0], rep["evaluation"]
    assert layer["certificate"]["certified"] is True
    assert layer["objective_before"] == pytest.approx(ev["base"]["calibration_objective"], rel=1e-9)
    assert layer["objective_after_exact"] == pytest.approx(ev["merged"]["calibration_objective"], rel=1e-9)
    assert ev["merged"]["calibration_objective"] < ev["base"]["calibration_objective"]


def test_output_metric_validation():
    minimal = {"base": "b", "models": [{"path": "x", "calibration": "c.txt"}], "layers": "m.*"}
    assert parse_config(minimal).output.metric == "euclidean"
    assert parse_config({**minimal, "output": {"metric": "kl", "restrict": "topk", "k": 3}}).output.metric == "kl"
    with pytest.raises(ConfigError) as info:
        parse_config({**minimal, "output": {"metric": "fisher"}})
    assert "output.metric: unknown output metric 'fisher'; valid: euclidean, kl, cross_entropy" in str(info.value)
