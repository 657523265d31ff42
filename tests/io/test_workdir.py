"""Work folders: removed on exit; those of dead runs removed by the next run, never a live run's
(whatever its process namespace: the lock, not a process id, decides), nor a folder without a lock."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from mergeqp.io.workdir import LOCK_FILE, remove_stale_work_folders, work_folder

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform.startswith("win"), reason="POSIX flock")

HOLD = textwrap.dedent("""
    import sys, time
    from mergeqp.io.workdir import work_folder
    with work_folder(sys.argv[1], sys.argv[2]) as folder:
        print(folder, flush=True)
        if sys.argv[3] == "die":
            import os; os._exit(9)  # killed: no clean-up runs
        sys.stdin.readline()  # held until the test says
""")


def _start(prefix, parent, how):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, prefix, str(parent), how], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def test_a_dead_runs_folder_is_removed_and_a_live_ones_is_kept(tmp_path):
    first_proc, first = _start(".lm-work-", tmp_path, "die")
    first_proc.wait()
    assert os.path.isdir(first)  # killed: left behind
    live_proc, live = _start(".lm-work-", tmp_path, "hold")  # the next run removes it
    try:
        assert not os.path.exists(first) and os.path.isdir(live)
        dead_proc, dead = _start(".lm-work-", tmp_path, "die")
        dead_proc.wait()
        assert os.path.isdir(dead) and os.path.isdir(live)  # a live run's folder is kept by every run
        unlocked = tmp_path / ".lm-work-old"  # no lock file (another version, or a user's): never touched
        unlocked.mkdir()
        other = tmp_path / "mergeqp-text-x"
        (other).mkdir()
        (other / LOCK_FILE).write_text("")
        with work_folder(".lm-work-", tmp_path) as work:
            assert work.is_dir() and work.name.startswith(".lm-work-") and (work / LOCK_FILE).is_file()
            assert not os.path.exists(dead) and os.path.isdir(live) and unlocked.is_dir() and other.is_dir()
            assert remove_stale_work_folders(tmp_path, ".lm-work-") == []  # this run's own is locked too
        assert not work.exists()
    finally:
        live_proc.communicate("\n")
    assert not os.path.exists(live)  # the live run removed its own on exit
