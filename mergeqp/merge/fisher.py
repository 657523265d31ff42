"""Fisher merging with the diagonal empirical Fisher from per-example gradients.

Matena & Raffel, "Merging Models with Fisher-Weighted Averaging", NeurIPS 2022
(arXiv:2111.09832). For each fine-tuned model ``k`` and parameter tensor ``theta``::

    F_k = (1/N) sum_{j=1..N} (d/dtheta log p_k(y_j | x_j))^2          (element-wise square)

over its N calibration examples (``estimator="per_example"``, the default): one gradient per
*example*, from ``torch.func.vmap(torch.func.grad(...))`` (``per_example="vmap"``, default) or a
Python loop of ``torch.autograd.grad`` calls (``per_example="loop"``, for models that ``vmap``
cannot trace). ``y_j`` is the batch's target; a batch without targets uses the model's own
predicted class ``argmax`` (a predicted-label Fisher). The merged tensor is::

    merged = sum_k c_k (F_k + floor) theta_k / sum_k c_k (F_k + floor)

with ``c_k`` = ``weights`` (default 1 each) and ``floor`` = ``fisher_floor`` (default 1e-6, as
Matena & Raffel's code and fusion_bench). Entries where the denominator is 0 (only possible
with ``fisher_floor=0``) and selected tensors without a Fisher (buffers, tensors the model does
not use as parameters) get the weighted average ``sum_k c_k theta_k / sum_k c_k``. With
``normalize_fisher`` each model's Fisher is first divided by its global L2 norm over the
selected tensors. The base is not used (only for unselected tensors).

**Batch-level estimate** (``estimator="batch"``; what fusion_bench computes): the square of the
gradient of the *batch-summed* log-likelihood, averaged over batches,
``(1/B) sum_b (sum_{j in b} g_j)^2``. It contains the cross terms ``g_i g_j`` of examples in the
same batch, so it equals the per-example estimate (times the batch size) only for batches of
one example; with larger batches the cross terms, whose signs vary, partly cancel and the
estimate depends on the batching. It is offered to reproduce such results, not as a default.

The log-likelihood is ``log_likelihood(outputs, targets) -> scalar`` summed over the examples it
is given (in the per-example estimate it sees one example: leading dimension 1). The default
is the categorical log-likelihood of integer class targets (``logits`` ``(..., C)``, targets
``(...)``; entries equal to -100 ignored) on the output's logits (the output itself, its
``.logits``, or its first element). For a causal language model pass targets already shifted
to align with the logits, or a custom ``log_likelihood``.

Precomputed Fishers can be passed instead of ``model`` + ``calibration``: ``fishers`` = a list
of K mappings ``name -> tensor`` (the tensor's shape).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from ..errors import ConfigError, ValidationError
from .batches import (
    call,
    check_calibration,
    check_model,
    eval_mode,
    logits_of,
    map_tensors,
    model_device,
    model_failure,
    model_weights,
    n_examples,
    run_model,
    split_batch,
    supplied_tensor,
)
from .inputs import TensorSource
from .method import MergeMethod, WeightedParams, iterate, resolve_weights

IGNORE_INDEX = -100


class FisherParams(WeightedParams):
    model: Any = None
    calibration: Any = None
    fishers: Any = None
    log_likelihood: Callable[..., Any] | None = None
    estimator: Literal["per_example", "batch"] = "per_example"
    per_example: Literal["vmap", "loop"] = "vmap"
    chunk_size: int | None = Field(None, ge=1)
    fisher_floor: float = Field(1e-6, ge=0.0)
    normalize_fisher: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> FisherParams:
        if self.fishers is not None and (self.model is not None or self.calibration is not None):
            raise ValueError("give either fishers= or model= with calibration=, not both")
        if self.fishers is None and (self.model is None or self.calibration is None):
            raise ValueError("Fisher merging needs model= and calibration= (or precomputed fishers=)")
        return self


def categorical_log_likelihood(output: Any, targets: Any) -> Any:
    """``sum log softmax(logits)[target]`` over all positions (targets -100 ignored)."""
    import torch

    logits = logits_of(output)
    if targets is None:
        raise ValidationError("the categorical log-likelihood needs targets")
    if tuple(logits.shape[:-1]) != tuple(targets.shape):
        raise ValidationError(f"logits of shape {tuple(logits.shape)} do not match targets of shape "
                              f"{tuple(targets.shape)} (expected logits (..., C) and targets (...))")
    if targets.is_floating_point() or targets.is_complex():
        raise ValidationError(f"the categorical log-likelihood needs integer class targets, got "
                              f"{targets.dtype} (from Python, pass log_likelihood= for other targets)")
    logp = torch.log_softmax(logits, dim=-1)
    keep = targets != IGNORE_INDEX
    picked = logp.gather(-1, torch.where(keep, targets, 0).unsqueeze(-1)).squeeze(-1)
    return (picked * keep).sum()


def _primary_names(model: Any) -> dict[str, str]:
    """Every parameter name (tied aliases included) -> the name ``named_parameters()`` keeps."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def compute_fisher(
    model: Any,
    batches: Iterable[Any],
    *,
    state_dict: Any = None,
    names: Sequence[str] | None = None,
    log_likelihood: Callable[[Any, Any], Any] | None = None,
    estimator: Literal["per_example", "batch"] = "per_example",
    per_example: Literal["vmap", "loop"] = "vmap",
    chunk_size: int | None = None,
    label: str = "model",
) -> dict[str, Any]:
    """Diagonal Fisher of ``model`` (with the weights of ``state_dict``, default its own) on
    ``batches`` (format in :mod:`mergeqp.merge.batches`), as defined in the module docstring.

    Returns ``{name: F}`` (float64, the parameter's shape) for ``names`` (default: every
    parameter; names that are not parameters are skipped; tied aliases get their parameter's
    Fisher)."""
    import torch
    from torch.func import grad, vmap

    model = check_model(model, "fisher")
    source = state_dict if isinstance(state_dict, TensorSource) else TensorSource(
        model.state_dict() if state_dict is None else state_dict, label)
    device = model_device(model)
    weights = model_weights(model, source, device)
    primary = _primary_names(model)
    wanted = list(primary) if names is None else [n for n in names if n in primary]
    diff_names = list(dict.fromkeys(primary[n] for n in wanted))
    ll = log_likelihood or categorical_log_likelihood
    fixed = {k: v for k, v in weights.items() if k not in diff_names}
    diff = {k: weights[k].detach() for k in diff_names}
    acc = {k: torch.zeros(v.shape, dtype=torch.float64, device=device) for k, v in diff.items()}
    count = 0

    def one(dp: dict, x: Any, y: Any) -> Any:
        x1 = map_tensors(x, lambda t: t.unsqueeze(0))
        y1 = None if y is None else y.unsqueeze(0)
        return ll(call(model, {**fixed, **dp}, x1), y1)

    def add(grads: Mapping[str, Any], per_row: bool) -> None:
        for k, g in grads.items():
            if g is not None:
                sq = g.detach().to(torch.float64) ** 2
                acc[k] += sq.sum(dim=0) if per_row else sq

    with eval_mode(model):
        for b, batch in enumerate(batches):
            where = f"{label} calibration batch {b}"
            inputs, targets = split_batch(batch, where)
            inputs = map_tensors(inputs, lambda t: t.to(device))
            n = n_examples(inputs, where)
            if targets is None and log_likelihood is None:
                with torch.no_grad():
                    targets = logits_of(run_model(model, weights, inputs, where)).argmax(dim=-1)
            if targets is not None:
                targets = targets.to(device)
                if targets.dim() == 0 or targets.shape[0] != n:
                    raise ValidationError(f"{where}: targets have shape {tuple(targets.shape)}, "
                                          f"expected {n} examples along dimension 0")
                if log_likelihood is None and not targets.is_floating_point():
                    keep = targets != IGNORE_INDEX  # class indices: checked outside vmap
                    if bool(keep.any()) and (int(targets[keep].min()) < 0):
                        raise ValidationError(f"{where}: negative class targets (only -100 is ignored)")
            if estimator == "batch":
                leaves = {k: v.clone().requires_grad_(True) for k, v in diff.items()}
                total = ll(call(model, {**fixed, **leaves}, inputs), targets)
                grads = torch.autograd.grad(total, list(leaves.values()), allow_unused=True)
                add(dict(zip(leaves, grads)), per_row=False)
                count += 1
            elif per_example == "vmap":
                in_dims = (None, 0, None if targets is None else 0)
                try:
                    add(vmap(grad(one), in_dims=in_dims, chunk_size=chunk_size)(diff, inputs, targets), per_row=True)
                except (RuntimeError, IndexError) as exc:
                    if "out of bounds" in str(exc):
                        raise ValidationError(f"{where}: a class target is not below the number of "
                                              f"logits ({str(exc).splitlines()[0]})") from None
                    if "vmap" in str(exc):  # vmap cannot trace the model: the caller may fall back to a loop
                        raise
                    raise model_failure(where, exc) from exc
                count += n
            else:
                for i in range(n):
                    leaves = {k: v.clone().requires_grad_(True) for k, v in diff.items()}
                    x_i = map_tensors(inputs, lambda t: t[i])
                    y_i = None if targets is None else targets[i]
                    total = one(leaves, x_i, y_i)
                    grads = torch.autograd.grad(total, list(leaves.values()), allow_unused=True)
                    add(dict(zip(leaves, grads)), per_row=False)
                count += n
    if count == 0:
        raise ValidationError(f"{label}: the calibration data holds no example")
    fisher = {k: v / count for k, v in acc.items()}
    return {n: fisher[primary[n]] for n in wanted}


