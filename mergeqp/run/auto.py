"""``start: {name: auto}``: the start of a start-using mode chosen by cross-validation on calibration batches.

A start-using mode (``trust_region``, ``hybrid``) begins from a baseline merged on every tensor.
With ``start: auto`` the run layer merges each candidate in turn (by default the soup, task
arithmetic at three weights, TIES, RegMean at three alphas, RegMean with each layer's Gram matrices at
the merged model's inputs (``regmean_sequential``) at the same alphas where it has at most
:data:`SEQUENTIAL_MAX_STAGES` stages, Fisher and the full-matrix ``output_space`` merge at
three ridges, by damped Gauss-Newton steps) and scores it by the merge's own objective (the configured ``output:`` block and metric)
on calibration batches it was not fitted to; the lowest score is the start. No test data is
involved. Listing one method at several settings (the defaults do so for task arithmetic's
weight and ``output_space``'s ridge) chooses the setting the same way; a ``{name: qp, params:
{...}}`` candidate is a QP merge from the base (any mode but ``hybrid``, any parametrisation: a
basis rank, a ridge ``regularisation`` or a constraint set chosen on held-out data).

Scoring (:func:`batch_splits`): with ``folds`` k >= 2 (default 4) each task's calibration
batches are cut into k contiguous folds; a candidate that needs data (RegMean's or Fisher's statistics,
``output_space``'s fit, a QP) is fitted per fold on the other folds and scored on the fold, the
score being the sum over folds; a data-free one is merged once and scored on every batch; the
winner is then refitted on every batch. With ``folds: 1`` the last ``round(holdout * n)`` batches
of each task (:func:`mergeqp.merge.trust_region.holdout_count`) are scored and the winner keeps
its fit on the rest.

A candidate that cannot run on this merge is skipped with its reason in the report: the
``output_space`` merge fits the fine-tunes' outputs (not a metric that scores the prompts' own
tokens), solves linear sites only, and is a candidate only where its per-sample Jacobians fit
``jacobian_max_bytes`` (the matrix-free solve is too slow to be tried on speculation); a
candidate whose statistics the model cannot give (Fisher's need logits) is skipped, and with
``lazy: true`` so are the default candidates whose statistics would load every fine-tune whole
(:func:`lazy_skipped`).

``method: auto`` (:data:`AUTO_METHOD`, also the default method) is the recommended merge: a
trust-region QP over the selected layers from this start, early stopping on the last quarter of
each task's calibration batches and refitted on all of them (``docs/hf.md``, "method: auto").
When the chosen start was fitted to calibration data, the trust region's early stopping runs from
its fit without those held-out batches (:func:`held_out_fit`), so they are held out from the start
too, and the result from its fit on every batch.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..errors import ConfigError, MergeQPError, parse_params

#: the start name that selects among candidates
AUTO = "auto"

#: damped Gauss-Newton solves per site of the ``output_space`` candidates (a cap: each stops when
#: a step gains less than its ``tol``); one undamped solve from RegMean is rejected on ReLU
#: networks (docs/mnist.md), the damped steps are not
OUTPUT_SPACE_STEPS = 60

#: the ``max_stages`` of the default ``regmean_sequential`` candidates: about four transformer
#: blocks' linear layers (each block's attention input and output projections, its MLP's input and
#: output ones); a merge of more is skipped unless the candidates are listed (each stage is a pass of
#: every calibration batch up to it)
SEQUENTIAL_MAX_STAGES = 16

#: the candidates of ``start: auto`` when none are given: the tensor-wise baselines at their
#: defaults (task arithmetic at three weights), RegMean at three ``alpha`` across its range (the
#: RegMean paper tunes it on validation data; one fixed 0.9 before stop 77), RegMean with each layer's
#: Gram matrices at the merged model's inputs (``regmean_sequential``, stop 80) at the same alphas,
#: Fisher and the full-matrix output-space merge at three relative ridges (so these, too, are chosen
#: on the held-out batches)
DEFAULT_CANDIDATES: tuple[dict[str, Any], ...] = (
    {"name": "soup"},
    {"name": "task_arithmetic", "params": {"scaling": 0.3}},
    {"name": "task_arithmetic", "params": {"scaling": 0.5}},
    {"name": "task_arithmetic", "params": {"scaling": 1.0}},
    {"name": "ties"},
    {"name": "regmean", "params": {"alpha": 0.1}},
    {"name": "regmean", "params": {"alpha": 0.5}},
    {"name": "regmean", "params": {"alpha": 0.9}},
    {"name": "regmean_sequential", "params": {"alpha": 0.1, "max_stages": SEQUENTIAL_MAX_STAGES}},
    {"name": "regmean_sequential", "params": {"alpha": 0.5, "max_stages": SEQUENTIAL_MAX_STAGES}},
    {"name": "regmean_sequential", "params": {"alpha": 0.9, "max_stages": SEQUENTIAL_MAX_STAGES}},
    {"name": "fisher"},
    {"name": "output_space", "params": {"ridge": 0.01, "steps": OUTPUT_SPACE_STEPS}},
    {"name": "output_space", "params": {"ridge": 0.1, "steps": OUTPUT_SPACE_STEPS}},
    {"name": "output_space", "params": {"ridge": 1.0, "steps": OUTPUT_SPACE_STEPS}},
)

#: a candidate that is a QP merge from the base: its ``params`` are a ``method`` block of
#: ``name: qp`` without a start (``mode``, ``parametrisation``, ``rank``, ``constraints``, ...)
QP_CANDIDATE = "qp"

#: ``method: auto``: the recommended merge (docs/hf.md); its trust-region options
AUTO_METHOD = "auto"
AUTO_HOLDOUT = 0.25
AUTO_FOLDS = 4
AUTO_MODE_OPTIONS: dict[str, Any] = {"radius": 0.05, "holdout": AUTO_HOLDOUT, "refit": True, "max_steps": 8}


def named_entries(v: Any) -> Any:
    """A config list of methods (``[ties, {name: dare, params: {...}}]``, or one of them alone) as
    ``{name, ...}`` mappings: a bare name is that method with its defaults."""
    if isinstance(v, (str, dict)):
        v = [v]
    return [{"name": c} if isinstance(c, str) else c for c in (v or [])]


class Candidate(BaseModel):
    """One candidate start: a merge method name and its parameters."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    params: dict[str, Any] = Field(default_factory=dict)

    @property
    def label(self) -> str:
        """``name`` or ``name(key=value, ...)``: unique per candidate in a report."""
        if not self.params:
            return self.name
        return f"{self.name}(" + ", ".join(f"{k}={v}" for k, v in sorted(self.params.items())) + ")"

    @property
    def key(self) -> str:
        return json.dumps([self.name, self.params], sort_keys=True, default=str)


