"""Calibration data for Hugging Face models: prompt files -> tokenised batches.

Prompt files (one per task):

- ``.txt``: one prompt per non-empty line (surrounding whitespace stripped);
- ``.jsonl``: one JSON object per non-empty line; the prompt is the object's ``field``
  (default ``"text"``); a line that is a bare JSON string is used as is;
- ``.json``: a list of strings, or of objects holding ``field``;
- ``.safetensors`` / ``.pt``: not prompts but ready model inputs, a dict of tensors sharing
  their first (sample) dimension, e.g. ``{"pixel_values": (N, C, H, W)}`` for a ViT.

Labelled prompts (a classification objective, ``metric: cross_entropy`` through a task's head):
each ``.jsonl`` / ``.json`` object also holds an integer class index under ``label_field``
(:func:`read_labelled_prompts`); in a tensor file, ``label_field`` names a ``(N,)`` integer
tensor that is taken out of the model's inputs. Each :class:`Batch` then carries its
``labels``.

Prompts are split into calibration and held-out prompts with a seeded permutation
(:func:`split_holdout`) and tokenised with the base model's tokenizer, right-padded per batch
(:func:`tokenize_batches`); the attention mask marks the real tokens, and only those positions
enter the statistics and the evaluation.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .text import read_text
from ..errors import ValidationError
from .checkpoint import torch_load

TEXT_SUFFIXES = (".txt", ".jsonl", ".json")
TENSOR_SUFFIXES = (".safetensors", ".pt", ".pth")


@dataclass(frozen=True)
class Batch:
    """One batch of model inputs: ``inputs`` (keyword arguments of the model's forward, e.g.
    ``input_ids`` and ``attention_mask`` of shape ``(B, T)``), and ``mask`` (``(B, T)`` of 0/1,
    the positions compared, or ``None`` when every position / the whole output counts);
    ``labels``: ``(B,)`` int64 class indices of labelled prompts, else ``None``. A left-padded
    batch of a model with absolute positions (GPT-2, OPT, BERT) needs ``position_ids`` among its
    inputs (``(attention_mask.cumsum(1) - 1).clamp_min(0)``), or its prompts are read at shifted
    positions (docs/statistics.md); mergeqp's own tokenisation pads on the right."""

    inputs: dict[str, Any]
    mask: Any = None
    labels: Any = None

    @property
    def size(self) -> int:
        first = next(iter(self.inputs.values()))
        return int(first.shape[0])

    @property
    def positions(self) -> int:
        """Prompts x positions of the first input (its first two axes; the prompts alone for a
        one-axis input): how many per-position outputs the batch has."""
        first = next(iter(self.inputs.values()))
        return int(first.shape[0]) * (int(first.shape[1]) if first.dim() >= 2 else 1)

    def to(self, device: Any) -> Batch:
        return Batch({k: v.to(device) for k, v in self.inputs.items()},
                     None if self.mask is None else self.mask.to(device),
                     None if self.labels is None else self.labels.to(device))


