"""A sentence encoder whose lower blocks are frozen: cached block inputs, pooled embeddings, fine-tunes.

The text experiment trains and merges only tensors in the top blocks of an encoder whose blocks
form one ``nn.ModuleList`` (:func:`mergeqp.stats.prefix.block_stack`: ``encoder.layer`` of BERT,
RoBERTa, ELECTRA, MPNet, e.g. all-MiniLM-L6-v2's ``encoder.layer.5.output.dense``;
``transformer.layer`` of DistilBERT). Everything below the first trained block is the base's, so
its output is computed once per text and cached:

- :func:`block_inputs`: tokenise texts (truncated to ``max_length``, right-padded per batch of
  texts sorted by length) and record, per batch, the hidden states entering block ``first_block``
  ``(B, T, H)``, the attention mask ``(B, T)`` and every other argument the block receives (its
  mask in the model's own format, MPNet's position bias, ...: captured by a forward pre-hook and
  given again to every upper block, as the encoder gives the same ones to all of its blocks); the
  forward stops there.
- :func:`pooled_embeddings`: run blocks ``first_block..`` on cached inputs and mean-pool the last
  hidden state over real tokens: the sentence embedding ``(N, H)`` (all-MiniLM-L6-v2's pooling,
  without its final normalisation).
- :func:`finetune_encoder`: train the tensors named by ``train_patterns`` together with a linear
  head ``(C, H)`` on the pooled embedding (cross-entropy, Adam) and save the encoder as a Hugging
  Face folder plus ``head.safetensors`` and ``finetune.json`` (settings, key, loss curve). The
  folder is written atomically; a call whose key (base weights' identity, texts, labels,
  settings) matches an existing folder returns it without training.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ValidationError, first_line
from ..io.atomic import atomic_file, atomic_folder, save_safetensors, write_json_atomic
from ..run.checkpoints import TOKENIZER_FILES, has_tokenizer
from ..stats.prefix import block_stack
from .finetune_lm import (FINETUNE_RECORD, block_arguments, check_training_settings, damaged_files, trainable_names,
                          training_step)
from .finetune_lm import weights_identity  # one definition of a folder's weights identity

HEAD_FILE = "head.safetensors"


@dataclass(frozen=True)
class FeatureBatch:
    """Cached inputs of the first trained block for one batch: ``hidden`` ``(B, T, H)``, the
    tokens' ``attention_mask`` ``(B, T)`` (1 = real token), the block's own ``block_mask`` (any
    format the model uses, or ``None``), integer ``labels`` ``(B,)``, the texts' positions
    ``rows`` ``(B,)`` in the list given to :func:`block_inputs`, and the block's other arguments:
    ``block_args`` (positional, after the hidden states; the mask among them when it came so)
    and ``block_kwargs``."""

    hidden: Any
    attention_mask: Any
    block_mask: Any
    labels: Any
    rows: Any
    block_args: tuple = ()
    block_kwargs: dict = field(default_factory=dict)

    def sample(self, i: int) -> FeatureBatch:
        """Text ``i`` of the batch alone, cut to its real tokens (every block argument with the
        batch as its first axis is cut the same way: its last two axes where they are positions)."""
        real = int(self.attention_mask[i].sum())
        width = int(self.attention_mask.shape[1])
        return FeatureBatch(self.hidden[i:i + 1, :real], self.attention_mask[i:i + 1, :real],
                            _sample_of(self.block_mask, i, real, width, self.size), self.labels[i:i + 1],
                            self.rows[i:i + 1], tuple(_sample_of(a, i, real, width, self.size) for a in self.block_args),
                            {k: _sample_of(v, i, real, width, self.size) for k, v in self.block_kwargs.items()})

    @property
    def size(self) -> int:
        return int(self.hidden.shape[0])


def _sample_of(x: Any, i: int, real: int, width: int, batch: int) -> Any:
    """Sample ``i`` of a block argument ``x`` (a tensor with ``batch`` first, else ``x`` itself),
    its last two axes cut to ``real`` positions where they have the padded ``width``."""
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) == 0 or int(shape[0]) != batch:
        return x
    x = x[i:i + 1]
    for axis in (-1, -2):
        if x.dim() >= 1 - axis and int(x.shape[axis]) == width:
            x = x.narrow(x.dim() + axis, 0, real)
    return x


@dataclass(frozen=True)
class EncoderSettings:
    """How tasks are fine-tuned: ``train_patterns`` (globs over the encoder's parameter names,
    all in blocks >= the first trained block), ``epochs`` over the training batches, Adam ``lr``
    for the encoder tensors and ``head_lr`` for the head, ``batch_size`` texts of at most
    ``max_length`` tokens, ``seed``."""

    train_patterns: tuple[str, ...]
    epochs: int = 4
    lr: float = 1e-3
    head_lr: float = 1e-2
    batch_size: int = 32
    max_length: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        check_training_settings(self, counts=("epochs", "batch_size", "max_length"), rates=("lr", "head_lr"))


@dataclass(frozen=True)
class EncoderFinetune:
    """A fine-tuned task: ``folder`` (Hugging Face encoder + head), ``trained`` parameter names,
    ``head_weight`` ``(C, H)`` / ``head_bias`` ``(C,)`` (torch tensors), per-step ``losses``,
    wall ``seconds`` of training (0 when ``cached``) and the cache ``key``."""

    folder: Path
    trained: tuple[str, ...]
    head_weight: Any
    head_bias: Any
    losses: tuple[float, ...]
    seconds: float
    cached: bool
    key: str
    settings: dict[str, Any] = field(default_factory=dict)


def encoder_blocks(model: Any) -> Any:
    """The encoder's block list (``encoder.layer`` of BERT, ``transformer.layer`` of DistilBERT: the
    ``nn.ModuleList`` of one block class); an error names what is missing."""
    blocks = block_stack(model)
    if blocks is None:
        raise ValidationError(f"{type(model).__name__} has no stack of blocks (an nn.ModuleList of one block class); "
                              f"the text experiment needs a transformer encoder (e.g. BertModel)")
    return blocks


def block_prefix(model: Any) -> str:
    """The parameter-name prefix of the encoder's blocks (``encoder.layer``, ``transformer.layer``)."""
    blocks = encoder_blocks(model)
    return next(n for n, m in model.named_modules() if m is blocks)


