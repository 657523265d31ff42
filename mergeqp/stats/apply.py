"""Turning a QP point ``d`` into merged weights, a merged model or a merged state dict, and
known merges as points of the same QP.

Merged layer: ``W = W_base + sum_(k,a) d[k, a] B_(k,a)`` (augmented with the bias column; see
:mod:`.parametrisation`). Inputs are never modified: models are deep-copied, state dicts are
shallow-copied with new tensors for the merged layer (other entries still refer to the
base's tensors).

Known merges (``d`` of shape ``(K, n_atoms)``):

- ``task_arithmetic``: ``d = lambda`` everywhere (``W_base + lambda sum_k delta_k`` for
  ``scalar``, ``rows`` and ``columns``; for a basis ``Q`` it is ``lambda Q Q' sum_k delta_k``);
- ``soup``: ``d = 1/K`` (the average of the K fine-tuned layers when the parametrisation is
  complete);
- ``row_dare`` (``rows`` only): the paper's row-uniform DARE, each row of each model kept with
  probability ``1 - p`` (one seeded Bernoulli draw per row) and rescaled by ``lambda/(1 - p)``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import ValidationError
from .hooks import augmented_weight, check_same_architecture, check_untied, resolve_linear
from .parametrisation import (
    Parametrisation,
    RowsParametrisation,
    as_parametrisation,
    check_d,
    merged_update,
    solution_point,
)


def _finite_number(value: Any, what: str) -> float:
    """``value`` as a finite float; a ValidationError naming ``what`` otherwise."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValidationError(f"{what} must be a number, got {value!r}") from None
    if not np.isfinite(out):
        raise ValidationError(f"{what} must be finite, got {out}")
    return out


def task_arithmetic_point(shape: tuple[int, int], lam: float = 1.0) -> np.ndarray:
    """``d = lambda`` everywhere (``(K, n_atoms)``): task arithmetic in a layout whose atoms sum to each
    fine-tune's residual (``rows``, ``basis``). A parametrisation with other atoms (``rows+baselines``)
    is not: there, task arithmetic is rows ``lambda`` and baseline atoms 0."""
    return np.full(shape, float(lam))


def soup_point(shape: tuple[int, int]) -> np.ndarray:
    """``d = 1/K`` everywhere (``(K, n_atoms)``): the soup in a layout whose atoms sum to each fine-tune's
    residual. For a given problem, :meth:`mergeqp.MergeQP.soup_point` is its soup whatever the atoms
    (``rows+baselines``: rows ``1/K``, baseline atoms 0)."""
    return np.full(shape, 1.0 / shape[0])


def row_dare_point(K: int, r: int, p: float = 0.5, seed: int = 0, lam: float = 1.0) -> np.ndarray:
    """Row-uniform DARE in the ``rows`` layout (``(K, r)``): keep each row with probability
    ``1 - p`` (``numpy.random.default_rng(seed)``), rescale kept rows by ``lam / (1 - p)``."""
    if not 0.0 <= p < 1.0:
        raise ValidationError(f"DARE drop probability p must be in [0, 1), got {p}")
    keep = np.random.default_rng(seed).random((K, r)) >= p
    return keep * (float(lam) / (1.0 - p))


def merge_points(param: Parametrisation, K: int, r: int, m1: int, *, lam: float = 1.0,
                 dare_p: float = 0.5, seed: int = 0) -> dict[str, np.ndarray]:
    """Known merges as points ``d`` of the QP of ``param`` (see the module docstring)."""
    lam = _finite_number(lam, "the task-arithmetic weight lam")
    dare_p = _finite_number(dare_p, "the DARE drop probability dare_p")
    points = {  # (each family's own coordinates of them: rows+baselines' baseline atoms stay 0)
        "task_arithmetic": param.task_vector_point(K, r, m1, lam),
        "soup": param.task_vector_point(K, r, m1, 1.0 / K),
    }
    if isinstance(param, RowsParametrisation):
        points["row_dare"] = row_dare_point(K, r, dare_p, seed, lam)
    return points


def layer_deltas(base_model: Any, finetuned_models: Sequence[Any], layer: str) -> tuple[np.ndarray, np.ndarray, bool]:
    """``(base_weight (r, m1), deltas (K, r, m1), has_bias)`` at ``layer`` (float64)."""
    models = list(finetuned_models.values()) if isinstance(finetuned_models, Mapping) else list(finetuned_models)
    if not models:
        raise ValidationError("finetuned_models is empty")
    names = (list(finetuned_models) if isinstance(finetuned_models, Mapping)
             else [f"model{i}" for i in range(len(models))])
    check_same_architecture(base_model, list(zip(names, models)))
    base_layer = resolve_linear(base_model, layer, "base model")
    base = augmented_weight(base_layer)
    deltas = np.stack([augmented_weight(resolve_linear(m, layer, f"fine-tuned model {n!r}")) - base
                       for n, m in zip(names, models)])
    return base, deltas, base_layer.bias is not None


def merged_layer_weight(base_weight: np.ndarray, deltas: np.ndarray, d: Any,
                        parametrisation: Any = "rows") -> np.ndarray:
    """``W_base + sum_a d_a B_a`` (augmented, ``(r, m1)``, float64)."""
    param = as_parametrisation(parametrisation)
    K, r, m1 = deltas.shape
    param.check(r, m1)
    d = check_d(d, K, param.n_atoms(r, m1), param)
    base_weight = np.asarray(base_weight, dtype=np.float64)
    deltas = np.asarray(deltas, dtype=np.float64)
    if not np.all(np.isfinite(base_weight)):
        raise ValidationError("the base model's layer weights contain NaN or inf")
    bad = [k for k in range(K) if not np.all(np.isfinite(deltas[k]))]
    if bad:
        raise ValidationError(
            f"the layer weights of fine-tuned model(s) {bad} (0-based) contain NaN or inf"
        )
    return base_weight + merged_update(param, d, deltas)


