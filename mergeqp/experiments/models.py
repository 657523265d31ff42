"""The paper's MNIST MLP and its (deterministic) training and fine-tuning.

``MLP``: ``layer1 = Linear(784, 256) -> ReLU -> layer2 = Linear(256, 128) -> ReLU ->
layer3 = Linear(128, 10)``; the merge layer is ``"layer2"``. Training is mini-batch Adam on the
cross-entropy over all classes, with batches drawn by a seeded ``torch.Generator``; fine-tuning
copies the base and trains only the parameters whose names match ``trainable`` (default the
merge layer's weight and bias).
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ValidationError

MERGE_LAYER = "layer2"
FINETUNE_MODES = {"layer2": ("layer2.weight", "layer2.bias"), "all": ("*",)}


class MLP(nn.Module):
    """``Linear(d_in, h1) -> ReLU -> Linear(h1, h2) -> ReLU -> Linear(h2, n_classes)``;
    inputs ``(B, d_in)`` -> logits ``(B, n_classes)``. Module names ``layer1..layer3``."""

    def __init__(self, d_in: int = 784, h1: int = 256, h2: int = 128, n_classes: int = 10):
        super().__init__()
        self.layer1 = nn.Linear(d_in, h1)
        self.layer2 = nn.Linear(h1, h2)
        self.layer3 = nn.Linear(h2, n_classes)

    def hidden1(self, x: torch.Tensor) -> torch.Tensor:
        """The merge layer's input ``relu(layer1(x))`` (``(B, h1)``)."""
        return torch.relu(self.layer1(x))

    def from_hidden1(self, h: torch.Tensor) -> torch.Tensor:
        """Logits from the merge layer's input ``h`` (``(B, h1)``)."""
        return self.layer3(torch.relu(self.layer2(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.from_hidden1(self.hidden1(x))


@dataclass(frozen=True)
class TrainConfig:
    """Mini-batch Adam: ``epochs`` passes, ``batch_size`` samples, learning rate ``lr``,
    decoupled ``weight_decay`` (AdamW)."""

    epochs: int
    lr: float = 1e-3
    batch_size: int = 64
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.epochs < 0 or self.batch_size < 1 or not self.lr > 0 or self.weight_decay < 0:
            raise ValidationError(
                f"invalid training setting: epochs={self.epochs} (>= 0), batch_size="
                f"{self.batch_size} (>= 1), lr={self.lr} (> 0), weight_decay={self.weight_decay} (>= 0)"
            )


def train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    config: TrainConfig,
    *,
    seed: int,
    trainable: Sequence[str] = ("*",),
    desc: str = "train",
    progress: bool = True,
    forward: Any = None,
) -> dict[str, float]:
    """Train ``model`` in place on ``x`` ``(N, D)``, labels ``y`` ``(N,)`` with cross-entropy.

    Only parameters whose names match a pattern of ``trainable`` (``fnmatch``) are updated; the
    others keep ``requires_grad`` as they were afterwards. Returns the final epoch's mean loss
    and training accuracy. ``forward`` (default ``model``) maps a batch of ``x`` to logits (e.g.
    from precomputed features of frozen layers).
    """
    from tqdm.auto import tqdm

    names = [n for n, _ in model.named_parameters()]
    chosen = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in trainable)]
    if not chosen:
        raise ValidationError(f"no parameter matches trainable={list(trainable)}; parameters: {names}")
    params = dict(model.named_parameters())
    saved = {n: p.requires_grad for n, p in params.items()}
    for n, p in params.items():
        p.requires_grad_(n in chosen)
    opt = torch.optim.AdamW([params[n] for n in chosen], lr=config.lr, weight_decay=config.weight_decay)
    gen = torch.Generator().manual_seed(int(seed))
    N = int(x.shape[0])
    stats = {"loss": float("nan"), "accuracy": float("nan")}
    model.train()
    bar = tqdm(range(config.epochs), desc=desc, unit="epoch", disable=not progress, leave=False)
    try:
        for _ in bar:
            order = torch.randperm(N, generator=gen)
            total, correct = 0.0, 0
            for start in range(0, N, config.batch_size):
                idx = order[start:start + config.batch_size]
                logits = (forward or model)(x[idx])
                loss = nn.functional.cross_entropy(logits, y[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total += float(loss.detach()) * len(idx)
                correct += int((logits.argmax(1) == y[idx]).sum())
            stats = {"loss": total / N, "accuracy": correct / N}
            bar.set_postfix(loss=f"{stats['loss']:.4f}", acc=f"{stats['accuracy']:.3f}")
    finally:
        bar.close()
        model.eval()
        for n, p in params.items():
            p.requires_grad_(saved[n])
    return stats


def finetune(base: nn.Module, x: torch.Tensor, y: torch.Tensor, config: TrainConfig, *, seed: int,
             mode: str = "layer2", desc: str = "fine-tune", progress: bool = True
             ) -> tuple[nn.Module, dict[str, float]]:
    """A fine-tuned copy of ``base``: ``mode`` ``"layer2"`` (only the merge layer's weight and
    bias) or ``"all"`` (every parameter). ``base`` is untouched."""
    if mode not in FINETUNE_MODES:
        raise ValidationError(f"unknown fine-tune mode {mode!r}; valid: {', '.join(FINETUNE_MODES)}")
    model = copy.deepcopy(base)
    forward = None
    if mode == "layer2" and isinstance(model, MLP):
        # layer1 is frozen: compute its features once (same arithmetic, several times faster)
        with torch.no_grad():
            x = model.hidden1(x)
        forward = model.from_hidden1
    stats = train(model, x, y, config, seed=seed, trainable=FINETUNE_MODES[mode], desc=desc,
                  progress=progress, forward=forward)
    return model, stats


def changed_tensors(base: nn.Module, model: nn.Module) -> list[str]:
    """Names of the state-dict tensors of ``model`` that differ from ``base``'s."""
    ref = base.state_dict()
    return [n for n, t in model.state_dict().items() if not torch.equal(t, ref[n])]


def initial_model(seed: int, d_in: int = 784, n_classes: int = 10) -> MLP:
    """A freshly initialised :class:`MLP` (PyTorch's default init under ``torch.manual_seed``)."""
    torch.manual_seed(int(seed))
    return MLP(d_in=d_in, n_classes=n_classes)


def logits_of(model: nn.Module, x: torch.Tensor, batch_size: int = 2048) -> torch.Tensor:
    """``model(x)`` in eval mode without gradients, in batches; ``(N, c)``."""
    model.eval()
    with torch.no_grad():
        return torch.cat([model(x[i:i + batch_size]) for i in range(0, int(x.shape[0]), batch_size)])


def as_float64(model: nn.Module) -> nn.Module:
    """A float64 copy (the statistics and the true objective are float64)."""
    return copy.deepcopy(model).to(torch.float64)
