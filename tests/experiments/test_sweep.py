"""``mergeqp sweep``: one statistics file, every (constraint set, parametrisation, basis, p) QP
solved, certified and written as CSV + PNG."""

from __future__ import annotations

import copy
import csv
import math
import os

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


def _run(args, capsys):
    code = main(["sweep", *args])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_cli_never_writes_over_its_input(stats_file, tmp_path, capsys):
    """The review's data loss: the statistics given as DIR/sweep.csv (or a link there) and --out DIR
    replaced the statistics by the table. Refused before any work, the input unchanged."""
    import os
    import shutil

    _, path = stats_file
    folder = tmp_path / "d"
    folder.mkdir()
    shutil.copy(path, folder / "sweep.csv")
    before = (folder / "sweep.csv").read_bytes()
    code, text = _run([str(folder / "sweep.csv"), "--out", str(folder), "--overwrite"], capsys)
    assert code == 2 and "overlaps input" in text
    assert (folder / "sweep.csv").read_bytes() == before
    linked = tmp_path / "l"
    linked.mkdir()
    os.symlink(path, linked / "sweep.csv")
    code, text = _run([str(linked / "sweep.csv"), "--out", str(linked), "--overwrite"], capsys)
    assert code == 2 and "overlaps input" in text and (linked / "sweep.csv").is_symlink()


def test_cli_replaces_a_folder_only_with_overwrite_and_writes_both_files_or_neither(stats_file, tmp_path, capsys):
    _, path = stats_file
    out = tmp_path / "out"
    small = ["--bases", "--parametrisations", "rows", "--quiet"]
    assert _run([path, "--out", str(out), *small], capsys)[0] == 0
    table = (out / "sweep.csv").read_text()
    code, text = _run([path, "--out", str(out), "--parametrisations", "scalar", "--bases"], capsys)
    assert code == 2 and "not empty; pass --overwrite" in text and (out / "sweep.csv").read_text() == table
    # --overwrite replaces an earlier output only: a folder of other files (the current folder above
    # all) is refused and kept (stop 46: sweep --out . --overwrite deleted every file there)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "thesis.tex").write_text("x")
    code, text = _run([path, "--out", str(tmp_path / "notes"), "--overwrite", *small], capsys)
    assert code == 2 and "replaces only an earlier output of mergeqp: it holds no earlier mergeqp output" in text
    assert sorted(p.name for p in (tmp_path / "notes").iterdir()) == ["thesis.tex"]
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path / "notes")
        code, text = _run([path, "--out", ".", "--overwrite", *small], capsys)
    finally:
        os.chdir(cwd)
    assert code == 2 and "it is the current folder or holds it" in text
    assert sorted(p.name for p in (tmp_path / "notes").iterdir()) == ["thesis.tex"]
    # the figure cannot be written (a folder where the file goes): the old folder stays as it was
    (tmp_path / "blocked").mkdir()
    (tmp_path / "blocked" / "keep.txt").write_text("x")
    (tmp_path / "blocked" / "sweep.csv").write_text(table)  # an earlier sweep's folder
    from mergeqp.experiments import sweep as sweep_module

    def broken(rows, where):
        raise OSError(28, "No space left on device")

    original = sweep_module._figure
    sweep_module._figure = broken
    try:
        code, text = _run([path, "--out", str(tmp_path / "blocked"), "--overwrite", *small], capsys)
    finally:
        sweep_module._figure = original
    assert code == 4 and sorted(p.name for p in (tmp_path / "blocked").iterdir()) == ["keep.txt", "sweep.csv"]
    code, text = _run([path, "--out", str(out), "--overwrite", "--parametrisations", "scalar", "--bases", "--quiet"],
                      capsys)
    assert code == 0 and (out / "sweep.csv").read_text() != table


@pytest.mark.parametrize(("args", "message"), [
    (["--constraints", "boxx:0,1"], "unknown constraint set 'boxx'"),
    (["--constraints", "box:1,0"], "box is empty"),
    (["--solver", "clarabell"], "did you mean 'clarabel'"),
    (["--sizes", "0"], "--sizes must be integers >= 1, got 0"),
    (["--seeds", "-1"], "--seeds must be integers >= 0, got -1"),
    (["--parametrisations", "optimal:2"], "bases are swept by --bases KIND --sizes P"),
    (["--parametrisations", "basis"], "bases are swept by --bases"),
    (["--parametrisations", "rowz"], "did you mean 'rows'"),
    (["--bases", "svdd"], "did you mean 'svd'"),
    (["--parametrisations", "--bases"], "nothing to sweep"),
    (["--parametrisations", "--sizes", "100"], "every basis size exceeds the layer's r = 5"),
])
def test_cli_bad_arguments_are_exit_2_and_write_nothing(stats_file, tmp_path, capsys, args, message):
    _, path = stats_file
    code, text = _run([path, "--out", str(tmp_path / "o"), "--quiet", *args], capsys)
    assert code == 2, text
    assert message in text and "Traceback" not in text
    assert not (tmp_path / "o").exists()


