"""How many threads the dense BLAS may use during a solve (the ``threads`` option of
``active_set`` and ``dense_ipm``).

``active_set`` spends its time in many small dense operations (face blocks of a few hundred to a
few thousand rows, triangular solves, products with H) for which a BLAS pool of many threads
costs more in synchronisation than it gains: on a 16-core machine (OpenBLAS 0.3.34) the same
n = 3072 box solve took 0.97 s with 16 threads, 0.22 s with 4 and 0.30 s with 1
(docs/solvers.md, stop 31). ``"auto"`` therefore caps the pools at :data:`AUTO_MAX_THREADS`
while a solve runs and restores them afterwards; on a machine with no more cores than that it
does nothing at all (not even a query of the pools). A solver whose time goes to larger
factorisations passes its own cap for ``"auto"`` (``dense_ipm``: 8; docs/solvers.md, stop 33).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

from ..errors import ValidationError

#: ``threads: "auto"`` lets the BLAS use at most this many threads during an active-set solve
AUTO_MAX_THREADS = 4

_controller: Any = None


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def thread_cap(setting: Any, auto: int = AUTO_MAX_THREADS) -> int | None:
    """The number of BLAS threads ``setting`` asks for (``None``: leave the pools as they are).
    ``"auto"``: ``auto`` (default :data:`AUTO_MAX_THREADS`); ``"all"``: no limit; an integer >= 1:
    that many."""
    if setting == "auto":
        return auto
    if setting == "all":
        return None
    if isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1:
        return setting
    raise ValidationError(f"threads={setting!r} must be 'auto', 'all' or an integer >= 1")


@contextlib.contextmanager
def blas_threads(setting: Any, auto: int = AUTO_MAX_THREADS) -> Iterator[int | None]:
    """Limit the BLAS pools to ``thread_cap(setting, auto)`` threads inside the block (a no-op when the
    cap is at least the usable cores or every pool is already that small; a pool is never
    enlarged). Yields the cap applied, ``None`` when nothing was limited."""
    global _controller
    cap = thread_cap(setting, auto)
    if cap is None or cap >= usable_cores():
        yield None
        return
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # a dependency; without it the pools keep their size
        yield None
        return
    if _controller is None:  # finding the loaded libraries once is the expensive part
        _controller = ThreadpoolController()
    # only the pools above the cap: a pool already within it (OMP_NUM_THREADS, a single-threaded
    # build) keeps its size
    over = [lib["filepath"] for lib in _controller.select(user_api="blas").info() if int(lib["num_threads"]) > cap]
    if not over:
        yield None
        return
    with _controller.select(filepath=over).limit(limits=cap):
        yield cap


__all__ = ["AUTO_MAX_THREADS", "blas_threads", "thread_cap", "usable_cores"]
