"""Fixtures shared by several test folders, and the hypothesis profiles.

* Hypothesis profiles: ``dev`` (default) draws new examples on every run; ``ci`` (set by
  ``.ci/run`` through ``MERGEQP_HYPOTHESIS_PROFILE=ci``) draws the same examples every run, so
  that CI results do not depend on chance.
* Random merge QPs and independent CVXPY references (``random_problem``, ``cvxpy_solve``,
  ``clarabel_tight``): the numerical-core and command-line tests.
* ``tiny_hf``: tiny Hugging Face checkpoints built offline (Llama, GPT-2, BERT, ViT) for the
  merge, I/O, command-line and experiment tests.
"""

from __future__ import annotations

import fnmatch
import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cvxpy as cp
import numpy as np
import pytest
import yaml
from hypothesis import settings

from mergeqp.constraints import as_constraint_set
from mergeqp.problem import MergeQP

settings.register_profile("dev", print_blob=True)
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("MERGEQP_HYPOTHESIS_PROFILE", "dev"))

# every test runs offline and quietly (tiny checkpoints are written here, never downloaded)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


# ---------------------------------------------------------------------- random QPs, CVXPY references
@pytest.fixture(scope="session")
def clarabel_tight() -> dict[str, float]:
    """Tight Clarabel settings for the independent reference solves."""
    return {"tol_gap_abs": 1e-11, "tol_gap_rel": 1e-11, "tol_feas": 1e-11}


@pytest.fixture(scope="session")
def random_problem() -> Callable[..., MergeQP]:
    """``random_problem(rng, K=3, m=4, rank=None, offset=0.0, c=None)``: a merge QP like the
    paper's: ``H = A'A`` (rank ``rank``, default full), ``g = -A'y`` with targets ``y`` chosen so
    that the unconstrained optimum sits around ``offset`` (plus noise, so that ``J* > 0``),
    ``c = |y|^2 / 2`` so that ``J(d) = |A d - y|^2 / 2``; shape ``(K, m)``."""

    def _random_problem(rng: np.random.Generator, K: int = 3, m: int = 4, rank: int | None = None,
                        offset: float = 0.0, c: float | None = None) -> MergeQP:
        n = K * m
        rows = max(n + 3, 8)
        A = rng.normal(size=(rows, n)) / np.sqrt(rows)
        if rank is not None:  # rank-deficient: more samples than the rank of H
            A = rng.normal(size=(rows, rank)) @ rng.normal(size=(rank, n)) / np.sqrt(rows * rank)
        y = A @ (offset + rng.normal(size=n)) + 0.1 * rng.normal(size=rows)
        H = A.T @ A
        g = -A.T @ y
        return MergeQP(H, g, c=0.5 * float(y @ y) if c is None else c, shape=(K, m))

    return _random_problem


@pytest.fixture(scope="session")
def cvxpy_solve(clarabel_tight) -> Callable[[MergeQP, Any], tuple[float, np.ndarray]]:
    """``cvxpy_solve(problem, constraints) -> (J*, d*)`` (``d*`` of shape ``problem.shape``) from
    an independent CVXPY + Clarabel solve (``quad_form`` on H)."""

    def _cvxpy_solve(problem: MergeQP, constraints: Any) -> tuple[float, np.ndarray]:
        cset = as_constraint_set(constraints)
        var = cp.Variable(problem.shape)
        x = cp.vec(var, order="C")
        H = cp.psd_wrap(problem.H)
        obj = 0.5 * cp.quad_form(x, H) + problem.g @ x + problem.c
        prob = cp.Problem(cp.Minimize(obj), cset.cvxpy(var))
        prob.solve(solver=cp.CLARABEL, **clarabel_tight)
        assert prob.status in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE), prob.status
        d = np.asarray(var.value, dtype=np.float64)
        return problem.objective(d), d

    return _cvxpy_solve


