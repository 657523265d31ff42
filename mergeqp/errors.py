"""Exceptions raised by mergeqp.

Every error a user can trigger with bad input is one of these, and its message names the
offending field, tensor, layer or setting. Nothing from a third-party solver escapes raw:
solver wrappers catch and re-raise as :class:`SolverError` with the solver's name.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import numbers
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


class MergeQPError(Exception):
    """Base class of every mergeqp error."""


class ValidationError(MergeQPError, ValueError):
    """Input data has the wrong shape, contains NaN/inf, or is otherwise malformed."""


class NotConvexError(ValidationError):
    """The Hessian of a problem is not positive semidefinite (within tolerance)."""


class InfeasibleError(MergeQPError):
    """A constraint set (or an intersection of several) contains no point."""


#: registries a user adds to (the kinds named by their lookups): an unknown name there may be an entry
#: whose module was not imported
USER_REGISTRIES = frozenset({"solver", "constraint set", "merge method", "merge mode", "parametrisation",
                             "basis name", "instance family", "output metric"})

#: what an unknown name of :data:`USER_REGISTRIES` adds when no registered name is close
OWN_ENTRY_HINT = ("an entry of your own is registered by importing its module first (command line: "
                  "mergeqp --import FILE.py or $MERGEQP_IMPORT; a merge config: imports: [FILE.py])")


def _plural(kind: str) -> str:
    """``"solvers"``, ``"families"``; a trailing parenthesis stays last (``"basis names (--option)"``)."""
    head, sep, tail = kind.partition(" (")
    if sep and kind.endswith(")"):
        return f"{_plural(head)} ({tail}"
    return kind[:-1] + "ies" if kind.endswith("y") and kind[-2:-1] not in "aeiou" else kind + "s"


def did_you_mean(name: object, valid: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the valid name closest to ``name``, or ``""`` (one rule for every
    message that names an unknown key, parameter or registry entry)."""
    close = difflib.get_close_matches(str(name), list(valid), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


class UnknownNameError(MergeQPError, KeyError):
    """A registry lookup (solver, constraint set, merge method, basis, ...) failed."""

    def __init__(self, kind: str, name: str, valid: Iterable[str]):
        self.kind = kind
        self.name = name
        self.valid = sorted(valid)
        hint = did_you_mean(name, self.valid)
        own = f"; {OWN_ENTRY_HINT}" if kind in USER_REGISTRIES and not hint else ""
        super().__init__(f"unknown {kind} {name!r}; valid {_plural(kind)}: {', '.join(self.valid)}{hint}{own}")

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return self.args[0]


class SolverError(MergeQPError):
    """A solver failed (numerical trouble, not installed, unsupported constraint set)."""


class UnsupportedError(SolverError):
    """The chosen solver cannot handle this problem / constraint combination."""


class UnboundedError(SolverError):
    """``J`` is unbounded below on the constraint set (a solver proved it: a dual
    infeasibility certificate or a recession direction along which ``J`` falls)."""


class ConfigError(MergeQPError, ValueError):
    """A configuration file or command-line setting is invalid."""


class MergeMethodError(MergeQPError):
    """A merge method or merge mode (a user's registered one, most often) raised or returned
    something unusable; the message names it (exit code 2)."""


class BadDataError(ValidationError):
    """The input files were read, but their numbers are unusable: NaN or inf in a checkpoint
    tensor, in calibration statistics or in a problem's arrays, or a merge that would write
    non-finite weights. The message names the tensor (or array) and the model (or file)."""


class OutputError(MergeQPError, OSError):
    """Writing an output failed (disk full, permission denied, read-only file system, ...).
    Outputs are written atomically, so the previous state of the path is left as it was."""


class Interrupted(MergeQPError):
    """The run was stopped by SIGINT (Ctrl-C) or SIGTERM; no output was left half-written."""


#: exit codes of the ``mergeqp`` command line (README, ``docs/reliability.md``, every ``--help``)
EXIT_OK = 0
EXIT_NOT_CERTIFIED = 1
EXIT_USAGE = 2
EXIT_BAD_DATA = 3
EXIT_IO = 4
EXIT_OTHER_PROCESS = 5
#: an exception no check anticipated (sysexits' EX_SOFTWARE): a bug, or a plugin of the user's
EXIT_UNEXPECTED = 70
EXIT_INTERRUPTED = 130

EXIT_CODES: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "success (solved and certified; the output was written)"),
    (EXIT_NOT_CERTIFIED, "solved (and written), but the answer is not certified"),
    (EXIT_USAGE, "usage or configuration error: a bad argument or config value, an unknown name, "
                 "a missing or malformed input file, an output that would overwrite an input; also a module of "
                 "yours (`--import`, `imports:`) that fails to load, or an entry of yours (a solver, merge method, "
                 "mode, metric, ...) that raises: one line names the exception and where in your file it was raised; "
                 "so is a solver, built-in or yours, that fails on the problem (`auto` first tries another)"),
    (EXIT_BAD_DATA, "bad input data: NaN or inf in a checkpoint, statistics or problem file, or a "
                    "merge that would produce non-finite weights"),
    (EXIT_IO, "I/O error while writing (disk full, no permission, read-only file system); the "
              "previous state of the output is kept. An output found unwritable before any work (a "
              "read-only folder, a file output's missing folder, a mount point) is refused with 2 instead; "
              "a folder output (`merge`, `experiment`, `sweep --out`) creates its missing parent folders"),
    (EXIT_OTHER_PROCESS, "under torchrun: another process of the job stopped (failed, killed or interrupted) "
                         "and this one could not go on; torchrun's report names that process and its message"),
    (EXIT_UNEXPECTED, "an unexpected error (a bug in mergeqp, or in your code where it is not called as one of "
                      "your entries): one line "
                      "names the exception and where it was raised (MERGEQP_TRACEBACK=1 prints the traceback); "
                      "outputs not yet written keep their previous state"),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C or SIGTERM); outputs not yet written keep their previous state"),
)


