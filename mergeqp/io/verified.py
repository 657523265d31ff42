"""What this process has already verified about input files that have not changed since.

Checking a checkpoint (every tensor finite) or two tokenizers (the same vocabulary) reads the
files in full; a run that merges the same folders many times (an experiment's grid of methods,
a sweep) paid that again for every merge: in the LM experiment's quick mode about half a minute
of its ten (docs/lm.md, stop 31). A check that passed is remembered under a key built from
:func:`signature` (each file's path, inode, size and modification and change times), so it runs
again as soon as any of them changes. Only passes are remembered, the memo lives as long as the
process, and nothing is remembered about a file modified in the last :data:`RACY_SECONDS` (file
times can be coarser than the time between two writes; git's "racily clean" rule).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path

#: files modified this recently (seconds) are never remembered as checked
RACY_SECONDS = 2.0

_PASSED: set[Hashable] = set()
_LOCK = threading.Lock()


@dataclass(frozen=True)
class Signature:
    """The state of a file, or of the files directly inside a folder: ``files`` holds
    ``(name, inode, size, mtime_ns, ctime_ns)`` per file (``(name,)`` for an absent one)."""

    path: str
    files: tuple[tuple, ...]
    newest_ns: int


def signature(path: str | os.PathLike[str], names: Iterable[str] | None = None) -> Signature:
    """The :class:`Signature` of the file ``path``, or of the files directly inside the folder
    ``path`` (only ``names`` of them when given, absent ones recorded as absent). Changes whenever
    a file is added, removed, replaced, rewritten or touched."""
    p = Path(path).resolve()
    if p.is_file():
        candidates = [p]
    elif names is not None:
        candidates = [p / n for n in sorted(names)]
    else:
        try:
            candidates = sorted((Path(e.path) for e in os.scandir(p) if not e.is_dir()), key=lambda q: q.name)
        except OSError:
            candidates = []
    files: list[tuple] = []
    newest = 0
    for q in candidates:
        try:
            st = q.stat()
        except OSError:
            files.append((q.name,))
            continue
        files.append((q.name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        newest = max(newest, st.st_mtime_ns, st.st_ctime_ns)
    return Signature(str(p), tuple(files), newest)


def passed(key: Hashable) -> bool:
    """Whether the check ``key`` (a tuple holding :func:`signature` values) passed in this process."""
    with _LOCK:
        return key in _PASSED


def remember(key: tuple) -> None:
    """Record that the check ``key`` passed, unless one of its files changed too recently."""
    now = time.time_ns()
    if any(isinstance(part, Signature) and now - part.newest_ns < RACY_SECONDS * 1e9 for part in key):
        return
    with _LOCK:
        _PASSED.add(key)


def once(key: tuple, check: Callable[[], None]) -> None:
    """Run ``check`` (which raises when the check fails) unless ``key`` passed earlier in this
    process; remember the pass (:func:`remember`'s rule)."""
    if passed(key):
        return
    check()
    remember(key)


def forget() -> None:
    """Forget every remembered check."""
    with _LOCK:
        _PASSED.clear()


__all__ = ["RACY_SECONDS", "Signature", "forget", "once", "passed", "remember", "signature"]
