"""Merge modes of the multi-layer QP merge, as registry entries (see :mod:`.multilayer` for the maths).

A :class:`MergeMode` owns everything that differs between modes: which sites form one QP
(:meth:`~MergeMode.groups`), where each QP is linearised (:meth:`~MergeMode.linearised_at`), the
config requirements (:attr:`~MergeMode.uses_start`, :attr:`~MergeMode.spans_layers`), what it
keeps in memory, how it runs on a live model (:meth:`~MergeMode.run`), its notes and the extra
fields of its report (:meth:`~MergeMode.prepare`, :meth:`~MergeMode.report_fields`).

Built in: ``single``, ``sequential``, ``hybrid``, ``joint`` and ``trust_region``.
:func:`register_merge_mode` adds one (then ``method.mode: NAME`` selects it in a ``mergeqp
merge`` config). A mode with options declares them as a pydantic model (:attr:`MergeMode.options`);
the config's ``method.mode_options`` block is validated by it (:meth:`MergeMode.check_options`).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic import ValidationError as PydanticError

from ..errors import (MergeMethodError, ValidationError, check_new_name, check_signature, did_you_mean, lookup,
                      named_failure)
from ..formatting import format_number
from ..io.distributed import current_group
from ..lm import forward
from .depth import depth_levels, site_dependencies
from .multilayer import (
    LayerRecord,
    MergeContext,
    apply_weights,
    calibration_objective,
    say,
    solve_group,
    with_exact,
)
from .sites import LayerSite, read_augmented, write_augmented
from .trust_region import TrustRegionConfig, TrustRegionLayerRecord, trust_region_sites

#: ``evaluate(model) -> {"calibration_objective": float, "heldout_mse": {task: float}}``
Evaluator = Callable[[Any], dict[str, Any]]


class MergeMode:
    """A registered merge mode. Subclass it and override what differs (at least :meth:`run`).

    ``name``: the config's ``method.mode``; ``description``: one line for docs and errors;
    ``uses_start``: the mode starts from a baseline merged on every tensor (``method.start``
    is required, and the model holds that merge when :meth:`run` is called); ``spans_layers``:
    one QP may couple several layers (per-layer constraints such as ``sign`` cannot be used);
    ``start_required``: with ``uses_start``, whether ``method.start`` must be given (``False``:
    without it the mode starts from the base model); ``default_constraints``: the constraint
    spellings used when the config gives none (``None``: the config's default ``box:0,1``);
    ``options``: the pydantic model of ``method.mode_options`` (``None``: the mode takes none);
    ``origin_feasible``: the QP's coefficients are corrections from the start, so the constraint
    set must contain ``0`` (the plan checks it before any weight is loaded); ``step_bounded``:
    every QP also bounds its step in a box (a trust region), so the plan names the solver that
    ``auto`` picks for the set with that box.
    """

    name: str = ""
    description: str = ""
    uses_start: bool = False
    start_required: bool = True
    spans_layers: bool = False
    default_constraints: tuple[str, ...] | None = None
    options: type[BaseModel] | None = None
    origin_feasible: bool = False
    step_bounded: bool = False
    #: what ``method.regularisation`` pulls toward in this mode, for the plan's description (``None``:
    #: ``method.reference``, as the QPs of the layer-wise modes use it)
    regularises_toward: str | None = None

    def check_options(self, raw: Mapping[str, Any] | None) -> BaseModel | None:
        """``raw`` (the config's ``method.mode_options``) validated by :attr:`options`; a
        :class:`~mergeqp.errors.ValidationError` names each bad key or value and lists the valid
        keys. A mode without options accepts only an empty block (``None`` is returned)."""
        raw = dict(raw or {})
        if self.options is None:
            if raw:
                raise ValidationError(f"mode: {self.name} takes no mode_options (got {sorted(raw)})")
            return None
        valid = sorted(self.options.model_fields)
        bad = [k for k in raw if k not in valid]
        if bad:
            hint = did_you_mean(bad[0], valid)
            raise ValidationError(f"mode_options: unknown key {bad[0]!r} for mode: {self.name}{hint}; valid keys: "
                                  f"{', '.join(valid)}")
        try:
            return self.options(**raw)
        except PydanticError as exc:
            why = "; ".join((f"{'.'.join(str(x) for x in e['loc'])}: " if e["loc"] else "")
                            + str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
            raise ValidationError(f"mode_options of mode: {self.name}: {why}") from None

    def start_holdout(self, raw: Mapping[str, Any] | None) -> float:
        """The fraction of each task's calibration batches that the mode holds out from a start it
        then refits on (``ctx.held_out_start``; :func:`~.trust_region.holdout_count` batches): a
        start fitted to calibration data is also fitted without them. Default 0: none."""
        return 0.0

    def selection_holdout(self, raw: Mapping[str, Any] | None) -> float:
        """The fraction of each task's calibration batches (:func:`~.trust_region.holdout_count`
        batches, the last ones) on which the mode makes a choice, e.g. early stopping: anything
        fitted to calibration data for the mode's QPs (``rows+baselines`` atoms of RegMean or
        Fisher) is fitted without them. Default 0: none."""
        return 0.0

    # ------------------------------------------------------------------ planning
    def groups(self, sites: Sequence[LayerSite]) -> list[tuple[LayerSite, ...]]:
        """The sites solved together, one tuple per QP, in solve order (default: one per site)."""
        return [(s,) for s in sites]

    def linearised_at(self, start: str | None) -> str:
        """Where each QP is linearised, for the plan (``start``: the hybrid start's method name)."""
        return "the base model"

    def plan_notes(self, settings: Any) -> list[str]:
        """Notes for the plan, from the QP settings (:class:`~.multilayer.QPSettings`)."""
        return []

    def models_in_memory(self, settings: Any) -> int:
        """Full models held at once (the working model, one fine-tuned model, any copies)."""
        return 2

    def deltas_in_memory(self, n_sites: int) -> int:
        """Sites whose residuals are held at once."""
        return 1

    # ------------------------------------------------------------------ running
    def prepare(self, ctx: MergeContext) -> Any:
        """Called before :meth:`run`; what it returns is given to :meth:`report_fields`."""
        return None

    def run(self, ctx: MergeContext, sites: Sequence[LayerSite]) -> list[LayerRecord]:
        """Merge ``sites`` in the live ``ctx.model`` (modified in place); one record per site."""
        raise NotImplementedError(f"merge mode {self.name!r} does not define run")

    def notes(self, records: Sequence[LayerRecord], constraints: Sequence[str], start: str | None) -> list[str]:
        """Notes for the report: the QP objective rose at some layer (d = 0 infeasible, or uncertified)."""
        worse = [r.layer for r in records
                 if r.objective_after > r.objective_before + 1e-9 * abs(r.objective_before)]
        if not worse:
            return []
        return [f"the QP objective rose at {worse}: the starting point (the current weights, d = 0) is not in "
                f"the constraint set {list(constraints)}, so its optimum can lie above it (an L1 ball or simplex "
                f"away from 0), or a `regularisation` toward another point (`reference: soup`) traded the "
                f"objective for closeness to it, or the solve was not certified"]

    def report_fields(self, ctx: MergeContext, sites: Sequence[LayerSite], records: Sequence[LayerRecord],
                      prepared: Any, merged: Mapping[str, Any], evaluate: Evaluator,
                      before: Mapping[str, Any]) -> dict[str, Any]:
        """Extra top-level fields of ``report.json`` (``merged``: the merged model's evaluation;
        ``before``: the evaluation of the model as :meth:`run` began, the start merge or the base,
        already measured by the run layer; ``evaluate(model)`` measures any other model)."""
        return {}

    def report_markdown(self, report: Mapping[str, Any]) -> list[str]:
        """Markdown sections of ``report.md`` for the fields :meth:`report_fields` added (``report``:
        the whole JSON-able ``report.json`` mapping); none by default."""
        return []

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class _KeepStart:
    """``keep_start``: the exact calibration objective before each step, and the weights to restore
    where the step raised it (the start's: a layer-wise mode from a start never ends above it there)."""

    def __init__(self, ctx: MergeContext, on: bool):
        self.ctx, self.on = ctx, on
        self.before: float | None = None

    def save(self, sites: Sequence[LayerSite]) -> list[Any]:
        if not self.on:
            return []
        if self.before is None:
            self.before = calibration_objective(self.ctx)  # the start's (later: the last step's, measured)
        return [read_augmented(self.ctx.model, site) for site in sites]

    def settle(self, sites: Sequence[LayerSite], saved: Sequence[Any], exact: float,
               records: list[LayerRecord]) -> list[LayerRecord]:
        """``records``, marked ``kept_start`` with the saved weights restored where ``exact`` rose above the
        objective before the step."""
        if not self.on:
            return records
        assert self.before is not None
        if exact > self.before:
            for site, weights in zip(sites, saved):
                write_augmented(self.ctx.model, site, weights)
            say(self.ctx, f"  the step raised the exact objective ({self.before:.6g} -> {exact:.6g}): "
                          f"{', '.join(s.name for s in sites)} kept as before it")
            return [dataclasses.replace(r, kept_start=True) for r in records]
        self.before = exact
        return records


def _solve_one_by_one(ctx: MergeContext, sites: Sequence[LayerSite], mode: str, relinearise: bool,
                      keep_start: bool = False) -> list[LayerRecord]:
    """Sites in model order; each solved at the current model and applied before the next
    (``keep_start``: not where it raised the exact calibration objective, :class:`_KeepStart`)."""
    out: list[LayerRecord] = []
    keep = _KeepStart(ctx, keep_start)
    for i, site in enumerate(sites):
        res = solve_group(ctx, [site], mode=mode, group=i, relinearise_offsets=relinearise)
        saved = keep.save([site])
        apply_weights(ctx, [site], res.new_weights)
        t = time.perf_counter()
        exact = calibration_objective(ctx)
        records = with_exact(res.records, exact, time.perf_counter() - t)
        r = records[-1]
        say(ctx, f"[{mode} {i + 1}/{len(sites)}] {site.name}: J {r.objective_before:.6g} -> "
                 f"{r.objective_after:.6g} (exact {exact:.6g}), gap {r.certificate.get('fw_gap')}")
        out.extend(keep.settle([site], saved, exact, records))
    return out


def _solve_by_depth(ctx: MergeContext, sites: Sequence[LayerSite], mode: str, relinearise: bool,
                    keep_start: bool = False) -> list[LayerRecord]:
    """Sites grouped by depth (:mod:`.depth`); the sites of one depth are each linearised at the
    model merged below that depth and solved on their own (spread over the ranks under
    ``torchrun``, like ``single`` mode's sites), then applied together before the next depth
    (``keep_start``: a depth whose steps together raised the exact objective is kept as before)."""
    first = ctx.tasks[0].batches[0]
    levels = depth_levels(sites, site_dependencies(ctx.model, sites,
                                                   lambda: forward(ctx.model, first.batch, ctx.device)))
    index = {s.name: i for i, s in enumerate(sites)}
    say(ctx, f"[{mode} by depth] {len(levels)} depths: "
             + "; ".join(", ".join(s.name for s in level) for level in levels))
    out: list[LayerRecord] = []
    keep = _KeepStart(ctx, keep_start)
    for depth, level in enumerate(levels):
        def solve_site(i: int, site: LayerSite) -> tuple[dict[str, Any], tuple[LayerRecord, ...]]:
            res = solve_group(ctx, [site], mode=mode, group=index[site.name], relinearise_offsets=relinearise)
            return res.new_weights, res.records

        results = (current_group().spread(level, solve_site) if len(level) > 1
                   else [solve_site(0, level[0])])
        saved = keep.save(level)
        for site, (weights, _) in zip(level, results):
            apply_weights(ctx, [site], weights)
        t = time.perf_counter()
        exact = calibration_objective(ctx)
        seconds = time.perf_counter() - t
        say(ctx, f"[{mode} depth {depth + 1}/{len(levels)}] {len(level)} layer(s): exact objective {exact:.6g}")
        out.extend(keep.settle(level, saved, exact, [r for _, records in results for r in with_exact(records, exact, seconds)]))
    return out


class DepthOptions(BaseModel):
    """``method.mode_options`` of ``mode: sequential`` and ``mode: hybrid``.

    ``by_depth``: group the layers by depth (a layer's depth is one more than the deepest
    selected layer whose weights change its input, measured by perturbing each layer once on a
    calibration batch; :mod:`mergeqp.merge.depth`) and linearise every layer of one depth at the
    model merged below it, solve them independently (spread over the ranks under ``torchrun``) and
    apply them together. Default ``false``: one layer after the other in model order, each at the
    model with every earlier layer merged (the paper's scheme). With one layer per depth (e.g.
    the ``down_proj`` of several blocks) both give the same merge."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    by_depth: bool = False


def _step_number(step: Any) -> Any:
    """A step as the run's progress lines and notes count it, from 1 (``report.json``'s ``step`` and
    ``chosen_step`` count from 0)."""
    return step + 1 if isinstance(step, int) else step


def _trust_region_rows(steps: Sequence[Mapping[str, Any]]) -> list[str]:
    """A Markdown table of trust-region steps (:meth:`SitesTrustRegion.step_rows`); a ``held-out``
    column when the steps carry one."""
    held = any("validation" in r for r in steps)
    lines = ["| step | radius | J before | J after (linearised) | J after (true) | rho | accepted | certified | "
             + ("held-out | " if held else "") + "s |",
             "|---|---|---|---|---|---|---|---|" + ("---|" if held else "") + "---|"]
    for r in steps:
        lines.append(f"| {_step_number(r.get('step'))} | {format_number(r.get('radius'), 3)} | {format_number(r.get('objective_before'))} | "
                     f"{format_number(r.get('linearised_after'))} | {format_number(r.get('true_after'))} | "
                     f"{format_number(r.get('rho'), 3)} | {format_number(r.get('accepted'))} | "
                     f"{format_number(r.get('certified'))} | "
                     + (f"{format_number(r.get('validation'))} | " if held else "")
                     + f"{format_number(r.get('seconds'), 3)} |")
    return lines


def _by_depth(mode: MergeMode, settings: Any) -> bool:
    """Whether ``settings.mode_options`` ask ``mode`` to merge layer depth by layer depth."""
    o = mode.check_options(settings.mode_options)
    return isinstance(o, DepthOptions) and o.by_depth


def _depth_notes(mode: MergeMode, settings: Any) -> list[str]:
    if not _by_depth(mode, settings):
        return []
    return [f"{mode.name} by_depth: layers grouped by depth (measured on the first calibration batch: one forward "
            f"pass per layer plus one); the layers of one depth are linearised at the model merged below it, solved "
            f"independently (spread over the ranks under torchrun) and applied together"]


class SingleMode(MergeMode):
    """Each site linearised at the base model and solved on its own; all applied at the end. The
    exact objective after is measured with that site alone applied."""

    name = "single"
    description = "every layer solved independently at the base model"

    def run(self, ctx: MergeContext, sites: Sequence[LayerSite]) -> list[LayerRecord]:
        # independent QPs: under torchrun each rank solves its share of the sites whole (one site:
        # its batches are shared instead, in the statistics), and every rank gets every result
        def solve_site(i: int, site: LayerSite) -> tuple[dict[str, Any], tuple[LayerRecord, ...]]:
            res = solve_group(ctx, [site], mode=self.name, group=i, relinearise_offsets=False)
            return res.new_weights, res.records

        results = (current_group().spread(sites, solve_site) if len(sites) > 1
                   else [solve_site(i, site) for i, site in enumerate(sites)])
        out: list[LayerRecord] = []
        for site, (weights, records) in zip(sites, results):
            before = read_augmented(ctx.model, site)
            apply_weights(ctx, [site], weights)
            t = time.perf_counter()
            exact = calibration_objective(ctx)
            write_augmented(ctx.model, site, before)
            out.extend(with_exact(records, exact, time.perf_counter() - t))
        for site, (weights, _) in zip(sites, results):
            apply_weights(ctx, [site], weights)
        return out


class SequentialMode(MergeMode):
    """The paper's scheme: layer by layer, statistics recomputed on the partially merged model."""

    name = "sequential"
    description = "layer by layer, each linearised at the partially merged model"
    options = DepthOptions

    def linearised_at(self, start: str | None) -> str:
        return "the partially merged model"

    def plan_notes(self, settings: Any) -> list[str]:
        return _depth_notes(self, settings)

    def run(self, ctx: MergeContext, sites: Sequence[LayerSite]) -> list[LayerRecord]:
        if _by_depth(self, ctx.settings):
            return _solve_by_depth(ctx, sites, self.name, relinearise=False)
        return _solve_one_by_one(ctx, sites, self.name, relinearise=False)


