"""The package surface: every public name resolves, and importing mergeqp stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest

import mergeqp
from mergeqp.cli import SUBCOMMANDS, build_parser


@pytest.mark.parametrize("name", mergeqp.__all__)
def test_every_public_name_resolves(name: str) -> None:
    assert getattr(mergeqp, name) is not None


def test_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        mergeqp.no_such_name  # noqa: B018


def test_import_does_not_pull_torch_or_cvxpy() -> None:
    code = "import sys, mergeqp; print('torch' in sys.modules, 'cvxpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_every_subcommand_is_registered() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(SUBCOMMANDS) <= set(sub.choices)


def test_broken_pipe_exits_quietly() -> None:
    # `mergeqp bench | head -1`: the reader closes the pipe early; no traceback may reach stderr
    proc = subprocess.run(
        f"{sys.executable} -m mergeqp bench --problems tiny96 --solvers active_set | head -c 10",
        shell=True, capture_output=True, text=True,
    )
    assert "Traceback" not in proc.stderr
