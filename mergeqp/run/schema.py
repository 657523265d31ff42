"""The typed input of a ``mergeqp merge`` run: the config schema (pydantic v2, unknown keys forbidden).

A minimal file::

    base: ./base                      # a Hugging Face folder (fine-tunes may also be weight files)
    models:
      - {name: code, path: ./ft_code, calibration: ./code.jsonl}
      - {name: math, path: ./ft_math, calibration: ./math.txt}
    layers: ["model.layers.*.mlp.down_proj"]
    method: auto                      # the recommended merge (also the default); or e.g.
                                      # {name: qp, mode: sequential, constraints: ["box:0,1"]}

Every block rejects keys it does not know with an error that names the key and lists the valid
ones (a misspelt ``desnity`` is an error, never a silent default); names of modes,
parametrisations and bases are checked against their registries. Relative paths are resolved
against ``root`` (the folder of the config file). :func:`check_paths` verifies that every input
exists (run before anything heavy). Reading YAML files is :mod:`mergeqp.config`'s job; the full
reference is ``docs/hf.md``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ValidationError as PydanticValidationError
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from ..errors import OWN_ENTRY_HINT, ConfigError, MergeQPError, did_you_mean, unknown
from ..io.writer import parse_size
from ..merge.baseline_residuals import check_baselines
from ..merge.modes import MERGE_MODES
from ..output_metrics import OUTPUT_METRICS, output_metric
from ..plugins import imported_modules
from ..stats.bases import BASES, checkpoint_bases
from ..stats.parametrisation import PARAMETRISATIONS
from .auto import AUTO_METHOD, auto_method_config, is_auto_start, named_entries
from .model_methods import MODEL_METHODS, method_names

DTYPES = ("float32", "float64", "bfloat16", "float16")
RESTRICTIONS = ("none", "topk", "projection")


def is_device_name(name: Any) -> bool:
    """Whether ``name`` is a device mergeqp runs on: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    return isinstance(name, str) and (name in ("auto", "cpu", "cuda")
                                      or (name.startswith("cuda:") and name[5:].isdigit()))


def size_number(v: Any) -> Any:
    """A size written as a float (``8e9``: a number in YAML 1.2) as the integer it is; another float
    is an error that says how sizes are written. Anything else passes unchanged."""
    if isinstance(v, float) and not isinstance(v, bool):
        if math.isfinite(v) and v >= 0 and v.is_integer():
            return int(v)
        raise ValueError(f"a size is a whole number of bytes or a string such as 5GB or 512MB, got {v!r}")
    return v


def _registered(kind: str, name: str, valid: list[str]) -> str:
    """``name`` if it is one of the registry's ``valid`` names, else a ``ValueError`` listing them
    (with a did-you-mean)."""
    if name in valid:
        return name
    hint = did_you_mean(name, valid)
    raise ValueError(f"unknown {kind} {name!r}{hint}; valid: {', '.join(valid)}"
                     + ("" if hint else f"; {OWN_ENTRY_HINT}"))


def _keys(names: list[str]) -> str:
    return " and ".join(repr(n) for n in names)


#: top-level keys of a mergekit YAML (named when a mergekit config is given to ``mergeqp merge``)
MERGEKIT_KEYS = frozenset({"base_model", "merge_method", "slices", "dtype_out", "tokenizer_source"})

#: what each block is, for a value of the wrong kind (pydantic would name the class)
BLOCK_SHAPES = {
    "ModelEntry": "a mapping {path, name, calibration, weight, head} per fine-tune, e.g. '- path: ./ft_code'",
    "CalibrationOptions": ("a mapping {max_length, batch_size, holdout, balance} (a model's own prompt file goes "
                           "under models[].calibration)"),
    "MethodConfig": "a mapping {name, mode, parametrisation, constraints, ...}, e.g. 'method: {name: qp}'",
    "OutputConfig": "a mapping {field, restrict, k, metric, ...}",
    "PromptSource": "a prompt file, or a mapping {path, field, max_prompts, holdout, label_field}",
    "BaselineSpec": "a method's name, or a mapping {name, params}",
}


