"""Runs over several processes with ``torch.distributed`` (``torchrun``): who this process is,
which calibration batches it handles, and the reductions that make its partial sums whole.

A command launched by ``torchrun`` (which sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``) enters :func:`launched`: the default process group is initialised (``gloo`` for
CPU devices, ``nccl`` for CUDA) with a group of mergeqp's own over the same ranks, on which every
collective below runs; both are torn down when the process exits. Anywhere inside,
:func:`current_group` answers a :class:`Ranks` -- for a plain single process ``Ranks(0, 1)``,
whose methods do nothing.

Why a group of its own: importing some torch modules after the default group exists
(``torch.distributed.nn``, which ``transformers``' model code imports) stores the default group as
a function default, so that destroying it at exit no longer frees it. Its gloo worker threads then
live into the interpreter's finalisation, and one still releasing the last tensor of a finished
collective there needs the GIL and aborts the process (``terminate called without an active
exception``, exit -6, after the outputs were written: seen about once in 30 launches). mergeqp's
own group is referenced by this module alone, so the teardown at exit (:func:`_destroy`) frees it,
which waits for its workers and joins them while the interpreter is whole; the default group, which
runs no collective of mergeqp's, has nothing left to release.

The statistics collectors use four things only:

- :meth:`Ranks.owns` / :meth:`Ranks.shard`: batch ``i`` (counted over every task in order) is
  handled by rank ``i mod world_size`` -- deterministic, every batch exactly once, and each batch
  is the very batch a single process forms (the same prompts, padded the same), so its float
  computations are the same;
- :meth:`Ranks.all_reduce_sum`: float64 / int64 tensors summed over the ranks in place (every
  rank then holds the same totals);
- :meth:`Ranks.all_reduce_max`: the same for maxima (per-sample maxima, flags);
- :meth:`Ranks.gather`: picklable objects from every rank, in rank order (kept per-sample data).

Anything not a plain sum (means, fractions, normalisations) is computed by the callers from the
reduced sums, so that the result equals the single-process one up to the order of float64
additions (about ``1e-15`` relative). :meth:`Ranks.is_writer` (rank 0) says who writes files
and prints; the others compute the same reduced statistics and write nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import json
import os
import pickle
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import ConfigError, MergeQPError, OtherProcessLost, OtherRankFailed, exit_code

T = TypeVar("T")
U = TypeVar("U")

#: environment variables ``torchrun`` sets in every process it launches
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE")


@dataclass(frozen=True)
class Ranks:
    """This process's place in a run: ``rank`` in ``0 .. world_size - 1`` and the backend
    (``"gloo"``, ``"nccl"``, or ``None`` for a single process)."""

    rank: int = 0
    world_size: int = 1
    backend: str | None = None

    @property
    def distributed(self) -> bool:
        """Whether several processes share the work."""
        return self.world_size > 1

    def is_writer(self) -> bool:
        """Rank 0 writes outputs and prints the summary; the others write nothing."""
        return self.rank == 0

    def owns(self, index: int) -> bool:
        """Whether this rank handles work item ``index`` (``index mod world_size == rank``)."""
        return index % self.world_size == self.rank

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's items of ``items``: those at positions ``rank, rank + W, ...``."""
        return list(items[self.rank::self.world_size])

    def all_reduce_sum(self, tensors: Sequence[Any]) -> None:
        """Sum each torch tensor over the ranks, in place (no-op for one process)."""
        self._reduce(tensors, "SUM")

    def all_reduce_max(self, tensors: Sequence[Any]) -> None:
        """Element-wise maximum of each torch tensor over the ranks, in place."""
        self._reduce(tensors, "MAX")

    def reduce_floats(self, values: Sequence[float], op: str = "sum") -> list[float]:
        """Python floats summed (``op="sum"``) or maximised (``"max"``) over the ranks, in float64."""
        if not self.distributed:
            return [float(v) for v in values]
        import torch  # deferred: torch is heavy

        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        (self.all_reduce_sum if op == "sum" else self.all_reduce_max)([t])
        return [float(v) for v in t.tolist()]

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank (picklable), in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist  # deferred: torch is heavy

        out: list[Any] = [None] * self.world_size
        _collective(lambda: dist.all_gather_object(out, obj, group=_own_group()))
        return out

    def spread(self, items: Sequence[T], work: Callable[[int, T], U]) -> list[U]:
        """``[work(i, item) for i, item in enumerate(items)]`` with the items spread over the
        ranks (item ``i`` on rank ``i mod world_size``, run :func:`alone`), the results gathered
        in order on every rank. An error on any rank is raised on every rank (the first item's).
        The results must be picklable."""
        if not self.distributed:
            return [work(i, item) for i, item in enumerate(items)]
        mine: dict[int, Any] = {}
        with alone():
            for i, item in enumerate(items):
                if self.owns(i):
                    try:
                        mine[i] = work(i, item)
                    except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
                        mine[i] = _Failed(exc)
                        break
        sent = {i: _Failed(_portable(r.error)) if isinstance(r, _Failed) else r for i, r in mine.items()}
        merged = {i: r for part in self.gather(sent) for i, r in part.items()}
        failed = sorted(i for i in merged if isinstance(merged[i], _Failed))
        if failed:  # the first item's error: its own rank raises the original (its traceback kept)
            if failed[0] in mine:
                raise mine[failed[0]].error
            raise _from_other_rank(merged[failed[0]].error, failed[0] % self.world_size)
        return [merged[i] for i in range(len(items))]

    def held(self, work: Callable[[], T]) -> tuple[T | None, Exception | None]:
        """``(work(), None)``; where ``work`` raises: under torchrun ``(None, error)``, held for
        :meth:`raise_first` at the step every rank reaches, and in a single process the error at once."""
        try:
            return work(), None
        except Exception as exc:  # noqa: BLE001 - raised on every rank by raise_first
            if not self.distributed:
                raise
            return None, exc

    def raise_first(self, error: Exception | None) -> None:
        """At a step that every rank reaches (e.g. after its own batches, before the reduction):
        raise the first error of any rank (in rank order) on every rank; nothing when none failed.
        The rank it belongs to raises its own (its traceback kept), the others a copy of it, which
        rank 0 prints. Without this, a rank that failed on its own batch left the others waiting in
        the next collective until ``torchrun`` stopped them (a gloo traceback, not the message)."""
        if not self.distributed:
            if error is not None:
                raise error
            return
        errors = self.gather(None if error is None else _Failed(_portable(error)))
        first = next((r for r, e in enumerate(errors) if e is not None), None)
        if first is None:
            return
        if first == self.rank and error is not None:
            raise error
        raise _from_other_rank(errors[first].error, first)

    def _reduce(self, tensors: Sequence[Any], op: str) -> None:
        if not self.distributed:
            return
        import torch.distributed as dist  # deferred: torch is heavy

        reduce_op = getattr(dist.ReduceOp, op)
        for t in tensors:
            if t is None:
                continue
            # gloo reduces CPU tensors, nccl CUDA ones: a copy on the backend's device if needed
            on_cpu = self.backend != "nccl"
            work = t if (t.device.type == "cpu") == on_cpu else t.to("cpu" if on_cpu else "cuda")
            _collective(lambda: dist.all_reduce(work, op=reduce_op, group=_own_group()))
            if work is not t:
                t.copy_(work)


