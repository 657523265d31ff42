"""``method: auto`` and ``start: {name: auto}`` (:mod:`mergeqp.run.auto`) on tiny Hugging Face checkpoints.

Checks: a config without ``method`` gets the recommended merge; the start is the candidate with
the lowest held-out objective, its evaluation is that candidate's (the soup's equals an explicit
``start: soup``'s; RegMean's, fitted on the other batches only, differs from RegMean on all of
them); the result is never worse than the start on the calibration objective; candidates that
cannot run are skipped with the reason in the report; bad configs fail at plan time naming the
candidate or key.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from mergeqp.config import load_config
from mergeqp.errors import ConfigError, ValidationError
from mergeqp.run.auto import AUTO_MODE_OPTIONS, DEFAULT_CANDIDATES
from mergeqp.run.pipeline import run_merge
from mergeqp.run.plan import build_plan
from mergeqp.run.schema import MergeConfig

LAYERS = ("model.layers.1.mlp.*",)


@pytest.fixture(scope="module")
def llama(tiny_hf, tmp_path_factory):
    """A tiny Llama family whose block 1 is perturbed in both fine-tunes; 16 prompts per task:
    4 held out for evaluation, 12 for calibration in 3 batches of 4."""
    return tiny_hf.make_family(tmp_path_factory.mktemp("auto") / "llama", "llama", K=2, scale=0.3, n_prompts=16)


def _merge(fam, tmp_path, method, name="cfg", **extra):
    cfg = load_config(fam.write_config(tmp_path / f"{name}.yml", list(LAYERS), method, **extra))
    res = run_merge(cfg, tmp_path / f"out_{name}", progress=False)
    return res, json.loads((res.out_dir / "report.json").read_text())


def test_no_method_means_the_recommended_merge():
    cfg = MergeConfig(base="b", models=[{"path": "a", "calibration": "a.txt"}], layers=["x"])
    spelled = MergeConfig(base="b", models=[{"path": "a", "calibration": "a.txt"}], layers=["x"], method="auto")
    assert cfg.method == spelled.method
    m = cfg.method
    assert (m.name, m.mode, m.parametrisation, m.constraints) == ("qp", "trust_region", "rows", [])
    assert m.start is not None and m.start.name == "auto"
    assert m.mode_options == AUTO_MODE_OPTIONS
    # the holdout of the start's selection and of the early stopping is one setting
    other = MergeConfig(base="b", models=[{"path": "a", "calibration": "a.txt"}], layers=["x"],
                        method={"name": "auto", "params": {"holdout": 0.5}})
    assert other.method.mode_options["holdout"] == 0.5 and other.method.start.params == {"holdout": 0.5}
    assert MergeConfig(base="b", models=[{"path": "a"}], layers=["x"], method="soup").method.name == "soup"


def test_method_auto_rejects_qp_keys():
    with pytest.raises(Exception, match="auto takes only 'params'"):
        MergeConfig(base="b", models=[{"path": "a", "calibration": "a.txt"}], layers=["x"],
                    method={"name": "auto", "mode": "joint"})
    with pytest.raises(Exception, match="unknown parameter"):
        MergeConfig(base="b", models=[{"path": "a", "calibration": "a.txt"}], layers=["x"],
                    method={"name": "auto", "params": {"candidate": ["soup"]}})


def test_auto_starts_from_the_lowest_held_out_candidate(llama, tmp_path):
    res, rep = _merge(llama, tmp_path, "auto")
    sel = rep["start_selection"]
    scored = {c["label"]: c["validation"] for c in sel["candidates"] if c["validation"] is not None}
    assert len(sel["candidates"]) == len(DEFAULT_CANDIDATES)
    assert len(scored) == len(DEFAULT_CANDIDATES)  # every default candidate runs on this small Llama
    assert sel["chosen"] == min(scored, key=scored.get)
    chosen = next(c for c in sel["candidates"] if c["label"] == sel["chosen"])
    assert rep["evaluation"]["start"]["method"] == chosen["method"]
    tr = rep["trust_region"]
    assert tr["start"]["calibration_objective"] == pytest.approx(
        rep["evaluation"]["start"]["calibration_objective"], rel=1e-9)
    assert tr["result"]["calibration_objective"] <= tr["start"]["calibration_objective"] * (1 + 1e-12)
    assert tr["holdout"]["fraction"] == 0.25 and sel["folds"] == 4
    assert f"start: {sel['chosen']}" in " ".join(rep["notes"])
    md = (res.out_dir / "report.md").read_text()
    assert "## Start selection" in md and f"**`{sel['chosen']}`**" in md
    plan = build_plan(load_config(tmp_path / "cfg.yml")).render()
    assert f"start auto: {len(DEFAULT_CANDIDATES)} candidate(s)" in plan


def test_the_start_is_the_candidate_as_merged_alone(llama, tmp_path):
    """The soup needs no data: auto's start equals an explicit soup start, and its k-fold score
    is its objective on every calibration batch. RegMean with k folds is refitted on every batch,
    so it equals an explicit RegMean start; with one split it keeps the fit on the batches not
    held out, so it differs."""
    tr = {"name": "qp", "mode": "trust_region", "mode_options": {"max_steps": 1}}
    _, soup_auto = _merge(llama, tmp_path, {**tr, "start": {"name": "auto", "params": {"candidates": ["soup"]}}}, "sa")
    _, soup = _merge(llama, tmp_path, {**tr, "start": {"name": "soup"}}, "s")
    start = soup_auto["evaluation"]["start"]["calibration_objective"]
    assert start == pytest.approx(soup["evaluation"]["start"]["calibration_objective"], rel=1e-12)
    sel = soup_auto["start_selection"]
    assert sel["chosen"] == "soup" and sel["folds"] == 4 and "4-fold" in sel["criterion"]
    assert sel["candidates"][0]["validation"] == pytest.approx(start, rel=1e-12)
    _, rm = _merge(llama, tmp_path, {**tr, "start": {"name": "regmean"}}, "r")
    explicit = rm["evaluation"]["start"]["calibration_objective"]
    for folds, same in ((3, True), (1, False)):
        params = {"candidates": ["regmean"], "folds": folds}
        _, rm_auto = _merge(llama, tmp_path, {**tr, "start": {"name": "auto", "params": params}}, f"ra{folds}")
        got = rm_auto["evaluation"]["start"]["calibration_objective"]
        if same:
            assert got == pytest.approx(explicit, rel=1e-10)
        else:
            assert abs(got - explicit) > 1e-6 * abs(explicit)


def test_k_fold_scores_every_batch_once(llama, tmp_path):
    """With k folds a data-dependent candidate's score is the sum over folds of its objective on
    the fold, fitted on the rest; the score of the one-split run is on the last batches only."""
    from mergeqp.run.auto import AutoStartParams, batch_splits
    splits = batch_splits(3, AutoStartParams(folds=2))
    assert splits == [([2], [0, 1]), ([0, 1], [2])]
    assert batch_splits(3, AutoStartParams(folds=4))[3] == ([0, 1, 2], [])
    assert batch_splits(4, AutoStartParams(folds=1, holdout=0.25)) == [([0, 1, 2], [3])]
    tr = {"name": "qp", "mode": "trust_region", "mode_options": {"max_steps": 1}}
    scores = {}
    for folds in (1, 3):
        _, rep = _merge(llama, tmp_path, {**tr, "start": {"name": "auto", "params": {
            "candidates": ["soup", "regmean"], "folds": folds}}}, f"k{folds}")
        scores[folds] = {c["label"]: c["validation"] for c in rep["start_selection"]["candidates"]}
    # the soup is data-free: all batches (3 folds) vs the last of each task's three (one split)
    assert scores[3]["soup"] > scores[1]["soup"] > 0


def test_qp_candidates_choose_a_rank_on_held_out_batches(llama, tmp_path):
    """``{name: qp, params: {...}}`` candidates are QP merges from the base on the fit batches:
    the basis rank is chosen by the held-out objective like any other candidate."""
    ranks = [{"name": "qp", "params": {"mode": "single", "parametrisation": "basis", "basis": "svd", "rank": p}}
             for p in (1, 4)]
    start = {"name": "auto", "params": {"candidates": ranks + ["soup"]}}
    _, rep = _merge(llama, tmp_path, {"name": "qp", "mode": "trust_region", "mode_options": {"max_steps": 1},
                                      "start": start}, "qp")
    sel = rep["start_selection"]
    scored = {c["label"]: c["validation"] for c in sel["candidates"]}
    assert set(scored) == {"qp(basis=svd, mode=single, parametrisation=basis, rank=1)",
                           "qp(basis=svd, mode=single, parametrisation=basis, rank=4)", "soup"}
    assert all(v is not None and v > 0 for v in scored.values())
    assert sel["chosen"] == min(scored, key=scored.get)
    assert len(set(scored.values())) == 3  # three different merges
    assert rep["evaluation"]["start"]["method"] == ("qp" if sel["chosen"].startswith("qp(") else "soup")


def test_candidates_that_cannot_run_are_skipped_with_the_reason(llama, tmp_path):
    start = {"name": "auto", "params": {"candidates": ["soup", {"name": "output_space",
                                                                 "params": {"jacobian_max_bytes": 0}}]}}
    _, rep = _merge(llama, tmp_path, {"name": "qp", "mode": "trust_region", "mode_options": {"max_steps": 1},
                                      "start": start}, "skip")
    cands = {c["label"]: c for c in rep["start_selection"]["candidates"]}
    assert cands["output_space(jacobian_max_bytes=0)"]["validation"] is None
    assert "jacobian_max_bytes" in cands["output_space(jacobian_max_bytes=0)"]["skipped"]
    assert rep["start_selection"]["chosen"] == "soup"
    # a metric on the prompts' own tokens: output_space fits the fine-tunes' outputs, so it is skipped
    _, rep = _merge(llama, tmp_path, {"name": "qp", "mode": "trust_region", "mode_options": {"max_steps": 1},
                                      "start": {"name": "auto", "params": {"candidates": ["output_space", "soup"]}}},
                    "ce", output={"metric": "cross_entropy"})
    cands = {c["label"]: c for c in rep["start_selection"]["candidates"]}
    assert "cross_entropy" in cands["output_space"]["skipped"] and rep["start_selection"]["chosen"] == "soup"


def test_every_candidate_skipped_is_an_error(llama, tmp_path):
    start = {"name": "auto", "params": {"candidates": [{"name": "output_space", "params": {"jacobian_max_bytes": 0}}]}}
    with pytest.raises(ConfigError, match="every candidate was skipped.*jacobian_max_bytes"):
        _merge(llama, tmp_path, {"name": "qp", "mode": "trust_region", "start": start}, "none")


@pytest.mark.parametrize("candidates, match", [
    (["soupp"], r"candidates\[soupp\].*unknown merge method"),
    ([{"name": "ties", "params": {"desnity": 0.3}}], r"candidates\[ties\(desnity=0.3\)\]"),
    ([{"name": "output_space", "params": {"ridg": 1}}], r"candidates\[output_space\(ridg=1\)\].*did you mean 'ridge'"),
    (["soup", "soup"], "repeated candidate"),
    ([{"name": "qp", "params": {"mode": "hybrid"}}], r"candidates\[qp\(mode=hybrid\)\] \(of method: auto, or of its start: auto\): a QP candidate is merged from"),
    ([{"name": "qp", "params": {"rnak": 2}}], r"candidates\[qp\(rnak=2\)\].*rnak"),
    ([{"name": "qp", "params": {"constraints": ["box:0"]}}], r"candidates\[qp\(constraints=\['box:0'\]\)\].*constraints"),
    ([], "candidates"),
    ([{"name": "qp", "params": {"parametrisation": "rows+baselines", "baselines": ["regmean"]}}],
     r"baseline atoms with calibration statistics \('regmean'\) are not available to start candidates"),
])
def test_bad_candidates_fail_at_plan_time(llama, tmp_path, candidates, match):
    method = {"name": "qp", "mode": "trust_region", "start": {"name": "auto", "params": {"candidates": candidates}}}
    with pytest.raises(ConfigError, match=match):
        build_plan(load_config(llama.write_config(tmp_path / "bad.yml", list(LAYERS), method)))


def test_a_misspelt_auto_is_named_and_candidates_are_placed_where_written(llama, tmp_path):
    """(stop 53 review) `method: autp` listed the baselines without auto (no did-you-mean), and a bad
    candidate of `method: auto` was placed at method.start.params, a key the user never wrote."""
    with pytest.raises(ConfigError, match=r"unknown merge method 'autp'.*did you mean 'auto'"):
        build_plan(load_config(llama.write_config(tmp_path / "typo.yml", list(LAYERS), "autp")))
    method = {"name": "auto", "params": {"candidates": ["soup", "tie"]}}
    with pytest.raises(ConfigError, match=r"candidates\[tie\] \(of method: auto, or of its start: auto\).*unknown "
                                          r"merge method 'tie'"):
        build_plan(load_config(llama.write_config(tmp_path / "cand.yml", list(LAYERS), method)))


def test_one_batch_per_task_cannot_hold_out(llama, tmp_path):
    one = {"max_length": 12, "batch_size": 12, "holdout": 4}
    # (refused by the plan, before any weight is loaded: docs/hf.md, and tests/run/test_config.py for --dry-run)
    with pytest.raises((ConfigError, ValidationError), match="start: auto with 4 folds: task 'code' has 1 calibration batch"):
        _merge(llama, tmp_path, {"name": "qp", "mode": "hybrid", "start": {"name": "auto"}}, "one", calibration=one)
    # (refused by the plan too since stop 75: it failed after the models were loaded)
    with pytest.raises(ConfigError, match="start: auto holdout 0.25: every task has a single calibration batch"):
        _merge(llama, tmp_path, {"name": "qp", "mode": "hybrid", "start": {"name": "auto", "params": {"folds": 1}}},
               "one1", calibration=one)
    with pytest.raises(ConfigError, match="mode trust_region's mode_options.holdout 0.25: every task has a single"):
        _merge(llama, tmp_path, {"name": "qp", "mode": "trust_region", "mode_options": {"holdout": 0.25}}, "one2",
               calibration=one)


@pytest.mark.parametrize("method, collector", [("regmean", "gram_rows"), ("fisher", "compute_fisher")])
def test_k_fold_statistics_are_collected_once_per_batch(llama, tmp_path, monkeypatch, method, collector):
    """RegMean's Grams and Fisher's diagonals of every fold's fit (and the refit, and the trust
    region's held-out fit) are pooled from one pass per calibration batch, not one pass per fit:
    3 batches per task, 3 folds + refit + held-out fit would be 5 collections of 2-3 batches each.
    The pooled start equals an explicit start of the method (collected over all batches at once)
    to rounding."""
    import mergeqp.merge.calibration_statistics as cs

    calls: list[int] = []
    real = getattr(cs, collector)

    def counting(model, batches, *args, **kw):
        batches = list(batches)
        out = real(model, batches, *args, **kw)
        calls.append(sum(int(b["input_ids"].shape[0]) for b in batches))
        return out

    monkeypatch.setattr(cs, collector, counting)
    tr = {"name": "qp", "mode": "trust_region", "mode_options": {"max_steps": 1, "holdout": 0.34, "refit": True}}
    _, rep = _merge(llama, tmp_path, {**tr, "start": {"name": "auto", "params": {"candidates": [method],
                                                                                  "folds": 3}}}, "once")
    # 2 fine-tunes x 3 batches, each once: 24 prompts in all
    assert len(calls) == 2 * 3 and sum(calls) == 2 * 12
    monkeypatch.setattr(cs, collector, real)
    _, explicit = _merge(llama, tmp_path, {**tr, "start": {"name": method}}, "explicit")
    assert rep["evaluation"]["start"]["calibration_objective"] == pytest.approx(
        explicit["evaluation"]["start"]["calibration_objective"], rel=1e-10)
    assert rep["start_selection"]["chosen"].startswith(method)


def test_a_candidate_whose_statistics_cannot_be_collected_is_skipped(llama, tmp_path, monkeypatch):
    """Statistics a model cannot give (Fisher's need logits; an encoder without a head has none)
    skip that candidate with the reason, and an ``output_space`` candidate whose RegMean reference
    failed is skipped too; the other candidates go on."""
    import mergeqp.merge.calibration_statistics as cs

    def no_logits(*args, **kwargs):
        raise ValidationError("cannot find logits in a model output of type BaseModelOutput")

    monkeypatch.setattr(cs, "compute_fisher", no_logits)
    monkeypatch.setattr(cs, "gram_rows", no_logits)
    method = {"name": "auto", "params": {"candidates": ["soup", "fisher", "regmean",
                                                        {"name": "output_space", "params": {"ridge": 0.1}}],
                                         "folds": 3}}
    _, rep = _merge(llama, tmp_path, method, "nologits")
    skipped = {c["label"]: c.get("skipped") for c in rep["start_selection"]["candidates"]}
    assert skipped["soup"] is None and rep["start_selection"]["chosen"] == "soup"
    assert "could not be collected" in skipped["fisher"] and "cannot find logits" in skipped["fisher"]
    assert "could not be collected" in skipped["regmean"]
    assert skipped["output_space(ridge=0.1)"].startswith("its reference RegMean")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available on this machine")
def test_recommended_cross_entropy_merge_on_cuda_matches_cpu(llama, tmp_path):
    """The LM experiment's recommended merge (``auto`` with RegMean's pooled fold statistics, the
    cross-entropy metric folded into the head, a held-out trust region) on CUDA: the same start,
    the same candidate scores and the same result as on the CPU (float64 both)."""
    method = {"name": "auto", "params": {"candidates": ["soup", "regmean"], "folds": 3}}
    extra = {"output": {"metric": "cross_entropy"}}
    _, cpu = _merge(llama, tmp_path, method, "ce_cpu", **extra)
    _, gpu = _merge(llama, tmp_path, method, "ce_gpu", device="cuda", **extra)
    assert gpu["device"] == "cuda"
    a, b = cpu["start_selection"], gpu["start_selection"]
    assert b["chosen"] == a["chosen"]
    for ca, cb in zip(a["candidates"], b["candidates"]):
        assert cb["validation"] == pytest.approx(ca["validation"], rel=1e-8)
    for key in ("start", "result"):
        assert gpu["trust_region"][key]["calibration_objective"] == pytest.approx(
            cpu["trust_region"][key]["calibration_objective"], rel=1e-8)
    assert gpu["trust_region"]["result"]["calibration_objective"] <= (
        gpu["trust_region"]["start"]["calibration_objective"] * (1 + 1e-12))


def test_candidates_are_scored_from_the_same_model_whatever_ran_before(llama, tmp_path):
    """(stop 46 review) A selected layer no fine-tune changed (block 0 here) is in no candidate's
    merged tensors, but an output_space fit rewrote it in the live model, and nothing reset it: the
    data-free soup scored one value first and another after output_space, later folds were scored on
    weights fitted to their own held-out batches, and the chosen start could carry another
    candidate's fit into the written model. Now every fit and score starts from the base at every
    tensor a candidate may change, and output_space leaves layers no fine-tune changed alone."""
    from mergeqp.io.checkpoint import open_checkpoint

    tr = {"name": "qp", "mode": "trust_region", "mode_options": {"max_steps": 1}}
    space = {"name": "output_space", "params": {"ridge": 1.0, "steps": 3}}
    scores = []
    for name, candidates in (("first", [space, "soup"]), ("last", ["soup", space])):
        cfg = load_config(llama.write_config(tmp_path / f"{name}.yml", ["model.layers.*.mlp.down_proj"],
                                             {**tr, "start": {"name": "auto", "params": {"candidates": candidates}}}))
        res = run_merge(cfg, tmp_path / f"out_{name}", progress=False)
        rep = json.loads((res.out_dir / "report.json").read_text())
        got = {c["label"]: c["validation"] for c in rep["start_selection"]["candidates"]}
        assert all(v is not None for v in got.values()), rep["start_selection"]
        scores.append(got)
        key = "model.layers.0.mlp.down_proj.weight"
        assert torch.equal(open_checkpoint(res.out_dir).get(key), open_checkpoint(llama.base).get(key)), name
    assert scores[0].keys() == scores[1].keys()
    for label in scores[0]:
        assert scores[0][label] == pytest.approx(scores[1][label], rel=1e-9), label


def test_a_qp_candidate_refuses_any_mode_that_needs_a_start():
    """(stop 49 architecture review) The rule "a QP candidate is merged from the base" named
    ``hybrid`` alone: a user's mode that needs a start slipped past it. It follows the mode's own
    ``uses_start`` / ``start_required`` now; a mode whose start is optional is a candidate."""
    from mergeqp.errors import ConfigError
    from mergeqp.merge.modes import MERGE_MODES, HybridMode, register_merge_mode
    from mergeqp.run.schema import qp_candidate_block

    class MyStarting(HybridMode):
        name = "my_starting_mode"

    register_merge_mode(MyStarting())
    try:
        with pytest.raises(ConfigError, match=r"here: a QP candidate is merged from the base: .*needs a start "
                                              r"\(hybrid, my_starting_mode\)"):
            qp_candidate_block({"mode": "my_starting_mode"}, "here")
        assert qp_candidate_block({"mode": "trust_region"}, "here").mode == "trust_region"
    finally:
        del MERGE_MODES["my_starting_mode"]


def test_a_winner_whose_fit_on_every_batch_cannot_run_gives_way_to_the_next():
    """(stop 56 review) output_space won on its folds, then its fit on every batch (more batches: a
    Jacobian above jacobian_max_bytes) raised CandidateSkipped outside the selection and ended the
    merge. The next best is taken, the winner's reason kept for the report."""
    from mergeqp.run.auto import AutoStartParams, CandidateSkipped, select_start

    params = AutoStartParams(candidates=["soup", "ties", {"name": "output_space", "params": {"ridge": 0.1}}])
    scores = {"soup": 3.0, "ties": 2.0, "output_space": 1.0}
    loaded = []

    def evaluate(cand):
        def final():
            if cand.name == "output_space":
                raise CandidateSkipped("per-sample Jacobians take 73 MiB, above jacobian_max_bytes (64 MiB)")
            return {"w": cand.name}
        return scores[cand.name], final

    sel = select_start(params, evaluate, loaded.append)
    assert sel.chosen.name == "ties" and loaded == [{"w": "ties"}] and sel.overrides == {"w": "ties"}
    winner = next(c for c in sel.candidates if c.name == "output_space")
    assert winner.validation == 1.0 and "could not run: per-sample Jacobians" in winner.note

    def nothing_runs(cand):
        def final():
            raise CandidateSkipped("too large")
        return scores[cand.name], final

    with pytest.raises(ConfigError, match="no candidate's fit on every batch could run"):
        select_start(params, nothing_runs, loaded.append)
    # a NaN score sorts last (compared with NaN no order holds: the adversarial review's pick was 5 over 1)
    scores.update(soup=5.0, ties=float("nan"), output_space=1.0)
    assert select_start(AutoStartParams(candidates=["soup", "ties", "dare_ties"]),
                        lambda c: ({"dare_ties": 1.0, **scores}[c.name], lambda: {"w": c.name}),
                        loaded.append).chosen.name == "dare_ties"