class _Strict(BaseModel):
    """Base block: frozen, unknown keys are errors that list the valid keys."""

    # strict: YAML already gives typed values; `batch_size: true` or `seed: "3"` are errors,
    # not silently coerced (an integer is still accepted where a float is expected); no float
    # setting takes inf or NaN
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, strict=True, allow_inf_nan=False)

    @classmethod
    def _declared_keys(cls) -> set[str]:
        """Keys this block takes besides its fields (keys registered entries declare)."""
        return set()

    @model_validator(mode="before")
    @classmethod
    def _unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            valid = cls._declared_keys()
            internal = set()
            for name, f in cls.model_fields.items():
                (internal if f.exclude else valid).add(name)
                if f.alias:
                    valid.add(f.alias)
            bad = [k for k in data if k not in valid and k not in internal]
            if bad:
                key = str(bad[0])
                hint = did_you_mean(key, sorted(valid))
                mergekit = sorted(k for k in bad if k in MERGEKIT_KEYS)
                if mergekit:
                    hint = (f" ({', '.join(mergekit)}: this looks like a mergekit config; mergeqp's keys are base, "
                            f"models[].path and method.name, docs/hf.md)")
                raise ValueError(
                    f"unknown key {key!r}{hint}; valid keys: {', '.join(sorted(valid))}"
                )
        return data


class PromptSource(_Strict):
    """Calibration prompts of one task.

    ``path``: a ``.txt`` file (one prompt per non-empty line), a ``.jsonl`` file (one JSON object
    per line; the prompt is ``field``), or a ``.json`` list of strings / objects.
    ``max_prompts``: use at most this many (the first ones). ``holdout``: how many prompts (an
    integer) or what fraction (a float in (0, 1)) to hold out for evaluation (overrides the
    global ``calibration.holdout``). ``label_field``: each object's integer class index (the row
    of the task's ``head``; in a tensor file, an ``(N,)`` integer tensor of that name), for
    ``output.metric: cross_entropy`` with ``pool: mean`` (a classification objective).
    """

    path: str
    field: str = "text"
    label_field: str | None = None
    max_prompts: int | None = Field(default=None, ge=1)
    holdout: float | int | None = None

    @field_validator("holdout")
    @classmethod
    def _holdout(cls, v: float | None) -> float | int | None:
        return None if v is None else _check_holdout(v)


class ModelEntry(_Strict):
    """One fine-tuned model: its checkpoint, a name, the task weight in the objective, the
    task's calibration prompts (a path, or a :class:`PromptSource` block) and, for a
    classification objective (``output.metric: cross_entropy`` with ``pool: mean``), the task's
    classifier ``head``: a ``.safetensors`` / ``.pt`` / ``.npz`` file holding ``weight``
    ``(classes, features)`` and optionally ``bias`` ``(classes,)``, applied to the merged model's
    pooled output."""

    path: str
    name: str | None = None
    weight: float = Field(default=1.0, ge=0.0)
    calibration: PromptSource | None = None
    head: str | None = None

    @field_validator("calibration", mode="before")
    @classmethod
    def _path_shorthand(cls, v: Any) -> Any:
        return {"path": v} if isinstance(v, (str, Path)) else v

    @field_validator("weight")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("weight must be finite")
        return v

    def prompts(self) -> PromptSource | None:
        return self.calibration


class CalibrationOptions(_Strict):
    """How prompts become batches: ``max_length`` tokens per prompt (longer ones are
    truncated), ``batch_size`` prompts per batch, ``holdout`` prompts per task kept out of the
    statistics for the held-out evaluation (count or fraction; 0 disables evaluation).
    ``balance``: ``none`` (default: the objective sums over every compared token, so a task with
    longer or more prompts weighs more) or ``tokens`` (each task's weight is divided by its number
    of compared positions in the calibration prompts and multiplied by the mean of those numbers
    over the tasks: every task counts by its mean per token, as a mean of per-task metrics does)."""

    max_length: int = Field(default=128, ge=2)
    batch_size: int = Field(default=8, ge=1)
    holdout: float | int = 0.25
    balance: Literal["none", "tokens"] = "none"

    @field_validator("holdout")
    @classmethod
    def _holdout(cls, v: float) -> float | int:
        return _check_holdout(v)


def _check_holdout(v: float) -> float | int:
    if isinstance(v, float) and v == 1.0:
        # (stop 73, a QA review: read as the count 1 where a fraction of 1.0 was meant)
        raise ValueError("holdout 1.0 is ambiguous: a fraction lies in (0, 1) (1.0 would hold every prompt out); "
                         "write 1 for one prompt")
    if isinstance(v, float) and not v.is_integer() and not 0.0 < v < 1.0:
        raise ValueError("holdout is a count (integer >= 0) or a fraction in (0, 1)")
    if isinstance(v, (int, float)) and v < 0:
        raise ValueError("holdout must be >= 0")
    return v