#: words of a backend's error when a collective lost a peer (gloo: "Connection closed by peer",
#: "Connection reset by peer", "Broken pipe", timeouts; NCCL: an aborted communicator)
PEER_LOST_MARKS = ("closed by peer", "reset by peer", "broken pipe", "connection refused", "timed out",
                   "timeout", "communicator was aborted", "remote process exited", "connection closed")


def _collective(call: Callable[[], Any]) -> Any:
    """``call()`` (one collective); a backend error that says a peer is gone becomes
    :class:`~mergeqp.errors.OtherProcessLost` (one line, exit 5) instead of gloo's traceback."""
    try:
        return call()
    except RuntimeError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if any(mark in first.lower() for mark in PEER_LOST_MARKS):
            detail = re.sub(r"^\[[^\]]*\]\s*", "", first)  # gloo's "[.../pair.cc:553] " source location
            raise OtherProcessLost(detail[:160]) from None
        raise


def _from_other_rank(error: Exception, rank: int) -> Exception:
    """``error``, a copy of the one another ``rank`` met, marked as such: the command line prints
    and records a rank's own errors only (:func:`from_rank`)."""
    try:
        error.mergeqp_from_rank = int(rank)  # type: ignore[attr-defined]
    except AttributeError:  # an exception type with __slots__
        pass
    return error