# ---------------------------------------------------------------------- tiny Hugging Face checkpoints
@dataclass(frozen=True)
class Family:
    """Folders of one tiny base checkpoint, its fine-tuned copies and one prompt file per task."""

    root: Path
    arch: str
    base: Path
    finetuned: list[Path]
    prompts: list[Path]
    tasks: list[str]

    @property
    def auto_class(self):
        """The ``transformers`` auto class that loads this family's folders."""
        return TinyCheckpoints.auto_class(self.arch)

    @property
    def mlp_layer(self) -> str:
        """An MLP projection of block 1 (the single-layer merge site of the tests)."""
        return TinyCheckpoints.MLP_LAYER[self.arch]

    def write_config(self, path: Path, layers, method: dict, **extra) -> Path:
        """Write a ``mergeqp merge`` YAML config for this family at ``path`` (float64 on the
        CPU, 12-token prompts in batches of 4, 4 held out); ``extra`` adds or overrides keys."""
        cfg = {
            "base": str(self.base),
            "models": [{"name": t, "path": str(ft), "calibration": str(p)}
                       for t, ft, p in zip(self.tasks, self.finetuned, self.prompts)],
            "layers": list(layers) if not isinstance(layers, str) else [layers],
            "method": method,
            "calibration": {"max_length": 12, "batch_size": 4, "holdout": 4},
            "dtype": "float64",
            "device": "cpu",
        }
        cfg.update(extra)
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path