def set_linear_weights(model: Any, layer: str, weight: np.ndarray, bias: np.ndarray | None,
                       expected_base: np.ndarray | None = None) -> Any:
    """A deep copy of ``model`` with ``layer``'s weight (``(r, m)``) and bias (``(r,)``) replaced.

    ``expected_base`` (augmented ``(r, m1)``): if given, the model's layer must hold it (checks
    that the statistics belong to this model)."""
    import torch  # deferred: torch is heavy

    module = resolve_linear(model, layer, "model")
    check_untied(model, layer, "model")
    if expected_base is not None:
        have = augmented_weight(module)
        if have.shape != expected_base.shape or not np.allclose(have, expected_base, rtol=1e-5, atol=1e-6):
            raise ValidationError(
                f"the model's layer {layer!r} does not hold the base weights the statistics were "
                f"collected with; pass the same base model"
            )
    if tuple(module.weight.shape) != tuple(weight.shape):
        raise ValidationError(
            f"merged weight has shape {tuple(weight.shape)} but {layer}.weight is {tuple(module.weight.shape)}"
        )
    if (bias is None) != (module.bias is None):
        raise ValidationError(f"bias presence of the merged weights does not match layer {layer!r}")
    merged = copy.deepcopy(model)
    target = resolve_linear(merged, layer, "model")
    with torch.no_grad():
        target.weight.copy_(torch.as_tensor(weight, dtype=target.weight.dtype))
        if bias is not None:
            target.bias.copy_(torch.as_tensor(bias, dtype=target.bias.dtype))
    return merged


def apply_merge(base_model: Any, finetuned_models: Sequence[Any], layer: str, d: Any,
                parametrisation: Any = None) -> Any:
    """A new model: ``base_model`` with ``layer`` set to ``W_base + sum_a d_a B_a``.

    ``d``: a :class:`~mergeqp.solution.Solution` (read in its QP's recorded parametrisation), or
    coefficients ``(K, n_atoms)`` (or flat) for ``parametrisation`` (``rows`` when ``None``;
    ``scalar``, ``columns``, a :class:`Basis`, an orthonormal ``(r, p)`` array or a
    parametrisation instance). Inputs are untouched.
    """
    base, deltas, has_bias = layer_deltas(base_model, finetuned_models, layer)
    d, param = solution_point(d, parametrisation, layer=layer)
    W = merged_layer_weight(base, deltas, d, param)
    return set_linear_weights(base_model, layer, W[:, :-1] if has_bias else W,
                              W[:, -1] if has_bias else None)


def apply_merge_state_dict(base_state_dict: Mapping[str, Any], finetuned_state_dicts: Sequence[Mapping[str, Any]],
                           layer: str, d: Any, parametrisation: Any = None) -> dict[str, Any]:
    """The state-dict form of :func:`apply_merge`: a new dict with ``{layer}.weight`` (and
    ``.bias``) merged; other entries are the base's tensors (not copied)."""
    import torch  # deferred: torch is heavy

    wkey, bkey = f"{layer}.weight", f"{layer}.bias"
    if wkey not in base_state_dict:
        candidates = [k[: -len(".weight")] for k, v in base_state_dict.items()
                      if k.endswith(".weight") and getattr(v, "ndim", 0) == 2]
        raise ValidationError(
            f"the base state dict has no tensor {wkey!r}; 2-D weights exist for: "
            f"{', '.join(candidates[:40]) or '(none)'}"
        )
    has_bias = bkey in base_state_dict

    def aug(sd: Mapping[str, Any], who: str) -> np.ndarray:
        if wkey not in sd:
            raise ValidationError(f"{who} has no tensor {wkey!r}")
        W = torch.as_tensor(sd[wkey]).detach().to("cpu", torch.float64)
        if W.shape != base_state_dict[wkey].shape:
            raise ValidationError(
                f"tensor {wkey!r} has shape {tuple(W.shape)} in {who} but "
                f"{tuple(base_state_dict[wkey].shape)} in the base"
            )
        if has_bias:
            if bkey not in sd:
                raise ValidationError(f"{who} has no tensor {bkey!r}")
            W = torch.cat([W, torch.as_tensor(sd[bkey]).detach().to("cpu", torch.float64)[:, None]], 1)
        return W.numpy()

    base = aug(base_state_dict, "the base state dict")
    if not finetuned_state_dicts:
        raise ValidationError("finetuned_state_dicts is empty")
    deltas = np.stack([aug(sd, f"fine-tuned state dict {i}") - base
                       for i, sd in enumerate(finetuned_state_dicts)])
    d, param = solution_point(d, parametrisation, layer=layer)
    W = merged_layer_weight(base, deltas, d, param)
    out = dict(base_state_dict)
    ref_w = base_state_dict[wkey]
    out[wkey] = torch.as_tensor(W[:, :-1] if has_bias else W).to(ref_w.dtype).contiguous()
    if has_bias:
        out[bkey] = torch.as_tensor(W[:, -1]).to(base_state_dict[bkey].dtype).contiguous()
    return out