class BaselineSpec(_Strict):
    """A baseline merge (``mergeqp.merge_state_dicts`` method name) and its parameters."""

    name: str
    params: dict[str, Any] = Field(default_factory=dict)


class MethodConfig(_Strict):
    """How to merge.

    ``name: qp`` (the default name of a written-out block) solves the merge QP at every selected
    layer; any other name is a baseline of ``mergeqp.MERGE_METHODS`` applied to the selected layers
    with ``params``. ``method: auto`` (the default when the file has no ``method``) is the
    recommended merge, the block :func:`mergeqp.run.auto.auto_method_config` writes out: a
    trust-region QP from ``start: {name: auto}``, the start chosen among candidate merges on
    held-out calibration batches (:mod:`mergeqp.run.auto`).

    QP settings: ``mode`` (a registered merge mode, :mod:`mergeqp.merge.modes`: ``single`` = each
    layer independently at the base model; ``sequential`` = layer by layer, statistics recomputed
    on the partially merged model; ``joint`` = one first-order QP over all selected layers'
    coefficients; ``hybrid`` = start from the ``start`` baseline merged on ALL layers, then refine
    the selected layers sequentially; ``trust_region`` = from the ``start`` merge, or the base when
    none is given, trust-region QPs over all selected layers accepted only on a true calibration
    decrease, default constraints none); ``mode_options``: the selected mode's own options
    (validated by its entry; modes without options reject a non-empty block); ``parametrisation`` (a registered parametrisation:
    ``scalar``, ``rows``, ``columns``, ``basis``); ``basis`` (a registered basis a checkpoint
    merge can build: ``svd``, ``random`` or ``optimal``: the paper's Corollary 4.2 with the
    calibration-mean output Jacobian, see ``docs/hf.md``) and ``rank`` (for ``basis``); the
    parametrisation entry checks the keys it reads; ``baselines`` (for ``rows+baselines``: the
    tensor-wise baselines whose merged residuals are atoms beside the rows, each a method name or
    ``{name, params}``; every baseline is then a feasible point, see ``docs/statistics.md``);
    ``basis_max_size``: cap on the
    ``(c, r)`` float64 mean Jacobian that ``basis: optimal`` forms per layer (``c`` = compared
    outputs per sample, e.g. tokens x k); ``constraints`` (a list of ``mergeqp solve`` spellings, intersected:
    ``box:0,1``, ``simplex``, ``l1:R``, ``nonneg``, ``global_simplex``, ``sign[:density]``);
    ``solver`` (``auto`` or a registry name) and ``solver_options``; ``regularisation`` ``mu``
    adds ``mu ||d - d_ref||^2`` with ``d_ref`` the soup (``reference: soup``: each parametrisation's
    ``task_vector_point`` at ``1/K``) or 0;
    ``compare_sequential``: the older spelling of ``mode: joint``'s ``mode_options:
    {compare_sequential: ...}`` (also run the sequential QP on the same layers and put the
    comparison in the report; default true), refused with another mode;
    ``chunk_size``: atoms per vectorised JVP call;
    ``jacobian_mode``: how the statistics' derivatives are taken: ``forward`` (one JVP per atom),
    ``reverse`` (one VJP per compared output) or ``auto`` (default: the fewer, by counting; the
    two agree to rounding, :func:`mergeqp.stats.linearise.choose_mode`).
    """

    # a registered parametrisation's own keys (``config_options``) are keys of this block too;
    # they are kept as extras (``model_extra``), every other unknown key is still refused
    model_config = ConfigDict(**{**_Strict.model_config, "extra": "allow"})

    name: str = "qp"
    mode: str = "sequential"
    parametrisation: str = "rows"
    basis: str = "svd"
    rank: int | None = Field(default=None, ge=1)
    basis_max_size: str | int = "2GB"
    constraints: list[str] = Field(default_factory=lambda: ["box:0,1"])
    solver: str = "auto"
    solver_options: dict[str, Any] = Field(default_factory=dict)
    regularisation: float = Field(default=0.0, ge=0.0)
    reference: Literal["soup", "zero"] = "soup"
    start: BaselineSpec | None = None
    mode_options: dict[str, Any] = Field(default_factory=dict)
    baselines: list[BaselineSpec] = Field(default_factory=list)
    compare_sequential: bool | None = None
    chunk_size: int = Field(default=256, ge=1)
    jacobian_mode: Literal["auto", "forward", "reverse"] = "auto"
    params: dict[str, Any] = Field(default_factory=dict)

    @property
    def effective_mode_options(self) -> dict[str, Any]:
        """``mode_options`` with the older spelling ``compare_sequential`` folded in (``joint``'s option)."""
        if self.compare_sequential is None:
            return dict(self.mode_options)
        return {**self.mode_options, "compare_sequential": self.compare_sequential}

    @classmethod
    def _declared_keys(cls) -> set[str]:
        """The keys registered parametrisations read (``config_options``: a user's entry's own keys
        are keys of the method block, like ``basis`` / ``rank``; before stop 49 an entry declaring one
        made every config fail with an AttributeError)."""
        return {k for p in PARAMETRISATIONS.values() for k in p.config_options} - set(cls.model_fields)

    @model_validator(mode="before")
    @classmethod
    def _named(cls, data: Any) -> Any:
        """``method: soup`` is ``{name: soup}``; ``method: auto`` (or ``{name: auto, params: {...}}``)
        is the block it stands for (:func:`mergeqp.run.auto.auto_method_config`)."""
        if isinstance(data, str):
            data = {"name": data}
        if isinstance(data, dict) and data.get("name") == AUTO_METHOD:
            extra = sorted(k for k in data if k not in ("name", "params"))
            if extra:
                raise ValueError(f"auto takes only 'params' (candidates, folds, holdout), not {extra}; to set "
                                 "them write the QP out: name: qp, mode: trust_region, start: {name: auto}")
            return auto_method_config(data.get("params") or {})
        return data

    @model_validator(mode="before")
    @classmethod
    def _mode_default_constraints(cls, data: Any) -> Any:
        """A mode's own default constraint set (``default_constraints``) when none is given."""
        if isinstance(data, dict) and "constraints" not in data and data.get("mode") in MERGE_MODES:
            default = MERGE_MODES[data["mode"]].default_constraints
            if default is not None:
                return {**data, "constraints": list(default)}
        return data

    @field_validator("basis_max_size", mode="before")
    @classmethod
    def _basis_max_size(cls, v: Any) -> Any:
        return size_number(v)

    @field_validator("baselines", mode="before")
    @classmethod
    def _baseline_names(cls, v: Any) -> Any:
        """``baselines: [ties, {name: dare, params: {...}}]``: a bare name is that method with its defaults."""
        return named_entries(v)

    @field_validator("start", mode="before")
    @classmethod
    def _start_name(cls, v: Any) -> Any:
        """``start: soup``: a bare name is that method with its defaults (as for ``method``)."""
        return {"name": v} if isinstance(v, str) else v

    @field_validator("constraints", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [v]
        if v is None:
            return []
        return v

    @field_validator("mode")
    @classmethod
    def _mode(cls, v: str) -> str:
        return _registered("merge mode", v, list(MERGE_MODES))

    @field_validator("parametrisation")
    @classmethod
    def _parametrisation(cls, v: str) -> str:
        return _registered("parametrisation", v, list(PARAMETRISATIONS))

    @field_validator("basis")
    @classmethod
    def _basis(cls, v: str) -> str:
        if v in BASES and v not in checkpoint_bases():
            raise ValueError(f"basis {v!r} is registered without a checkpoint_source, so a checkpoint merge cannot "
                             f"build it (register_basis(..., checkpoint_source='deltas' or 'output_jacobian')); "
                             f"bases a merge can build: {', '.join(checkpoint_bases())}")
        return _registered("basis", v, checkpoint_bases())

    @model_validator(mode="after")
    def _consistent(self) -> MethodConfig:
        if self.name != "qp":
            qp_only = [k for k in ("mode", "parametrisation", "basis", "rank", "basis_max_size", "constraints", "solver",
                                   "solver_options", "regularisation", "reference", "start",
                                   "mode_options", "baselines", "compare_sequential", "chunk_size", "jacobian_mode")
                       if k in self.model_fields_set]
            known = method_names()
            if qp_only and self.name not in known:  # a misspelt name, not a baseline: say that first
                raise ValueError(str(unknown("merge method", self.name, ["qp", AUTO_METHOD, *known])))
            if qp_only:
                kind = "a model method" if self.name in MODEL_METHODS else "a baseline"
                raise ValueError(
                    f"method {self.name!r} is {kind}: key(s) {qp_only} apply only to name: qp; "
                    f"give its parameters under 'params'"
                )
            return self
        if self.params:
            raise ValueError("'params' is for baselines; the QP is configured by its own keys")
        mode = MERGE_MODES[self.mode]
        if mode.uses_start and mode.start_required and self.start is None:
            raise ValueError(f"mode: {self.mode} needs 'start': the baseline merged on all layers first, "
                             "e.g. start: {name: task_arithmetic, params: {scaling: 0.5}}")
        if not mode.uses_start and self.start is not None:
            users = [n for n, m in MERGE_MODES.items() if m.uses_start]
            raise ValueError(f"'start' is only used with mode: {' or '.join(users)}")
        if mode.options is None and self.mode_options:
            owners = [n for n, m in MERGE_MODES.items() if m.options is not None]
            raise ValueError(f"mode_options: mode: {self.mode} takes no options (modes with options: "
                             f"{', '.join(owners) or 'none'})")
        if self.compare_sequential is not None:
            owners = [n for n, m in MERGE_MODES.items()
                      if m.options is not None and "compare_sequential" in m.options.model_fields]
            if self.mode not in owners:
                raise ValueError(f"compare_sequential applies only to mode: {' or '.join(owners) or '(none)'} "
                                 f"(the sequential QP beside the joint one), not to mode: {self.mode}")
            given = self.mode_options.get("compare_sequential", self.compare_sequential)
            if given != self.compare_sequential:
                raise ValueError(f"compare_sequential is given twice with different values: "
                                 f"{self.compare_sequential} (method.compare_sequential) and {given} "
                                 f"(method.mode_options.compare_sequential); give it once, under mode_options")
        if mode.regularises_toward is not None and "reference" in self.model_fields_set:
            # (stop 73, a QA review: accepted and silently ignored, while other keys that do not apply are refused)
            raise ValueError(f"reference is not used with mode: {self.mode}: its regularisation pulls toward "
                             f"{mode.regularises_toward}; remove 'reference'")
        mode.check_options(self.effective_mode_options)
        param = PARAMETRISATIONS[self.parametrisation]
        options = self.parametrisation_options()
        given = [k for k in options if k in self.model_fields_set or k in (self.model_extra or {})
                 or (k == "rank" and self.rank is not None)]
        foreign = [k for k in given if k not in param.config_options]
        if foreign:
            owners = [n for n, p in PARAMETRISATIONS.items() if set(foreign) <= set(p.config_options)]
            raise ValueError(f"the key(s) {_keys(foreign)} apply only to parametrisation: "
                             f"{' or '.join(owners) or '(none registered)'}")
        param.check_config(options, given)
        if self.baselines:
            try:
                check_baselines(self.baseline_choices)
            except MergeQPError as exc:
                raise ValueError(str(exc)) from None
        return self

    def parametrisation_options(self) -> dict[str, Any]:
        """The parametrisation options of this block: every key some registered parametrisation
        reads (``config_options``), with its value."""
        keys = dict.fromkeys(k for p in PARAMETRISATIONS.values() for k in p.config_options)
        extra = self.model_extra or {}
        return {k: getattr(self, k) if k in type(self).model_fields else extra.get(k) for k in keys}

    @property
    def baseline_choices(self) -> tuple[tuple[str, dict[str, Any]], ...]:
        """``baselines`` as ``(name, params)`` pairs (``rows+baselines``'s atoms)."""
        return tuple((b.name, dict(b.params)) for b in self.baselines)

    @property
    def is_qp(self) -> bool:
        return self.name == "qp"


class OutputConfig(_Strict):
    """What model output is compared, and how a large vocabulary is made tractable.

    ``field``: the attribute of the model output (``logits`` by default; ``last_hidden_state``
    for bare encoders). ``restrict``: ``none`` (every logit), ``projection`` (a seeded Gaussian
    random projection of each position's logits to ``k`` dimensions, scaled by ``1/sqrt(k)``:
    an unbiased estimate of the squared error, Johnson-Lindenstrauss), or ``topk`` (the ``k``
    logits that the task's fine-tuned model ranks highest at each position, the same indices for
    the merged model: the objective only sees those entries). ``metric``: ``euclidean`` (the
    squared logit error), ``kl`` (the softmax Gauss-Newton metric: the objective approximates
    ``2 * sum KL(fine-tune || merged)`` of the next-token distributions, :mod:`mergeqp.lm`) or
    ``cross_entropy`` (``2 * sum`` of the next-token negative log-likelihoods of the calibration
    prompts' own tokens, exact; each QP is its Gauss-Newton model at the current merge; ``topk``
    tracks the model's top ``k`` tokens and the rest as one logit), or a metric a user registered
    (:func:`mergeqp.output_metrics.register_output_metric`, a module of ``imports:``).
    ``fold_head``: ``auto`` (default), ``true`` or ``false``: compute the statistics from the final
    hidden state through the model's linear head folded into the metric (the same objective to
    rounding, no ``tokens x vocabulary`` logits in the derivative passes; ``auto`` folds whenever
    the head is a shared ``nn.Linear`` and the output allows it, ``true`` fails naming why not;
    :class:`mergeqp.lm.FoldedHead`). ``sketch``: ``s`` (default none): the statistics' Hessian
    from ``s`` seeded Gaussian combinations of each sample's compared outputs (unbiased; ``g``
    and ``c`` stay exact), so that reverse mode costs ``s`` VJPs per batch; ``auto``: a sketch of
    :data:`mergeqp.run.statistics_cost.AUTO_SKETCH` where the exact statistics of one batch would cost more
    than :data:`mergeqp.run.statistics_cost.STATISTICS_BUDGET` multiply-adds, else exact (the plan says which). ``pool``: ``none``
    (default: every token position) or ``mean`` (one vector per prompt, the mean over its real
    tokens, as a sentence encoder's mean-pooled embedding; Euclidean metric, or ``cross_entropy``
    for a classification: each model's ``head`` reads the pooled output and the objective is ``2 *
    sum`` of the calibration prompts' class negative log-likelihoods, their labels read from
    ``calibration.label_field``). ``matrix``: a
    file (``.npy``, ``.npz``, ``.pt``, ``.safetensors``, ``.txt``, ``.csv``; relative to the config
    file) holding a ``(features, q)`` matrix ``M`` that replaces the random projection
    (``restrict: projection``, no ``k``): the output ``y`` is compared as ``y M``, e.g. through the
    stacked weights of classifier heads that read it, so the objective counts what they see;
    Euclidean metric only.
    """

    field: str = "logits"
    restrict: Literal["none", "topk", "projection"] = "none"
    k: int | None = Field(default=None, ge=1)
    metric: str = "euclidean"
    fold_head: bool | Literal["auto"] = "auto"
    sketch: Annotated[int, Field(ge=1)] | Literal["auto"] | None = None
    pool: Literal["none", "mean"] = "none"
    matrix: str | None = None

    def describe(self) -> str:
        """One line on what the objective compares (the plan and the report print it)."""
        entry = output_metric(self.metric)
        if entry.classifies(self.pool):
            return (f"class labels of the prompts through each model's head on the mean-pooled {self.field} "
                    f"(classification cross-entropy; Gauss-Newton model at the current merge)")
        restrict = ("all entries" if self.restrict == "none" else f"through the matrix in {self.matrix}"
                    if self.matrix is not None else f"{self.restrict} k={self.k}")
        if entry.scores_data:
            return (f"the prompts' own next tokens, {self.field} ({restrict}) (next-token cross-entropy; "
                    f"Gauss-Newton model at the current merge)")
        pooled = ", mean-pooled per prompt" if self.pool != "none" else ""
        return (f"{self.field} ({restrict}{pooled}), metric {self.metric}, targets: fine-tuned models, "
                f"teacher forced")

    @field_validator("metric")
    @classmethod
    def _metric(cls, v: str) -> str:
        return _registered("output metric", v, list(OUTPUT_METRICS))

    @field_validator("sketch", mode="before")
    @classmethod
    def _sketch(cls, value: Any) -> Any:
        """One message for a bad value (pydantic's own named each member of the union)."""
        if value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ValueError(f"takes a whole number of outputs per prompt >= 1, auto, or null (got {value!r})")

    @property
    def fold_head_flag(self) -> bool | None:
        """``fold_head`` as :class:`mergeqp.lm.OutputSpec` takes it (``None`` for ``auto``)."""
        return None if self.fold_head == "auto" else bool(self.fold_head)

    @model_validator(mode="after")
    def _k(self) -> OutputConfig:
        if self.matrix is not None:
            if self.restrict != "projection":
                raise ValueError(f"'matrix' is a projection: it needs restrict: projection, not {self.restrict}")
            if self.k is not None:
                raise ValueError("'matrix' gives the projection's size (its columns): leave out 'k'")
        elif self.restrict != "none" and self.k is None:
            raise ValueError(f"restrict: {self.restrict} needs 'k'")
        if self.restrict == "none" and self.k is not None:
            raise ValueError("'k' applies only to restrict: topk or projection")
        problem = output_metric(self.metric).problem(self.field, self.restrict, self.pool, self.matrix is not None)
        if problem is not None:
            raise ValueError(problem)
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The default metric, fold_head, sketch and pool are left out, so that such a run's plan reads as before."""
        out = handler(self)
        if out.get("metric") == "euclidean":
            del out["metric"]
        if out.get("fold_head") == "auto":
            del out["fold_head"]
        if out.get("sketch") is None:
            out.pop("sketch", None)
        if out.get("pool") == "none":
            del out["pool"]
        if out.get("matrix") is None:
            out.pop("matrix", None)
        return out


#: file stems that name a format, not a model: a model given as such a file is named after its folder
GENERIC_STEMS = frozenset({"model", "pytorch_model", "adapter_model", "diffusion_pytorch_model", "weights",
                           "checkpoint", "state_dict"})


#: suffixes of weight files (a model given as such a file is named by its stem)
WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".npz"})