def test_scores_equal_to_rounding_are_a_tie_won_by_the_first_listed():
    """(stop 80) Two candidates that make the same merge score the same to rounding (the text experiment:
    regmean_sequential on one layer is RegMean, 780.57394 and 780.57394 - 4e-6 on a float32 model): the first
    listed wins, as on an exact tie; a real difference (1e-4 relative) still decides; NaN still sorts last."""
    from mergeqp.run.auto import TIE_RTOL, AutoStartParams, ranked_order, select_start

    params = AutoStartParams(candidates=["soup", "ties", "dare_ties"])
    for scores, chosen in (({"soup": 900.0, "ties": 780.57, "dare_ties": 780.57 * (1 - 1e-13)}, "ties"),
                           ({"soup": 2.0, "ties": 1.0, "dare_ties": 1.0 - 1e-4}, "dare_ties"),
                           ({"soup": 900.0, "ties": 780.5739393314898, "dare_ties": 780.5739352120786}, "ties"),
                           ({"soup": 780.57 * (1 + TIE_RTOL / 2), "ties": 780.57, "dare_ties": 900.0}, "soup"),
                           ({"soup": -5.0 * (1 - TIE_RTOL / 2), "ties": -5.0, "dare_ties": 1.0}, "soup")):
        sel = select_start(params, lambda c, s=scores: (s[c.name], lambda: {"w": c.name}), lambda t: None)
        assert sel.chosen.name == chosen, scores
    order = ranked_order([(3.0, 0, "a"), (float("nan"), 1, "b"), (1.0, 2, "c"), (1.0 + 1e-9, 3, "d"), (1.0, 4, "e")])
    assert [r[2] for r in order] == ["c", "d", "e", "a", "b"]