class HybridOptions(DepthOptions):
    """``method.mode_options`` of ``mode: hybrid``: ``by_depth`` (:class:`DepthOptions`) and
    ``keep_start`` (default ``true``): where a layer's QP step (a depth's, with ``by_depth``) raised
    the exact calibration objective, keep the weights it had before the step (the start's), so that
    the refinement never ends above its start there. The step can raise it where the start is not a
    point of the QP's parametrisation (TIES, DARE, Fisher, RegMean, ``output_space``: what ``start:
    auto`` often picks) or through the linearisation error (a QA review, stop 73: base 3398 -> RegMean
    start 757 -> hybrid 986 without it). The layer's record says ``kept_start``; ``false``: every step
    is applied, as before stop 73."""

    keep_start: bool = True


class HybridMode(MergeMode):
    """A baseline merged on every tensor first (``start``), then the selected sites refined
    sequentially, linearised at the baseline's weights (its offset accounted for); a step that
    raised the exact calibration objective is not kept (:class:`HybridOptions`)."""

    name = "hybrid"
    description = "the 'start' baseline on all tensors, then the layers refined sequentially"
    uses_start = True
    options = HybridOptions

    def linearised_at(self, start: str | None) -> str:
        return f"the {start or ''} merge"

    def plan_notes(self, settings: Any) -> list[str]:
        return _depth_notes(self, settings)

    def run(self, ctx: MergeContext, sites: Sequence[LayerSite]) -> list[LayerRecord]:
        o = self.check_options(ctx.settings.mode_options)
        keep = bool(getattr(o, "keep_start", True))
        if _by_depth(self, ctx.settings):
            return _solve_by_depth(ctx, sites, self.name, relinearise=True, keep_start=keep)
        return _solve_one_by_one(ctx, sites, self.name, relinearise=True, keep_start=keep)

    def notes(self, records: Sequence[LayerRecord], constraints: Sequence[str], start: str | None) -> list[str]:
        kept = [r.layer for r in records if r.kept_start]
        worse = [r.layer for r in records if not r.kept_start and r.objective_after_exact > r.objective_before]
        why = (f"the QP's merged weight is W_base + sum_a d_a B_a, and the {start} weight of a layer is a feasible "
               f"point only when it has that form (task arithmetic / soup with rows or scalar, not TIES, DARE, "
               f"Fisher or RegMean); the linearisation error can do it too")
        out = []
        if kept:
            out.append(f"hybrid: the QP step raised the exact calibration objective at {kept}, which keep the weights "
                       f"they had before it (mode_options.keep_start): {why}")
        if worse:
            out.append(f"hybrid: the QP step raised the exact calibration objective at {worse}: {why}")
        return out