class OtherRankFailed(MergeQPError):
    """Raised on the ranks of a ``torchrun`` launch whose own work succeeded while another rank's
    failed at the same step (that rank prints the message): they exit with its code, silently
    (:func:`mergeqp.io.distributed.agree_on`)."""

    def __init__(self, code: int) -> None:
        super().__init__(f"another rank failed (exit code {code}); its message says why")
        self.code = int(code)


class OtherProcessLost(MergeQPError):
    """Raised under ``torchrun`` when a collective fails because another process of the job is gone
    (it failed on its own, was killed or interrupted): this process cannot go on alone. Exit code
    :data:`EXIT_OTHER_PROCESS`; the process that stopped first says why (torchrun's report)."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"another process of this torchrun job stopped (it failed, was killed or interrupted: "
                         f"torchrun's report names it and its message), and this one cannot go on alone "
                         f"({detail})")


def interruption(exc: BaseException) -> BaseException | None:
    """The Ctrl-C or SIGTERM behind ``exc``, if there is one in its chain of causes.

    A signal that arrives while a library runs (a module being imported, a class being created)
    can reach us wrapped: Python reports an exception raised in ``__set_name__`` as a
    ``RuntimeError`` whose cause is the interrupt, and a solver wrapper turns that into a
    :class:`SolverError`. The run was still interrupted, not failed."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, (KeyboardInterrupt, Interrupted)):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def exit_code(exc: BaseException) -> int:
    """The command-line exit code for an exception that stopped a command (see :data:`EXIT_CODES`)."""
    if isinstance(exc, OtherRankFailed):
        return exc.code
    if isinstance(exc, OtherProcessLost):
        return EXIT_OTHER_PROCESS
    if interruption(exc) is not None:
        return EXIT_INTERRUPTED
    if isinstance(exc, BadDataError):
        return EXIT_BAD_DATA
    if isinstance(exc, OutputError) or (isinstance(exc, OSError) and not isinstance(exc, MergeQPError)):
        return EXIT_IO
    if isinstance(exc, MergeQPError):
        return EXIT_USAGE
    raise TypeError(f"no exit code for {type(exc).__name__}")


