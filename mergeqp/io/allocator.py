"""The C allocator's policy for freed memory: keep it in the process instead of returning it.

glibc's ``malloc`` serves every allocation above its mmap threshold (at most 32 MB) with a fresh
``mmap`` and gives it back with ``munmap`` when freed. A language-model merge allocates and frees
tensors of that size many times per batch (logits of ``tokens x vocabulary``, the statistics'
designs, the evaluation's per-token values), and every fresh mapping is zero-filled by the kernel
page by page on first touch: measured on the LM experiment (``docs/lm.md``), 27 million minor
page faults and 119 s of system time in a 285 s run. :func:`keep_freed_memory` turns the mapping
off (``M_MMAP_MAX = 0``: large blocks come from the heap, which is reused) and raises the trim
threshold (freed memory at the heap's top stays until 2 GiB of it is free). The same run then
took 203 s (21 s of system time, 1 million page faults) and its peak resident memory rose 15%
(7.5 -> 8.6 GB): freed memory is reused by the process instead of being returned to the system.
The results are the same bit for bit (only where memory comes from changes).

``mergeqp`` commands call it at start (not ``bench``, whose memory figures are taken with the
system's policy); ``MERGEQP_ALLOCATOR=system`` in the environment keeps the system's policy. From
Python, call it before a long merge or experiment (a library does not change its caller's process
by itself). It changes nothing on a system whose C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

from ..errors import ValidationError, did_you_mean

#: ``mallopt`` parameters (glibc ``malloc.h``)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
#: freed memory at the top of the heap is returned once this much of it is free (``mallopt``
#: takes a C ``int``)
TRIM_THRESHOLD = 2**31 - 1
#: environment variable: ``system`` keeps the C library's own policy
ENV = "MERGEQP_ALLOCATOR"
#: its values: unset (or empty) and ``keep`` keep freed memory; ``system`` keeps the C library's policy
POLICIES = ("", "keep", "system")


def keep_freed_memory() -> bool:
    """Keep freed memory in this process (see the module doc). ``True`` when the policy is now in
    force; ``False`` when ``MERGEQP_ALLOCATOR=system`` is set or the C library is not glibc.
    Takes effect for allocations made after the call. Another value of the variable (a typo of
    ``system``) is a :class:`~mergeqp.errors.ValidationError`: it was taken as the default."""
    policy = os.environ.get(ENV, "").strip().lower()
    if policy not in POLICIES:
        raise ValidationError(f"{ENV}={os.environ.get(ENV)!r}: valid values are {', '.join(POLICIES[1:])} "
                              f"(or unset){did_you_mean(policy, POLICIES[1:])}")
    if policy == "system" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl has neither the symbol nor these knobs
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
