"""Paired, stratified bootstrap intervals of the experiments' goal comparisons."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeqp.errors import ValidationError
from mergeqp.experiments.lm_claims import goal_intervals, lm_goal
from mergeqp.experiments.text_report import evaluate_goal, goal_line, paired_interval
from mergeqp.experiments.uncertainty import bootstrap, group_mean, group_ratio, resample_indices


def test_resamples_stay_inside_their_group_and_are_seeded():
    a = resample_indices([3, 50], 400, seed=7)
    b = resample_indices([3, 50], 400, seed=7)
    assert [x.shape for x in a] == [(400, 3), (400, 50)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert a[0].min() == 0 and a[0].max() == 2 and a[1].max() == 49
    assert not np.array_equal(a[1], resample_indices([3, 50], 400, seed=8)[1])
    with pytest.raises(ValidationError, match="at least one text"):
        resample_indices([3, 0], 10)
    with pytest.raises(ValidationError, match="resamples"):
        resample_indices([3], 0)


def test_interval_of_a_mean_matches_the_normal_approximation():
    """For the mean of n = 400 draws the percentile interval is mean +- 1.96 sd / sqrt(n), to the
    bootstrap's own noise."""
    x = np.random.default_rng(0).normal(2.0, 3.0, 400)
    iv = bootstrap(lambda idx: group_mean([x], idx), [x.size], resamples=4000, seed=1)
    half = 1.96 * x.std() / math.sqrt(x.size)
    assert iv.estimate == pytest.approx(x.mean())
    assert iv.low == pytest.approx(x.mean() - half, abs=0.08 * half)
    assert iv.high == pytest.approx(x.mean() + half, abs=0.08 * half)
    assert iv.finite == 4000 and iv.level == 0.95 and not iv.excludes(x.mean()) and iv.excludes(x.mean() + 2 * half)
    assert iv.relation(x.mean()) == "includes" and iv.relation(x.mean() + 2 * half) == "below"
    assert iv.relation(x.mean() - 2 * half) == "above"


def test_pairing_removes_what_the_models_share():
    """Two models that differ by a constant on every text: the difference's interval is that
    constant exactly, although each model's own interval is wide."""
    rng = np.random.default_rng(3)
    hard = [rng.exponential(5.0, 30), rng.exponential(1.0, 70)]  # text difficulty, shared
    a = [h + 0.25 for h in hard]
    own = bootstrap(lambda idx: group_mean(a, idx), [30, 70], seed=0)
    diff = bootstrap(lambda idx: group_mean([x - h for x, h in zip(a, hard)], idx), [30, 70], seed=0)
    assert own.high - own.low > 0.5
    assert diff.low == pytest.approx(0.25) and diff.high == pytest.approx(0.25)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=4), st.integers(0, 2**31 - 1))
def test_group_ratio_on_the_identity_resample_is_the_mean_of_group_ratios(sizes, seed):
    rng = np.random.default_rng(seed)
    num = [rng.uniform(0, 10, n) for n in sizes]
    den = [rng.integers(1, 9, n).astype(float) for n in sizes]
    identity = [np.arange(n)[None, :] for n in sizes]
    want = np.mean([x.sum() / y.sum() for x, y in zip(num, den)])
    assert group_ratio(num, den, identity)[0] == pytest.approx(want)
    iv = bootstrap(lambda idx: group_ratio(num, den, idx), sizes, resamples=200, seed=seed)
    assert iv.low <= iv.high and iv.estimate == pytest.approx(want)


def _lm_results(shift: float, n: int = 40) -> dict:
    """Two domains; the recommended merge's NLL per text is the rival's minus ``shift`` times the
    text's tokens plus noise; each fine-tune 1 nat per token below the rival on its own domain."""
    rng = np.random.default_rng(5)
    domains = ["a", "b"]
    texts, methods = {}, {}
    pred = {d: rng.integers(5, 30, n) for d in domains}
    rival = {d: 3.0 * pred[d] + rng.normal(0, 4, n) for d in domains}
    rec = {d: rival[d] - shift * pred[d] + rng.normal(0, 1, n) for d in domains}

    def entry(nll: dict) -> dict:
        return {d: {"nll": nll[d].tolist(), "predicted": pred[d].tolist()} for d in domains}

    def record(nll: dict, kind: str) -> dict:
        test = {d: {"ce": float(nll[d].sum() / pred[d].sum())} for d in domains}
        return {"kind": kind, "test": test, "mean_test": {"ce": float(np.mean([v["ce"] for v in test.values()]))}}

    texts["qp_rec"], methods["qp_rec"] = entry(rec), record(rec, "qp")
    texts["soup"], methods["soup"] = entry(rival), record(rival, "baseline")
    for d in domains:
        own = {e: rival[e] - 1.0 * pred[e] for e in domains}
        texts[f"finetune:{d}"], methods[f"finetune:{d}"] = entry(own), record(own, "reference")
    res = {"domains": {d: {} for d in domains}, "methods": methods, "per_text_test": texts,
           "recommended": {"method": "qp_rec", "mean_test_ce": methods["qp_rec"]["mean_test"]["ce"]}}
    return res


