"""``mergeqp solve`` / ``mergeqp certify``: JSON output, exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mergeqp.cli import main
from mergeqp.constraints import Box, SignConsensus, Simplex
from mergeqp.problem import MergeQP


@pytest.fixture()
def problem_file(random_problem, tmp_path) -> tuple[str, MergeQP]:
    problem = random_problem(np.random.default_rng(0), K=3, m=4, offset=0.7)
    path = str(tmp_path / "p.npz")
    problem.save_npz(path)
    return path, problem


def read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_solve_unconstrained_writes_json(problem_file, tmp_path, capsys) -> None:
    path, problem = problem_file
    out = str(tmp_path / "sol.json")
    code, stdout, _ = run(capsys, "solve", path, "--out", out)
    assert code == 0
    assert "certificate: CERTIFIED" in stdout and "objective J(d)" in stdout
    sol = read_json(out)
    d = np.linalg.solve(problem.H, -problem.g).reshape(problem.shape)
    np.testing.assert_allclose(np.array(sol["d"]), d, rtol=1e-8, atol=1e-10)
    assert len(sol["d"]) == 3 and len(sol["d"][0]) == 4  # K x n_atoms
    assert sol["objective"] == pytest.approx(problem.objective(d), rel=1e-10)
    assert sol["solver"] == "closed_form"
    assert sol["certificate"]["certified"] is True and sol["certificate"]["fw_gap"] >= 0


def test_solve_box_and_simplex_then_certify(cvxpy_solve, problem_file, tmp_path, capsys) -> None:
    path, problem = problem_file
    out, d_file = str(tmp_path / "sol.json"), str(tmp_path / "d.npy")
    code, stdout, _ = run(capsys, "solve", path, "--constraint", "box:0,0.8", "--constraint", "simplex",
                          "--out", out, "--save-d", d_file)
    assert code == 0, stdout
    sol = read_json(out)
    j_star, _ = cvxpy_solve(problem, Box(0, 0.8) & Simplex())
    assert sol["objective"] == pytest.approx(j_star, rel=1e-7)
    assert sol["constraints"] == "box:0,0.8 & simplex"
    assert sol["certificate"]["certified"] is True
    # certify the saved point (npy), and the JSON itself
    code, stdout, _ = run(capsys, "certify", path, "--point", d_file, "--constraint", "box:0,0.8 & simplex")
    assert code == 0 and "CERTIFIED" in stdout
    cert_out = str(tmp_path / "cert.json")
    code, _, _ = run(capsys, "certify", path, "--point", out, "--constraint", "box:0,0.8",
                     "--constraint", "simplex", "--out", cert_out)
    assert code == 0 and read_json(cert_out)["certified"] is True
    # the same point is not optimal for another set: exit 1 with the reason
    code, stdout, stderr = run(capsys, "certify", path, "--point", d_file, "--constraint", "box:0,1")
    assert code == 1
    assert "NOT CERTIFIED" in stdout and "optimality gap" in stderr


def test_certify_wrong_points(cvxpy_solve, problem_file, tmp_path, capsys) -> None:
    path, problem = problem_file
    _, d = cvxpy_solve(problem, Box(0, 1))
    bad = np.clip(d, 0, 1) + 0.3  # infeasible
    np.save(tmp_path / "bad.npy", bad)
    code, _, stderr = run(capsys, "certify", path, "--point", str(tmp_path / "bad.npy"), "--constraint", "box:0,1")
    assert code == 1 and "infeasible: constraint violation" in stderr
    np.savetxt(tmp_path / "soup.txt", problem.soup_point().ravel())
    code, _, stderr = run(capsys, "certify", path, "--point", str(tmp_path / "soup.txt"), "--constraint", "box:0,1")
    assert code == 1 and "optimality gap" in stderr


def test_sign_constraint_from_the_problem_file(cvxpy_solve, random_problem, tmp_path, capsys) -> None:
    rng = np.random.default_rng(1)
    K, r, m = 3, 4, 5
    deltas = rng.normal(size=(K, r, m)) + 0.1
    problem = random_problem(rng, K=K, m=r, offset=0.8)
    path = str(tmp_path / "sign.npz")
    problem.save_npz(path, extra={"deltas": deltas, "parametrisation": "rows"})
    out = str(tmp_path / "sol.json")
    code, stdout, _ = run(capsys, "solve", path, "--constraint", "box:0,1", "--constraint", "sign", "--out", out)
    assert code == 0, stdout
    cset = Box(0, 1) & SignConsensus.from_deltas(deltas, "rows")
    j_star, _ = cvxpy_solve(problem, cset)
    sol = read_json(out)
    assert sol["objective"] == pytest.approx(j_star, rel=1e-6)
    assert sol["certificate"]["gap_method"].startswith("frank-wolfe, LP (HiGHS")
    assert cset.violation(np.array(sol["d"])) <= 1e-7


@pytest.mark.parametrize(
    "argv, message",
    [
        (["solve", "{missing}"], "problem file not found"),
        (["solve", "{garbage}"], "cannot read problem file"),
        (["solve", "{noH}"], "lacks array(s) ['H']"),
        (["solve", "{ok}", "--constraint", "boxx:0,1"], "unknown constraint set 'boxx'; valid constraint sets: box,"),
        (["solve", "{ok}", "--constraint", "box:0"], "box takes two bounds"),
        (["solve", "{ok}", "--constraint", "box:0,0.1", "--constraint", "simplex"], "box:0,0.1 & simplex is empty"),
        (["solve", "{ok}", "--constraint", "sign"], "'sign' needs the residual tensors"),
        (["solve", "{ok}", "--solver", "magic"], "unknown solver 'magic'; valid solvers: "),
        (["solve", "{ok}", "--option", "novalue"], "expected KEY=VALUE"),
        (["solve", "{ok}", "--out", "/nonexistent-dir/x.json"], "cannot write the solution to /nonexistent-dir/x.json"),
        (["certify", "{ok}", "--point", "{missing}"], "point file not found"),
        (["certify", "{ok}", "--point", "{transposed}"], "point has shape (4, 3), the problem needs d of shape (3, 4)"),
        # (stop 52 review) each was a traceback, a wrong exit code, a run of every solver or an unclear line
        (["solve", "{tolstr}"], "psd_tol must be a real number"),
        (["solve", "{ok}", "--constraint", "box:1e308,1e308"], "lies beyond float64's range for a QP"),
        (["solve", "{ok}", "--x0", "{transposed}"], "--x0 file (the warm start) {transposed}: point has shape (4, 3)"),
        (["solve", "{ok}", "--out", "{folder}"], "is a folder; give a file name"),
        (["solve", "{ok}", "--out", "{ok}/x.json"], "is a file, not a folder"),
        (["certify", "{ok}", "--point", "{junk_npy}"], "not a NumPy array file (.npy)"),
        (["certify", "{ok}", "--point", "{ragged}"], "not a rectangular array of numbers"),
        (["solve", "{ok}", "--solver", "closed_form", "--option", "rcond=abc"], "option rcond must be a number (default None), got 'abc'"),
        (["solve", "{ok}", "--constraint", "box:0,1", "--solver", "torch_fista", "--option", "lipschitz=-1"],
         "option lipschitz=-1 is out of range"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(problem_file, tmp_path, capsys, argv, message) -> None:
    path, _ = problem_file
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"\x00\x01 not an archive")
    noH = tmp_path / "noH.npz"
    np.savez(noH, g=np.ones(3))
    transposed = tmp_path / "t.npy"
    np.save(transposed, np.zeros((4, 3)))
    tolstr = tmp_path / "tolstr.npz"
    problem = np.load(path)
    np.savez(tolstr, **{k: problem[k] for k in problem.files}, psd_tol=np.array("abc"))
    junk_npy = tmp_path / "junk.npy"
    junk_npy.write_bytes(b"not an array file at all")
    ragged = tmp_path / "ragged.json"
    ragged.write_text('{"d": [[1, 2, 3, 4], [1, 2]]}')
    names = {"missing": str(tmp_path / "missing.npz"), "garbage": str(garbage), "noH": str(noH),
             "ok": path, "transposed": str(transposed), "tolstr": str(tolstr), "folder": str(tmp_path),
             "junk_npy": str(junk_npy), "ragged": str(ragged)}
    code, _, stderr = run(capsys, *[a.format(**names) for a in argv])
    assert code == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"mergeqp {argv[0]}: error: ") and message.format(**names) in lines[0]
    assert "Traceback" not in stderr


def test_python_dash_m_entry_point(problem_file, tmp_path) -> None:
    path, _ = problem_file
    out = tmp_path / "sol.json"
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "mergeqp", "solve", path, "--constraint", "box:0,1",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "certificate: CERTIFIED" in proc.stdout
    sol = json.loads(out.read_text())
    assert sol["certificate"]["certified"] is True and np.array(sol["d"]).shape == (3, 4)


def test_point_formats_and_pinv_flag(problem_file, tmp_path, capsys) -> None:
    from mergeqp.cli.solve import load_point

    path, problem = problem_file
    d = np.linalg.solve(problem.H, -problem.g).reshape(problem.shape)
    np.savez(tmp_path / "point.npz", d=d)
    np.savez(tmp_path / "other.npz", x=d)
    np.savetxt(tmp_path / "p.csv", d, delimiter=",")
    (tmp_path / "p.json").write_text(json.dumps(d.tolist()))
    for name in ("point.npz", "other.npz", "p.csv", "p.json"):
        np.testing.assert_allclose(load_point(str(tmp_path / name)), d, rtol=1e-15)
        code, _, _ = run(capsys, "certify", path, "--point", str(tmp_path / name), "--pinv")
        assert code == 0, name
    np.savez(tmp_path / "two.npz", a=d, b=d)
    code, _, stderr = run(capsys, "certify", path, "--point", str(tmp_path / "two.npz"))
    assert code == 2 and "name the point's array 'd'" in stderr
    out = str(tmp_path / "sol.json")
    code, _, _ = run(capsys, "solve", path, "--constraint", "box:0,1", "--pinv", "--out", out)
    assert code == 0
    cert = read_json(out)["certificate"]
    assert cert["unconstrained_bound"] <= cert["lower_bound"] + 1e-9
    assert cert["binding"] is True


@pytest.mark.parametrize("extra, message", [
    (["--json", "/nonexistent-folder-xyz/x.json"], "does not exist"),
    (["--opt", "active_set.foo=1"], "unrecognised solver option"),
    (["--problems", ","], "--problems is empty"),
    # (stop 52 review) options of a solver the run does not use were ignored; --json replaced any file
    (["--opt", "clarabel.max_iter=5"], "clarabel is not among --solvers (active_set)"),
    (["--json", "{script}"], "exists and is not a JSON file"),
])
def test_bench_rejects_bad_arguments_before_running(extra, message, capsys, tmp_path) -> None:
    from mergeqp.cli import main

    script = tmp_path / "keep.py"
    script.write_text("print('mine')\n")
    empty = tmp_path / "empty.json"
    empty.write_text("")
    extra = [a.format(script=script, empty=empty) for a in extra]
    args = ["bench", "--problems", "tiny96", "--solvers", "active_set", *extra]
    if "--problems" in extra:
        args = ["bench", "--solvers", "active_set", *extra]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "problem" not in captured.out  # no table was started
    assert script.read_text() == "print('mine')\n"
    from mergeqp.cli.bench import check_json_output

    check_json_output(str(empty))  # an empty file (mktemp's) or an earlier table may be replaced
    (tmp_path / "earlier.json").write_text('{"rows": []}')
    check_json_output(str(tmp_path / "earlier.json"))


def test_overflowing_objective_is_a_solver_error() -> None:
    import mergeqp as mq
    from mergeqp.errors import SolverError

    with pytest.raises(SolverError, match="overflows float64"):
        mq.solve(mq.MergeQP(np.eye(2), [1e300, -1e300]), None)


def test_solve_command_reports_the_pseudo_inverse_facts_by_default_at_small_n(tmp_path, capsys) -> None:
    """``mergeqp solve`` keeps printing the unconstrained bound where ``certify`` computes it by
    default (definite H, n <= 2048), although ``solve()`` from Python skips it."""
    rng = np.random.default_rng(2)
    A = rng.standard_normal((30, 8))
    path = str(tmp_path / "p.npz")
    MergeQP(2 * A.T @ A + np.eye(8), rng.standard_normal(8) - 3.0, 0.0, shape=(2, 4)).save_npz(path)
    out = str(tmp_path / "sol.json")
    code, stdout, _ = run(capsys, "solve", path, "--constraint", "box:0,1", "--out", out)
    assert code == 0
    cert = read_json(out)["certificate"]
    assert cert["unconstrained_bound"] is not None and cert["binding"] is not None
    assert "unconstrained bound" in stdout


def test_outputs_never_replace_an_input_a_device_or_a_pipe(problem_file, tmp_path, capsys) -> None:
    """The warm start and a problem named without its .npz suffix are inputs too; an existing
    output that is not a regular file (a FIFO, a device) is refused before any work; an empty
    --out is an error, not a silently skipped output."""
    path, problem = problem_file
    x0 = tmp_path / "x0.npy"
    np.save(x0, np.full(problem.shape, 0.5))
    before = x0.read_bytes()
    for flag in ("--out", "--save-d"):
        code, _, err = run(capsys, "solve", path, "--constraint", "box:0,1", "--x0", str(x0), flag, str(x0))
        assert code == 2 and "would overwrite the input" in err and x0.read_bytes() == before
    bare = path[: -len(".npz")]  # read as p.npz
    kept = open(path, "rb").read()
    for cmd in (["solve", bare, "--constraint", "box:0,1", "--out", path],
                ["certify", bare, "--point", str(x0), "--constraint", "box:0,1", "--out", path]):
        code, _, err = run(capsys, *cmd)
        assert code == 2 and "would overwrite the input" in err and open(path, "rb").read() == kept
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code, _, err = run(capsys, "solve", path, "--constraint", "box:0,1", "--out", str(fifo))
    assert code == 2 and "not a regular file" in err and not fifo.is_file()
    code, _, err = run(capsys, "solve", path, "--constraint", "box:0,1", "--out", "")
    assert code == 2 and "is empty" in err


def test_bench_never_replaces_the_instances_and_checks_its_numbers(tmp_path, monkeypatch, capsys) -> None:
    """--json over a benchmarked instance's files is refused; a damaged optima file is a warning and
    an empty 'vs ref' column, not a traceback; --seed, --rel-tol and --max-n are checked first;
    a solver named twice runs once."""
    import shutil

    from mergeqp.solvers.reference_problems import repo_problems_dir

    root = tmp_path / "problems"
    root.mkdir()
    for suffix in (".npz", ".json"):
        shutil.copy(repo_problems_dir() / f"tiny96{suffix}", root / f"tiny96{suffix}")
    monkeypatch.setenv("MERGEQP_PROBLEMS_DIR", str(root))
    kept = (root / "tiny96.json").read_bytes()
    for target in ("tiny96.json", "tiny96.npz"):
        code, out, err = run(capsys, "bench", "--problems", "tiny96", "--solvers", "active_set", "--constraint",
                             "box:0,1", "--json", str(root / target))
        assert code == 2 and "would overwrite the input" in err and "problem" not in out
    assert (root / "tiny96.json").read_bytes() == kept
    for extra, message in ((["--rel-tol", "nan"], "--rel-tol must be finite"), (["--max-n", "-5"], "--max-n"),
                           (["--constraint", "box:0,1 &"], "an empty part")):
        code, out, err = run(capsys, "bench", "--problems", "tiny96", "--solvers", "active_set", *extra)
        assert code == 2 and message in err and "problem" not in out
    code, _, err = run(capsys, "bench", "--family", "box", "--n", "64", "--seed", "-1", "--solvers", "active_set")
    assert code == 2 and "--seed must be >= 0" in err
    for damaged in ('{"optima": {"box:0,1": {"objective": "abc"}}}', "[1, 2]", kept[:300].decode()):
        (root / "tiny96.json").write_text(damaged)
        code, out, err = run(capsys, "bench", "--problems", "tiny96", "--solvers", "active_set,active_set",
                             "--constraint", "box:0,1")
        assert code == 0 and "are damaged" in err and "Traceback" not in err
        assert sum(line.startswith("tiny96") for line in out.splitlines()) == 1  # one row: the solver once


def test_a_lowered_iteration_limit_is_not_blamed_on_the_set(capsys) -> None:
    """dense_ipm / torch_ipm stopped by a max_iter the user lowered: the best iterate, not certified
    (exit 1), instead of 'the set may be empty' (exit 2)."""
    from mergeqp.solvers.reference_problems import repo_problems_dir

    tiny = str(repo_problems_dir() / "tiny96.npz")
    code, out, err = run(capsys, "solve", tiny, "--constraint", "box:0,1 & simplex", "--solver", "dense_ipm",
                         "--option", "max_iter=3")
    assert code == 1 and "max_iterations" in out and "may be empty" not in err


def test_the_command_imports_a_users_registrations(tmp_path, capsys, monkeypatch) -> None:
    """A set registered in the user's own file is a valid --constraint for the command once it is
    imported with --import (a .py path or a module name) or $MERGEQP_IMPORT; a module that fails to
    import is one line, exit 2."""
    from mergeqp.solvers.reference_problems import repo_problems_dir

    tiny = str(repo_problems_dir() / "tiny96.npz")
    plugin = tmp_path / "my_sets_cli.py"
    plugin.write_text(
        "import numpy as np\nimport mergeqp as mq\nfrom mergeqp.constraints import SetStructure\n\n"
        "class Interval(mq.ConstraintSet):\n    name = 'interval_cli'\n    has_projection = True\n"
        "    def __init__(self, lo, hi):\n        self.lo, self.hi = float(lo), float(hi)\n"
        "    @property\n    def spec(self):\n        return f'interval_cli:{self.lo:g},{self.hi:g}'\n"
        "    @property\n    def bounded(self):\n        return True\n"
        "    def structure(self, shape):\n        n = shape[0] * shape[1]\n"
        "        return SetStructure(np.full(n, self.lo), np.full(n, self.hi))\n"
        "    def violation(self, d):\n        return float(max(0.0, self.lo - np.min(d), np.max(d) - self.hi))\n\n"
        "mq.register_constraint('interval_cli', lambda args, spec, context: Interval(*map(float, args)))\n")
    code, _, err = run(capsys, "solve", tiny, "--constraint", "interval_cli:0,0.8")
    assert code == 2 and "unknown constraint set 'interval_cli'" in err
    from mergeqp.constraints.parse import CONSTRAINT_SETS

    # (the registration lives in this process: taken back at the end, so that other tests see the
    # built-in names only)
    monkeypatch.setitem(CONSTRAINT_SETS, "interval_cli", None)
    monkeypatch.delitem(CONSTRAINT_SETS, "interval_cli")
    monkeypatch.setitem(sys.modules, "mergeqp_plugin_my_sets_cli", None)
    monkeypatch.delitem(sys.modules, "mergeqp_plugin_my_sets_cli")
    code, out, _ = run(capsys, "--import", str(plugin), "solve", tiny, "--constraint", "interval_cli:0,0.8")
    assert code == 0 and "CERTIFIED" in out
    code, box, _ = run(capsys, "solve", tiny, "--constraint", "box:0,0.8")
    import re

    def objective(text: str) -> float:
        return float(re.search(r"objective J\(d\) = (\S+)", text).group(1))
    assert objective(out) == pytest.approx(objective(box), rel=1e-7)
    monkeypatch.setenv("MERGEQP_IMPORT", str(plugin))  # imported already: not registered twice
    assert run(capsys, "solve", tiny, "--constraint", "interval_cli:0,0.8")[0] == 0
    monkeypatch.delenv("MERGEQP_IMPORT")
    (tmp_path / "broken_cli.py").write_text("raise RuntimeError('no')\n")
    for name in (str(tmp_path / "broken_cli.py"), "no_such_module_cli_xyz", str(tmp_path / "missing.py")):
        code, _, err = run(capsys, "--import", name, "solve", tiny)
        assert code == 2 and f"--import {name}" in err and "Traceback" not in err


def test_bench_max_n_keeps_the_solvers_marked_to_scale(capsys) -> None:
    """(stop 50) --max-n kept active_set / torch_fista by name; the solver's own flag decides now."""
    from mergeqp.cli import main
    from mergeqp.solvers.registry import SOLVERS

    assert SOLVERS["active_set"].large_n_benchmark and not SOLVERS["osqp"].large_n_benchmark
    assert main(["bench", "--problems", "tiny96", "--solvers", "active_set,osqp", "--max-n", "10",
                 "--constraint", "box:0,1"]) == 0
    lines = {line.split()[3]: line for line in capsys.readouterr().out.splitlines() if line.startswith("tiny96")}
    assert "skipped: n > --max-n 10" in lines["osqp"] and "skipped" not in lines["active_set"]


