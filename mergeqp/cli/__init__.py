"""The ``mergeqp`` command line: one module per subcommand, registered explicitly below.

:func:`main` maps what stopped a command to its exit code (:data:`mergeqp.errors.EXIT_CODES`,
printed in every ``--help``): 0 success, 1 solved but not certified, 2 usage or configuration
error, 3 bad input data (NaN / inf), 4 I/O error while writing, 5 (under torchrun) another process
of the job stopped, 130 interrupted (Ctrl-C or SIGTERM). Errors are one line ``mergeqp COMMAND: error: ...`` on stderr, never a traceback.

Import policy: the subcommand modules import the package's numerical and model layers inside
their ``run`` functions, so that ``mergeqp --help`` and argument errors answer without loading
torch, cvxpy or transformers. This is the one layer where the package defers its own imports
(``tests/architecture/test_imports.py`` allows it here and nowhere else).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Sequence

from ..errors import (
    EXIT_INTERRUPTED,
    EXIT_IO,
    EXIT_UNEXPECTED,
    EXIT_USAGE,
    ConfigError,
    Interrupted,
    MergeQPError,
    exit_code,
    interruption,
    exit_code_epilog,
    raised_at,
)
from ..plugins import IMPORT_ENV, import_plugins
from .signals import signals_held_during_native_imports, sigterm_as_interrupt

# subcommand -> module exposing ``register(subparsers)`` (which sets ``func`` on its parser)
SUBCOMMANDS: dict[str, str] = {
    "solve": "mergeqp.cli.solve",
    "certify": "mergeqp.cli.solve",
    "bench": "mergeqp.cli.bench",
    "collect": "mergeqp.cli.collect",
    "experiment": "mergeqp.cli.experiment",
    "merge": "mergeqp.cli.merge",
    "sweep": "mergeqp.cli.sweep",
    "list": "mergeqp.cli.names",
}
#: subcommands that keep the C allocator's own policy for freed memory; every other one keeps freed
#: memory in the process (:func:`mergeqp.io.allocator.keep_freed_memory`: large tensors are
#: reused instead of mapped afresh; ``MERGEQP_ALLOCATOR=system`` turns it off)
SYSTEM_ALLOCATOR = frozenset({"bench"})
#: subcommands that share their work over the processes of a ``torchrun`` launch (the others run
#: in one process and are refused under torchrun: each rank ran the whole command and wrote the same
#: outputs at once)
DISTRIBUTED = frozenset({"collect", "merge"})



def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mergeqp",
        description="Merge fine-tuned checkpoints by convex optimisation, with certificates.",
    )
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="import MODULE (a dotted module name, or a .py file) before the command: your own "
                             "constraint sets, solvers, parametrisations, bases, merge methods and modes, output metrics "
                             "and architectures registered there (mergeqp.register_*; see mergeqp list) are then "
                             "valid names for it; repeatable, before the "
                             f"command; also ${IMPORT_ENV}=MODULE[,MODULE...]")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    done: set[str] = set()
    for module_name in SUBCOMMANDS.values():
        if module_name in done:
            continue
        done.add(module_name)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # subcommand not built yet
            raise
        module.register(sub)
    _add_exit_codes(parser)
    return parser


def _add_exit_codes(parser: argparse.ArgumentParser) -> None:
    """Put the exit-code table in the ``--help`` of ``parser`` and of every subcommand (nested)."""
    epilog = exit_code_epilog()
    parser.epilog = epilog
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    for action in parser._actions:  # noqa: SLF001 - argparse offers no public walk over subparsers
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for child in dict.fromkeys(action.choices.values()):
                _add_exit_codes(child)


def _interrupted(command: str, stop: BaseException) -> int:
    """Say that ``command`` was stopped by a signal, and what it had already put in place; the
    exit code for it."""
    from ..io.atomic import committed_outputs

    if _other_rank():  # under torchrun every rank is stopped: rank 0 says it once
        return EXIT_INTERRUPTED
    how = str(stop) if isinstance(stop, Interrupted) else "interrupted (Ctrl-C)"
    done = committed_outputs()
    if done:
        shown = ", ".join(done[:3]) + (f" and {len(done) - 3} more" if len(done) > 3 else "")
        print(f"mergeqp {command}: {how} after writing {shown} (complete, new); every other output keeps its "
              f"previous state", file=sys.stderr)
    else:
        print(f"mergeqp {command}: {how}; outputs keep their previous state", file=sys.stderr)
    return EXIT_INTERRUPTED


def _other_rank() -> bool:
    """A rank other than 0 of a ``torchrun`` launch (it prints no error: rank 0 does, once)."""
    from ..io.distributed import other_rank  # (deferred: ``mergeqp --help`` imports no more than it needs)

    return other_rank()


def _traceback_on_request(exc: BaseException | None) -> None:
    """With ``MERGEQP_TRACEBACK=1``, ``exc``'s traceback on stderr (the one line and the command's exit code
    follow: re-raised, the interpreter's exit code 1 read as "solved, not certified", a review of stop 74)."""
    if exc is not None and os.environ.get("MERGEQP_TRACEBACK"):
        import traceback

        traceback.print_exception(exc, file=sys.stderr)