def test_lm_goal_reports_intervals_of_the_difference_and_the_gap_closed():
    res = _lm_results(0.3)
    goal = lm_goal(res)
    iv = goal["intervals"]
    diff, share = iv["ce_difference"], iv["gap_closed"]
    assert diff["estimate"] == pytest.approx(goal["best_rival_ce"] - goal["recommended_ce"])
    assert share["estimate"] == pytest.approx(goal["gap_closed"])
    assert 0 < diff["low"] < 0.3 < diff["high"] < 0.4  # the shift, with noise, clearly above zero
    assert share["low"] < goal["gap_closed"] < share["high"]
    assert "paired bootstrap" in goal["detail"] and "above zero" in goal["detail"]
    assert goal["passed"] is False  # 30% of the gap: the verdict stays on the point estimates
    # no texts for a fine-tune, or ragged arrays: no interval, the goal as before
    res_missing = _lm_results(0.3)
    del res_missing["per_text_test"]["finetune:b"]
    assert goal_intervals(res_missing, "qp_rec", "soup") is None and "intervals" not in lm_goal(res_missing)
    res_ragged = _lm_results(0.3)
    res_ragged["per_text_test"]["soup"]["a"]["nll"].pop()
    assert goal_intervals(res_ragged, "qp_rec", "soup") is None
    # a recommended merge equal to the rival on every text: the difference is exactly zero
    same = _lm_results(0.0)
    same["per_text_test"]["qp_rec"] = same["per_text_test"]["soup"]
    d, _ = goal_intervals(same, "qp_rec", "soup")
    assert d.low == d.high == d.estimate == 0 and "not above zero" in lm_goal({**same, "methods": {
        **same["methods"], "qp_rec": same["methods"]["soup"] | {"kind": "qp"}}})["detail"]


def _text_results(delta_acc: int) -> dict:
    """Two tasks of 50 texts; ``auto`` gets ``delta_acc`` more texts right than the soup per task and
    a squared error 0.9 times RegMean's on every text."""
    rng = np.random.default_rng(2)
    tasks = ["t1", "t2"]
    texts, methods = {}, {}

    def add(name: str, correct: dict, se: dict) -> None:
        texts[name] = {t: {"correct": correct[t].tolist(), "se": se[t].tolist()} for t in tasks}
        per = {t: {"accuracy": float(correct[t].mean()), "mse": float(se[t].mean())} for t in tasks}
        methods[name] = {"test": {"tasks": per, "mean": {k: float(np.mean([v[k] for v in per.values()]))
                                                         for k in ("accuracy", "mse")}}}

    soup_c = {t: (rng.uniform(size=50) < 0.7).astype(int) for t in tasks}
    auto_c = {t: soup_c[t].copy() for t in tasks}
    for t in tasks:
        wrong = np.flatnonzero(auto_c[t] == 0)[:delta_acc]
        auto_c[t][wrong] = 1
    reg_se = {t: rng.exponential(0.02, 50) for t in tasks}
    add("soup", soup_c, {t: 2 * reg_se[t] for t in tasks})
    add("regmean", {t: (rng.uniform(size=50) < 0.6).astype(int) for t in tasks}, reg_se)
    add("auto", auto_c, {t: 0.9 * reg_se[t] for t in tasks})
    return {"tasks": [{"name": t} for t in tasks], "methods": methods, "per_text_test": texts,
            "selection": {"recommended": {"chosen": "auto"}}}