def test_the_plan_names_an_output_space_candidate_whose_jacobians_cannot_fit(llama, tmp_path):
    """(stop 57 review) The dry run listed `auto`'s output_space candidates, and the run on a real
    language model skipped each for its per-sample Jacobians (82,674 MiB against 64 MiB): the plan
    now says so where even a lower bound exceeds the candidate's jacobian_max_bytes, and not where
    the run forms them (the tiny Llama, default candidates)."""
    tight = {"name": "output_space", "params": {"ridge": 0.1, "steps": 5, "jacobian_max_bytes": 16}}
    tr = {"name": "qp", "mode": "trust_region", "mode_options": {"max_steps": 1},
          "start": {"name": "auto", "params": {"candidates": ["soup", tight]}}}
    cfg = load_config(llama.write_config(tmp_path / "tight.yml", list(LAYERS), tr))
    lines = [ln for ln in build_plan(cfg).render().splitlines() if "output_space(" in ln and "skipped" in ln]
    assert len(lines) == 1 and "jacobian_max_bytes (16 B): the run skips it" in lines[0]
    _, rep = _merge(llama, tmp_path, tr, "tight")
    (cand,) = [c for c in rep["start_selection"]["candidates"] if c["method"] == "output_space"]
    assert cand["validation"] is None and "above jacobian_max_bytes" in json.dumps(cand)
    default = load_config(llama.write_config(tmp_path / "auto.yml", list(LAYERS), "auto"))
    assert not any("output_space(" in ln and "skipped" in ln for ln in build_plan(default).render().splitlines())