def exit_code_epilog() -> str:
    """The exit-code table as ``--help`` epilog text."""
    return "exit codes:\n" + "\n".join(f"  {code:<4d} {what}" for code, what in EXIT_CODES)


def unknown(kind: str, name: str, valid: Iterable[str]) -> UnknownNameError:
    """Build the standard "unknown X; valid Xs: ..." error."""
    return UnknownNameError(kind, name, valid)


def lookup(kind: str, name: object, registry: Mapping[str, T]) -> T:
    """``registry[name]``, or the standard :func:`unknown` error listing the registered names
    (also for a name that is not a string)."""
    try:
        return registry[name]  # type: ignore[index]
    except (KeyError, TypeError):
        raise unknown(kind, str(name), registry) from None


def check_new_name(kind: str, name: object, taken: Container[str], *, forbidden: str = ":",
                   error: type[MergeQPError] = ValidationError) -> str:
    """``name`` when it can be registered as a new ``kind``: a non-empty string without spaces
    or any of the ``forbidden`` characters (the separators of the spellings that name it, such as
    ``box:0,1``), not already in ``taken``; else ``error`` saying which rule it breaks."""
    if not isinstance(name, str) or not name:
        raise error(f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind} name must be a non-empty string, got {name!r}")
    if any(ch in forbidden or ch.isspace() for ch in name):
        raise error(f"{kind} name {name!r} must be non-empty without "
                    f"{', '.join(repr(ch) for ch in forbidden)} or spaces")
    if name in taken:
        raise error(f"{kind} {name!r} is already registered")
    return name


