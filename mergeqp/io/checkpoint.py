"""Read-only, lazy access to checkpoints: Hugging Face folders, safetensors files, torch files.

:func:`open_checkpoint` accepts

- a Hugging Face model folder: ``config.json`` plus ``model.safetensors``, or sharded
  ``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json`` (the ``weight_map``
  says which shard holds each tensor); legacy ``pytorch_model.bin`` (sharded or not) too;
- a single ``.safetensors`` file;
- a torch file (``.pt``, ``.pth``, ``.bin``) holding a state dict (or ``{"state_dict": ...}``).

Nothing is read when the checkpoint is opened except safetensors *headers* (the JSON table of
names, dtypes and shapes at the start of each file), so names, shapes and sizes are known
without touching a weight. :meth:`Checkpoint.get` loads one tensor (``safe_open`` per shard,
memory-mapped); torch files are loaded with ``mmap=True, weights_only=True`` so that they too
are paged in only when a tensor is used. A checkpoint never writes to its files.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from ..errors import ValidationError, first_line

#: safetensors dtype codes -> torch dtype names
SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool", "U16": "uint16", "U32": "uint32", "U64": "uint64",
}
#: bytes per element of each torch dtype name
DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "uint16": 2, "uint32": 4, "uint64": 8,
}
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
TORCH_INDEX = "pytorch_model.bin.index.json"
TORCH_SINGLE = "pytorch_model.bin"
TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def is_float_dtype(name: str) -> bool:
    """Whether a stored dtype name (``"bfloat16"``, ``"float8_e4m3fn"``, ``"int32"`` ...) is a
    floating-point one."""
    return name.startswith(("float", "bfloat"))


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives and what it is, read from a header (no data loaded).

    ``shape`` is the tensor's shape, ``dtype`` a torch dtype name (``"float32"``), ``file`` the
    file holding it, ``nbytes`` its size in bytes.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    file: Path
    #: absolute byte offset of the data in a safetensors file (``None`` for torch files)
    offset: int | None = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 4)

    @property
    def floating(self) -> bool:
        return is_float_dtype(self.dtype)


def read_safetensors_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse the JSON header of a safetensors file: ``({name: TensorInfo}, metadata)``.

    Reads only the first ``8 + header_length`` bytes.
    """
    try:
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ValidationError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (length,) = struct.unpack("<Q", raw)
            if length > 100_000_000:
                raise ValidationError(f"{path}: not a safetensors file (header length {length})")
            header = json.loads(fh.read(length))
            data_bytes = os.fstat(fh.fileno()).st_size - 8 - length
    except OSError as exc:
        raise ValidationError(f"cannot read checkpoint file {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValidationError(f"{path}: not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict) or not all(isinstance(e, dict) for k, e in header.items() if k != "__metadata__"):
        raise ValidationError(f"{path}: not a safetensors file (the header is not a mapping of tensor entries)")
    meta = header.pop("__metadata__", None) or {}
    infos: dict[str, TensorInfo] = {}
    data_end = 0
    for name, entry in header.items():
        dtype = SAFETENSORS_DTYPES.get(str(entry.get("dtype")), str(entry.get("dtype")).lower())
        offsets = entry.get("data_offsets") or (0, 0)
        infos[name] = TensorInfo(name, tuple(int(s) for s in entry.get("shape", ())), dtype, path,
                                 8 + length + int(offsets[0]))
        data_end = max(data_end, int(offsets[-1]))
    if data_bytes != data_end:  # a truncated (or padded) file: caught here, before any weight is read
        raise ValidationError(f"{path}: truncated or damaged safetensors file: its header describes {data_end} bytes "
                              f"of tensor data, the file holds {max(data_bytes, 0)}")
    return infos, {str(k): str(v) for k, v in meta.items()}


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _on_cpu(device: Any) -> bool:
    return device is None or str(device) == "cpu"


def _placed(tensor: Any, dtype: Any, device: Any) -> Any:
    """``tensor`` converted to ``dtype`` (``None``: kept) and moved to ``device`` (``None`` / cpu: kept)."""
    if dtype is not None:
        tensor = tensor.to(dtype)
    return tensor if _on_cpu(device) else tensor.to(device)


#: safetensors dtypes :meth:`Checkpoint.read` decodes itself (little-endian, as the format stores them)
_READ_DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")


