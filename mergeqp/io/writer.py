"""Write a merged model as a Hugging Face folder that ``AutoModel*.from_pretrained`` loads.

:func:`save_hf_folder` streams ``(name, tensor)`` pairs into safetensors shards: a shard is
flushed as soon as adding the next tensor would exceed ``max_shard_bytes``, so at most one
shard's worth of tensors is held at once. One shard is written as ``model.safetensors``;
several as ``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json``
(``{"metadata": {"total_size": bytes}, "weight_map": {name: shard}}``), the layout
``transformers`` writes and reads. ``config.json`` is copied from the source folder (its dtype
entry updated to the dtype written), and so are ``generation_config.json``, tokenizer and
processor files when present. The writer refuses to write into (or over) an input folder.

The folder is written atomically (:func:`mergeqp.io.atomic.atomic_folder`): it is assembled in
a hidden sibling folder and renamed into place once complete, so a full disk, Ctrl-C or an
error leaves the previous ``out_dir`` (or none) and never a partial model. Every floating-point
tensor is checked finite before it is written (a :class:`~mergeqp.errors.BadDataError` naming
the tensor). ``extra_files`` lets the caller add files (a report) that need the
:class:`WrittenModel` and must be in the folder when it appears.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import BadDataError, OutputError, ValidationError
from .atomic import (
    atomic_folder,
    check_output_folder,
    copy_file_atomic,
    save_safetensors,
    write_text_atomic,
)
from .checkpoint import SAFETENSORS_INDEX, SAFETENSORS_SINGLE, is_float_dtype, read_config

#: files copied from the source folder when present (besides config.json)
AUX_FILES: tuple[str, ...] = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja",
    "chat_template.json", "preprocessor_config.json", "processor_config.json",
    "video_preprocessor_config.json", "tekken.json",
)
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
#: how safetensors words a failed write: "... I/O error: No space left on device (os error 28)"
_SAFETENSORS_IO_ERROR = re.compile(r"I/O error: ([^(]*?)\s*(?:\(os error (\d+)\))?$")
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _custom_code(folder: Path | None, config: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The ``.py`` files at the top of ``folder`` when its model config (``config``; ``None``: its
    ``tokenizer_config.json``) names classes there (``auto_map``): a model or tokenizer with custom
    code does not load without them (stop 56 review: the written config kept its ``auto_map`` and
    ``from_pretrained(..., trust_remote_code=True)`` failed for want of ``configuration_*.py``)."""
    if folder is None or not folder.is_dir():
        return ()
    if config is None:
        try:
            config = json.loads((folder / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            return ()
    if not isinstance(config, Mapping) or not config.get("auto_map"):
        return ()
    return tuple(sorted(p.name for p in folder.glob("*.py") if p.is_file()))


#: a sentence-transformers folder's own files (beside ``modules.json``'s module folders)
SENTENCE_TRANSFORMERS_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")


def _sentence_transformers(folder: Path | None) -> tuple[str, ...]:
    """The files that make ``folder`` a sentence-transformers model, relative to it: its own
    (:data:`SENTENCE_TRANSFORMERS_FILES`) and every file of the module folders ``modules.json`` names
    (pooling, normalisation, dense layers: the base's, which a merge of the transformer does not
    change); none where it has no ``modules.json``. Without them ``SentenceTransformer(out)`` built a
    model without the base's Normalize step, whose embeddings were no longer unit vectors (a QA review,
    stop 76). A module path outside the folder, and a link, are left out; and none at all where the
    transformer module lies in a folder of its own (the merged weights are written at the top: its
    folder would bring the base's back into ``SentenceTransformer(out)``, a review of the fix)."""
    modules = _modules_json(folder)
    if folder is None or modules is None or _own_folder_transformer(modules) is not None:
        return ()
    names = [f for f in SENTENCE_TRANSFORMERS_FILES if (folder / f).is_file()]
    root = folder.resolve()
    for path in (_module_folder(m) for m in modules):
        if path is None:
            continue  # ("": the transformer itself, written above)
        sub = (folder / path).resolve()
        if not sub.is_dir() or not sub.is_relative_to(root) or sub == root:
            continue
        names.extend(str(p.relative_to(root)) for p in sorted(sub.rglob("*"))
                     if p.is_file() and not p.is_symlink() and p.resolve().is_relative_to(sub))
    return tuple(dict.fromkeys(names))


def _modules_json(folder: Path | None) -> list[Mapping[str, Any]] | None:
    """The entries (mappings) of ``folder``'s ``modules.json``, or ``None`` where it has none or it
    cannot be read (a file that is not a list: no entries)."""
    if folder is None or not (folder / "modules.json").is_file():
        return None
    try:
        modules = json.loads((folder / "modules.json").read_text())
    except (OSError, ValueError):
        return None
    return [m for m in modules if isinstance(m, Mapping)] if isinstance(modules, list) else []


def _module_folder(module: Mapping[str, Any]) -> str | None:
    """A ``modules.json`` entry's folder, ``None`` for the top of the model folder ("" or "." ...)."""
    path = module.get("path")
    return path if isinstance(path, str) and path.strip("/.") else None


def _own_folder_transformer(modules: list[Mapping[str, Any]]) -> str | None:
    """The folder of the transformer module where it lies in a folder of its own, else ``None``."""
    return next((_module_folder(m) for m in modules
                 if _module_folder(m) is not None and str(m.get("type", "")).endswith(".Transformer")), None)


def sentence_transformers_note(folder: str | Path | None) -> str | None:
    """What the written folder lacks where the base is a sentence-transformers model whose transformer
    module lies in a folder of its own (:func:`_sentence_transformers` copies nothing of it then), else
    ``None``."""
    modules = _modules_json(Path(folder).expanduser() if folder is not None else None)
    inner = None if modules is None else _own_folder_transformer(modules)
    if inner is None:
        return None
    return (f"the base is a sentence-transformers model whose transformer lies in {inner}/: the merged model is "
            f"written at the top of the folder, as a transformers model, without modules.json and the other "
            f"modules (SentenceTransformer(out) builds a transformer and a mean pooling, not the base's pipeline)")


def parse_size(value: int | str) -> int:
    """``"5GB"`` / ``"200MiB"`` / ``1000`` -> bytes (decimal units for KB/MB/GB, binary for KiB...)."""
    if isinstance(value, int):
        if value <= 0:
            raise ValidationError(f"size must be positive, got {value}")
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ValidationError(f"cannot parse size {value!r}; write e.g. 5GB, 500MB, 200MiB or a byte count")
    out = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if out <= 0:
        raise ValidationError(f"size must be positive, got {value!r}")
    return out


@dataclass(frozen=True)
class WrittenModel:
    """What :func:`save_hf_folder` wrote: the folder, its weight files, bytes and tensor count."""

    folder: Path
    weight_files: tuple[str, ...]
    total_bytes: int
    n_tensors: int
    copied: tuple[str, ...]
    index: str | None


def check_tensor_finite(name: str, tensor: Any, model: str) -> None:
    """Raise :class:`~mergeqp.errors.BadDataError` naming ``name`` and ``model`` when the
    floating-point torch ``tensor`` holds NaN or inf (integer / bool tensors always pass)."""
    import torch

    if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.numel() == 0:
        return
    try:
        bad = ~torch.isfinite(tensor)
    except (NotImplementedError, RuntimeError):  # float8 dtypes have no isfinite (a review, stop 73): upcast
        bad = ~torch.isfinite(tensor.to(torch.float32))
    if bool(bad.any()):
        count = int(bad.sum())
        first = tuple(int(i) for i in torch.nonzero(bad)[0]) if tensor.ndim else ()
        raise BadDataError(f"tensor {name!r} of {model} has {count} non-finite value(s) (NaN or inf), "
                           f"first at index {first}")


def cast_checked(name: str, tensor: Any, dtype: Any, model: str) -> Any:
    """``tensor`` cast to the torch ``dtype`` (``None``: as it is), refused with :class:`BadDataError` when
    the result holds NaN or inf: where the cast made them from finite values, as an overflow of
    ``dtype``'s range with the remedy (stop 60 review: a float16 output of values above 65,504 was
    reported as NaN or inf in the merge itself, sending the user to look for them in the checkpoints)."""
    import torch

    floating = isinstance(dtype, torch.dtype) and dtype.is_floating_point
    if dtype is not None and tensor.is_floating_point() and not floating:
        raise ValidationError(f"tensor {name!r} of {model}: the output dtype must be a floating-point torch dtype, got "
                              f"{dtype!r} (a cast would truncate the merged values)")
    out = tensor if dtype is None or not tensor.is_floating_point() else tensor.to(dtype)
    if out is not tensor and out.numel() and not bool(torch.isfinite(out).all()) and bool(torch.isfinite(tensor).all()):
        count = int((~torch.isfinite(out)).sum())
        largest = float(tensor.detach().abs().max())
        kind = str(out.dtype).replace("torch.", "")
        wider = ("float32, or bfloat16, which keeps float32's range" if torch.finfo(out.dtype).max < 1e38
                 else "float64")
        raise BadDataError(f"tensor {name!r} of {model}: {count} value(s) overflow {kind} when cast to it (largest "
                           f"magnitude {largest:.4g}; {kind} holds up to {torch.finfo(out.dtype).max:.4g}): write a "
                           f"wider output dtype ({wider})")
    check_tensor_finite(name, out, model)
    return out


def as_written(name: str, tensor: Any, dtype: Any, model: str) -> Any:
    """``tensor`` as :func:`save_hf_folder` writes it: detached, cast to ``dtype`` (:func:`cast_checked`),
    an own contiguous CPU copy (safetensors refuses shared or strided storage)."""
    return cast_checked(name, tensor.detach(), dtype, model).to("cpu").contiguous().clone()


def _config_with_dtype(config: Mapping[str, Any], dtype: str | None) -> dict[str, Any]:
    cfg = dict(config)
    if dtype is None:
        return cfg
    keys = [k for k in ("dtype", "torch_dtype") if k in cfg] or ["dtype"]
    for k in keys:
        cfg[k] = dtype
    return cfg


def save_hf_folder(
    out_dir: str | Path,
    tensors: Iterable[tuple[str, Any]],
    *,
    source_folder: str | Path | None = None,
    config: Mapping[str, Any] | None = None,
    tokenizer_folder: str | Path | None = None,
    max_shard_bytes: int | str = DEFAULT_MAX_SHARD_BYTES,
    dtype: Any = None,
    protected: Sequence[str | Path] = (),
    overwrite: bool = False,
    metadata: Mapping[str, str] | None = None,
    extra_files: Callable[[WrittenModel], Mapping[str, str]] | None = None,
    origin: Callable[[str], str] | None = None,
) -> WrittenModel:
    """Write ``tensors`` (an iterable of ``(name, torch.Tensor)``; consumed once, in order) as a
    Hugging Face folder.

    ``source_folder``: where ``config.json`` and auxiliary files are copied from (or pass
    ``config``); ``tokenizer_folder``: where tokenizer files come from (default the source).
    ``dtype``: torch dtype (or name) to cast floating tensors to (default: as given); the
    config's dtype entry records it. ``protected``: input paths the output must not overlap
    (``source_folder`` and ``tokenizer_folder`` are always protected).
    ``extra_files``: called with the result (its ``folder`` is the final ``out_dir``) before
    the folder is renamed into place; returns ``{file name: text}`` to write into it too (e.g.
    ``report.json`` / ``report.md``), so that the folder appears complete with them or not at all.
    ``origin(name)``: what a non-finite tensor's error names as its model (default "the merged
    model"; a merge names the base for the tensors it keeps from it).
    Raises :class:`~mergeqp.errors.BadDataError` for a non-finite tensor,
    :class:`~mergeqp.errors.OutputError` when the disk refuses a write; in both cases nothing
    changes at ``out_dir``.
    """
    import torch

    out = Path(out_dir).expanduser()
    sources = [Path(p) for p in (source_folder, tokenizer_folder) if p is not None]  # inputs too
    check_output_folder(out, [Path(p) for p in protected] + sources, overwrite=overwrite)
    limit = parse_size(max_shard_bytes)
    cast = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with atomic_folder(out, overwrite=overwrite) as staging:
        written = _write_folder(staging, tensors, limit, cast, metadata, source_folder, config,
                                tokenizer_folder, save_safetensors, final=out, origin=origin)
        written = replace(written, folder=out)
        for fname, text in (extra_files(written) if extra_files is not None else {}).items():
            write_text_atomic(staging / fname, text)
    return written


def _write_folder(out: Path, tensors: Iterable[tuple[str, Any]], limit: int, cast: Any,
                  metadata: Mapping[str, str] | None, source_folder: str | Path | None,
                  config: Mapping[str, Any] | None, tokenizer_folder: str | Path | None,
                  save_file: Callable[..., None], final: Path | None = None,
                  origin: Callable[[str], str] | None = None) -> WrittenModel:
    """Write the shards, index, config and auxiliary files into ``out`` (the staging folder);
    ``final``: the output folder it becomes, which a failed write names (not the staging file's
    internal name, a QA review, stop 73)."""
    import torch

    st_meta = {"format": "pt", "producer": "mergeqp"}
    st_meta.update({str(k): str(v) for k, v in (metadata or {}).items()})

    shards: list[tuple[str, list[str]]] = []
    current: dict[str, Any] = {}
    current_bytes = 0
    total = 0
    seen: set[str] = set()
    written_dtypes: set[str] = set()

    def where() -> str:
        folder = final if final is not None else out
        return f"the merged model's weights in {folder} (shard {len(shards) + 1})"

    def flush() -> None:
        nonlocal current, current_bytes
        if not current:
            return
        tmp = f"tmp-mergeqp-{len(shards):05d}.safetensors"
        try:
            save_file(current, str(out / tmp), metadata=st_meta)
        except OSError as exc:
            raise OutputError(f"cannot write {where()}: {exc.strerror or exc}; "
                              f"the output folder was not changed") from None
        except Exception as exc:  # noqa: BLE001 - safetensors reports a failed write as its own SafetensorError
            match = _SAFETENSORS_IO_ERROR.search(str(exc))
            if match is None:
                raise
            err = OutputError(f"cannot write {where()}: {match.group(1)}; the output folder was not "
                              f"changed")
            err.errno = int(match.group(2)) if match.group(2) else None
            raise err from None
        shards.append((tmp, list(current)))
        current, current_bytes = {}, 0

    for name, tensor in tensors:
        if name in seen:
            raise ValidationError(f"tensor {name!r} given twice to the writer")
        seen.add(name)
        if not isinstance(tensor, torch.Tensor):
            raise ValidationError(f"tensor {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        t = as_written(name, tensor, cast, "the merged model" if origin is None else origin(name))
        written_dtypes.add(str(t.dtype).replace("torch.", ""))
        nbytes = t.numel() * t.element_size()
        if current and current_bytes + nbytes > limit:
            flush()
        current[name] = t
        current_bytes += nbytes
        total += nbytes
    flush()
    if not shards:
        raise ValidationError("no tensors to write")

    files: list[str] = []
    index_name: str | None = None
    if len(shards) == 1:
        (out / shards[0][0]).rename(out / SAFETENSORS_SINGLE)
        files.append(SAFETENSORS_SINGLE)
    else:
        weight_map: dict[str, str] = {}
        n = len(shards)
        for i, (tmp, names) in enumerate(shards, start=1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            (out / tmp).rename(out / final)
            files.append(final)
            weight_map.update({nm: final for nm in names})
        write_text_atomic(out / SAFETENSORS_INDEX, json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        index_name = SAFETENSORS_INDEX

    copied: list[str] = []
    src = Path(source_folder).expanduser() if source_folder is not None else None
    cfg = dict(config) if config is not None else (read_config(src) if src is not None and src.is_dir() else None)
    if cfg is not None:
        float_dtypes = sorted(d for d in written_dtypes if is_float_dtype(d))
        dtype_name = float_dtypes[0] if len(float_dtypes) == 1 else None
        new_cfg = _config_with_dtype(cfg, dtype_name)
        source_cfg = src / "config.json" if src is not None and src.is_dir() else None
        if config is None and new_cfg == cfg and source_cfg is not None and source_cfg.is_file():
            copy_file_atomic(source_cfg, out / "config.json")  # unchanged: the very bytes
        else:
            write_text_atomic(out / "config.json", json.dumps(new_cfg, indent=2))
        copied.append("config.json")
    tok = Path(tokenizer_folder).expanduser() if tokenizer_folder is not None else src
    for folder, names in ((src, ("generation_config.json", "preprocessor_config.json",
                                 *(_custom_code(src, cfg) if cfg is not None else ()))),
                          (tok, AUX_FILES), (tok, _custom_code(tok, None)), (src, _sentence_transformers(src))):
        if folder is None or not folder.is_dir():
            continue
        for fname in names:
            if fname in copied:
                continue
            if (folder / fname).is_file():
                (out / fname).parent.mkdir(parents=True, exist_ok=True)  # (a module folder's files)
                copy_file_atomic(folder / fname, out / fname)
                copied.append(fname)
    return WrittenModel(out, tuple(files), total, len(seen), tuple(copied), index_name)
