"""The allocator policy: freed large blocks are reused instead of mapped (and zero-filled) afresh."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from mergeqp.io import allocator

# 40 rounds of a 64 MB array written then freed; prints the minor page faults of those rounds
PROBE = textwrap.dedent("""
    import resource, sys
    import numpy as np
    from mergeqp.io.allocator import keep_freed_memory
    kept = keep_freed_memory()
    a = np.ones(8 * 2**20); del a  # first use: the heap grows once
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(40):
        a = np.ones(8 * 2**20)  # 64 MB, above glibc's largest mmap threshold
        del a
    print(int(kept), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _faults(policy: str) -> tuple[bool, int]:
    env = {**os.environ, allocator.ENV: policy}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    kept, faults = out.stdout.split()
    return kept == "1", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keep_freed_memory_reuses_large_blocks() -> None:
    kept, faults = _faults("keep")
    if not kept:
        pytest.skip("the C library is not glibc")
    system_kept, system_faults = _faults("system")
    assert not system_kept  # MERGEQP_ALLOCATOR=system keeps the C library's policy
    # system policy: every round maps 64 MB afresh (16,384 pages of 4 KiB, or 32 huge pages, 40
    # times); kept: the first block is reused, so a round touches no new page
    assert system_faults >= 40 * 32
    assert faults < system_faults / 20


def test_system_policy_is_respected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(allocator.ENV, "System")
    assert allocator.keep_freed_memory() is False


def test_cli_keeps_the_system_policy_for_bench() -> None:
    from mergeqp.cli import SUBCOMMANDS, SYSTEM_ALLOCATOR

    assert SYSTEM_ALLOCATOR <= set(SUBCOMMANDS) and "bench" in SYSTEM_ALLOCATOR


def test_a_typo_in_the_policy_is_named(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """(stop 50) ``MERGEQP_ALLOCATOR=sytem`` was taken as the default policy, silently."""
    from mergeqp.cli import main
    from mergeqp.errors import ValidationError

    monkeypatch.setenv(allocator.ENV, "sytem")
    with pytest.raises(ValidationError, match=r"MERGEQP_ALLOCATOR='sytem': valid values are keep, system .*"
                                              r"did you mean 'system'"):
        allocator.keep_freed_memory()
    assert main(["certify", "nothing.npz", "--point", "d.npy"]) == 2  # before the command reads anything
    assert "MERGEQP_ALLOCATOR='sytem'" in capsys.readouterr().err