def default_model_name(path: str) -> str:
    """A model's name when the config gives none: a folder's name; a file's stem (``ft_code.pt`` ->
    ``ft_code``), or its folder's name for a generic stem (``ft_code/model.safetensors`` -> ``ft_code``)."""
    p = Path(path)
    if p.suffix.lower() not in WEIGHT_SUFFIXES or p.is_dir():  # (a folder: "llama-3.1-ft" keeps its dots)
        return p.name
    stem = p.name[: -len(p.suffix)]
    return p.parent.name if stem.lower() in GENERIC_STEMS and p.parent.name not in ("", ".") else stem


class MergeConfig(_Strict):
    """The whole ``mergeqp merge`` file (see the module docstring and ``docs/hf.md``)."""

    #: your own modules (``.py`` files relative to the config's folder, or module names), imported when
    #: the file is read (:func:`mergeqp.config.parse_config`), before any of its names is checked
    imports: list[str] = Field(default_factory=list)
    base: str
    models: list[ModelEntry] = Field(min_length=1)
    layers: list[str] = Field(min_length=1)
    #: the recommended merge when no method is chosen (``method: auto``)
    method: MethodConfig = Field(default_factory=lambda: MethodConfig.model_validate(AUTO_METHOD))
    calibration: CalibrationOptions = Field(default_factory=CalibrationOptions)
    targets: Literal["finetuned"] = "finetuned"
    output: OutputConfig = Field(default_factory=OutputConfig)
    tokenizer: str | None = None
    device: str = "auto"
    dtype: Literal["float32", "float64", "bfloat16", "float16"] = "float32"
    output_dtype: Literal["float32", "float64", "bfloat16", "float16"] | None = None
    max_shard_size: str | int = "5GB"
    #: cap on each merge site's statistics and solve (``"8GB"``, bytes); ``None``: the machine's memory
    max_memory: str | int | None = None
    #: models larger than memory: keep off the linearised path on disk (``mergeqp.io.lazy_model``)
    lazy: bool = False
    evaluate: bool = True
    seed: int = Field(default=0, ge=0, le=2**63 - 1)

    #: folder of the config file (relative paths are resolved against it); not a YAML key
    root: str = Field(default=".", exclude=True)
    #: the config file itself, when read from one (an input: never overwritten); not a YAML key
    config_file: str | None = Field(default=None, exclude=True)

    @field_validator("layers", mode="before")
    @classmethod
    def _layers(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [v]
        return v

    @field_validator("max_memory", "max_shard_size", mode="before")
    @classmethod
    def _size_numbers(cls, v: Any) -> Any:
        return size_number(v)

    @field_validator("max_memory")
    @classmethod
    def _max_memory(cls, v: str | int | None) -> str | int | None:
        if v is not None:
            try:
                parse_size(v)
            except MergeQPError as exc:
                raise ValueError(str(exc)) from None
        return v

    def max_memory_bytes(self) -> int | None:
        """``max_memory`` in bytes (``None`` when not set)."""
        return None if self.max_memory is None else parse_size(self.max_memory)

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        v = v.strip().lower()
        if is_device_name(v):
            return v
        raise ValueError(f"device {v!r}; valid: auto, cpu, cuda, cuda:N")

    @model_validator(mode="after")
    def _names(self) -> MergeConfig:
        names = self.model_names()
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"model names must be unique; repeated: {dup} (set 'name' on each model)")
        if all(m.weight == 0 for m in self.models):
            raise ValueError("every model has weight 0: at least one task must count in the objective")
        if self.method.is_qp:
            missing = [n for n, m in zip(names, self.models) if m.prompts() is None]
            if missing:
                auto = "method: auto (the default when no method is given)" if is_auto_start(self.method.start) \
                    else "the QP"
                raise ValueError(f"{auto} needs calibration prompts for every model; missing for {missing} "
                                 f"(or choose a method without data, e.g. method: soup or method: ties)")
        classify = output_metric(self.output.metric).classifies(self.output.pool)
        if classify:
            no_head = [n for n, m in zip(names, self.models) if m.head is None]
            no_labels = [n for n, m in zip(names, self.models)
                         if m.prompts() is not None and m.prompts().label_field is None]
            if no_head or no_labels:
                raise ValueError(
                    "output.metric: cross_entropy with pool: mean scores each task's calibration labels through its "
                    "classifier head: " + "; ".join(
                        part for part in (f"models {no_head} have no 'head'" if no_head else "",
                                          f"models {no_labels} have no calibration.label_field" if no_labels else "")
                        if part))
        else:
            with_head = [n for n, m in zip(names, self.models) if m.head is not None]
            if with_head:
                raise ValueError(f"models {with_head} name a 'head', which only output.metric: cross_entropy with "
                                 f"pool: mean (a classification objective) reads")
            with_labels = [n for n, m in zip(names, self.models)
                           if m.prompts() is not None and m.prompts().label_field is not None]
            if with_labels:  # (it was ignored without a word)
                raise ValueError(f"models {with_labels} name a calibration.label_field, which only output.metric: "
                                 f"cross_entropy with pool: mean (a classification objective, with each model's "
                                 f"'head') reads")
        return self

    # ------------------------------------------------------------------ helpers
    def model_names(self) -> list[str]:
        return [m.name or default_model_name(m.path) or f"model{i}" for i, m in enumerate(self.models)]

    def resolve(self, path: str) -> Path:
        p = Path(path).expanduser()
        return p if p.is_absolute() else (Path(self.root) / p)

    def input_paths(self) -> list[tuple[str, Path]]:
        """``(what, path)`` for every input the config names, in order."""
        out = [("base", self.resolve(self.base))]
        for name, m in zip(self.model_names(), self.models):
            out.append((f"models[{name}].path", self.resolve(m.path)))
            src = m.prompts()
            if src is not None:
                out.append((f"models[{name}].calibration", self.resolve(src.path)))
            if m.head is not None:
                out.append((f"models[{name}].head", self.resolve(m.head)))
        if self.tokenizer is not None:
            out.append(("tokenizer", self.resolve(self.tokenizer)))
        if self.output.matrix is not None:
            out.append(("output.matrix", self.resolve(self.output.matrix)))
        return out

    def protected_paths(self) -> list[Path]:
        """Every path an output must not be, contain or lie inside: the inputs, the config file and the
        files of the user modules imported (the config's ``imports:``, ``--import``, ``$MERGEQP_IMPORT``:
        a plugin kept in an earlier output folder was deleted by ``--overwrite``)."""
        plugins = [Path(e["file"]) for e in imported_modules() if e.get("file")]
        return ([p for _, p in self.input_paths()] + ([Path(self.config_file)] if self.config_file else [])
                + plugins)

    def holdout_for(self, index: int) -> float | int:
        src = self.models[index].prompts()
        if src is not None and src.holdout is not None:
            return _check_holdout(src.holdout)
        return self.calibration.holdout