def _supplied_fisher(F: Any, where: str) -> Any:
    """A user's Fisher as a tensor, checked: finite and non-negative (a mean of squared gradients;
    a negative entry makes the precision-weighted mean leave the models' range)."""
    F = supplied_tensor(F, where)
    if F.numel() and float(F.min()) < 0:
        raise ValidationError(f"{where} has a negative entry ({float(F.min()):.3g}): a Fisher is a mean of squared "
                              f"gradients")
    return F


def _check_fishers(fishers: Any, K: int, names: Sequence[str], inputs: Any) -> list[Mapping[str, Any]]:
    if not isinstance(fishers, Sequence) or isinstance(fishers, Mapping) or len(fishers) != K:
        raise ConfigError(f"parameter 'fishers' must be a list of {K} mappings name -> tensor "
                          f"(one per fine-tuned model)")
    for k, f in enumerate(fishers):
        if not isinstance(f, Mapping):
            raise ConfigError(f"fishers[{k}] must be a mapping name -> tensor, got {type(f).__name__}")
    for name in names:
        have = [name in f for f in fishers]
        if any(have) and not all(have):
            raise ValidationError(f"tensor {name!r} has a Fisher in fishers[{have.index(True)}] but "
                                  f"not in fishers[{have.index(False)}]")
        for k, f in enumerate(fishers):
            if name in f and tuple(np.shape(f[name])) != tuple(inputs.reference.shape(name)):
                raise ValidationError(f"the Fisher of tensor {name!r} in fishers[{k}] has shape "
                                      f"{tuple(np.shape(f[name]))}, expected {inputs.reference.shape(name)}")
    return [{n: (_supplied_fisher(v, f"the Fisher of tensor {n!r} in fishers[{k}]") if n in names else v)
             for n, v in f.items()} for k, f in enumerate(fishers)]


