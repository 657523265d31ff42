"""How the command line takes SIGINT and SIGTERM.

* SIGTERM raises :class:`~mergeqp.errors.Interrupted`, like Ctrl-C raises ``KeyboardInterrupt``,
  so that atomic writes clean up and the previous outputs stay (:func:`sigterm_as_interrupt`).
* Neither signal lands inside the import of a native package (:data:`NATIVE_PACKAGES`, torch):
  torch's import calls C++ that runs Python code (``torch._C._autograd_init``); a Python exception
  raised there by a signal handler cannot cross the C++ frames and the process aborts
  (``terminate called after throwing an instance of 'pybind11::error_already_set'``, exit -6)
  instead of exiting 130 with its outputs intact. :func:`signals_held_during_native_imports` defers
  the two signals while such a package imports (their handlers only record them,
  :func:`~mergeqp.io.held_signals.deferred_signals`); a signal sent meanwhile is raised again as soon
  as the import ends, in Python code, where it stops the command cleanly. (Until stop 68 they were
  blocked with ``pthread_sigmask``, in the importing thread only: a signal sent to the process could
  be taken by another of its threads, and its handler then ran in the import all the same.)
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import signal
import sys
import threading
import types
from collections.abc import Iterable, Iterator, Sequence

from ..errors import Interrupted
from ..io.held_signals import deferred_signals

# top-level packages whose import runs native code that cannot take a Python exception
NATIVE_PACKAGES: tuple[str, ...] = ("torch",)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises :class:`Interrupted` (like Ctrl-C), so that atomic writes clean up and the
    previous outputs stay; only in the main thread (where signal handlers can be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise Interrupted(f"stopped by signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _HeldLoader(importlib.abc.Loader):
    """Runs another loader's ``exec_module`` with the signals deferred; the module keeps the real
    loader as its ``__loader__`` and ``__spec__.loader``."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        with deferred_signals():
            self._loader.exec_module(module)


class NativeImportGuard(importlib.abc.MetaPathFinder):
    """A meta-path finder that finds nothing itself: for the top-level packages ``names`` it asks
    the finders after it and wraps the loader they return so that the package (and every module it
    imports while it initialises) imports with SIGINT and SIGTERM held."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = frozenset(names)

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names or threading.current_thread() is not threading.main_thread():
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _HeldLoader(spec.loader)
                return spec
        return None


@contextlib.contextmanager
def signals_held_during_native_imports(names: Iterable[str] = NATIVE_PACKAGES) -> Iterator[None]:
    """While the block runs, the first import of each package in ``names`` holds SIGINT and
    SIGTERM (see the module docstring); a package already imported is unaffected."""
    guard = NativeImportGuard(names)
    sys.meta_path.insert(0, guard)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(guard)
