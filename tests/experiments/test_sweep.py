"""``mergeqp sweep``: one statistics file, every (constraint set, parametrisation, basis, p) QP
solved, certified and written as CSV + PNG."""

from __future__ import annotations

import copy
import csv
import math

import pytest
import torch
from torch import nn

from mergeqp.cli import main
from mergeqp.experiments.sweep import sweep_statistics
from mergeqp.stats import collect_statistics


@pytest.fixture(scope="module")
def stats_file(tmp_path_factory):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 3)).to(torch.float64)
    g = torch.Generator().manual_seed(1)
    fts = []
    for _ in range(2):
        m = copy.deepcopy(base)
        with torch.no_grad():
            m[2].weight.add_(0.5 * torch.randn(m[2].weight.shape, generator=g, dtype=torch.float64))
        fts.append(m)
    cal = [torch.randn(12, 6, generator=g, dtype=torch.float64) for _ in range(2)]
    stats = collect_statistics(base, fts, "2", cal, parametrisations=["rows", "scalar"], keep_samples=True,
                               progress=False)
    path = tmp_path_factory.mktemp("sweep") / "stats.npz"
    stats.save(str(path))
    return stats, str(path)


def test_sweep_rows_are_certified_and_consistent(stats_file):
    stats, _ = stats_file
    rows = sweep_statistics(stats, constraints=["box:0,1", "none"], bases=["optimal", "random"], sizes=(1, 2, 5, 9),
                            seeds=(0, 1))
    # 3 named + optimal (p 1, 2, 5) + random (p 1, 2, 5 x 2 seeds); p = 9 > r = 5 is left out; x 2 sets
    assert len(rows) == 2 * (3 + 3 + 6)
    assert all(r.certified and not r.skipped for r in rows)
    by = {(r.constraints, r.parametrisation, r.basis, r.p, r.seed): r for r in rows}
    for spec in ("box:0,1", "none"):  # rows contains every scalar point, so its optimum is no worse
        assert by[(spec, "rows", "", 0, 0)].objective <= by[(spec, "scalar", "", 0, 0)].objective * (1 + 1e-9)
        for p in (1, 2):  # Ky Fan, up to the mean-Jacobian approximation with a ReLU downstream
            assert by[(spec, "basis", "optimal", p, 0)].energy_fraction >= by[(spec, "basis", "random", p, 0)].energy_fraction - 0.05
        full = by[(spec, "basis", "optimal", 5, 0)]  # p = r: every basis spans the whole output space
        assert full.energy_fraction == pytest.approx(by[(spec, "basis", "random", 5, 1)].energy_fraction, abs=1e-9)
    for r in rows:  # no constraint is a superset of the box
        if r.constraints == "none":
            assert r.objective <= by[("box:0,1", r.parametrisation, r.basis, r.p, r.seed)].objective * (1 + 1e-9)
        assert r.mse == pytest.approx(r.objective / (stats.n_samples * stats.c), rel=1e-12)


def test_cli_writes_csv_and_png(stats_file, tmp_path, capsys):
    _, path = stats_file
    out = tmp_path / "out"
    code = main(["sweep", path, "--out", str(out), "--constraints", "box:0,1", "--bases", "svd", "optimal",
                 "--sizes", "1,3", "--parametrisations", "rows", "columns"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    with open(out / "sweep.csv") as fh:
        table = list(csv.DictReader(fh))
    assert len(table) == 2 + 2 * 2
    assert {r["parametrisation"] for r in table} == {"rows", "columns", "basis"}
    assert all(r["certified"] == "True" and math.isfinite(float(r["objective"])) for r in table)
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "6 QPs solved (6 certified), 0 skipped" in printed
    # a bad size list is a usage error
    assert main(["sweep", path, "--out", str(tmp_path / "x"), "--sizes", "a"]) == 2
