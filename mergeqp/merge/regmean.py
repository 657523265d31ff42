"""RegMean: per-linear-layer least squares of the layer outputs, in closed form.

Jin et al., "Dataless Knowledge Fusion by Merging Weights of Language Models", ICLR 2023
(arXiv:2212.09849). For each linear layer (``nn.Linear``, or Hugging Face ``Conv1D`` with its
transposed weight) whose weight is selected, with ``X_k`` (``N_k x m``) the inputs the layer
sees in fine-tuned model ``k`` on its own calibration data (every position of a sequence is a
row), the Gram matrix ``G_k = X_k' X_k / N_k`` (``m x m``, float64) is shrunk off the diagonal,
``G~_k = alpha G_k + (1 - alpha) diag(G_k)``, and the merged weight (out x in) is::

    W = (sum_k c_k W_k G~_k) (sum_k c_k G~_k)^(-1)

``c_k`` = ``weights`` (default 1). With ``alpha = 1`` this is the exact least-squares solution
of ``min_W sum_k (c_k / N_k) ||X_k W' - X_k W_k'||^2`` (the layer outputs; each model's Gram is
a mean, so every model counts equally whatever its number of rows).

Bias (``bias=``): ``"augment"`` (default) appends a constant 1 to the layer input, so the
weight and bias ``[W | b]`` (``r x (m+1)``) are solved together and the least squares is
exactly that of the layer outputs; this needs both ``X.weight`` and ``X.bias`` selected (if
only the weight is, the weight is solved with the input block of the Gram). ``"average"``:
the weight is solved with the input block of the Gram and the bias is averaged, as the
reference implementation does.

When ``sum_k c_k G~_k`` is singular (inputs confined to a subspace: its Cholesky factorisation
fails or a squared pivot is below 1e-10 times its largest diagonal entry), the solution
closest to the weighted average ``W_bar`` is returned:
``W = W_bar + (B - W_bar A) A^+`` with ``A = sum c_k G~_k``, ``B = sum c_k W_k G~_k`` (equal to
``B A^(-1)`` when ``A`` is invertible): directions the inputs never take keep the average.

Every other selected tensor (embeddings, norms, ...) is the weighted average
``sum_k c_k theta_k / sum_k c_k``. The base is not used (only for unselected tensors).

Defaults: ``alpha`` 0.9 (our choice; the paper tunes alpha in [0, 1] on validation data and
shrinks the off-diagonal to keep the inverse well conditioned; fusion_bench defaults to 0.1,
0.95 for CLIP), ``bias="augment"``.

Precomputed Gram matrices can be passed instead of ``model`` + ``calibration``: ``grams`` = a
list of K mappings ``module name -> G`` with ``G`` ``(m1, m1)``, ``m1 = m + 1`` when the layer has
a bias (``X.bias`` in the state dict; the constant input last), else ``m``. Without ``model``
every module whose ``.weight`` is 2-D is taken as an ``nn.Linear`` (weight ``(out, in)``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from pydantic import Field, model_validator

from ..errors import ConfigError, ValidationError
from .batches import (
    check_calibration,
    check_model,
    eval_mode,
    map_tensors,
    model_device,
    model_weights,
    run_model,
    split_batch,
    supplied_tensor,
)
from .inputs import TensorSource
from .method import MergeMethod, WeightedParams, iterate, resolve_weights
from .sites import _kind, model_sites

#: relative threshold below which sum_k c_k G~_k counts as singular (see regmean_solve)
RANK_RTOL = 1e-10


class RegMeanParams(WeightedParams):
    model: Any = None
    calibration: Any = None
    grams: Any = None
    alpha: float = Field(0.9, ge=0.0, le=1.0)
    bias: Literal["augment", "average"] = "augment"

    @model_validator(mode="after")
    def _one_source(self) -> RegMeanParams:
        if self.grams is not None and self.calibration is not None:
            raise ValueError("give either grams= or model= with calibration=, not both")
        if self.grams is None and (self.model is None or self.calibration is None):
            raise ValueError("RegMean needs model= and calibration= (or precomputed grams=)")
        return self


class _Layer:
    """A linear layer: ``name``, ``kind`` (``linear`` | ``conv1d``), ``has_bias``."""

    def __init__(self, name: str, kind: str, has_bias: bool):
        self.name, self.kind, self.has_bias = name, kind, has_bias

    @property
    def weight_key(self) -> str:
        return f"{self.name}.weight"

    @property
    def bias_key(self) -> str:
        return f"{self.name}.bias"


def _model_layers(model: Any) -> list[_Layer]:
    if _kind(model) is not None:
        raise ValidationError(
            f"regmean: the model is itself a linear layer ({type(model).__name__}); RegMean finds "
            f"its layers among the submodules: wrap it (e.g. nn.Sequential(layer), whose state dict "
            f"keys are '0.weight', '0.bias') or pass grams= for it"
        )
    layers = [_Layer(s.name, s.kind, s.has_bias) for s in model_sites(model)]
    if not layers:
        raise ValidationError(f"regmean: the {type(model).__name__} model has no nn.Linear / Conv1D "
                              f"layer to solve for (every tensor would just be averaged)")
    return layers


class _InputsSeen(Exception):
    """Raised by :func:`gram_rows`'s hooks with ``stop_early`` once every chosen layer has its input."""