def check_integer(what: str, value: object, minimum: int = 1) -> None:
    """:class:`ValidationError` unless ``value`` is an integer (numpy's too, not a bool) ``>= minimum``;
    ``what`` names it in the message."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValidationError(f"{what} must be an integer >= {minimum}, got {value!r}")


def unit_grid(what: str, values: object) -> tuple[float, ...]:
    """``values`` (one or more numbers in [0, 1], not bools) as a tuple of floats; else a
    :class:`ValidationError` naming ``what`` (e.g. ``regmean_alphas``)."""
    if (isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)) or not values
            or any(isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 <= v <= 1 for v in values)):
        raise ValidationError(f"{what} must be one or more numbers in [0, 1], got {values!r}")
    return tuple(float(v) for v in values)


def check_callable(kind: str, name: str, what: str, value: object,
                   error: type[MergeQPError] = ValidationError) -> None:
    """``error`` unless ``value`` (the ``what`` of a ``kind`` being registered) is callable."""
    if not callable(value):
        raise error(f"{kind} {name!r}: {what} must be callable, got {type(value).__name__}")


def first_line(exc: BaseException | str, limit: int = 300) -> str:
    """The first line of ``exc``'s message (an exception or the text itself), and the lines after it
    where it ends with ``:`` (what it introduces: "Couldn't instantiate the backend tokenizer from one
    of:" said nothing alone), as one line of at most ``limit`` characters, cut at a space with ``...``
    (for one-line errors that name a user's code and what it raised; a cut mid-word read "Check the logs
    of the re)", a QA review, stop 76)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    joined = lines and lines[0].endswith(":") and not any(line.startswith("Traceback (most recent") for line in lines)
    text = (" ".join(lines) if joined else lines[0]) if lines else ""  # (a traceback stays out: a review of the fix)
    if len(text) <= limit:
        return text
    if limit < 8:
        return text[:limit]
    cut = text[: max(1, limit - 4)]
    space = cut.rfind(" ")
    return (cut[:space] if space > limit // 2 else cut).rstrip(" ,;:") + " ..."


def raised_at(exc: BaseException) -> tuple[str, bool]:
    """Where ``exc`` was raised: ``(" at FILE:LINE", own)`` of the innermost frame of its traceback
    outside mergeqp and installed packages (the user's own file, ``own`` true), else of its innermost
    frame (``own`` false); ``("", False)`` without a traceback."""
    import os
    import sysconfig
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    # mergeqp's own folder, the standard library and installed packages are not the user's (a review of
    # stop 74: a factory's json.loads was blamed on json/decoder.py, and mergeqp_plugins/ on mergeqp)
    theirs = tuple(os.path.join(os.path.realpath(p), "") for p in
                   (os.path.dirname(os.path.abspath(__file__)), sysconfig.get_paths().get("stdlib", ""),
                    sysconfig.get_paths().get("platstdlib", "")) if p)

    def users(filename: str) -> bool:
        path = os.path.realpath(filename)
        return not (filename.startswith("<") or path.startswith(theirs)
                    or any(part in ("site-packages", "dist-packages") for part in path.split(os.sep)))

    own = [f for f in frames if users(f.filename)]
    where = own[-1] if own else (frames[-1] if frames else None)
    return ("" if where is None else f" at {where.filename}:{where.lineno}"), bool(own)


@contextlib.contextmanager
def named_failure(what: str, error: type[MergeQPError]) -> Iterator[None]:
    """Run a user's entry (a merge method's or mode's ``run``): an exception of ours, an I/O error
    (exit 4) or running out of memory passes as it is; any other becomes ``error`` in one line,
    ``"{what} failed: {Type}: {first line} (raised at FILE:LINE)"`` (the innermost place in the user's
    own file; exit 2, no traceback)."""
    try:
        yield
    except (MergeQPError, OSError, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - a user's code (or a bug): named, one line
        raise error(f"{what} failed: {failure_text(exc)}") from exc


def failure_text(exc: BaseException) -> str:
    """``"{Type}: {first line} (raised at FILE:LINE)"`` for a user's code (or a solver) that raised: the
    message's first line (:func:`first_line`; left out where empty) and :func:`raised_at`'s place (a
    ``SyntaxError``'s own file and line), the form of every such one-line error (the merge's entries,
    ``--import`` modules, solvers, ``collect``'s model factory)."""
    said = first_line(exc)
    if isinstance(exc, SyntaxError) and exc.filename:
        place = f" at {exc.filename}:{exc.lineno}"
    else:
        place, _ = raised_at(exc)
    return f"{type(exc).__name__}{': ' + said if said else ''}{f' (raised{place})' if place else ''}"


def check_signature(kind: str, name: str, what: str, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                    error: type[MergeQPError] = ValidationError) -> None:
    """``error`` unless ``fn`` (the ``what`` of a ``kind`` being registered) can be called with
    ``args`` / ``kwargs`` (checked on its signature, not called; a callable without an inspectable
    signature passes)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise error(f"{kind} {name!r}: {what} cannot be called as documented ({exc}); its signature is "
                    f"{sig}") from None


def listing(names: Sequence[str], limit: int = 30) -> str:
    """``"a, b, ... and N more"`` (at most ``limit`` names) for error messages; ``"(none)"``."""
    names = list(names)
    if not names:
        return "(none)"
    shown = ", ".join(str(n) for n in names[:limit])
    more = len(names) - limit
    return shown + (f", ... and {more} more" if more > 0 else "")


def parse_params(model: type[T], params: Mapping[str, object], where: str, owner: str) -> T:
    """``model(**params)`` for a pydantic ``model`` of a config block's ``params``, or a
    :class:`ConfigError`: an unknown key is named with a did-you-mean and the valid keys (``owner``
    says whose parameters they are, e.g. ``'output_space'``), a bad value with its key and input."""
    from pydantic import ValidationError as PydanticValidationError  # deferred: errors.py is imported first

    valid = list(model.model_fields)  # type: ignore[attr-defined]
    extra = [k for k in params if k not in valid]
    if extra:
        hint = did_you_mean(extra[0], valid)
        raise ConfigError(f"{where}.params: unknown parameter {extra[0]!r} of {owner}{hint}; valid: "
                          f"{', '.join(valid)}")
    try:
        return model(**params)
    except PydanticValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        if not loc:  # a check across parameters (a model validator): no single key to name
            raise ConfigError(f"{where}.params: {err['msg']}") from None
        raise ConfigError(f"{where}.params.{loc}: {err['msg']} (got {err.get('input')!r})") from None
