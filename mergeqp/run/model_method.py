"""The type of a *model method*: a ``method:`` of ``mergeqp merge`` that runs on the live models.

A baseline of :data:`mergeqp.MERGE_METHODS` is merged by the run layer tensor by tensor, in chunks
(:func:`mergeqp.merge_state_dicts`), with calibration statistics where it declares them. A model
method needs more: the models themselves and their outputs on the calibration prompts (e.g.
``output_space``, which linearises a reference merge at each selected layer). The run layer hands
it a :class:`RunContext` (the plan, the loaded base, the tasks' targets, evaluation) and takes back
a :class:`MethodOutcome` (the merged tensors, the evaluations, report fields), which it writes and
reports like any other merge.

A new model method is one module that defines a :class:`ModelMethod` and its registration with
:func:`mergeqp.run.model_methods.register_model_method` (also from outside the package: see
``docs/hf.md``, "Model methods"); the plan, the memory estimate, the checks and the pipeline ask the
entry, never its name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .report import Evaluation


class RunContext(Protocol):
    """What a model method gets from the run layer (``mergeqp.run.pipeline``'s run in progress).

    Attributes: ``plan`` (the :class:`~mergeqp.run.plan.MergePlan`: sites, tasks, checkpoints),
    ``cfg`` (its :class:`~mergeqp.run.schema.MergeConfig`), ``device``, ``dtype`` (torch),
    ``spec`` (the compared output, :class:`~mergeqp.lm.OutputSpec`), ``notes`` (the report's notes:
    append to it), ``say`` (a console line)."""

    plan: Any
    cfg: Any
    device: str
    dtype: Any
    spec: Any
    notes: list[str]
    say: Callable[[str], None]

    def prepare_tasks(self, visit: Any = None) -> list[Any]:
        """Each task's calibration batches and targets (every fine-tune loaded once, in turn);
        ``visit``: a statistics collector fed while each fine-tune is loaded."""

    def calibration_batches(self) -> list[list[Any]]:
        """Each model's task's calibration batches (:class:`~mergeqp.io.calibration.Batch`, in the models'
        order), without loading any model or computing targets (for a method that needs the prompts only)."""

    def statistics_collector(self, name: str, params: dict[str, Any], keys: Sequence[str]) -> Any:
        """A collector of the calibration statistics of the registered method ``name``."""

    def collected_merge(self, collector: Any, keys: Sequence[str]) -> dict[str, Any]:
        """The merge of ``keys`` from a collector fed by :meth:`prepare_tasks` (its notes kept)."""

    def baseline_merge(self, name: str, params: dict[str, Any], keys: Sequence[str]) -> dict[str, Any]:
        """``{key: tensor}``: the tensor-wise baseline ``name`` on ``keys``, read in chunks."""

    def load_base_model(self) -> Any:
        """The base model, loaded on the run's device in its dtype."""

    def load(self, model: Any, tensors: Mapping[str, Any]) -> None:
        """Copy ``tensors`` (checkpoint names) into the live ``model``."""

    def evaluate(self, model: Any, tasks: Sequence[Any], **described: Any) -> Any:
        """The report's :class:`~mergeqp.run.report.ModelEvaluation` of ``model`` (calibration
        objective, held-out metrics); ``described``: its ``method`` / ``params`` / ``seconds`` /
        ``statistics``."""


@dataclass(frozen=True)
class MethodOutcome:
    """What a model method returns: ``merged`` (``{checkpoint key: tensor}``: every tensor it sets;
    the others stay the base's), the live ``model`` holding them (or ``None``), the parameters it
    ran with (``params``, for the report), ``seconds``, its ``evaluation`` (or ``None``) and
    ``report_fields`` (extra top-level entries of ``report.json``, e.g. per-layer records)."""

    merged: dict[str, Any]
    model: Any
    params: Mapping[str, Any]
    seconds: float
    evaluation: Evaluation | None = None
    report_fields: Mapping[str, Any] = field(default_factory=dict)


class CandidateContext(Protocol):
    """What a model method's :class:`StartFit` gets from ``start: auto``'s selection, for one fit (one
    split of the calibration batches, or the refit on all of them).

    Attributes: ``model`` (the live base model, every tensor a candidate may change at the base's
    value), ``plan``, ``spec`` (the compared output), ``device``, ``floats`` (the floating-point
    checkpoint keys some fine-tune changed: the tensors a start merges), ``notes`` (the report's notes
    of the selection: append to it), ``say`` (a console line)."""

    model: Any
    plan: Any
    spec: Any
    device: str
    floats: Sequence[str]
    notes: list[str]
    say: Callable[[str], None]

    def merge(self, name: str, params: Mapping[str, Any], label: str | None = None) -> dict[str, Any]:
        """``{key: tensor}`` over :attr:`floats`: the merge method ``name``, fitted on this split's
        batches where it has calibration statistics (one that :attr:`StartFit.statistics` named),
        tensor-wise otherwise. Raises :class:`~mergeqp.run.auto.CandidateSkipped` (naming ``label``)
        when those statistics could not be collected."""

    def load(self, tensors: Mapping[str, Any]) -> None:
        """Load ``tensors`` into :attr:`model`, every other tensor a candidate may change at the base's."""

    def changed_sites(self) -> list[Any]:
        """The selected sites some fine-tune changed (the others keep the base weight in every start)."""


@dataclass(frozen=True)
class StartFit:
    """How a model method runs as a candidate of ``start: auto`` (``start: {name: auto, params:
    {candidates: [NAME, {name: NAME, params: {...}}]}}``), fitted on each split's batches and scored
    on the held-out ones like every candidate.

    - ``fit(context, parsed, tasks)``: the candidate's tensors (``{checkpoint key: tensor}``, over the
      context's ``floats`` and the sites it solves), fitted on ``tasks`` (the split's
      :class:`~mergeqp.merge.firstorder.TaskTargets`); raise :class:`~mergeqp.run.auto.CandidateSkipped`
      with the reason where it cannot run here (the selection goes on without it);
    - ``statistics(parsed)``: the ``(name, params)`` of registered methods whose calibration
      statistics the fit needs per split (collected while each fine-tune is loaded; ``context.merge``
      returns their fitted merge); ``None``: none;
    - ``skip(plan, parsed, auto)``: why the plan already knows the run will skip it (the dry run says
      so); ``auto`` is the selection's :class:`~mergeqp.run.auto.AutoStartParams`; ``None``: never."""

    fit: Callable[[CandidateContext, Any, Sequence[Any]], dict[str, Any]]
    statistics: Callable[[Any], Sequence[tuple[str, Mapping[str, Any]]]] | None = None
    skip: Callable[[Any, Any, Any], str | None] | None = None


@dataclass(frozen=True)
class ModelMethod:
    """A registered model method (see the module doc).

    - ``parse(params, where)``: the validated parameters (a :class:`~mergeqp.errors.ConfigError`
      naming ``where`` and the bad key otherwise);
    - ``run(context, parsed)``: the merge, a :class:`MethodOutcome`;
    - ``describe(parsed)``: the dry run's lines for it;
    - ``check_sites(sites)``: raises a ``ConfigError`` for selected layers it cannot merge (its return
      value is not read; ``None``: every selection is accepted);
    - ``memory(parsed, statistics_bytes)``: its items of the peak-memory estimate in bytes, beyond
      the models (loaded one at a time) and the targets; ``statistics_bytes(name)``: the bytes of
      the calibration statistics of the registered method ``name`` for the merged tensors;
    - ``fits_outputs``: it fits the fine-tunes' compared outputs, so a metric that scores the
      prompts' own labels or next tokens (``output.metric`` cross-entropy) is refused;
    - ``lazy_reason``: why it cannot run with ``lazy: true`` (the blocks kept on disk);
    - ``evaluates``: its outcome carries the report's evaluation of the base and the merge (the dry
      run says so);
    - ``report_markdown(report)``: its own Markdown sections of ``report.md`` (a list of strings,
      each a section with its ``##`` heading), from the whole JSON-able ``report.json`` mapping, its
      ``report_fields`` included under their names; they come before the evaluation (``None``: none).
    - ``start``: a :class:`StartFit` to run it as a candidate of ``start: auto`` too (``None``: it
      cannot be one; ``output_space`` is).

    What ``run`` returns is checked before anything is written: it sets at least one tensor, each a
    checkpoint key of the selected layers with the base's shape, floating point where the base's is
    (cast to the base's dtype unless ``output_dtype`` is set); its report fields are JSON-able and
    do not take the report's own names (:data:`~.report.REPORT_KEYS`). Its name may not be that of a
    baseline a merge config runs (:data:`~mergeqp.MERGE_METHODS`, tensor-wise or with statistics).

    Every model method needs calibration prompts for every model (the plan checks it).
    """

    name: str
    summary: str
    parse: Callable[[Mapping[str, Any], str], Any]
    run: Callable[[RunContext, Any], MethodOutcome]
    describe: Callable[[Any], list[str]] = lambda parsed: []
    check_sites: Callable[[Sequence[Any]], None] | None = None
    memory: Callable[[Any, Callable[[str], int]], dict[str, int]] | None = None
    fits_outputs: bool = True
    lazy_reason: str = "loads its model whole"
    evaluates: bool = True
    report_markdown: Callable[[Mapping[str, Any]], Sequence[str]] | None = None
    start: StartFit | None = None
