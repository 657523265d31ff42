"""Signals held for a short critical section: SIGINT and SIGTERM blocked in this thread, and
delivered (their handlers run) when the section ends. Used where an interruption between two steps
would lose data (:func:`mergeqp.io.atomic.atomic_folder` moves the old output aside, then the new one
into place) and by the command line while native packages import (:mod:`mergeqp.cli.signals`)."""

from __future__ import annotations

import contextlib
import signal
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


__all__ = ["HELD_SIGNALS", "held_signals"]