class Checkpoint:
    """A read-only, lazily loaded collection of named tensors.

    Use :func:`open_checkpoint` to build one. ``names()`` lists the tensors (in file order),
    ``info(name)`` gives shape / dtype / size from the headers, ``get(name)`` loads one tensor.
    ``config`` is the parsed ``config.json`` of a Hugging Face folder (``None`` for bare files).
    Usable as a context manager; :meth:`close` releases open file handles.
    """

    def __init__(self, path: Path, kind: str, infos: Mapping[str, TensorInfo],
                 config: dict[str, Any] | None = None, torch_state: dict[str, Any] | None = None):
        self.path = path
        self.kind = kind
        self._infos = dict(infos)
        self.config = config
        self._torch_state = torch_state  # lazily loaded torch files: file -> state dict
        self._handles: dict[Path, Any] = {}
        self._source_names: dict[str, str] = {}  # name here -> name in the file (renamed views)

    # ------------------------------------------------------------------ facts
    def names(self) -> tuple[str, ...]:
        return tuple(self._infos)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def info(self, name: str) -> TensorInfo:
        if name not in self._infos:
            raise ValidationError(self._missing(name))
        return self._infos[name]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: i.shape for n, i in self._infos.items()}

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self._infos.values())

    @property
    def files(self) -> tuple[Path, ...]:
        return tuple(dict.fromkeys(i.file for i in self._infos.values()))

    @property
    def is_hf_folder(self) -> bool:
        return self.kind.startswith("hf")

    @property
    def configured(self) -> bool:
        """A Hugging Face folder with its own ``config.json``, loaded as itself; a bare weight file, or
        a folder of weights without a config, is read into the base's architecture. (Stop 60 review:
        a fine-tune folder without ``config.json`` went to ``from_pretrained``, which built
        transformers' default-size model, a 7B Llama, and ran the machine out of memory.)"""
        return self.is_hf_folder and self.config is not None

    @property
    def folder(self) -> Path | None:
        """The Hugging Face folder (for its config and tokenizer), ``None`` for bare files."""
        return self.path if self.path.is_dir() else None

    def _missing(self, name: str) -> str:
        import difflib

        close = difflib.get_close_matches(name, list(self._infos), n=3)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        return f"tensor {name!r} is not in checkpoint {self.path} ({len(self._infos)} tensors){hint}"

    # ------------------------------------------------------------------ loading
    def get(self, name: str, dtype: Any = None, device: Any = "cpu") -> Any:
        """Load one tensor (a new CPU tensor unless ``device`` says otherwise).

        ``dtype``: optional torch dtype to convert to.
        """
        info = self.info(name)
        name = self._source_names.get(name, name)
        if self.kind.endswith("torch"):
            tensor = self._torch_file(info.file)[name]
        else:
            from safetensors import SafetensorError, safe_open  # deferred: optional heavy dependency

            handle = self._handles.get(info.file)
            if handle is None:
                try:
                    handle = safe_open(str(info.file), framework="pt", device="cpu")
                except (SafetensorError, OSError) as exc:  # name the file
                    raise ValidationError(f"cannot read checkpoint file {info.file}: {type(exc).__name__}: "
                                          f"{exc}") from None
                self._handles[info.file] = handle
            try:
                tensor = handle.get_tensor(name)
            except (SafetensorError, OSError) as exc:  # e.g. the file changed since it was opened
                raise ValidationError(f"cannot read tensor {name!r} of checkpoint file {info.file}: "
                                      f"{type(exc).__name__}: {exc}") from None
        if self.kind.endswith("torch") and _on_cpu(device):
            tensor = tensor.clone()  # never hand out views of the mmapped file
        return _placed(tensor, dtype, device)

    def sample(self, name: str, count: int = 256) -> Any:
        """The first ``count`` entries of tensor ``name`` (flattened, its stored dtype): a safetensors
        tensor reads only those bytes; another format reads the tensor."""
        info = self.info(name)
        n = min(int(count), info.numel)
        if info.offset is None or info.dtype not in _READ_DTYPES or sys.byteorder != "little":
            return self.get(name).reshape(-1)[:n].clone()
        import torch  # deferred: optional heavy dependency

        itemsize = info.nbytes // max(info.numel, 1)
        try:
            with open(info.file, "rb") as fh:
                fh.seek(info.offset)
                buf = bytearray(fh.read(n * itemsize))
        except OSError as exc:
            raise ValidationError(f"cannot read tensor {name!r} of checkpoint file {info.file}: {exc}") from None
        if len(buf) != n * itemsize:
            raise ValidationError(f"cannot read tensor {name!r} of checkpoint file {info.file}: the file ends early")
        return torch.frombuffer(buf, dtype=getattr(torch, info.dtype)) if n else torch.empty(0)

    def get_many(self, names: Iterable[str], dtype: Any = None, device: Any = "cpu") -> dict[str, Any]:
        return {n: self.get(n, dtype=dtype, device=device) for n in names}

    def read(self, name: str, dtype: Any = None, device: Any = "cpu") -> Any:
        """Like :meth:`get`, but a safetensors tensor is read with plain file reads instead of a
        memory map, so the file's pages never count in this process's resident memory (what a
        model whose blocks stay on disk reads over and over)."""
        info = self.info(name)
        if info.offset is None or info.dtype not in _READ_DTYPES or sys.byteorder != "little":
            return self.get(name, dtype=dtype, device=device)
        import torch  # deferred: optional heavy dependency

        try:
            fd = os.open(info.file, os.O_RDONLY)
            try:
                buf = bytearray(info.nbytes)
                view, done = memoryview(buf), 0
                while done < info.nbytes:
                    n = os.preadv(fd, [view[done:]], info.offset + done)
                    if n <= 0:
                        raise OSError(f"unexpected end of file at byte {info.offset + done}")
                    done += n
            finally:
                os.close(fd)
        except OSError as exc:
            raise ValidationError(f"cannot read tensor {name!r} of checkpoint file {info.file}: {exc}") from None
        tensor = (torch.frombuffer(buf, dtype=getattr(torch, info.dtype)) if info.nbytes
                  else torch.empty(0, dtype=getattr(torch, info.dtype))).reshape(info.shape)
        return _placed(tensor, dtype, device)

    def read_many(self, names: Iterable[str], dtype: Any = None, device: Any = "cpu") -> dict[str, Any]:
        return {n: self.read(n, dtype=dtype, device=device) for n in names}

    def state_dict(self, dtype: Any = None) -> dict[str, Any]:
        """Load every tensor (use sparingly: the point of this class is not to)."""
        return self.get_many(self.names(), dtype=dtype)

    def _torch_file(self, path: Path) -> dict[str, Any]:
        assert self._torch_state is not None
        if path not in self._torch_state:
            self._torch_state[path] = load_torch_state(path)
        return self._torch_state[path]

    def renamed(self, mapping: Mapping[str, str]) -> Checkpoint:
        """A view whose tensor ``old`` is called ``mapping[old]`` (names not in ``mapping`` keep
        theirs); it shares this checkpoint's files and handles."""
        infos = {}
        sources = {}
        for old, info in self._infos.items():
            new = mapping.get(old, old)
            if new in infos:
                raise ValidationError(f"renaming {self.path}: two tensors would be called {new!r}")
            infos[new] = TensorInfo(new, info.shape, info.dtype, info.file, info.offset)
            sources[new] = self._source_names.get(old, old)
        return self._view(infos, sources)

    def aligned(self, drop: Iterable[str] = (), aliases: Mapping[str, str] | None = None) -> Checkpoint:
        """A view without the tensors ``drop`` and with each ``aliases`` name (absent here) reading
        the tensor of the name it maps to (a tied weight stored under one name only; that name may
        itself be dropped, the tensor then read under the alias only); it shares this checkpoint's
        files and handles."""
        gone = set(drop)
        infos = {k: v for k, v in self._infos.items() if k not in gone}
        sources = {k: self._source_names.get(k, k) for k in infos}
        for name, other in (aliases or {}).items():
            if name in infos or other not in self._infos:
                raise ValidationError(f"{self.path}: cannot read {name!r} as {other!r}")
            info = self._infos[other]
            infos[name] = TensorInfo(name, info.shape, info.dtype, info.file, info.offset)
            sources[name] = self._source_names.get(other, other)
        return self._view(infos, sources)

    def _view(self, infos: dict[str, TensorInfo], sources: dict[str, str]) -> Checkpoint:
        """A checkpoint of ``infos`` (name here -> its entry) reading each name as ``sources`` says
        (name here -> name in the file), sharing this one's files and handles."""
        view = Checkpoint(self.path, self.kind, infos, self.config, self._torch_state)
        view._handles = self._handles
        view._source_names = sources
        return view

    def close(self) -> None:
        self._handles.clear()
        if self._torch_state is not None:
            self._torch_state.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, kind={self.kind!r}, tensors={len(self)})"


