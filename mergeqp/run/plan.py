"""Validate a ``mergeqp merge`` config against its checkpoints and build the plan, loading no weights.

Everything here reads only metadata: ``config.json``, safetensors headers (names, dtypes,
shapes), tokenizer files, prompt files, and a ``meta``-device skeleton of the architecture
(module types without storage). Errors found here (missing files, models of different
architectures, tokenizer mismatch, a layer pattern that matches nothing, a bad constraint or
solver name) are raised before any tensor is loaded. ``mergeqp merge --dry-run`` prints
:meth:`MergePlan.render`.
"""

from __future__ import annotations


import fnmatch
import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .architectures import ARCHITECTURES, causal_lm_obstacle, lower_blocks
from .auto import (
    AUTO,
    MIN_FOLD_BATCHES,
    QP_CANDIDATE,
    candidate_notes,
    candidate_where,
    held_out_fit,
    is_auto_start,
    lazy_skipped,
    parse_auto_params,
    statistics_candidates,
    too_few_batches,
)
from .checkpoints import (aligned_checkpoints, changed_keys, check_architectures, check_decoder_inputs,
                          check_tokenizers, has_tokenizer, output_fields, same_stored_value, skeleton,
                          stored_names)
from .schema import MergeConfig, check_paths, qp_candidate_block
from ..constraints import as_constraint_set, check_feasible, layer_constraint, layer_context, parse_constraint
from ..errors import ConfigError, MergeQPError, ValidationError, unknown
from ..io.calibration import (
    holdout_count,
    is_tensor_file,
    load_tokenizer,
    read_labelled_prompts,
    read_prompts,
    read_tensor_inputs,
    split_holdout,
    tensor_labels,
)
from ..io.checkpoint import DTYPE_BYTES, Checkpoint, open_checkpoint
from ..io.arrays import read_head, read_matrix
from ..io.memory import SiteMemory, design_bytes, estimate_site_memory, human_bytes
from ..io.writer import parse_size
from ..merge.calibrated import check_params, statistics_methods, statistics_of
from ..merge.modes import MergeMode, get_merge_mode
from ..merge.firstorder import widest_layer
from ..merge.outputbasis import basis_pass_bytes, jacobian_bytes
from ..lm import (MAX_SKETCH_ENTRIES, ClassifierHead, OutputSpec, backbone, keeps_head_targets,
                  linear_head)
from ..output_metrics import output_metric
from ..merge.baseline_residuals import statistics_baselines
from ..merge.registry import MERGE_METHODS, get_merge_method
from ..merge.sites import (
    LayerSite,
    listing,
    match_sites,
    model_sites,
    module_hint,
    shared_linear_layers,
    site_matches,
    tied_match,
)
from ..problem import MergeQP
from ..solvers.registry import choose_solver, declines, get_solver
from ..stats.linearise import choose_mode
from ..stats.parametrisation import Parametrisation, get_parametrisation
from .model_methods import (MODEL_METHODS, baseline_clash, entry_call, method_names, model_method_of, parse_candidate,
                            start_method, start_statistics)
from .settings import DEFAULT_CHUNK_BYTES, qp_settings

@dataclass(frozen=True)
class TaskPlan:
    name: str
    checkpoint: str
    prompts_file: str | None
    n_prompts: int
    n_calibration: int
    n_heldout: int
    weight: float
    #: the classifier head file, its classes, and the prompts' label field (classification objective)
    head: str | None = None
    classes: int | None = None
    label_field: str | None = None


@dataclass(frozen=True)
class GroupPlan:
    """One QP: the sites solved together, its variable count and solver."""

    sites: tuple[str, ...]
    n_variables: int
    solver: str
    linearised_at: str


