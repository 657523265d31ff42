"""Temporary work folders that a killed run does not leave behind for good.

A run killed by SIGKILL (or by SIGTERM from Python, where mergeqp installs no signal handler) cannot
remove its work folder. :func:`work_folder` names each folder after the machine and the process
(``<prefix><host>-<pid>-<random>``) and, before making a new one, removes the folders of its prefix
that processes of this machine no longer running left in the same parent. A folder of a live
process, or of another machine sharing the file system, is never touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname() or "host")[:40]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def stale_work_folders(parent: Path, prefix: str) -> list[Path]:
    """The folders in ``parent`` named ``<prefix><this host>-<pid>-...`` whose process is gone."""
    pattern = re.compile(re.escape(prefix + _host() + "-") + r"(\d+)-[0-9a-z_]+$")
    out = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return []
    for entry in entries:
        m = pattern.match(entry.name)
        if m and entry.is_dir() and not entry.is_symlink() and not _alive(int(m.group(1))):
            out.append(entry)
    return out


@contextlib.contextmanager
def work_folder(prefix: str, parent: str | os.PathLike[str] | None = None) -> Iterator[Path]:
    """A new empty folder in ``parent`` (default: the system's temporary folder), removed on exit;
    first the folders of ``prefix`` left there by killed processes of this machine are removed."""
    root = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    for stale in stale_work_folders(root, prefix):
        shutil.rmtree(stale, ignore_errors=True)
    folder = Path(tempfile.mkdtemp(prefix=f"{prefix}{_host()}-{os.getpid()}-", dir=str(root)))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


__all__ = ["stale_work_folders", "work_folder"]