def _run(inputs: Any, names: Sequence[str], params: FisherParams) -> dict[str, Any]:
    import torch

    K = inputs.K
    c = resolve_weights(params.weights, K, 1.0)
    if sum(c) == 0:
        raise ConfigError("parameter 'weights' sums to 0: Fisher merging divides by it")
    if params.fishers is not None:
        fishers = _check_fishers(params.fishers, K, names, inputs)
    else:
        model = check_model(params.model, "fisher")
        calibration = check_calibration(params.calibration, K, "fisher")
        fishers = [
            compute_fisher(model, calibration[k], state_dict=inputs.finetuned[k], names=names,
                           log_likelihood=params.log_likelihood, estimator=params.estimator,
                           per_example=params.per_example, chunk_size=params.chunk_size,
                           label=inputs.finetuned[k].label)
            for k in range(K)
        ]
    with_fisher = [n for n in names if n in fishers[0]]
    scale = [1.0] * K
    if params.normalize_fisher:
        for k in range(K):
            norm = float(torch.sqrt(sum((fishers[k][n].double() ** 2).sum() for n in with_fisher)))
            scale[k] = 1.0 / norm if norm > 0 else 1.0
    out = {}
    for name in iterate(names, params, "Fisher merge"):
        thetas = [t.to(torch.float64) for t in inputs.finetuned_tensors(name)]
        average = sum(ck * t for ck, t in zip(c, thetas)) / sum(c)
        if name not in fishers[0]:
            out[name] = average
            continue
        device = thetas[0].device
        prec = [ck * (fishers[k][name].to(device, torch.float64) * scale[k] + params.fisher_floor)
                for k, ck in enumerate(c)]
        num = sum(p * t for p, t in zip(prec, thetas))
        den = sum(prec)
        zero = den == 0
        out[name] = torch.where(zero, average, num / torch.where(zero, 1.0, den))
    return out


FISHER = MergeMethod(
    name="fisher",
    summary="Fisher-weighted average with the diagonal empirical Fisher of each model",
    reference="Matena & Raffel, Merging Models with Fisher-Weighted Averaging, NeurIPS 2022 (arXiv:2111.09832)",
    params=FisherParams,
    run=_run,
    needs_base=False,
    tensorwise=False,
)
