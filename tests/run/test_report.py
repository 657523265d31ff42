"""The typed merge report: ``report.json``'s layout, and a missing or failed certificate is never certified."""

from __future__ import annotations

import numpy as np

from mergeqp.merge.multilayer import LayerRecord
from mergeqp.run.report import (
    BaselineSummary,
    Evaluation,
    MergeReport,
    ModelEvaluation,
    WrittenOutput,
    uncertified,
)


def _record(layer: str, certificate: dict) -> LayerRecord:
    return LayerRecord(layer=layer, mode="sequential", objective_before=2.0, objective_after=1.0,
                       objective_after_exact=1.5, certificate=certificate, energy_fraction=0.5, seconds=0.1,
                       solver="active_set", status="optimal", n_variables=4, group=0, points={"zero": 2.0},
                       d=np.zeros((2, 2)), timings={})


def test_missing_or_failed_certificates_are_not_certified():
    records = [_record("a", {"certified": True}), _record("b", {}), _record("c", {"certified": False}),
               _record("d", {"certified": None})]
    assert uncertified(records) == ["b", "c", "d"]
    out = WrittenOutput("o", ("model.safetensors",), 10, 3, ("config.json",))
    report = MergeReport(plan={}, device="cpu", notes=(), output=out, seconds=1.0, layers=tuple(records))
    assert report.uncertified_layers == ["b", "c", "d"]
    assert report.to_json()["layers"][1]["certificate"]["certified"] is None


def test_report_json_layout():
    out = WrittenOutput("o", ("model.safetensors",), 10, 3, ("config.json",), None)
    ev = Evaluation(base=ModelEvaluation(3.0, {"t": 0.1}),
                    start=ModelEvaluation(2.0, {"t": 0.05}, method="soup", params={}, seconds=0.5),
                    merged=ModelEvaluation(1.0, {"t": 0.01}))
    qp = MergeReport(plan={"p": 1}, device="cpu", notes=("n",), output=out, seconds=2.0,
                     layers=(_record("a", {"certified": True}),), evaluation=ev,
                     mode_fields={"joint_vs_sequential": {}})
    data = qp.to_json()
    assert list(data) == ["plan", "device", "notes", "joint_vs_sequential", "layers", "evaluation", "output", "seconds"]
    assert list(data["evaluation"]) == ["base", "start", "merged"]
    assert list(data["evaluation"]["start"]) == ["method", "params", "calibration_objective", "heldout_mse", "seconds"]
    assert data["output"] == {"folder": "o", "weight_files": ["model.safetensors"], "bytes": 10, "tensors": 3,
                              "copied": ["config.json"], "index": None}
    base = MergeReport(plan={}, device="cpu", notes=(), output=out, seconds=1.0,
                       baseline=BaselineSummary("ties", {"density": 0.5}, 4, 0.2),
                       evaluation=Evaluation(ModelEvaluation(3.0, {}), ModelEvaluation(2.0, {}, method="ties")))
    data = base.to_json()
    assert list(data) == ["plan", "device", "notes", "baseline", "evaluation", "output", "seconds"]
    assert list(data["evaluation"]["merged"]) == ["method", "calibration_objective", "heldout_mse"]
    assert base.uncertified_layers == []
