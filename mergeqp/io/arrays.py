"""Small arrays named by a config file: a 2-D matrix from ``.npy``, ``.npz`` (its only array),
``.pt`` / ``.pth`` (a tensor), ``.safetensors`` (its only tensor) or text (``.txt`` / ``.csv``);
a linear classifier head (``weight`` and an optional ``bias``) from ``.safetensors``, ``.pt`` /
``.pth`` (a dict of tensors) or ``.npz``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import BadDataError, ValidationError
from .checkpoint import torch_load

MATRIX_SUFFIXES = (".npy", ".npz", ".pt", ".pth", ".safetensors", ".txt", ".csv")


def _named_file(path: str | Path, what: str, suffixes: tuple[str, ...], hint: str = "") -> tuple[Path, str]:
    """``(path, lower-case suffix)`` of an existing file with one of ``suffixes``, else an error
    naming ``what`` and the file."""
    p = Path(path)
    if p.is_dir():
        raise ValidationError(f"{what}: {p} is a folder; give the file in it ({', '.join(suffixes)}){hint}")
    if not p.is_file():
        raise ValidationError(f"{what}: file not found: {p}")
    ext = p.suffix.lower()
    if ext not in suffixes:
        raise ValidationError(f"{what}: {p} is not one of {', '.join(suffixes)}{hint}")
    return p, ext


def _unreadable(what: str, p: Path, exc: Exception) -> ValidationError:
    """One line for a file numpy, torch or safetensors could not read; never numpy's advice to load
    pickled data (``allow_pickle``), which would run the file's code (a QA review, stop 73: a text file
    named ``heads.npy`` as ``output.matrix``)."""
    if "allow_pickle" in str(exc):
        return ValidationError(f"{what}: cannot read {p}: it is not an array of numbers in {p.suffix} format "
                               f"(numpy reads it as pickled Python objects, which mergeqp never loads)")
    return ValidationError(f"{what}: cannot read {p}: {type(exc).__name__}: {exc}")


def read_matrix(path: str | Path, what: str = "matrix") -> np.ndarray:
    """The 2-D float64 array in ``path`` (formats above); an unreadable file, another shape or a
    non-finite entry is an error naming ``what`` and the file."""
    p, ext = _named_file(path, what, MATRIX_SUFFIXES)
    try:
        if ext == ".npz":
            with np.load(p, allow_pickle=False) as data:
                if len(data.files) != 1:
                    raise ValidationError(f"{what}: {p} holds {sorted(data.files)}; it must hold one array")
                arr = data[data.files[0]]
        elif ext in (".pt", ".pth"):
            import torch  # deferred: torch is heavy
            value = torch_load(p, what)
            if not isinstance(value, torch.Tensor):
                raise ValidationError(f"{what}: {p} holds a {type(value).__name__}, not a tensor")
            arr = value.detach().to(torch.float64).numpy()
        elif ext == ".safetensors":
            from safetensors.numpy import load_file  # deferred: only for this format

            tensors = load_file(str(p))
            if len(tensors) != 1:
                raise ValidationError(f"{what}: {p} holds {sorted(tensors)}; it must hold one tensor")
            arr = next(iter(tensors.values()))
        elif ext in (".txt", ".csv"):
            arr = np.loadtxt(p, delimiter="," if ext == ".csv" else None, ndmin=2)
        else:
            arr = np.load(p, allow_pickle=False)
    except ValidationError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unreadable file: one clear line
        raise _unreadable(what, p, exc) from None
    arr = np.asarray(arr)
    if arr.ndim != 2 or 0 in arr.shape or not np.issubdtype(arr.dtype, np.number):
        raise ValidationError(f"{what}: {p} holds an array of shape {arr.shape} and type {arr.dtype}; "
                              "expected a 2-D matrix of numbers")
    arr = arr.astype(np.float64)
    if not np.all(np.isfinite(arr)):
        raise BadDataError(f"{what}: {p} has {int(np.sum(~np.isfinite(arr)))} non-finite entries")
    return arr


HEAD_SUFFIXES = (".safetensors", ".pt", ".pth", ".npz")


def read_head(path: str | Path, what: str = "head") -> tuple[np.ndarray, np.ndarray | None]:
    """``(weight, bias)`` of a linear classifier head stored as named tensors ``weight``
    (``(classes, features)``) and optionally ``bias`` (``(classes,)``), float64; anything else is an
    error naming ``what`` and the file."""
    p, ext = _named_file(path, what, HEAD_SUFFIXES, " (named tensors weight, bias)")
    try:
        if ext == ".npz":
            with np.load(p, allow_pickle=False) as data:
                tensors = {k: np.asarray(data[k]) for k in data.files}
        else:
            import torch  # deferred: torch is heavy (and safetensors.numpy has no bfloat16)

            if ext == ".safetensors":
                from safetensors.torch import load_file  # deferred: only for this format

                value = load_file(str(p))
            else:
                value = torch_load(p, what)
            if not isinstance(value, dict) or not all(isinstance(v, torch.Tensor) for v in value.values()):
                raise ValidationError(f"{what}: {p} holds a {type(value).__name__}, not a dict of tensors "
                                      f"(weight, bias)")
            # real floats (bfloat16 too) become float64; complex and boolean tensors keep their kind
            # for the checks below (a cast would drop an imaginary part silently)
            tensors = {str(k): v.detach().numpy() if v.is_complex() or v.dtype == torch.bool
                       else v.detach().to(torch.float64).numpy() for k, v in value.items()}
    except ValidationError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unreadable file: one clear line
        raise _unreadable(what, p, exc) from None
    if "weight" not in tensors:
        raise ValidationError(f"{what}: {p} has no tensor 'weight' (tensors: {sorted(tensors)})")
    extra = sorted(set(tensors) - {"weight", "bias"})
    if extra:
        raise ValidationError(f"{what}: {p} holds {extra} besides weight and bias")
    weight = np.asarray(tensors["weight"])
    not_real = [k for k, v in tensors.items() if not (np.issubdtype(np.asarray(v).dtype, np.number)
                                                      and not np.iscomplexobj(v))]
    if weight.ndim != 2 or weight.shape[0] < 2 or weight.shape[1] < 1 or "weight" in not_real:
        # (its dtype only when it is not real: real tensors were read as float64 above, whatever they held)
        kind = f" and type {weight.dtype}" if "weight" in not_real else ""
        raise ValidationError(f"{what}: {p}: weight has shape {weight.shape}{kind}; expected "
                              f"(classes >= 2, features) real numbers")
    bias = None
    if "bias" in tensors:
        if "bias" in not_real:
            raise ValidationError(f"{what}: {p}: bias has type {np.asarray(tensors['bias']).dtype}; expected real "
                                  f"numbers")
        bias = np.asarray(tensors["bias"]).astype(np.float64)
        if bias.shape != (weight.shape[0],):
            hint = (f"; the weight looks transposed: (features, classes) = {weight.shape} with a bias of "
                    f"{bias.shape[0]} classes, expected (classes, features)"
                    if bias.ndim == 1 and bias.shape[0] == weight.shape[1] else "")
            raise ValidationError(f"{what}: {p}: bias has shape {bias.shape}, expected ({weight.shape[0]},) "
                                  f"(one per class){hint}")
    weight = weight.astype(np.float64)
    for name, arr in (("weight", weight), ("bias", bias)):
        if arr is not None and not np.all(np.isfinite(arr)):
            raise BadDataError(f"{what}: {p}: {name} has {int(np.sum(~np.isfinite(arr)))} non-finite entries")
    return weight, bias


__all__ = ["HEAD_SUFFIXES", "MATRIX_SUFFIXES", "read_head", "read_matrix"]