class JointOptions(BaseModel):
    """``method.mode_options`` of ``mode: joint``.

    ``compare_sequential``: also run the sequential QP on the same layers (on a copy of the model)
    and put the comparison in the report (default ``true``). ``method.compare_sequential`` is the
    older spelling of the same option (the config folds it in here)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    compare_sequential: bool = True


class JointMode(MergeMode):
    """One first-order QP over every site's coefficients, linearised at the base; optionally
    compared with the sequential QP on a copy of the model (:class:`JointOptions`)."""

    name = "joint"
    description = "one QP over all layers' coefficients, linearised at the base model"
    spans_layers = True
    options = JointOptions

    def groups(self, sites: Sequence[LayerSite]) -> list[tuple[LayerSite, ...]]:
        return [tuple(sites)]

    def _compares(self, settings: Any) -> bool:
        o = self.check_options(settings.mode_options)
        return isinstance(o, JointOptions) and o.compare_sequential

    def plan_notes(self, settings: Any) -> list[str]:
        return ["joint mode also runs the sequential QP on the same layers for the report's comparison"
                if self._compares(settings) else "joint mode: no sequential comparison (compare_sequential: false)"]

    def models_in_memory(self, settings: Any) -> int:
        return 2 + (1 if self._compares(settings) else 0)

    def deltas_in_memory(self, n_sites: int) -> int:
        return n_sites

    def prepare(self, ctx: MergeContext) -> Any:
        return copy.deepcopy(ctx.model) if self._compares(ctx.settings) else None

    def run(self, ctx: MergeContext, sites: Sequence[LayerSite]) -> list[LayerRecord]:
        res = solve_group(ctx, list(sites), mode=self.name, group=0, relinearise_offsets=False)
        apply_weights(ctx, sites, res.new_weights)
        t = time.perf_counter()
        exact = calibration_objective(ctx)
        records = with_exact(res.records, exact, time.perf_counter() - t)
        say(ctx, f"[joint] {len(sites)} layers, {res.records[0].n_variables} variables: J "
                 f"{records[0].objective_before:.6g} -> {records[0].objective_after:.6g} (exact {exact:.6g})")
        return records

    def report_markdown(self, report: Mapping[str, Any]) -> list[str]:
        cmp_ = report.get("joint_vs_sequential")
        if not cmp_:
            return []
        lines = ["## Joint QP vs sequential QP on the same layers", "",
                 "| scheme | calibration J (exact) | held-out MSE (mean over tasks) | s |", "|---|---|---|---|"]
        for key in ("joint", "sequential"):
            v = cmp_[key]
            mse = list(v.get("heldout_mse", {}).values())
            mean = sum(mse) / len(mse) if mse else None
            lines.append(f"| {key} | {format_number(v['calibration_objective'])} | {format_number(mean)} | "
                         f"{format_number(v.get('seconds'), 3)} |")
        return ["\n".join(lines)]

    def report_fields(self, ctx: MergeContext, sites: Sequence[LayerSite], records: Sequence[LayerRecord],
                      prepared: Any, merged: Mapping[str, Any], evaluate: Evaluator,
                      before: Mapping[str, Any]) -> dict[str, Any]:
        if prepared is None:
            return {}
        t = time.perf_counter()
        # the sequential mode's own options are not the joint mode's (compare_sequential is joint's)
        seq_ctx = MergeContext(prepared, ctx.weights, ctx.tasks, ctx.spec, dataclasses.replace(ctx.settings, mode_options={}),
                               ctx.device, ctx.model_names, ctx.progress, ctx.log)
        seq_records = get_merge_mode("sequential").run(seq_ctx, sites)
        seq_eval = evaluate(prepared)
        return {"joint_vs_sequential": {
            "joint": {"calibration_objective": merged["calibration_objective"],
                      "heldout_mse": merged["heldout_mse"],
                      "qp_objective": records[0].objective_after,
                      "seconds": records[0].seconds},
            "sequential": {"calibration_objective": seq_eval["calibration_objective"],
                           "heldout_mse": seq_eval["heldout_mse"],
                           "layers": [r.to_json() for r in seq_records],
                           "seconds": time.perf_counter() - t},
        }}


class TrustRegionOptions(BaseModel):
    """``method.mode_options`` of ``mode: trust_region`` (radii in units of the coefficients ``D``,
    infinity norm).

    ``radius``: initial trust-region radius; ``min_radius``: stop when the radius falls below it;
    ``max_radius``: the radius never grows beyond it; ``shrink``: when ``rho`` (true over predicted
    decrease) is below ``shrink_below`` the radius becomes ``shrink`` times the smaller of the
    radius and the rejected step's length; ``grow``: factor when
    ``rho > grow_above`` and the step reached the boundary; ``eta``: a step is accepted when
    ``rho > eta`` (``eta >= 0``: only on a true decrease); ``max_steps``: QP solves in all
    (accepted or not); ``tol``: stop when the predicted decrease is below ``tol`` times the
    current objective; ``holdout``: the fraction of each task's calibration batches held out for
    early stopping (0: none): the QPs and the acceptance use the rest, and the result is the
    accepted point with the lowest held-out objective, the loop stopping after ``patience``
    accepted steps without a new lowest; ``refit``: then run again from the start on every
    calibration batch for as many QP steps as that chose."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    radius: float = Field(default=0.5, gt=0)
    min_radius: float = Field(default=1e-4, gt=0)
    max_radius: float = Field(default=4.0, gt=0)
    shrink: float = Field(default=0.5, gt=0, lt=1)
    grow: float = Field(default=2.0, ge=1)
    eta: float = Field(default=0.1, ge=0, lt=1)
    shrink_below: float = Field(default=0.25, ge=0, lt=1)
    grow_above: float = Field(default=0.75, ge=0, lt=1)
    max_steps: int = Field(default=10, ge=1)
    tol: float = Field(default=1e-9, ge=0)
    holdout: float = Field(default=0.0, ge=0, lt=1)
    patience: int = Field(default=1, ge=1)
    refit: bool = False

    @model_validator(mode="after")
    def _ordered(self) -> TrustRegionOptions:
        if self.min_radius > self.max_radius:
            raise ValueError(f"min_radius ({self.min_radius:g}) must not exceed max_radius ({self.max_radius:g})")
        if not self.min_radius <= self.radius <= self.max_radius:  # (it was capped without a word)
            raise ValueError(f"radius ({self.radius:g}) must lie between min_radius ({self.min_radius:g}) and "
                             f"max_radius ({self.max_radius:g}); raise max_radius to start wider")
        if not self.eta <= self.grow_above:
            raise ValueError(f"need eta ({self.eta:g}) <= grow_above ({self.grow_above:g})")
        if not self.shrink_below <= self.grow_above:
            raise ValueError(f"need shrink_below ({self.shrink_below:g}) <= grow_above ({self.grow_above:g})")
        return self

    def config(self, ridge: float) -> TrustRegionConfig:
        """The loop's settings (``ridge``: weight of ``mu ||D||^2``, toward the start)."""
        return TrustRegionConfig(delta0=self.radius, max_qps=self.max_steps, accept=self.eta,
                                 expand_above=self.grow_above, shrink_below=self.shrink_below, expand=self.grow,
                                 shrink=self.shrink, delta_min=self.min_radius, delta_max=self.max_radius,
                                 tol=self.tol, ridge=ridge, ridge_reference=0.0)


