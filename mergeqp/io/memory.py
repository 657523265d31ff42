"""The memory model: how many bytes a merge site's statistics and solve will need, how many the
machine (or the user's ``max_memory``) allows, and a refusal before the work allocates more.

:func:`available_memory_bytes` reads ``MemAvailable`` from ``/proc/meminfo`` (Linux: the memory
the kernel can hand out without swapping, page cache included); elsewhere, or when the file
cannot be read, it returns ``None`` and the machine's side of the check is skipped.

A site (or a group of sites solved as one QP) with ``n = K x atoms`` coefficients and
``n_tasks`` tasks needs (:func:`estimate_site_memory`, every count in bytes):

- ``statistics``: the float64 sums kept for the whole run, ``8 n_tasks (n^2 + n + 1)``
  (``H_t``, ``g_t``, ``c_t``);
- ``batch``: one calibration batch's float64 design ``A`` (``samples x outputs x n``, with the
  derivatives in the model's dtype and :data:`DESIGN_COPIES_FLOAT64` float64 copies), the
  :data:`GRAM_SQUARE_COPIES` ``n x n`` temporaries of the Hessian update, the atoms' tangents at
  the site in forward mode (:data:`TANGENT_COPIES` x ``n x tokens x r``), or in reverse mode the
  per-sample Jacobian of a site (:data:`JACOBIAN_COPIES` x ``outputs x tokens x r``: ``outputs``
  VJPs, no tangents; or one VJP chunk, :data:`VJP_ACTIVATION_COPIES` x ``chunk x tokens x widest
  layer``, whichever is larger: they are not alive together), and with the tangents one
  vectorised JVP chunk (:data:`ACTIVATION_COPIES` x ``chunk x tokens x widest layer``); sites
  are differentiated one at a time (the larger of the two modes' parts); freed after each batch;
- ``solve``: the :data:`SOLVE_SQUARE_COPIES` ``n x n`` float64 matrices alive while the QP is
  built and solved (weighted ``H``, its symmetrised copy, the solver's factorisation).

Peak = ``statistics + max(batch, solve)`` (the two temporaries are never alive together). The
constants are counted from the code and checked against measured peaks by
``benchmarks/memory_model.py`` (see ``docs/scaling.md``). Activations of the model itself are
not counted: they scale with the model, not with the site, and are already allocated when the
first batch runs.

:func:`memory_limit` sets the user's cap (``--max-memory`` / ``max_memory:``) for the work inside
it; :func:`check_site_memory` refuses a site whose peak exceeds the cap or the available memory,
naming the site and what to change.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import ValidationError

MEMINFO = "/proc/meminfo"

#: bytes per entry of one batch's design while it is built: the derivatives in the model's dtype,
#: their float64 copy, the per-site permuted blocks and the concatenated ``A`` (float64 each)
DESIGN_COPIES_FLOAT64 = 3
#: ``n x n`` float64 temporaries of one Hessian update ``H_t += 2.0 * (A'A)``: ``A'A`` and its double
GRAM_SQUARE_COPIES = 2
#: copies of the atoms' tangents at the site (``n x samples x positions x r`` in the model's
#: dtype): each model's block and their concatenation
TANGENT_COPIES = 2
#: copies of one site's per-sample Jacobian in reverse mode (``outputs x samples x positions x r``
#: in the model's dtype): the stacked VJPs and their sample-major contiguous copy
JACOBIAN_COPIES = 2
#: tensors of the widest layer alive at once in one vectorised JVP chunk (primal and tangent of
#: the layer's output, its activation and the product that feeds the next layer)
ACTIVATION_COPIES = 6
#: tensors of the widest layer alive at once in one vectorised VJP chunk (the cotangent entering
#: the layer and the one leaving it; measured: ``benchmarks/memory_model.py --jacobian-mode reverse``)
VJP_ACTIVATION_COPIES = 2
#: ``n x n`` float64 matrices while the QP is built and solved: the task-weighted ``H``, the
#: symmetrised ``(H + H') / 2`` (its sum and its half), the problem's symmetry check and the
#: solver's factorisation (measured: ``benchmarks/memory_model.py --tokens 2 --batch 1``)
SOLVE_SQUARE_COPIES = 5

#: what to change when a site does not fit (the merge's config keys)
ADVICE = ("use fewer atoms (method.parametrisation: scalar, or a basis with a small rank), lower "
          "calibration.batch_size (the atoms' tangents grow with it) or method.chunk_size, compare fewer outputs (output.restrict: projection|topk with a small k, "
          "or output.sketch: s), or merge fewer layers per QP: select only the layers your fine-tunes changed "
          "(a pattern such as model.layers.*.self_attn.o_proj selects every block; the run leaves out those no "
          "fine-tune changed, the dry run, which reads no weights, counts them all), or a mode that solves one "
          "layer at a time (single, sequential)")

_LIMIT: contextvars.ContextVar[int | None] = contextvars.ContextVar("mergeqp_max_memory", default=None)


def human_bytes(n: float) -> str:
    """``512 B``, ``9.8 KiB``, ``1.2 GiB``: a size in binary units (plans and memory messages)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


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