def first_trained_block(names: Sequence[str], prefix: str = "encoder.layer") -> int:
    """The lowest block index among parameter names ``<prefix>.<i>.*``; a name outside the
    blocks is an error (everything below the first trained block is cached)."""
    pattern = re.compile(rf"(?:^|\.){re.escape(prefix)}\.(\d+)\.")
    blocks = []
    for n in names:
        m = pattern.search(n)
        if m is None:
            raise ValidationError(f"trained parameter {n!r} is not inside {prefix}.<i>; the text experiment "
                                  f"trains tensors of the top blocks only")
        blocks.append(int(m.group(1)))
    if not blocks:
        raise ValidationError("no trained parameters")
    return min(blocks)


#: ends of architecture names of a model with a head on top of its encoder (the run layer merges the
#: folder's own architecture, whose output is then the head's, not the encoder's hidden states)
HEAD_ARCHITECTURES = ("ForMaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
                      "ForMultipleChoice", "ForPreTraining", "ForNextSentencePrediction", "ForCausalLM",
                      "LMHeadModel")


def encoder_obstacle(config: Any) -> str | None:
    """Why a model ``config`` is not a bare encoder that the text experiment can use (``None``: it
    is): a decoder (``is_decoder``, or a family without a masked-LM form: Llama, GPT-2, ...), or
    a folder saved with a head (``BertForMaskedLM``, ...)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_decoder", False) or getattr(config, "is_encoder_decoder", False):
        return f"its config has is_decoder / is_encoder_decoder set (model_type {model_type!r})"
    if model_type is not None and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return (f"model_type {model_type!r} is not an encoder family (transformers has no masked-LM form of it, "
                f"as decoders such as Llama or GPT-2, whose attention is causal, have none)")
    archs = list(getattr(config, "architectures", None) or [])
    heads = [a for a in archs if a.endswith(HEAD_ARCHITECTURES)]
    if heads:
        return (f"it is saved as {heads[0]}, an encoder with a head; save the encoder alone "
                f"(model.base_model.save_pretrained(folder) with transformers) and pass that folder")
    return None


def check_encoder_folder(folder: str | Path) -> None:
    """Refuse (before any work) a ``folder`` that is not a bare encoder (:func:`encoder_obstacle`)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a folder it cannot read
        raise ValidationError(f"cannot read the model config of {folder}: {type(exc).__name__}: "
                              f"{first_line(exc)}") from None
    why = encoder_obstacle(config)
    if why is not None:
        raise ValidationError(f"{folder} is not a sentence encoder the text experiment can fine-tune: {why}")
    if not has_tokenizer(Path(folder)):  # (a QA review, stop 73: a tokenizer of 5 tokens was built, every word
        # became [UNK], and the run trained and cached before it stopped)
        raise ValidationError(f"{folder} has no tokenizer files ({', '.join(TOKENIZER_FILES[:4])}, ...): the text "
                              f"experiment tokenizes its texts with the base's own tokenizer")
    if not any(Path(folder).glob("*.safetensors")):  # the fine-tunes are written as the base's safetensors, edited
        raise ValidationError(f"{folder} holds no .safetensors weights (a pytorch_model.bin only?): the text experiment "
                              f"writes each fine-tune as a copy of the base's safetensors; save the base with "
                              f"save_pretrained(..., safe_serialization=True) first")


