"""Tiny Hugging Face checkpoints built offline for the HF-merging tests.

``make_family(tmp, arch)`` writes a base model folder (with a word-level tokenizer built with
the ``tokenizers`` library), K fine-tuned copies whose chosen layers are perturbed (seeded;
the rest identical to the base), and one prompt file per task. Architectures: ``llama``
(LlamaForCausalLM), ``gpt2`` (GPT2LMHeadModel: Conv1D projections, tied embeddings) and
``bert`` (BertForMaskedLM).
"""

from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

WORDS = ["the", "a", "cat", "dog", "runs", "sits", "on", "mat", "code", "def", "return", "x", "y", "plus", "two", "one", "three", "=", "(", ")", "math", "is", "fun", "print", "if", "else", "for", "in", "range", "list", "sum", "zero", "four", "five", "times", "minus", "equals", "proof", "lemma"]
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "[CLS]", "[SEP]", "[MASK]"]
TASK_WORDS = {
    "code": ["code", "def", "return", "x", "y", "print", "if", "else", "for", "in", "range", "list", "=", "(", ")"],
    "math": ["math", "plus", "two", "one", "three", "sum", "zero", "four", "five", "times", "minus", "equals", "proof", "lemma"],
    "story": ["the", "a", "cat", "dog", "runs", "sits", "on", "mat", "is", "fun"],
}
ARCHS = ("llama", "gpt2", "bert")
#: an MLP projection and the linear layers of one block, per architecture
MLP_LAYER = {"llama": "model.layers.1.mlp.down_proj", "gpt2": "transformer.h.1.mlp.c_fc",
             "bert": "bert.encoder.layer.1.intermediate.dense"}
BLOCK_PATTERN = {"llama": "model.layers.1.*", "gpt2": "transformer.h.1.*",
                 "bert": "bert.encoder.layer.1.*"}


def vocab() -> dict[str, int]:
    return {w: i for i, w in enumerate(SPECIALS + WORDS)}


def build_tokenizer(folder: Path, extra_word: str | None = None) -> None:
    """A word-level fast tokenizer over :data:`WORDS` (``extra_word`` changes the vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    v = vocab()
    if extra_word is not None:
        v = dict(v)
        v[extra_word] = len(v)
    tok = Tokenizer(models.WordLevel(vocab=v, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>", mask_token="[MASK]")
    fast.save_pretrained(str(folder))


def make_config(arch: str):
    from transformers import BertConfig, GPT2Config, LlamaConfig

    V = len(vocab())
    if arch == "llama":
        return LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                           pad_token_id=0, bos_token_id=2, eos_token_id=3)
    if arch == "gpt2":
        return GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=64,
                          bos_token_id=2, eos_token_id=3, pad_token_id=0)
    if arch == "bert":
        return BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=32, max_position_embeddings=64, pad_token_id=0)
    raise ValueError(arch)


def model_class(arch: str):
    from transformers import BertForMaskedLM, GPT2LMHeadModel, LlamaForCausalLM

    return {"llama": LlamaForCausalLM, "gpt2": GPT2LMHeadModel, "bert": BertForMaskedLM}[arch]


def auto_class(arch: str):
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    return AutoModelForMaskedLM if arch == "bert" else AutoModelForCausalLM


def build_base(folder: Path, arch: str, seed: int = 0, tokenizer: bool = True):
    import torch

    torch.manual_seed(seed)
    model = model_class(arch)(make_config(arch)).eval()
    # larger-than-default weights so that the tiny models are not nearly constant
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(str(folder))
    if tokenizer:
        build_tokenizer(folder)
    return model


def perturb(base_folder: Path, out: Path, arch: str, patterns, scale: float, seed: int) -> None:
    """A fine-tuned copy: matching 2-D weights (and biases) get seeded Gaussian noise of std
    ``scale * std(weight)``; everything else is identical to the base."""
    import torch

    model = auto_class(arch).from_pretrained(str(base_folder), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            module = name.rsplit(".", 1)[0]
            if any(fnmatch.fnmatchcase(module, pat) for pat in patterns):
                std = float(p.std()) if p.numel() > 1 else 0.1
                p.add_(torch.randn(p.shape, generator=gen) * scale * max(std, 0.05))
    model.save_pretrained(str(out))


def sentences(task: str, n: int, seed: int, length: tuple[int, int] = (4, 10)) -> list[str]:
    import random

    rng = random.Random(seed)
    words = TASK_WORDS[task]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(*length))) for _ in range(n)]


@dataclass
class Family:
    root: Path
    arch: str
    base: Path
    finetuned: list[Path]
    prompts: list[Path]
    tasks: list[str]


def make_family(root: Path, arch: str, K: int = 2, perturbed: tuple[str, ...] | None = None,
                scale: float = 0.3, n_prompts: int = 12, seed: int = 0) -> Family:
    """Write base, K fine-tuned folders and K prompt files (``.jsonl`` then ``.txt``) under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    base = root / "base"
    build_base(base, arch, seed=seed)
    patterns = perturbed if perturbed is not None else (BLOCK_PATTERN[arch],)
    tasks = list(TASK_WORDS)[:K]
    fts, prompts = [], []
    for k, task in enumerate(tasks):
        ft = root / f"ft_{task}"
        perturb(base, ft, arch, patterns, scale, seed=seed + 100 + k)
        fts.append(ft)
        lines = sentences(task, n_prompts, seed=seed + k)
        if k % 2 == 0:
            p = root / f"{task}.jsonl"
            p.write_text("\n".join(json.dumps({"text": s}) for s in lines) + "\n")
        else:
            p = root / f"{task}.txt"
            p.write_text("\n".join(lines) + "\n")
        prompts.append(p)
    return Family(root, arch, base, fts, prompts, tasks)