class TrustRegionMode(MergeMode):
    """Trust-region QPs over every selected layer at once, from the ``start`` merge (or the base):
    in the coordinates ``D`` of ``W = W_start + sum_a D_a B_a`` (``D = 0`` is the start), each step
    re-linearises the live model at the current weights, solves the QP over the user's set
    intersected with ``||D - D_current||_inf <= radius`` (certified), and accepts the candidate only
    when the true calibration objective falls (:mod:`.trust_region`). Never worse than the start on
    the calibration objective. Options: :class:`TrustRegionOptions`."""

    name = "trust_region"
    description = ("from the 'start' merge (or the base), trust-region QPs over all layers, re-linearised at "
                   "the merged model, accepted only on a true calibration decrease")
    uses_start = True
    start_required = False
    spans_layers = True
    default_constraints = ()
    options = TrustRegionOptions
    regularises_toward = "the start (D = 0)"
    origin_feasible = True
    step_bounded = True

    def groups(self, sites: Sequence[LayerSite]) -> list[tuple[LayerSite, ...]]:
        return [tuple(sites)]

    def linearised_at(self, start: str | None) -> str:
        return f"the current merge, re-linearised each accepted step (from the {start or 'base'} model)"

    def plan_notes(self, settings: Any) -> list[str]:
        o = self.check_options(settings.mode_options)
        assert isinstance(o, TrustRegionOptions)
        ridge = (f"; regularisation {settings.regularisation:g} ||D||^2 toward the start"
                 if settings.regularisation else "")
        return [f"trust_region: coefficients D of W = W_start + sum_a D_a B_a (D = 0 is the start); up to "
                f"{o.max_steps} QPs over all layers, each linearised at the current merge, over the constraints "
                f"{' & '.join(settings.constraints) or 'none'} and ||D - D_current||_inf <= radius (initial {o.radius:g}); "
                f"a step is accepted when rho = true / predicted decrease > {o.eta:g}; radius x{o.shrink:g} (of the "
                f"step's length when shorter) when rho < {o.shrink_below:g}, x{o.grow:g} (<= {o.max_radius:g}) when rho > {o.grow_above:g} at the "
                f"boundary; stops below radius {o.min_radius:g}, after {o.max_steps} QPs, or when the predicted "
                f"decrease is below {o.tol:g} x the objective{ridge}"
                + (f"; {o.holdout:g} of each task's calibration batches held out: the result is the accepted "
                   f"point with the lowest held-out objective (early stopping, patience {o.patience})"
                   + ("; then as many steps again from the start on every batch (refit)" if o.refit else "")
                   if o.holdout else "")
                + ". Never worse than the start on the calibration objective"]

    def models_in_memory(self, settings: Any) -> int:
        return 2

    def deltas_in_memory(self, n_sites: int) -> int:
        return n_sites

    def start_holdout(self, raw: Mapping[str, Any] | None) -> float:
        o = self.check_options(raw)
        assert isinstance(o, TrustRegionOptions)
        return o.holdout if o.refit else 0.0

    def selection_holdout(self, raw: Mapping[str, Any] | None) -> float:
        o = self.check_options(raw)
        assert isinstance(o, TrustRegionOptions)
        return o.holdout

    def run(self, ctx: MergeContext, sites: Sequence[LayerSite]) -> list[LayerRecord]:
        o = self.check_options(ctx.settings.mode_options)
        assert isinstance(o, TrustRegionOptions)
        return list(trust_region_sites(ctx, sites, o.config(ctx.settings.regularisation), mode=self.name,
                                       holdout=o.holdout, patience=o.patience, refit=o.refit))

    def notes(self, records: Sequence[LayerRecord], constraints: Sequence[str], start: str | None) -> list[str]:
        if not records or not isinstance(records[0], TrustRegionLayerRecord):
            return []
        r = records[0]
        out = [f"trust_region: {r.status}; calibration objective {r.objective_before:.6g} (start: "
               f"{start or 'base'}) -> {r.objective_after_exact:.6g}"]
        if r.objective_after_exact > r.objective_before + 1e-9 * abs(r.objective_before):  # not summation order
            out.append("trust_region: the result's calibration objective is above the start's although no step "
                       "raised it (a regularisation term, or a non-deterministic model)")
        return out

    def report_markdown(self, report: Mapping[str, Any]) -> list[str]:
        """The trust region's steps (before stop 49 in ``report.json`` only). With held-out batches each
        table says which run it is (since stop 52: the fit on the fitting part, whose objectives are of
        that part, was shown under the whole calibration set's start and result without a word, and a
        refit's table hid the selection run): the selection run with its held-out objective per
        accepted step, then the refit."""
        tr = report.get("trust_region")
        if not tr or not tr.get("steps"):
            return []
        start, result = tr.get("start") or {}, tr.get("result") or {}
        holdout = tr.get("holdout") or {}
        lines = ["## Trust-region steps", "",
                 (f"{tr.get('n_accepted')} of {tr.get('n_steps')} QP steps accepted (a step is kept only when the "
                  f"true calibration objective falls); stopped: {tr.get('stop_reason')}; every subproblem certified: "
                  f"{format_number(tr.get('all_certified'))}. Calibration objective "
                  f"{format_number(start.get('calibration_objective'))} (start) -> "
                  f"{format_number(result.get('calibration_objective'))} (result).")]
        mu = tr.get("regularisation") or 0.0
        if mu > 0:  # (stop 54 review: J beside the calibration objective without saying it is another sum)
            lines += ["", (f"With `regularisation: {format_number(mu)}` the J of the steps below is the calibration "
                           f"objective plus mu ||D||^2 (D: the coefficients' change from the start), the merit on "
                           f"which steps are accepted; so is each layer's `objective_after`. The calibration "
                           f"objectives above and `objective_after_exact` are without it.")]
        if holdout:
            chosen = holdout.get("chosen_step")
            kept = "the start (no accepted step lowered it)" if chosen is None else f"step {chosen + 1}"
            lines += ["", (f"Early stopping: {format_number(holdout.get('fraction'), 3)} of each task's calibration "
                           f"batches held out; the QPs fit the rest, so J in the fit's table is that part's objective, "
                           f"and 'held-out' is the held-out part's objective at each accepted point (start "
                           f"{format_number(holdout.get('validation_start'))}, kept {kept}: "
                           f"{format_number(holdout.get('validation_result'))}).")]
            if holdout.get("refit"):
                lines += ["", "Fit on the fitting part (it chose the number of steps):", "",
                          *_trust_region_rows(holdout.get("selection_steps") or []), "",
                          "Refit on every calibration batch for as many steps (its J is the whole calibration "
                          "objective):"]
            else:
                lines += ["", "Fit on the fitting part (the result is its kept point):"]
        lines += ["", *_trust_region_rows(tr["steps"])]
        return ["\n".join(lines)]

    def report_fields(self, ctx: MergeContext, sites: Sequence[LayerSite], records: Sequence[LayerRecord],
                      prepared: Any, merged: Mapping[str, Any], evaluate: Evaluator,
                      before: Mapping[str, Any]) -> dict[str, Any]:
        outcome = getattr(records[0], "outcome", None) if records else None
        if outcome is None:
            return {}
        result = outcome.result
        chooser = outcome.selection or result  # the run whose held-out objective decided
        return {"trust_region": {
            "options": self.check_options(ctx.settings.mode_options).model_dump(),  # type: ignore[union-attr]
            "constraints": list(ctx.settings.constraints),
            # mu of the penalty mu ||D||^2 that the steps' J (and the layer records' objective_after) include
            "regularisation": ctx.settings.regularisation,
            "start": {"calibration_objective": before["calibration_objective"],  # D = 0: the model run began with
                      "heldout_mse": before["heldout_mse"]},
            "result": {"calibration_objective": merged["calibration_objective"],
                       "heldout_mse": merged["heldout_mse"]},
            "steps": outcome.step_rows(), "n_steps": result.n_qps, "n_accepted": result.n_accepted,
            "all_certified": result.all_certified, "stop_reason": result.stop_reason,
            "seconds": result.seconds,
            **({} if chooser.validation is None else {"holdout": {
                "fraction": self.check_options(ctx.settings.mode_options).holdout,  # type: ignore[union-attr]
                "validation_start": chooser.validation_start, "validation_result": chooser.validation,
                "chosen_step": chooser.chosen_step, "refit": outcome.selection is not None,
                **({} if outcome.selection is None else {"selection_steps": outcome.step_rows(chooser)})}}),
        }}