def load_encoder(folder: str | Path, device: str = "cpu") -> Any:
    """A frozen encoder in eval mode (eager attention, the run layer's choice, so that the block
    masks captured here fit the blocks of every model loaded the same way); a folder that
    ``transformers`` cannot load is an error naming it."""
    from transformers import AutoModel  # optional heavy dependency: the experiment runs on transformers

    try:
        try:
            model = AutoModel.from_pretrained(str(folder), attn_implementation="eager")
        except (ValueError, TypeError):
            model = AutoModel.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a folder it cannot read
        raise ValidationError(f"cannot load an encoder from {folder}: {type(exc).__name__}: "
                              f"{first_line(exc)}") from None
    model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def block_inputs(model: Any, tokenizer: Any, texts: Sequence[str], labels: Sequence[int], first_block: int,
                 max_length: int, batch_size: int, device: str = "cpu") -> list[FeatureBatch]:
    """Per batch of texts (sorted by token count), the inputs of block ``first_block``; see the
    module docstring. Tensors are kept on ``device``."""
    import torch

    blocks = encoder_blocks(model)
    if not 0 <= first_block < len(blocks):
        raise ValidationError(f"first trained block {first_block} outside the encoder's {len(blocks)} blocks")
    lengths = [len(ids) for ids in tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]]
    order = np.argsort(lengths, kind="stable")
    out = []
    for s in range(0, len(order), batch_size):
        rows = order[s: s + batch_size]
        enc = tokenizer([texts[i] for i in rows], return_tensors="pt", padding=True, truncation=True,
                        max_length=max_length)
        enc = {k: v.to(device) for k, v in enc.items()}
        args, kwargs = block_arguments(model, blocks[first_block], **enc)
        hidden = args[0] if args else kwargs["hidden_states"]
        mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
        out.append(FeatureBatch(hidden.detach(), enc["attention_mask"], mask,
                                torch.as_tensor(np.asarray(labels)[rows], dtype=torch.long, device=device),
                                torch.as_tensor(rows, dtype=torch.long), tuple(args[1:]),
                                {k: v for k, v in kwargs.items() if k != "hidden_states"}))
    return out


def run_top(model: Any, batch: FeatureBatch, first_block: int) -> Any:
    """The pooled embedding ``(B, H)`` of one cached batch through blocks ``first_block..``."""
    h = batch.hidden
    for block in list(encoder_blocks(model))[first_block:]:
        out = block(h, *batch.block_args, **batch.block_kwargs)
        h = out[0] if isinstance(out, tuple) else out
    m = batch.attention_mask.to(h.dtype).unsqueeze(-1)
    return (h * m).sum(1) / m.sum(1).clamp_min(1.0)


def pooled_embeddings(model: Any, batches: Sequence[FeatureBatch], first_block: int) -> tuple[Any, Any]:
    """``(embeddings (N, H), labels (N,))`` in the original text order (float32, CPU)."""
    import torch

    n = sum(len(b.rows) for b in batches)
    emb: Any = None
    labels = torch.empty(n, dtype=torch.long)
    with torch.no_grad():
        for b in batches:
            e = run_top(model, b, first_block).float().cpu()
            if emb is None:
                emb = torch.empty(n, e.shape[1])
            emb[b.rows] = e
            labels[b.rows] = b.labels.cpu()
    return emb, labels