def write_config(fam: Family, path: Path, layers, method: dict, **extra) -> Path:
    import yaml

    cfg = {
        "base": str(fam.base),
        "models": [{"name": t, "path": str(ft), "calibration": str(p)}
                   for t, ft, p in zip(fam.tasks, fam.finetuned, fam.prompts)],
        "layers": list(layers) if not isinstance(layers, str) else [layers],
        "method": method,
        "calibration": {"max_length": 12, "batch_size": 4, "holdout": 4},
        "dtype": "float64",
        "device": "cpu",
    }
    cfg.update(extra)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def file_digests(folder: Path) -> dict[str, tuple[int, int]]:
    """``name -> (size, mtime_ns)`` of every file under ``folder`` (to check inputs are untouched)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(folder))] = (st.st_size, st.st_mtime_ns)
    return out


def make_vit_family(root: Path, K: int = 2, scale: float = 0.3, n_images: int = 12, seed: int = 0) -> Family:
    """A tiny ViTForImageClassification (8x8 one-channel images, 3 labels), K fine-tuned copies
    perturbed in block 1, and per-task calibration inputs as ``.safetensors`` files holding
    ``pixel_values`` ``(N, 1, 8, 8)``."""
    import torch
    from safetensors.torch import save_file
    from transformers import ViTConfig, ViTForImageClassification

    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                    image_size=8, patch_size=4, num_channels=1, num_labels=3)
    model = ViTForImageClassification(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    base = root / "base"
    model.save_pretrained(str(base))
    fts, inputs = [], []
    gen = torch.Generator().manual_seed(seed + 1)
    for k in range(K):
        ft = root / f"ft{k}"
        m = ViTForImageClassification.from_pretrained(str(base))
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.startswith(("vit.encoder.layer.1.", "vit.layers.1.")):  # transformers 4 / 5 names
                    p.add_(torch.randn(p.shape, generator=gen) * scale * max(float(p.std()) if p.numel() > 1 else 0.1, 0.05))
        m.save_pretrained(str(ft))
        fts.append(ft)
        x = torch.randn(n_images, 1, 8, 8, generator=gen) + (k - 0.5)
        save_file({"pixel_values": x.contiguous()}, str(root / f"task{k}.safetensors"))
        inputs.append(root / f"task{k}.safetensors")
    return Family(root, "vit", base, fts, inputs, [f"task{k}" for k in range(K)])
