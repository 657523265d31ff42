"""The plan of a ``mergeqp merge`` run, as :func:`~mergeqp.run.plan.build_plan` makes it from a config and the
checkpoints' metadata: :class:`MergePlan` (sites, tasks, QP groups, notes, the memory estimate and the
statistics' cost), with what it says of itself (``--dry-run``'s :meth:`MergePlan.render`, ``report.json``'s
:meth:`MergePlan.to_json`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any

from .architectures import lower_blocks
from .auto import candidate_notes, is_auto_start, lazy_skipped, parse_auto_params
from .schema import MergeConfig
from .settings import evaluates_baseline
from ..errors import ConfigError
from ..io.checkpoint import Checkpoint, config_int, positive_int
from ..io.memory import human_bytes
from ..lm import OutputSpec, backbone, linear_head
from ..merge.calibrated import statistics_of
from ..merge.firstorder import widest_layer
from ..merge.modes import MergeMode, get_merge_mode
from ..merge.sites import LayerSite
from ..output_metrics import output_metric
from ..stats.parametrisation import Parametrisation, get_parametrisation
from .model_methods import entry_call, model_method_of, parse_candidate, start_method


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

    def parts(self) -> str:
        """The parts in words."""
        derivatives = ("" if self.derivatives is None else
                       f" and {self.derivatives:.2g} in the derivative passes from each site to the compared output")
        return (f"{self.work:.2g} to form H from {self.rows:,} rows ({self.prompts} prompts x {self.outputs:,} "
                f"compared outputs) of n = {self.n:,} coefficients, {self.energy:.2g} for the energy fractions{derivatives}")



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
    #: the ``s`` that ``output.sketch: auto`` chose (``None``: exact statistics; see :func:`choose_sketch`)
    auto_sketch: int | None = None
    #: what one calibration batch's statistics cost for the costliest QP, with the sketch the run takes
    #: (:func:`~.statistics_cost.count_statistics`; ``None``: no QP statistics, or not counted)
    statistics: StatisticsWork | None = None
    #: the tensors the ``layers`` patterns match that a QP does not merge (not a linear layer's weight or bias:
    #: norms, embeddings), which it keeps as the base's
    qp_unmerged: list[str] = field(default_factory=list)
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
        """Numbers compared per position: a restriction's k or the output matrix's columns; else a
        language model's vocabulary (:func:`counts_outputs`), and otherwise the width the plan can tell
        (:func:`compared_width`: a classifier's labels, a hidden state's features), the vocabulary where it
        cannot (a QA review, stop 76: ``last_hidden_state`` of a BERT was counted as its 30,522-word
        vocabulary, 80x its 384 features, and the dry run asked for 33 GiB)."""
        out = self.config.output
        if out.restrict != "none":
            return int(self.output_matrix.shape[1]) if self.output_matrix is not None else int(out.k)
        if not counts_outputs(self):  # (a classifier's labels, hidden states, a pooled output: their width)
            width = compared_width(self)
            if width is not None:
                return width[0]
        return self.vocab_size or 1

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
        width = compared_width(self)
        if width is None:  # (what the plan cannot count: one, a lower bound)
            return 1
        spec = replace(self.output_spec(), sketch=None)
        hidden, folds = hidden_and_folds(self, spec)
        # (stop 58 review: a sequence classifier's 3 labels were counted as the vocabulary, 46, and an
        # output_space candidate that fits was skipped)
        return min(design_outputs(spec, f, 1, width[0], hidden) for f in {folds, False})

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
                params = f" {m.start.params}" if m.start.params else ""
                lines.append(f"  {m.mode} start: {m.start.name}{params} on every tensor")
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
            cost = self.statistics
            if cost is not None:
                lines.append(f"  statistics cost per calibration batch (every prompt at the longest length): about "
                             f"{cost.total:.2g} multiply-adds ({cost.parts()})")
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


def compared_width(plan: MergePlan) -> tuple[int, bool] | None:
    """The numbers the statistics compare per position, and whether the output is one per prompt
    (a sequence classifier's logits), where the plan can tell from the config: a restriction's ``k``
    or matrix, a language model's vocabulary, a classifier head's classes, the hidden width of
    ``last_hidden_state`` / ``pooler_output``, a classifier's ``num_labels``; ``None`` otherwise (no
    cost is counted). (Stop 58 review: a pooled BERT output and a sequence classifier's logits were
    counted as positions x vocabulary, 8-50x their cost.)"""
    out = plan.config.output
    if out.restrict != "none" or counts_outputs(plan):
        return plan.per_position, False
    if any(plan.heads):  # class logits through each model's head
        classes = max((t.classes or 0 for t in plan.tasks), default=0)
        return (classes, False) if classes else None
    bcfg = plan.base.config or {}
    hidden = hidden_width(bcfg)
    if out.field in ("last_hidden_state", "pooler_output"):
        return (hidden, out.field == "pooler_output") if hidden else None
    arch = ((bcfg.get("architectures") or [""])[0]) or ""
    if out.field == "logits" and arch.endswith(("ForMaskedLM", "ForCausalLM", "LMHeadModel")) and plan.vocab_size:
        return plan.vocab_size, False
    if out.field == "logits" and arch.endswith(CLASSIFIER_SUFFIXES[:2]):
        labels = bcfg.get("num_labels") or len(bcfg.get("id2label") or {})
        return (int(labels), arch.endswith("ForSequenceClassification")) if labels else None
    return None


#: the config keys of a model's hidden width, in the order read (DistilBERT: ``dim``)
HIDDEN_WIDTH_KEYS = ("hidden_size", "n_embd", "d_model", "dim")


def hidden_width(config: dict[str, Any]) -> int | None:
    """A model's hidden width from its config: the first of :data:`HIDDEN_WIDTH_KEYS` at the top
    level, else in the language model's sub-config of a composite model (``text_config``, ...,
    :func:`mergeqp.io.checkpoint.config_int`); ``None`` where none holds a positive integer."""
    top = next((config[k] for k in HIDDEN_WIDTH_KEYS if positive_int(config.get(k))), None)
    if top is not None:
        return top
    found = next((f for k in HIDDEN_WIDTH_KEYS if (f := config_int(config, k)) is not None), None)
    return None if found is None else found[1]


def counts_outputs(plan: MergePlan) -> bool:
    """Whether the plan can count the numbers each prompt compares: a language model's logits per
    position (the vocabulary, or a restriction's k), not a pooled output, a classifier's labels or
    another field, whose widths only the run sees (stop 57 review: a pooled BERT embedding 16 wide
    was counted as the vocabulary's 46, and a sketch wider than the output was chosen)."""
    out = plan.config.output
    return (out.field == "logits" and bool(plan.vocab_size) and out.pool == "none" and not any(plan.heads)
            and plan.not_causal is None)


def hidden_and_folds(plan: MergePlan, spec: OutputSpec) -> tuple[int, bool]:
    """The final hidden width, and whether a language model's head folds into it (docs/lm-statistics.md:
    its width is then compared, and no logits' tangents are formed)."""
    bcfg = plan.base.config or {}
    hidden = hidden_width(bcfg) or max((s.r for s in plan.sites), default=1)
    return hidden, bool(plan.vocab_size) and spec.fold_obstacle() is None and plan.structure_folds


def design_outputs(spec: OutputSpec, folds: bool, T: int, per_pos: int, hidden: int) -> int:
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


#: configuration keys that hold a model's context length (positions it was built for; MPT's max_seq_len)
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length", "max_seq_len")
#: architectures whose logits are labels, not a vocabulary
CLASSIFIER_SUFFIXES = ("ForSequenceClassification", "ForTokenClassification", "ForMultipleChoice",
                       "ForQuestionAnswering")


def context_length(config: dict[str, Any]) -> tuple[str, int] | None:
    """``(key, positions)`` of a Hugging Face config's context length, or ``None`` when it names
    none (:data:`CONTEXT_KEYS`, the first positive integer found; a composite model's in its language
    sub-config, the key then dotted: ``text_config.max_position_embeddings``)."""
    return next((found for key in CONTEXT_KEYS if (found := config_int(config, key)) is not None), None)
