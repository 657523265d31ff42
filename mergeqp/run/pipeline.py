"""``mergeqp merge``: run a validated config end to end and write the merged Hugging Face folder.

Order of work (each step only after the previous one succeeded):

1. :func:`~mergeqp.run.plan.build_plan`: every check that needs no weights (paths, architectures,
   tokenizers, layer patterns, method / constraint / solver names); the output folder is checked
   too (it must not overlap an input, and must be empty unless ``overwrite``).
2. Baseline methods: the selected tensors are merged with :func:`mergeqp.merge_state_dicts`, read
   lazily from the checkpoints in chunks of ``chunk_bytes``. Methods that declare calibration
   statistics (Fisher, RegMean) first get them from each fine-tuned model on its calibration
   prompts (:mod:`mergeqp.merge.calibrated`); when
   every model has prompts (and ``evaluate`` is on) each fine-tuned model also gives its
   targets, and the base and the merged model are evaluated with the QP's metrics. A
   tensor-wise baseline without prompts loads no model.
3. QP methods: prompts are tokenised with the base tokenizer; each fine-tuned model is loaded in
   turn (one at a time) to compute its task's teacher-forced targets on the calibration and
   held-out prompts, then freed; the base model is loaded once as the working model; the residuals
   ``delta_k`` of a layer are read lazily from the checkpoints when the layer is solved.
4. The merged folder is written by streaming: merged tensors replace the base's, every other tensor
   is copied from the base checkpoint unchanged (same dtype) -- so the output differs from the base
   exactly at the merged layers. Config and tokenizer files are copied.
5. ``report.json`` and ``report.md`` (per layer: objective before / after, certificate, energy
   fraction, seconds; held-out teacher-forced MSE per task for the base and the merged model),
   from the typed :class:`~mergeqp.run.report.MergeReport`.

The merge mode (:mod:`mergeqp.merge.modes`) decides how the selected layers are solved, what
the plan says about it and the extra report fields; the parametrisation entry how each layer's
atoms are built. A layer whose certificate is missing or failed is never counted as certified.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .schema import MergeConfig
from ..errors import MergeMethodError, MergeQPError, ValidationError, listing, named_failure
from ..plugins import imported_modules
from ..io.calibration import load_tokenizer
from ..io.atomic import check_free_space
from ..io.distributed import agree_everywhere, agree_on, current_group
from ..io.lazy_model import LazyModel, lazy_summary
from ..io.progress import library_bars
from ..io.memory import check_site_memory, estimate_site_memory, memory_limit
from ..io.writer import (WrittenModel, as_written, check_output_folder, parse_size, save_hf_folder,
                         sentence_transformers_note)
from ..lm import teacher_forced_targets
from ..merge.baseline_residuals import statistics_baselines
from ..merge.calibrated import StatisticsCollector, needs_statistics, run_params
from ..merge.firstorder import TaskTargets, check_first_design, largest_design_batch
from ..merge.modes import get_merge_mode, run_mode
from ..merge.multilayer import HeldOutStart, MergeContext, WeightSource, calibration_objective
from ..merge.outputbasis import check_jacobian_size
from ..merge.flags import heldout_regression_notes, zero_residual_notes
from ..merge.report import report_files
from ..merge.sites import read_augmented, site_module, stored_tensors
from ..stats.parametrisation import get_parametrisation
from ..stats.prefix import frozen_prefix
from .architectures import lower_blocks
from .plan import (
    MergePlan,
    build_plan,
    changed_outside,
    check_config_object,
    keeps_base_outside,
    start_outside,
    without_unchanged,
)
from .auto import is_auto_start, parse_auto_params
from .model_method import MethodOutcome, ModelMethod
from .model_methods import entry_call, model_method_of
from .report import BaselineSummary, Evaluation, MergeReport, ModelEvaluation, WrittenOutput, uncertified
from .settings import DEFAULT_CHUNK_BYTES, evaluates_baseline, qp_settings, statistics_method
from . import models
from .models import collect_if_held, load_into, load_model, resolve_device
from .outcomes import checked_merge, checked_report_fields, method_sections
from .tasks import (
    TaskData,
    baseline_merge,
    calibration_batches,
    task_calibration_batches,
    evaluate,
    heldout_metrics,
    prepare_tasks,
    statistics_collector,
)
from .auto_start import AutoStart, fit_part, visit_all, with_fit_part


#: the output folder a report names when ``run_merge(..., write=False)`` wrote nothing
IN_MEMORY = "(in memory)"


@dataclass(frozen=True)
class MergeResult:
    """What :func:`run_merge` produced: the plan, the typed ``summary`` (:class:`MergeReport`;
    :attr:`report` is its ``report.json`` mapping), the output folder and, for QP methods and
    evaluated baselines, the merged in-memory model."""

    plan: MergePlan
    summary: MergeReport
    out_dir: Path
    model: Any = None
    #: with ``run_merge(..., write=False)``: every tensor the merge computed (checkpoint name ->
    #: tensor, as it would have been written; the others are the base's); ``None`` when a folder was written
    tensors: dict[str, Any] | None = None

    @property
    def report(self) -> dict[str, Any]:
        """The ``report.json`` mapping (:meth:`MergeReport.to_json`)."""
        return self.summary.to_json()


# ---------------------------------------------------------------------- main entry
def _protected(cfg: MergeConfig) -> list[Path]:
    return cfg.protected_paths()


def run_merge(cfg: MergeConfig, out_dir: str | Path | None, *, overwrite: bool = False, progress: bool = True,
              log: Callable[[str], None] | None = None, plan: MergePlan | None = None,
              write: bool = True) -> MergeResult:
    """Merge per ``cfg`` into ``out_dir`` (see the module docstring). Returns the plan, the typed
    report and, for QP methods, the merged model (in memory, on the configured device).

    ``write=False`` merges in memory only (for sweeps from Python that evaluate each merge
    themselves): nothing is written, ``out_dir`` may be ``None``, and the result's ``tensors`` holds
    every tensor the merge computed, exactly as the folder would have held them (every other tensor
    is the base's); the report's output folder reads ``(in memory)``."""
    import torch  # optional heavy dependency: the merge runs on torch

    say = log or (lambda msg: None)
    t_start = time.perf_counter()
    check_config_object(cfg, "run_merge")
    if out_dir is None and write:
        raise ValidationError("run_merge: an output folder is needed unless write=False")
    plan = plan or build_plan(cfg)
    out = Path(out_dir if out_dir is not None else IN_MEMORY).expanduser()
    if write:  # under torchrun rank 0 checks (it alone writes) and every rank hears its verdict here
        agree_on(current_group(), lambda: (check_output_folder(out, _protected(cfg), overwrite=overwrite),
                                           check_free_space(out, plan.base.total_bytes, "the merged model")))
    reduced = without_unchanged(plan)  # (the same on every rank: the same files)
    if reduced is not plan:
        say(f"note: {reduced.notes[-1]}")
    plan, cfg = reduced, reduced.config
    device, device_note = resolve_device(cfg.device)
    notes = list(plan.notes) + ([device_note] if device_note else [])
    st_note = sentence_transformers_note(cfg.resolve(cfg.base)) if write else None  # (about the written folder)
    if st_note is not None:
        notes.append(st_note)
    group = current_group()
    if group.world_size > 1:  # (the report of a torchrun launch says so: a QA review, stop 76)
        notes.append(f"{group.world_size} processes (torchrun, {group.backend} backend) shared the calibration "
                     f"batches and the sites")
    # a fine-tune's changes outside the selection: not merged, or merged by the start alone: said
    outside = changed_outside(plan) if keeps_base_outside(plan) else start_outside(plan)
    notes.extend(outside)
    for note in outside:
        say(f"note: {note}")
    dtype = getattr(torch, cfg.dtype)
    torch.manual_seed(cfg.seed)
    run = _Run(plan, out, overwrite, device, dtype, notes, say, progress, t_start, write)
    # every site's statistics and solve are checked against the memory limit
    with memory_limit(cfg.max_memory_bytes()), library_bars(progress):
        model_method = model_method_of(cfg)
        if model_method is not None:
            return run.model_method(model_method)
        if cfg.method.is_qp:  # (under torchrun a refusal of any rank, from the memory it sees, stops every rank)
            agree_everywhere(current_group(), lambda: check_groups_fit(plan))
            return run.qp()
        return run.baseline()


def check_groups_fit(plan: MergePlan) -> None:
    """Refuse (exit 2) a QP whose statistics and solve alone (``n_tasks`` sums of ``n x n`` float64
    and the solver's copies of one: exact sizes, known from the plan) exceed the memory available or
    ``max_memory``: the check each QP makes before its sums are allocated
    (:func:`mergeqp.merge.firstorder.collect_first_order`), made before any weight is loaded,
    instead of after the start candidates, targets and earlier QPs have taken their minutes."""
    n_tasks = len(plan.config.models)
    for group in plan.groups:
        check_site_memory(estimate_site_memory(", ".join(group.sites), group.n_variables, n_tasks))


@dataclass
class _Run:
    """One merge in progress: what every step shares."""

    plan: MergePlan
    out: Path
    overwrite: bool
    device: str
    dtype: Any
    notes: list[str]
    say: Callable[[str], None]
    progress: bool
    t_start: float
    write: bool = True

    def __post_init__(self) -> None:
        cfg = self.plan.config
        self.cfg = cfg
        self.spec = self.plan.output_spec()
        self.eval_spec = self.plan.heldout_spec()
        self.next_token = self.plan.not_causal is None  # next-token cross-entropy means something

    def _finish(self, overrides: dict[str, Any], report_fields: dict[str, Any], model: Any,
                sections: Callable[[dict[str, Any]], Sequence[str]] | None = None) -> MergeResult:
        """Write the merged folder with its ``report.json`` / ``report.md`` inside, atomically (the
        folder appears complete with its report, or not at all), and return the result. ``sections``:
        a model method's own Markdown sections of the JSON-able report (the QP's come from its merge
        mode and parametrisation)."""
        cfg = self.cfg
        evaluation = report_fields.get("evaluation")
        if evaluation is not None:
            self.notes.extend(n for n in heldout_regression_notes(evaluation.to_json(), cfg.output.metric)
                              if n not in self.notes)
        made: list[MergeReport] = []

        def report_of(written: Any) -> dict[str, str]:
            report = MergeReport(plan=self.plan.to_json(), device=self.device, notes=tuple(self.notes),
                                 imports=tuple(imported_modules()),
                                 output=WrittenOutput.of(written), seconds=time.perf_counter() - self.t_start,
                                 **report_fields)
            made.append(report)
            if not cfg.method.is_qp:
                return report_files(report.to_json(), method_sections=sections)
            return report_files(report.to_json(), get_merge_mode(cfg.method.mode).report_markdown,
                                get_parametrisation(cfg.method.parametrisation).report_markdown)

        if not self.write:  # in memory only: the report says nothing was written
            report_of(WrittenModel(Path(IN_MEMORY), (), 0, 0, (), None))
            return MergeResult(self.plan, made[-1], self.out, model, tensors=_as_written(overrides, cfg.output_dtype))
        # rank 0 writes (a non-finite tensor in the output dtype, a full disk): every rank hears of it here
        agree_on(current_group(), lambda: save_hf_folder(
            self.out, _stream(self.plan, overrides), source_folder=cfg.resolve(cfg.base),
            tokenizer_folder=self.plan.tokenizer_folder, max_shard_bytes=parse_size(cfg.max_shard_size),
            protected=_protected(cfg), overwrite=self.overwrite, dtype=cfg.output_dtype, extra_files=report_of,
            # a tensor kept from the base: its NaN / inf are the base's, named so (a QA review, stop 73)
            origin=lambda name: ("the merged model" if name in overrides
                                 else f"the base ({self.plan.base.path}), kept in the merged model")))
        if not current_group().is_writer():  # another rank of a torchrun launch: the same report, nothing written
            report_of(WrittenModel(self.out, (), 0, 0, (), None))
        return MergeResult(self.plan, made[-1], self.out, model)

    # ------------------------------------------------------------------ QP
    def _load_base(self) -> tuple[Any, LazyModel | None]:
        """The base model to merge into, and with ``lazy: true`` its :class:`LazyModel` (the blocks
        below every site stay on disk: only the linearised path is resident), else ``None``."""
        plan, cfg = self.plan, self.cfg
        if cfg.lazy:
            lazy = models.load_lazy(plan.base, cfg.resolve(cfg.base), self.dtype, self.device, lower_blocks(plan.sites))
            return lazy.model, lazy
        return models.load_model(plan.base, cfg.resolve(cfg.base), self.dtype, self.device), None

    def _check_first_design(self) -> None:
        """:meth:`_check_first_design_here` on every rank, a refusal of any stopping every rank at this
        step (rank 0 printing it; before, one rank's refusal was printed nowhere)."""
        agree_everywhere(current_group(), self._check_first_design_here)

    def _check_first_design_here(self) -> None:
        """The statistics' check of their largest batch's design (:func:`check_first_design`), made
        before the fine-tunes' targets and any start selection (minutes on a language model): the
        base model stands in for the first fine-tune (the compared outputs have the same shape) on
        the first task's largest calibration batch (:func:`largest_design_batch`), and is freed. A batch
        that cannot be read here is left to the run, which names it. A later task's larger batch is
        checked by the statistics themselves, before its design is built."""
        plan, cfg = self.plan, self.cfg
        if not str(self.device).startswith("cpu") or not plan.tasks or not cfg.models[0].prompts():
            return
        try:
            tok = load_tokenizer(plan.tokenizer_folder) if plan.tokenizer_folder else None
            calib, _ = calibration_batches(cfg, 0, tok, plan.max_length)
        except MergeQPError:
            return
        if not calib:
            return
        model = self._load_base()[0]
        head = plan.heads[0] if plan.heads else None
        try:
            largest = largest_design_batch(calib, self.spec)  # of task 0
            stand_in = teacher_forced_targets(model, [largest], self.spec, self.device, head)
        except Exception:  # noqa: BLE001 - the model and its inputs: the run names what fails, with the model
            return
        by_name = {site.name: site for site in plan.sites}
        alive = weakref.ref(model)
        try:
            check_first_design(model, [([by_name[s] for s in g.sites], g.n_variables) for g in plan.groups],
                               [TaskTargets(cfg.model_names()[0], 1.0, stand_in)], self.spec, self.device)
        finally:
            del model, stand_in
            collect_if_held(alive)  # before the fine-tunes load

    def _held_out_start(self, model: Any, name: str, fit: dict[str, Any], full: dict[str, Any],
                        holdout: float) -> HeldOutStart:
        """The start ``name`` (fitted to calibration data) as the trust region's early stopping
        needs it: ``fit`` its tensors fitted without the mode's held-out batches, ``full`` on every
        batch (what ``model`` holds now)."""
        self.notes.append(f"start {name}: the trust region's early stopping ran from {name} fitted without its "
                          f"held-out batches (the last {holdout:g} of each task's), the refit from {name} fitted "
                          f"on every batch")
        return HeldOutStart(name, lambda: load_into(model, fit), lambda: load_into(model, full))

    def qp(self) -> MergeResult:
        plan, cfg, device, say = self.plan, self.cfg, self.device, self.say
        m = cfg.method
        self._check_first_design()
        collector = held_collector = None
        start_holdout = 0.0
        if statistics_method(cfg) is not None:  # a hybrid start with statistics: those of every tensor
            assert m.start is not None
            collector = statistics_collector(plan, m.start.name, m.start.params, plan.float_keys(), say)
            # a mode that holds batches out from its start (trust region with refit): the start is
            # also fitted without them, as start: auto's winner is (before stop 54 early stopping
            # scored a RegMean / Fisher start on batches that start had been fitted to)
            start_holdout = get_merge_mode(m.mode).start_holdout(m.mode_options)
            if start_holdout > 0:
                held_collector = statistics_collector(plan, m.start.name, m.start.params, plan.float_keys(), say)
        auto = AutoStart(self, parse_auto_params(m.start.params)) if is_auto_start(m.start) else None
        # rows+baselines atoms of baselines with calibration statistics: collected on the sites' tensors
        site_keys = plan.site_keys()
        atom_collectors = [statistics_collector(plan, n, p, site_keys, say)
                           for n, p in statistics_baselines(m.baseline_choices)]
        # the batches on which the mode chooses (the trust region's early stopping) are not seen by the atoms
        atom_holdout = get_merge_mode(m.mode).selection_holdout(m.mode_options) if atom_collectors else 0.0
        atom_visitors = [fit_part(c, atom_holdout) for c in atom_collectors]
        start_visitor = (auto.visit if auto is not None else
                         with_fit_part(collector, held_collector, start_holdout) if held_collector is not None
                         else collector)
        visitors = [v for v in (start_visitor, *atom_visitors) if v is not None]
        lazy_models = self._lazy_fine_tunes([*atom_collectors, *(c for c in (collector, held_collector) if c is not None),
                                             *(auto.all_collectors() if auto is not None else [])])
        tasks = prepare_tasks(plan, self.spec, self.eval_spec, self.dtype, device, say, visit=visit_all(visitors),
                              lazy=lazy_models, notes=self.notes)
        if get_parametrisation(m.parametrisation).needs_output_jacobian(m.parametrisation_options()):
            c = max(tb.sample_size for t in tasks for tb in t.calibration)
            for site in plan.sites:  # before any model is linearised
                check_jacobian_size(site.name, c, site.r, parse_size(m.basis_max_size))
        model, base_lazy = self._load_base()
        task_targets = [TaskTargets(t.name, t.weight, t.calibration) for t in tasks]
        settings = qp_settings(cfg, device)
        if atom_collectors:
            t = time.perf_counter()
            merges = {c.name: c.merge(plan, site_keys, DEFAULT_CHUNK_BYTES) for c in atom_collectors}
            settings = dataclasses.replace(settings, baseline_merges=merges)
            which = (f"the calibration batches but the last {atom_holdout:g} of each task's, which the "
                     f"{m.mode} mode holds out to choose on (so that its choice sees them unseen)"
                     if atom_holdout > 0 else "every calibration prompt")
            self.notes.append(
                f"rows+baselines: the atoms of {', '.join(merges)} are their merges of the merge layers with statistics "
                f"of {which} (held-out evaluation prompts excluded; {time.perf_counter() - t:.1f} s to merge)")
            for c in atom_collectors:
                self.notes.extend(n for n in c.notes if n not in self.notes)
        weights = WeightSource(plan.base, plan.finetuned)
        ctx = MergeContext(model, weights, task_targets, self.spec, settings, device, cfg.model_names(),
                           self.progress, say)

        def evaluate_model(live: Any) -> dict[str, Any]:
            """The QP's calibration objective and the held-out metrics of a live model."""
            return {"calibration_objective": calibration_objective(dataclasses.replace(ctx, model=live)),
                    **heldout_metrics(live, tasks, self.eval_spec, device, self.next_token)}

        # the blocks below every merge site are computed once per batch for the whole run
        with frozen_prefix(model, [site_module(model, site) for site in plan.sites]) as prefix:
            before = evaluate_model(model)  # the model as the mode's run begins: the base, or the start below
            base_eval = ModelEvaluation(**before)
            start_eval = None
            start_overrides: dict[str, Any] = {}
            mode = get_merge_mode(m.mode)
            selection = None
            if auto is not None:  # the start chosen among candidates on held-out calibration batches
                t = time.perf_counter()
                selection = auto.select(ctx)
                start_overrides = selection.overrides
                ctx = dataclasses.replace(ctx, held_out_start=auto.held_out_start(ctx, selection))
                before = evaluate_model(model)
                start_eval = ModelEvaluation(**before, method=selection.chosen.name,
                                             params=run_params(selection.chosen.name, selection.chosen.params),
                                             seconds=time.perf_counter() - t)
                self.notes.extend(n for n in auto.notes if n not in self.notes)
            elif mode.uses_start and m.start is not None:  # a mode whose start is optional starts from the base
                t = time.perf_counter()
                floats = plan.float_keys()
                if collector is not None:
                    start_overrides = collector.merge(plan, floats, DEFAULT_CHUNK_BYTES)
                else:
                    start_overrides = baseline_merge(plan, m.start.name, m.start.params, floats)
                load_into(model, start_overrides)
                if held_collector is not None:
                    ctx = dataclasses.replace(ctx, held_out_start=self._held_out_start(
                        model, m.start.name, held_collector.merge(plan, floats, DEFAULT_CHUNK_BYTES),
                        start_overrides, start_holdout))
                before = evaluate_model(model)
                start_eval = ModelEvaluation(**before, method=m.start.name, params=run_params(m.start.name, m.start.params),
                                             seconds=time.perf_counter() - t,
                                             statistics=collector.summary() if collector is not None else None)
                if collector is not None:
                    self.notes.extend(n for n in collector.notes if n not in self.notes)
            prepared = mode.prepare(ctx)
            records = run_mode(ctx, m.mode, plan.sites)
            start_name = selection.chosen.label if selection is not None else (m.start.name if m.start else None)
            mode_notes = mode.notes(records, m.constraints, start_name)
            # a start-based mode's notes explain the records; the others' follow the certificate note
            self.notes.extend(mode_notes if mode.uses_start else [])
            failed = uncertified(records)  # a missing or failed certificate is never certified
            if failed:
                why = "; ".join(dict.fromkeys(str(x) for r in records for x in r.certificate.get("reasons", [])))
                self.notes.append(f"QP solution NOT certified at {failed}: {why or 'see the certificates'}")
            self.notes.extend([] if mode.uses_start else mode_notes)
            for r in records:
                if r.residual_norms:
                    self.notes.extend(n for n in zero_residual_notes(r.layer, r.residual_norms, cfg.model_names())
                                      if n not in self.notes)
            for why in dict.fromkeys(r.head_not_folded for r in records if r.head_not_folded):
                self.notes.append(f"output.fold_head: auto compared the vocabulary-size logits (statistics cost more "
                                  f"time and memory): the head was not folded into the final hidden state because "
                                  f"{why}")
            merged = evaluate_model(model)
            mode_fields = mode.report_fields(ctx, plan.sites, records, prepared, merged, evaluate_model, before)
            if selection is not None:
                mode_fields = {"start_selection": selection.to_json(), **mode_fields}
        if prefix is not None and prefix.note:
            self.notes.append(prefix.note)
        if cfg.lazy:
            self.notes.append(_lazy_note(lazy_summary([base_lazy]), lazy_models or []))
        del prepared
        overrides = dict(start_overrides)
        for site in plan.sites:
            # stored in the base checkpoint's dtype, unless output_dtype says otherwise (the writer casts)
            like = None if cfg.output_dtype else {k: plan.base.get(k) for k in site.keys}
            overrides.update(stored_tensors(site, read_augmented(model, site), like))
        evaluation = Evaluation(base=base_eval, start=start_eval, merged=ModelEvaluation(**merged))
        return self._finish(overrides, {"layers": tuple(records), "evaluation": evaluation,
                                        "mode_fields": mode_fields}, model)

    def _lazy_fine_tunes(self, collectors: Sequence[StatisticsCollector]) -> list[dict[str, Any]] | None:
        """With ``lazy: true``, a list for :func:`prepare_tasks` to load the fine-tunes with every
        block on disk; ``None`` (loaded whole) without it, or when a statistics collector needs
        gradients of every weight (Fisher), which a note says."""
        if not self.cfg.lazy:
            return None
        heavy = sorted({c.name for c in collectors if not c.spec.forward_only})
        if heavy:
            self.notes.append(f"lazy: the fine-tuned models were loaded whole: the {', '.join(heavy)} "
                              "statistics need gradients of every weight")
            return None
        return []

    # ------------------------------------------------------------------ baselines
    def baseline(self) -> MergeResult:
        """A baseline method: statistics (a method that declares them) and targets (evaluation)
        while each fine-tuned model is loaded, the merge of the selected tensors, the evaluation
        of the base and the merged model, the folder and the report."""
        plan, cfg, device, say = self.plan, self.cfg, self.device, self.say
        name, params = cfg.method.name, cfg.method.params
        keys = plan.merged_keys()
        collector = statistics_collector(plan, name, params, keys, say) if needs_statistics(name) else None
        evaluated = evaluates_baseline(cfg)
        tasks: list[TaskData] = []
        t = time.perf_counter()
        if collector is not None or evaluated:
            tasks = prepare_tasks(plan, self.spec, self.eval_spec, self.dtype, device, say, targets=evaluated,
                                  visit=collector, notes=self.notes)
        t_stats = time.perf_counter() - t
        t = time.perf_counter()
        if collector is not None:
            merged = collector.merge(plan, keys, DEFAULT_CHUNK_BYTES)
        else:
            unchanged = [True] * len(plan.finetuned)
            merged = baseline_merge(plan, name, params, keys, unchanged=unchanged)
            same = [n for n, u in zip(cfg.model_names(), unchanged) if u]
            if same:  # (the QP says so of a zero residual; a baseline counted it silently: stop 56 review)
                self.notes.append(
                    f"{listing([repr(n) for n in same], 3)} hold{'s' if len(same) == 1 else ''} the base's values in "
                    f"every merged tensor (a zero task vector, or the base saved in another dtype): {name} still "
                    f"counts {'it' if len(same) == 1 else 'them'} as a model (a soup is pulled toward the base); "
                    f"leave {'it' if len(same) == 1 else 'them'} out if that is not meant")
        summary = BaselineSummary(name, run_params(name, params), len(merged), time.perf_counter() - t + t_stats,
                                  collector.summary() if collector is not None else None)
        if collector is not None:
            self.notes.extend(n for n in collector.notes if n not in self.notes)
        model = None
        evaluation = None
        if evaluated:
            model = models.load_model(plan.base, cfg.resolve(cfg.base), self.dtype, device)
            base_eval = ModelEvaluation(**evaluate(model, tasks, self.spec, self.eval_spec, device, self.next_token))
            load_into(model, merged)
            merged_eval = ModelEvaluation(**evaluate(model, tasks, self.spec, self.eval_spec, device, self.next_token), method=name)
            evaluation = Evaluation(base=base_eval, merged=merged_eval)
        return self._finish(merged, {"baseline": summary, "evaluation": evaluation}, model)


    # ------------------------------------------------------------------ model methods
    def model_method(self, method: ModelMethod) -> MergeResult:
        """A model method (:mod:`.model_methods`, e.g. ``output_space``): it runs with this run as its
        :class:`~.model_method.RunContext`; its merged tensors are written with the report (its
        parameters, seconds, evaluation and report fields)."""
        cfg = self.cfg
        params = entry_call(method, "parse", method.parse, cfg.method.params, "method")
        with named_failure(f"model method {method.name!r}", MergeMethodError):
            outcome = method.run(self, params)
        merged = self._checked_tensors(method.name, outcome)
        extra = checked_report_fields(method.name, outcome.report_fields)
        summary = BaselineSummary(cfg.method.name, dict(outcome.params), len(merged), outcome.seconds,
                                  kind="model method")
        fields: dict[str, Any] = {"baseline": summary, "evaluation": outcome.evaluation}
        if extra:
            fields["mode_fields"] = extra
        return self._finish(merged, fields, outcome.model,
                            None if method.report_markdown is None else method_sections(method))

    def _checked_tensors(self, name: str, outcome: Any) -> dict[str, Any]:
        """What a (user's) model method hands back, checked before anything is written: a
        :class:`MethodOutcome` whose ``merged`` sets at least one tensor, each a floating-point tensor
        of one of the selected layers' checkpoint keys with the base's shape; cast to the base
        tensor's dtype unless ``output_dtype`` says otherwise (the writer casts then)."""
        def bad(why: str) -> MergeMethodError:
            return MergeMethodError(f"model method {name!r} {why}")

        if not isinstance(outcome, MethodOutcome):
            raise bad(f"returned {type(outcome).__name__}, not a MethodOutcome")
        if not isinstance(outcome.merged, Mapping):
            raise bad(f"returned merged as {type(outcome.merged).__name__}, not a dict of tensors by checkpoint key")
        if not outcome.merged:
            raise bad("returned no merged tensor (MethodOutcome.merged is empty): the output would be the base model")
        return checked_merge(self.plan, self.cfg.output_dtype, outcome.merged, self.plan.merged_keys(), bad,
                             "the selected layers ('layers' selects the tensors a merge may set)")

    # the RunContext of a model method
    def prepare_tasks(self, visit: Any = None) -> list[TaskData]:
        return prepare_tasks(self.plan, self.spec, self.eval_spec, self.dtype, self.device, self.say, visit=visit,
                             notes=self.notes)

    def calibration_batches(self) -> list[list[Any]]:
        return task_calibration_batches(self.plan)

    def statistics_collector(self, name: str, params: dict[str, Any], keys: Sequence[str]) -> StatisticsCollector:
        return statistics_collector(self.plan, name, params, keys, self.say)

    def collected_merge(self, collector: StatisticsCollector, keys: Sequence[str]) -> dict[str, Any]:
        merged = collector.merge(self.plan, keys, DEFAULT_CHUNK_BYTES)
        self.notes.extend(n for n in collector.notes if n not in self.notes)
        return merged

    def baseline_merge(self, name: str, params: dict[str, Any], keys: Sequence[str]) -> dict[str, Any]:
        return baseline_merge(self.plan, name, params, keys)

    def load_base_model(self) -> Any:
        return models.load_model(self.plan.base, self.cfg.resolve(self.cfg.base), self.dtype, self.device)

    def load(self, model: Any, tensors: Mapping[str, Any]) -> None:
        load_into(model, dict(tensors))

    def evaluate(self, model: Any, tasks: Sequence[TaskData], **described: Any) -> ModelEvaluation:
        return ModelEvaluation(**evaluate(model, tasks, self.spec, self.eval_spec, self.device, self.next_token),
                               **described)


def _lazy_note(base: dict[str, Any], finetunes: Sequence[dict[str, Any]]) -> str:
    """The report note of a lazy merge (:func:`~mergeqp.io.lazy_model.lazy_summary` of the base and
    of each fine-tune)."""
    mib = 2 ** 20
    note = (f"lazy: {base['lazy_blocks']} block(s) below the merge sites stayed on disk ({base['lazy_bytes'] / mib:.1f} "
            f"MiB; {base['resident_bytes'] / mib:.1f} MiB resident), read {base['block_loads']} time(s)")
    if finetunes:
        note += (f"; each fine-tuned model ran with all {finetunes[0]['lazy_blocks']} blocks on disk "
                 f"({max(f['resident_bytes'] for f in finetunes) / mib:.1f} MiB resident)")
    return note


def _as_written(overrides: Mapping[str, Any], output_dtype: str | None) -> dict[str, Any]:
    """The merged tensors as :func:`save_hf_folder` would write them: floating tensors cast to
    ``output_dtype`` (when set), detached CPU copies, NaN / inf refused with the tensor's name."""
    import torch  # optional heavy dependency: the merge runs on torch

    cast = getattr(torch, output_dtype) if output_dtype else None
    out = {}
    for name, tensor in overrides.items():
        out[name] = as_written(name, tensor, cast, "the merged model")
    return out


def _stream(plan: MergePlan, overrides: dict[str, Any]):
    """``(name, tensor)`` in the base checkpoint's order: merged tensors, else the base's (read
    without a memory map, so writing a large model does not map its whole file into memory)."""
    for name in plan.base.names():
        tensor = overrides.get(name)
        yield name, (tensor if tensor is not None else plan.base.read(name))


__all__ = ["MergeResult", "baseline_merge", "load_model", "prepare_tasks", "resolve_device", "run_merge",
           "statistics_collector"]
