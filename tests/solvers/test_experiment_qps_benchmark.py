"""``benchmarks/experiment_qps.py``: the recorder catches the solves of modules that imported
``solve`` by name, keeps each QP with its set and start, restores the original afterwards, and
the timer solves the recorded QPs again to the run's objectives."""

from __future__ import annotations

import importlib.util
import pickle
from pathlib import Path

import numpy as np
import pytest

import mergeqp.merge.multilayer as multilayer
import mergeqp.solvers.registry as registry
from mergeqp.constraints import Box
from mergeqp.solvers.instance_families import draw

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "experiment_qps.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("experiment_qps", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_records_solves_made_through_module_bindings_and_times_them_again(bench, tmp_path: Path) -> None:
    original = registry.solve
    inst = draw("box", 3, 48)
    small = draw("simplex", 1, 12)
    P = inst.problem
    x0 = np.full(P.shape, 0.5)
    per_entry = Box(np.zeros(P.shape), np.full(P.shape, 0.9))  # a trust region's per-entry bounds
    with bench.recording(tmp_path, min_n=16) as records:
        assert multilayer.solve is not original and registry.solve is not original
        a = multilayer.solve(P, per_entry, x0=x0)
        registry.solve(small.problem, small.constraints)  # below min_n: solved, not kept
        b = registry.solve(P, inst.constraints, solver="active_set")
    assert multilayer.solve is original and registry.solve is original
    assert [r["file"] for r in records] == ["q000.npz", "q002.npz"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q000.npz", "q000.pkl", "q002.npz", "q002.pkl"]
    with open(tmp_path / "q000.pkl", "rb") as fh:
        rec = pickle.load(fh)
    np.testing.assert_array_equal(rec["x0"], x0)
    np.testing.assert_array_equal(rec["constraints"].hi, per_entry.hi)
    assert rec["meta"]["objective"] == a.objective

    rows = bench.time_folder(tmp_path, repeat=1)
    assert [r["file"] for r in rows] == ["q000.npz", "q002.npz"]
    first, second = rows
    assert first["cold_certified"] and first["warm_certified"] and second["cold_certified"]
    assert "warm_seconds" not in second  # that run passed no start
    assert first["cold_objective"] == pytest.approx(a.objective, rel=1e-9)
    assert first["warm_objective"] == pytest.approx(a.objective, rel=1e-9)
    assert second["cold_objective"] == pytest.approx(b.objective, rel=1e-9)
    assert first["cold_over_cholesky"] > 0
    with pytest.raises(SystemExit, match="already holds recorded QPs"), bench.recording(tmp_path):
        pass  # never over an earlier recording
    assert multilayer.solve is original
    lines = bench.summary(rows)
    assert len(lines) == 1 and lines[0].startswith("n = 48: 2 QPs, 2 certified")
    assert "the 1 with the run's start" in lines[0]


def test_recording_restores_the_original_when_a_solve_fails(bench, tmp_path: Path) -> None:
    original = registry.solve
    inst = draw("box", 0, 20)
    with pytest.raises(Exception), bench.recording(tmp_path):
        multilayer.solve(inst.problem, inst.constraints, solver="no_such_solver")
    assert multilayer.solve is original and registry.solve is original
