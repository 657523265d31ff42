"""Finding the merge layer, checking architectures, and the forward hook that perturbs it.

The hook lets any ``nn.Module`` be linearised at a layer without model surgery: it records the
layer's input and output and, when a perturbation is set, returns ``output + perturbation``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np

from ..errors import ValidationError, listing

MAX_LISTED = 40


def linear_layer_names(model: Any) -> list[str]:
    """Names (``model.named_modules()``) of every ``nn.Linear`` in ``model``."""
    from torch import nn  # deferred: torch is heavy

    return [name for name, mod in model.named_modules() if isinstance(mod, nn.Linear) and name]



def resolve_linear(model: Any, layer: str, what: str = "base model") -> Any:
    """Return the ``nn.Linear`` called ``layer`` in ``model``; the error lists the valid names."""
    from torch import nn  # deferred: torch is heavy

    if not isinstance(layer, str) or not layer:
        raise ValidationError(f"layer must be a module name (str), got {layer!r}")
    modules = dict(model.named_modules())
    module = modules.get(layer)
    if module is None:
        raise ValidationError(
            f"the {what} has no module named {layer!r}; its nn.Linear layers are: "
            f"{listing(linear_layer_names(model), MAX_LISTED)}"
        )
    if not isinstance(module, nn.Linear):
        raise ValidationError(
            f"module {layer!r} of the {what} is a {type(module).__name__}, not an nn.Linear; "
            f"the nn.Linear layers are: {listing(linear_layer_names(model), MAX_LISTED)}"
        )
    return module


def check_untied(model: Any, layer: str, what: str = "base model") -> None:
    """Raise if the weight or bias of ``layer`` is also a parameter of another module (tied
    weights, e.g. an ``lm_head`` tied to the input embedding): merging it would change that
    module too, which the layer's linearisation does not see."""
    module = resolve_linear(model, layer, what)
    mine = {id(p): pname for pname, p in (("weight", module.weight), ("bias", module.bias)) if p is not None}
    for name, other in model.named_modules(remove_duplicate=False):
        if other is module or name == layer:
            continue
        for pname, param in other.named_parameters(recurse=False):
            if id(param) in mine:
                where = f"{name}.{pname}" if name else pname
                raise ValidationError(
                    f"the {mine[id(param)]} of layer {layer!r} is tied to {where!r} of the {what} "
                    f"(one shared tensor): merging the layer alone would change that module too, "
                    f"which its statistics do not account for; choose an untied layer"
                )


def check_same_architecture(base: Any, others: Sequence[tuple[str, Any]]) -> None:
    """Raise naming the first tensor whose presence or shape differs from the base model's."""
    ref = {k: tuple(v.shape) for k, v in base.state_dict().items()}
    for name, model in others:
        theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        missing = [k for k in ref if k not in theirs]
        if missing:
            raise ValidationError(
                f"model {name!r} lacks tensor {missing[0]!r} of the base model "
                f"({len(missing)} missing in all)"
            )
        extra = [k for k in theirs if k not in ref]
        if extra:
            raise ValidationError(
                f"model {name!r} has tensor {extra[0]!r} that the base model lacks "
                f"({len(extra)} extra in all)"
            )
        for key, shape in ref.items():
            if theirs[key] != shape:
                raise ValidationError(
                    f"tensor {key!r} has shape {theirs[key]} in model {name!r} but {shape} in "
                    f"the base model; all models must share one architecture"
                )


def differing_tensors(base: Any, model: Any, skip_prefix: str) -> int:
    """How many tensors of ``model`` differ from ``base`` outside the module ``skip_prefix``."""
    import torch  # deferred: torch is heavy

    count = 0
    theirs = model.state_dict()
    for key, value in base.state_dict().items():
        if key.startswith(skip_prefix + "."):
            continue
        other = theirs[key]
        if other.device != value.device:
            other = other.to(value.device)
        if not torch.equal(value, other):
            count += 1
    return count


def augmented_weight(module: Any) -> np.ndarray:
    """``[W, b]`` (``(r, m + 1)``) of an ``nn.Linear`` with a bias, else ``W`` (``(r, m)``),
    as a numpy array in float64 (or the layer's own dtype when that is wider)."""
    import torch  # deferred: torch is heavy

    with torch.no_grad():
        W = module.weight.detach().to("cpu", torch.float64)
        if module.bias is not None:
            W = torch.cat([W, module.bias.detach().to("cpu", torch.float64)[:, None]], dim=1)
    return W.numpy().copy()


class PerturbationHook:
    """Forward hook for one layer: records its input/output; adds ``perturbation`` if set."""

    def __init__(self) -> None:
        self.record = False
        self.perturbation: Any = None
        self.layer_input: Any = None
        self.layer_output: Any = None
        self.calls = 0

    def __call__(self, module: Any, inputs: tuple[Any, ...], output: Any) -> Any:
        self.calls += 1
        if self.record:
            # copies: the model may modify them in place later (``x += layer(x)``,
            # ``nn.ReLU(inplace=True)``), which would corrupt what is recorded
            self.layer_input = inputs[0].detach().clone()
            self.layer_output = output.detach().clone()
        if self.perturbation is not None:
            if self.perturbation.shape != output.shape:
                raise ValidationError(
                    f"perturbation shape {tuple(self.perturbation.shape)} does not match the "
                    f"layer output shape {tuple(output.shape)} (is the layer called more than "
                    f"once per forward pass?)"
                )
            return output + self.perturbation
        return None


@contextmanager
def perturbation_hook(module: Any) -> Iterator[PerturbationHook]:
    """Register a :class:`PerturbationHook` on ``module`` for the duration of the block."""
    hook = PerturbationHook()
    handle = module.register_forward_hook(hook)
    try:
        yield hook
    finally:
        handle.remove()


@contextmanager
def eval_mode(*models: Any) -> Iterator[None]:
    """Put models in eval mode (no dropout, running batch-norm statistics); restore after."""
    saved = [[(m, m.training) for m in model.modules()] for model in models]
    try:
        for model in models:
            model.eval()
        yield
    finally:
        for flags in saved:
            for module, training in flags:
                module.training = training


@contextmanager
def frozen_parameters(model: Any) -> Iterator[None]:
    """Set ``requires_grad=False`` on every parameter of ``model`` (differentiation then
    follows only the layer-output perturbations); restore the flags after."""
    params = list(model.parameters())
    saved = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in zip(params, saved):
            p.requires_grad_(flag)


@contextmanager
def hooked_layers(model: Any, modules: Sequence[Any], *,
                  also_eval: Sequence[Any] = ()) -> Iterator[list[PerturbationHook]]:
    """The set-up of a linearisation: ``model`` (and ``also_eval``, e.g. the fine-tuned models
    that give targets) in eval mode, ``model``'s parameters frozen, and one
    :class:`PerturbationHook` per module of ``modules`` (in order); all undone after."""
    with ExitStack() as stack:
        stack.enter_context(eval_mode(model, *also_eval))
        stack.enter_context(frozen_parameters(model))
        hooks = [stack.enter_context(perturbation_hook(module)) for module in modules]
        yield hooks