def test_nan_in_a_problem_files_deltas_is_bad_data(random_problem, tmp_path, capsys) -> None:
    """(stop 52 review) NaN in the residuals a sign set is built from: exit 3 (bad data) naming the
    file, as for H and g (it was exit 2 without the file)."""
    problem = random_problem(np.random.default_rng(1), K=2, m=3)
    deltas = np.ones((2, 3, 2))
    deltas[0, 0, 0] = np.nan
    path = str(tmp_path / "nan_deltas.npz")
    problem.save_npz(path)
    arrays = dict(np.load(path))
    np.savez(path, **arrays, deltas=deltas, parametrisation=np.array("rows"))
    code, _, err = run(capsys, "solve", path, "--constraint", "sign")
    assert code == 3 and path in err and "'deltas'" in err and "NaN" in err
    code, _, _ = run(capsys, "solve", path, "--constraint", "simplex")  # no set reads them: solved as before
    assert code == 0


def test_psd_tol_written_as_text_is_still_read(random_problem, tmp_path, capsys) -> None:
    problem = random_problem(np.random.default_rng(2), K=2, m=3)
    path = str(tmp_path / "tol_text.npz")
    problem.save_npz(path)
    np.savez(path, **dict(np.load(path)), psd_tol=np.array("1e-6"))
    code, _, _ = run(capsys, "solve", path, "--constraint", "box:0,1")
    assert code == 0