def compute_grams(
    model: Any,
    batches: Iterable[Any],
    *,
    state_dict: Any = None,
    layers: Sequence[str] | None = None,
    label: str = "model",
) -> dict[str, Any]:
    """Input Gram matrices ``G = X'X / N`` (float64, ``(m1, m1)``, a constant-1 column appended
    for layers with a bias) of the linear layers ``layers`` (module names; default all) of
    ``model`` run with the weights of ``state_dict`` (default its own) on ``batches``."""
    return gram_rows(model, batches, state_dict=state_dict, layers=layers, label=label)[0]


def gram_rows(
    model: Any,
    batches: Iterable[Any],
    *,
    state_dict: Any = None,
    layers: Sequence[str] | None = None,
    label: str = "model",
    stop_early: bool = False,
) -> tuple[dict[str, Any], dict[str, int]]:
    """:func:`compute_grams` and, per layer, the number of rows ``N`` of ``X`` its Gram matrix
    averages over (every position of every input: real tokens for unpadded text), so that the
    Grams of disjoint batch sets pool exactly: ``G = sum_j N_j G_j / sum_j N_j``. ``stop_early``:
    each pass stops once every chosen layer has seen its input (the model's output is not needed;
    a layer called more than once per pass counts its first call only)."""
    import torch

    model = check_model(model, "regmean")
    device = model_device(model)
    weights = None  # the model's own weights: run it as it is (a model with blocks on disk too)
    if state_dict is not None:
        source = state_dict if isinstance(state_dict, TensorSource) else TensorSource(state_dict, label)
        weights = model_weights(model, source, device)
    found = {lay.name: lay for lay in _model_layers(model)}
    chosen = list(found) if layers is None else list(layers)
    for name in chosen:
        if name not in found:
            raise ValidationError(f"module {name!r} is not a linear layer of the model")
    sums: dict[str, Any] = {}
    rows: dict[str, int] = {name: 0 for name in chosen}
    seen: set[str] = set()  # (stop_early) the chosen layers that have seen this pass's input

    def hook_for(name: str, has_bias: bool) -> Any:
        def hook(module: Any, args: tuple, kwargs: dict | None = None) -> None:
            if name in seen:
                return
            x = args[0] if args else next(iter((kwargs or {}).values()))
            X = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
            if has_bias:
                X = torch.cat([X, X.new_ones(X.shape[0], 1)], dim=1)
            sums[name] = sums.get(name, 0) + X.T @ X
            rows[name] += X.shape[0]
            if stop_early:
                seen.add(name)
                if len(seen) == len(chosen):
                    raise _InputsSeen
        return hook

    handles = [model.get_submodule(n).register_forward_pre_hook(hook_for(n, found[n].has_bias))
               for n in chosen]
    try:
        with eval_mode(model), torch.no_grad():
            for b, batch in enumerate(batches):
                where = f"{label} calibration batch {b}"
                inputs, _ = split_batch(batch, where)
                seen.clear()
                try:
                    run_model(model, weights, map_tensors(inputs, lambda t: t.to(device)), where)
                except _InputsSeen:
                    pass
    finally:
        for h in handles:
            h.remove()
    out = {}
    for name in chosen:
        if rows[name] == 0:
            raise ValidationError(f"layer {name!r} of {label} saw no input on the calibration data")
        out[name] = sums[name] / rows[name]
        if not bool(torch.isfinite(out[name]).all()):
            raise ValidationError(f"the inputs of layer {name!r} in {label} on its calibration data contain NaN or "
                                  f"inf (its Gram matrix is not finite): check the calibration batches")
    return out, rows