@dataclass
class MergePlan:
    """What a merge will do (JSON-able via :meth:`to_json`)."""

    config: MergeConfig
    base: Checkpoint
    finetuned: list[Checkpoint]
    architecture: str
    model_type: str | None
    sites: list[LayerSite]
    extra_tensors: list[str]
    tasks: list[TaskPlan]
    groups: list[GroupPlan]
    vocab_size: int | None
    tokenizer_folder: str | None
    memory: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: the architecture on the ``meta`` device (module structure, no storage)
    skeleton: Any = field(default=None, repr=False, compare=False)
    #: ``output.matrix`` read from its file once (``None`` when the config names none)
    output_matrix: Any = field(default=None, repr=False, compare=False)
    #: each model's classifier ``head`` read once (:class:`mergeqp.lm.ClassifierHead`; ``None``
    #: where the config names none)
    heads: list[Any] = field(default_factory=list, repr=False, compare=False)
    #: tokens of the longest calibration prompt (text prompts, tokenised by the plan; ``None`` when
    #: not measured: tensor inputs, or no tokenizer)
    longest_prompt: int | None = None
    #: why the base is not a causal language model (``None``: it is, or a registered architecture
    #: whose config cannot tell): no next-token cross-entropy is measured or optimised then
    not_causal: str | None = None
    #: ``output.sketch`` left out: it is not below the numbers each prompt compares (exact statistics
    #: are then cheaper, and exact)
    sketch_dropped: bool = False
    #: the ``s`` that ``output.sketch: auto`` chose (``None``: exact statistics; see :func:`_choose_sketch`)
    auto_sketch: int | None = None
    #: the notes among :attr:`notes` that depend on the QPs (the sketch's choice, the statistics' cost):
    #: :func:`without_unchanged` removes exactly these and decides them again on the run's own QPs
    qp_notes: list[str] = field(default_factory=list)

    def add_qp_note(self, note: str) -> None:
        """Append ``note``, one that :func:`without_unchanged` recounts on the run's QPs."""
        self.notes.append(note)
        self.qp_notes.append(note)

    @property
    def sketch(self) -> int | None:
        """The statistics' sketch as the run takes it: ``output.sketch``, or what ``auto`` chose;
        ``None`` (exact) where the plan left a sketch out."""
        s = self.config.output.sketch
        return None if self.sketch_dropped else self.auto_sketch if s == "auto" else s

    def output_spec(self) -> OutputSpec:
        """The output the merge compares (the config's ``output``, its matrix read once)."""
        out = self.config.output
        return OutputSpec(out.field, out.restrict, out.k, self.config.seed, out.metric, out.fold_head_flag,
                          self.sketch, out.pool, self.output_matrix)

    def heldout_spec(self) -> OutputSpec:
        """The output the report's held-out metrics compare: every entry, Euclidean, unfolded."""
        return OutputSpec(self.config.output.field, "none", fold_head=False, pool=self.config.output.pool)

    @property
    def batch_length(self) -> int:
        """Positions per calibration batch at most: :attr:`max_length`, or the longest prompt's
        tokens where that is shorter (measured by the plan)."""
        return self.max_length if self.longest_prompt is None else min(self.max_length, self.longest_prompt)

    @property
    def batch_prompts(self) -> int:
        """Prompts per calibration batch at most: ``calibration.batch_size``, or the largest task's
        prompts where that is fewer."""
        return min(self.config.calibration.batch_size, max((t.n_calibration for t in self.tasks), default=1) or 1)

    @property
    def per_position(self) -> int:
        """Numbers compared per position: the vocabulary / features, a restriction's k, or the output
        matrix's columns."""
        out = self.config.output
        return ((self.vocab_size or 1) if out.restrict == "none" else
                int(self.output_matrix.shape[1]) if self.output_matrix is not None else int(out.k))

    @property
    def widest(self) -> int:
        """The widest layer the derivatives pass through (the vocabulary or the compared width when the
        skeleton is unknown)."""
        return widest_layer(self.skeleton) if self.skeleton is not None else max(self.vocab_size or 0, self.per_position)

    @functools.cached_property
    def structure_folds(self) -> bool:
        """Whether the model's structure lets the run fold its head (what the plan can see of the run's
        checks, :func:`mergeqp.lm.fold_decision`, without weights): an ``nn.Linear`` head, a backbone
        holding every merge site and every parameter but the head's (BERT's masked-LM head transforms the
        backbone's output first), and no soft-capped logits. The run still checks its first batch; where
        the plan presumed a fold the run refused, its estimates were below the run's (stop 57 review:
        BERT's masked LM, a merge site in ``lm_head``); unknown structure counts as folding. Computed
        once per plan (every estimate asks it; :func:`without_unchanged` makes a new plan)."""
        model = self.skeleton
        if model is None:
            return True
        head, inner = linear_head(model), backbone(model)
        if head is None or inner is None:
            return False
        if (self.base.config or {}).get("final_logit_softcapping"):
            return False
        inside = {id(p) for p in inner.parameters()} | {id(p) for p in head.parameters()}
        if any(id(p) not in inside for p in model.parameters()):
            return False
        modules = {id(m) for m in inner.modules()}
        names = dict(model.named_modules())
        return all(id(names[s.name]) in modules for s in self.sites if s.name in names)

    def fewest_outputs_per_token(self) -> int:
        """The fewest numbers one token compares in the statistics, unsketched: of the folded (where the
        head folds) and the unfolded outputs, the fewer (a lower bound a candidate's skip can count
        on: the run decides the fold at its first batch)."""
        width = _compared_width(self)
        if width is None:  # (what the plan cannot count: one, a lower bound)
            return 1
        spec = replace(self.output_spec(), sketch=None)
        hidden, folds = _hidden_and_folds(self, spec)
        # (stop 58 review: a sequence classifier's 3 labels were counted as the vocabulary, 46, and an
        # output_space candidate that fits was skipped)
        return min(_design_outputs(spec, f, 1, width[0], hidden) for f in {folds, False})

    @functools.cached_property
    def start_skips(self) -> dict[str, str]:
        """:func:`planned_skips` of the config's ``start: auto`` (``{}`` without one), worked out once per
        plan: the dry run, the memory estimate and the run read it (a user's ``start.skip`` ran two or
        three times per run before; :func:`without_unchanged` makes a new plan, which asks again)."""
        m = self.config.method
        if not (m.is_qp and is_auto_start(m.start)):
            return {}
        assert m.start is not None
        return planned_skips(self, parse_auto_params(m.start.params))

    @functools.cached_property
    def matmul_layers(self) -> tuple[tuple[str, int, bool], ...]:
        """The skeleton's matrix products in module order: ``(name, multiply-adds per token, inside the
        backbone)``: every 2-D ``weight`` but an embedding's (``nn.Linear``'s ``in x out``, GPT-2's
        ``Conv1D``, a router's), and a mixture's fused 3-D expert parameters at the share a token uses
        (``num_experts_per_tok`` of their experts; all of them where the config does not say; stop 58
        review: the experts went uncounted, 7.7x under on Mixtral). ``()`` without a skeleton.
        :func:`derivative_work` counts the passes through them."""
        import torch  # optional heavy dependency: the plan's skeleton is a torch module

        model = self.skeleton
        if model is None:
            return ()
        bcfg = self.base.config or {}
        active = bcfg.get("num_experts_per_tok") or bcfg.get("moe_topk") or bcfg.get("top_k")
        inner = backbone(model)
        inside = {id(m) for m in inner.modules()} if inner is not None else set()
        out = []
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Embedding):
                continue
            madds = 0
            for pname, param in module.named_parameters(recurse=False):
                if param.ndim == 2 and pname == "weight":
                    madds += int(param.numel())
                elif param.ndim == 3:  # (experts, out, in)
                    experts = int(param.shape[0])
                    share = min(int(active), experts) if isinstance(active, int) and active > 0 else experts
                    madds += int(param.numel()) * share // max(experts, 1)
            if madds:
                out.append((name, madds, id(module) in inside))
        return tuple(out)

    def derivative_width(self, folds: bool) -> int:
        """:attr:`widest` of the part the statistics' derivatives run through: the backbone where a
        language model's head ``folds`` (no logits' tangents are formed), else the whole model."""
        inner = backbone(self.skeleton) if folds and self.skeleton is not None else None
        return widest_layer(inner) if inner is not None else self.widest

    @property
    def max_length(self) -> int:
        """Tokens per prompt: ``calibration.max_length``, or the model's context where that is
        shorter (:func:`context_length`)."""
        context = context_length(self.base.config or {})
        wanted = self.config.calibration.max_length
        return wanted if context is None else min(wanted, context[1])

    @property
    def method(self) -> str:
        m = self.config.method
        return f"qp ({m.mode})" if m.is_qp else m.name

    @property
    def mode(self) -> MergeMode:
        """The registered merge mode entry (QP methods)."""
        return get_merge_mode(self.config.method.mode)

    @property
    def parametrisation(self) -> Parametrisation:
        """The registered parametrisation entry (QP methods)."""
        return get_parametrisation(self.config.method.parametrisation)

    def site_keys(self) -> list[str]:
        """The checkpoint keys of the merge sites (weights and biases), in site order."""
        return [k for s in self.sites for k in s.keys]

    def merged_keys(self) -> list[str]:
        keys = self.site_keys()
        return keys + [k for k in self.extra_tensors if k not in keys]

    def float_keys(self) -> list[str]:
        """The base checkpoint's floating-point tensors (what a start merges "on every tensor")."""
        return [k for k in self.base.names() if self.base.info(k).floating]

    def written_dtype(self) -> Any:
        """The ``torch.dtype`` of ``output_dtype``, or ``None`` (each tensor in the base's dtype): what
        merged tensors are cast to once (a baseline's float32 sums over a bfloat16 base kept in float32)."""
        import torch  # deferred: torch is heavy

        name = self.config.output_dtype
        return getattr(torch, name) if name else None

    def stored_dtypes(self) -> dict[str, list[str]]:
        """The floating-point dtypes each checkpoint stores (``base`` and each model's name), read
        from the headers: the written tensors take the base's unless ``output_dtype`` is set."""
        def floats(ck: Checkpoint) -> list[str]:
            return sorted({ck.info(k).dtype for k in ck.names() if ck.info(k).floating})

        return {"base": floats(self.base),
                **{name: floats(ck) for name, ck in zip(self.config.model_names(), self.finetuned)}}

    def to_json(self) -> dict[str, Any]:
        m = self.config.method
        return {
            "base": str(self.base.path), "architecture": self.architecture, "model_type": self.model_type,
            "models": [t.__dict__ for t in self.tasks],
            "method": m.model_dump(),
            "layers": [s.to_json() for s in self.sites],
            "extra_tensors": self.extra_tensors,
            "groups": [g.__dict__ for g in self.groups],
            "output": self.config.output.model_dump(),
            # the sketch the statistics take (output.sketch, or auto's choice; null: exact)
            **({"statistics_sketch": self.sketch} if self.config.method.is_qp else {}),
            "device": self.config.device, "dtype": self.config.dtype, "seed": self.config.seed,
            "stored_dtypes": self.stored_dtypes(), "output_dtype": self.config.output_dtype,
            "memory_estimate_bytes": self.memory,
            "notes": self.notes,
        }

    def render(self) -> str:
        cfg = self.config
        lines = [f"merge plan: {self.method}, {len(self.sites)} layer(s) of {self.architecture}"]
        lines.append(f"  base: {self.base.path} ({len(self.base)} tensors, {human_bytes(self.base.total_bytes)})")
        for t in self.tasks:
            lines.append(f"  model {t.name}: {t.checkpoint}; prompts {t.prompts_file or '-'} "
                         f"({t.n_calibration} calibration + {t.n_heldout} held out), weight {t.weight:g}")
        if cfg.method.is_qp:
            m = cfg.method
            options = m.parametrisation_options()
            par = self.parametrisation.describe(options)
            lines.append(f"  QP: parametrisation {par}; constraints {', '.join(m.constraints) or 'none'}; "
                         f"regularisation {m.regularisation:g}"
                         + (f" toward {self.mode.regularises_toward or m.reference}" if m.regularisation else ""))
            if is_auto_start(m.start):
                auto = parse_auto_params(m.start.params)
                lines.extend(f"  {m.mode} {line}" for line in candidate_notes(auto, self.start_skips))
            elif m.start is not None:
                lines.append(f"  {m.mode} start: {m.start.name} {m.start.params or ''} on every tensor")
                spec = statistics_of(m.start.name)
                if spec is not None:
                    lines.append(f"    {spec.plan_line}")
            if self.parametrisation.needs_output_jacobian(options):
                lines.append("  optimal basis per layer (Corollary 4.2): calibration-mean output Jacobian summed over "
                             f"positions (r JVPs per batch), residual energy restricted to its range; Jacobian cap "
                             f"{m.basis_max_size}")
            o = cfg.output
            lines.append(f"  compared output: {o.describe()}")
            if o.fold_head != "auto" or o.sketch is not None or m.jacobian_mode != "auto":
                sketch = (f"{o.sketch} (left out: see the notes)" if self.sketch_dropped else
                          f"auto -> {self.sketch or 'none (exact)'}" if o.sketch == "auto" else o.sketch or "none")
                lines.append(f"  statistics: output fold_head {o.fold_head}, sketch {sketch}, "
                             f"jacobian_mode {m.jacobian_mode}")
            lines.append("  statistics per QP: per-task H_t (n x n), g_t (n), c_t; energy fractions")
            cost = statistics_work(self, self.sketch)
            if cost is not None:
                lines.append(f"  statistics cost per calibration batch (every prompt at the longest length): about "
                             f"{cost.total:.2g} multiply-adds ({_cost_parts(cost)})")
            for g in self.groups:
                lines.append(f"    QP over {', '.join(g.sites)}: n = {g.n_variables}, solver {g.solver}, "
                             f"linearised at {g.linearised_at}")
        else:
            spec = statistics_of(cfg.method.name)
            if spec is not None:
                lines.append(f"  {spec.plan_line}")
            model_method = model_method_of(cfg)
            if model_method is not None:
                parsed = entry_call(model_method, "parse", model_method.parse, cfg.method.params, "method")
                described = entry_call(model_method, "describe", model_method.describe, parsed)
                lines.extend(f"  {line}" for line in ([described] if isinstance(described, str) else described))
            if evaluates_baseline(cfg) or (model_method is not None and model_method.evaluates):
                lines.append("  evaluation: calibration objective and held-out teacher-forced MSE of the base and the merge")
            lines.append(f"  {'model method' if model_method is not None else 'baseline'} {cfg.method.name} "
                         + (f"{cfg.method.params} " if cfg.method.params else "") + "on:")
            for s in self.sites:
                lines.append(f"    {s.label} ({s.r} x {s.m}{' + bias' if s.has_bias else ''})")
            for k in self.extra_tensors:
                lines.append(f"    {k}")
        lines.append(f"  device {cfg.device}, dtype {cfg.dtype}, seed {cfg.seed}")
        stored = self.stored_dtypes()
        if cfg.output_dtype or len({tuple(v) for v in stored.values()}) > 1:  # (stop 56 review: said nowhere)
            lines.append("  stored dtypes: " + "; ".join(f"{k} {'/'.join(v) or '-'}" for k, v in stored.items())
                         + f"; written as {cfg.output_dtype or 'the base stores each tensor'}")
        if cfg.lazy and self.skeleton is not None:
            below = lower_blocks(self.sites)(self.skeleton)
            lines.append(f"  lazy: {len(below)} block(s) below the merge sites stay on disk (read while they run); "
                         "each fine-tuned model runs one block at a time")
        cap = f" and max_memory {cfg.max_memory}" if cfg.max_memory is not None else ""
        at = (f"as long as the longest prompt, {self.longest_prompt} tokens" if self.longest_prompt is not None
              and self.longest_prompt < self.max_length else "at calibration.max_length")
        lines.append(f"  memory estimate (upper bounds: every prompt {at}; the run checks each "
                     f"site with its measured sizes against the available memory{cap}): "
                     + ", ".join(f"{k} {human_bytes(v)}" for k, v in self.memory.items()))
        for n in self.notes:
            lines.append(f"  note: {n}")
        return "\n".join(lines)


# ---------------------------------------------------------------------- checks
def without_unchanged(plan: MergePlan) -> MergePlan:
    """The run's plan: the selected layers and tensors that no fine-tune changed (each fine-tune holds
    the base's very tensors there, so any merge leaves them as they are) left out, with a note, when
    some others changed; ``plan`` itself when none or all changed (a selection of unchanged layers
    alone is merged and reported as such). Reads the selected tensors, which the dry run does not.
    Before stop 48 a pattern over every block of fine-tunes of a few put every block into the QP (a
    review's: 3 changed ``o_proj`` of 30, a 160 GiB QP refused), and Fisher / RegMean computed
    statistics for every unchanged tensor. The plan keeps what it read (prompts, tokenizers, heads);
    only its sites, groups and memory estimate are redone."""
    keys = plan.merged_keys()
    changed = set(changed_keys(plan.base, plan.finetuned, keys))
    if not changed or len(changed) == len(keys):
        return plan
    sites = [s for s in plan.sites if changed & set(s.keys)]
    extra = [t for t in plan.extra_tensors if t in changed]
    dropped = [s.name for s in plan.sites if s not in sites] + [t for t in plan.extra_tensors if t not in changed]
    if not dropped:
        return plan
    cfg = plan.config.model_copy(update={"layers": [s.name for s in sites] + extra})
    # the sketch and the cost are decided again on the QPs the run solves (stop 57 review: a sketch
    # chosen for a QP of 64 coefficients was kept for the 32 left, whose exact statistics were cheap)
    new = replace(plan, config=cfg, sites=sites, extra_tensors=extra, groups=plan_groups(cfg, sites),
                  notes=[n for n in plan.notes if n not in plan.qp_notes], qp_notes=[], auto_sketch=None)
    _choose_sketch(new)
    new.memory = estimate_memory(new)
    _note_statistics_cost(new)
    new.notes.append(f"{len(dropped)} selected layer(s) or tensor(s) are the base's in every fine-tuned model and "
                     f"were left so (not merged, no coefficients): {listing(dropped, 8)}")
    return new