class AutoStartParams(BaseModel):
    """``start.params`` of ``start: {name: auto}``: ``candidates`` (method names or ``{name,
    params}``; default :data:`DEFAULT_CANDIDATES`), ``folds`` (``k`` >= 2: k-fold scoring, every
    calibration batch held out once, the chosen candidate then refitted on all of them; 1: one
    split) and ``holdout`` (with ``folds: 1``: the fraction of each task's calibration batches
    held out to score them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    candidates: tuple[Candidate, ...] = Field(
        default_factory=lambda: tuple(Candidate(**c) for c in DEFAULT_CANDIDATES), min_length=1)
    holdout: float = Field(AUTO_HOLDOUT, gt=0.0, lt=1.0)
    folds: int = Field(AUTO_FOLDS, ge=1, le=20)

    @field_validator("candidates", mode="before")
    @classmethod
    def _names(cls, v: Any) -> Any:
        return named_entries(v)

    @property
    def fits(self) -> int:
        """Fits of a data-dependent candidate's statistics: one per fold and the refit on every
        batch (with ``folds: 1``, the one split)."""
        return self.folds + 1 if self.folds > 1 else 1

    @field_validator("candidates")
    @classmethod
    def _unique(cls, v: tuple[Candidate, ...]) -> tuple[Candidate, ...]:
        labels = [c.label for c in v]
        dup = sorted({x for x in labels if labels.count(x) > 1})
        if dup:
            raise ValueError(f"repeated candidate(s) {dup}")
        return v


def parse_auto_params(params: Mapping[str, Any], where: str = "method.start") -> AutoStartParams:
    """Validate ``start.params`` of ``start: auto``; :class:`ConfigError` naming the bad key."""
    return parse_params(AutoStartParams, params, where, "start 'auto'")


def is_auto_start(start: Any) -> bool:
    """The config's ``start`` (a ``BaselineSpec`` or ``None``) asks for the automatic start."""
    return start is not None and start.name == AUTO


