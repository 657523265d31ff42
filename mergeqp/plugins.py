"""Importing users' own modules, so that what they register (constraint sets, solvers, parametrisations,
bases, output metrics, merge methods and modes, architectures, domains) is known before a command or a config uses it.

The ``mergeqp`` command imports ``$MERGEQP_IMPORT`` (comma-separated) and every ``--import`` before
it runs; a merge config's ``imports:`` list is imported when the config is read, before any of its
names is checked (``docs/architecture.md``). Importing a module runs its code: only name modules you
trust, as with ``python my_module.py``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import ConfigError, MergeQPError, failure_text

#: the environment variable holding modules the ``mergeqp`` command imports first (comma-separated)
IMPORT_ENV = "MERGEQP_IMPORT"
#: what :func:`import_plugins` imported in this process, in order (:func:`imported_modules`)
_IMPORTED: list[dict[str, Any]] = []


def imported_modules() -> list[dict[str, Any]]:
    """Every user module :func:`import_plugins` imported in this process, in order: ``import`` (as
    named), ``module``, ``file`` and the ``sha256`` of the file's bytes when it was imported (``None``
    for a module without a file), so that a report says which code registered what it used."""
    return [dict(entry) for entry in _IMPORTED]


def _record(name: str, module: Any) -> None:
    path = getattr(module, "__file__", None)
    digest = None
    if path:
        try:
            digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        except OSError:
            digest = None
    _IMPORTED.append({"import": name, "module": getattr(module, "__name__", name),
                      "file": None if not path else os.path.abspath(path), "sha256": digest})


def import_plugins(names: Sequence[str], *, label: str = "--import", root: str | Path | None = None) -> None:
    """Import each of ``names`` (a dotted module name, found beside ``root`` first when given, or a
    path to a ``.py`` file, relative to ``root`` or else to the working folder, whose folder then joins
    ``sys.path`` so that it imports the modules beside it) so that what it registers is known; a module that
    cannot be imported, or whose registrations are refused (e.g. a name another module registered),
    is a :class:`ConfigError` starting ``"{label} {name}: "``. A file already imported (under either
    spelling) is not imported again."""
    for name in names:
        prefix = f"{label} {name}:"
        try:
            if name.endswith(".py") or os.sep in name:
                path = os.path.abspath(os.path.join(os.fspath(root or os.getcwd()), os.path.expanduser(name)))
                if os.path.isdir(path):
                    raise ConfigError(f"{prefix} {path} is a folder; name a .py file (or a package by its module name)")
                if not os.path.isfile(path):
                    raise ConfigError(f"{prefix} no such file ({path})")
                if _imported(path):
                    continue  # imported already (its registrations hold for this process)
                mod_name = "mergeqp_plugin_" + os.path.splitext(os.path.basename(path))[0]
                spec = importlib.util.spec_from_file_location(mod_name, path)
                if spec is None or spec.loader is None:
                    raise ConfigError(f"{prefix} not a Python file")
                module = importlib.util.module_from_spec(spec)
                folder = os.path.dirname(path)
                if folder not in sys.path:  # its own imports find the modules beside it, as `python FILE` would
                    sys.path.insert(0, folder)
                sys.modules[mod_name] = module
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    sys.modules.pop(mod_name, None)  # a failed import is not an import: a fixed file runs again
                    raise
                _record(name, module)
            else:
                if "" not in sys.path and os.getcwd() not in sys.path:
                    sys.path.insert(0, os.getcwd())  # a module beside the user, as `python -m` finds it
                where = os.path.abspath(os.fspath(root)) if root is not None else None
                if where is not None and where not in sys.path:
                    sys.path.insert(0, where)  # a config's module names: beside the config first
                found = None if name in sys.modules else importlib.util.find_spec(name)
                if found is not None and found.origin and _imported(os.path.abspath(found.origin)):
                    continue  # the same file, imported before by its path
                if found is not None and found.origin is None and found.submodule_search_locations is not None:
                    where_ = ", ".join(found.submodule_search_locations)
                    raise ConfigError(f"{prefix} a folder without __init__.py ({where_}): importing it runs no code "
                                      f"and registers nothing; name a .py file or a module")
                fresh = name not in sys.modules
                module = importlib.import_module(name)
                if fresh:
                    _record(name, module)
        except MergeQPError as exc:  # a registration refused: name the module that made it
            msg = str(exc) if str(exc).startswith(prefix) else f"{prefix} {exc}"
            if "is already registered" in msg:
                msg += " (by mergeqp itself or by a module imported before this one)"
            raise ConfigError(msg) from None
        except Exception as exc:  # noqa: BLE001 - the user's module: name it and where, one line
            # (where it raised, since stop 74; MERGEQP_TRACEBACK=1 prints the traceback)
            raise ConfigError(f"{prefix} {failure_text(exc)}") from exc


def _imported(path: str) -> bool:
    """Whether a loaded module was read from the file ``path``."""
    return any(getattr(m, "__file__", None) and os.path.abspath(m.__file__) == path
               for m in list(sys.modules.values()))


__all__ = ["IMPORT_ENV", "import_plugins", "imported_modules"]