def _failed(command: str, exc: MergeQPError) -> int:
    """Report the error that stopped ``command``: rank 0 prints it (under torchrun the ranks mostly
    meet the same error, or a copy of one rank's); a process's own error also goes to torchrun's
    error file, so that one met by a rank other than 0 alone is in torchrun's report."""
    from ..io.distributed import own_error, record_for_launcher  # (deferred, as _other_rank)

    _traceback_on_request(exc.__cause__)  # a user's code's error, wrapped
    message = f"mergeqp {command}: error: {exc}"
    if own_error(exc):
        record_for_launcher(message)
    if not _other_rank():
        print(message, file=sys.stderr)
    return exit_code(exc)


def _refuse_launch(command: str) -> MergeQPError | None:
    """The error for a command that does not share its work, run under ``torchrun``."""
    from ..io.distributed import launch_requested  # (deferred, as _other_rank)

    try:
        world = launch_requested()
    except MergeQPError as exc:
        return exc
    if world > 1 and command not in DISTRIBUTED:
        return ConfigError(f"{command} runs in one process (under torchrun every process would run all of it and "
                           f"write the same outputs); only {' and '.join(sorted(DISTRIBUTED))} share their work "
                           f"over torchrun's processes: run `mergeqp {command} ...` without torchrun")
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # (no choice of any command depends on what a user registers)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as typed: reports name the command that made them
    try:  # $MERGEQP_IMPORT, then every --import: before the command runs
        import_plugins([m.strip() for m in os.environ.get(IMPORT_ENV, "").split(",") if m.strip()]
                       + [m for m in args.imports if m])
    except MergeQPError as exc:
        if not _other_rank():
            _traceback_on_request(exc.__cause__)  # the module's own error
            print(f"mergeqp: error: {exc}", file=sys.stderr)
        return exit_code(exc)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    refused = _refuse_launch(args.command)
    if refused is not None:
        return _failed(args.command, refused)
    if args.command not in SYSTEM_ALLOCATOR:
        from ..io.allocator import keep_freed_memory

        try:
            keep_freed_memory()
        except MergeQPError as exc:  # a typo in $MERGEQP_ALLOCATOR
            return _failed(args.command, exc)
    from ..io.atomic import forget_committed

    forget_committed()
    try:
        with sigterm_as_interrupt(), signals_held_during_native_imports():
            return int(args.func(args) or 0)
    except (KeyboardInterrupt, Interrupted) as exc:
        return _interrupted(args.command, exc)
    except MergeQPError as exc:
        stop = interruption(exc)
        if stop is not None:  # a signal that a library (or a solver wrapper) wrapped into an error
            return _interrupted(args.command, stop)
        return _failed(args.command, exc)
    except BrokenPipeError:
        # output piped into a program that stopped reading (e.g. `mergeqp bench | head`):
        # silence the second error Python would print at exit and exit like other tools do
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        except OSError:
            pass
        return 141
    except OSError as exc:  # a write outside the atomic helpers; they name the path themselves
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"mergeqp {args.command}: error: I/O error{where}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_IO
    except RuntimeError as exc:
        if not str(exc).startswith("Symlink loop"):
            return _unexpected(args.command, exc)
        # (pathlib's resolve() of a path whose links form a loop, a QA review, stop 73)
        print(f"mergeqp {args.command}: error: {str(exc).replace('Symlink loop', 'a loop of symbolic links')}",
              file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 - the last resort: one line, never a traceback
        return _unexpected(args.command, exc)


def _unexpected(command: str, exc: BaseException) -> int:
    """An exception no check anticipated (a bug, or a user's plugin that raised): one line naming it and
    the innermost place it was raised (the user's own file when the traceback passes through one), exit
    :data:`~mergeqp.errors.EXIT_UNEXPECTED`; ``MERGEQP_TRACEBACK=1`` prints its traceback first. Before
    stop 73 such errors (a user's basis builder or domain loader that raised, a config.json holding a
    list) printed Python's traceback and exited 1, which the exit codes say is "solved, not certified"."""
    _traceback_on_request(exc)
    place, own = raised_at(exc)
    whose = "in a module of yours" if own else "a bug in mergeqp, please report it"
    first = (str(exc).strip().splitlines() or [""])[0]
    message = (f"mergeqp {command}: error: unexpected {type(exc).__name__}{place} ({whose}): {first}; "
               f"MERGEQP_TRACEBACK=1 prints the traceback")
    if not _other_rank():
        print(message, file=sys.stderr)
    return EXIT_UNEXPECTED


def entry() -> None:
    """The ``mergeqp`` program: :func:`main`, then its exit code. Once the command has returned,
    a late SIGINT / SIGTERM (during the interpreter's exit) is ignored, so that the exit code
    says what the command did instead of the process dying by the signal."""
    code = main()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    entry()