def from_rank(error: BaseException) -> int | None:
    """The rank whose error ``error`` is a copy of (:meth:`Ranks.raise_first`, :meth:`Ranks.spread`),
    or ``None`` for this process's own error."""
    rank = getattr(error, "mergeqp_from_rank", None)
    return rank if isinstance(rank, int) else None


def own_error(error: BaseException) -> bool:
    """Whether ``error`` is this process's own (not a copy of another rank's, nor the news that
    another rank failed or is gone)."""
    return from_rank(error) is None and not isinstance(error, (OtherRankFailed, OtherProcessLost))


_ALONE: contextvars.ContextVar[bool] = contextvars.ContextVar("mergeqp_alone", default=False)

#: the process group mergeqp's collectives run on: its own one over every rank, made by
#: :func:`launched` (see the module's docstring), or ``None`` (the default group: one a caller
#: initialised); referenced here only, so that :func:`_destroy` frees it
_OWN_GROUP: Any = None
#: the default group :data:`_OWN_GROUP` was made beside: a caller who destroys it and initialises
#: another makes :data:`_OWN_GROUP` stale (it is then not used)
_OWN_WORLD: Any = None


def _own_group() -> Any:
    """:data:`_OWN_GROUP` while the default group it was made beside lives, else ``None`` (the
    default group)."""
    import torch.distributed as dist  # deferred: torch is heavy

    return _OWN_GROUP if _OWN_GROUP is not None and dist.group.WORLD is _OWN_WORLD else None


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """Inside, :func:`current_group` is a single process: work that one rank does on its own
    (a whole site, :meth:`Ranks.spread`) is not sharded again."""
    token = _ALONE.set(True)
    try:
        yield
    finally:
        _ALONE.reset(token)


@dataclass(frozen=True)
class _Failed:
    """An error of one rank's work (:meth:`Ranks.spread`, :meth:`Ranks.raise_first`), sent to the
    others."""

    error: Exception


def _portable(error: Exception) -> Exception:
    """``error`` if it survives pickling (to be sent to the other ranks), else a
    :class:`~mergeqp.errors.MergeQPError` (or, for an error that is not mergeqp's, a
    ``RuntimeError``) with its type and message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any failure to pickle or unpickle
        text = f"{type(error).__name__}: {error}"
        return MergeQPError(text) if isinstance(error, MergeQPError) else RuntimeError(text)


def current_group() -> Ranks:
    """The :class:`Ranks` of this process: from the initialised default ``torch.distributed``
    group, else (or inside :func:`alone`) a single process."""
    import torch.distributed as dist  # deferred: torch is heavy

    if _ALONE.get() or not (dist.is_available() and dist.is_initialized()):
        return Ranks()
    return Ranks(dist.get_rank(), dist.get_world_size(), str(dist.get_backend()))


def launch_requested(environ: dict[str, str] | None = None) -> int:
    """The world size a launcher (``torchrun``) asked for through the environment; 1 when none."""
    env = os.environ if environ is None else environ
    if not all(v in env for v in LAUNCH_VARIABLES):
        return 1
    try:
        world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={env['WORLD_SIZE']!r} / RANK={env['RANK']!r} are not integers; "
                          f"launch with torchrun (or unset them)") from None
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is not in 0 .. WORLD_SIZE-1 = {world - 1}; launch with torchrun")
    return world


def other_rank(environ: dict[str, str] | None = None) -> bool:
    """Whether this process is a rank other than 0 of a ``torchrun`` launch (read from the
    environment, so also before the ranks connect): such a process prints no error or plan, rank 0
    prints them once. A malformed launch environment counts as rank 0 (its error is printed)."""
    env = os.environ if environ is None else environ
    try:
        return launch_requested(env) > 1 and int(env["RANK"]) > 0
    except ConfigError:
        return False


def backend_for(device: str) -> str:
    """``nccl`` for a CUDA device, ``gloo`` otherwise."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