def planned_skips(plan: MergePlan, auto: Any) -> dict[str, str]:
    """The candidates of ``start: auto`` (``auto``: its parameters) that the run skips before any work,
    by :attr:`~.auto.Candidate.key`, with the reason: with ``lazy: true`` the default ones whose
    statistics would load every fine-tune whole (:func:`~.auto.lazy_skipped`); a model method that
    fits the fine-tunes' outputs under a metric that scores the prompts' own tokens or labels; one
    whose entry's ``start.skip`` gives a reason (``output_space``'s Jacobians that cannot fit even at a
    lower bound). The dry run lists them, the memory estimate leaves out their statistics and the run
    skips them (one rule for the three; stop 58 review: the run fitted and chose a user's candidate that
    the dry run said was skipped)."""
    skipped = dict(lazy_skipped(auto, statistics_of, plan.config.lazy))
    metric = plan.config.output.metric
    scores_data = output_metric(metric).scores_data
    for c in auto.candidates:
        entry = start_method(c.name)
        if entry is None or c.key in skipped:
            continue
        assert entry.start is not None
        if entry.fits_outputs and scores_data:
            skipped[c.key] = (f"it fits the fine-tunes' outputs, not the prompts' own tokens or labels that metric: "
                              f"{metric} scores")
        elif entry.start.skip is not None:
            why = entry_call(entry, "start.skip", entry.start.skip, plan, parse_candidate(entry, c), auto)
            if why is not None and not isinstance(why, str):
                raise ConfigError(f"model method {entry.name!r}: start.skip(plan, parsed, auto) must return a reason "
                                  f"(a string) or None, got {type(why).__name__} {why!r:.60}")
            if why:
                skipped[c.key] = why
    return skipped


def keeps_base_outside(plan: MergePlan) -> bool:
    """Whether the merged model holds the base's tensors outside the merged ones: every method but a
    QP mode started from a merge of every tensor (``hybrid``, a trust region's start, ``auto``)."""
    m = plan.config.method
    return not (m.is_qp and plan.mode.uses_start and m.start is not None)


def changed_outside(plan: MergePlan, count: int = 256) -> list[str]:
    """Notes naming, per fine-tuned model, the floating-point tensors outside the merged ones that it
    changed: their first ``count`` entries differ from the base's, beyond the rounding to the
    fine-tune's stored dtype (a sample: a change elsewhere in a tensor is not seen). Meant for a
    merge that keeps the base's tensors outside its selection (a user who selected too few layers
    otherwise loses those changes without a word). Reads ``count`` entries per tensor."""
    return [f"model {name!r} also changed {len(changed)} tensor(s) outside the merged layers "
            f"({listing(changed, 4)}): the merged model keeps the base's there; select them in "
            f"layers: to merge them too" for name, changed in _outside_changes(plan, count).items() if changed]


def start_outside(plan: MergePlan, count: int = 256) -> list[str]:
    """The note of a QP mode whose start is merged on every tensor (``method: auto``, ``hybrid``, a
    trust region's ``start``): the tensors outside the selected layers that a fine-tune changed are
    the start's in the written model, not the base's, and the QP does not refine them; a baseline
    over the same ``layers`` keeps the base's there, so the two do not merge the same tensors (stop
    57 review: `auto` over two `down_proj` changed all twelve fine-tuned MLP tensors, with no word,
    beside baselines that kept ten of them as the base's). ``[]`` where no such tensor changed."""
    changed = sorted({k for keys in _outside_changes(plan, count).values() for k in keys})
    if not changed:
        return []
    start = plan.config.method.start
    name = "the chosen start" if start is None or is_auto_start(start) else start.name
    return [f"{name} is merged on every tensor: the merged model also changes {len(changed)} tensor(s) outside the "
            f"selected layers ({listing(changed, 4)}), as the start left them (the QP refines only the selected "
            f"layers); a baseline over the same layers keeps the base's there: to compare like with like, run it "
            f"with these tensors in layers too"]


def _outside_changes(plan: MergePlan, count: int) -> dict[str, list[str]]:
    """Per fine-tuned model, the floating-point tensors outside the merged ones whose first ``count``
    entries differ from the base's beyond the rounding to the fine-tune's stored dtype."""
    merged = set(plan.merged_keys())
    outside = [k for k in plan.float_keys() if k not in merged]
    base_samples: dict[str, Any] = {}
    out: dict[str, list[str]] = {}
    for name, ft in zip(plan.config.model_names(), plan.finetuned):
        changed = out.setdefault(name, [])
        for key in outside:
            if key not in ft:
                continue
            if key not in base_samples:
                base_samples[key] = plan.base.sample(key, count)
            if not same_stored_value(base_samples[key], ft.sample(key, count)):
                changed.append(key)
    return out


def _no_sites(base: Checkpoint, base_path: Path, model: Any) -> None:
    """Raise the reason why the model built from the base's ``config.json`` has no linear layer
    stored in the checkpoint: most often a config without ``architectures`` (``AutoModel`` builds the
    backbone, whose names lack the head model's prefix); the pattern is not to blame."""
    names = [n for n in base.names() if n.endswith(".weight")]
    if not names:
        raise ConfigError(f"base {base_path}: the checkpoint stores no weight tensor (no name ending in .weight)")
    live = [n for n, _ in model.named_parameters()]
    archs = (base.config or {}).get("architectures")
    why = ("its config.json names no `architectures`, so transformers.AutoModel built "
           f"{type(model).__name__}; add the class that saved the checkpoint, e.g. \"architectures\": "
           f"[\"{type(model).__name__.removesuffix('Model')}ForCausalLM\"]" if not archs else
           f"config.json names {archs}")
    raise ConfigError(f"base {base_path}: no linear layer of the model built from its config.json is stored in its "
                      f"checkpoint ({why}): the checkpoint holds e.g. {names[0]!r}, the model's parameters are named "
                      f"e.g. {live[0] if live else '(none)'!r}")


def _select(cfg: MergeConfig, sites: list[LayerSite], names: list[str],
            shared: Mapping[str, str] | None = None) -> tuple[list[LayerSite], list[str]]:
    """Sites (QP) or sites + other checkpoint tensors (baselines) matched by the layer patterns
    (``shared``: the model's tied linear layers, named when a QP pattern matches only them)."""
    if cfg.method.is_qp:
        return match_sites(sites, cfg.layers, shared), []
    chosen: list[LayerSite] = []
    extra: list[str] = []
    site_keys = {k for s in sites for k in s.keys}
    for pattern in cfg.layers:
        p = pattern.removesuffix(".weight")
        hit_sites = [s for s in sites if site_matches(s, p)]
        hit_tensors = [n for n in names if n not in site_keys
                       and (fnmatch.fnmatchcase(n, pattern) or fnmatch.fnmatchcase(n.rsplit(".", 1)[0], p))]
        if not hit_sites and not hit_tensors:
            tied = tied_match(pattern, shared)
            if tied:  # (Gemma2's lm_head: the QP named the tie, a baseline said "matches no layer")
                raise ConfigError(f"{tied}: select the tensor it is tied to, to merge it")
            raise ConfigError(
                f"layer pattern {pattern!r} matches no layer or tensor{module_hint(sites, pattern)}; linear layers: "
                f"{listing([s.label for s in sites])}"
            )
        chosen.extend(s for s in hit_sites if s not in chosen)
        extra.extend(t for t in hit_tensors if t not in extra)
    order = {s.name: i for i, s in enumerate(sites)}
    return sorted(chosen, key=lambda s: order[s.name]), [n for n in names if n in set(extra)]