def candidate_where(label: str) -> str:
    """Where a start candidate is, for errors: the key path the user wrote (``method: auto``'s
    ``params.candidates`` or ``start: auto``'s; before stop 53 errors named the expanded block's
    ``method.start.params.candidates``, which a ``method: auto`` config does not have)."""
    return f"candidates[{label}] (of method: auto, or of its start: auto)"


def auto_method_config(params: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``method:`` block that ``method: auto`` stands for: a trust-region QP over the selected
    layers, per-row coefficients, no constraint beyond the trust region, from ``start: auto``,
    early stopping on the last ``holdout`` of each task's calibration batches, refitted on all.
    ``params`` (``candidates``, ``folds``, ``holdout``) go to the start; ``holdout`` also to the
    mode (its early stopping)."""
    params = dict(params or {})
    holdout = parse_params(AutoStartParams, params, "method", "method 'auto'").holdout
    return {"name": "qp", "mode": "trust_region", "parametrisation": "rows", "constraints": [],
            "start": {"name": AUTO, "params": params},
            "mode_options": {**AUTO_MODE_OPTIONS, "holdout": holdout}}


@dataclass(frozen=True)
class ScoredCandidate:
    """A candidate start as scored: its objective on the held-out batches (``None`` when it was
    skipped, with the reason in ``note``) and the seconds its merge and scoring took."""

    label: str
    name: str
    params: Mapping[str, Any]
    validation: float | None
    seconds: float
    note: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"label": self.label, "method": self.name, "params": dict(self.params), "validation": self.validation,
               "seconds": self.seconds}
        if self.note:
            out["skipped"] = self.note
        return out


@dataclass(frozen=True)
class StartSelection:
    """The outcome of ``start: auto``: every candidate scored, the chosen one, the folds (or the
    held-out fraction) and the chosen candidate's merged tensors (checkpoint names)."""

    candidates: tuple[ScoredCandidate, ...]
    chosen: ScoredCandidate
    folds: int
    holdout: float
    overrides: dict[str, Any] = field(repr=False)

    def to_json(self) -> dict[str, Any]:
        if self.folds > 1:
            criterion = (f"lowest objective on held-out calibration batches, {self.folds}-fold: each batch scored "
                         f"by the candidate fitted without its fold; the chosen one refitted on every batch")
        else:
            criterion = (f"lowest objective on the held-out calibration batches (the last {self.holdout:g} of each "
                         f"task's), the candidates fitted on the others")
        return {"criterion": criterion, "folds": self.folds, "holdout": self.holdout, "chosen": self.chosen.label,
                "candidates": [c.to_json() for c in self.candidates]}


def held_out_fit(params: AutoStartParams, mode_holdout: float) -> tuple[int, int | None]:
    """``(fits, index)``: how many fits a data-dependent candidate's statistics take, and which of
    them is its fit without the mode's held-out batches (``mode_holdout``: the fraction a mode
    holds out from a start it refits, :meth:`~mergeqp.merge.modes.MergeMode.start_holdout`;
    ``None`` when 0). With ``folds: 1`` and the same fraction that is the one split's fit; else one
    more fit, on each task's batches but the last :func:`~mergeqp.merge.trust_region.holdout_count`."""
    if mode_holdout <= 0:
        return params.fits, None
    if params.folds == 1 and params.holdout == mode_holdout:
        return params.fits, 0
    return params.fits + 1, params.fits


class CandidateSkipped(MergeQPError):
    """A candidate that cannot run on this merge (its reason goes to the report)."""


#: what the run layer gives :func:`select_start` per candidate: its score (the summed held-out
#: objective) and how to get its final tensors (the fit on every batch, or the one fit made)
CandidateScore = tuple[float, Callable[[], dict[str, Any]]]


#: scores within this relative difference of the lowest are a tie, won by the candidate listed first:
#: two candidates that make the same merge (``regmean_sequential`` is ``regmean`` on one merged layer)
#: differ in their scores by rounding only (stop 80: on MiniLM, a float32 model, by 5e-9 relative), and
#: rounding is no reason to prefer the later one; distinct candidates differed by 2e-4 relative or more
#: on every run measured
TIE_RTOL = 1e-6


def ranked_order(ranked: Sequence[tuple[float, int, Any]]) -> list[tuple[float, int, Any]]:
    """``(score, listed index, ...)`` entries lowest score first, NaN last; among scores within
    :data:`TIE_RTOL` (relative) of the lowest remaining one, the earliest listed first."""
    remaining = sorted(ranked, key=lambda r: (math.isnan(r[0]), r[0] if not math.isnan(r[0]) else 0.0, r[1]))
    out = []
    while remaining:
        best = remaining[0][0]
        tied = [r for r in remaining if not math.isnan(best) and not math.isnan(r[0])
                and r[0] - best <= TIE_RTOL * abs(best)] or remaining[:1]
        pick = min(tied, key=lambda r: r[1])
        out.append(pick)
        remaining.remove(pick)
    return out


def select_start(params: AutoStartParams, evaluate: Callable[[Candidate], CandidateScore],
                 load: Callable[[dict[str, Any]], None], log: Callable[[str], None] | None = None) -> StartSelection:
    """Score each candidate (``evaluate(candidate)``; it raises :class:`CandidateSkipped` when
    the candidate cannot run here); the lowest wins: its final tensors are made and ``load``-ed
    into the live model. Raises :class:`ConfigError` when every candidate was skipped."""
    say = log or (lambda msg: None)
    scored: list[ScoredCandidate] = []
    ranked: list[tuple[float, int, Callable[[], dict[str, Any]]]] = []
    for cand in params.candidates:
        t = time.perf_counter()
        try:
            value, final = evaluate(cand)
        except CandidateSkipped as exc:
            scored.append(ScoredCandidate(cand.label, cand.name, cand.params, None, time.perf_counter() - t, str(exc)))
            say(f"start auto: {cand.label} skipped: {exc}")
            continue
        entry = ScoredCandidate(cand.label, cand.name, cand.params, float(value), time.perf_counter() - t)
        ranked.append((float(value), len(scored), final))
        scored.append(entry)
        say(f"start auto: {cand.label}: held-out objective {value:.6g} ({entry.seconds:.1f} s)")
    if not ranked:
        raise ConfigError("start: auto: every candidate was skipped: " + "; ".join(
            f"{c.label}: {c.note}" for c in scored))
    # the lowest first (the earliest on a tie, to rounding: TIE_RTOL); a winner whose fit on every batch
    # cannot run (more batches than its folds' fits: a Jacobian above the limit) gives way to the next
    # (stop 56 review: the merge stopped there)
    # (a NaN score sorts last: compared with it, no order holds; the adversarial review chose 5 over 1)
    for _, i, final in ranked_order(ranked):
        try:
            tensors = final()
        except CandidateSkipped as exc:
            scored[i] = replace(scored[i], note=f"lowest held-out objective, but its fit on every batch could "
                                                f"not run: {exc}")
            say(f"start auto: {scored[i].label} set aside: its fit on every batch could not run: {exc}")
            continue
        load(tensors)
        say(f"start auto: chose {scored[i].label}")
        return StartSelection(tuple(scored), scored[i], params.folds, params.holdout, tensors)
    raise ConfigError("start: auto: no candidate's fit on every batch could run: " + "; ".join(
        f"{c.label}: {c.note}" for c in scored))


#: calibration batches per task that ``start: auto`` with k >= 2 folds needs (one to fit on, one to score)
MIN_FOLD_BATCHES = 2


def too_few_batches(folds: int, n_calibration: int, batch_size: int) -> int | None:
    """The number of calibration batches ``n_calibration`` prompts make in batches of ``batch_size``
    where ``start: auto`` with ``folds`` cannot cross-validate on them (folds >= 2, fewer than
    :data:`MIN_FOLD_BATCHES` batches), else ``None``: the rule the plan and ``mergeqp experiment
    lm`` check before any work."""
    batches = calibration_batches(n_calibration, batch_size)
    return batches if folds > 1 and batches < MIN_FOLD_BATCHES else None


def calibration_batches(n_calibration: int, batch_size: int) -> int:
    """How many calibration batches ``n_calibration`` prompts make in batches of ``batch_size``."""
    return -(-int(n_calibration) // int(batch_size))


def batch_splits(n: int, params: AutoStartParams) -> list[tuple[list[int], list[int]]]:
    """``(fit, held)`` batch indices of a task with ``n`` calibration batches, per split: with
    ``folds`` k >= 2, contiguous folds (``numpy.array_split``; a task with fewer batches than k
    has folds without a batch of its own); with one fold, the last
    :func:`~mergeqp.merge.trust_region.holdout_count` batches held out (none of a one-batch task)."""
    from ..merge.trust_region import holdout_count  # deferred: only the run splits batches

    idx = list(range(n))
    if params.folds <= 1:
        m = holdout_count(n, params.holdout)
        return [(idx[:n - m], idx[n - m:])]
    return [([j for j in idx if j not in part], list(part)) for part in contiguous_parts(n, params.folds)]


def contiguous_parts(n: int, k: int) -> list[range]:
    """``numpy.array_split(range(n), k)`` as ranges: the first ``n % k`` parts one longer (the folds of
    :func:`batch_splits`; :func:`mergeqp.experiments.kfold.contiguous_folds` cuts texts the same way)."""
    q, r = divmod(n, k)
    out, start = [], 0
    for i in range(k):
        size = q + (1 if i < r else 0)
        out.append(range(start, start + size))
        start += size
    return out


def lazy_skipped(params: AutoStartParams, statistics_of: Callable[[str], Any], lazy: bool) -> dict[str, str]:
    """With ``lazy`` (the merge's ``lazy: true``, for models larger than memory; otherwise nothing
    is skipped): the *default* candidates whose statistics need gradients of every weight
    (Fisher), by :attr:`Candidate.key`, with the reason they are skipped: collecting them would
    load every fine-tune whole. A candidate list written out keeps
    them (as an explicit Fisher start does; the report then says the fine-tunes were loaded whole)."""
    if not lazy or "candidates" in params.model_fields_set:
        return {}
    out = {}
    for cand in params.candidates:
        spec = statistics_of(cand.name)
        if spec is not None and not spec.forward_only:
            out[cand.key] = ("lazy: true: its statistics need gradients of every weight, which would load every "
                             "fine-tuned model whole (list the candidates to include it)")
    return out


def statistics_candidates(params: AutoStartParams, statistics_of: Callable[[str], Any],
                          skip: Collection[str] = (),
                          start_statistics: Callable[[Candidate], list[Candidate] | None] = lambda cand: None,
                          ) -> list[Candidate]:
    """The distinct statistics-based merges the candidates need (a method that declares calibration
    statistics, and those a model method's start fit names, ``start_statistics(cand)``: e.g. RegMean
    as the reference of ``output_space`` unless it is the soup; ``None`` for a candidate that is no
    model method), but those whose :attr:`Candidate.key` is in ``skip``: one collector each, fed the
    fit batches while each fine-tune is loaded."""
    out: dict[str, Candidate] = {}
    for cand in params.candidates:
        if cand.key in skip:
            continue
        needs = start_statistics(cand)
        if needs is not None:
            for need in needs:
                out.setdefault(need.key, need)
        elif statistics_of(cand.name) is not None:
            out.setdefault(cand.key, cand)
    return list(out.values())


def candidate_notes(params: AutoStartParams, skipped: Mapping[str, str] | None = None) -> list[str]:
    """The plan's description of the selection (``skipped``: the candidates the run skips before any
    work, ``MergePlan.start_skips``)."""
    how = (f"{params.folds}-fold: each calibration batch scored by the candidate fitted without its fold, the "
           f"chosen one refitted on every batch" if params.folds > 1 else
           f"on the last {params.holdout:g} of each task's calibration batches (fitted on the others)")
    lines = [f"start auto: {len(params.candidates)} candidate(s) "
             f"({', '.join(c.label for c in params.candidates)}), each scored by the objective {how}; the lowest "
             f"is the start"]
    lines += [f"start auto: {c.label} skipped: {skipped[c.key]}" for c in params.candidates if c.key in (skipped or {})]
    return lines


__all__ = ["AUTO", "AUTO_METHOD", "AUTO_MODE_OPTIONS", "AutoStartParams", "Candidate", "CandidateSkipped",
           "CandidateScore", "DEFAULT_CANDIDATES", "MIN_FOLD_BATCHES", "batch_splits", "ScoredCandidate", "StartSelection", "auto_method_config",
           "candidate_notes", "is_auto_start", "named_entries", "parse_auto_params", "select_start",
           "lazy_skipped", "statistics_candidates"]
