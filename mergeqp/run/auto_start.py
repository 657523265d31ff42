"""``start: auto`` during a run: every candidate fitted on the folds of the calibration batches and
scored on the held-out ones (:class:`AutoStart`), and the context a model method's candidate fit
receives (:class:`CandidateFit`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from .schema import MergeConfig, qp_candidate_block
from ..errors import Interrupted, MergeMethodError, MergeQPError, ValidationError, named_failure
from ..lm import OutputSpec
from ..merge.calibrated import StatisticsCollector, statistics_of
from ..merge.firstorder import TaskTargets
from ..merge.modes import get_merge_mode, run_mode
from ..merge.multilayer import HeldOutStart, MergeContext, calibration_objective
from ..merge.trust_region import holdout_count, no_holdout_error, split_tasks
from ..merge.sites import read_augmented, stored_tensors
from .checkpoints import changed_keys
from .merge_plan import MergePlan
from .auto import (
    QP_CANDIDATE,
    AutoStartParams,
    Candidate,
    CandidateSkipped,
    CandidateScore,
    StartSelection,
    batch_splits,
    candidate_where,
    held_out_fit,
    select_start,
    statistics_candidates,
)
from .model_methods import parse_candidate, start_method, start_statistics
from .report import uncertified
from .settings import DEFAULT_CHUNK_BYTES, qp_settings
from .models import load_into
from .outcomes import checked_merge
from .tasks import baseline_merge, statistics_collector


class AutoStartRun(Protocol):
    """What :class:`AutoStart` reads of the run it serves (the pipeline's run of one merge)."""

    cfg: MergeConfig
    plan: MergePlan
    spec: OutputSpec
    device: str

    def say(self, message: str) -> None: ...


class AutoStart:
    """``start: auto`` in a run (:mod:`.auto`). Per statistics-based candidate one collector per
    split (fed each task's fit batches of that split while its fine-tune is loaded) and, with
    k folds, one on every batch for the refit; statistics that pool (RegMean's Grams, Fisher) are
    collected once per batch and pooled per split, so k folds cost one pass over the data. Then
    every candidate scored (a data-free one merged once and scored on every held-out batch; the
    others fitted per split) and the lowest loaded: its one fit, or with k folds its refit on every
    batch."""

    def __init__(self, run: AutoStartRun, params: AutoStartParams):
        self.run = run
        self.params = params
        # a tensor equal in the base and every fine-tune is the base's in every candidate: only
        # the others are merged (and RegMean's statistics are collected for their layers only)
        self.floats = changed_keys(run.plan.base, run.plan.finetuned, run.plan.float_keys())
        # every tensor a candidate's fit may leave changed in the live model: the merged ones and
        # the selected sites' (output_space and the QP candidates write every site they solve)
        self.reset_keys = list(dict.fromkeys([*self.floats, *(k for site in run.plan.sites for k in site.keys)]))
        m = run.cfg.method
        # the batches the mode holds out from its start (trust region with refit): a data-dependent
        # winner is also fitted without them, for the mode's early stopping
        self.mode_holdout = get_merge_mode(m.mode).start_holdout(m.mode_options)
        fits, self.held_out_index = held_out_fit(params, self.mode_holdout)
        # what the plan says the run skips (lazy: true's default Fisher, a model method that fits outputs
        # under a data metric or whose entry's skip gives a reason): skipped before any statistics
        self.skipped = dict(run.plan.start_skips)  # (a copy: candidates skipped at run time join it)
        self.collectors = {c.key: [statistics_collector(run.plan, c.name, c.params, self.floats, run.say)
                                   for _ in range(fits)]
                           for c in statistics_candidates(params, statistics_of, self.skipped, start_statistics)}
        self.notes: list[str] = []

    def load(self, model: Any, tensors: dict[str, Any]) -> None:
        """Load a candidate's ``tensors`` into ``model`` with every other tensor a candidate may
        change (:attr:`reset_keys`) at the base's value: each fit and each score starts from the
        same model whatever ran before it. Loading ``tensors`` alone left what an earlier candidate
        or fold had fitted at the sites they do not cover (an output_space fit rewrote selected
        layers no fine-tune changed): a data-free soup scored 23.0 first and 8.7 after output_space,
        and later folds were scored on weights fitted to their own held-out batches."""
        base = self.run.plan.base
        load_into(model, {**{k: base.get(k) for k in self.reset_keys if k not in tensors}, **tensors})

    def all_collectors(self) -> list[StatisticsCollector]:
        """Every statistics collector of the candidates (all splits)."""
        return [c for per_split in self.collectors.values() for c in per_split]

    def visit(self, index: int, name: str, model: Any, batches: list[Any]) -> None:
        if self.params.folds > 1 and len(batches) < 2:
            raise ValidationError(f"start: auto with {self.params.folds} folds: task {name!r} has "
                                  f"{len(batches)} calibration batch(es), at least 2 are needed (more prompts, a "
                                  f"smaller calibration.batch_size or calibration.holdout, or folds: 1)")
        n = len(batches)
        fits = [fit for fit, _ in batch_splits(n, self.params)]
        if self.params.folds > 1:
            fits.append(list(range(n)))
        if self.held_out_index is not None and self.held_out_index == len(fits):
            fits.append(list(range(n - holdout_count(n, self.mode_holdout))))
        for key, per_split in list(self.collectors.items()):
            try:
                collect_fits(per_split, fits, index, name, model, batches)
            except Interrupted:
                raise
            except MergeQPError as exc:
                # statistics this model cannot give (Fisher's need logits): the candidate is skipped,
                # like one that cannot run here, and the others go on
                self.skipped[key] = f"its statistics could not be collected on {name!r}: {exc}"
                del self.collectors[key]
                self.run.say(f"start auto: {per_split[0].name} statistics skipped: {exc}")


    def _splits(self, tasks: Sequence[TaskTargets]) -> list[tuple[list[TaskTargets], list[TaskTargets]]]:
        """``(fit tasks, held-out tasks)`` per split (tasks without a batch there left out)."""
        per_task = [batch_splits(len(t.batches), self.params) for t in tasks]
        out = []
        for s in range(len(per_task[0])):
            fit = [dataclasses.replace(t, batches=[t.batches[j] for j in p[s][0]]) for t, p in zip(tasks, per_task)]
            held = [dataclasses.replace(t, batches=[t.batches[j] for j in p[s][1]]) for t, p in zip(tasks, per_task)]
            out.append(([t for t in fit if t.batches], [t for t in held if t.batches]))
        if not any(held for _, held in out):
            raise no_holdout_error("start: auto holdout", self.params.holdout)
        return out

    def select(self, ctx: MergeContext) -> StartSelection:
        run = self.run
        splits = self._splits(ctx.tasks)

        def score(tasks: Sequence[TaskTargets]) -> float:
            return calibration_objective(dataclasses.replace(ctx, tasks=tasks)) if tasks else 0.0

        fitted = functools.partial(self._fitted, ctx)

        def evaluate(cand: Candidate) -> CandidateScore:
            if cand.key in self.skipped:
                raise CandidateSkipped(self.skipped[cand.key])
            if not self._needs_data(cand):
                tensors = baseline_merge(run.plan, cand.name, cand.params, self.floats)
                self.load(ctx.model, tensors)
                return sum(score(held) for _, held in splits), lambda: tensors
            total, last = 0.0, {}
            for s, (fit, held) in enumerate(splits):
                if held:
                    last = fitted(cand, s, fit)
                    self.load(ctx.model, last)
                    total += score(held)
            if self.params.folds > 1:
                return total, lambda: fitted(cand, self.params.folds, ctx.tasks)
            return total, lambda: last

        return select_start(self.params, evaluate, lambda tensors: self.load(ctx.model, tensors), run.say)

    def _needs_data(self, cand: Candidate) -> bool:
        return cand.name == QP_CANDIDATE or start_method(cand.name) is not None or cand.key in self.collectors

    def _fitted(self, ctx: MergeContext, cand: Candidate, split: int, fit: Sequence[TaskTargets]) -> dict[str, Any]:
        """``cand``'s tensors fitted on the ``fit`` batches (``split``: the index of its statistics' fit)."""
        entry = start_method(cand.name)
        if entry is not None:  # a model method: its entry's fit (output_space's, a user's)
            assert entry.start is not None
            fitting = CandidateFit(self, ctx, split)
            what = f"start auto: candidate {cand.label}: model method {entry.name!r}: start.fit"
            with named_failure(what, MergeMethodError):  # (CandidateSkipped, an error of ours, passes as it is)
                tensors = entry.start.fit(fitting, parse_candidate(entry, cand), fit)
            if not isinstance(tensors, Mapping):
                raise MergeMethodError(f"{what} returned {type(tensors).__name__}, not a dict of tensors by "
                                       f"checkpoint key")
            # the tensors a candidate may change (the others stay the base's in every candidate's scoring)
            return checked_merge(self.run.plan, self.run.cfg.output_dtype, tensors, self.reset_keys,
                                 lambda why: MergeMethodError(f"{what} {why}"),
                                 "the tensors some fine-tune changed and the selected layers", cast=False,
                                 live=ctx.model)
        if cand.name == QP_CANDIDATE:
            return self.qp(ctx, cand, fit)
        collector = self.collectors[cand.key][split]
        merged = collector.merge(self.run.plan, self.floats, DEFAULT_CHUNK_BYTES)
        self.notes.extend(n for n in collector.notes if n not in self.notes)
        return merged

    def held_out_start(self, ctx: MergeContext, selection: StartSelection) -> HeldOutStart | None:
        """The chosen start as :class:`~mergeqp.merge.multilayer.HeldOutStart` where it was fitted to
        calibration data and the mode holds batches out from its start (``None`` otherwise): its fit
        without those batches, and its fit on every batch (the tensors the model holds now)."""
        chosen = next(c for c in self.params.candidates if c.label == selection.chosen.label)
        if self.held_out_index is None or not self._needs_data(chosen):
            return None
        fit, _ = split_tasks(ctx.tasks, self.mode_holdout)
        tensors = self._fitted(ctx, chosen, self.held_out_index, fit)
        self.load(ctx.model, selection.overrides)
        # (folds: 1 keeps the winner as fitted for its score, on all but the split's held-out batches)
        final = "fitted on every batch" if self.params.folds > 1 else "as fitted for its score (folds: 1)"
        self.notes.append(f"start auto: the trust region's early stopping ran from {chosen.label} fitted without "
                          f"its held-out batches (the last {self.mode_holdout:g} of each task's); the result from "
                          f"{chosen.label} {final}")
        return HeldOutStart(chosen.label, lambda: self.load(ctx.model, tensors),
                            lambda: self.load(ctx.model, selection.overrides))

    def qp(self, ctx: MergeContext, cand: Candidate, fit: Sequence[TaskTargets]) -> dict[str, Any]:
        """A ``{name: qp, params: {...}}`` candidate: its QP mode run from the base on the fit
        batches at the selected layers; every other tensor stays the base's."""
        run = self.run
        where = candidate_where(cand.label)
        block = qp_candidate_block(dict(cand.params), where)
        settings = qp_settings(run.cfg.model_copy(update={"method": block}), run.device)
        tensors = {k: run.plan.base.get(k) for k in self.floats}
        self.load(ctx.model, tensors)
        records = run_mode(dataclasses.replace(ctx, tasks=fit, settings=settings), block.mode, run.plan.sites)
        failed = uncertified(records)
        if failed:
            self.notes.append(f"start auto: candidate {cand.label}'s QP not certified at {failed}")
        for site in run.plan.sites:
            like = {k: run.plan.base.get(k) for k in site.keys}
            tensors.update(stored_tensors(site, read_augmented(ctx.model, site), like))
        return tensors


@dataclasses.dataclass
class CandidateFit:
    """:class:`~.model_method.CandidateContext` of one fit of a model-method candidate (split ``split``
    of ``start: auto``'s batches)."""

    auto: AutoStart
    ctx: MergeContext
    split: int

    @property
    def model(self) -> Any:
        return self.ctx.model

    @property
    def plan(self) -> Any:
        return self.auto.run.plan

    @property
    def spec(self) -> Any:
        return self.auto.run.spec

    @property
    def device(self) -> str:
        return self.auto.run.device

    @property
    def floats(self) -> list[str]:
        return self.auto.floats

    @property
    def notes(self) -> list[str]:
        return self.auto.notes

    @property
    def say(self) -> Callable[[str], None]:
        return self.auto.run.say

    def merge(self, name: str, params: Mapping[str, Any], label: str | None = None) -> dict[str, Any]:
        key = Candidate(name=name, params=dict(params)).key
        if key in self.auto.skipped:
            raise CandidateSkipped(f"its reference {label or name}: {self.auto.skipped[key]}")
        if key in self.auto.collectors:
            return self.auto.collectors[key][self.split].merge(self.plan, self.floats, DEFAULT_CHUNK_BYTES)
        if statistics_of(name) is not None:
            raise ValidationError(f"start auto: the statistics of {name} {dict(params)} were not collected: name them "
                                  f"in the model method's start.statistics")
        return baseline_merge(self.plan, name, dict(params), self.floats)

    def load(self, tensors: Mapping[str, Any]) -> None:
        self.auto.load(self.ctx.model, dict(tensors))

    def changed_sites(self) -> list[Any]:
        changed = set(self.floats)
        return [site for site in self.plan.sites if any(k in changed for k in site.keys)]


def collect_fits(per_split: Sequence[StatisticsCollector], fits: Sequence[Sequence[int]], index: int, name: str,
                  model: Any, batches: list[Any]) -> None:
    """One method's statistics of one fine-tune for every fit (``per_split[i]`` on the batches
    ``fits[i]``; each batch computed once and pooled per fit where the statistics pool)."""
    first = per_split[0]
    if first.poolable:
        parts = first.batch_parts(name, model, batches)
        for collector, fit in zip(per_split, fits):
            collector.pool(index, name, [parts[j] for j in fit])
            collector.notes.extend(n for n in first.notes if n not in collector.notes)
        return
    for collector, fit in zip(per_split, fits):
        collector(index, name, model, [batches[j] for j in fit])


def with_fit_part(full: StatisticsCollector, part: StatisticsCollector, holdout: float
                   ) -> Callable[[int, str, Any, list[Any]], None]:
    """One visitor filling ``full`` with each task's calibration batches and ``part`` with them but
    the last :func:`holdout_count` (``holdout``), each batch's statistics computed once where they pool."""

    def visit(index: int, name: str, model: Any, batches: list[Any]) -> None:
        keep = len(batches) - holdout_count(len(batches), holdout)
        collect_fits([full, part], [list(range(len(batches))), list(range(keep))], index, name, model, batches)
    return visit


def fit_part(visit: Callable[[int, str, Any, list[Any]], None], holdout: float
              ) -> Callable[[int, str, Any, list[Any]], None]:
    """``visit`` fed each task's calibration batches but the last :func:`holdout_count` (``holdout``:
    the fraction a mode holds out to choose on; 0: every batch)."""
    if holdout <= 0:
        return visit

    def fit_only(index: int, name: str, model: Any, batches: list[Any]) -> None:
        visit(index, name, model, batches[:len(batches) - holdout_count(len(batches), holdout)])
    return fit_only


def visit_all(visitors: Sequence[Callable[[int, str, Any, list[Any]], None]]
               ) -> Callable[[int, str, Any, list[Any]], None] | None:
    """One ``prepare_tasks`` visitor that calls each of ``visitors`` in turn (``None`` for none)."""
    if not visitors:
        return None
    if len(visitors) == 1:
        return visitors[0]

    def visit(index: int, name: str, model: Any, batches: list[Any]) -> None:
        for v in visitors:
            v(index, name, model, batches)
    return visit
