"""DARE (drop and rescale) and its combinations, plus the paper's row-uniform DARE.

Yu et al., "Language Models are Super Mario: Absorbing Abilities from Homologous Models as a
Free Lunch" (DARE), ICML 2024 (arXiv:2311.03099). Per tensor, with task vectors
``delta_k = finetuned_k - base`` and keep-masks ``m_k ~ Bernoulli(density)`` (element-wise;
seeding and injection in :mod:`mergeqp.merge.masks`), the sparsified task vector is

- ``rescale="inverse"``: ``delta_k * m_k / density`` (the paper's ``1/(1-p)``; PEFT),
- ``rescale="l1"``: ``delta_k * m_k * |delta_k|_1 / |delta_k * m_k|_1`` per tensor (mergekit's
  default for ``dare_*``; left unscaled when either norm is below 1e-7, as mergekit),
- ``rescale="none"``: ``delta_k * m_k``.

Methods:

- ``dare``: the paper's form with a *drop rate* ``drop_rate`` (p, default 0.5): identical to
  ``dare_linear`` with ``density = 1 - p`` and ``rescale="inverse"``:
  ``merged = base + scaling * sum_k w_k delta_k m_k / (1 - p)``. Defaults ``weights`` 1,
  ``scaling`` 1.0.
- ``dare_linear``: ``merged = base + scaling * sum_k w_k D_k / (sum_k w_k if normalize else 1)``
  with ``D_k`` the sparsified task vectors. Defaults ``density`` 0.5, ``rescale="inverse"``,
  ``normalize`` False, weights 1, scaling 1. PEFT's ``dare_linear`` is ``rescale="inverse"``;
  mergekit's ``dare_linear`` is ``rescale="l1"`` (its default ``normalize`` is False too).
- ``dare_ties``: DARE-sparsified task vectors merged by TIES' sign election and disjoint merge
  (:func:`mergeqp.merge.ties.consensus_merge`). ``variant="paper"``/``"peft"`` (default) is PEFT's
  ``dare_ties`` (unweighted election, divide by the count of agreeing models; default
  ``rescale="inverse"``); ``variant="mergekit"`` is mergekit's ``dare_ties`` (weighted election;
  default ``rescale="l1"`` and ``normalize=False``). Defaults ``density`` 0.5, weights 1,
  ``scaling`` 1, ``sign_method="sum"``.
- ``row_dare``: the paper's row-uniform DARE (``D_k = diag(m^(k)/p)``, ``m^(k)_i ~
  Bernoulli(p)`` iid per row, p = ``density``): one keep-draw per *row* (first dimension) of
  each model's task vector, ``merged = base + scaling * sum_k w_k diag(m_k / density) delta_k``.
  A bias ``X.bias`` shares the row mask of ``X.weight`` (when that weight has as many rows): in
  the paper's augmented layout the bias is the weight's last column, so a row's draw covers
  both. Other 1-D tensors get one draw per entry. Defaults ``density`` 0.5, weights 1,
  scaling 1. Injected masks have shape ``(K, rows)`` keyed by the *weight's* name.

Every DARE method takes ``seed`` (default 0), ``seed_scope`` (``"tensor"`` default, or
``"global"`` to reproduce PEFT / mergekit after ``torch.manual_seed(seed)``) and ``masks``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, model_validator

from .masks import MaskDrawer
from .method import (
    MergeMethod,
    WeightedParams,
    resolve_weights,
    tensorwise_run,
    weight_column,
)
from .task_arithmetic import task_vectors
from .ties import SignMethod, Variant, consensus_merge

Rescale = Literal["inverse", "l1", "none"]
L1_EPS = 1e-7


class DareCommon(WeightedParams):
    scaling: float = 1.0
    seed: int = Field(0, ge=0, le=2**63 - 1)
    seed_scope: Literal["tensor", "global"] = "tensor"
    masks: Mapping[str, Any] | None = None


class DareParams(DareCommon):
    drop_rate: float = Field(0.5, ge=0.0, lt=1.0)


class DareLinearParams(DareCommon):
    density: float = Field(0.5, gt=0.0, le=1.0)
    rescale: Rescale = "inverse"
    normalize: bool = False


class DareTiesParams(DareCommon):
    density: float = Field(0.5, gt=0.0, le=1.0)
    rescale: Rescale | None = None
    variant: Variant = "paper"
    sign_method: SignMethod = "sum"
    normalize: bool | None = None

    @model_validator(mode="after")
    def _normalize_only_mergekit(self) -> DareTiesParams:
        if self.normalize is not None and self.variant != "mergekit":
            raise ValueError("'normalize' applies only to variant='mergekit'")
        return self


class RowDareParams(DareCommon):
    density: float = Field(0.5, gt=0.0, le=1.0)


def rescale_masked(delta: Any, mask: Any, density: float, rescale: Rescale) -> Any:
    """Sparsified task vector ``delta * mask`` rescaled as ``rescale`` says (any shape)."""
    masked = delta * mask
    if rescale == "inverse":
        return masked / density
    if rescale == "l1":
        before, after = delta.abs().sum(), masked.abs().sum()
        if before < L1_EPS or after < L1_EPS:
            return masked
        return masked * (before / after)
    return masked


def _drawer(state: dict, params: DareCommon) -> MaskDrawer:
    """The merge's mask drawer (created by ``tensorwise_run``'s setup, so that its check of
    unused injected masks runs even when no tensor is merged)."""
    if "drawer" not in state:
        drawer = MaskDrawer(state["inputs"].K, params.seed, params.seed_scope, params.masks)
        state["drawer"] = drawer
        state["finish"] = drawer.check_all_used
    return state["drawer"]


def _sparsified(name: str, deltas: Any, params: DareCommon, state: dict, density: float,
                rescale: Rescale) -> Any:
    import torch

    mask = _drawer(state, params).elementwise(name, tuple(deltas.shape[1:]), density)
    mask = mask.to(device=deltas.device, dtype=deltas.dtype)
    return torch.stack([rescale_masked(d, m, density, rescale) for d, m in zip(deltas, mask)])


def _linear(base_c: Any, sparse: Any, weights: list[float], scaling: float, normalize: bool) -> Any:
    mixed = (sparse * weight_column(weights, sparse)).sum(dim=0)
    if normalize:
        total = sum(weights)
        mixed = mixed / (total if abs(total) >= 1e-8 else 1.0)
    return base_c + scaling * mixed


def _dare_one(name: str, base: Any, finetuned: list[Any], params: DareParams, state: dict) -> Any:
    base_c, deltas = task_vectors(base, finetuned)
    density = 1.0 - params.drop_rate
    sparse = _sparsified(name, deltas, params, state, density, "inverse")
    return _linear(base_c, sparse, resolve_weights(params.weights, len(finetuned), 1.0), params.scaling, False)


def _dare_linear_one(name: str, base: Any, finetuned: list[Any], params: DareLinearParams, state: dict) -> Any:
    base_c, deltas = task_vectors(base, finetuned)
    sparse = _sparsified(name, deltas, params, state, params.density, params.rescale)
    weights = resolve_weights(params.weights, len(finetuned), 1.0)
    return _linear(base_c, sparse, weights, params.scaling, params.normalize)


def _dare_ties_one(name: str, base: Any, finetuned: list[Any], params: DareTiesParams, state: dict) -> Any:
    base_c, deltas = task_vectors(base, finetuned)
    mergekit = params.variant == "mergekit"
    rescale = params.rescale or ("l1" if mergekit else "inverse")
    sparse = _sparsified(name, deltas, params, state, params.density, rescale)
    normalize = (params.normalize or False) if mergekit else None
    mixed = consensus_merge(sparse, resolve_weights(params.weights, len(finetuned), 1.0),
                            variant=params.variant, sign_method=params.sign_method, normalize=normalize)
    return base_c + params.scaling * mixed


def row_group(name: str, shape: tuple[int, ...], inputs: Any) -> str:
    """The mask key of ``name``'s rows: ``X.weight`` for a bias ``X.bias`` whose weight exists
    with the same number of rows, else ``name`` itself."""
    if name.endswith(".bias") and len(shape) == 1:
        partner = name[: -len("bias")] + "weight"
        if partner in inputs.names:
            pshape = inputs.reference.shape(partner)
            if len(pshape) >= 1 and pshape[0] == shape[0]:
                return partner
    return name


def _row_dare_one(name: str, base: Any, finetuned: list[Any], params: RowDareParams, state: dict) -> Any:
    base_c, deltas = task_vectors(base, finetuned)
    shape = tuple(base.shape)
    n_rows = shape[0] if shape else 1
    group = row_group(name, shape, state["inputs"])
    rows = _drawer(state, params).rows(group, n_rows, params.density)
    rows = rows.to(device=deltas.device, dtype=deltas.dtype)
    mask = rows.reshape((len(finetuned),) + shape) if not shape else rows.reshape(
        (len(finetuned), n_rows) + (1,) * (len(shape) - 1))
    sparse = deltas * mask / params.density
    return _linear(base_c, sparse, resolve_weights(params.weights, len(finetuned), 1.0), params.scaling, False)


DARE = MergeMethod(
    name="dare",
    summary="drop each task-vector entry with probability drop_rate, rescale by 1/(1-p), add",
    reference="Yu et al., DARE (Super Mario), ICML 2024 (arXiv:2311.03099)",
    params=DareParams,
    run=tensorwise_run(_dare_one, "DARE", setup=_drawer),
)

DARE_LINEAR = MergeMethod(
    name="dare_linear",
    summary="DARE-sparsified task vectors, weighted sum (PEFT / mergekit dare_linear)",
    reference="Yu et al., DARE (Super Mario), ICML 2024 (arXiv:2311.03099)",
    params=DareLinearParams,
    run=tensorwise_run(_dare_linear_one, "DARE-linear", setup=_drawer),
)

DARE_TIES = MergeMethod(
    name="dare_ties",
    summary="DARE-sparsified task vectors merged by TIES sign election and disjoint merge",
    reference="Yu et al., DARE, ICML 2024 (arXiv:2311.03099); Yadav et al., TIES, NeurIPS 2023",
    params=DareTiesParams,
    run=tensorwise_run(_dare_ties_one, "DARE-TIES", setup=_drawer),
)

ROW_DARE = MergeMethod(
    name="row_dare",
    summary="row-uniform DARE: one Bernoulli(density) keep-draw per row, rescaled by 1/density",
    reference="output-space-projection paper, Sec. 2 (row-uniform restriction of Yu et al.'s DARE)",
    params=RowDareParams,
    run=tensorwise_run(_row_dare_one, "row-DARE", setup=_drawer),
)