MERGE_MODES: dict[str, MergeMode] = {}


def register_merge_mode(mode: MergeMode) -> MergeMode:
    """Add ``mode`` under ``mode.name`` (explicit registration; a duplicate name is an error).
    Once registered, ``method.mode: NAME`` selects it in a ``mergeqp merge`` config."""
    if not isinstance(mode, MergeMode):
        raise ValidationError(f"register_merge_mode expects a MergeMode instance, got {type(mode).__name__}")
    check_new_name("merge mode", mode.name, MERGE_MODES)
    if type(mode).run is MergeMode.run:
        raise ValidationError(f"merge mode {mode.name!r}: its class {type(mode).__name__} does not override "
                              f"run(ctx, sites) (what the mode does)")
    check_signature("merge mode", mode.name, "run(ctx, sites)", mode.run, (None, []), {})
    if mode.options is not None and not (isinstance(mode.options, type) and issubclass(mode.options, BaseModel)):
        raise ValidationError(f"merge mode {mode.name!r}: options must be None or a pydantic BaseModel class "
                              f"(the fields of method.mode_options), got {mode.options!r}")
    MERGE_MODES[mode.name] = mode
    return mode


def get_merge_mode(name: str) -> MergeMode:
    """The registered mode ``name`` (an unknown name lists the valid ones)."""
    return lookup("merge mode", name, MERGE_MODES)


