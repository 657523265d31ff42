"""``mergeqp bench --family``: times relative to one Cholesky, warm-started sequences, and
errors for arguments that do not apply."""

from __future__ import annotations

import json

import pytest

from mergeqp.cli import main


def test_family_table_has_cholesky_ratios(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    out = tmp_path / "fam.json"
    code = main(["bench", "--family", "box,simplex", "--n", "48", "--solvers", "auto,active_set",
                 "--sequence", "3", "--clock", "cpu", "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "x chol" in text and "related QPs" in text
    payload = json.loads(out.read_text())
    rows = payload["rows"]
    cells = [r for r in rows if "seconds" in r]
    assert len(cells) == len(rows)  # the sequences are not rows of the table
    assert {(r["problem"], r["solver"]) for r in cells} == {
        (f, s) for f in ("box", "simplex") for s in ("auto", "active_set")}
    for r in cells:
        assert r["certified"] and 0 < r["vs_cholesky"] < float("inf")
        assert abs(r["vs_reference"]) <= 1e-9  # the planted optimum
    seq = payload["sequences"]
    assert len(seq) == 4 and all(r["cold_certified"] and r["warm_certified"] and r["steps"] == 3 for r in seq)
    assert all(r["step"] == 0.01 and 0 < r["optimum_moves"] < 1 for r in seq)
    assert "moved the optimum by a median" in text


def test_sequence_step_sets_how_related_the_qps_are(tmp_path) -> None:
    """``--sequence-step``: the random walk's step; a smaller one moves the optimum less (the
    planted box of n = 48 moves 58% at 0.1 and 6.5% at 1e-4: its flat directions amplify
    the small steps)"""
    moves = []
    for step in ("0.1", "0.0001"):
        out = tmp_path / f"s{step}.json"
        assert main(["bench", "--family", "box", "--n", "48", "--solvers", "active_set", "--sequence", "3",
                     "--sequence-step", step, "--clock", "cpu", "--json", str(out)]) == 0
        (row,) = json.loads(out.read_text())["sequences"]
        assert row["step"] == float(step) and row["warm_certified"]
        moves.append(row["optimum_moves"])
    assert moves[1] < moves[0] / 2


def test_json_dash_is_standard_output_and_the_table_goes_to_standard_error(
        capsys: pytest.CaptureFixture[str], tmp_path, monkeypatch) -> None:
    """(stop 47) ``--json -`` wrote a file named '-' in the working folder."""
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--family", "box", "--n", "48", "--solvers", "active_set", "--sequence", "2",
                 "--clock", "cpu", "--json", "-"]) == 0
    captured = capsys.readouterr()
    payload = json.loads(captured.out)  # nothing but the JSON on standard output
    assert [r["solver"] for r in payload["rows"]] == ["active_set"] and len(payload["sequences"]) == 1
    assert "x chol" in captured.err and "related QPs" in captured.err
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize("argv, message", [
    (["--family", "nope"], "unknown family 'nope'"),
    (["--family", "box:K=8:rr=80"], "unknown field 'rr' (did you mean 'r'?)"),
    (["--family", "box", "--n", "10"], "multiple of K = 4"),
    (["--family", "box", "--constraint", "simplex"], "do not apply"),
    (["--problems", "tiny96", "--n", "96"], "apply to --family only"),
    (["--problems", "tiny96", "--seed", "3"], "apply to --family only"),
    (["--family", "box", "--sequence", "-1"], "--sequence must be between 0 and 100000"),
    (["--family", "box", "--sequence", "1000000000"], "--sequence must be between 0 and 100000"),
    (["--family", "box", "--sequence", "2", "--sequence-step", "0"], "--sequence-step must be finite, > 0"),
    (["--family", "box", "--sequence", "2", "--sequence-step", "nan"], "--sequence-step must be finite, > 0"),
    (["--family", "box", "--sequence", "2", "--sequence-step", "1e308"], "at most 1000"),
    (["--family", "box", "--sequence-step", "0.1"], "--sequence-step applies with --sequence T only"),
    (["--problems", "tiny96", "--sequence-step", "0.1"], "apply to --family only"),
])
def test_family_argument_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_reference_problems_take_auto_and_the_cpu_clock(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """``auto`` and ``--clock cpu`` work on the committed instances too, and ``auto`` reports the
    solver it chose and the same certified optimum as that solver run by name."""
    out = tmp_path / "rows.json"
    assert main(["bench", "--problems", "tiny96", "--solvers", "auto,active_set", "--constraint", "box:0,1",
                 "--clock", "cpu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    auto, named = (next(r for r in rows if r["solver"] == s) for s in ("auto", "active_set"))
    assert auto["certified"] and named["certified"] and auto["chosen"] == "active_set"
    assert auto["objective"] == pytest.approx(named["objective"], rel=1e-10)
    assert auto["seconds"] > 0


def test_a_family_size_beyond_memory_is_refused_with_what_fits(monkeypatch, capsys):
    """(stop 46 review) --n 1000000000 ended in a raw numpy allocation traceback, exit 1 (the code of
    "solved but not certified")."""
    import mergeqp.io.memory as memory

    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 2**30)
    assert main(["bench", "--family", "box", "--n", "1000000000", "--solvers", "active_set"]) == 2
    err = capsys.readouterr().err
    assert "--n 1000000000: the instance's H and its copies need about" in err and "--n 5792 fits" in err
    # (stop 73, a QA review) the size suggested is a multiple of every family's K (box: 4, box_llama: 3)
    assert main(["bench", "--family", "box,box_llama", "--n", "1200000000", "--solvers", "active_set"]) == 2
    assert "--n 5784 fits" in capsys.readouterr().err


def test_a_family_variant_runs_from_the_command_line(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """(stop 51) a variant of a family, spelt FAMILY:key=value:... (a low-rank box with a weak ridge here),
    is benchmarked like a registered family; its spelling names its rows."""
    out = tmp_path / "v.json"
    spec = "box:K=8:r=10:cond=1e9:c=4:N=30:at_bounds=0.95"
    assert main(["bench", "--family", f"{spec},simplex", "--n", "80", "--solvers", "active_set", "--clock", "cpu",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["problem"] for r in rows] == [spec, "simplex"]
    assert all(r["certified"] and abs(r["vs_reference"]) <= 1e-9 for r in rows)


def test_an_interpolating_instance_is_marked_at_its_rounding_floor(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path) -> None:
    """(stop 54) J* ~ 0 (a rank-40 H, its targets reachable inside the box): no float64 solve
    certifies a relative gap of 1e-8 there; the table says ``flr`` (optimal to float64 precision,
    what ``solve`` accepts) instead of ``NO``, and the JSON row says ``at_rounding_floor``."""
    out = tmp_path / "i.json"
    assert main(["bench", "--family", "box_singular:c=2:N=20", "--n", "512", "--solvers", "active_set",
                 "--clock", "cpu", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert not row["certified"] and row["at_rounding_floor"]
    assert abs(row["objective"]) <= 1e-12
    assert " flr " in capsys.readouterr().out


def test_a_variant_beyond_memory_is_refused_before_any_work(monkeypatch, capsys):
    """A review of stop 74: only --n was checked; `box:r=60000` or `box:N=100000000` ended in a numpy
    MemoryError (exit 70, "a bug in mergeqp") or the kernel's out-of-memory killer."""
    import mergeqp.io.memory as memory

    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 2**30)
    for variant in ("box:r=60000", "box:N=100000000", "box:c=100000:N=100000"):
        assert main(["bench", "--family", variant, "--solvers", "active_set"]) == 2
        err = capsys.readouterr().err
        assert f"--family {variant}: its instance" in err and "choose smaller r, c or N" in err


def test_an_interrupt_stops_bench_with_exit_130_and_writes_nothing(monkeypatch, tmp_path, capsys):
    """A review of stop 74: Ctrl-C / SIGTERM during a solve became that cell's error; the run went on,
    wrote --json and exited 0."""
    from mergeqp.errors import Interrupted
    from mergeqp.solvers.registry import SOLVERS

    def stopped(*args, **kwargs):
        raise Interrupted("stopped by signal SIGTERM")

    monkeypatch.setattr(SOLVERS["active_set"], "solve", stopped)
    out = tmp_path / "b.json"
    assert main(["bench", "--family", "box,simplex", "--n", "48", "--solvers", "active_set",
                 "--json", str(out)]) == 130
    assert not out.exists()
    assert main(["bench", "--family", "box", "--n", "48", "--solvers", "dense_ipm,active_set", "--sequence", "2",
                 "--json", str(out)]) == 130
    assert not out.exists()


def test_json_never_replaces_another_json_file_a_device_or_a_folder_name(tmp_path, capsys):
    """A review of stop 74: `--family ... --json problems/tiny96.json` replaced the committed optima (any JSON
    passed), `--json new/` wrote a file named `new`, and `--json /dev/stdout` redirected to a file replaced it."""
    other = tmp_path / "optima.json"
    other.write_text('{"box:0,1": {"objective": 1.0}}')
    common = ["bench", "--family", "box", "--n", "48", "--solvers", "active_set"]
    assert main(common + ["--json", str(other)]) == 2
    assert "is not an earlier bench table" in capsys.readouterr().err
    assert other.read_text() == '{"box:0,1": {"objective": 1.0}}'
    assert main(common + ["--json", str(tmp_path / "new") + "/"]) == 2
    assert "ends with a separator" in capsys.readouterr().err and not (tmp_path / "new").exists()
    assert main(common + ["--json", "/dev/stdout"]) == 2
    assert "is a device, not a file" in capsys.readouterr().err
    table = tmp_path / "t.json"
    assert main(common + ["--json", str(table)]) == 0 and main(common + ["--json", str(table)]) == 0  # its own: replaced


def test_family_all_leaves_out_a_family_beyond_memory_with_a_note(monkeypatch, capsys):
    """A review of stop 74: `--family all` without --n was refused whole on a small machine because of
    box_llama alone; a family named explicitly is still refused."""
    import mergeqp.io.memory as memory
    from mergeqp.cli.bench import _check_variant_memory
    from mergeqp.errors import ConfigError
    from mergeqp.solvers.instance_families import get_family

    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 2 * 2**30)
    fams = [get_family("box"), get_family("box_llama")]
    assert _check_variant_memory(fams, every=True) == ["box"]
    assert "note: family box_llama left out" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--family box_llama: its instance"):
        _check_variant_memory(fams)


def test_untuned_variants_are_named_rows_and_summarised(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """``--untuned COUNT`` (stop 75): COUNT drawn variants, each row named by a spelling that
    ``--family`` reruns to the same instance, and one summary line per solver."""
    from mergeqp.solvers.instance_families import untuned_variants

    out = tmp_path / "u.json"
    assert main(["bench", "--untuned", "3", "--n", "48", "--seed", "5", "--solvers", "active_set,dense_ipm",
                 "--clock", "cpu", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    payload = json.loads(out.read_text())
    rows = payload["rows"]
    names = untuned_variants(3, 48, 5)
    # (the review of the fixes: the summary and the draw were on the terminal only)
    assert {k: payload["untuned"][k] for k in ("count", "n", "seed", "goal_choleskys")} == {
        "count": 3, "n": 48, "seed": 5, "goal_choleskys": 3.0}
    assert [line.split(":")[0] for line in payload["untuned"]["summary"]] == ["untuned active_set", "untuned dense_ipm"]
    assert [r["problem"] for r in rows] == [v for v in names for _ in range(2)]
    assert all(r["n"] == 48 and r["certified"] for r in rows)
    for solver in ("active_set", "dense_ipm"):
        line = next(x for x in text.splitlines() if x.startswith(f"untuned {solver}:"))
        within = sum(1 for r in rows if r["solver"] == solver and r["vs_cholesky"] <= 3.0)
        assert line.startswith(f"untuned {solver}: {within} of 3 variants") and "(3 certified)" in line
    # a row reruns by its name: the same objective
    first = rows[0]
    rerun = tmp_path / "r.json"
    assert main(["bench", "--family", first["problem"], "--seed", "5", "--solvers", "active_set", "--json",
                 str(rerun)]) == 0
    (again,) = json.loads(rerun.read_text())["rows"]
    assert again["objective"] == pytest.approx(first["objective"], rel=1e-12, abs=1e-12)


def test_untuned_summary_counts_only_certified_runs_within_the_goal() -> None:
    from mergeqp.cli.bench import untuned_summary

    rows = [{"problem": "a", "solver": "s", "vs_cholesky": 2.0, "certified": True, "seconds": 0.2},
            {"problem": "b", "solver": "s", "vs_cholesky": 2.5, "certified": False, "seconds": 0.25},  # not certified
            {"problem": "b2", "solver": "s", "vs_cholesky": 1.0, "certified": False, "at_rounding_floor": True,
             "seconds": 0.1},
            {"problem": "c", "solver": "s", "vs_cholesky": 9.0, "certified": True, "seconds": 0.9},
            {"problem": "d", "solver": "s", "error": "x"}, {"problem": "e", "solver": "t", "skipped": "y"}]
    (line,) = untuned_summary(rows)
    assert line.startswith("untuned s: 1 of 4 variants") and "(2 certified, 1 more at the rounding floor (flr))" in line
    assert "median 2.25, largest 9.00 (c, seed 0); seconds: median 0.225, largest 0.9" in line


def test_auto_summary_compares_auto_with_the_fastest_certifying_solver_of_each_variant() -> None:
    from mergeqp.cli.bench import auto_summary, untuned_summary

    def row(problem: str, solver: str, seconds: float, certified: bool = True) -> dict:
        return {"problem": problem, "seed": 3, "solver": solver, "seconds": seconds, "certified": certified,
                "vs_cholesky": seconds}

    rows = [row("a", "auto", 1.4), row("a", "x", 1.0), row("a", "y", 0.9, certified=False),  # 1.4x the fastest certifying
            row("b", "auto", 2.0), row("b", "x", 1.0),  # 2x
            row("c", "auto", 0.5, certified=False), row("c", "x", 1.0),  # auto uncertified: a miss
            row("d", "auto", 1.0, certified=False), row("d", "x", 1.0, certified=False),  # nobody certified: not counted
            {"problem": "e", "seed": 3, "solver": "x", "error": "boom"}, row("e", "auto", 1.0)]  # auto alone: not counted
    line = auto_summary(rows)
    assert line == ("untuned auto against the fastest certifying solver: within 1.5x on 1 of 3 variants; "
                    "largest auto not certified (c, seed 3)")
    assert auto_summary(rows[:5]).endswith("within 1.5x on 1 of 2 variants; largest 2.00x (b, seed 3)")
    assert untuned_summary(rows)[-1] == line
    assert auto_summary([row("a", "auto", 1.0), row("b", "auto", 1.0)]) is None  # no other solver
    assert all(not s.startswith("untuned auto against") for s in untuned_summary([row("a", "auto", 1.0)]))


@pytest.mark.parametrize("argv, message", [
    (["--untuned", "2", "--family", "box"], "not both"),
    (["--untuned", "0"], "between 1 and"),
    (["--untuned", "2", "--n", "7"], "--n 7 must be a multiple of one of 2, 3, 4, 6, 8"),
    (["--untuned", "2", "--problems", "tiny96"], "do not apply"),
])
def test_untuned_arguments_are_checked(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_family_all_leaves_out_a_family_whose_models_do_not_divide_n(capsys: pytest.CaptureFixture[str]) -> None:
    """A review of stop 75: ``--family all --n 640`` was refused as a whole (box_llama has K = 3)."""
    assert main(["bench", "--family", "all", "--n", "8", "--solvers", "active_set", "--clock", "cpu"]) == 0
    captured = capsys.readouterr()
    assert "family box_llama left out: n = 8 is not a multiple of its K = 3" in captured.err
    assert "box_llama" not in captured.out and "box_free" in captured.out
    assert main(["bench", "--family", "all", "--n", "7", "--solvers", "active_set"]) == 2
    err = capsys.readouterr().err  # (the review of the fixes: 18 notes came before the error)
    assert "no family's number of models divides it (a multiple of 12 suits every one)" in err and "note:" not in err
    assert main(["bench", "--family", "all", "--n", "-4", "--solvers", "active_set"]) == 2
    assert "--n must be a positive number of unknowns, got -4" in capsys.readouterr().err
