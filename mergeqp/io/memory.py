"""How much memory the machine can still give this process, for checks that refuse work before
it allocates more than there is (instead of being killed by the kernel's out-of-memory killer).

:func:`available_memory_bytes` reads ``MemAvailable`` from ``/proc/meminfo`` (Linux: the memory
the kernel can hand out without swapping, page cache included); elsewhere, or when the file
cannot be read, it returns ``None`` and callers skip their check.
"""

from __future__ import annotations

MEMINFO = "/proc/meminfo"


def available_memory_bytes(meminfo: str = MEMINFO) -> int | None:
    """Bytes of memory available to new allocations on this machine, or ``None`` if unknown."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    parts = line.split()
                    return int(parts[1]) * 1024 if len(parts) >= 2 and parts[1].isdigit() else None
    except OSError:
        return None
    return None


__all__ = ["available_memory_bytes"]
