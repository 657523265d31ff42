"""``mergeqp --help`` and every subcommand's ``--help`` load no heavy optional dependency
(torch, cvxpy, transformers, mergekit): the CLI defers them until a command runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

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


@pytest.mark.filterwarnings("ignore:Cannot enable progress bars")
def test_quiet_experiments_silence_transformers_bars():
    """(stop 46 review) ``experiment mnist --quiet`` still printed transformers' "Loading weights"
    bars: --quiet now turns them off, as ``merge --quiet`` did."""
    import argparse

    hf_logging = pytest.importorskip("transformers.utils.logging")
    from mergeqp.cli.experiment import _quiet

    try:
        hf_logging.enable_progress_bar()
        _quiet(argparse.Namespace(quiet=False))
        assert hf_logging.is_progress_bar_enabled()
        _quiet(argparse.Namespace(quiet=True))
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()