def test_cli_all_skipped_is_exit_2(stats_file, tmp_path, capsys):
    """Statistics without kept samples cannot build a basis QP: a sweep of only such QPs ran nothing."""
    stats, _ = stats_file
    path = tmp_path / "nokeep.npz"
    stats.save(str(path), include_samples=False)
    code, text = _run([str(path), "--out", str(tmp_path / "o"), "--parametrisations", "columns", "--bases", "svd",
                       "--sizes", "2", "--quiet"], capsys)
    assert code == 2 and "no QP of the sweep could be built" in text and "skipped svd:2 (box:0,1)" in text
    assert not (tmp_path / "o").exists()


def test_damaged_statistics_files_are_named(stats_file, tmp_path, capsys):
    import json

    import numpy as np

    _, path = stats_file
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}

    def variant(name, **changes):
        out = tmp_path / f"{name}.npz"
        np.savez(out, **{k: v for k, v in {**arrays, **changes}.items() if v is not None})
        return str(out)

    S = arrays["task_S"].copy()
    S[0, 0, 0] = np.nan
    meta = json.loads(str(arrays["meta"]))
    cases = [
        (variant("nan", task_S=S), 3, "array 'task_S' of the statistics contains 1 NaN/inf"),
        (variant("noS", task_S=None), 2, "no array 'task_S'"),
        (variant("deltas", deltas=arrays["deltas"][:, :4]), 2, "'base_weight' has shape"),
        (variant("z", sample0_z=arrays["sample0_z"][:5]), 2, "kept batch 0 (task 0) has layer inputs"),
        (variant("meta", meta=np.array(json.dumps([1]))), 2, "corrupt metadata (a JSON list"),
        (variant("nocollected", meta=np.array(json.dumps({k: v for k, v in meta.items() if k != "collected"}))),
         2, "damaged statistics file (KeyError"),
    ]
    np.save(tmp_path / "arr.npy", np.zeros(3))
    cases.append((str(tmp_path / "arr.npy"), 2, "a single .npy array"))
    for file, want, message in cases:
        code, text = _run([file, "--out", str(tmp_path / "o"), "--quiet"], capsys)
        assert (code, "Traceback" in text) == (want, False), (file, text)
        assert message in text, (file, text)


def test_an_interruption_stops_the_sweep(stats_file, monkeypatch):
    """A SIGTERM during a solve was recorded as a skipped row and the sweep went on to exit 0."""
    from mergeqp.errors import Interrupted
    from mergeqp.experiments import sweep as sweep_module

    stats, _ = stats_file
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        raise Interrupted("stopped by signal SIGTERM")

    monkeypatch.setattr(sweep_module, "solve", interrupted)
    with pytest.raises(Interrupted):
        sweep_statistics(stats, parametrisations=["rows", "scalar"], bases=[])
    assert calls == [1]


def test_figure_without_bases_warns_nothing(stats_file, tmp_path):
    import warnings

    from mergeqp.experiments.sweep import write_sweep

    stats, _ = stats_file
    rows = sweep_statistics(stats, parametrisations=["rows", "scalar"], bases=[], constraints=["box:0,1", "none"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        files = write_sweep(rows, str(tmp_path / "f"))
    assert set(files) == {"csv", "png"}


def test_a_users_seeded_basis_is_swept_over_the_seeds(stats_file):
    """(stop 58, an architecture review's find) Only the basis named ``random`` was varied over
    ``--seeds``: a user's basis whose seed changes it got seed 0 alone. The entry says so now
    (``register_basis(..., seeded=True)``); an unseeded one still runs once."""
    import numpy as np

    import mergeqp
    from mergeqp.stats.bases import BASES, random_basis
    from mergeqp.stats.basis import Basis

    stats, _ = stats_file

    def shuffled_rows(st, p, *, seed=0, task_weights=None):
        rows = np.random.default_rng(seed).permutation(st.r)[:p]
        return Basis(np.eye(st.r)[:, rows], name="shuffled_rows")

    mergeqp.register_basis("shuffled_rows", shuffled_rows, seeded=True)
    mergeqp.register_basis("first_rows", lambda st, p, *, seed=0, task_weights=None: random_basis(st, p, seed=0))
    try:
        rows = sweep_statistics(stats, constraints=["box:0,1"], parametrisations=[], bases=["shuffled_rows", "first_rows"],
                                sizes=(2,), seeds=(0, 1, 2))
    finally:
        BASES.pop("shuffled_rows")
        BASES.pop("first_rows")
    assert sorted(r.seed for r in rows if r.basis == "shuffled_rows") == [0, 1, 2]
    assert [r.seed for r in rows if r.basis == "first_rows"] == [0]
    assert BASES["random"].seeded and not BASES["svd"].seeded
