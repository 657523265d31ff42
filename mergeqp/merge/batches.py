"""Calibration batches for the data-driven baselines (Fisher, RegMean), and running a model on
one fine-tuned model's weights without copying the module.

``calibration`` is a list with one entry per fine-tuned model (same order as ``finetuned``);
each entry is an iterable of batches (a list, a DataLoader, ...), iterated once. A batch is

- ``inputs`` alone: a tensor (``model(x)``), a dict of tensors (``model(**d)``); or
- a pair ``(inputs, targets)`` (tuple or list of length 2), where ``inputs`` is a tensor, a dict,
  or a tuple of tensors (positional arguments, ``model(*t)``), and ``targets`` a tensor or
  ``None``. RegMean ignores ``targets``.

Every tensor in ``inputs`` / ``targets`` has the examples along dimension 0.

The model runs on each fine-tuned state dict through ``torch.func.functional_call``; the
module's own parameters are left untouched (its architecture is all that is used). The module
is put in ``eval()`` mode while statistics are collected and restored afterwards.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from ..errors import ConfigError, ValidationError


def split_batch(batch: Any, where: str) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a batch (``targets`` ``None`` when absent)."""
    import torch

    if isinstance(batch, (tuple, list)):
        if len(batch) != 2:
            raise ValidationError(
                f"{where}: a tuple batch must be (inputs, targets), got a {type(batch).__name__} of "
                f"length {len(batch)} (wrap several positional inputs as ((a, b), targets))"
            )
        inputs, targets = batch
        if targets is not None and not isinstance(targets, torch.Tensor):
            raise ValidationError(f"{where}: targets must be a tensor or None, got {type(targets).__name__}")
    else:
        inputs, targets = batch, None
    if not isinstance(inputs, (torch.Tensor, Mapping, tuple, list)):
        raise ValidationError(f"{where}: inputs must be a tensor, a dict or a tuple of tensors, "
                              f"got {type(inputs).__name__}")
    return inputs, targets


def leaves(inputs: Any) -> list[Any]:
    if isinstance(inputs, Mapping):
        return [v for v in inputs.values() if hasattr(v, "shape")]
    if isinstance(inputs, (tuple, list)):
        return [v for v in inputs if hasattr(v, "shape")]
    return [inputs]


def n_examples(inputs: Any, where: str) -> int:
    sizes = {int(t.shape[0]) for t in leaves(inputs) if t.dim() > 0}
    if len(sizes) != 1:
        raise ValidationError(f"{where}: input tensors disagree on the number of examples "
                              f"(dimension 0 sizes {sorted(sizes)})")
    return sizes.pop()


def map_tensors(inputs: Any, fn: Any) -> Any:
    """Apply ``fn`` to every tensor of ``inputs`` (tensor / dict / tuple), keeping the structure."""
    import torch

    if isinstance(inputs, Mapping):
        return {k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return tuple(fn(v) if isinstance(v, torch.Tensor) else v for v in inputs)
    return fn(inputs)


def call(model: Any, weights: Mapping[str, Any] | None, inputs: Any) -> Any:
    """``model(inputs)`` with its parameters and buffers replaced by ``weights`` (``None``: its own)."""
    from torch.func import functional_call

    if weights is None:
        if isinstance(inputs, Mapping):
            return model(**inputs)
        return model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)
    if isinstance(inputs, Mapping):
        return functional_call(model, dict(weights), args=(), kwargs=dict(inputs))
    if isinstance(inputs, (tuple, list)):
        return functional_call(model, dict(weights), args=tuple(inputs))
    return functional_call(model, dict(weights), args=(inputs,))


def run_model(model: Any, weights: Mapping[str, Any] | None, inputs: Any, where: str) -> Any:
    """:func:`call`, with a failure of the model on the batch (wrong input width or dtype, ...) as a
    :class:`ValidationError` naming the batch and the model's first error line."""
    try:
        return call(model, weights, inputs)
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:
        raise model_failure(where, exc) from exc