def test_a_plugin_folder_is_named(tmp_path, capsys, monkeypatch, problem_file) -> None:
    """(stop 52 review) --import FOLDER (no __init__.py) imported nothing and said nothing."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "myplugins").mkdir()
    path, _ = problem_file
    for name, message in (("myplugins", "a folder without __init__.py"), ("myplugins/", "is a folder; name a .py file")):
        code, _, err = run(capsys, "--import", name, "solve", path)
        assert code == 2 and message in err, err


def test_out_dash_prints_the_json_on_stdout_and_the_summary_on_stderr(problem_file, tmp_path, capsys,
                                                                      monkeypatch) -> None:
    """``--out -`` wrote a file named ``-`` (stop 73); now the JSON is standard output, alone."""
    monkeypatch.chdir(tmp_path)
    path, problem = problem_file
    code, stdout, stderr = run(capsys, "solve", path, "--constraint", "box:0,1", "--out", "-")
    assert code == 0 and not (tmp_path / "-").exists()
    sol = json.loads(stdout)  # nothing but the JSON
    assert sol["certificate"]["certified"] is True and len(sol["d"]) == problem.K
    assert "objective J(d)" in stderr and "wrote" not in stderr
    np.save(tmp_path / "d.npy", np.array(sol["d"]))
    code, stdout, stderr = run(capsys, "certify", path, "--constraint", "box:0,1", "--point", "d.npy", "--out", "-")
    assert code == 0 and not (tmp_path / "-").exists()
    cert = json.loads(stdout)
    assert cert["certified"] is True and cert["objective"] == pytest.approx(sol["objective"], rel=1e-12)
    assert "CERTIFIED" in stderr
    # a binary output cannot go there: refused before the solve, and no file named '-'
    code, stdout, stderr = run(capsys, "solve", path, "--save-d", "-")
    assert code == 2 and "cannot go to standard output" in stderr and not stdout
    assert not (tmp_path / "-").exists()


def test_certify_a_solve_out_file_uses_its_recorded_constraints(problem_file, tmp_path, capsys) -> None:
    """Stop 74 review: ``certify --point sol.json`` of a point solved on ``box:0,1 & simplex`` certified it
    against no constraints ("NOT CERTIFIED gap 11.6") without a word about what the file records."""
    path, problem = problem_file
    sol = str(tmp_path / "sol.json")
    code, _, _ = run(capsys, "solve", path, "--constraint", "box:0,1", "--constraint", "simplex", "--out", sol)
    assert code == 0
    code, stdout, _ = run(capsys, "certify", path, "--point", sol)
    assert code == 0, stdout
    assert "constraints from the point file" in stdout and "box:0,1 & simplex" in stdout
    # given explicitly and different: as given, with a note
    code, stdout, _ = run(capsys, "certify", path, "--point", sol, "--constraint", "box:0,1")
    assert "note: the point file" in stdout and "records the constraints box:0,1 & simplex" in stdout
    # solved for another problem: a note
    other = str(tmp_path / "other.npz")
    problem.save_npz(other)
    code, stdout, _ = run(capsys, "certify", other, "--point", sol)
    assert code == 0 and "was solved for the problem" in stdout