def qp_candidate_block(params: dict[str, Any], where: str) -> MethodConfig:
    """The ``method`` block of a ``{name: qp, params: {...}}`` candidate of ``start: auto`` (a QP
    from the base: no start of its own), or a :class:`ConfigError` naming ``where``."""
    mode = MERGE_MODES.get(params.get("mode"))  # (an unknown mode is named by the validation below)
    if "start" in params or "name" in params or (mode is not None and mode.uses_start and mode.start_required):
        needs = [n for n, m in MERGE_MODES.items() if m.uses_start and m.start_required]
        raise ConfigError(f"{where}: a QP candidate is merged from the base: no 'start', 'name' or a mode that "
                          f"needs a start ({', '.join(needs)}) (list the baseline itself as a candidate instead)")
    try:
        return MethodConfig.model_validate({"name": "qp", **params})
    except PydanticValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise ConfigError(f"{where}.params{'.' + loc if loc else ''}: {err['msg']}") from None


def check_paths(cfg: MergeConfig) -> None:
    """Every input path exists (checkpoints, prompt files, tokenizer): one error listing all
    missing ones, before anything is loaded."""
    missing = [f"  {what}: {path}" for what, path in cfg.input_paths() if not path.exists()]
    if missing:
        raise ConfigError("missing input(s):\n" + "\n".join(missing))