@contextlib.contextmanager
def launched(device: str = "cpu") -> Iterator[Ranks]:
    """Inside a ``torchrun`` launch (``WORLD_SIZE > 1``): initialise the default process group
    for ``device`` (each CUDA rank on its ``LOCAL_RANK`` GPU) and yield its :class:`Ranks`. The
    group lives until the process exits (a second command in the same process reuses it: the
    launcher's rendezvous serves one initialisation). Otherwise (or when a group is already
    initialised, e.g. by the caller) yield :func:`current_group`."""
    import torch.distributed as dist  # deferred: torch is heavy

    if launch_requested() == 1 or dist.is_initialized():
        yield current_group()
        return
    if not dist.is_available():
        raise ConfigError("WORLD_SIZE > 1 asks for a distributed run, but this torch has no torch.distributed")
    backend = backend_for(device)
    if backend == "nccl":
        import torch  # deferred: torch is heavy

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend)
    atexit.register(_destroy)
    global _OWN_GROUP, _OWN_WORLD
    _OWN_GROUP, _OWN_WORLD = dist.new_group(backend=backend), dist.group.WORLD
    yield current_group()


def _destroy() -> None:
    """At exit: destroy every process group. mergeqp's own is freed here (its last reference
    dropped), its workers finishing and joined while the interpreter is whole."""
    import torch.distributed as dist  # deferred: torch is heavy

    global _OWN_GROUP, _OWN_WORLD
    _OWN_GROUP = _OWN_WORLD = None
    if dist.is_initialized():
        dist.destroy_process_group()


def agree_on(group: Ranks, check: Callable[[], None]) -> None:
    """Run ``check`` on the writer rank (it raises on a problem) and share the verdict at this same
    step of every rank: the writer re-raises its error, the others raise :class:`OtherRankFailed`
    with its exit code. Without this a rank-0-only check (an output folder that is not empty) left
    the others working until their next collective, which then failed with a raw gloo traceback."""
    if not group.distributed:
        check()
        return
    error: BaseException | None = None
    if group.is_writer():
        try:
            check()
        except (MergeQPError, OSError) as exc:
            error = exc
    code = int(group.reduce_floats([exit_code(error) if error is not None else 0], op="max")[0])
    if error is not None:
        raise error
    if code:
        raise OtherRankFailed(code)


def agree_everywhere(group: Ranks, check: Callable[[], None]) -> None:
    """Run ``check`` on every rank (each may refuse on its own, e.g. from the memory it sees) and
    raise the first refusal, in rank order, on every rank at this same step, rank 0 printing it.
    Every rank of ``group`` must call it at the same step; in one process ``check`` runs as it is."""
    _, error = group.held(check)
    group.raise_first(error)


def agree_exit_code(group: Ranks, code: int) -> int:
    """The largest exit code over the ranks (every rank then exits with it; 0 only if all
    succeeded)."""
    if not group.distributed:
        return code
    return int(group.reduce_floats([code], op="max")[0])


def record_for_launcher(message: str, environ: dict[str, str] | None = None) -> None:
    """Under ``torchrun``: write ``message`` (one line) to this process's error file
    (``$TORCHELASTIC_ERROR_FILE``), which torchrun shows in its report, the first process's as the
    root cause. Rank 0 prints its errors; without this a rank's own error (a file missing on its node,
    its memory) was printed nowhere. Nothing when the variable is unset; a failure to write is ignored."""
    path = (os.environ if environ is None else environ).get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                           "timestamp": str(int(time.time()))}}}
    with contextlib.suppress(OSError):
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(data, fh)


__all__ = ["LAUNCH_VARIABLES", "PEER_LOST_MARKS", "Ranks", "agree_everywhere", "agree_exit_code", "agree_on", "alone",
           "backend_for", "current_group", "from_rank", "launch_requested", "launched", "other_rank", "own_error",
           "record_for_launcher"]

