"""Errors no check anticipated end in one line and exit 70, never a traceback (stop 73, a QA review: a
user's solver whose ``available()`` raised, a base folder whose config.json holds a list, an output
path whose links form a loop, a seed torch cannot take, a cache that is a file)."""

from __future__ import annotations

import os

import pytest

from mergeqp.cli import main
from mergeqp.errors import EXIT_UNEXPECTED, EXIT_USAGE


def test_a_plugin_that_raises_is_one_line_naming_its_file(tmp_path, capsys, monkeypatch):
    plugin = tmp_path / "badsolver.py"
    plugin.write_text(
        "import mergeqp\n"
        "from mergeqp.solvers.base import QPSolver\n"
        "class Bad(QPSolver):\n"
        "    name = 'badsolver_s73'\n"
        "    def available(self):\n"
        "        raise RuntimeError('cannot probe')\n"
        "    def supports(self, problem, constraints):\n"
        "        return None\n"
        "    def solve(self, problem, constraints, x0=None, **options):\n"
        "        raise ValueError('no')\n"
        "mergeqp.register_solver(Bad())\n")
    monkeypatch.delenv("MERGEQP_TRACEBACK", raising=False)
    try:
        code = main(["--import", str(plugin), "list", "solvers"])
    finally:
        from mergeqp.solvers.registry import SOLVERS
        SOLVERS.pop("badsolver_s73", None)
    err = capsys.readouterr().err
    assert code == EXIT_UNEXPECTED, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"unexpected RuntimeError at {plugin}:6 (in a module of yours): cannot probe" in err
    assert "MERGEQP_TRACEBACK=1" in err


def test_the_traceback_on_request(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MERGEQP_TRACEBACK", "1")
    lc = tmp_path / "lc"
    lc.mkdir()
    (lc / "config.json").write_text("[1, 2]")
    monkeypatch.setattr("mergeqp.experiments.lm.check_base_folder", lambda folder: 1 / 0)
    # (since stop 74 the traceback is printed and the exit code kept: re-raised, it was 1, "not certified")
    assert main(["experiment", "lm", "--quick", "--base", str(lc), "--out", str(tmp_path / "o")]) == EXIT_UNEXPECTED
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError" in err


def test_an_output_whose_links_form_a_loop_is_a_usage_error(tmp_path, capsys):
    from pathlib import Path

    problem = Path(__file__).resolve().parents[2] / "problems" / "tiny96.npz"
    os.symlink(tmp_path / "loopB", tmp_path / "loopA")
    os.symlink(tmp_path / "loopA", tmp_path / "loopB")
    assert main(["solve", str(problem), "--out", str(tmp_path / "loopA")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "a loop of symbolic links" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--seed", "18446744073709551616"], "--seed must be an integer in [0, 9007199254740992]"),
    (["--cache", "{file}"], "the cache folder (--cache) {file} is a file, not a folder"),
    (["--base", "{lc}"], "its config.json holds a list, not an object of settings"),
])
def test_lm_experiment_refuses_before_any_work(tmp_path, capsys, argv, message):
    afile = tmp_path / "afile.txt"
    afile.write_text("x")
    lc = tmp_path / "lc"
    lc.mkdir()
    (lc / "config.json").write_text("[1, 2]")
    fill = {"file": str(afile), "lc": str(lc)}
    argv = [a.format(**fill) for a in argv]
    code = main(["experiment", "lm", "--quick", *argv, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE, err
    assert message.format(**fill) in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_traceback_variable_prints_a_wrapped_users_error_and_keeps_the_exit_code(tmp_path, capsys, monkeypatch):
    """A review of stop 74: with MERGEQP_TRACEBACK=1 an error wrapping a user's exception (a factory that
    raised: exit 2) was re-raised, and the exit code became 1 ("solved, not certified")."""
    from mergeqp.cli import main

    (tmp_path / "factory.py").write_text("def make():\n    raise RuntimeError('factory exploded')\n")
    monkeypatch.setenv("MERGEQP_TRACEBACK", "1")
    code = main(["collect", "--factory", f"{tmp_path / 'factory.py'}:make", "--base", str(tmp_path / "factory.py"),
                 "--finetuned", str(tmp_path / "factory.py"), "--layer", "l", "--calibration",
                 str(tmp_path / "factory.py"), "--out", str(tmp_path / "s.npz"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" in err and "factory exploded" in err, err


def test_a_plugin_that_fails_on_import_is_named_with_where(tmp_path, capsys, monkeypatch):
    """A review of stop 74: an --import module that raised (or did not parse) was named without a file:line,
    and MERGEQP_TRACEBACK=1 printed nothing more."""
    from mergeqp.cli import main

    raising = tmp_path / "raising_plugin_s74.py"
    raising.write_text("import json\nX = json.loads('{x')\n")
    broken = tmp_path / "broken_plugin_s74.py"
    broken.write_text("def f(:\n    pass\n")
    monkeypatch.delenv("MERGEQP_TRACEBACK", raising=False)
    assert main(["--import", str(raising), "list", "solvers"]) == 2
    assert "JSONDecodeError" in (err := capsys.readouterr().err) and f"(raised at {raising}:2)" in err
    assert main(["--import", str(broken), "list", "solvers"]) == 2
    assert "SyntaxError" in (err := capsys.readouterr().err) and f"(raised at {broken}:1)" in err
    monkeypatch.setenv("MERGEQP_TRACEBACK", "1")
    assert main(["--import", str(raising), "list", "solvers"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_a_users_solver_that_raises_is_named_with_where(tmp_path, capsys, monkeypatch):
    """A review of stop 75: a registered solver whose ``solve`` raised was named without a file:line (a merge
    method's failure had one); exit 2, as for every entry of the user's that raises."""
    from pathlib import Path

    import mergeqp
    from mergeqp.solvers.registry import SOLVERS

    plugin = tmp_path / "buggy_solver_s75.py"
    plugin.write_text("from mergeqp.solvers.base import QPSolver\nfrom mergeqp.solvers.registry import register_solver\n"
                      "class Buggy(QPSolver):\n    name = 'buggy_s75'\n    def supports(self, problem, constraints):\n"
                      "        return None\n    def solve(self, problem, constraints, x0=None, **options):\n"
                      "        return {}['nope']\nregister_solver(Buggy())\n")
    problem = Path(mergeqp.__file__).resolve().parent.parent / "problems" / "tiny96.npz"
    monkeypatch.delenv("MERGEQP_TRACEBACK", raising=False)
    monkeypatch.delitem(SOLVERS, "buggy_s75", raising=False)
    try:
        code = main(["--import", str(plugin), "solve", str(problem), "--solver", "buggy_s75", "--constraint", "box:0,1"])
    finally:
        SOLVERS.pop("buggy_s75", None)
    err = capsys.readouterr().err
    assert code == 2 and "solver 'buggy_s75' failed: KeyError: 'nope'" in err and f"(raised at {plugin}:8)" in err, err
