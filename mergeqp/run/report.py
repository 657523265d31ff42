"""The typed report of a ``mergeqp merge`` run; :meth:`MergeReport.to_json` is ``report.json``.

Every object is a frozen dataclass; ``to_json`` gives the plain JSON mapping written to
``report.json`` (key order and values as the file documents, see :mod:`mergeqp.merge.report`
for the file format and the Markdown rendering).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..merge.multilayer import LayerRecord


@dataclass(frozen=True)
class ModelEvaluation:
    """One model's evaluation: the calibration objective ``sum_t w_t sum_j ||h_j - y_j||^2`` (compared
    output, squared units of the output) and the held-out teacher-forced MSE per task (per logit);
    for logits also the held-out mean KL from the fine-tune per real token and the next-token
    cross-entropy per predicted token (nats; ``None`` where not measured); for classifiers (a head per
    task and labelled prompts) the held-out accuracy and the classification cross-entropy per prompt. ``method`` / ``params`` / ``seconds`` / ``statistics`` describe a baseline (hybrid start or
    baseline merge) when the evaluated model is one."""

    calibration_objective: float
    heldout_mse: Mapping[str, float]
    method: str | None = None
    params: Mapping[str, Any] | None = None
    seconds: float | None = None
    statistics: Mapping[str, Any] | None = None
    heldout_kl: Mapping[str, float] | None = None
    heldout_cross_entropy: Mapping[str, float] | None = None
    heldout_accuracy: Mapping[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.method is not None:
            out["method"] = self.method
        if self.params is not None:
            out["params"] = dict(self.params)
        out["calibration_objective"] = self.calibration_objective
        out["heldout_mse"] = dict(self.heldout_mse)
        if self.heldout_kl is not None:
            out["heldout_kl"] = dict(self.heldout_kl)
        if self.heldout_cross_entropy is not None:
            out["heldout_cross_entropy"] = dict(self.heldout_cross_entropy)
        if self.heldout_accuracy is not None:
            out["heldout_accuracy"] = dict(self.heldout_accuracy)
        if self.seconds is not None:
            out["seconds"] = self.seconds
        if self.statistics is not None:
            out["statistics"] = self.statistics
        return out


@dataclass(frozen=True)
class Evaluation:
    """The base model, the hybrid start (if any) and the merged model, evaluated alike."""

    base: ModelEvaluation
    merged: ModelEvaluation
    start: ModelEvaluation | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"base": self.base.to_json()}
        if self.start is not None:
            out["start"] = self.start.to_json()
        out["merged"] = self.merged.to_json()
        return out


@dataclass(frozen=True)
class BaselineSummary:
    """A baseline merge: its method and parameters, merged tensors, seconds (statistics included)
    and, for a method with calibration statistics, what was collected."""

    method: str
    params: Mapping[str, Any]
    tensors: int
    seconds: float
    statistics: Mapping[str, Any] | None = None
    #: ``"model method"`` for a method run on the live models (:mod:`.model_methods`), else ``None``
    kind: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"method": self.method, "params": dict(self.params), "tensors": self.tensors, "seconds": self.seconds}
        if self.statistics is not None:
            out["statistics"] = self.statistics
        if self.kind is not None:
            out["kind"] = self.kind
        return out


@dataclass(frozen=True)
class WrittenOutput:
    """The merged folder as written: weight files, bytes, tensor count, copied files, shard index."""

    folder: str
    weight_files: tuple[str, ...]
    bytes: int
    tensors: int
    copied: tuple[str, ...]
    index: Any = None

    @classmethod
    def of(cls, written: Any) -> WrittenOutput:
        """From the writer's result (:func:`mergeqp.io.save_hf_folder`)."""
        return cls(str(written.folder), tuple(written.weight_files), written.total_bytes, written.n_tensors,
                   tuple(written.copied), written.index)

    def to_json(self) -> dict[str, Any]:
        return {"folder": self.folder, "weight_files": list(self.weight_files), "bytes": self.bytes,
                "tensors": self.tensors, "copied": list(self.copied), "index": self.index}


@dataclass(frozen=True)
class MergeReport:
    """Everything a merge reports. ``plan``: the plan's JSON (:meth:`MergePlan.to_json`);
    ``device``: where it ran; ``notes``; for the QP ``layers`` (one record per merged layer),
    ``mode_fields`` (extra fields the merge mode reports, e.g. ``joint_vs_sequential``); for a
    baseline ``baseline``; ``evaluation`` (when evaluated); ``output``; ``seconds`` (wall);
    ``imports``: the user modules imported in the process (:func:`mergeqp.plugins.imported_modules`:
    ``--import``, ``$MERGEQP_IMPORT``, the config's ``imports:``), in the JSON only when there are any."""

    plan: Mapping[str, Any]
    device: str
    notes: tuple[str, ...]
    output: WrittenOutput
    seconds: float
    layers: tuple[LayerRecord, ...] | None = None
    evaluation: Evaluation | None = None
    baseline: BaselineSummary | None = None
    mode_fields: Mapping[str, Any] = field(default_factory=dict)
    imports: tuple[Mapping[str, Any], ...] = ()

    @property
    def uncertified_layers(self) -> list[str]:
        """Layers whose QP solution is not certified (a missing certificate counts as not certified)."""
        return uncertified(self.layers or ())

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"plan": self.plan, "device": self.device, "notes": list(self.notes)}
        if self.imports:
            out["imports"] = [dict(entry) for entry in self.imports]
        if self.baseline is not None:
            out["baseline"] = self.baseline.to_json()
        out.update(self.mode_fields)
        if self.layers is not None:
            out["layers"] = [r.to_json() for r in self.layers]
        if self.evaluation is not None:
            out["evaluation"] = self.evaluation.to_json()
        out["output"] = self.output.to_json()
        out["seconds"] = self.seconds
        return out


#: the top-level keys of ``report.json`` that :class:`MergeReport` writes itself (a mode's or a model
#: method's extra fields may not take them)
REPORT_KEYS = frozenset({"plan", "device", "notes", "imports", "baseline", "layers", "evaluation", "output",
                         "seconds"})


def uncertified(records: Sequence[LayerRecord]) -> list[str]:
    """Layers of ``records`` not certified: a missing or failed certificate is never certified."""
    return [r.layer for r in records if r.certificate.get("certified") is not True]