def _solver_name(cfg: MergeConfig, n: int) -> str:
    """The solver ``auto`` would pick for an ``n``-variable problem with these constraints; a named
    solver is checked now against its options and against the set (a solver that cannot take it is
    refused before any model is loaded)."""
    m = cfg.method
    K = len(cfg.models)
    if m.solver != "auto":
        try:
            solver = get_solver(m.solver)
            solver.check_options(m.solver_options)
        except MergeQPError as exc:
            raise ConfigError(f"method.solver: {exc}") from None
        try:
            why = declines(solver, _probe(K, n), as_constraint_set(_planned_sets(cfg, n // K) or None))
        except MergeQPError:
            why = None  # decided at solve time
        if why is not None:
            raise ConfigError(f"method.solver: {m.solver!r} cannot solve these QPs ({' & '.join(m.constraints)}): "
                              f"{why}; use solver: auto, or a solver that takes the set")
        return m.solver
    if m.solver_options:
        raise ConfigError("method.solver_options: name a solver (options differ between solvers), not 'auto'")
    try:
        sets = _planned_sets(cfg, n // K)
        return "auto -> " + choose_solver(_probe(K, n), as_constraint_set(sets or None)).name
    except MergeQPError:
        return "auto (decided at solve time)"


def _probe(K: int, n: int) -> MergeQP:
    """A stand-in for a planned QP of ``n`` variables: an explicit H of the real size, as the run has
    (a merge's statistics are always an explicit H), held as a read-only zero-stride view (no memory,
    no factorisation: the solvers' choice reads only n, the shape and that H is explicit)."""
    small = MergeQP(H=np.eye(K), g=np.zeros(K), shape=(K, 1))
    return small._derived(H=np.broadcast_to(np.zeros(1), (n, n)), g=np.zeros(n), shape=(K, n // K))


def _planned_sets(cfg: MergeConfig, n_atoms: int) -> list[Any]:
    """The QPs' constraint sets as planned for ``n_atoms`` coefficients per model (layer sets such as
    ``sign`` on stand-in residuals of as many rows), with the trust region's box for a step-bounded
    mode."""
    m = cfg.method
    deltas = np.ones((len(cfg.models), max(int(n_atoms), 1), 1))
    sets = [parse_constraint(s, {"deltas": deltas, "parametrisation": "rows"}) for s in m.constraints]
    if get_merge_mode(m.mode).step_bounded:  # (the trust region's box: closed_form cannot take it)
        sets.append(parse_constraint("box:-1,1"))
    return sets


def _n_atoms(cfg: MergeConfig, site: LayerSite) -> int:
    m = cfg.method
    return get_parametrisation(m.parametrisation).planned_atoms(site.r, site.m1, m.parametrisation_options())


def statistics_method(cfg: MergeConfig) -> str | None:
    """The baseline (the method, or the hybrid start) whose calibration statistics the pipeline
    collects (a method that declares ``statistics``: ``fisher`` / ``regmean``), else ``None``."""
    m = cfg.method
    if not m.is_qp and statistics_of(m.name) is not None:
        return m.name
    if m.is_qp and m.start is not None and statistics_of(m.start.name) is not None:
        return m.start.name
    return None


def evaluates_baseline(cfg: MergeConfig) -> bool:
    """A baseline run is evaluated (calibration objective, held-out MSE) when ``evaluate`` is on
    and every model has calibration prompts."""
    return not cfg.method.is_qp and cfg.evaluate and all(m.prompts() is not None for m in cfg.models)


def _check_output_field(cfg: MergeConfig, model: Any) -> None:
    """``output.field`` is one the model's output class declares, where the run compares outputs (the
    QP, an evaluated baseline, a model method) and the class is known (:func:`output_fields`). Stop 58
    review: GPT-2's ``last_hidden_state`` and a headless BERT's ``logits`` passed the dry run, and the
    run refused them at its first batch, after loading every model."""
    if not (cfg.method.is_qp or evaluates_baseline(cfg) or model_method_of(cfg) is not None):
        return
    declared = output_fields(model)
    if declared is None or cfg.output.field in declared[1]:
        return
    name, fields = declared
    tensors = [f for f in fields if f not in ("loss", "past_key_values", "hidden_states", "attentions",
                                              "cross_attentions")]
    raise ConfigError(f"output.field {cfg.output.field!r}: {type(model).__name__} returns {name}, which has no such "
                      f"field; it has {', '.join(tensors) or ', '.join(fields)} (a head model's outputs are its "
                      f"head's: merge with the backbone's class in the folders' config.json 'architectures' to "
                      f"compare its hidden states)")


def uses_prompts(cfg: MergeConfig) -> bool:
    """The run reads the calibration prompts: the QP, a method with calibration statistics, an
    evaluated baseline, a model method (:mod:`.model_methods`: e.g. ``output_space`` linearises its
    reference merge on them)."""
    return (cfg.method.is_qp or statistics_method(cfg) is not None or evaluates_baseline(cfg)
            or model_method_of(cfg) is not None)


def _without_prompts(cfg: MergeConfig) -> list[str]:
    """The names of the models that have no calibration prompts."""
    return [n for n, e in zip(cfg.model_names(), cfg.models) if e.prompts() is None]


def _check_method(cfg: MergeConfig) -> None:
    m = cfg.method
    if cfg.lazy and not m.is_qp:
        raise ConfigError(f"lazy: true keeps the blocks off a QP merge's linearised path on disk (method: qp, or "
                          f"the default auto); method {m.name!r} "
                          + (model_method.lazy_reason if (model_method := model_method_of(cfg)) is not None else
                             "already streams tensors in chunks (evaluate: false keeps models out of memory)"))
    stats = statistics_method(cfg)
    if stats is not None:
        missing = _without_prompts(cfg)
        if missing:
            raise ConfigError(f"{'method' if not m.is_qp else 'method.start'}: {stats!r} needs calibration prompts "
                              f"for every model (its statistics are computed on them); missing for {missing}")
    model_method = model_method_of(cfg)
    if model_method is not None:
        clash = baseline_clash(m.name)  # (a merge method registered after the model method)
        if clash is not None:
            raise ConfigError(f"method: {clash}")
        missing = _without_prompts(cfg)
        if missing:
            raise ConfigError(f"method: {m.name!r} needs calibration prompts for every model (it runs on the "
                              f"models' outputs on them); missing for {missing}")
        if model_method.fits_outputs and output_metric(cfg.output.metric).scores_data:
            classifies = cfg.output.pool != "none"  # class labels through each model's head
            scored = "class labels through each model's head" if classifies else "next tokens"
            remedy = ("drop the models' head and label_field and use metric: euclidean" if classifies
                      else "use metric: euclidean or kl")
            raise ConfigError(f"output.metric: {cfg.output.metric} scores the prompts' {scored}, which method: "
                              f"{m.name} does not fit (it fits the fine-tunes' outputs); {remedy}, or a QP "
                              f"method (e.g. mode: trust_region) with metric: {cfg.output.metric}")
        entry_call(model_method, "parse", model_method.parse, m.params, "method")
        return
    if not m.is_qp:
        _check_baseline(m.name, m.params, "method", len(cfg.models))
        return
    atom_stats = statistics_baselines(m.baseline_choices)
    if atom_stats:
        missing = _without_prompts(cfg)
        if missing:
            raise ConfigError(f"method.baselines: {atom_stats[0][0]!r} needs calibration prompts for every model (its "
                              f"statistics are computed on them); missing for {missing}")
    if is_auto_start(m.start):
        assert m.start is not None
        for cand in parse_auto_params(m.start.params).candidates:
            where = candidate_where(cand.label)
            entry = start_method(cand.name)
            if entry is not None:
                parse_candidate(entry, cand)
            elif cand.name in MODEL_METHODS:
                raise ConfigError(f"{where}: model method {cand.name!r} cannot be a start candidate: its entry has no "
                                  f"start fit (ModelMethod.start, docs/hf.md \"Model methods\"); run it as method: "
                                  f"{cand.name} instead")
            elif cand.name == QP_CANDIDATE:
                block = qp_candidate_block(cand.params, where)
                fitted = statistics_baselines(block.baseline_choices)
                if fitted:
                    raise ConfigError(f"{where}: baseline atoms with calibration statistics ({fitted[0][0]!r}) are not "
                                      "available to start candidates (they would be fitted on the held-out folds); "
                                      "use tensor-wise baselines there, or a run of its own")
                try:
                    _check_method(cfg.model_copy(update={"method": block}))
                except ConfigError as exc:
                    raise ConfigError(f"{where}: {exc}") from None
            else:
                _check_baseline(cand.name, cand.params, where, len(cfg.models))
    elif m.start is not None:
        _check_baseline(m.start.name, m.start.params, "method.start", len(cfg.models))
    for spec in m.constraints:
        name = layer_constraint(spec)
        if name is not None:
            if get_merge_mode(m.mode).spans_layers:
                raise ConfigError(f"method.constraints: {name!r} is per layer and cannot be used with mode: {m.mode}")
            try:  # the set needs the layer's deltas (solve time); its spelling is checked now on a stand-in
                # with the configured parametrisation (a set built per parametrisation may refuse it)
                entry = get_parametrisation(m.parametrisation)
                parse_constraint(spec, layer_context(np.ones((len(cfg.models), 1, 1)), m.parametrisation,
                                                     entry.parameter_atoms(1, 1)))
            except MergeQPError as exc:
                raise ConfigError(f"method.constraints: {exc}") from None
            continue
        try:
            parse_constraint(spec)
        except MergeQPError as exc:
            raise ConfigError(f"method.constraints: {exc}") from None
    param = get_parametrisation(m.parametrisation)
    if type(param).tangents is Parametrisation.tangents:  # (a user's entry written for in-memory statistics only)
        raise ConfigError(f"method.parametrisation: {m.parametrisation!r} has no tangent rule (tangents(Z, delta)), "
                          f"which checkpoint merging needs; it can be used with collect_statistics in Python")
    if param.needs_output_jacobian(m.parametrisation_options()):
        if output_metric(cfg.output.metric).scores_data:
            raise ConfigError(f"method.basis: {m.basis} (the optimal basis) is built from the residuals to the "
                              f"fine-tunes' outputs; output.metric: {cfg.output.metric} has none. Use basis: svd "
                              f"or random, or another parametrisation")
        try:
            parse_size(m.basis_max_size)
        except MergeQPError as exc:
            raise ConfigError(f"method.basis_max_size: {exc}") from None


def _check_output(cfg: MergeConfig) -> None:
    try:
        parse_size(cfg.max_shard_size)
    except MergeQPError as exc:
        raise ConfigError(f"max_shard_size: {exc}") from None


def _check_feasible_sets(cfg: MergeConfig, groups: Sequence[Any]) -> None:
    """The QP's constraint set (without the layer constraints such as 'sign', which need the
    deltas) is non-empty for every planned problem shape: an empty intersection fails now, not
    after the statistics."""
    specs = [s for s in cfg.method.constraints if layer_constraint(s) is None]
    if not specs:
        return
    cset = as_constraint_set([parse_constraint(s) for s in specs])
    K = len(cfg.models)
    origin = get_merge_mode(cfg.method.mode).origin_feasible
    for n in sorted({int(g.n_variables) for g in groups}):
        try:
            check_feasible(cset, (K, n // K))
        except MergeQPError as exc:
            raise ConfigError(f"method.constraints: {exc}") from None
        viol = cset.violation(np.zeros((K, n // K))) if origin else 0.0
        if viol > 1e-9:
            raise ConfigError(
                f"method.constraints: mode {cfg.method.mode} solves for corrections D from the start (D = 0), "
                f"which the constraints {cfg.method.constraints} exclude (violation {viol:.3g}); use a set that "
                f"contains 0, e.g. box:-1,1, or none")


def _check_baseline(name: str, params: dict[str, Any], where: str, K: int) -> None:
    """Known baseline (tensor-wise, or with calibration statistics) with valid parameters (checked
    by the method's own schema); a per-model ``weights`` list has one entry per fine-tune (``K``)."""
    if name in MODEL_METHODS and (name not in MERGE_METHODS or not get_merge_method(name).tensorwise):
        among = (f", or tries it as a start among others with 'start: {{name: auto, params: {{candidates: "
                 f"[{name}, ...]}}}}'" if start_method(name) is not None else "")
        raise ConfigError(
            f"{where}: {name!r} is a model method (it runs on the live models, not on tensors) and cannot be used "
            f"here: a merge config runs it as 'method: {name}'{among}"
        )
    if name not in MERGE_METHODS:
        known = ["qp", AUTO, *method_names()] if where == "method" else ["qp", *MERGE_METHODS]
        raise ConfigError(f"{where}: {unknown('merge method', name, known)}")
    method = get_merge_method(name)
    weights = params.get("weights")
    if isinstance(weights, (list, tuple)) and len(weights) != K:
        raise ConfigError(f"{where}.params.weights has {len(weights)} entries but there are {K} fine-tuned models "
                          f"(one weight per entry of models, in order)")
    if "include" in params or "exclude" in params:
        raise ConfigError(f"{where}.params: select tensors with the top-level 'layers', not include/exclude")
    if method.statistics is not None:
        check_params(name, params, where)
        return
    if not method.tensorwise:
        raise ConfigError(
            f"{where}: {name!r} needs calibration statistics of its own (not tensor-wise) and mergeqp merge "
            f"computes them only for {', '.join(statistics_methods())}: use it from Python with "
            f"merge_state_dicts, or use the QP"
        )
    try:
        method.parse(params)
    except MergeQPError as exc:
        raise ConfigError(f"{where}.params: {exc}") from None


def output_matrix(cfg: MergeConfig) -> np.ndarray | None:
    """``output.matrix`` read from its file (``None`` when the config names none)."""
    if cfg.output.matrix is None:
        return None
    return read_matrix(cfg.resolve(cfg.output.matrix), "output.matrix")


#: configuration keys that hold a model's context length (positions it was built for)
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


def context_length(config: dict[str, Any]) -> tuple[str, int] | None:
    """``(key, positions)`` of a Hugging Face config's context length, or ``None`` when it names
    none (:data:`CONTEXT_KEYS`, the first positive integer found)."""
    for key in CONTEXT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return key, value
    return None


def _head_fields(cfg: MergeConfig, entry: Any, head: ClassifierHead | None, label_field: str | None) -> dict[str, Any]:
    """The plan's record of a model's classifier head (none: no fields)."""
    if head is None:
        return {}
    return {"head": str(cfg.resolve(entry.head)), "classes": head.classes, "label_field": label_field}


def model_heads(cfg: MergeConfig) -> list[ClassifierHead | None]:
    """Each model's classifier ``head`` read from its file (``None`` where it names none)."""
    heads: list[ClassifierHead | None] = []
    for name, m in zip(cfg.model_names(), cfg.models):
        if m.head is None:
            heads.append(None)
            continue
        where = f"models[{name}].head"
        try:
            weight, bias = read_head(cfg.resolve(m.head), where)
            heads.append(ClassifierHead.of(weight, bias, f"{where} ({m.head})"))
        except ValidationError as exc:
            raise ConfigError(str(exc)) from None
    return heads


def plan_groups(cfg: MergeConfig, sites: Sequence[LayerSite]) -> list[GroupPlan]:
    """The QPs a QP method solves over ``sites`` (its mode's groups, each one's variable count and
    solver), each checked to have a feasible set; none for a baseline."""
    if not cfg.method.is_qp:
        return []
    mode = get_merge_mode(cfg.method.mode)
    start = cfg.method.start
    at = mode.linearised_at(None if start is None else "chosen start" if is_auto_start(start) else start.name)
    K = len(cfg.models)
    groups = []
    for group in mode.groups(list(sites)):
        n = K * sum(_n_atoms(cfg, s) for s in group)
        groups.append(GroupPlan(tuple(s.name for s in group), n, _solver_name(cfg, n), at))
    _check_feasible_sets(cfg, groups)
    return groups


def check_config_object(cfg: Any, where: str) -> None:
    """A :class:`ValidationError` naming what ``where`` takes when ``cfg`` is not a merge config (a
    path or a mapping was a raw AttributeError from deep inside the plan)."""
    if isinstance(cfg, MergeConfig):
        return
    hint = (" (a path: read the file with mergeqp.load_config(path) first)" if isinstance(cfg, (str, os.PathLike))
            else " (mergeqp.load_config(path) reads a YAML file, mergeqp.config.parse_config(mapping) a mapping)")
    raise ValidationError(f"{where}: cfg must be a MergeConfig, got {type(cfg).__name__}{hint}")


def build_plan(cfg: MergeConfig) -> MergePlan:
    """Validate ``cfg`` against its inputs (no weights loaded) and return the plan."""
    check_config_object(cfg, "build_plan")
    check_paths(cfg)
    matrix = output_matrix(cfg)  # an unreadable or malformed matrix stops the run before any model is loaded
    heads = model_heads(cfg)
    _check_method(cfg)
    _check_output(cfg)
    names = cfg.model_names()
    base_path = cfg.resolve(cfg.base)
    try:
        base = open_checkpoint(base_path)
        fts = [open_checkpoint(cfg.resolve(m.path)) for m in cfg.models]
    except ValidationError as exc:
        raise ConfigError(str(exc)) from None
    if not base.is_hf_folder or base.config is None:
        raise ConfigError(f"base {base_path} must be a Hugging Face model folder (config.json + weights): "
                          f"its config gives the architecture")
    model = skeleton(base_path)
    check_decoder_inputs(model, base.config)
    fts = [stored_names(ck, base, model) for ck in fts]
    base, fts, align_notes = aligned_checkpoints(base, fts, model)
    config_notes = align_notes + check_architectures(base, list(zip(names, fts)))
    not_causal = _not_causal(base.config)
    if not_causal is not None and output_metric(cfg.output.metric).scores_data and cfg.output.pool == "none":
        raise ConfigError(f"output.metric: cross_entropy scores next tokens (each position predicts the next "
                          f"token), but the base model is not a causal language model: {not_causal}; compare the "
                          f"fine-tunes' outputs instead (metric: euclidean or kl), or, for a classifier with a head "
                          f"per task, use pool: mean")

    tok_folder = cfg.resolve(cfg.tokenizer) if cfg.tokenizer else base_path
    needs_text = uses_prompts(cfg) and any(not is_tensor_file(m.prompts().path) for m in cfg.models if m.prompts())
    if needs_text and not has_tokenizer(tok_folder):
        hint = ("" if cfg.method.is_qp or statistics_method(cfg) or model_method_of(cfg) is not None
                else "; or set 'evaluate: false' to skip the evaluation")
        raise ConfigError(f"no tokenizer files in {tok_folder}: text prompts need the base model's tokenizer "
                          f"(or set 'tokenizer:' to a folder holding it){hint}")
    if has_tokenizer(tok_folder):
        check_tokenizers(tok_folder, [(n, ck.path) for n, ck in zip(names, fts) if ck.folder is not None])

    tasks = []
    all_texts: list[str] = []
    owners: list[str] = []  # whose prompt file each of all_texts came from
    holdout_notes: list[str] = []
    for i, (name, entry, ck) in enumerate(zip(names, cfg.models, fts)):
        src = entry.prompts()
        if src is None:
            tasks.append(TaskPlan(name, str(ck.path), None, 0, 0, 0, entry.weight,
                                  **_head_fields(cfg, entry, heads[i], None)))
            continue
        path = cfg.resolve(src.path)
        try:
            labels = None
            if is_tensor_file(path):
                data = read_tensor_inputs(path)
                if heads[i] is not None and src.label_field is not None:
                    labels = tensor_labels(data, src.label_field, str(path)).tolist()
                n = int(next(iter(data.values())).shape[0])
                if src.max_prompts is not None:
                    n = min(n, src.max_prompts)
            elif heads[i] is not None and src.label_field is not None:
                labels = read_labelled_prompts(path, src.field, src.label_field, src.max_prompts,
                                               classes=getattr(heads[i], "classes", None))[1]
                n = len(labels)
            else:
                texts = read_prompts(path, src.field, src.max_prompts)
                n = len(texts)
                all_texts.extend(texts)
                owners.extend([f"models[{name}].calibration ({src.path})"] * n)
                if cfg.evaluate and len(set(texts)) < n:
                    # (stop 56 review: 8 of 8 held-out prompts of a duplicated file were also fitted on);
                    # the run's own split (seeded), so only repeats on both sides are named
                    fitted, held_out = split_holdout(texts, cfg.holdout_for(i), cfg.seed + i)
                    both = set(fitted) & set(held_out)
                    if both:
                        holdout_notes.append(
                            f"models[{name}]: {len(both)} of the {len(held_out)} held-out prompts of {src.path} also "
                            f"stand among its fitted ones (the file repeats them): the held-out metrics are then "
                            f"not of unseen text (remove the repeats)")
            if labels and max(labels[:n]) >= heads[i].classes:
                at = int(np.argmax(np.asarray(labels[:n])))
                raise ValidationError(f"{path}: class label {labels[at]} (sample {at}, counted from 0) but the head has "
                                      f"{heads[i].classes} classes (labels are its row indices, 0 to "
                                      f"{heads[i].classes - 1})")
        except ValidationError as exc:
            raise ConfigError(f"models[{name}].calibration: {exc}") from None
        spec = cfg.holdout_for(i)
        held = holdout_count(n, spec) if cfg.evaluate else 0
        if cfg.evaluate and not (isinstance(spec, float) and not spec.is_integer()) and int(spec) > held:
            holdout_notes.append(
                f"models[{name}]: holdout {int(spec)} of {n} prompts would leave none for the "
                f"statistics; {held} held out, {n - held} used for calibration")
        elif cfg.evaluate and held == 0 and n > 0 and float(spec) > 0:
            # (stop 54 review: 1-3 prompts under the default 0.25 gave an empty held-out evaluation, silently)
            holdout_notes.append(
                f"models[{name}]: holdout {spec:g} of {n} prompt(s) is none: no held-out metric for this task "
                f"(more prompts, or calibration.holdout as a count, e.g. 1)")
        tasks.append(TaskPlan(name, str(ck.path), str(path), n, n - held, held, entry.weight,
                              **_head_fields(cfg, entry, heads[i], src.label_field)))

    all_sites = model_sites(model, base.names())
    if not all_sites:
        _no_sites(base, base_path, model)
    sites, extra = _select(cfg, all_sites, list(base.names()), shared_linear_layers(model))
    _check_output_field(cfg, model)  # (after the layers: a config without architectures is named first)
    model_method = model_method_of(cfg)
    if model_method is not None and model_method.check_sites is not None:
        entry_call(model_method, "check_sites", model_method.check_sites, sites)
    vocab = (base.config or {}).get("vocab_size")
    groups: list[GroupPlan] = []
    notes: list[str] = [*config_notes, *holdout_notes]
    unprompted = _without_prompts(cfg)
    if (not cfg.method.is_qp and cfg.evaluate and not evaluates_baseline(cfg) and model_method is None
            and len(unprompted) < len(cfg.models)):  # (some have prompts: the user may expect one)
        notes.append(f"no evaluation: models {unprompted} have no calibration prompts (the calibration "
                     f"objective and the held-out error are measured only when every model has them)")
    if cfg.method.is_qp:
        mode = get_merge_mode(cfg.method.mode)
        entry = get_parametrisation(cfg.method.parametrisation)
        for site in sites:  # (a basis rank beyond a layer's rows was found after every target was computed)
            try:
                entry.check_site(site, cfg.method.parametrisation_options())
            except ValidationError as exc:
                raise ConfigError(f"method.parametrisation: {exc}") from None
        groups = plan_groups(cfg, sites)
        notes.extend(mode.plan_notes(qp_settings(cfg)))
        if (cfg.output.field == "logits" and cfg.output.restrict == "topk" and cfg.output.k is not None
                and isinstance(vocab, int) and cfg.output.k > vocab):
            raise ConfigError(f"output.k {cfg.output.k}: restrict topk keeps the k largest of the {vocab} logits per "
                              f"position (vocab_size in the base's config.json): k must be at most {vocab}")
        if (cfg.output.field == "logits" and cfg.output.restrict != "none" and cfg.output.k is not None and vocab
                and cfg.output.k >= vocab):
            notes.append(f"output.restrict {cfg.output.restrict} with k = {cfg.output.k} is not below the "
                         f"{vocab} compared values per position: it compares as many or more numbers than all of "
                         f"them (restrict: none is exact, and no larger)")
        if cfg.output.restrict == "none" and cfg.output.sketch is None and vocab and vocab > 4096:
            notes.append(f"vocabulary {vocab}: consider output.restrict projection|topk with k ~ 64..512 to keep "
                         f"the statistics tractable")
    if (matrix is not None and cfg.output.field == "logits" and cfg.output.pool == "none" and not any(heads)
            and not_causal is None and isinstance(vocab, int) and matrix.shape[0] != vocab):
        raise ConfigError(f"output.matrix {cfg.output.matrix}: it has {matrix.shape[0]} rows, but the compared output "
                          f"'logits' has {vocab} numbers per position (vocab_size in the base's config.json); the "
                          f"matrix needs one row per logit")
    _check_auto_batches(cfg, tasks)
    context = context_length(base.config or {})
    if context is not None and cfg.calibration.max_length > context[1]:
        notes.append(f"calibration.max_length {cfg.calibration.max_length} exceeds the model's context "
                     f"({context[0]} {context[1]}): prompts are truncated to {context[1]} tokens")
    plan = MergePlan(cfg, base, fts, ((base.config or {}).get("architectures") or ["?"])[0],
                     (base.config or {}).get("model_type"), sites, extra, tasks, groups, vocab,
                     str(tok_folder) if has_tokenizer(tok_folder) else None, notes=notes, skeleton=model,
                     output_matrix=matrix, heads=heads, not_causal=not_causal)
    if all_texts and has_tokenizer(tok_folder):
        plan.longest_prompt = _longest_prompt(tok_folder, all_texts, plan.max_length, owners)
    if cfg.method.is_qp and cfg.output.fold_head_flag is True:  # (found only after every target was computed)
        why = plan.output_spec().fold_obstacle()
        if why is not None:
            raise ConfigError(f"output.fold_head: true, but the head cannot be folded: {why}")
    _choose_sketch(plan)
    _drop_a_useless_sketch(plan)
    plan.memory = estimate_memory(plan)
    _note_statistics_cost(plan)
    jacobian, cap = plan.memory.get(OPTIMAL_JACOBIAN), cfg.method.basis_max_size
    if jacobian is not None and cap is not None and jacobian > parse_size(cap):
        plan.notes.append(f"method.basis_max_size {cap} is below the optimal basis's mean Jacobian at its upper "
                          f"bound ({human_bytes(jacobian)}, every prompt at the longest length): the run stops at "
                          f"the first layer whose Jacobian, with the real prompt lengths, exceeds it")
    return plan


#: multiply-adds per calibration batch of forming a QP's H above which the plan says what they cost,
#: and ``output.sketch: auto`` takes a sketch (a stop 56 review, SmolLM2 on 2 CPU cores: 21-24 s per
#: batch at 3.7e11 (one down_proj), 150-180 s at 1.5e12 (two))
STATISTICS_BUDGET = 3e11
#: ``output.sketch: auto``'s ``s`` where it sketches: H's relative error about ``sqrt(2 / s)`` (9%)
#: per prompt, averaging over the prompts (docs/hf.md)
AUTO_SKETCH = 256


@dataclass(frozen=True)
class StatisticsWork:
    """What one calibration batch's statistics cost for the plan's costliest QP, in multiply-adds with
    every prompt at the longest length: forming H from ``rows`` (prompts x ``outputs`` compared
    outputs each) of ``n`` coefficients, ``rows x n^2`` (``work``), and the derivative passes that give
    those rows (``derivatives``: :func:`derivative_work`; ``None`` where the plan cannot count them).
    An estimate, not a bound: a FLOP counter on tiny Llama / GPT-2 / BERT / Mixtral models measured
    0.8-1.7x ``total`` (attention's own products and the primal passes of vectorised JVPs are not
    counted; ``tests/run/test_statistics_cost.py``)."""

    prompts: int
    outputs: int
    n: int
    derivatives: float | None = None

    @property
    def rows(self) -> int:
        return self.prompts * self.outputs

    @property
    def work(self) -> float:
        return float(self.rows) * self.n * self.n

    @property
    def energy(self) -> float:
        """The energy fractions' per-prompt Gram and its eigendecomposition (``m^2 M + m^3`` per prompt,
        ``m``, ``M`` the smaller and larger of the outputs and ``n``; stop 58 review: as large as H's
        formation on small models, and not counted)."""
        m, M = min(self.outputs, self.n), max(self.outputs, self.n)
        return float(self.prompts) * (m * m * M + m ** 3)

    @property
    def total(self) -> float:
        """H's formation, the energies and the derivative passes together."""
        return self.work + self.energy + (self.derivatives or 0.0)


def statistics_work(plan: MergePlan, sketch: int | None) -> StatisticsWork | None:
    """:class:`StatisticsWork` of the plan's statistics with ``sketch`` (``None``: exact), at its
    upper bound (every prompt at the longest length); ``None`` for a method without QP statistics."""
    cfg = plan.config
    width = _compared_width(plan)
    if not cfg.method.is_qp or not plan.groups or width is None:
        return None
    spec = replace(plan.output_spec(), sketch=sketch)
    hidden, folds = _hidden_and_folds(plan, spec)
    per, per_prompt = width
    outputs = _design_outputs(spec, folds, 1 if per_prompt else plan.batch_length, per, hidden)
    return StatisticsWork(plan.batch_prompts, outputs, max(g.n_variables for g in plan.groups),
                          derivative_work(plan, outputs, folds, hidden))


def _compared_width(plan: MergePlan) -> tuple[int, bool] | None:
    """The numbers the statistics compare per position, and whether the output is one per prompt
    (a sequence classifier's logits), where the plan can tell from the config: a restriction's ``k``
    or matrix, a language model's vocabulary, a classifier head's classes, the hidden width of
    ``last_hidden_state`` / ``pooler_output``, a classifier's ``num_labels``; ``None`` otherwise (no
    cost is counted). (Stop 58 review: a pooled BERT output and a sequence classifier's logits were
    counted as positions x vocabulary, 8-50x their cost.)"""
    out = plan.config.output
    if out.restrict != "none" or _counts_outputs(plan):
        return plan.per_position, False
    if any(plan.heads):  # class logits through each model's head
        classes = max((t.classes or 0 for t in plan.tasks), default=0)
        return (classes, False) if classes else None
    bcfg = plan.base.config or {}
    hidden = bcfg.get("hidden_size") or bcfg.get("n_embd") or bcfg.get("d_model")
    if out.field in ("last_hidden_state", "pooler_output"):
        return (int(hidden), out.field == "pooler_output") if hidden else None
    arch = ((bcfg.get("architectures") or [""])[0]) or ""
    if out.field == "logits" and arch.endswith(("ForMaskedLM", "ForCausalLM", "LMHeadModel")) and plan.vocab_size:
        return plan.vocab_size, False
    if out.field == "logits" and arch.endswith(("ForSequenceClassification", "ForTokenClassification")):
        labels = bcfg.get("num_labels") or len(bcfg.get("id2label") or {})
        return (int(labels), arch.endswith("ForSequenceClassification")) if labels else None
    return None


def derivative_work(plan: MergePlan, outputs: int, folds: bool, hidden: int) -> float | None:
    """Multiply-adds of one calibration batch's derivative passes for the plan's costliest QP, every
    prompt at the longest length: at each site of the QP, in the mode the run takes there
    (:func:`choose_mode`), ``outputs`` VJPs (reverse) or ``K x atoms`` JVPs (forward), each through
    the matrix products after the site in the model's module order (:attr:`MergePlan.matmul_layers`;
    the backbone's where the head ``folds``, plus the fold's projection from the final ``hidden``
    width), for every prompt and
    position, plus one forward pass of the model per site and the site's own products (the models'
    changes applied to its input; in reverse mode the Jacobian's contraction with them). Module order
    approximates what lies downstream; attention's own products are not counted. ``None`` without a
    skeleton. (Stop 57: the README's merge of four ``down_proj`` spent 214 s per trust-region step in
    these passes, while H's formation, the one cost the plan counted, was a tenth of its note's
    threshold.)"""
    if plan.skeleton is None or not plan.groups:
        return None
    layers = plan.matmul_layers
    order = {name: i for i, (name, _, _) in enumerate(layers)}
    model_madds = sum(madds for _, madds, _ in layers)
    cfg = plan.config
    K = len(cfg.models)
    by_name = {s.name: s for s in plan.sites}
    tokens = plan.batch_prompts * plan.batch_length
    best = 0.0
    for g in plan.groups:
        work = 0.0
        for name in g.sites:
            site = by_name.get(name)
            if site is None or name not in order:
                continue
            tangents = K * _n_atoms(cfg, site)
            reverse = choose_mode(cfg.method.jacobian_mode, outputs, tangents) == "reverse"
            passes = outputs if reverse else tangents
            after = sum(madds for _, madds, in_backbone in layers[order[name] + 1:] if in_backbone or not folds)
            # the site's own products: each model's change applied to the layer's input (K r m1), and in
            # reverse mode the per-sample Jacobian contracted with it (outputs x K r; stop 58 review: the
            # last down_proj, with nothing after it, was 3.6x under without it)
            own = K * site.r * site.m1 + (outputs * K * site.r if reverse else 0)
            work += float(tokens) * (passes * after + model_madds + own)
            if folds:  # each pass's hidden states through the folded head's projection (hidden x its width)
                work += float(plan.batch_prompts) * passes * outputs * hidden
        best = max(best, work)
    return best


def _counts_outputs(plan: MergePlan) -> bool:
    """Whether the plan can count the numbers each prompt compares: a language model's logits per
    position (the vocabulary, or a restriction's k), not a pooled output, a classifier's labels or
    another field, whose widths only the run sees (stop 57 review: a pooled BERT embedding 16 wide
    was counted as the vocabulary's 46, and a sketch wider than the output was chosen)."""
    out = plan.config.output
    return (out.field == "logits" and bool(plan.vocab_size) and out.pool == "none" and not any(plan.heads)
            and plan.not_causal is None)


def _choose_sketch(plan: MergePlan) -> None:
    """``output.sketch: auto``: a sketch of :data:`AUTO_SKETCH` per prompt where the exact
    statistics of one batch would cost more than :data:`STATISTICS_BUDGET` multiply-adds, the
    sketch compares fewer numbers than the prompt and at least halves that cost; exact otherwise. A note says which, and why.
    (Stop 57: docs/hf.md's example, ``restrict: projection, k: 256`` on two of SmolLM2's
    ``down_proj``, formed H from 124,928 rows per batch, 150-180 s each, half an hour per
    trust-region step.) The work counted is :attr:`StatisticsWork.total` (H and the derivative passes);
    a sketch that would not halve it (forward-mode JVPs, which it does not shrink, dominating) is not
    taken."""
    cfg = plan.config
    if cfg.output.sketch != "auto" or not cfg.method.is_qp or not plan.groups:
        return
    if not _counts_outputs(plan):
        plan.add_qp_note("output.sketch auto: the statistics are exact (the plan counts the compared numbers of "
                          "a language model's logits only, and this output is another: give output.sketch: s to "
                          "sketch it)")
        return
    exact = statistics_work(plan, None)
    if exact is None:
        return
    entries = exact.prompts * AUTO_SKETCH * exact.outputs
    sketched = statistics_work(plan, AUTO_SKETCH)
    assert sketched is not None
    why = None
    if exact.total <= STATISTICS_BUDGET:
        why = f"about {exact.total:.2g} multiply-adds per batch, within {STATISTICS_BUDGET:.0g}"
    elif AUTO_SKETCH >= exact.outputs:
        why = f"a sketch of {AUTO_SKETCH} is not below the {exact.outputs:,} numbers each prompt compares"
    elif entries > MAX_SKETCH_ENTRIES:
        why = (f"a sketch of {AUTO_SKETCH} of {exact.outputs:,} compared outputs per prompt would draw {entries:,} "
               f"entries per batch, above {MAX_SKETCH_ENTRIES:,}: restrict the output first (restrict: "
               f"projection|topk) or use smaller batches")
    elif sketched.total > 0.5 * exact.total:
        why = (f"a sketch of {AUTO_SKETCH} would cut a batch's {exact.total:.2g} multiply-adds to {sketched.total:.2g} "
               f"only: the derivative passes, {exact.derivatives or 0:.2g}, do not shrink with it (one JVP per "
               f"coefficient direction in forward mode)")
    if why is not None:
        plan.add_qp_note(f"output.sketch auto: the statistics are exact ({why})")
        return
    plan.auto_sketch = AUTO_SKETCH
    plan.add_qp_note(
        f"output.sketch auto: a sketch of {AUTO_SKETCH} per prompt, since the exact statistics would cost about "
        f"{exact.total:.2g} multiply-adds per batch (above {STATISTICS_BUDGET:.0g}; {_cost_parts(exact)}); "
        f"sketched: {sketched.total:.2g} ({_cost_parts(sketched)}). H is then an unbiased estimate (relative error "
        f"about {(2 / AUTO_SKETCH) ** 0.5:.0%} per prompt, averaging over the prompts), g and c exact, and each QP's "
        f"certificate is of the sketched QP; the calibration objective the modes measure (the trust region's "
        f"true decrease, the report's) is exact. output.sketch: none keeps the statistics exact")


def _cost_parts(cost: StatisticsWork) -> str:
    """:class:`StatisticsWork`'s parts in words."""
    derivatives = ("" if cost.derivatives is None else
                   f" and {cost.derivatives:.2g} in the derivative passes from each site to the compared output")
    return (f"{cost.work:.2g} to form H from {cost.rows:,} rows ({cost.prompts} prompts x {cost.outputs:,} compared "
            f"outputs) of n = {cost.n:,} coefficients, {cost.energy:.2g} for the energy fractions{derivatives}")


#: what reviews measured the statistics to take per batch on 2 CPU cores (SmolLM2-135M, 8 prompts of up
#: to 61 tokens; their multiply-adds counted by :func:`statistics_work` at the plan's upper bound)
MEASURED_COST = ("reviews measured 21-24 s per batch at 4.4e11 (one down_proj, projection k 256), 150-180 s at "
                 "4.6e12 (two, forward-mode JVPs) and 14-20 s at 9.5e11 (four, cross-entropy top 16, sketch 64) on "
                 "2 CPU cores")


def _note_statistics_cost(plan: MergePlan) -> None:
    """A plan note when one calibration batch's statistics need more than
    :data:`STATISTICS_BUDGET` multiply-adds (:func:`statistics_work`: H's formation from the batch's
    design of ``prompts x compared outputs`` rows and n columns, rows x n^2, and the derivative passes
    that give it), at the plan's upper bound (every prompt at the longest length), for every batch of
    every linearisation. (Stop 56 review: a real two-layer merge ran 150-180 s per batch, half an hour
    per trust-region step, with no word from ``--dry-run``; stop 57: four layers' derivative passes, 214
    s per step, were not counted.)"""
    cost = statistics_work(plan, plan.sketch)
    if cost is None or cost.total <= STATISTICS_BUDGET:
        return
    size = plan.config.calibration.batch_size
    batches = sum(-(-t.n_calibration // size) for t in plan.tasks)
    # (under sketch: auto its own note says why it stayed exact)
    advice = (f"; output: {{sketch: auto}} (or sketch: s) makes it {cost.prompts} x s rows (docs/hf.md)"
              if plan.sketch is None and plan.config.output.sketch != "auto" else "")
    plan.add_qp_note(
        f"statistics cost: each calibration batch costs about {cost.total:.2g} multiply-adds with every prompt at the "
        f"longest length "
        f"({_cost_parts(cost)}; {MEASURED_COST}), for each of {batches} batches of every linearisation (each "
        f"sequential layer, each trust-region step){advice}")


def _drop_a_useless_sketch(plan: MergePlan) -> None:
    """Leave ``output.sketch: s`` out, with a note, where a language model's prompts compare at most
    ``s`` numbers each (positions x compared numbers per position, after restriction, not counting
    a fold of the head, which the run may refuse): the exact statistics are then cheaper and exact. (Stop 54 review: `sketch: 100000` on a tiny model
    whose prompts compare 192 numbers took 2 minutes and 5.7 GB instead of 5 s, with no word.)"""
    cfg = plan.config
    s = cfg.output.sketch
    if not cfg.method.is_qp or s is None or s == "auto" or cfg.output.field != "logits" or not plan.vocab_size:
        return
    spec = plan.output_spec()
    hidden, _ = _hidden_and_folds(plan, spec)
    # counted unfolded: the run may still refuse to fold the head (a fine-tune that changed it, a
    # merge site outside the backbone), and then compares every logit (stop 54 review)
    exact = _design_outputs(replace(spec, sketch=None), False, plan.batch_length, plan.per_position, hidden)
    if s >= exact:
        plan.sketch_dropped = True
        plan.notes.append(f"output.sketch {s} is not below the {exact} numbers each prompt compares at most "
                          f"({plan.batch_length} positions x {exact // max(plan.batch_length, 1)}, after "
                          f"restriction, before any fold of the head): the statistics are computed exactly instead "
                          f"(cheaper, and without the sketch's noise)")


def _not_causal(config: dict[str, Any]) -> str | None:
    """:func:`~.architectures.causal_lm_obstacle` of the base's ``config.json``, except for an
    architecture a user registered (its class name need not follow transformers' naming)."""
    archs = config.get("architectures") or []
    if archs and archs[0] in ARCHITECTURES:
        return None
    return causal_lm_obstacle(config)


def _longest_prompt(folder: Path, texts: Sequence[str], max_length: int, owners: Sequence[str] = ()) -> int | None:
    """Tokens of the longest of ``texts`` (at most ``max_length``) by the tokenizer in ``folder``, or
    ``None`` when it cannot say (the run names tokenizer errors itself). A prompt that tokenises to
    nothing is a :class:`ConfigError` naming its file (``owners[i]``: where ``texts[i]`` came from),
    as the run would say after loading every model (stop 55 review: ``--dry-run`` passed)."""
    try:
        tok = load_tokenizer(folder)
        ids = tok(list(texts), truncation=True, max_length=max_length)["input_ids"]
    except Exception:  # noqa: BLE001 - a tokenizer's own failure: the estimate falls back to max_length
        return None
    empty = [i for i, x in enumerate(ids) if len(x) == 0]
    if empty:
        where = owners[empty[0]] if len(owners) == len(texts) else "calibration"
        raise ConfigError(f"{where}: prompt(s) tokenise to nothing with the tokenizer of {folder}: "
                          f"{[texts[i] for i in empty[:3]]}")
    return max((len(x) for x in ids), default=None)


def _check_auto_batches(cfg: MergeConfig, tasks: Sequence[Any]) -> None:
    """``start: auto`` with folds needs two calibration batches per task: refused by the plan (so by
    ``--dry-run`` too), not after the models and the candidates' statistics were loaded."""
    m = cfg.method
    if not is_auto_start(m.start):
        return
    assert m.start is not None
    folds = parse_auto_params(m.start.params).folds
    B = cfg.calibration.batch_size
    for t in tasks:
        n = too_few_batches(folds, t.n_calibration, B)
        if n is not None:
            held = (f", after calibration.holdout kept {t.n_heldout} of its prompts for the held-out evaluation"
                    if t.n_heldout else "")
            raise ConfigError(f"start: auto with {folds} folds: task {t.name!r} has {n} calibration batch(es) "
                              f"({t.n_calibration} prompts in batches of {B}{held}), at least {MIN_FOLD_BATCHES} are "
                              f"needed (more prompts, a smaller calibration.batch_size"
                              f"{' or calibration.holdout' if held else ''}, or folds: 1)")


def _targets_bytes(plan: MergePlan, spec: OutputSpec, prompts: int, held: int, T: int, per_pos: int) -> int:
    """The fine-tunes' targets of ``spec`` on the calibration and held-out prompts (float64): ``per_pos``
    compared numbers per position, every logit on the held-out ones, or the final hidden state
    where the targets are kept as it (:class:`~mergeqp.lm.HeadTargets`: a linear head much wider
    than its input, every logit compared), and a whitening metric's distributions; the fold's hidden states beside restricted targets
    are not counted."""
    head = linear_head(plan.skeleton) if plan.skeleton is not None else None
    held_spec = plan.heldout_spec()

    def width(s: OutputSpec, whole: int) -> int:
        if head is not None and keeps_head_targets(s, int(head.out_features), int(head.in_features)):
            return int(head.in_features)
        return whole

    # a whitening metric's distributions beside the targets: one number per entry before any projection
    # (stop 59 review: left out, the dry run passed what the run's own memory check refused)
    spread = 0
    if spec.output_metric.whitens:
        spread = int(spec.k) if spec.restrict == "topk" else (plan.vocab_size or per_pos) if spec.field == "logits" \
            else per_pos
    return (prompts * T * (width(spec, per_pos) + spread) * 8
            + held * T * width(held_spec, plan.vocab_size or per_pos) * 8)


def _hidden_and_folds(plan: MergePlan, spec: OutputSpec) -> tuple[int, bool]:
    """The final hidden width, and whether a language model's head folds into it (docs/lm-statistics.md:
    its width is then compared, and no logits' tangents are formed)."""
    bcfg = plan.base.config or {}
    hidden = int(bcfg.get("hidden_size") or bcfg.get("n_embd") or max((s.r for s in plan.sites), default=1))
    return hidden, bool(plan.vocab_size) and spec.fold_obstacle() is None and plan.structure_folds


def qp_site_memory(plan: MergePlan) -> list[SiteMemory]:
    """Each QP's memory model (:func:`mergeqp.io.memory.estimate_site_memory`: the check the run makes
    at its first batch, with the sizes it measures) at the plan's upper bounds: batches of
    ``calibration.batch_size`` prompts at the longest length, each site's derivatives in the mode the
    run takes for it (``jacobian_mode``; ``auto`` counts, as the run does: ``K x atoms`` JVPs against
    one VJP per compared output), through the layers the run differentiates (the backbone's where the
    head folds: stop 57 review, a SmolLM2 dry run counted VJP chunks 49,152 wide, the vocabulary, and
    warned of 57.2 GiB where the run's own check, through 1,536-wide layers, passed). ``[]`` for a
    baseline."""
    cfg = plan.config
    if not cfg.method.is_qp:
        return []
    T = plan.batch_length
    spec = plan.output_spec()
    hidden, folds = _hidden_and_folds(plan, spec)
    outputs = _design_outputs(spec, folds, T, plan.per_position, hidden)
    batch = {"samples": plan.batch_prompts, "outputs": outputs, "itemsize": DTYPE_BYTES[cfg.dtype], "positions": T,
             "chunk": cfg.method.chunk_size, "widest": plan.derivative_width(folds)}
    by_name = {s.name: s for s in plan.sites}
    K = len(cfg.models)
    out = []
    for g in plan.groups:
        sites = [by_name[name] for name in g.sites if name in by_name]
        reverse = [choose_mode(cfg.method.jacobian_mode, outputs, K * _n_atoms(cfg, s)) == "reverse" for s in sites]
        out.append(estimate_site_memory(
            ", ".join(g.sites), g.n_variables, K, site_width=max((s.r for s in sites), default=0),
            tangent_atoms=sum(K * _n_atoms(cfg, s) for s, rev in zip(sites, reverse) if not rev),
            jacobian_width=max((s.r for s, rev in zip(sites, reverse) if rev), default=0), **batch))
    return out


def _design_outputs(spec: OutputSpec, folds: bool, T: int, per_pos: int, hidden: int) -> int:
    """Compared outputs per prompt in the statistics' design, as the run forms them: a sketch's
    count; else positions (one when pooled) times the numbers compared per position, at most the
    final hidden width where a language model's head ``folds`` into it (a Linear head assumed; the
    run checks it, and the design, at its start: ``check_first_design``) except under ``topk``,
    whose folded width is its k."""
    if spec.sketch is not None:
        return int(spec.sketch)
    narrowed = folds and spec.restrict != "topk"
    if spec.restrict == "topk" and spec.scores_data:
        per_pos += 1  # the top k tokens and the rest as one logit (stop 57 review: counted k)
    return (1 if spec.pool != "none" else T) * (min(per_pos, hidden) if narrowed else per_pos)


#: the memory estimate's item of one batch's derivatives (the largest QP's, as its memory model counts them)
DERIVATIVES = ("derivatives (one batch: the atoms' tangents or the sites' Jacobians, and one vectorised JVP / VJP "
               "chunk)")
#: the memory estimate's item of the optimal basis's mean Jacobian (the largest layer's)
OPTIMAL_JACOBIAN = "optimal-basis mean Jacobian (one layer)"
#: the memory estimate's item of the optimal basis's pass (one chunk of ``chunk_size`` tangents)
BASIS_PASS = "optimal-basis pass (a chunk of vectorised JVPs through the head, shrunk at run time to fit)"


def basis_pass_tangent(plan: MergePlan) -> int | None:
    """Bytes of one tangent of the optimal basis's pass at the plan's upper bounds (``None``: no such
    pass): its estimate's chunk over the chunk's tangents (the dry run warns when not one fits)."""
    chunk_bytes = plan.memory.get(BASIS_PASS)
    if chunk_bytes is None:
        return None
    tangents = min(plan.config.method.chunk_size, max((s.r for s in plan.sites), default=0))
    return chunk_bytes // tangents if tangents else chunk_bytes


def estimate_memory(plan: MergePlan) -> dict[str, int]:
    """Peak-memory estimate in bytes, by item (see ``docs/hf.md``)."""
    cfg = plan.config
    elem = DTYPE_BYTES[cfg.dtype]
    numel = sum(plan.base.info(n).numel for n in plan.base.names())
    K = len(cfg.models)
    T = plan.batch_length
    B = plan.batch_prompts
    per_pos = plan.per_position
    prompts = sum(t.n_calibration for t in plan.tasks)
    held = sum(t.n_heldout for t in plan.tasks)
    spec = plan.output_spec()
    targets = _targets_bytes(plan, spec, prompts, held, T, per_pos)
    stats_method = statistics_method(cfg)
    if not cfg.method.is_qp:  # streamed in chunks: K + 2 copies of one chunk
        merged = sum(plan.base.info(k).nbytes for k in plan.merged_keys())
        out = {"merged tensors (one chunk)": min(merged, DEFAULT_CHUNK_BYTES) * (K + 2)}
        model_method = model_method_of(cfg)
        if stats_method is not None or evaluates_baseline(cfg) or model_method is not None:
            out["models (one at a time)"] = numel * elem
        if stats_method is not None:
            out[f"{stats_method} statistics"] = _statistics_bytes(plan, stats_method, plan.merged_keys())
        if model_method is not None and model_method.memory is not None:
            parsed = entry_call(model_method, "parse", model_method.parse, cfg.method.params, "method")
            def statistics_bytes(name: str) -> int:
                if statistics_of(name) is None:
                    raise ConfigError(f"model method {model_method.name!r}: memory asked for the statistics of "
                                      f"{name!r}, which declares none (those that do: "
                                      f"{', '.join(statistics_methods())})")
                return _statistics_bytes(plan, name, plan.merged_keys())

            items = entry_call(model_method, "memory", model_method.memory, parsed, statistics_bytes)
            if not isinstance(items, dict) or not all(isinstance(k, str) and isinstance(v, (int, np.integer))
                                                      and not isinstance(v, bool) and v >= 0 for k, v in items.items()):
                raise ConfigError(f"model method {model_method.name!r}: memory(parsed, statistics_bytes) must return a "
                                  f"dict of item name -> bytes (an integer >= 0), got {items!r:.120}")
            out.update({k: int(v) for k, v in items.items()})
        if evaluates_baseline(cfg) or model_method is not None:
            out["targets"] = targets
        return out
    m = cfg.method
    mode = plan.mode
    resident = numel
    if cfg.lazy and plan.skeleton is not None:  # the blocks below the sites stay on disk, one read at a time
        sizes = [sum(p.numel() for p in b.parameters()) for b in lower_blocks(plan.sites)(plan.skeleton)]
        resident = numel - sum(sizes) + max(sizes, default=0)
    out = {"models" + (" (resident: lazy)" if cfg.lazy else ""):
           mode.models_in_memory(qp_settings(cfg)) * resident * elem}
    if is_auto_start(m.start):
        assert m.start is not None
        auto = parse_auto_params(m.start.params)
        fits, held_fit = held_out_fit(auto, mode.start_holdout(m.mode_options))
        out["start candidates (the best, its fit without the held-out batches, the current; all tensors)"] = (
            (2 if held_fit is None else 3) * plan.base.total_bytes)
        for need in statistics_candidates(auto, statistics_of, plan.start_skips, start_statistics):
            label = (f"{need.label} statistics ({fits} fit(s), if every tensor differs from the base: the run "
                     f"collects them for those that do)")
            out[label] = fits * _statistics_bytes(plan, need.name, plan.float_keys())
    elif mode.uses_start and m.start is not None:
        # a start fitted to data is also fitted without the batches the mode holds out from it
        held = stats_method is not None and mode.start_holdout(m.mode_options) > 0
        out["start merge (all tensors" + (", and its fit without the held-out batches)" if held else ")")] = (
            (2 if held else 1) * plan.base.total_bytes)
        if stats_method is not None:
            out[f"{stats_method} statistics (all tensors" + (", 2 fits)" if held else ")")] = (
                (2 if held else 1) * _statistics_bytes(plan, stats_method, plan.float_keys()))
    site_keys = plan.site_keys()
    for name, _ in statistics_baselines(m.baseline_choices):
        out[f"{name} statistics (baseline atoms)"] = _statistics_bytes(plan, name, site_keys)
        out[f"{name} merge (baseline atoms)"] = sum(plan.base.info(k).nbytes for k in site_keys)
    if get_parametrisation(m.parametrisation).needs_output_jacobian(m.parametrisation_options()):
        # upper bound: prompts of max_length tokens; tensor inputs: per-sample outputs unknown here
        out[OPTIMAL_JACOBIAN] = max((jacobian_bytes(T * per_pos, s.r) for s in plan.sites), default=0)
        out["optimal-basis residuals"] = prompts * T * per_pos * 8
        # its pass carries up to chunk_size tangents through the unfolded head at once (the run shrinks
        # the chunk to what the memory holds, down to one tangent)
        r_max = max((s.r for s in plan.sites), default=0)
        out[BASIS_PASS] = basis_pass_bytes(B * T, r_max, plan.widest, elem, min(m.chunk_size, r_max))
    n_max = max((g.n_variables for g in plan.groups), default=0)
    n_tasks = len(cfg.models)
    out["statistics"] = n_tasks * n_max * n_max * 8
    hidden, folds = _hidden_and_folds(plan, spec)
    out["design (one batch: prompts x compared outputs x n, with its float64 copies)"] = design_bytes(
        B, _design_outputs(spec, folds, T, per_pos, hidden), n_max, elem)
    deltas = max((K * s.r * s.m1 * 8 for s in plan.sites), default=0)
    out["deltas"] = deltas * mode.deltas_in_memory(len(plan.sites))
    out["targets"] = targets
    # the QPs' own memory model (what --dry-run's warning and the run's first-batch check count), its
    # derivatives part: the atoms' tangents or the sites' Jacobians and one JVP / VJP chunk (stop 57
    # review: an estimate of its own here said 8.6 GiB beside a warning's 57.2 GiB batch)
    out[DERIVATIVES] = max((site.derivatives for site in qp_site_memory(plan)), default=0)
    return out


def _statistics_bytes(plan: MergePlan, method: str, keys: list[str]) -> int:
    """Float64 bytes of K models' calibration statistics of ``method`` for ``keys`` (its own rule)."""
    spec = statistics_of(method)
    assert spec is not None
    sites = model_sites(plan.skeleton, plan.base.names()) if plan.skeleton is not None else plan.sites
    return spec.nbytes(len(plan.config.models), keys, lambda k: plan.base.info(k).numel, sites)
