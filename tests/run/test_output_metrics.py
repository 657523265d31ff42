"""The output-metric registry (``mergeqp.output_metrics``): a user's whitening metric is what the
merge optimises (a copy of ``kl`` registered under another name merges to the built-in's
objective and coefficients; a tempered KL's calibration objective is recomputed here from the
logits), it reaches the config, the head fold and the report through its entry, and what a
metric cannot be is refused at registration or in the config, naming it."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from mergeqp.config import load_config, parse_config  # noqa: E402
from mergeqp.errors import ConfigError, ValidationError  # noqa: E402
from mergeqp.lm import OutputSpec  # noqa: E402
from mergeqp.output_metrics import OUTPUT_METRICS, OutputMetric, register_output_metric  # noqa: E402

TEMPERATURE = 2.0


def _softmax(y):
    return torch.softmax(y.to(torch.float64), dim=-1)


def _centred(x, p):
    """``sqrt(p) (x - p'x)``, written here apart from ``mergeqp.output_metrics.kl_whiten``."""
    p = p.to(x.dtype)
    return p.sqrt() * (x - (p * x).sum(-1, keepdim=True))


def _tempered_distribution(y):
    return torch.softmax(y.to(torch.float64) / TEMPERATURE, dim=-1)


def _tempered_whiten(x, p):
    return _centred(x, p) / TEMPERATURE


@pytest.fixture(scope="module")
def user_metrics():
    made = [register_output_metric(OutputMetric("test_kl_copy", "kl, written by a user", distribution=_softmax,
                                                 whiten=_centred)),
            register_output_metric(OutputMetric("test_tempered_kl", "KL of the tempered distributions",
                                                distribution=_tempered_distribution, whiten=_tempered_whiten))]
    yield made
    for m in made:
        OUTPUT_METRICS.pop(m.name, None)


@pytest.fixture(scope="module")
def llama(tiny_hf, tmp_path_factory):
    return tiny_hf.make_family(tmp_path_factory.mktemp("metrics") / "llama", "llama", K=2,
                               perturbed=(tiny_hf.BLOCK_PATTERN["llama"],), scale=0.3, n_prompts=10)


def _merge(tiny_hf, fam, tmp_path, name, output):
    from mergeqp.run.pipeline import run_merge

    cfg = load_config(fam.write_config(tmp_path / f"{name}.yml", tiny_hf.MLP_LAYER["llama"],
                                       {"name": "qp", "mode": "single"}, output=output))
    return run_merge(cfg, tmp_path / name, progress=False)


@pytest.mark.parametrize("restrict", [{}, {"restrict": "topk", "k": 6, "fold_head": True}])
def test_a_users_copy_of_kl_merges_as_the_builtin(tiny_hf, llama, tmp_path, user_metrics, restrict):
    """Every logit (no fold) and top k (``fold_head: true``: the entry's map is applied to the folded
    outputs, or the run fails): the same objective, coefficients and certificate as ``metric: kl``."""
    builtin = _merge(tiny_hf, llama, tmp_path, "kl", {"metric": "kl", **restrict}).report
    user = _merge(tiny_hf, llama, tmp_path, "copy", {"metric": "test_kl_copy", **restrict}).report
    for a, b in zip(builtin["layers"], user["layers"]):
        assert b["certificate"]["certified"] is True
        assert b["objective_after_exact"] == pytest.approx(a["objective_after_exact"], rel=1e-9)
        assert b["objective_before"] == pytest.approx(a["objective_before"], rel=1e-9)
    assert user["evaluation"]["merged"]["calibration_objective"] == pytest.approx(
        builtin["evaluation"]["merged"]["calibration_objective"], rel=1e-9)


def test_a_tempered_kl_is_what_the_merge_optimises(tiny_hf, llama, tmp_path, user_metrics):
    """The calibration objective reported for a user's metric is ``sum ||F x - F y||^2`` with its own
    ``F``, recomputed here from the merged and fine-tuned models' logits; the QP's exact objective
    after the merge equals it; the merge lowers it and is certified; the report words it generically."""
    from mergeqp.run.pipeline import load_model, prepare_tasks
    from mergeqp.run.plan import build_plan

    res = _merge(tiny_hf, llama, tmp_path, "tempered", {"metric": "test_tempered_kl"})
    rep = json.loads((res.out_dir / "report.json").read_text())
    layer, ev = rep["layers"][0], rep["evaluation"]
    assert layer["certificate"]["certified"] is True
    assert ev["merged"]["calibration_objective"] < ev["base"]["calibration_objective"]
    assert layer["objective_after_exact"] == pytest.approx(ev["merged"]["calibration_objective"], rel=1e-9)

    cfg = load_config(res.out_dir.parent / "tempered.yml")
    plan = build_plan(cfg)
    tasks = prepare_tasks(plan, OutputSpec(), OutputSpec(), torch.float64, "cpu", lambda m: None)
    objective = 0.0
    for i, t in enumerate(tasks):
        ft = load_model(plan.finetuned[i], llama.base, torch.float64, "cpu")
        for tb in t.calibration:
            with torch.no_grad():
                x = res.model(**tb.batch.inputs).logits.to(torch.float64)
                y = ft(**tb.batch.inputs).logits.to(torch.float64)
            m = tb.batch.mask.bool()
            p = torch.softmax(y[m] / TEMPERATURE, dim=-1)
            d = x[m] - y[m]
            fd = p.sqrt() * (d - (p * d).sum(-1, keepdim=True)) / TEMPERATURE
            objective += t.weight * float((fd * fd).sum())
    assert ev["merged"]["calibration_objective"] == pytest.approx(objective, rel=1e-9)
    text = (res.out_dir / "report.md").read_text()
    assert "metric `test_tempered_kl`" in text and "under the test_tempered_kl metric" in text


def test_a_users_metric_in_a_config_and_its_refusals(user_metrics):
    minimal = {"base": "b", "models": [{"path": "x", "calibration": "c.txt"}], "layers": "m.*"}
    assert parse_config({**minimal, "output": {"metric": "test_tempered_kl"}}).output.metric == "test_tempered_kl"
    with pytest.raises(ConfigError, match=r"unknown output metric 'test_tempered'.*did you mean.*test_tempered_kl"):
        parse_config({**minimal, "output": {"metric": "test_tempered"}})
    with pytest.raises(ConfigError, match=r"pool: mean needs metric: euclidean or another that takes it "
                                          r"\(euclidean, cross_entropy\), not test_tempered_kl"):
        parse_config({**minimal, "output": {"metric": "test_tempered_kl", "pool": "mean"}})
    with pytest.raises(ConfigError, match="takes metric: euclidean"):
        parse_config({**minimal, "output": {"metric": "test_tempered_kl", "restrict": "projection",
                                            "matrix": "m.npy"}})
    # the head folds a whitening metric only through its top k, as for kl
    assert "vocabulary-size metric" in OutputSpec(metric="test_tempered_kl").fold_obstacle()
    assert OutputSpec(metric="test_tempered_kl", restrict="topk", k=3).fold_obstacle() is None
    with pytest.raises(ValidationError, match="unknown output metric 'nope'; valid: euclidean, kl, cross_entropy"):
        OutputSpec(metric="nope")


def _whiten_ok(x, p):
    return x * p.to(x.dtype)


def _numpy_whiten(x, p):
    import numpy as np

    return torch.from_numpy(np.asarray(x.detach()) * np.asarray(p))


def _mixing(x, p):
    return x + x.roll(1, dims=1)


@pytest.mark.parametrize("metric, match", [
    (OutputMetric("kl", "again", distribution=_softmax, whiten=_whiten_ok), "output metric 'kl' is already registered"),
    (OutputMetric("my metric", "spaces", distribution=_softmax, whiten=_whiten_ok), "without ':' or spaces"),
    (OutputMetric("labels", "data", distribution=_softmax, whiten=_whiten_ok, scores_data=True),
     "only the built-in cross_entropy"),
    (OutputMetric("half", "no distribution", whiten=_whiten_ok), "give both distribution"),
    (OutputMetric("pooled", "pools", distribution=_softmax, whiten=_whiten_ok, pools=("none", "mean")),
     "takes pool 'none' only"),
    (OutputMetric("nopools", "pools", distribution=_softmax, whiten=_whiten_ok, pools=()), "takes pool 'none' only"),
    (OutputMetric("strpools", "pools", distribution=_softmax, whiten=_whiten_ok, pools="none"),
     r"pools 'none': .*\(pools=\('none',\)\)"),
    (OutputMetric("squares", "not linear", distribution=_softmax, whiten=lambda x, p: x * x), "not linear in x"),
    (OutputMetric("nanlinear", "NaN hides it", distribution=lambda y: torch.log_softmax(y, -1),
                  whiten=lambda x, p: p.sqrt() * x * x), "NaN or inf entries on finite inputs"),
    (OutputMetric("narrow", "shape", distribution=lambda y: y[..., :2], whiten=_whiten_ok),
     r"distribution\(target\) on a target of shape \(2, 3, 5\) returned Tensor of shape \(2, 3, 2\)"),
    (OutputMetric("infdist", "inf", distribution=lambda y: y / 0.0, whiten=_whiten_ok), "has NaN or inf entries"),
    (OutputMetric("raises", "raises", distribution=_softmax, whiten=lambda x, p: 1 / 0),
     r"whiten\(x, aux\) failed on x of shape \(2, 3, 5\): ZeroDivisionError"),
    (OutputMetric("float32", "dtype", distribution=_softmax, whiten=lambda x, p: (x * p).float()),
     "must return a tensor of x's dtype \\(torch.float64\\), got torch.float32"),
    (OutputMetric("mixing", "positions", distribution=_softmax, whiten=_mixing), "mixes positions"),
    (OutputMetric("numpy", "not torch", distribution=_softmax, whiten=_numpy_whiten), "not differentiable in x"),
    (OutputMetric("notcall", "bad", distribution=_softmax, whiten=3), "must be callable"),
    (OutputMetric("trusted", "bad", distribution=_softmax, whiten=_whiten_ok, builtin=True), "builtin=True is for"),
    (OutputMetric("heldout1", "report", distribution=_softmax, whiten=_whiten_ok, heldout=(("KL", "heldout_mine"),)),
     "heldout must be pairs \\(label, measure\\) with a measure of heldout_mse, heldout_kl"),
    (OutputMetric("heldout2", "report", distribution=_softmax, whiten=_whiten_ok, heldout=("KL", "heldout_kl")),
     "heldout must be pairs"),
    (OutputMetric("regress", "report", distribution=_softmax, whiten=_whiten_ok, regression=("heldout_kl",)),
     "regression must be None or \\(measure, words\\)"),
])
def test_what_cannot_be_a_metric_is_refused_at_registration(metric, match):
    with pytest.raises(ValidationError, match=match):
        register_output_metric(metric)
    assert metric.name == "kl" or metric.name not in OUTPUT_METRICS
    with pytest.raises(ValidationError, match="expects an OutputMetric"):
        register_output_metric("kl")


def test_a_users_map_that_fails_on_real_data_is_named_not_blamed_on_the_model(tiny_hf, llama, tmp_path):
    """The probe passes maps that fail only at a vocabulary's size (here above 8 entries): the run's
    error names the metric and its map, not the model's inputs; a distribution that is not finite
    there is refused the same way."""
    def picky(y):
        return torch.softmax(y, -1) if y.shape[-1] <= 8 else 1 / 0

    def overflowing(y):
        return torch.softmax(y, -1) if y.shape[-1] <= 8 else torch.full_like(y, float("inf"))

    made = [register_output_metric(OutputMetric("test_picky", "fails on wide outputs", distribution=picky,
                                                 whiten=_centred)),
            register_output_metric(OutputMetric("test_overflowing", "inf on wide outputs", distribution=overflowing,
                                                whiten=_centred))]
    try:
        with pytest.raises(ValidationError, match=r"output metric 'test_picky': distribution\(target\) on a target "
                                                  r"of shape \(\d+, \d+, \d+\) failed: ZeroDivisionError"):
            _merge(tiny_hf, llama, tmp_path, "picky", {"metric": "test_picky"})
        with pytest.raises(ValidationError, match=r"output metric 'test_overflowing': distribution\(target\) .* has "
                                                  r"NaN or inf entries"):
            _merge(tiny_hf, llama, tmp_path, "overflowing", {"metric": "test_overflowing"})
    finally:
        for m in made:
            OUTPUT_METRICS.pop(m.name, None)


def test_a_users_check_is_named_when_it_fails_or_answers_no_reason():
    minimal = {"base": "b", "models": [{"path": "x", "calibration": "c.txt"}], "layers": "m.*"}

    def boom(field, restrict, pool):
        raise ZeroDivisionError("no")

    made = [register_output_metric(OutputMetric("test_boolcheck", "check answers a bool", distribution=_softmax,
                                                 whiten=_centred, check=lambda f, r, p: False)),
            register_output_metric(OutputMetric("test_boomcheck", "check raises", distribution=_softmax,
                                                whiten=_centred, check=boom)),
            register_output_metric(OutputMetric("test_topkonly", "topk only", distribution=_softmax, whiten=_centred,
                                                check=lambda f, r, p: None if r == "topk" else "needs restrict: topk"))]
    try:
        with pytest.raises(ConfigError, match=r"output metric 'test_boolcheck': check\(field, restrict, pool\) "
                                              r"returned False; it must return None"):
            parse_config({**minimal, "output": {"metric": "test_boolcheck"}})
        with pytest.raises(ConfigError, match=r"output metric 'test_boomcheck': check\(field, restrict, pool\) "
                                              r"failed: ZeroDivisionError: no"):
            parse_config({**minimal, "output": {"metric": "test_boomcheck"}})
        with pytest.raises(ConfigError, match="needs restrict: topk"):
            parse_config({**minimal, "output": {"metric": "test_topkonly"}})
        assert parse_config({**minimal, "output": {"metric": "test_topkonly", "restrict": "topk", "k": 2}})
    finally:
        for m in made:
            OUTPUT_METRICS.pop(m.name, None)


def test_the_dry_runs_targets_count_a_whitening_metrics_distributions(tiny_hf, llama, tmp_path, user_metrics):
    """(stop 59 review) Under a projection a whitening metric keeps each position's vocabulary-wide
    distribution beside its k-wide target: the plan's targets item counts them, as the run does."""
    from mergeqp.run.memory_estimate import estimate_memory
    from mergeqp.run.plan import build_plan

    def targets(name, metric):
        cfg = load_config(llama.write_config(tmp_path / f"{name}.yml", tiny_hf.MLP_LAYER["llama"],
                                             {"name": "qp", "mode": "single"},
                                             output={"metric": metric, "restrict": "projection", "k": 5}))
        plan = build_plan(cfg)
        return estimate_memory(plan)["targets"], plan

    plain, plan = targets("e", "euclidean")
    prompts = sum(t.n_calibration for t in plan.tasks)
    for metric in ("kl", "test_kl_copy"):
        whitened, _ = targets(metric, metric)
        assert whitened - plain == prompts * plan.batch_length * plan.vocab_size * 8


def test_the_docs_example_registers_through_a_configs_imports(tiny_hf, tmp_path):
    """``docs/architecture.md``'s example module, named in a config's ``imports:``, makes ``output.metric:
    tempered_kl`` a merge that ``mergeqp merge`` runs, certifies and reports in the metric's words."""
    import re
    from pathlib import Path

    from mergeqp.cli import main

    docs = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    section = docs[docs.index("## Add an output metric"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "my_metrics.py").write_text(code)
    fam = tiny_hf.make_family(tmp_path / "fam", "llama", K=2, scale=0.3, n_prompts=10)
    cfg = fam.write_config(tmp_path / "c.yml", [fam.mlp_layer], {"name": "qp", "mode": "single"},
                           imports=["my_metrics.py"], output={"metric": "tempered_kl", "restrict": "topk", "k": 4})
    try:
        assert main(["merge", str(cfg), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    finally:
        OUTPUT_METRICS.pop("tempered_kl", None)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    (layer,) = report["layers"]
    assert layer["certificate"]["certified"] is True
    assert report["evaluation"]["merged"]["calibration_objective"] < report["evaluation"]["base"]["calibration_objective"]
    assert "the merge objective: about twice the summed tempered KL" in (tmp_path / "out" / "report.md").read_text()


def test_the_heldout_measures_an_entry_may_name_are_those_a_merge_records():
    """``HELDOUT_MEASURES`` (the registry's layer cannot import the run layer's report) is the set of
    held-out fields of :class:`mergeqp.run.report.ModelEvaluation`."""
    import dataclasses

    from mergeqp.output_metrics import HELDOUT_MEASURES
    from mergeqp.run.report import ModelEvaluation

    fields = {f.name for f in dataclasses.fields(ModelEvaluation) if f.name.startswith("heldout_")}
    assert set(HELDOUT_MEASURES) == fields
    for metric in OUTPUT_METRICS.values():  # the built-ins name only recorded measures
        assert {key for _, key in metric.heldout} <= fields
        assert metric.regression is None or metric.regression[0] in fields