def torch_load(path: str | os.PathLike[str], what: str, **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=True, map_location="cpu", **kwargs)``; a file it cannot read
    is a :class:`ValidationError` of one line naming ``what`` and ``path``. Tensors only: a file
    of pickled Python objects is refused, never executed (torch's own message would suggest
    ``weights_only=False``, which runs the file's code, and its pickle-protocol warning is muted)."""
    import warnings

    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            where = kwargs.pop("map_location", "cpu")
            try:
                return torch.load(str(path), map_location=where, weights_only=True, **kwargs)
            except RuntimeError as exc:
                if not (kwargs.get("mmap") and "mmap can only be used" in str(exc)):
                    raise
                # not a zip file: torch's legacy format, which loads without a memory map, or not a torch file
                # at all, which the second try says (torch's first message advised saving it again: a review,
                # stop 76)
                return torch.load(str(path), map_location=where, weights_only=True, **{**kwargs, "mmap": False})
    except Exception as exc:  # noqa: BLE001 - a corrupt / pickled-code file: report, don't leak
        text = str(exc)
        if "Weights only load failed" in text:
            detail = next((ln.strip() for ln in text.splitlines() if "WeightsUnpickler error" in ln), "")
            reason = ("it is not a PyTorch tensor file, or it holds pickled Python objects besides tensors "
                      "(never loaded: that would run code from the file)"
                      + (f"; {detail.rstrip(':')}" if detail and not detail.endswith(":") else ""))
        elif not zipfile.is_zipfile(str(path)):
            # (an empty file said "EOFError: ", a text file "KeyError: 101": a review, stop 76)
            said = first_line(exc)
            reason = f"it is not a PyTorch tensor file (torch.load: {type(exc).__name__}{': ' + said if said else ''})"
        else:
            reason = f"{type(exc).__name__}: {first_line(exc)}"
        raise ValidationError(f"cannot read {what} {path}: {reason}") from None


def load_torch_state(path: Path) -> dict[str, Any]:
    """Load a torch state dict file memory-mapped and with ``weights_only=True``."""
    import torch

    obj = torch_load(path, "torch checkpoint", mmap=True)
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValidationError(
            f"{path}: expected a state dict (a mapping of names to tensors, or "
            f"{{'state_dict': ...}}), got {type(obj).__name__}"
        )
    return dict(obj)


def _torch_infos(path: Path, state: Mapping[str, Any]) -> dict[str, TensorInfo]:
    return {n: TensorInfo(n, tuple(t.shape), _dtype_name(t.dtype), path) for n, t in state.items()}


def read_config(folder: Path) -> dict[str, Any] | None:
    """The parsed ``config.json`` of a folder, or ``None`` if it has none."""
    cfg = folder / "config.json"
    if not cfg.is_file():
        return None
    try:
        return json.loads(cfg.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValidationError(f"{cfg}: not valid JSON ({exc})") from None


#: sub-configs in which a composite model (Llava, Gemma 3, Qwen2-VL, ...) keeps its language model's settings
TEXT_SUBCONFIGS = ("text_config", "llm_config", "language_config")


def config_setting(config: Mapping[str, Any] | None, key: str) -> tuple[str, Any] | None:
    """``(where, value)`` of a Hugging Face config's setting ``key``: at its top level, else in the
    language model's sub-config of a composite model (:data:`TEXT_SUBCONFIGS`; ``where`` is then the
    dotted name, e.g. ``text_config.vocab_size``); ``None`` where neither holds it (or it is null)."""
    if not isinstance(config, Mapping):
        return None
    if config.get(key) is not None:
        return key, config[key]
    for sub in TEXT_SUBCONFIGS:
        inner = config.get(sub)
        if isinstance(inner, Mapping) and inner.get(key) is not None:
            return f"{sub}.{key}", inner[key]
    return None


def positive_int(value: Any) -> bool:
    """Whether a config value is a positive integer (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def config_int(config: Mapping[str, Any] | None, key: str) -> tuple[str, int] | None:
    """:func:`config_setting` (``(where, value)``) where its value is a positive integer (not a bool),
    else ``None``."""
    found = config_setting(config, key)
    return found if found is not None and positive_int(found[1]) else None


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValidationError(f"{index}: not a valid shard index (needs 'weight_map'): {exc}") from None
    if not isinstance(weight_map, dict):
        raise ValidationError(f"{index}: 'weight_map' must map tensor names to shard files")
    return {str(k): str(v) for k, v in weight_map.items()}


#: the file that marks a PEFT adapter, and what to do with one
PEFT_CONFIG = "adapter_config.json"
PEFT_ADVICE = "merge it into its base first (peft's merge_and_unload, then save_pretrained) and give that folder"


def is_peft_adapter(path: str | Path) -> bool:
    """Whether ``path`` is a PEFT adapter folder, or a file inside one (``adapter_config.json`` beside it)."""
    p = Path(path)
    return any((folder / PEFT_CONFIG).is_file() for folder in (p, p.parent))


def _open_folder(folder: Path) -> Checkpoint:
    # transformers' own order (a single file before an index, safetensors before torch): a folder
    # holding both is read as transformers loads it (before stop 53 the index came first, so a
    # merge read one model's residuals and evaluated another's weights)
    config = read_config(folder)
    if (folder / SAFETENSORS_SINGLE).is_file():
        infos, _ = read_safetensors_header(folder / SAFETENSORS_SINGLE)
        return Checkpoint(folder, "hf_safetensors", infos, config)
    if (folder / SAFETENSORS_INDEX).is_file():
        weight_map = _read_index(folder / SAFETENSORS_INDEX)
        infos: dict[str, TensorInfo] = {}
        for shard in dict.fromkeys(weight_map.values()):
            shard_path = folder / shard
            if not shard_path.is_file():
                raise ValidationError(f"{folder / SAFETENSORS_INDEX} names shard {shard!r}, which is missing")
            shard_infos, _ = read_safetensors_header(shard_path)
            for name, file in weight_map.items():
                if file == shard:
                    if name not in shard_infos:
                        raise ValidationError(f"shard {shard_path} lacks tensor {name!r} listed in its index")
                    infos[name] = shard_infos[name]
        return Checkpoint(folder, "hf_safetensors", infos, config)
    if (folder / TORCH_SINGLE).is_file():
        state = load_torch_state(folder / TORCH_SINGLE)
        return Checkpoint(folder, "hf_torch", _torch_infos(folder / TORCH_SINGLE, state), config,
                          torch_state={folder / TORCH_SINGLE: state})
    if (folder / TORCH_INDEX).is_file():
        weight_map = _read_index(folder / TORCH_INDEX)
        states = {}
        infos = {}
        for shard in dict.fromkeys(weight_map.values()):
            state = load_torch_state(folder / shard)
            states[folder / shard] = state
            infos.update(_torch_infos(folder / shard, state))
        return Checkpoint(folder, "hf_torch", infos, config, torch_state=states)
    adapter = next((n for n in ("adapter_model.safetensors", "adapter_model.bin") if (folder / n).is_file()), None)
    if adapter is not None and is_peft_adapter(folder):
        raise ValidationError(f"{folder}: a PEFT adapter ({adapter} + {PEFT_CONFIG}), not a model: {PEFT_ADVICE}")
    loose = sorted(p.name for p in folder.glob("*.safetensors"))
    if len(loose) == 1 and config is not None:
        # transformers would not load it: refused here, before the plan, not after it (stop 53 review)
        raise ValidationError(f"{folder}: holds config.json and {loose[0]} but no {SAFETENSORS_SINGLE}; "
                              f"transformers loads only {SAFETENSORS_SINGLE}, shards with {SAFETENSORS_INDEX}, "
                              f"{TORCH_SINGLE} or {TORCH_INDEX}: rename {loose[0]} to {SAFETENSORS_SINGLE}")
    if len(loose) == 1:
        infos, _ = read_safetensors_header(folder / loose[0])
        return Checkpoint(folder, "hf_safetensors", infos, config)
    raise ValidationError(
        f"{folder}: no weights found; a model folder holds {SAFETENSORS_SINGLE}, or shards with "
        f"{SAFETENSORS_INDEX} (or {TORCH_SINGLE} / {TORCH_INDEX})"
    )


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a checkpoint without loading its tensors (see the module docstring for formats)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ValidationError(f"checkpoint not found: {p}")
    if p.is_dir():
        return _open_folder(p)
    if p.suffix == ".safetensors":
        infos, _ = read_safetensors_header(p)
        return Checkpoint(p, "safetensors", infos, None)
    if p.suffix in TORCH_SUFFIXES:
        state = load_torch_state(p)
        return Checkpoint(p, "torch", _torch_infos(p, state), None, torch_state={p: state})
    raise ValidationError(
        f"{p}: unknown checkpoint format; expected a Hugging Face folder, a .safetensors file or "
        f"a torch file ({', '.join(TORCH_SUFFIXES)})"
    )


def weight_files(folder: Path) -> list[Path]:
    """Files of a folder that hold weights or their index (what a writer must not copy)."""
    out = []
    for p in folder.iterdir():
        if p.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf") or p.name.endswith(".index.json"):
            out.append(p)
    return out
