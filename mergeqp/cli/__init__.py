"""The ``mergeqp`` command line: one module per subcommand, registered explicitly below."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from ..errors import MergeQPError

# subcommand -> module exposing ``register(subparsers)`` (which sets ``func`` on its parser)
SUBCOMMANDS: dict[str, str] = {
    "solve": "mergeqp.cli.solve",
    "certify": "mergeqp.cli.solve",
    "bench": "mergeqp.cli.bench",
    "collect": "mergeqp.cli.collect",
    "experiment": "mergeqp.cli.experiment",
    "merge": "mergeqp.cli.merge",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mergeqp",
        description="Merge fine-tuned checkpoints by convex optimisation, with certificates.",
    )
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except MergeQPError as exc:
        print(f"mergeqp {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # output piped into a program that stopped reading (e.g. `mergeqp bench | head`):
        # silence the second error Python would print at exit and exit like other tools do
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        except OSError:
            pass
        return 141


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
