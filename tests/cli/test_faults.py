"""Fault injection: a write that fails with ENOSPC half-way, Ctrl-C inside a write, and SIGINT /
SIGTERM sent to a running ``mergeqp`` process. Each must leave the previous outputs intact (or
the new ones complete), no temporary files, and the documented exit code."""

from __future__ import annotations

import errno
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

import mergeqp.io.atomic as atomic
from mergeqp.cli import main
from mergeqp.errors import Interrupted, OutputError
from mergeqp.io import save_hf_folder

ROOT = Path(__file__).resolve().parents[2]


class _HalfThenFail:
    """A file object that writes half of what it is given, then fails like a full disk (or
    raises ``interrupt``)."""

    def __init__(self, fh, interrupt: type[BaseException] | None = None):
        self._fh = fh
        self._interrupt = interrupt

    def write(self, data):
        self._fh.write(data[: max(1, len(data) // 2)])
        self._fh.flush()
        if self._interrupt is not None:
            raise self._interrupt()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._fh, name)


def _failing_open(monkeypatch, fail_on: int, interrupt: type[BaseException] | None = None) -> None:
    """Make the ``fail_on``-th file opened by the atomic writers fail half-way."""
    calls = {"n": 0}
    real_open = open

    def fake_open(path, *args, **kwargs):
        fh = real_open(path, *args, **kwargs)
        calls["n"] += 1
        return _HalfThenFail(fh, interrupt) if calls["n"] == fail_on else fh

    monkeypatch.setattr(atomic, "open", fake_open, raising=False)


@pytest.fixture()
def problem_path(small_problem, tmp_path) -> Path:
    path = tmp_path / "in" / "p.npz"
    path.parent.mkdir()
    np.savez(path, **small_problem())
    return path


@pytest.mark.parametrize("fail_on", [1, 2])
def test_full_disk_while_solve_writes_keeps_old_files(digests, leftovers, problem_path, tmp_path, monkeypatch, capsys, fail_on):
    out = tmp_path / "out"
    out.mkdir()
    (out / "sol.json").write_text("old solution")
    (out / "d.npy").write_bytes(b"old d")
    inputs = digests(problem_path.parent)
    _failing_open(monkeypatch, fail_on)
    code = main(["solve", str(problem_path), "--out", str(out / "sol.json"), "--save-d", str(out / "d.npy")])
    err = capsys.readouterr().err
    assert code == 4, err
    failed = "sol.json" if fail_on == 1 else "d.npy"
    assert f"cannot write {out / failed}: No space left on device; its previous state is kept" in err
    assert (out / "d.npy").read_bytes() == b"old d"  # the failed file, or one never reached
    if fail_on == 1:
        assert (out / "sol.json").read_text() == "old solution"
    else:  # the first file was complete before the second failed
        assert json.loads((out / "sol.json").read_text())["certificate"]["certified"] is True
    assert leftovers(tmp_path) == [] and digests(problem_path.parent) == inputs


def test_ctrl_c_inside_a_write_keeps_the_old_file(leftovers, problem_path, tmp_path, monkeypatch, capsys):
    (tmp_path / "sol.json").write_text("old")
    _failing_open(monkeypatch, 1, interrupt=KeyboardInterrupt)
    code = main(["solve", str(problem_path), "--out", str(tmp_path / "sol.json")])
    assert code == 130 and "interrupted" in capsys.readouterr().err
    assert (tmp_path / "sol.json").read_text() == "old" and leftovers(tmp_path) == []


@pytest.mark.parametrize("stop", [KeyboardInterrupt, lambda: Interrupted("stopped by signal SIGTERM")])
def test_a_signal_that_a_library_wrapped_still_exits_as_interrupted(leftovers, problem_path, tmp_path, monkeypatch,
                                                                     capsys, stop):
    """A signal that arrives while a solver imports a module reaches us wrapped: Python reports an
    exception in ``__set_name__`` as a RuntimeError caused by it, and the solver registry wraps
    that into a SolverError. The run was interrupted (130), not failed (2)."""
    from mergeqp.solvers.active_set import ActiveSetSolver

    def solve(self, *args, **kwargs):
        try:
            raise stop()
        except BaseException as exc:
            raise RuntimeError("Error calling __set_name__ on 'cached_property' instance") from exc

    monkeypatch.setattr(ActiveSetSolver, "solve", solve)
    (tmp_path / "sol.json").write_text("old")
    code = main(["solve", str(problem_path), "--solver", "active_set", "--out", str(tmp_path / "sol.json")])
    err = capsys.readouterr().err
    assert code == 130 and "outputs keep their previous state" in err and "error:" not in err
    assert (tmp_path / "sol.json").read_text() == "old" and leftovers(tmp_path) == []


def test_full_disk_while_collect_writes(build_world, digests, leftovers, tmp_path, monkeypatch, capsys):
    world = build_world(tmp_path / "w")
    inputs = digests(world)
    out = tmp_path / "o"
    out.mkdir()
    (out / "s.npz").write_bytes(b"old statistics")
    _failing_open(monkeypatch, 1)
    code = main(["collect", "--factory", f"{world}/factory.py:make", "--layer", "2", "--quiet",
                 "--base", f"{world}/base.safetensors", "--finetuned", f"{world}/ft0.safetensors",
                 "--calibration", f"{world}/cal0.pt", "--out", str(out / "s.npz")])
    err = capsys.readouterr().err
    assert code == 4 and "No space left on device" in err and str(out / "s.npz") in err
    assert (out / "s.npz").read_bytes() == b"old statistics" and not (out / "s_problem.npz").exists()
    assert leftovers(tmp_path) == [] and digests(world) == inputs


def test_full_disk_half_way_through_a_sharded_model_keeps_the_old_folder(digests, leftovers, tmp_path, monkeypatch):
    import safetensors.torch as st

    tensors = {f"t{i}": torch.full((64,), float(i)) for i in range(6)}
    out = tmp_path / "model"
    save_hf_folder(out, iter(tensors.items()), max_shard_bytes=600)
    before = digests(out)
    real_save, calls = st.save_file, {"n": 0}

    def save_file(data, path, metadata=None):
        calls["n"] += 1
        if calls["n"] == 2:  # the second shard: half its bytes, then the disk is full
            real_save(data, path, metadata=metadata)
            with open(path, "r+b") as fh:
                fh.truncate(os.path.getsize(path) // 2)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(data, path, metadata=metadata)

    monkeypatch.setattr(st, "save_file", save_file)
    new = {k: v + 1 for k, v in tensors.items()}
    with pytest.raises(OutputError, match="No space left on device; the output folder was not changed"):
        save_hf_folder(out, iter(new.items()), max_shard_bytes=600, overwrite=True)
    assert digests(out) == before and leftovers(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_failed_folder_write_leaves_no_folder(tmp_path):
    with pytest.raises(RuntimeError), atomic.atomic_folder(tmp_path / "new") as staging:
        (staging / "results.json").write_text("{}")
        raise RuntimeError("the run failed after its first file")
    assert list(tmp_path.iterdir()) == []


def test_atomic_folder_replaces_old_content_only_when_complete(leftovers, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "results.json").write_text("old")
    with pytest.raises(KeyboardInterrupt), atomic.atomic_folder(out, overwrite=True) as staging:
        (staging / "results.json").write_text("new, half")
        raise KeyboardInterrupt
    assert (out / "results.json").read_text() == "old"
    with atomic.atomic_folder(out, overwrite=True) as staging:
        (staging / "results.json").write_text("new")
    assert (out / "results.json").read_text() == "new" and leftovers(tmp_path) == []


# the solver announces that its loop has started (by then main's signal handling is in place),
# so the signal lands mid-solve however slowly the machine imports and sets up
SCRIPT = """
import sys
from mergeqp.cli import main
from mergeqp.solvers.torch_solvers import TorchAdamSolver
solve = TorchAdamSolver.solve
def announced(self, *args, **kwargs):
    print("solving", flush=True)
    return solve(self, *args, **kwargs)
TorchAdamSolver.solve = announced
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_mid_run_keeps_the_old_output(leftovers, interrupt_child, problem_path, tmp_path, signum):
    """A long solve (the paper's Adam with 10^9 steps) is stopped by a signal: exit 130, the old
    --out file untouched, no temporary file."""
    out = tmp_path / "sol.json"
    out.write_text("old solution")
    code, err = interrupt_child(
        SCRIPT, ["solve", str(problem_path), "--constraint", "box:0,1", "--solver", "torch_adam", "--option",
                 "steps=1000000000", "--option", "device='cpu'", "--out", str(out)],
        "solving", signum, settle=0.5)  # into the loop
    assert code == 130, err
    assert "outputs keep their previous state" in err and "Traceback" not in err
    assert out.read_text() == "old solution" and leftovers(tmp_path) == []


# a stand-in for torch: a package whose initialisation is where the signal arrives (it sends it to
# itself), with a line printed once the initialisation is complete
NATIVE_STAND_IN = """
import os, signal
os.kill(os.getpid(), signal.SIGTERM)
print("initialised", flush=True)
"""

GUARDED_IMPORT = """
import sys
from mergeqp.cli.signals import signals_held_during_native_imports, sigterm_as_interrupt
from mergeqp.errors import Interrupted
sys.path.insert(0, sys.argv[1])
names = sys.argv[2:]
try:
    with sigterm_as_interrupt(), signals_held_during_native_imports(names):
        import native_stand_in
        print("imported", flush=True)
except Interrupted as exc:
    print(exc, flush=True)
    sys.exit(130)
"""


@pytest.mark.parametrize("guarded", [True, False])
def test_a_signal_during_a_native_import_is_taken_after_it(tmp_path, guarded):
    """torch's import runs C++ that calls Python; a signal handler raising there aborts the process
    (exit -6, seen on CI). The CLI holds SIGINT/SIGTERM while such a package imports: the package
    initialises completely, then the pending signal stops the command with exit 130. Unguarded
    (the control), the signal stops the stand-in half-way through its initialisation."""
    import subprocess
    import sys

    (tmp_path / "native_stand_in").mkdir()
    (tmp_path / "native_stand_in" / "__init__.py").write_text(NATIVE_STAND_IN)
    names = ["native_stand_in"] if guarded else ["some_other_package"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", GUARDED_IMPORT, str(tmp_path), *names],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 130, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines == (["initialised", "stopped by signal SIGTERM"] if guarded else ["stopped by signal SIGTERM"])
    assert "Traceback" not in proc.stderr


def test_every_command_runs_with_torch_imports_guarded(problem_path, monkeypatch):
    """main() runs each command with the guard for torch in place, and removes it afterwards."""
    import sys

    import mergeqp.cli.solve as solve_cli
    from mergeqp.cli.signals import NativeImportGuard

    seen = []

    def record(args):
        seen.extend(f.names for f in sys.meta_path if isinstance(f, NativeImportGuard))
        return 0

    monkeypatch.setattr(solve_cli, "run_solve", record)
    assert main(["solve", str(problem_path), "--constraint", "box:0,1"]) == 0
    assert seen == [frozenset({"torch"})]
    assert not any(isinstance(f, NativeImportGuard) for f in sys.meta_path)


def test_collect_refuses_a_disk_too_small_before_collecting(build_world, tmp_path, monkeypatch, capsys):
    """The statistics' size is estimated once the layer is known, before the collection."""
    import collections

    world = build_world(tmp_path / "w")
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    monkeypatch.setattr("mergeqp.stats.collect_statistics",
                        lambda *a, **k: pytest.fail("collected despite the full disk"))
    code = main(["collect", "--factory", f"{world}/factory.py:make", "--layer", "2", "--quiet",
                 "--base", f"{world}/base.safetensors", "--finetuned", f"{world}/ft0.safetensors",
                 "--calibration", f"{world}/cal0.pt", "--out", str(tmp_path / "s.npz")])
    err = capsys.readouterr().err
    assert code == 2 and "not enough free space for the statistics and problem files" in err
    assert not (tmp_path / "s.npz").exists()


def test_atomic_file_writes_exact_name_and_keeps_permissions(leftovers, tmp_path):
    target = tmp_path / "d"
    target.write_text("old")
    os.chmod(target, 0o640)
    atomic.save_npy_atomic(target, np.arange(3.0))
    assert np.load(target).tolist() == [0.0, 1.0, 2.0] and not (tmp_path / "d.npy").exists()
    assert (os.stat(target).st_mode & 0o777) == 0o640 and leftovers(tmp_path) == []


def test_outputs_given_as_links_are_written_through(leftovers, tmp_path):
    """A symbolic link to a folder (or file) as the output: the target gets the new content, the
    link stays a link, and nothing (no '.old-mergeqp-' link) is left beside it."""
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "results.json").write_text("old")
    os.symlink(tmp_path / "real", tmp_path / "link")
    with atomic.atomic_folder(tmp_path / "link", overwrite=True) as staging:
        (staging / "results.json").write_text("new")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real" / "results.json").read_text() == "new"
    (tmp_path / "sol.json").write_text("old")
    os.symlink(tmp_path / "sol.json", tmp_path / "sol_link.json")
    atomic.write_text_atomic(tmp_path / "sol_link.json", "new")
    assert (tmp_path / "sol_link.json").is_symlink() and (tmp_path / "sol.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real", "sol.json", "sol_link.json"]
    assert leftovers(tmp_path) == []


def test_a_replaced_folder_keeps_its_permissions(leftovers, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "old.txt").write_text("old")
    out.chmod(0o750)
    with atomic.atomic_folder(out, overwrite=True) as staging:
        (staging / "new.txt").write_text("new")
    assert (out / "new.txt").is_file() and not (out / "old.txt").exists()
    assert (out.stat().st_mode & 0o777) == 0o750 and leftovers(tmp_path) == []


def test_an_output_folder_that_cannot_be_replaced_is_refused_before_any_work(tmp_path, monkeypatch):
    """A read-only folder (or one on a read-only file system) and a mount point are kept and
    refused by name; before, the first was replaced by a writable folder and the second failed only
    after the whole merge (root passes every permission check, so os.access is stood in for)."""
    from mergeqp.errors import ValidationError

    out = tmp_path / "ro"
    out.mkdir()
    real_access = os.access
    monkeypatch.setattr(atomic.os, "access", lambda p, mode: False if Path(p) == out else real_access(p, mode))
    with pytest.raises(ValidationError, match=r"ro is not writable \(read-only folder or file system\)"):
        atomic.check_output_folder(out, overwrite=True)
    monkeypatch.setattr(atomic.os, "access", real_access)
    monkeypatch.setattr(atomic.os.path, "ismount", lambda p: Path(p) == out)
    with pytest.raises(ValidationError, match="is a mount point, which cannot be replaced"):
        atomic.check_output_folder(out, overwrite=True)


def test_free_space_refusal_shows_the_margin(tmp_path, monkeypatch):
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda p: usage(10**9, 0, 10_500_000))
    with pytest.raises(Exception, match=r"about 0.0 MB needed plus a 16.8 MB margin, 10.5 MB free"):
        atomic.check_free_space(tmp_path, 10)


def test_an_interrupt_after_an_output_was_written_says_so(tmp_path, capsys, monkeypatch):
    """Exit 130 still, but the message names what was already put in place (complete) instead of
    claiming that every output kept its previous state."""
    import mergeqp.cli as cli

    def command(args):
        atomic.write_text_atomic(tmp_path / "report.md", "done")
        raise KeyboardInterrupt

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    args = parser.parse_args(["bench", "--family", "box"])
    monkeypatch.setattr(parser, "parse_args", lambda argv=None: type(args)(**{**vars(args), "func": command}))
    assert cli.main(["bench"]) == 130
    err = capsys.readouterr().err
    assert f"after writing {tmp_path / 'report.md'} (complete, new)" in err
    monkeypatch.setattr(parser, "parse_args", lambda argv=None: type(args)(
        **{**vars(args), "func": lambda a: (_ for _ in ()).throw(KeyboardInterrupt())}))
    assert cli.main(["bench"]) == 130
    assert "outputs keep their previous state" in capsys.readouterr().err  # nothing written this time


def test_the_program_ignores_a_signal_once_its_command_returned(monkeypatch):
    import mergeqp.cli as cli

    monkeypatch.setattr(cli, "main", lambda argv=None: 0)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as stop:
            cli.entry()
        assert stop.value.code == 0
        assert all(signal.getsignal(s) == signal.SIG_IGN for s in before)
    finally:
        for s, h in before.items():
            signal.signal(s, h)