def read_records(path: str | Path, what: str = "prompt file") -> list[tuple[str, Any]]:
    """``(where, record)`` of each entry of a ``.txt`` / ``.jsonl`` / ``.json`` file, in order:
    ``.txt``: each non-empty line, stripped; ``.jsonl``: each non-empty line's JSON value;
    ``.json``: each element of its list. ``where`` names the file and line or index for errors;
    ``what`` names the file in them."""
    p = Path(path)
    suffix = p.suffix.lower()  # (FILE.JSONL as file.jsonl)
    if suffix not in TEXT_SUFFIXES:
        tensors = f" (or input tensors: {', '.join(TENSOR_SUFFIXES)})" if what == "prompt file" else ""
        raise ValidationError(f"{p}: {what}s are {', '.join(TEXT_SUFFIXES)}{tensors}; got {p.suffix!r}")
    if p.is_dir():
        raise ValidationError(f"{p}: a folder, not a {what}")
    # UTF-8 (a byte-order mark, written by some editors, is not part of the first text); errors name
    # the line and column of a byte that is not (a review's find, stop 67: a byte offset)
    text = read_text(p, what)
    # lines end at "\n" only (read_text turns "\r\n" and "\r" into it): str.splitlines also splits at
    # U+2028, U+0085 and form feeds, which JSON strings may hold (a review's valid JSONL was refused,
    # a .txt prompt split in two)
    if suffix == ".txt":
        return [(f"{p}:{n}", line.strip()) for n, line in enumerate(text.split("\n"), start=1) if line.strip()]
    if suffix == ".jsonl":
        records = []
        for number, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                continue
            try:
                records.append((f"{p}:{number}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ValidationError(f"{p}:{number}: not JSON ({exc.msg})") from None
        return records
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValidationError(f"{p}: not JSON ({exc.msg})") from None
    if not isinstance(data, list):
        raise ValidationError(f"{p}: a .json {what} holds a list of strings or objects")
    return [(f"{p}[{i}]", obj) for i, obj in enumerate(data)]


def read_prompts(path: str | Path, field: str = "text", max_prompts: int | None = None) -> list[str]:
    """Read the prompts of a ``.txt`` / ``.jsonl`` / ``.json`` file (see the module docstring)."""
    p = Path(path)
    prompts = [_prompt_of(obj, field, where) for where, obj in read_records(p)]
    prompts = [x for x in prompts if x.strip()]
    if max_prompts is not None:
        prompts = prompts[:max_prompts]
    if not prompts:
        raise ValidationError(f"{p}: no prompts found")
    return prompts


def read_labelled_prompts(path: str | Path, field: str, label_field: str,
                          max_prompts: int | None = None, classes: int | None = None) -> tuple[list[str], list[int]]:
    """``(prompts, labels)`` of a ``.jsonl`` / ``.json`` file of objects holding the prompt under
    ``field`` and an integer class index (``>= 0``, below ``classes`` when given: the rows of the
    task's head) under ``label_field``; as :func:`read_prompts`, blank prompts are skipped and
    ``max_prompts`` keeps the first ones. A bad label names its line."""
    p = Path(path)
    if p.suffix.lower() == ".txt":
        raise ValidationError(f"{p}: labelled prompts (label_field {label_field!r}) need a .jsonl or .json file of "
                              f"objects, not one prompt per line")
    prompts, labels = [], []
    for where, obj in read_records(p):
        if not isinstance(obj, dict):
            raise ValidationError(f"{where}: a labelled prompt is an object with {field!r} and {label_field!r}, "
                                  f"got {type(obj).__name__}")
        text = _prompt_of(obj, field, where)
        if label_field not in obj:
            raise ValidationError(f"{where}: object has no label field {label_field!r} (fields: {sorted(obj)})")
        labels.append(_class_index(obj[label_field], f"{where}: label {label_field!r}", classes))
        prompts.append(text)
    kept = [(x, y) for x, y in zip(prompts, labels) if x.strip()]
    if max_prompts is not None:
        kept = kept[:max_prompts]
    if not kept:
        raise ValidationError(f"{p}: no prompts found")
    return [x for x, _ in kept], [y for _, y in kept]


def _class_index(value: Any, where: str, classes: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValidationError(f"{where} is {value!r}: a class index (an integer >= 0, the row of the task's head)")
    if classes is not None and value >= classes:
        raise ValidationError(f"{where} is {value}, but the task's head has {classes} classes (labels are its row "
                              f"indices, 0 to {classes - 1})")
    return int(value)


def tensor_labels(data: dict[str, Any], label_field: str, where: str) -> Any:
    """Take the ``(N,)`` integer class indices ``label_field`` out of ready model inputs ``data``
    (in place) and return them as int64."""
    import torch

    if label_field not in data:
        raise ValidationError(f"{where}: no label tensor {label_field!r} (tensors: {sorted(data)})")
    labels = data.pop(label_field)
    if labels.dim() != 1 or labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
        raise ValidationError(f"{where}: label tensor {label_field!r} must be (N,) integers, got {labels.dtype} "
                              f"of shape {tuple(labels.shape)}")
    if labels.numel() and float(labels.to(torch.float64).max()) >= 2.0**62:  # (uint64: past int64)
        raise ValidationError(f"{where}: label tensor {label_field!r} has a class index >= 2^62")
    labels = labels.to(torch.int64)  # (torch has no min() for uint32 / uint64)
    if labels.numel() and int(labels.min()) < 0:
        raise ValidationError(f"{where}: label tensor {label_field!r} has a negative class index {int(labels.min())}")
    if not data:
        raise ValidationError(f"{where}: nothing but the labels {label_field!r}: no model inputs left")
    return labels


def _prompt_of(obj: Any, field: str, where: str) -> str:
    if isinstance(obj, str):
        return obj
    if isinstance(obj, dict):
        if field not in obj:
            raise ValidationError(f"{where}: object has no field {field!r} (fields: {sorted(obj)})")
        value = obj[field]
        if not isinstance(value, str):
            raise ValidationError(f"{where}: field {field!r} is {type(value).__name__}, not a string")
        return value
    raise ValidationError(f"{where}: expected a string or an object, got {type(obj).__name__}")


def holdout_count(n: int, holdout: float) -> int:
    """How many of ``n`` items a holdout spec (count, or fraction in (0, 1)) keeps aside.
    At least one item is always left for calibration."""
    if isinstance(holdout, float) and not float(holdout).is_integer():
        count = math.floor(holdout * n)
    else:
        count = int(holdout)
    return max(0, min(count, n - 1))


def split_holdout(items: Sequence[Any], holdout: float, seed: int) -> tuple[list[Any], list[Any]]:
    """``(calibration, held_out)``: a seeded permutation; ``held_out`` gets
    :func:`holdout_count` items, both keep the file order among themselves."""
    import numpy as np

    n = len(items)
    count = holdout_count(n, holdout)
    order = np.random.default_rng(seed).permutation(n)
    held = {int(i) for i in order[:count]}
    return [x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held]


def load_tokenizer(folder: str | Path) -> Any:
    """``AutoTokenizer`` of a model folder, with a pad token (eos or unk when it has none)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001 - a missing / broken tokenizer, reported by name
        raise ValidationError(f"cannot load a tokenizer from {folder}: {type(exc).__name__}: {exc}") from None
    if tok.pad_token is None:
        fallback = tok.eos_token or tok.unk_token
        if fallback is None:
            raise ValidationError(f"tokenizer of {folder} has no pad, eos or unk token to pad batches with")
        tok.pad_token = fallback
    tok.padding_side = "right"
    return tok


def tokenize_batches(tokenizer: Any, prompts: Sequence[str], max_length: int, batch_size: int,
                     labels: Sequence[int] | None = None) -> list[Batch]:
    """Tokenise ``prompts`` (truncated to ``max_length`` tokens) into right-padded batches of
    ``batch_size``; each :class:`Batch` holds ``input_ids``, ``attention_mask`` (``(B, T)``,
    int64) and uses the attention mask as its comparison mask; with ``labels`` (one class index
    per prompt), its ``labels``."""
    import torch

    batches = []
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start:start + batch_size])
        enc = tokenizer(chunk, truncation=True, max_length=max_length, padding=True, return_tensors="pt")
        ids = enc["input_ids"].to(torch.int64)
        mask = enc["attention_mask"].to(torch.int64)
        empty = [chunk[i] for i in range(len(chunk)) if int(mask[i].sum()) == 0]
        if empty:
            raise ValidationError(f"prompt(s) tokenise to nothing: {empty[:3]}")
        inputs = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in enc:
            inputs["token_type_ids"] = enc["token_type_ids"].to(torch.int64)
        chunk_labels = None if labels is None else torch.as_tensor(list(labels[start:start + batch_size]),
                                                                   dtype=torch.int64)
        batches.append(Batch(inputs, mask, chunk_labels))
    return batches


def read_tensor_inputs(path: str | Path) -> dict[str, Any]:
    """A dict of model-input tensors sharing the first dimension (``.safetensors`` / ``.pt``)."""
    import torch

    p = Path(path)
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            data = load_file(str(p))
        except Exception as exc:  # noqa: BLE001
            raise ValidationError(f"cannot read calibration tensors {p}: {exc}") from None
    else:
        data = torch_load(p, "calibration tensors")
    if not isinstance(data, dict) or not data or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise ValidationError(f"{p}: expected a dict of model-input tensors, e.g. {{'pixel_values': (N, C, H, W)}}")
    scalars = sorted(k for k, v in data.items() if v.dim() == 0)
    if scalars:
        raise ValidationError(f"{p}: tensor(s) {scalars} have no sample dimension (0-d); every input tensor is "
                              f"(N, ...), one row per sample")
    sizes = {k: int(v.shape[0]) for k, v in data.items()}
    if len(set(sizes.values())) != 1:
        raise ValidationError(f"{p}: input tensors disagree on the number of samples: {sizes}")
    mask = data.get("attention_mask")
    if mask is not None and mask.numel():
        # (stop 73, QA reviews: an all-zero mask ran on and a note blamed single-token prompts; an all-zero row
        # made Llama's outputs NaN, reported as a non-finite checkpoint)
        live = mask.reshape(mask.shape[0], -1).ne(0).any(dim=1)
        if not bool(live.any()):
            raise ValidationError(f"{p}: its attention_mask is 0 everywhere: no sample has a position the model "
                                  f"attends to, so nothing could be compared")
        if not bool(live.all()):
            dead = torch.nonzero(~live).flatten().tolist()
            raise ValidationError(f"{p}: row(s) {dead[:8]}{' ...' if len(dead) > 8 else ''} ({len(dead)} of "
                                  f"{int(live.numel())}) of its attention_mask are 0 everywhere: samples with no "
                                  f"position the model attends to (its outputs there are undefined); remove them")
    return dict(data)


def tensor_batches(data: dict[str, Any], indices: Sequence[int], batch_size: int,
                   labels: Any = None) -> list[Batch]:
    """Slice ready model inputs (``read_tensor_inputs``) at ``indices`` into batches. The
    ``attention_mask`` (if any) is the comparison mask; ``labels`` (``(N,)``, :func:`tensor_labels`)
    are sliced alike."""
    import torch

    out = []
    idx = list(indices)
    for start in range(0, len(idx), batch_size):
        sel = torch.as_tensor(idx[start:start + batch_size], dtype=torch.int64)
        inputs = {k: v.index_select(0, sel) for k, v in data.items()}
        out.append(Batch(inputs, inputs.get("attention_mask"), None if labels is None else labels.index_select(0, sel)))
    return out


def is_tensor_file(path: str | Path) -> bool:
    return Path(path).suffix in TENSOR_SUFFIXES


def unpadded_inputs(batches: Sequence[Batch], batch_size: int) -> list[dict[str, Any]]:
    """The examples of ``batches`` with their padding removed, regrouped into batches of
    examples of equal length (at most ``batch_size`` each, in order of first appearance).

    For statistics that would otherwise count padded positions (RegMean's input Gram matrices
    take every position as a row; Fisher's argmax labels cover every position). Text batches
    must be right-padded (as :func:`tokenize_batches` makes them): example ``i`` keeps its first
    ``mask[i].sum()`` positions of every ``(B, T)`` input (its ``attention_mask`` is then all
    ones). Batches without a mask (ready tensor inputs such as ``pixel_values``) are returned as
    they are. Returns ``model(**inputs)`` keyword dicts."""
    import torch

    if batch_size < 1:
        raise ValidationError(f"batch_size must be >= 1, got {batch_size}")
    groups: dict[int, list[dict[str, Any]]] = {}
    out: list[dict[str, Any]] = []
    for number, batch in enumerate(batches):
        if batch.mask is None:
            out.append(dict(batch.inputs))
            continue
        mask = batch.mask
        B, T = (int(s) for s in mask.shape)
        lengths = mask.sum(dim=1).tolist()
        for i, n in enumerate(int(x) for x in lengths):
            if n == 0 or not bool(torch.all(mask[i, :n] != 0)) or bool(torch.any(mask[i, n:] != 0)):
                raise ValidationError(
                    f"calibration batch {number}, example {i}: the attention mask is not right padding "
                    f"({mask[i].tolist()}); statistics need the real tokens to come first"
                )
            example = {}
            for key, value in batch.inputs.items():
                if value.dim() >= 2 and tuple(value.shape[:2]) == (B, T):
                    example[key] = value[i:i + 1, :n]
                else:
                    example[key] = value[i:i + 1]
            groups.setdefault(n, []).append(example)
    for examples in groups.values():
        for start in range(0, len(examples), batch_size):
            chunk = examples[start:start + batch_size]
            out.append({k: torch.cat([e[k] for e in chunk]) for k in chunk[0]})
    return out
