"""Atomic writes: an output path holds either its previous content or the new, complete one.

Every file mergeqp writes (solutions, arrays, statistics, problem files, reports, plots,
safetensors shards) goes through this module:

- :func:`atomic_file` opens a temporary file *in the same folder* (``.NAME.tmp-mergeqp-*``),
  hands it to the caller, then flushes, ``fsync``s and ``os.replace``s it onto ``NAME`` (and
  ``fsync``s the folder); a symbolic link is written through. If anything goes wrong first (an exception, ``OSError(ENOSPC)``,
  Ctrl-C), the temporary file is removed and ``NAME`` keeps its old content. A hard kill
  (SIGKILL, power loss) can leave a ``.tmp-mergeqp-`` file beside it, never a half-written ``NAME``.
- :func:`atomic_folder` assembles a folder output in a sibling temporary folder and renames it
  into place at the end (through a symbolic link to a folder); a previous folder (``overwrite``)
  is moved aside first and deleted after the rename. The folder lists its files in a hidden
  :data:`MANIFEST`, so that ``--overwrite`` refuses to delete files added to it later.
- :func:`check_output_file` / :func:`check_output_folder` / :func:`check_free_space` validate an
  output before any heavy work: not an input (after resolving links), the folder exists and is
  writable, and (where the caller can estimate it) there is room for it.

Failures while writing are :class:`~mergeqp.errors.OutputError` (exit code 4) naming the path;
a bad output path found before the work is a :class:`~mergeqp.errors.ValidationError` (exit code 2).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import stat
import struct
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from ..errors import ConfigError, OutputError, ValidationError
from .held_signals import deferred_signals

TMP_MARK = ".tmp-mergeqp-"
OLD_MARK = ".old-mergeqp-"
#: free space kept in reserve beyond an output's estimated size (bytes)
SPACE_MARGIN = 16 * 1024**2
#: outputs put in place in this process (:func:`committed_outputs`), staging folders' content left out
_COMMITTED: list[str] = []


def _committed(target: Path) -> None:
    if not any(TMP_MARK in part for part in target.parts[:-1]):
        _COMMITTED.append(os.fspath(target))


def committed_outputs() -> list[str]:
    """The outputs (files and folders) put in place since :func:`forget_committed`: what a command
    interrupted after them has already written, complete."""
    return list(_COMMITTED)


def forget_committed() -> None:
    _COMMITTED.clear()


def _tmp_name(path: Path, mark: str = TMP_MARK) -> Path:
    return path.with_name(f".{path.name}{mark}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _fsync_folder(folder: Path) -> None:
    """Persist a rename (POSIX: the folder's entry table); a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _output_error(path: Any, exc: OSError) -> OutputError:
    err = OutputError(f"cannot write {os.fspath(path)}: {exc.strerror or exc}; its previous state is kept")
    err.errno = exc.errno
    return err


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], mode: str = "wb", encoding: str | None = None) -> Iterator[IO[Any]]:
    """``with atomic_file(path, "w") as fh: ...``: write ``path`` all at once or not at all.

    ``mode``: ``"wb"`` (binary) or ``"w"`` (text, ``encoding`` default UTF-8). The file is
    written exactly at ``path`` (no extension is added). An ``OSError`` while writing becomes an
    :class:`OutputError` naming ``path``; any exception (also ``KeyboardInterrupt``) removes
    the temporary file and leaves ``path`` untouched.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_file writes new content: mode 'w' or 'wb', got {mode!r}")
    target = Path(path).expanduser().resolve()  # a link is written through: its target gets the new content
    tmp = _tmp_name(target)
    fh: IO[Any] | None = None
    try:
        try:
            fh = open(tmp, mode, encoding=(encoding or "utf-8") if mode == "w" else None)  # noqa: SIM115
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()
            with contextlib.suppress(OSError):  # a replaced file keeps its permissions
                os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode))
            os.replace(tmp, target)
            _committed(target)
        except OSError as exc:
            raise _output_error(target, exc) from None
    except BaseException:
        if fh is not None and not fh.closed:
            with contextlib.suppress(OSError):
                fh.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_folder(target.parent)


def save_safetensors(tensors: Any, path: str | os.PathLike[str], metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, with the permissions any new file gets (``0666`` less the
    umask): safetensors creates its file readable by its owner only (``0600``), so a merged model
    written for a server or another user could not be read. Call it on a path inside a staging
    folder (:func:`atomic_folder`): the write itself is not atomic."""
    from safetensors.torch import save_file  # deferred: safetensors loads torch

    save_file(tensors, os.fspath(path), metadata=metadata)
    if metadata and len(metadata) > 1:
        _sort_metadata(path)
    mask = os.umask(0)
    os.umask(mask)
    with contextlib.suppress(OSError):
        os.chmod(path, 0o666 & ~mask)