def texts_key(*items: Any) -> str:
    """A short hash of strings, sequences of texts and label arrays (cache keys)."""
    h = hashlib.sha256()
    for item in items:
        if isinstance(item, str):
            h.update(b"s" + item.encode())
        elif isinstance(item, np.ndarray):
            h.update(b"a" + np.ascontiguousarray(item, dtype=np.int64).tobytes())
        else:
            for t in item:
                h.update(hashlib.sha256(str(t).encode()).digest())
        h.update(b"|")
    return h.hexdigest()[:24]


def cached_block_inputs(cache_dir: Path | None, base_folder: Path, model: Any, tokenizer: Any, texts: Sequence[str],
                        labels: np.ndarray, first_block: int, max_length: int, batch_size: int,
                        device: str = "cpu") -> tuple[list[FeatureBatch], bool]:
    """:func:`block_inputs`, stored in ``cache_dir/features/<key>.pt`` (atomic) and read back when
    the key (base weights, texts, labels, block, length, batch size) matches. Returns
    ``(batches, from_cache)``."""
    import torch

    key = texts_key(weights_identity(base_folder), texts, np.asarray(labels),
                    f"{first_block}:{max_length}:{batch_size}:block-arguments")
    path = None if cache_dir is None else Path(cache_dir) / "features" / f"{key}.pt"
    if path is not None and path.is_file():
        try:
            raw = torch.load(path, map_location=device, weights_only=True)
            return [FeatureBatch(**b) for b in raw], True
        except Exception:  # noqa: BLE001 - an unreadable cache entry is recomputed
            pass
    batches = block_inputs(model, tokenizer, texts, labels, first_block, max_length, batch_size, device)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with atomic_file(path, "wb") as fh:
                torch.save([asdict(b) for b in batches], fh)
        except (TypeError, AttributeError, RuntimeError, pickle.PicklingError):
            pass  # a block argument that cannot be stored: the features are recomputed next time
    return batches, False


def finetune_key(base_folder: Path, texts: Sequence[str], labels: np.ndarray, settings: EncoderSettings) -> str:
    return texts_key(weights_identity(base_folder), json.dumps(asdict(settings), sort_keys=True), texts,
                     np.asarray(labels))