def shrink(G: Any, alpha: float) -> Any:
    """``alpha G + (1 - alpha) diag(G)``: off-diagonal entries scaled by ``alpha``."""
    import torch

    return alpha * G + (1.0 - alpha) * torch.diag(torch.diagonal(G))


def regmean_solve(weights: Sequence[Any], grams: Sequence[Any], c: Sequence[float]) -> Any:
    """``(sum c_k W_k G_k)(sum c_k G_k)^(-1)`` for ``W_k`` ``(r, m)`` and ``G_k`` ``(m, m)``
    (float64), by Cholesky. When the sum ``A`` is (numerically) singular -- the Cholesky
    factorisation fails or a squared pivot falls below ``RANK_RTOL`` times the largest diagonal
    entry -- the solution closest to the weighted average ``W_bar`` is returned,
    ``W_bar + (B - W_bar A) A^+``, with the pseudo-inverse from an eigendecomposition that drops
    eigenvalues below ``RANK_RTOL`` times the largest."""
    import torch

    A = sum(ck * G for ck, G in zip(c, grams))
    B = sum(ck * W @ G for ck, W, G in zip(c, weights, grams))
    A = (A + A.T) / 2
    scale = float(torch.diagonal(A).abs().max()) if A.numel() else 0.0
    L, info = torch.linalg.cholesky_ex(A)
    if scale > 0 and int(info) == 0 and float(torch.diagonal(L).min()) ** 2 > RANK_RTOL * scale:
        return torch.cholesky_solve(B.T, L).T
    evals, evecs = torch.linalg.eigh(A)
    keep = evals > RANK_RTOL * float(evals.abs().max()) if scale > 0 else evals > 0
    W_bar = sum(ck * W for ck, W in zip(c, weights)) / sum(c)
    V = evecs[:, keep]
    return W_bar + (B - W_bar @ A) @ ((V / evals[keep]) @ V.T)


def _layers_from_grams(grams: Any, inputs: Any) -> list[_Layer]:
    _check_gram_mappings(grams, inputs.K)
    for k, g in enumerate(grams[1:], start=1):
        if set(g) != set(grams[0]):
            name = sorted(set(g) ^ set(grams[0]))[0]
            where = 0 if name in grams[0] else k
            raise ValidationError(f"layer {name!r} has a Gram matrix in grams[{where}] but not in "
                                  f"grams[{k if where == 0 else 0}] (every model needs one per merged layer)")
    out = []
    for name in grams[0]:
        if f"{name}.weight" not in inputs.names or len(inputs.reference.shape(f"{name}.weight")) != 2:
            raise ValidationError(f"grams[0] has a Gram for {name!r}, but {name + '.weight'!r} is not a "
                                  f"2-D tensor of the models")
        out.append(_Layer(name, "linear", f"{name}.bias" in inputs.names))
    return out


def _check_gram_mappings(grams: Any, K: int) -> None:
    if not isinstance(grams, Sequence) or isinstance(grams, Mapping) or len(grams) != K:
        raise ConfigError(f"parameter 'grams' must be a list of {K} mappings module name -> Gram "
                          f"matrix (one per fine-tuned model)")
    for k, g in enumerate(grams):
        if not isinstance(g, Mapping):
            raise ConfigError(f"grams[{k}] must be a mapping module name -> tensor, got {type(g).__name__}")


