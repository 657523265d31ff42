"""The language experiment's verdicts, computed from its results dict: the recommended merge
(chosen on calibration texts), the issue's LM goal, and the paper's LLM claims, each PASS/FAIL as
measured.

- **Recommended merge**: the product's recommended merge for causal language models, fixed in
  advance (``LmMergeSettings.recommended``, by default the trust region on the calibration
  cross-entropy, early-stopped on held-out calibration batches: every choice it makes uses
  calibration texts only, never the test texts). When that run is not among the QP runs, the QP
  run with the lowest mean calibration cross-entropy stands in (said in ``rule``).
- **Goal**: the recommended merge's mean held-out cross-entropy is below every baseline's and
  every mergekit method's, and it closes at least half of the gap from the best of them to the
  ceiling (each fine-tune on its own domain, averaged over domains).
- **Claims** of the paper's Llama appendix (its figures "Performance on LLaMA 3.1"), with the
  paper's Euclidean output metric: (L1) the single-layer QP attains the lowest logit MSE; (L2)
  the sequential multi-layer QP attains the lowest logit MSE; (L3) the sequential QP has the best
  task metric (here: held-out cross-entropy) on at least two of three domains; (L4) lower logit
  MSE does not always mean a better task metric. Also (F) every fine-tune beats the base on its
  own domain (the experiment's premise).

When the results hold every test text's NLL (``per_text_test``), the goal also reports how much of
its comparison is the test sample (:mod:`.uncertainty`): paired, stratified bootstrap intervals of
the CE difference between the best rival and the recommended merge and of the share of the gap
closed (the best rival and the ceiling's fine-tunes fixed as measured), and the same two with the
best rival chosen again in every resample (``intervals.every_rival``: the lowest CE of every
baseline and mergekit method on that resample, so the interval also carries the chance of which
rival looks best). They inform; the verdict stays the one on the point estimates.

The goal's detail also places the ``multitask`` reference (when it ran: one model fine-tuned by the
same recipe on every domain's train texts) on the same scale, as context; it decides nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .uncertainty import DEFAULT_RESAMPLES, Interval, bootstrap, describe_level, group_ratio

COMPETITOR_KINDS = ("baseline", "mergekit")
MULTITASK = "multitask"  # the reference row fine-tuned on every domain's train texts (lm.LmConfig.multitask)


def _claim(cid: str, statement: str, passed: bool, value: Any, detail: str) -> dict[str, Any]:
    return {"id": cid, "statement": statement, "passed": bool(passed), "value": value, "detail": detail}


def _of_kind(results: dict[str, Any], kinds: tuple[str, ...]) -> dict[str, Any]:
    return {n: m for n, m in results["methods"].items() if m.get("kind") in kinds}


def ceiling_ce(results: dict[str, Any]) -> float:
    """Mean over domains of each domain's fine-tune's held-out CE on its own domain."""
    domains = list(results["domains"])
    return sum(results["methods"][f"finetune:{d}"]["test"][d]["ce"] for d in domains) / len(domains)


def recommended_merge(results: dict[str, Any]) -> dict[str, Any] | None:
    """The recommended merge (see the module docstring)."""
    qps = _of_kind(results, ("qp",))
    if not qps:
        return None
    label = ((results.get("config") or {}).get("merge") or {}).get("recommended")
    name = f"qp_{label.replace(':', '_')}" if label else None
    if name in qps:
        rule = (f"the product's recommended merge for causal language models ({label}: method auto with this "
                f"metric), fixed in advance; its choices (the start, early stopping) use held-out calibration "
                f"batches")
    else:
        name = min(qps, key=lambda n: (qps[n]["mean_calibration_ce"], n))
        rule = ("the QP run (any mode and output metric) with the lowest mean cross-entropy on the calibration "
                "texts" + (f" (the configured recommendation {label} did not run)" if label else ""))
    m = qps[name]
    out = {"method": name, "mode": m.get("mode"), "metric": m.get("metric"),
           "mean_calibration_ce": m["mean_calibration_ce"], "mean_test_ce": m["mean_test"]["ce"], "rule": rule}
    selection = (m.get("report") or {}).get("start_selection")
    if selection:
        out["start_selection"] = selection
    return out


def lm_goal(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's LM goal as measured (see the module docstring)."""
    rec = results.get("recommended")
    rivals = _of_kind(results, COMPETITOR_KINDS)
    if rec is None or not rivals:
        return {"passed": False, "detail": "no QP run or no baseline to compare"}
    ceiling = ceiling_ce(results)
    best = min(rivals, key=lambda n: rivals[n]["mean_test"]["ce"])
    best_ce = rivals[best]["mean_test"]["ce"]
    ce = rec["mean_test_ce"]
    beats = all(ce < m["mean_test"]["ce"] for m in rivals.values())
    gap = best_ce - ceiling
    closed = (best_ce - ce) / gap if gap > 0 else math.nan
    passed = beats and gap > 0 and closed >= 0.5
    out = {"passed": passed, "recommended": rec["method"], "recommended_ce": ce, "best_rival": best,
           "best_rival_ce": best_ce, "ceiling_ce": ceiling, "beats_every_rival": beats,
           "gap_closed": closed,
           "detail": f"{rec['method']} mean held-out CE {ce:.4f} vs best baseline/mergekit {best} {best_ce:.4f}, "
                     f"ceiling {ceiling:.4f}: " + (f"closes {closed:.1%} of the gap" if gap > 0 else
                                                  "no gap to close (the best rival is at or below the ceiling: "
                                                  "the fine-tunes do not beat it on their own domains)")
                     + " (goal: lower than every rival and >= 50%)"}
    intervals = goal_intervals(results, rec["method"], best)
    if intervals is not None:
        diff, share = intervals
        out["intervals"] = {"ce_difference": diff.to_dict(), "gap_closed": share.to_dict(),
                            "method": describe_level(diff)}
        out["detail"] += (f"; {describe_level(diff)}: best rival minus recommended {diff.describe()} nats "
                          f"({'above' if diff.low > 0 else 'not above'} zero), share of the gap closed "
                          f"{share.describe('.3f')}")
        every = goal_intervals(results, rec["method"], sorted(rivals))
        if every is not None and len(rivals) > 1:
            e_diff, e_share = every
            out["intervals"]["every_rival"] = {"ce_difference": e_diff.to_dict(), "gap_closed": e_share.to_dict(),
                                               "rivals": sorted(rivals)}
            out["detail"] += (f"; with the best of the {len(rivals)} rivals chosen again in every resample: "
                              f"{e_diff.describe()} nats ({e_diff.relation()} zero), share {e_share.describe('.3f')}")
    multitask = results["methods"].get(MULTITASK)
    if multitask is not None:  # context, not part of the verdict: one model trained on every domain's texts
        mt_ce = multitask["mean_test"]["ce"]
        mt_closed = (best_ce - mt_ce) / gap if gap > 0 else math.nan
        out.update(multitask_ce=mt_ce, multitask_gap_closed=mt_closed)
        out["detail"] += (f"; for scale, the multitask fine-tune (one model trained by the fine-tunes' recipe on "
                          f"every domain's train texts) {mt_ce:.4f}" + (f" closes {mt_closed:.1%}" if gap > 0 else ""))
    return out