@contextlib.contextmanager
def memory_limit(max_bytes: int | None) -> Iterator[None]:
    """Cap the memory of every site checked inside (``None``: only the machine's memory)."""
    if max_bytes is not None and max_bytes <= 0:
        raise ValidationError(f"max_memory must be positive, got {max_bytes} bytes")
    token = _LIMIT.set(max_bytes)
    try:
        yield
    finally:
        _LIMIT.reset(token)


def current_limit() -> int | None:
    """The cap set by the innermost :func:`memory_limit` (bytes), or ``None``."""
    return _LIMIT.get()


def design_bytes(samples: int, outputs: int, n: int, itemsize: int) -> int:
    """Bytes of one batch's design ``A`` (``samples x outputs x n``) with its float64 copies."""
    return int(samples) * int(outputs) * int(n) * (int(itemsize) + 8 * DESIGN_COPIES_FLOAT64)


@dataclass(frozen=True)
class SiteMemory:
    """Estimated bytes of one site's (or QP group's) statistics and solve; see the module
    docstring. ``n``: coefficients of its QP (``K x atoms``)."""

    site: str
    n: int
    statistics: int
    batch: int
    solve: int
    #: the part of ``batch`` that is derivatives (the atoms' tangents or the sites' Jacobians, and one
    #: JVP / VJP chunk's activations); 0 when not counted apart
    derivatives: int = 0

    @property
    def peak(self) -> int:
        """Bytes alive at once at the worst moment: the sums plus the larger temporary."""
        return self.statistics + max(self.batch, self.solve)

    def describe(self) -> str:
        parts = (f" (design and H's update {human_bytes(self.batch - self.derivatives)}, derivatives "
                 f"{human_bytes(self.derivatives)})" if self.derivatives else "")
        return (f"n = {self.n} coefficients: statistics {human_bytes(self.statistics)} + "
                f"max(batch {human_bytes(self.batch)}{parts}, solve {human_bytes(self.solve)})")


