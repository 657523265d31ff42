"""Temporary work folders that a killed run does not leave behind for good.

A run killed by SIGKILL (or by SIGTERM from Python, where mergeqp installs no signal handler) cannot
remove its work folder. Each folder made by :func:`work_folder` holds a lock file that its run keeps
locked (``flock``) while it lives; the kernel releases the lock when the process ends, however it
ends. Before making a new folder, :func:`work_folder` removes the folders of its prefix in the same
parent whose lock it can take: those of runs that are gone. A live run's lock cannot be taken, from
any process namespace (a process id, which an earlier version checked, is not visible across
containers that share a hostname and a folder); a folder without a lock file is never touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

try:  # POSIX; elsewhere no folder is ever taken for stale
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

#: the file whose lock a live run holds
LOCK_FILE = ".mergeqp-lock"


def _try_lock(fd: int) -> bool:
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held by a live run (BlockingIOError), or a file system without locks
        return False
    return True


def remove_stale_work_folders(parent: Path, prefix: str) -> list[Path]:
    """Remove the folders ``<prefix>*`` in ``parent`` whose lock file nobody holds (their run is
    gone); returns them. Each is removed while this process holds its lock."""
    removed = []
    try:
        entries = sorted(parent.glob(prefix + "*"))
    except OSError:
        return []
    for entry in entries:
        lock = entry / LOCK_FILE
        if entry.is_symlink() or not entry.is_dir() or not lock.is_file():
            continue
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue
        try:
            if _try_lock(fd):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
        finally:
            os.close(fd)
    return removed


@contextlib.contextmanager
def work_folder(prefix: str, parent: str | os.PathLike[str] | None = None) -> Iterator[Path]:
    """A new empty folder (but for its lock file) in ``parent`` (default: the system's temporary
    folder), locked while the block runs and removed on exit; first the folders of ``prefix`` that
    dead runs left there are removed."""
    root = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    remove_stale_work_folders(root, prefix)
    # made and locked under a name outside the prefix, then renamed: another run's scan never sees
    # it unlocked (the lock belongs to the open file, which the rename keeps)
    staging = Path(tempfile.mkdtemp(prefix=".new-" + prefix.lstrip("."), dir=str(root)))
    fd = os.open(staging / LOCK_FILE, os.O_CREAT | os.O_RDWR, 0o600)
    folder = staging
    try:
        _try_lock(fd)
        folder = root / (prefix + staging.name[len(".new-" + prefix.lstrip(".")):])
        os.rename(staging, folder)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.close(fd)


__all__ = ["LOCK_FILE", "remove_stale_work_folders", "work_folder"]
