"""Fixtures for the baseline-merge tests: random task vectors, tiny Llama checkpoints written
offline, running mergekit on them through its command line, and small models."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

#: the one tensor that gets a DARE density < 1 in the mergekit runs (mergekit's filter is a
#: substring match), so that mergekit's global RNG draws masks for this tensor only
DARE_TENSOR = "model.layers.1.mlp.down_proj.weight"


def random_family(shape=(16, 12), K=3, seed=0, dtype=torch.float32):
    """``(base, [finetuned])`` tensors: base ~ N(0,1), finetuned = base + N(0,1)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g, dtype=dtype)
    return base, [base + torch.randn(shape, generator=g, dtype=dtype) for _ in range(K)]


def require(module: str):
    """Import ``module`` or skip the test with the reason."""
    return pytest.importorskip(module, reason=f"{module} is not installed (a test-only dependency)")


def mergekit_cli() -> str:
    """Path of ``mergekit-yaml`` beside this interpreter (skip when absent)."""
    require("mergekit")
    exe = Path(sys.executable).parent / "mergekit-yaml"
    if exe.exists():
        return str(exe)
    found = shutil.which("mergekit-yaml")
    if found is None:
        pytest.skip("mergekit is importable but its mergekit-yaml script is not on this interpreter's path")
    return found


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False)


def make_llama_family(folder: Path, K: int = 2, seed: int = 0, scale: float = 0.02):
    """Write ``base`` and ``ft{k}`` Llama folders under ``folder``; return ``(base_dir,
    [ft_dirs], base_state, [ft_states])`` (states: float32 CPU dicts)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config()).eval()
    base_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    base_dir = folder / "base"
    model.save_pretrained(base_dir)
    g = torch.Generator().manual_seed(seed + 1)
    ft_dirs, ft_states = [], []
    for k in range(K):
        state = {n: v + scale * torch.randn(v.shape, generator=g) for n, v in base_state.items()}
        model.load_state_dict(state)
        d = folder / f"ft{k}"
        model.save_pretrained(d)
        ft_dirs.append(d)
        ft_states.append(state)
    return base_dir, ft_dirs, base_state, ft_states


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    if not out:
        raise AssertionError(f"no safetensors written in {folder}: {sorted(p.name for p in folder.iterdir())}")
    return out


def run_mergekit(config: str, folder: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write ``config`` (YAML text) and run ``mergekit-yaml`` offline; return the merged tensors."""
    exe = mergekit_cli()
    cfg = folder / "merge.yml"
    cfg.write_text(config)
    out = folder / "out"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([exe, str(cfg), str(out), "--no-copy-tokenizer", "--random-seed", str(seed),
                           "--lazy-unpickle", "--quiet"],
                          capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"mergekit-yaml failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return read_folder(out)


def max_abs_diff(a: dict, b: dict) -> tuple[float, str]:
    """Largest |a - b| over the shared keys (which must be all keys of both) and where."""
    assert set(a) == set(b), (sorted(set(a) ^ set(b)))[:5]
    worst, where = 0.0, ""
    for k in a:
        d = float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0
        if d > worst:
            worst, where = d, k
    return worst, where


class TinyMLP(torch.nn.Module):
    """A 3-layer MLP classifier with an integer buffer (for the 'loads and runs' checks)."""

    def __init__(self, d_in=6, hidden=8, classes=3):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, classes)
        self.register_buffer("steps", torch.tensor(7, dtype=torch.int64))

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def mlp_family(K=2, seed=0, scale=0.3):
    """``(model, base_state, [ft_states])`` for :class:`TinyMLP`."""
    torch.manual_seed(seed)
    model = TinyMLP()
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(seed + 1)
    fts = [{k: (v + scale * torch.randn(v.shape, generator=g)) if v.is_floating_point() else v.clone()
            for k, v in base.items()} for _ in range(K)]
    return model, base, fts
