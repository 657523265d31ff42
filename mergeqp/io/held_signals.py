"""Signals held for a short critical section, and taken when it ends.

* :func:`held_signals`: SIGINT and SIGTERM blocked in this thread (``pthread_sigmask``). A signal sent
  to the process can still be taken by another thread (torch's and OpenMP's), whose C handler makes
  the main thread run the Python handler at once: what :func:`deferred_signals` falls back to outside
  the main thread only.
* :func:`deferred_signals`: their Python handlers replaced by one that records them, the previous
  handlers restored and the recorded signals raised again when the section ends; used where an
  interruption between two steps would lose data (:func:`mergeqp.io.atomic.atomic_folder` moves the old
  output aside, then the new one into place) and by the command line while native packages import
  (:mod:`mergeqp.cli.signals`: a handler that raises inside their C++ frames aborts the process). Only
  the main thread sets handlers; elsewhere it falls back to :func:`held_signals`. Nested sections
  work: an inner one raises its recorded signals to the outer one's recording handler."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterable, Iterator

HELD_SIGNALS: frozenset[int] = frozenset({signal.SIGINT, signal.SIGTERM})


@contextlib.contextmanager
def held_signals(signums: Iterable[int] = HELD_SIGNALS) -> Iterator[None]:
    """Block ``signums`` in this thread for the duration; one sent meanwhile is delivered (and its
    handler runs) when they are unblocked. A no-op where the platform has no ``pthread_sigmask``."""
    if not hasattr(signal, "pthread_sigmask"):  # pragma: no cover - Windows
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, set(signums))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def deferred_signals(signums: Iterable[int] = HELD_SIGNALS) -> Iterator[None]:
    """Record ``signums`` for the duration instead of handling them, then restore their handlers and
    raise each recorded signal once, in the order first received (so a Ctrl-C during the section is
    taken right after it, by the handler that was in place). In a thread other than the main one:
    :func:`held_signals`."""
    if threading.current_thread() is not threading.main_thread():
        with held_signals(signums):
            yield
        return
    pending: list[int] = []

    def record(signum: int, frame: object) -> None:
        if signum not in pending:
            pending.append(signum)

    previous = {s: signal.signal(s, record) for s in signums}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in pending:
            signal.raise_signal(s)


__all__ = ["HELD_SIGNALS", "deferred_signals", "held_signals"]