def _supplied_gram(G: Any, where: str) -> Any:
    """A user's Gram matrix as a float64 tensor, checked: finite, symmetric, non-negative diagonal
    (a Gram matrix ``X'X / N`` is positive semidefinite; a negated or damaged one is refused)."""
    import torch

    G = supplied_tensor(G, where).to(torch.float64)
    scale = float(G.abs().max()) if G.numel() else 0.0
    if float((G - G.T).abs().max()) > 1e-6 * max(scale, 1e-300):
        raise ValidationError(f"{where} is not symmetric (a Gram matrix X'X / N is)")
    if G.numel() and float(torch.diagonal(G).min()) < -1e-12 * scale:
        raise ValidationError(f"{where} has a negative diagonal entry ({float(torch.diagonal(G).min()):.3g}): a "
                              f"Gram matrix X'X / N is positive semidefinite")
    return G


def _check_grams(grams: Any, K: int, layers: Sequence[_Layer], inputs: Any) -> None:
    _check_gram_mappings(grams, K)
    for lay in layers:
        shape = inputs.reference.shape(lay.weight_key)
        m = shape[0] if lay.kind == "conv1d" else shape[1]
        m1 = m + (1 if lay.has_bias else 0)
        for k, g in enumerate(grams):
            if lay.name not in g:
                raise ValidationError(f"layer {lay.name!r} has no Gram matrix in grams[{k}]")
            if tuple(g[lay.name].shape) != (m1, m1):
                raise ValidationError(
                    f"the Gram matrix of layer {lay.name!r} in grams[{k}] has shape "
                    f"{tuple(g[lay.name].shape)}, expected ({m1}, {m1})"
                    + (" (the constant input of the bias last)" if lay.has_bias else ""))


def _run(inputs: Any, names: Sequence[str], params: RegMeanParams) -> dict[str, Any]:
    import torch

    K = inputs.K
    c = resolve_weights(params.weights, K, 1.0)
    if sum(c) == 0:
        raise ConfigError("parameter 'weights' sums to 0: RegMean divides by it")
    selected = set(names)
    model = None if params.model is None else check_model(params.model, "regmean")
    all_layers = _model_layers(model) if model is not None else _layers_from_grams(params.grams, inputs)
    layers = [lay for lay in all_layers if lay.weight_key in selected]
    if params.grams is not None:
        _check_grams(params.grams, K, layers, inputs)
        grams = [{lay.name: _supplied_gram(params.grams[k][lay.name], f"the Gram matrix of layer {lay.name!r} in "
                                                                      f"grams[{k}]")
                  for lay in layers} for k in range(K)]
    else:
        calibration = check_calibration(params.calibration, K, "regmean")
        grams = [compute_grams(model, calibration[k], state_dict=inputs.finetuned[k],
                               layers=[lay.name for lay in layers], label=inputs.finetuned[k].label)
                 for k in range(K)]
    out: dict[str, Any] = {}
    for lay in iterate(layers, params, "RegMean"):
        joint = lay.has_bias and params.bias == "augment" and lay.bias_key in selected
        Ws = []
        for t in inputs.finetuned_tensors(lay.weight_key):
            W = t.to(torch.float64)
            Ws.append(W.T if lay.kind == "conv1d" else W)
        m = Ws[0].shape[1]
        if joint:
            Ws = [torch.cat([W, b.to(torch.float64).reshape(-1, 1)], dim=1)
                  for W, b in zip(Ws, inputs.finetuned_tensors(lay.bias_key))]
            Gs = [shrink(g[lay.name], params.alpha) for g in grams]
        else:
            Gs = [shrink(g[lay.name][:m, :m], params.alpha) for g in grams]
        Gs = [G.to(Ws[0].device) for G in Gs]
        merged = regmean_solve(Ws, Gs, c)
        weight = merged[:, :m]
        out[lay.weight_key] = weight.T if lay.kind == "conv1d" else weight
        if joint:
            out[lay.bias_key] = merged[:, m]
    for name in names:
        if name not in out:
            thetas = [t.to(torch.float64) for t in inputs.finetuned_tensors(name)]
            out[name] = sum(ck * t for ck, t in zip(c, thetas)) / sum(c)
    return out


REGMEAN = MergeMethod(
    name="regmean",
    summary="per linear layer, closed-form least squares of the layer outputs (shrunk Gram matrices)",
    reference=("Jin et al., Dataless Knowledge Fusion by Merging Weights of Language Models, ICLR 2023 "
               "(arXiv:2212.09849)"),
    params=RegMeanParams,
    run=_run,
    needs_base=False,
    tensorwise=False,
)