def _sort_metadata(path: str | os.PathLike[str]) -> None:
    """Rewrite a safetensors file's header in place with its ``__metadata__`` keys sorted: the
    library writes them in hash order, which varies between processes, so two identical merges
    would not have equal file hashes. The header keeps its length (the same keys and values), so
    the tensor data does not move; anything unexpected leaves the file as written."""
    with open(path, "r+b") as fh:
        head = fh.read(8)
        if len(head) != 8:
            return
        size = struct.unpack("<Q", head)[0]
        raw = fh.read(size)
        try:
            header = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return
        meta = header.get("__metadata__") if isinstance(header, dict) else None
        if not isinstance(meta, dict):
            return
        header["__metadata__"] = dict(sorted(meta.items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) > size:
            return
        fh.seek(8)
        fh.write(text + b" " * (size - len(text)))


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_file(path, "wb") as fh:
        fh.write(data)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_file(path, "w") as fh:
        fh.write(text)


def write_json_atomic(path: str | os.PathLike[str], obj: Any, *, indent: int = 1, **dumps_kwargs: Any) -> None:
    """Serialise ``obj`` first (a serialisation error writes nothing), then write it atomically
    with a final newline."""
    text = json.dumps(obj, indent=indent, **dumps_kwargs) + "\n"
    write_text_atomic(path, text)


def save_npy_atomic(path: str | os.PathLike[str], array: Any) -> None:
    """``numpy.save`` to exactly ``path`` (numpy itself would append ``.npy``), atomically."""
    with atomic_file(path, "wb") as fh:
        np.save(fh, np.asarray(array), allow_pickle=False)


def save_npz_atomic(path: str | os.PathLike[str], arrays: dict[str, Any]) -> None:
    """``numpy.savez`` of ``arrays`` to exactly ``path``, atomically."""
    with atomic_file(path, "wb") as fh:
        np.savez(fh, **arrays)


def savefig_atomic(fig: Any, path: str | os.PathLike[str], **kwargs: Any) -> None:
    """``fig.savefig`` into memory, then write the bytes atomically (the format from the suffix)."""
    buffer = io.BytesIO()
    fmt = Path(path).suffix.lstrip(".") or "png"
    fig.savefig(buffer, format=fmt, **kwargs)
    write_bytes_atomic(path, buffer.getvalue())


def copy_file_atomic(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Copy ``src`` to ``dst`` atomically (``dst`` is complete or unchanged)."""
    with atomic_file(dst, "wb") as fh, open(src, "rb") as source:
        shutil.copyfileobj(source, fh)


# ---------------------------------------------------------------------- checks before work
def _resolved(p: str | os.PathLike[str]) -> Path:
    return Path(p).expanduser().resolve()


def overlapping_input(out: str | os.PathLike[str], inputs: Sequence[str | os.PathLike[str]]) -> str | None:
    """The first input that ``out`` is, contains or lies inside (links resolved), else ``None``. An input
    that does not exist yet (a cache folder made on first use) counts as a folder: ``out`` inside it was
    accepted once and refused on the next run, when the folder existed (a QA review, stop 76)."""
    out_r = _resolved(out)
    for p in inputs:
        pr = _resolved(p)
        if out_r == pr or pr.is_relative_to(out_r) or ((pr.is_dir() or not pr.exists()) and out_r.is_relative_to(pr)):
            return os.fspath(p)
        # a link inside ``out`` to a file elsewhere: replacing ``out`` would delete the path the user gave
        if (_resolved(Path(p).expanduser().parent) / Path(p).name).is_relative_to(out_r):
            return os.fspath(p)
        with contextlib.suppress(OSError):
            if out_r.exists() and pr.exists() and os.path.samefile(out_r, pr):  # hard links
                return os.fspath(p)
        if pr.is_dir() and out_r.exists():
            linked = _link_into(Path(p).expanduser(), out_r)
            if linked is not None:
                return linked
    return None


#: :func:`_link_into` looks at up to this many entries of an input folder
LINK_SCAN_MAX = 100_000


def _link_into(folder: Path, out_r: Path) -> str | None:
    """An entry of the input ``folder`` (at any depth, links not followed into) that is a link
    resolving into ``out_r``, else ``None``: replacing ``out`` would delete the file the input
    reads (a fine-tune folder whose ``model.safetensors`` links to an earlier merge's, or a hub
    cache's snapshot linking to its blobs, merged with ``--out`` that merge and ``--overwrite``:
    the input's weights were replaced, a QA review, stop 73)."""
    seen = 0
    for root, dirs, files in os.walk(folder):
        for name in (*files, *dirs):
            seen += 1
            if seen > LINK_SCAN_MAX:
                return None
            entry = Path(root) / name
            if entry.is_symlink():
                with contextlib.suppress(OSError, RuntimeError):
                    if _resolved(entry).is_relative_to(out_r):
                        return os.fspath(entry)
    return None


def _write_refusal(folder: Path, kind: str) -> str | None:
    """Why a ``kind`` ("file" or "folder") cannot be created in the existing ``folder``, tried for
    real (a hidden probe created and removed at once), or ``None`` where it can. ``os.access``
    alone says yes where the write then fails: as root on ``/proc`` or ``/sys`` (a merge ended with
    exit 4 after its work, a QA review, stop 68)."""
    try:
        if kind == "folder":
            os.rmdir(tempfile.mkdtemp(prefix=".mergeqp-probe-", dir=folder))
        else:
            fd, name = tempfile.mkstemp(prefix=".mergeqp-probe-", dir=folder)
            os.close(fd)
            os.unlink(name)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def nearest_existing(path: str | os.PathLike[str]) -> Path:
    """``path`` or its nearest ancestor that exists (the root at worst): where a folder that is
    still missing would be made."""
    p = Path(path)
    while not p.exists() and p.parent != p:
        p = p.parent
    return p


def check_writable_folder(path: str | os.PathLike[str], option: str) -> Path:
    """Before any work: a folder that the run reads and adds files to (a cache), refused when it is a
    file or when nothing can be created where it is (or would be made). Returns it resolved. (A QA
    review, stop 73: ``--cache`` naming a file, or on a read-only file system, failed after the work,
    as an I/O error that blamed the wrong thing.)"""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ValidationError(f"{option} {os.fspath(path)} is a file, not a folder")
    near = nearest_existing(p)
    if not near.is_dir():
        raise ValidationError(f"{option} {os.fspath(path)}: {near} is a file, so the folder cannot be made")
    why = _write_refusal(near, "folder")
    if why is not None:
        raise ValidationError(f"{option} {os.fspath(path)}: nothing can be written in {near} ({why})")
    return p.resolve()


def check_output_file(path: str | os.PathLike[str], option: str,
                      inputs: Sequence[str | os.PathLike[str]] = ()) -> None:
    """Before any work: refuse an output file that is (or lies inside) an input, is a folder,
    or whose folder is missing or not writable. ``option`` names it in the message
    (``"--out"``, ``"the solution"``...). Raises :class:`ValidationError`."""
    if not os.fspath(path):
        raise ValidationError(f"{option} is empty; give a file name")
    text = os.fspath(path)
    if text.endswith(("/", os.sep)):  # ("new/" wrote a file named new: a review, stop 74)
        raise ValidationError(f"{option} {text} ends with a separator, so it names a folder; give a file name")
    normal = os.path.normpath(text)
    if ((normal.startswith("/dev/") and not normal.startswith("/dev/shm/"))
            or re.match(r"^/proc/(self|\d+)/fd/", normal)):
        # (/dev/stdout redirected to a file resolves to that file, which the atomic write replaced)
        raise ValidationError(f"{option} {text} is a device, not a file; outputs are written as files "
                              f"(standard output: '-' where the command takes it)")
    p = Path(path).expanduser()
    if p.is_dir():  # (before the inputs: a folder holding an input is first of all not a file name)
        raise ValidationError(f"{option} {os.fspath(path)} is a folder; give a file name")
    clash = overlapping_input(p, inputs)
    if clash is not None:
        raise ValidationError(f"{option} {os.fspath(path)} would overwrite the input {clash}; inputs are never "
                          f"written: choose another path")
    if p.exists() and not p.resolve().is_file():
        # a device, pipe or socket (/dev/null, /dev/stdout, a FIFO): the atomic write would replace
        # it by a regular file (or fail after the work, for a pipe of another process)
        raise ValidationError(f"{option} {os.fspath(path)} is not a regular file (a device, pipe or socket); "
                              f"outputs are written as files: give a file path")
    folder = p.resolve().parent
    if not folder.is_dir():
        why = "is a file, not a folder" if folder.exists() else "does not exist"
        raise ValidationError(f"cannot write {option} to {os.fspath(path)}: folder {folder} {why}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValidationError(f"cannot write {option} to {os.fspath(path)}: folder {folder} is not writable")
    why = _write_refusal(folder, "file")
    if why is not None:
        raise ValidationError(f"cannot write {option} to {os.fspath(path)}: no file can be created in folder "
                              f"{folder} ({why})")


#: files that mark a folder as an earlier output of mergeqp, which ``--overwrite`` may replace: a
#: merge's or an experiment's report, an experiment's results, a sweep's table
OUTPUT_SIGNATURES = ("report.json", "results.json", "sweep.csv")
#: the hidden list of the files an output folder had when mergeqp put it in place (relative paths,
#: sorted; written by :func:`atomic_folder`): ``--overwrite`` refuses a folder holding others
MANIFEST = ".mergeqp-files.json"
#: how many of the files a refusal names
_NAMED = 5


def folder_files(root: str | os.PathLike[str]) -> list[str]:
    """The files (and links) under ``root`` as sorted relative POSIX paths, :data:`MANIFEST` left
    out; folders count through their files (an empty one is not listed)."""
    base = Path(root)
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(base):
        rel = Path(dirpath).relative_to(base)
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]  # not followed
        found.extend((rel / name).as_posix() for name in filenames + links)
    return sorted(f for f in found if f != MANIFEST)


def _unlisted_files(folder: Path) -> list[str] | None:
    """The files of ``folder`` that its :data:`MANIFEST` does not list (``None``: no readable
    manifest, e.g. a folder of an earlier version or of another tool)."""
    try:
        listed = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(listed, list):
        return None
    known = {str(f) for f in listed}
    return [f for f in folder_files(folder) if f not in known]


def replace_refusal(folder: str | os.PathLike[str]) -> str | None:
    """Why ``--overwrite`` may not replace the non-empty ``folder`` (``None``: it may): only an
    earlier output of mergeqp is replaced (its :data:`MANIFEST`, or one of :data:`OUTPUT_SIGNATURES`
    inside; since stop 49 not a model folder with neither: another tool's model, e.g. a fine-tune
    named as ``--out`` by mistake, was deleted), never the current folder, one holding it or the home folder
    (``sweep --out . --overwrite`` deleted every file of the current folder), and not a folder of
    mergeqp's to which files were added since (its :data:`MANIFEST` does not list them: a user's
    notes or evaluations beside a merged model were deleted before stop 48)."""
    path = Path(folder).expanduser().resolve()
    try:
        cwd: Path | None = Path.cwd().resolve()
    except OSError:  # the current folder was deleted
        cwd = None
    if cwd is not None and (path == cwd or path in cwd.parents):
        return "it is the current folder or holds it"
    if path == Path.home().resolve():
        return "it is your home folder"
    unlisted = _unlisted_files(path)
    if unlisted:  # files added since mergeqp wrote the folder: --overwrite would delete them
        more = f" and {len(unlisted) - _NAMED} more" if len(unlisted) > _NAMED else ""
        return (f"it holds {len(unlisted)} file(s) that mergeqp did not write there ({', '.join(unlisted[:_NAMED])}"
                f"{more}), which replacing it would delete; move them out of it first")
    if unlisted is not None:
        return None  # exactly what mergeqp wrote
    names = {p.name for p in path.iterdir()}
    if names & set(OUTPUT_SIGNATURES):
        return None
    if any(n.endswith((".safetensors", ".safetensors.index.json")) for n in names):
        return (f"it holds a model's weights but neither the list of files mergeqp writes into its folders "
                f"({MANIFEST}) nor a report: a model of another tool (or one written from Python before "
                f"stop 48), which mergeqp does not delete; delete it yourself if it is to go")
    return ("it holds no earlier mergeqp output (no " + ", ".join(OUTPUT_SIGNATURES)
            + f" nor {MANIFEST})")


def refuse_to_replace(folder: str | os.PathLike[str], option: str) -> None:
    """:class:`ValidationError` when ``--overwrite`` may not replace the non-empty ``folder``
    (:func:`replace_refusal`); its files are kept."""
    why = replace_refusal(folder)
    if why is not None:
        raise ValidationError(f"{option} {os.fspath(folder)} is not empty and --overwrite replaces only an earlier "
                              f"output of mergeqp: {why}. Its files are kept; choose a new or empty folder")


def check_output_folder(out: str | os.PathLike[str], inputs: Sequence[str | os.PathLike[str]] = (),
                        overwrite: bool = False, option: str = "output folder") -> None:
    """Before any work: refuse an output folder that is, contains or lies inside an input (links
    resolved), a path that is a file, a non-empty folder unless ``overwrite``, and a place where
    it cannot be created (the nearest existing parent must be a writable folder). Raises
    :class:`ConfigError`."""
    if not os.fspath(out):
        raise ValidationError(f"{option} is empty; give a folder")
    out_p = Path(out).expanduser()
    clash = overlapping_input(out_p, inputs)
    if clash is not None:
        raise ValidationError(f"{option} {os.fspath(out)} overlaps input {clash}; inputs are never modified: "
                              f"choose another --out")
    out_r = out_p.resolve()
    if out_r.exists() and not out_r.is_dir():
        raise ValidationError(f"{option} {os.fspath(out)} exists and is not a folder")
    orphan = orphaned_previous(out_r)
    if orphan is not None:
        raise ValidationError(
            f"{option} {os.fspath(out)} is missing, but {orphan} holds its previous contents (a run was killed "
            f"while replacing it): rename that folder back to {out_r.name} (or delete it) and run again")
    if out_r.is_dir() and any(out_r.iterdir()):
        if not overwrite:
            raise ValidationError(f"{option} {os.fspath(out)} is not empty; pass --overwrite (overwrite=True from "
                                  f"Python) to replace its contents")
        refuse_to_replace(out, option)
    if out_r.is_dir():  # it will be replaced by a new folder: refuse what the user protected
        if os.path.ismount(out_r):
            raise ValidationError(f"{option} {os.fspath(out)} is a mount point, which cannot be replaced; "
                                  f"choose a folder inside it")
        if not os.access(out_r, os.W_OK | os.X_OK):
            raise ValidationError(f"{option} {os.fspath(out)} is not writable (read-only folder or file system); "
                                  f"it is kept as it is: choose another --out or change its permissions")
    parent = nearest_existing(out_r.parent)
    if not parent.is_dir():
        raise ValidationError(f"cannot create {option} {os.fspath(out)}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValidationError(f"cannot create {option} {os.fspath(out)}: folder {parent} is not writable")
    why = _write_refusal(parent, "folder")
    if why is not None:
        raise ValidationError(f"cannot create {option} {os.fspath(out)}: no folder can be created in {parent} "
                              f"({why})")


def orphaned_previous(out: str | os.PathLike[str]) -> Path | None:
    """A hidden ``.NAME.old-mergeqp-*`` folder beside a missing ``out``: the previous output that a
    hard kill (SIGKILL, power loss) left aside between :func:`atomic_folder`'s two renames, the only
    copy of it (``None`` where ``out`` exists or there is none; the newest where there are several)."""
    target = Path(out)
    if target.exists() or not target.parent.is_dir():
        return None
    try:
        found = [p for p in target.parent.glob(f".{_glob_escape(target.name)}{OLD_MARK}*") if p.is_dir()]
    except OSError:
        return None
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def _glob_escape(name: str) -> str:
    """``name`` with glob's special characters taken literally."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def check_free_space(path: str | os.PathLike[str], need_bytes: int, option: str = "the output") -> None:
    """Before any work: refuse when the file system holding ``path`` (or its nearest existing
    parent) has less than ``need_bytes`` plus a small margin free. Raises :class:`ConfigError`."""
    p = nearest_existing(Path(path).expanduser().resolve())
    try:
        free = shutil.disk_usage(p).free
    except OSError:
        return  # cannot tell: the atomic writes still keep the old state if the disk fills
    if free < int(need_bytes) + SPACE_MARGIN:
        raise ConfigError(
            f"not enough free space for {option} at {os.fspath(path)}: about {int(need_bytes) / 1e6:.1f} MB "
            f"needed plus a {SPACE_MARGIN / 1e6:.1f} MB margin, {free / 1e6:.1f} MB free"
        )


# ---------------------------------------------------------------------- folders
@contextlib.contextmanager
def atomic_folder(out: str | os.PathLike[str], overwrite: bool = False) -> Iterator[Path]:
    """``with atomic_folder(out) as staging: ...write files into staging...``; on success the
    staging folder (a sibling of ``out``) becomes ``out``. A previous ``out`` (empty, or any
    content with ``overwrite``) is moved aside first and removed after the rename. On any
    exception (also Ctrl-C) the staging folder is removed and ``out`` is left as it was.
    Call :func:`check_output_folder` first for a clear message about a bad ``out``."""
    # a link to a folder is written through: the staging folder is a sibling of its target (same
    # file system) and the link keeps pointing at the new folder
    target = Path(out).expanduser().resolve()
    if target.exists() and not target.is_dir():
        raise ConfigError(f"output path {os.fspath(out)} exists and is not a folder")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise ConfigError(f"output folder {os.fspath(out)} is not empty; pass --overwrite to replace its contents")
    staging = _tmp_name(target)
    # the parents this call creates, removed again (where still empty) if it fails: a refused or
    # interrupted run left empty folders behind (a QA review, stop 68)
    created = [p for p in reversed(target.parents) if not p.exists()]
    try:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            staging.mkdir()
        except OSError as exc:
            raise _output_error(target, exc) from None
        try:
            yield staging
        except OutputError as exc:
            # a write inside the staging folder failed (a full disk): name the output the user asked
            # for, not the hidden temporary folder that is about to be removed
            raise _renamed(exc, staging, target) from None
        write_json_atomic(staging / MANIFEST, {"written_by": "mergeqp", "files": folder_files(staging)})
        old = _tmp_name(target, OLD_MARK) if target.exists() else None
        if old is not None:  # a replaced folder keeps its permissions, as a replaced file does
            with contextlib.suppress(OSError):
                os.chmod(staging, stat.S_IMODE(os.stat(target).st_mode))
        swapped = False
        try:
            # Ctrl-C or SIGTERM between the two renames would leave neither folder under its name
            # (the previous one hidden aside, the new one removed with the staging folder): they are
            # deferred until both renames are done, and taken after (a QA review, stop 68)
            with deferred_signals():
                try:
                    if old is not None:
                        os.replace(target, old)
                    try:
                        os.replace(staging, target)
                        swapped = True
                        _committed(target)
                    except OSError:
                        if old is not None:
                            os.replace(old, target)  # put the previous folder back
                        raise
                except OSError as exc:
                    raise _output_error(target, exc) from None
        finally:
            if swapped and old is not None:
                shutil.rmtree(old, ignore_errors=True)
        _fsync_folder(target.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for p in reversed(created):
            with contextlib.suppress(OSError):
                p.rmdir()  # (only an empty folder goes)
        raise


def _renamed(exc: OutputError, staging: Path, target: Path) -> OutputError:
    """``exc`` with the staging folder's path in its message replaced by ``target``'s."""
    msg = str(exc).replace(os.fspath(staging), os.fspath(target))
    if msg == str(exc):
        return exc
    new = OutputError(msg)
    new.errno = getattr(exc, "errno", None)
    return new


__all__ = [
    "atomic_file", "atomic_folder", "check_free_space", "check_output_file", "check_output_folder",
    "check_writable_folder", "committed_outputs", "copy_file_atomic", "folder_files", "forget_committed",
    "nearest_existing", "orphaned_previous", "overlapping_input", "refuse_to_replace", "replace_refusal",
    "save_npy_atomic", "save_npz_atomic", "savefig_atomic", "write_bytes_atomic", "write_json_atomic", "write_text_atomic",
]