def model_failure(where: str, exc: BaseException) -> ValidationError:
    first = (str(exc).strip().splitlines() or [""])[0]
    return ValidationError(f"{where}: the model failed on this batch ({type(exc).__name__}: {first}); "
                           f"check the batch's inputs against model= (shapes, dtypes, argument names)")


def supplied_tensor(x: Any, where: str) -> Any:
    """A user's precomputed statistic (a Fisher, a Gram matrix: a tensor, numpy array, ...) as a
    floating-point torch tensor (integers as float64), refused when it is not numbers or holds NaN
    or inf; ``where`` names it in the message."""
    import torch

    try:
        t = torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValidationError(f"{where} is not a tensor of numbers ({type(exc).__name__}: {exc})") from None
    if not t.is_floating_point():
        t = t.to(torch.float64)
    if not bool(torch.isfinite(t).all()):
        raise ValidationError(f"{where} contains NaN or inf")
    return t


def logits_of(output: Any) -> Any:
    """The logits tensor of a model output: itself, ``.logits``, or the first element."""
    import torch

    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ValidationError(
        f"cannot find logits in a model output of type {type(output).__name__} (a model without a "
        f"language-model or classification head; from Python, pass log_likelihood= to score it)"
    )


def model_weights(model: Any, source: Any, device: Any) -> dict[str, Any]:
    """The tensors ``functional_call`` needs (the module's parameters and persistent buffers,
    without tied duplicates) read from ``source`` (a :class:`~mergeqp.merge.inputs.TensorSource`),
    cast to the module's dtypes and moved to ``device``."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    persistent = set(model.state_dict().keys())
    available = set(source.names)
    out = {}
    for name, ref in {**params, **buffers}.items():
        if name not in available:
            if name in buffers and name not in persistent:
                continue  # non-persistent buffer: the module's own value is used
            raise ValidationError(f"the model's tensor {name!r} is not in {source.label}")
        tensor = source.get(name)
        if tuple(tensor.shape) != tuple(ref.shape):
            raise ValidationError(
                f"the model's tensor {name!r} has shape {tuple(ref.shape)} but {tuple(tensor.shape)} in "
                f"{source.label}: model= must have the merged models' architecture (only its weights are replaced)")
        out[name] = tensor.to(device=device, dtype=ref.dtype)
    return out


def model_device(model: Any) -> Any:
    import torch

    for p in model.parameters():
        return p.device
    return torch.device("cpu")


@contextmanager
def eval_mode(model: Any) -> Iterator[None]:
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


def check_calibration(calibration: Any, K: int, method: str) -> Sequence[Iterable[Any]]:
    """Validate ``calibration`` (one iterable of batches per fine-tuned model)."""
    if calibration is None:
        raise ConfigError(f"merge method {method!r} needs calibration data: pass calibration= "
                          f"(one list of batches per fine-tuned model) together with model=")
    if not isinstance(calibration, Sequence) or isinstance(calibration, (str, Mapping)):
        raise ConfigError(f"parameter 'calibration' must be a list with one iterable of batches per "
                          f"fine-tuned model, got {type(calibration).__name__}")
    if len(calibration) != K:
        raise ConfigError(f"parameter 'calibration' has {len(calibration)} entries but there are {K} "
                          f"fine-tuned models (one iterable of batches per model)")
    return calibration


def check_model(model: Any, method: str) -> Any:
    """``model`` itself when it is an ``nn.Module``; a zero-argument factory is called once."""
    import torch

    if model is None:
        raise ConfigError(f"merge method {method!r} needs model= (an nn.Module, or a zero-argument "
                          f"factory returning one: the architecture shared by all models)")
    if not isinstance(model, torch.nn.Module) and callable(model):
        model = model()
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"merge method {method!r}: parameter 'model' must be an nn.Module (the "
                          f"architecture; its weights are replaced by each fine-tuned model's) or a "
                          f"factory returning one, got {type(model).__name__}")
    return model