def test_text_goal_reports_paired_intervals_for_both_halves():
    res = _text_results(3)
    goal = evaluate_goal(res)
    assert goal["passed"] and goal["best_baseline_accuracy"]["method"] == "soup"
    acc, mse = goal["intervals"]["accuracy_difference"], goal["intervals"]["mse_difference"]
    assert acc["estimate"] == pytest.approx(3 / 50)
    assert acc["low"] >= 0 and acc["high"] <= 0.2  # auto never worse than the soup on any text
    assert mse["estimate"] == pytest.approx(goal["mse"] - goal["best_baseline_mse"]["value"])
    assert mse["high"] < 0  # below RegMean's on every text
    line = goal_line(goal)
    assert "paired bootstrap" in line and "MSE minus the lowest baseline's" in line and "below zero" in line
    # one text per task: the accuracy interval includes zero
    small = evaluate_goal(_text_results(1))
    assert small["intervals"]["accuracy_difference"]["low"] == 0 and "includes zero" in goal_line(small)
    # without the texts: no interval, the same verdict
    bare = _text_results(3)
    del bare["per_text_test"]
    assert "intervals" not in evaluate_goal(bare) and evaluate_goal(bare)["passed"]
    assert paired_interval(res, "auto", "missing", "correct") is None


def test_intervals_with_the_best_rival_chosen_again_in_every_resample():
    """Against several rivals, each resample's reference is the best of them on that resample:
    checked against a loop over the same draws; one rival in a list is the fixed-rival interval."""
    from mergeqp.experiments.uncertainty import resample_indices

    res = _lm_results(0.3)
    # a second rival, better than the soup on domain a and worse on b: the best one varies by resample
    rng = np.random.default_rng(9)
    soup = res["per_text_test"]["soup"]
    other = {d: {"nll": (np.asarray(soup[d]["nll"]) + (-0.5 if d == "a" else 0.5) * np.asarray(soup[d]["predicted"])
                         + rng.normal(0, 3, len(soup[d]["nll"]))).tolist(), "predicted": soup[d]["predicted"]}
             for d in soup}
    res["per_text_test"]["ties"] = other
    res["methods"]["ties"] = dict(res["methods"]["soup"])  # (kind baseline; its point CE does not matter here)
    single = goal_intervals(res, "qp_rec", "soup", resamples=300, seed=4)
    listed = goal_intervals(res, "qp_rec", ["soup"], resamples=300, seed=4)
    assert single is not None and listed is not None and single[0] == listed[0] and single[1] == listed[1]
    both = goal_intervals(res, "qp_rec", ["soup", "ties"], resamples=300, seed=4)
    assert both is not None
    domains = list(res["domains"])

    def ce(model: str, idx: list[np.ndarray], r: int) -> float:
        t = res["per_text_test"][model]
        return float(np.mean([np.asarray(t[d]["nll"])[i[r]].sum() / np.asarray(t[d]["predicted"])[i[r]].sum()
                              for d, i in zip(domains, idx)]))

    idx = resample_indices([len(soup[d]["nll"]) for d in domains], 300, seed=4)
    diffs = [min(ce("soup", idx, r), ce("ties", idx, r)) - ce("qp_rec", idx, r) for r in range(300)]
    lo, hi = np.quantile(diffs, [0.025, 0.975])
    assert both[0].low == pytest.approx(lo) and both[0].high == pytest.approx(hi)
    assert both[0].high < single[0].high  # the better of two rivals on each resample: a smaller lead
    # the goal reports it beside the fixed-rival intervals when several rivals have texts
    goal = lm_goal(res)
    assert goal["intervals"]["every_rival"]["rivals"] == ["soup", "ties"]
    assert "chosen again in every resample" in goal["detail"]
    # text: the best of several baselines per resample, by max (accuracy) and min (MSE)
    tres = _text_results(3)
    one = paired_interval(tres, "auto", "soup", "correct", resamples=300, seed=1)
    listed_t = paired_interval(tres, "auto", ["soup"], "correct", resamples=300, seed=1)
    assert one == listed_t
    many = paired_interval(tres, "auto", ["soup", "regmean"], "se", best="min", resamples=300, seed=1)
    tasks = [t["name"] for t in tres["tasks"]]
    tidx = resample_indices([50, 50], 300, seed=1)

    def mean_of(model: str, key: str, r: int) -> float:
        return float(np.mean([np.asarray(tres["per_text_test"][model][t][key])[i[r]].mean()
                              for t, i in zip(tasks, tidx)]))
    want = [mean_of("auto", "se", r) - min(mean_of("soup", "se", r), mean_of("regmean", "se", r)) for r in range(300)]
    assert many.low == pytest.approx(np.quantile(want, 0.025)) and many.high == pytest.approx(np.quantile(want, 0.975))
    assert "chosen again in every resample" in goal_line(evaluate_goal(tres))
    with pytest.raises(ValueError, match="best must be"):
        paired_interval(tres, "auto", ["soup", "regmean"], "se", best="mean")
