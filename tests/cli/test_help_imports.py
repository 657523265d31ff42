"""``mergeqp --help`` and every subcommand's ``--help`` load no heavy optional dependency
(torch, cvxpy, transformers, mergekit): the CLI defers them until a command runs."""

from __future__ import annotations

import subprocess
import sys

from mergeqp.cli import SUBCOMMANDS

HEAVY = ("torch", "cvxpy", "transformers", "mergekit")

_PROBE = """
import sys
from mergeqp.cli import main
argv = sys.argv[1:]
try:
    main(argv)
except SystemExit:
    pass
print("LOADED", *[m for m in {heavy!r} if m in sys.modules])
"""


def test_help_loads_no_heavy_dependency() -> None:
    for argv in (["--help"], *([name, "--help"] for name in SUBCOMMANDS)):
        out = subprocess.run([sys.executable, "-c", _PROBE.format(heavy=HEAVY), *argv],
                             capture_output=True, text=True, check=True)
        last = out.stdout.strip().splitlines()[-1]
        assert last == "LOADED", (argv, last)
