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


_SOLVE_PROBE = """
import sys
import numpy as np
import mergeqp as mq
rng = np.random.default_rng(0)
B = rng.standard_normal((1536, 40))
problem = mq.MergeQP(B @ B.T + np.eye(1536), rng.standard_normal(1536), shape=(2, 768))
for cset in ("box:0,1", "box:0,1 & sign"):
    spec = mq.parse_constraints(["box:0,1"]) if cset == "box:0,1" else None
    if spec is None:
        deltas = rng.standard_normal((2, 768, 3))
        spec = mq.Box(0, 1) & mq.SignConsensus.from_deltas(deltas, "rows")
    sol = mq.solve(problem, spec, solver="auto")
    assert sol.certificate.certified(), cset
print("LOADED", *[m for m in {heavy!r} if m in sys.modules])
"""


def test_auto_on_a_cpu_problem_loads_no_heavy_dependency() -> None:
    """(stop 67) ``auto`` at n = 1536, from which its GPU solvers are taken once CUDA is started,
    asked torch whether it was: the import (1.6 s) was 5x the solve of a box there. A process that
    has not imported torch has not started CUDA."""
    out = subprocess.run([sys.executable, "-c", _SOLVE_PROBE.format(heavy=HEAVY)],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "LOADED"