def goal_intervals(results: dict[str, Any], recommended: str, rival: str | Sequence[str], *,
                   resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> tuple[Interval, Interval] | None:
    """Paired bootstrap intervals (:mod:`.uncertainty`) of the mean held-out CE of ``rival`` minus
    ``recommended``'s, and of the share of the gap to the ceiling that ``recommended`` closes;
    ``None`` when the results lack any of the texts' NLLs this needs. With several rivals, the
    rival in each resample is the one with the lowest CE on that resample (the choice of the best
    rival is then part of what the interval varies, not fixed as measured on the sample)."""
    texts = results.get("per_text_test") or {}
    domains = list(results["domains"])
    rivals = [rival] if isinstance(rival, str) else list(rival)
    needed = [recommended, *rivals, *(f"finetune:{d}" for d in domains)]
    if not domains or not rivals or any(m not in texts or any(d not in texts[m] for d in domains) for m in needed):
        return None

    def arrays(model: str, key: str) -> list[np.ndarray]:
        return [np.asarray(texts[model][d][key], dtype=np.float64) for d in domains]

    rec_nll, rivals_nll = arrays(recommended, "nll"), [arrays(r, "nll") for r in rivals]
    pred = arrays(recommended, "predicted")
    ceiling_nll = [np.asarray(texts[f"finetune:{d}"][d]["nll"], dtype=np.float64) for d in domains]
    if any(len(a) != len(p) or not len(p) for nll in (*rivals_nll, rec_nll, ceiling_nll) for a, p in zip(nll, pred)):
        return None

    def ce(nll: list[np.ndarray], idx: Any) -> np.ndarray:
        return group_ratio(nll, pred, idx)

    def best(idx: Any) -> np.ndarray:
        return np.min([ce(nll, idx) for nll in rivals_nll], axis=0)

    def difference(idx: Any) -> np.ndarray:
        return best(idx) - ce(rec_nll, idx)

    def share(idx: Any) -> np.ndarray:
        b = best(idx)
        with np.errstate(divide="ignore", invalid="ignore"):
            return (b - ce(rec_nll, idx)) / (b - ce(ceiling_nll, idx))

    sizes = [len(p) for p in pred]
    return (bootstrap(difference, sizes, resamples=resamples, seed=seed),
            bootstrap(share, sizes, resamples=resamples, seed=seed))


def _lowest(results: dict[str, Any], name: str, key: str, rivals: dict[str, Any]) -> tuple[bool, str]:
    mine = results["methods"][name]["mean_test"][key]
    best = min(rivals, key=lambda n: rivals[n]["mean_test"][key])
    theirs = rivals[best]["mean_test"][key]
    return mine < theirs, f"{name} {mine:.4g} vs best rival {best} {theirs:.4g}"


def evaluate_lm_claims(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The claims table (see the module docstring); a claim whose methods did not run is left out."""
    methods = results["methods"]
    domains = list(results["domains"])
    rivals = _of_kind(results, COMPETITOR_KINDS)
    out = []
    own = {d: (methods[f"finetune:{d}"]["test"][d]["ce"], methods["base"]["test"][d]["ce"]) for d in domains}
    out.append(_claim("F", "each fine-tune has a lower held-out cross-entropy than the base on its own domain",
                      all(a < b for a, b in own.values()), {d: {"finetune": a, "base": b} for d, (a, b) in own.items()},
                      "; ".join(f"{d}: {a:.3f} vs base {b:.3f}" for d, (a, b) in own.items())))
    if "qp_single_euclidean" in methods and rivals:
        ok, detail = _lowest(results, "qp_single_euclidean", "mse", rivals)
        out.append(_claim("L1", "the single-layer QP (last fine-tuned layer; Euclidean metric) attains a lower "
                                "mean logit MSE than every baseline and mergekit method (which merge every "
                                "fine-tuned layer)", ok, methods["qp_single_euclidean"]["mean_test"]["mse"], detail))
    seq = "qp_sequential_euclidean"
    if seq in methods and rivals:
        ok, detail = _lowest(results, seq, "mse", rivals)
        out.append(_claim("L2", "the sequential multi-layer QP (Euclidean) attains the lowest mean logit MSE of "
                                "the baselines and mergekit methods", ok, methods[seq]["mean_test"]["mse"], detail))
        wins = [d for d in domains if methods[seq]["test"][d]["ce"] < min(m["test"][d]["ce"] for m in rivals.values())]
        need = math.ceil(2 * len(domains) / 3)
        out.append(_claim("L3", f"the sequential QP (Euclidean) has the lowest held-out cross-entropy on at least "
                                f"{need} of {len(domains)} domains", len(wins) >= need, wins,
                          f"lowest on: {', '.join(wins) or 'none'}"))
    merges = {n: m for n, m in methods.items() if m.get("kind") in ("qp", *COMPETITOR_KINDS)}
    names = sorted(merges)
    discordant = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]
                  if (merges[a]["mean_test"]["mse"] - merges[b]["mean_test"]["mse"])
                  * (merges[a]["mean_test"]["ce"] - merges[b]["mean_test"]["ce"]) < 0]
    if len(names) >= 2:
        pairs = len(names) * (len(names) - 1) // 2
        out.append(_claim("L4", "lower logit MSE does not always mean a lower cross-entropy (some pair of merges "
                                "is ordered differently by the two)", bool(discordant), len(discordant),
                          f"{len(discordant)} of {pairs} pairs of merges ordered differently by MSE and CE"))
    return out


__all__ = ["ceiling_ce", "evaluate_lm_claims", "goal_intervals", "lm_goal", "recommended_merge"]