class TinyCheckpoints:
    """Tiny Hugging Face checkpoints built offline.

    ``make_family(root, arch)`` writes a base model folder (with a word-level tokenizer built
    with the ``tokenizers`` library), K fine-tuned copies whose chosen layers are perturbed
    (seeded; the rest identical to the base), and one prompt file per task. Architectures:
    ``llama`` (LlamaForCausalLM), ``gpt2`` (GPT2LMHeadModel: Conv1D projections, tied
    embeddings), ``bert`` (BertForMaskedLM) and ``mixtral`` (MixtralForCausalLM: 4 experts fused
    into 3-D parameters in memory, stored one per expert); ``make_vit_family`` a ViT image classifier.
    """

    Family = Family
    WORDS = ["the", "a", "cat", "dog", "runs", "sits", "on", "mat", "code", "def", "return", "x", "y", "plus", "two", "one", "three", "=", "(", ")", "math", "is", "fun", "print", "if", "else", "for", "in", "range", "list", "sum", "zero", "four", "five", "times", "minus", "equals", "proof", "lemma"]
    SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "[CLS]", "[SEP]", "[MASK]"]
    TASK_WORDS = {
        "code": ["code", "def", "return", "x", "y", "print", "if", "else", "for", "in", "range", "list", "=", "(", ")"],
        "math": ["math", "plus", "two", "one", "three", "sum", "zero", "four", "five", "times", "minus", "equals", "proof", "lemma"],
        "story": ["the", "a", "cat", "dog", "runs", "sits", "on", "mat", "is", "fun"],
    }
    #: an MLP projection and the linear layers of one block, per architecture
    MLP_LAYER = {"llama": "model.layers.1.mlp.down_proj", "gpt2": "transformer.h.1.mlp.c_fc",
                 "bert": "bert.encoder.layer.1.intermediate.dense", "mixtral": "model.layers.1.self_attn.o_proj"}
    BLOCK_PATTERN = {"llama": "model.layers.1.*", "gpt2": "transformer.h.1.*",
                     "bert": "bert.encoder.layer.1.*", "mixtral": "model.layers.1.*"}

    @classmethod
    def vocab(cls) -> dict[str, int]:
        return {w: i for i, w in enumerate(cls.SPECIALS + cls.WORDS)}

    @classmethod
    def build_tokenizer(cls, folder: Path, extra_word: str | None = None) -> None:
        """A word-level fast tokenizer over :attr:`WORDS` (``extra_word`` changes the vocabulary)."""
        # deferred: tokenizers / transformers are heavy and only the HF tests need them
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        v = cls.vocab()
        if extra_word is not None:
            v = dict(v)
            v[extra_word] = len(v)
        tok = Tokenizer(models.WordLevel(vocab=v, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                       bos_token="<s>", eos_token="</s>", mask_token="[MASK]")
        fast.save_pretrained(str(folder))

    @classmethod
    def make_config(cls, arch: str):
        from transformers import BertConfig, GPT2Config, LlamaConfig, MixtralConfig  # deferred: heavy, HF tests only

        V = len(cls.vocab())
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
        if arch == "mixtral":  # transformers >= 5 fuses its experts into 3-D parameters (stored per expert)
            return MixtralConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                 num_local_experts=4, num_experts_per_tok=2, pad_token_id=0, bos_token_id=2,
                                 eos_token_id=3)
        raise ValueError(arch)

    @staticmethod
    def model_class(arch: str):
        from transformers import BertForMaskedLM, GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM  # deferred: heavy

        return {"llama": LlamaForCausalLM, "gpt2": GPT2LMHeadModel, "bert": BertForMaskedLM,
                "mixtral": MixtralForCausalLM}[arch]

    @staticmethod
    def auto_class(arch: str):
        from transformers import AutoModelForCausalLM, AutoModelForMaskedLM  # deferred: heavy

        return AutoModelForMaskedLM if arch == "bert" else AutoModelForCausalLM

    @classmethod
    def build_base(cls, folder: Path, arch: str, seed: int = 0, tokenizer: bool = True):
        import torch  # deferred: heavy, HF tests only

        torch.manual_seed(seed)
        model = cls.model_class(arch)(cls.make_config(arch)).eval()
        # larger-than-default weights so that the tiny models are not nearly constant
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:  # (3-D: a mixture of experts' fused weights)
                    p.normal_(0.0, 0.2)
        model.save_pretrained(str(folder))
        if tokenizer:
            cls.build_tokenizer(folder)
        return model

    @classmethod
    def perturb(cls, base_folder: Path, out: Path, arch: str, patterns, scale: float, seed: int) -> None:
        """A fine-tuned copy: matching 2-D weights (and biases) get seeded Gaussian noise of std
        ``scale * std(weight)``; everything else is identical to the base."""
        import torch  # deferred: heavy, HF tests only

        model = cls.auto_class(arch).from_pretrained(str(base_folder), dtype=torch.float32)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                module = name.rsplit(".", 1)[0]
                if any(fnmatch.fnmatchcase(module, pat) for pat in patterns):
                    std = float(p.std()) if p.numel() > 1 else 0.1
                    p.add_(torch.randn(p.shape, generator=gen) * scale * max(std, 0.05))
        model.save_pretrained(str(out))

    @classmethod
    def sentences(cls, task: str, n: int, seed: int, length: tuple[int, int] = (4, 10)) -> list[str]:
        rng = random.Random(seed)
        words = cls.TASK_WORDS[task]
        return [" ".join(rng.choice(words) for _ in range(rng.randint(*length))) for _ in range(n)]

    @classmethod
    def make_family(cls, root: Path, arch: str, K: int = 2, perturbed: tuple[str, ...] | None = None,
                    scale: float = 0.3, n_prompts: int = 12, seed: int = 0) -> Family:
        """Write base, K fine-tuned folders and K prompt files (``.jsonl`` then ``.txt``) under ``root``."""
        root.mkdir(parents=True, exist_ok=True)
        base = root / "base"
        cls.build_base(base, arch, seed=seed)
        patterns = perturbed if perturbed is not None else (cls.BLOCK_PATTERN[arch],)
        tasks = list(cls.TASK_WORDS)[:K]
        fts, prompts = [], []
        for k, task in enumerate(tasks):
            ft = root / f"ft_{task}"
            cls.perturb(base, ft, arch, patterns, scale, seed=seed + 100 + k)
            fts.append(ft)
            lines = cls.sentences(task, n_prompts, seed=seed + k)
            if k % 2 == 0:
                p = root / f"{task}.jsonl"
                p.write_text("\n".join(json.dumps({"text": s}) for s in lines) + "\n")
            else:
                p = root / f"{task}.txt"
                p.write_text("\n".join(lines) + "\n")
            prompts.append(p)
        return Family(root, arch, base, fts, prompts, tasks)

    @staticmethod
    def file_digests(folder: Path) -> dict[str, tuple[int, int]]:
        """``name -> (size, mtime_ns)`` of every file under ``folder`` (to check inputs are untouched)."""
        out = {}
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                st = p.stat()
                out[str(p.relative_to(folder))] = (st.st_size, st.st_mtime_ns)
        return out

    @staticmethod
    def make_vit_family(root: Path, K: int = 2, scale: float = 0.3, n_images: int = 12, seed: int = 0) -> Family:
        """A tiny ViTForImageClassification (8x8 one-channel images, 3 labels), K fine-tuned copies
        perturbed in block 1, and per-task calibration inputs as ``.safetensors`` files holding
        ``pixel_values`` ``(N, 1, 8, 8)``."""
        # deferred: heavy, HF tests only
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


@pytest.fixture(scope="session")
def tiny_hf() -> type[TinyCheckpoints]:
    """The tiny Hugging Face checkpoint kit (:class:`TinyCheckpoints`): ``tiny_hf.make_family(root,
    arch)``, ``tiny_hf.MLP_LAYER[arch]``, ``tiny_hf.auto_class(arch)``, ..."""
    return TinyCheckpoints