def _read_cached(out: Path, key: str, log: Callable[[str], None] | None = None) -> EncoderFinetune | None:
    """The fine-tune cached in ``out`` under ``key``, or ``None``: none, another key's, or damaged
    files (:func:`~.finetune_lm.damaged_files`, checked before the head is read; said to ``log``)."""
    from safetensors.torch import load_file

    record_path = out / FINETUNE_RECORD
    if not (record_path.is_file() and (out / HEAD_FILE).is_file()):
        return None
    try:
        record = json.loads(record_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if record.get("key") != key:
        return None
    damage = damaged_files(out)
    if damage is not None:
        if log is not None:
            log(f"cached fine-tune {out} is damaged ({damage}): training it again")
        return None
    try:
        head = load_file(str(out / HEAD_FILE))
    except (OSError, ValueError, RuntimeError):
        return None
    return EncoderFinetune(out, tuple(record["trained"]), head["weight"], head["bias"], tuple(record["losses"]),
                           0.0, True, key, record.get("settings", {}))


def write_like_base(base: Path, staging: Path, tensors: dict[str, Any]) -> None:
    """Write a copy of the base folder's top-level files into ``staging`` with ``tensors`` (live
    parameter names) replaced in its safetensors: the same stored names, buffers and metadata as
    the base (``save_pretrained`` would drop stored buffers such as BERT's ``position_ids``, and
    a merge requires every model to hold the base's tensors)."""
    import shutil

    from safetensors import safe_open

    done = set()
    for f in sorted(base.iterdir()):
        if not f.is_file():
            continue
        if f.suffix != ".safetensors":
            shutil.copy2(f, staging / f.name)
            continue
        with safe_open(str(f), framework="pt") as fh:
            meta = fh.metadata()
            stored = {k: fh.get_tensor(k) for k in fh.keys()}
        for key in stored:
            for n, v in tensors.items():
                if key == n or key.endswith("." + n):
                    stored[key] = v.to(stored[key].dtype).contiguous()
                    done.add(n)
        save_safetensors(stored, str(staging / f.name), metadata=meta)
    missing = sorted(set(tensors) - done)
    if missing:
        raise ValidationError(f"{base}: trained tensors {missing[:4]} not found in its safetensors")


def finetune_encoder(base_folder: str | Path, batches: Sequence[FeatureBatch], texts: Sequence[str],
                     labels: np.ndarray, n_classes: int, out_folder: str | Path, settings: EncoderSettings, *,
                     device: str = "cpu", progress: bool = True,
                     log: Callable[[str], None] | None = None) -> EncoderFinetune:
    """Fine-tune (see the module docstring) on the cached training ``batches`` (made from
    ``texts`` / ``labels`` with the settings' ``max_length`` and ``batch_size``); ``texts`` and
    ``labels`` only enter the cache key. Returns the cached folder when its key matches."""
    import torch
    from tqdm.auto import tqdm

    base = Path(base_folder).expanduser()
    out = Path(out_folder).expanduser()
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / FINETUNE_RECORD).is_file())):
        raise ValidationError(f"fine-tune output {out} exists and is not a fine-tune folder of mergeqp (no "
                              f"{FINETUNE_RECORD}); it is never overwritten: choose another folder")
    key = finetune_key(base, texts, labels, settings)
    hit = _read_cached(out, key, log)
    if hit is not None:
        return hit
    torch.manual_seed(settings.seed)
    model = load_encoder(base, device)
    trained = trainable_names(model, settings.train_patterns)
    first = first_trained_block(trained, block_prefix(model))
    chosen = set(trained)
    params = []
    for name, p in model.named_parameters():
        p.requires_grad_(name in chosen)
        if name in chosen:
            params.append(p)
    hidden = int(batches[0].hidden.shape[-1])
    head = torch.nn.Linear(hidden, n_classes).to(device)
    opt = torch.optim.Adam([{"params": params, "lr": settings.lr},
                            {"params": head.parameters(), "lr": settings.head_lr}])
    gen = torch.Generator().manual_seed(settings.seed)
    losses: list[float] = []
    t0 = time.perf_counter()
    steps = settings.epochs * len(batches)
    bar = tqdm(total=steps, desc=f"fine-tune {out.name}", leave=False, disable=None if progress else True)
    for _ in range(settings.epochs):
        for i in torch.randperm(len(batches), generator=gen).tolist():
            b = batches[i]
            loss = torch.nn.functional.cross_entropy(head(run_top(model, b, first)), b.labels)
            training_step(opt, loss, losses, lambda value: f"fine-tune {out.name!r}: the loss became {value}; lower "
                                                           f"the learning rate (lr={settings.lr}, head_lr={settings.head_lr})")
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    seconds = time.perf_counter() - t0
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    weight = head.weight.detach().cpu().contiguous()
    bias = head.bias.detach().cpu().contiguous()
    record = {"key": key, "base": str(base), "trained": trained, "losses": losses, "seconds": seconds,
              "texts": len(texts), "classes": n_classes, "settings": asdict(settings)}
    tuned = {n: p.detach().cpu() for n, p in model.named_parameters() if n in chosen}
    with atomic_folder(out, overwrite=True) as staging:  # a stale fine-tune of another key is replaced
        write_like_base(base, staging, tuned)
        save_safetensors({"weight": weight, "bias": bias}, str(staging / HEAD_FILE))
        write_json_atomic(staging / FINETUNE_RECORD, record)
    if log is not None:
        log(f"fine-tuned {out.name}: {len(trained)} tensors + head, loss {np.mean(losses[:5]):.3f} -> "
            f"{np.mean(losses[-5:]):.3f} ({seconds:.0f} s)")
    return EncoderFinetune(out, tuple(trained), weight, bias, tuple(losses), seconds, False, key, asdict(settings))


__all__ = ["EncoderFinetune", "EncoderSettings", "FeatureBatch", "block_inputs", "block_prefix", "cached_block_inputs",
           "encoder_blocks", "finetune_encoder", "first_trained_block", "load_encoder", "pooled_embeddings",
           "run_top", "texts_key"]