def run_mode(ctx: MergeContext, mode: str, sites: Sequence[LayerSite]) -> list[LayerRecord]:
    """Run the registered mode ``mode`` on ``sites`` of the live model."""
    entry = get_merge_mode(mode)
    if not sites:
        raise ValidationError("no layers to merge")
    with named_failure(f"merge mode {entry.name!r}", MergeMethodError):
        records = entry.run(ctx, sites)
    # (a user's mode: what it hands back is checked, so that a layer it skipped is not written as
    # the base with a report that says nothing)
    if not isinstance(records, list) or not all(isinstance(r, LayerRecord) for r in records):
        raise ValidationError(f"merge mode {entry.name!r} returned {type(records).__name__}"
                              f"{'' if not isinstance(records, list) else ' with entries that are not LayerRecords'}; "
                              f"its run() must return a list of LayerRecord, one per merged layer")
    done = {r.layer for r in records}
    skipped = [site.name for site in sites if site.name not in done]
    if skipped:
        raise ValidationError(f"merge mode {entry.name!r} returned no record for {skipped[0]}"
                              + (f" and {len(skipped) - 1} more layer(s)" if len(skipped) > 1 else "")
                              + "; every selected layer needs one")
    return records


for _mode in (SingleMode(), SequentialMode(), HybridMode(), JointMode(), TrustRegionMode()):
    register_merge_mode(_mode)
del _mode

__all__ = ["MERGE_MODES", "DepthOptions", "HybridMode", "HybridOptions", "JointMode", "MergeMode", "SequentialMode", "SingleMode",
           "TrustRegionMode", "TrustRegionOptions", "get_merge_mode", "register_merge_mode", "run_mode"]
