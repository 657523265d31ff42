"""Fixtures of the baseline-merge tests: random task vectors, a small MLP family, tiny Llama
checkpoints written offline, and running mergekit on them through its command line."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch


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


@pytest.fixture(scope="session")
def random_family() -> Callable[..., tuple]:
    """``random_family(shape=(16, 12), K=3, seed=0, dtype=float32) -> (base, [finetuned])``
    tensors of ``shape``: base ~ N(0,1), finetuned = base + N(0,1)."""

    def _random_family(shape=(16, 12), K=3, seed=0, dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        base = torch.randn(shape, generator=g, dtype=dtype)
        return base, [base + torch.randn(shape, generator=g, dtype=dtype) for _ in range(K)]

    return _random_family


@pytest.fixture(scope="session")
def mlp_family() -> Callable[..., tuple]:
    """``mlp_family(K=2, seed=0, scale=0.3) -> (model, base_state, [ft_states])`` for a 3-layer
    MLP classifier 6-8-8-3 with an integer buffer (``type(model)()`` builds a fresh one)."""

    def _mlp_family(K=2, seed=0, scale=0.3):
        torch.manual_seed(seed)
        model = TinyMLP()
        base = {k: v.detach().clone() for k, v in model.state_dict().items()}
        g = torch.Generator().manual_seed(seed + 1)
        fts = [{k: (v + scale * torch.randn(v.shape, generator=g)) if v.is_floating_point() else v.clone()
                for k, v in base.items()} for _ in range(K)]
        return model, base, fts

    return _mlp_family


@pytest.fixture(scope="session")
def require() -> Callable[[str], object]:
    """``require(module)``: import ``module`` or skip the test with the reason."""

    def _require(module: str):
        return pytest.importorskip(module, reason=f"{module} is not installed (a test-only dependency)")

    return _require


@pytest.fixture(scope="session")
def mergekit_cli(require) -> Callable[[], str]:
    """``mergekit_cli()``: path of ``mergekit-yaml`` beside this interpreter (skip when absent)."""

    def _mergekit_cli() -> str:
        require("mergekit")
        exe = Path(sys.executable).parent / "mergekit-yaml"
        if exe.exists():
            return str(exe)
        found = shutil.which("mergekit-yaml")
        if found is None:
            pytest.skip("mergekit is importable but its mergekit-yaml script is not on this interpreter's path")
        return found

    return _mergekit_cli


@pytest.fixture(scope="session")
def llama_config() -> Callable[[], object]:
    """``llama_config()``: a tiny ``LlamaConfig`` (vocabulary 128, hidden 64, 2 layers, untied)."""

    def _llama_config():
        from transformers import LlamaConfig  # deferred: heavy, and skipped where it is missing

        return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           tie_word_embeddings=False)

    return _llama_config


@pytest.fixture(scope="session")
def make_llama_family(llama_config) -> Callable[..., tuple]:
    """``make_llama_family(folder, K=2, seed=0, scale=0.02)``: write ``base`` and ``ft{k}`` Llama
    folders under ``folder``; return ``(base_dir, [ft_dirs], base_state, [ft_states])`` (states:
    float32 CPU dicts)."""

    def _make_llama_family(folder: Path, K: int = 2, seed: int = 0, scale: float = 0.02):
        from transformers import LlamaForCausalLM  # deferred: heavy, and skipped where it is missing

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

    return _make_llama_family


@pytest.fixture(scope="session")
def read_folder() -> Callable[[Path], dict[str, torch.Tensor]]:
    """``read_folder(folder)``: every tensor of the ``*.safetensors`` files in ``folder``."""

    def _read_folder(folder: Path) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file  # deferred: only the checkpoint tests need it

        out: dict[str, torch.Tensor] = {}
        for f in sorted(folder.glob("*.safetensors")):
            out.update(load_file(str(f)))
        if not out:
            raise AssertionError(f"no safetensors written in {folder}: {sorted(p.name for p in folder.iterdir())}")
        return out

    return _read_folder


@pytest.fixture(scope="session")
def max_abs_diff() -> Callable[[dict, dict], tuple[float, str]]:
    """``max_abs_diff(a, b) -> (largest |a - b|, key)`` over the shared keys (which must be all
    keys of both)."""

    def _max_abs_diff(a: dict, b: dict) -> tuple[float, str]:
        assert set(a) == set(b), (sorted(set(a) ^ set(b)))[:5]
        worst, where = 0.0, ""
        for k in a:
            d = float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0
            if d > worst:
                worst, where = d, k
        return worst, where

    return _max_abs_diff