def estimate_site_memory(site: str, n: int, n_tasks: int, *, samples: int = 0, outputs: int = 0,
                         itemsize: int = 4, positions: int = 1, site_width: int = 0, chunk: int = 0,
                         widest: int = 0, tangent_atoms: int | None = None,
                         jacobian_width: int = 0) -> SiteMemory:
    """The memory model of one QP: ``n`` coefficients, ``n_tasks`` tasks, batches of ``samples``
    prompts with ``outputs`` compared outputs each, derivatives of ``itemsize`` bytes (the model's
    dtype). ``samples = 0`` leaves the batch out (unknown before the first batch). The batch also
    counts the derivatives at the site (``positions`` per prompt): in forward mode the tangents of
    ``tangent_atoms`` atoms (default all ``n``; ``site_width`` = the sites' widest output ``r``),
    in reverse mode the per-sample Jacobian of the widest reverse-mode site (``jacobian_width``
    its ``r``; 0: no site in reverse mode), and one JVP / VJP chunk of ``chunk`` tangents or
    cotangents through layers at most ``widest`` features wide (0 when unknown)."""
    n, n_tasks = int(n), int(n_tasks)
    forward = n if tangent_atoms is None else int(tangent_atoms)
    square = 8 * n * n
    batch = derivatives = 0
    if samples:
        tokens = int(samples) * int(positions)
        chunk_bytes = tokens * int(widest) * int(itemsize)  # one tangent's / cotangent's widest activation
        forward_part = (TANGENT_COPIES * forward * tokens * int(site_width) * int(itemsize)
                        + ACTIVATION_COPIES * min(int(chunk), forward) * chunk_bytes) if forward else 0
        # reverse: the VJP chunks' activations are freed before the Jacobian's copies are made
        reverse_part = max(JACOBIAN_COPIES * int(outputs) * tokens * int(jacobian_width) * int(itemsize),
                           VJP_ACTIVATION_COPIES * min(int(chunk), int(outputs)) * chunk_bytes) if jacobian_width else 0
        derivatives = max(forward_part, reverse_part)  # the sites' derivatives are taken one site at a time
        batch = design_bytes(samples, outputs, n, itemsize) + GRAM_SQUARE_COPIES * square + derivatives
    return SiteMemory(site=site, n=n, statistics=8 * n_tasks * (n * n + n + 1), batch=batch,
                      solve=SOLVE_SQUARE_COPIES * square, derivatives=derivatives)


def memory_budget(free: int | None, kind: str = "memory available") -> tuple[int | None, str]:
    """``(bytes, what)``: the smaller of the :func:`memory_limit` cap and ``free`` (the machine's
    available memory, e.g. :func:`available_memory_bytes`, or a GPU's free memory: ``kind`` says
    which, for the message); ``None`` when neither is known."""
    cap = current_limit()
    if cap is not None and (free is None or cap <= free):
        return cap, f"max_memory = {human_bytes(cap)}"
    if free is None:
        return None, "unknown"
    return free, f"the {human_bytes(free)} of {kind}"


def device_free_bytes(device: Any) -> tuple[int | None, str]:
    """``(bytes, kind)``: the free memory where tensors on ``device`` are allocated: a CUDA device's
    (``torch.cuda.mem_get_info``), else the machine's available memory (:func:`available_memory_bytes`)."""
    if str(device).startswith("cuda"):
        import torch  # deferred: only a CUDA device asks, and torch is then loaded

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free), f"GPU memory free on {device}"
    return available_memory_bytes(), "memory available"


#: what to change when ``mergeqp collect``'s statistics do not fit (its own options)
COLLECT_ADVICE = ("use fewer atoms (--parametrisation scalar, or a basis with a small rank), a smaller "
                  "--batch-size (the atoms' tangents grow with it), or compare fewer outputs (an --output-fn that "
                  "reduces the model's output); from Python, collect_statistics's arguments of the same names")


def check_site_memory(estimate: SiteMemory, available: int | None = None, advice: str = ADVICE) -> None:
    """Refuse (:class:`ValidationError`, before anything is allocated) a site whose estimated
    peak exceeds :func:`memory_budget`; the message names the site, the parts and what to change
    (``advice``: a merge config's keys by default, :data:`COLLECT_ADVICE` for ``mergeqp collect``)."""
    budget, what = memory_budget(available_memory_bytes() if available is None else available)
    if budget is None or estimate.peak <= budget:
        return
    raise ValidationError(
        f"merge site {estimate.site}: the statistics and solve need about {human_bytes(estimate.peak)} "
        f"({estimate.describe()}), more than {what}; {advice}; or raise max_memory (--max-memory) if "
        f"the machine has more")


__all__ = ["ACTIVATION_COPIES", "ADVICE", "COLLECT_ADVICE", "DESIGN_COPIES_FLOAT64", "JACOBIAN_COPIES", "TANGENT_COPIES", "VJP_ACTIVATION_COPIES", "GRAM_SQUARE_COPIES", "SOLVE_SQUARE_COPIES", "SiteMemory",
           "available_memory_bytes", "check_site_memory", "current_limit", "design_bytes", "estimate_site_memory",
           "memory_budget", "memory_limit"]
