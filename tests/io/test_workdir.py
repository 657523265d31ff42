"""Work folders: removed on exit, and those of killed processes removed by the next run (never a live
process's, nor another machine's)."""

from __future__ import annotations

import os
import subprocess
import sys

from mergeqp.io import workdir
from mergeqp.io.workdir import stale_work_folders, work_folder


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    return int(proc.stdout)


def test_a_killed_runs_folder_is_removed_by_the_next_run_and_nothing_else(tmp_path):
    host = workdir._host()
    dead = tmp_path / f".lm-work-{host}-{_dead_pid()}-abc123"
    live = tmp_path / f".lm-work-{host}-{os.getpid()}-def456"
    other_host = tmp_path / f".lm-work-otherhost-{_dead_pid()}-aaa111"
    other_prefix = tmp_path / f"mergeqp-text-{host}-{_dead_pid()}-bbb222"
    for folder in (dead, live, other_host, other_prefix):
        (folder / "sub").mkdir(parents=True)
    assert stale_work_folders(tmp_path, ".lm-work-") == [dead]
    with work_folder(".lm-work-", tmp_path) as work:
        assert work.is_dir() and work.name.startswith(f".lm-work-{host}-{os.getpid()}-")
        assert not dead.exists() and live.exists() and other_host.exists() and other_prefix.exists()
        (work / "file").write_text("x")
    assert not work.exists()
