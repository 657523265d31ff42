"""TIES merging: trim, elect sign, disjoint merge (and the sign consensus DARE-TIES reuses).

Yadav et al., "TIES-Merging: Resolving Interference When Merging Models", NeurIPS 2023
(arXiv:2306.01708). Per tensor, with task vectors ``delta_k = finetuned_k - base``:

1. **trim**: keep the ``k = int(density * numel)`` entries of ``delta_k`` with the largest
   magnitude (``torch.topk``), zero the rest (``density >= 1``: no trimming);
2. **elect**: ``s = +1`` where ``sum_k T_k >= 0`` else ``-1`` (``sign_method="sum"``, the
   paper's "total mass"), or the sign of ``sum_k sign(T_k)`` (``"count"``, PEFT's "frequency",
   mergekit's ``count``); ties count as ``+``;
3. **disjoint merge**: ``m_k = [sign(T_k) == s]`` (zeros never agree), and

   ``merged = base + scaling * sum_k w_k T_k m_k / max(sum_k m_k, 1)``.

Defaults: ``density`` 0.2 (the paper keeps the top 20%), ``weights`` 1 per model, ``scaling``
1.0 (the paper's lambda), ``variant="paper"``, ``sign_method="sum"``. With unit weights this is
the paper's disjoint mean.

Variants (``variant=``):

- ``"paper"`` / ``"peft"`` (same formula): the above. It is exactly PEFT's
  ``merge_utils.ties(task_tensors, weights, density, majority_sign_method)`` for any weights:
  PEFT elects on the *unweighted* trimmed tensors and divides by the *count* of agreeing models.
- ``"mergekit"``: mergekit's ``ties``. The weights multiply the trimmed tensors *before* the
  election (``E_k = w_k T_k``; sign of ``sum_k E_k``), the trim keeps ``max(1, int(density*numel))``
  entries, and with ``normalize`` (default True) the sum ``sum_k E_k m_k`` is divided by the sum
  of the weights of the kept entries ``sum_k w_k m_k`` (0 replaced by 1), then times ``scaling``
  (mergekit's ``lambda``). With weights ``1/K`` it equals the paper's form (mergekit issue #474
  discusses the difference).
  ``normalize`` may only be set with this variant.

Magnitude ties at the trim threshold are broken by ``torch.topk`` (PEFT's choice; mergekit uses
``argsort``): with exactly equal magnitudes the kept set can differ from mergekit's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field, model_validator

from .method import (
    MergeMethod,
    WeightedParams,
    resolve_weights,
    tensorwise_run,
    weight_column,
)
from .task_arithmetic import task_vectors

Variant = Literal["paper", "peft", "mergekit"]
SignMethod = Literal["sum", "count"]


class TiesParams(WeightedParams):
    density: float = Field(0.2, ge=0.0, le=1.0)
    scaling: float = 1.0
    variant: Variant = "paper"
    sign_method: SignMethod = "sum"
    normalize: bool | None = None

    @model_validator(mode="after")
    def _normalize_only_mergekit(self) -> TiesParams:
        if self.normalize is not None and self.variant != "mergekit":
            raise ValueError(
                "'normalize' applies only to variant='mergekit' (the paper/PEFT variant always "
                "divides by the count of agreeing models)"
            )
        return self


def magnitude_trim(delta: Any, density: float, *, at_least_one: bool = False) -> Any:
    """Keep the ``int(density * numel)`` largest-magnitude entries of ``delta`` (any shape).

    ``at_least_one`` (mergekit): keep ``max(1, ...)`` entries when ``0 < density < 1``, and
    return zeros for ``density <= 0``. ``density >= 1`` returns ``delta`` unchanged."""
    import torch

    if density >= 1:
        return delta
    n = delta.numel()
    if at_least_one:
        if density <= 0 or n == 0:
            return torch.zeros_like(delta)
        k = max(1, int(density * n))
    else:
        k = int(density * n)
    mask = torch.zeros(n, dtype=delta.dtype, device=delta.device)
    if k > 0:
        mask[torch.topk(delta.abs().reshape(-1), k=k, largest=True).indices] = 1
    return delta * mask.reshape(delta.shape)


def elect_sign(values: Any, sign_method: SignMethod = "sum") -> Any:
    """Elected sign (``+1``/``-1``, ties ``+1``) of ``(K, *shape)`` values, shape ``shape``."""
    import torch

    mass = values.sum(dim=0) if sign_method == "sum" else values.sign().sum(dim=0)
    return torch.where(mass >= 0, 1.0, -1.0).to(values.dtype)


def consensus_merge(trimmed: Any, weights: Sequence[float], *, variant: Variant = "paper",
                    sign_method: SignMethod = "sum", normalize: bool | None = None) -> Any:
    """The merged delta (``shape``) of sparsified task vectors ``trimmed`` (``(K, *shape)``).

    See the module docstring for the two formulas (``variant``)."""
    w = weight_column(weights, trimmed)
    if variant == "mergekit":
        weighted = trimmed * w
        agree = weighted.sign() == elect_sign(weighted, sign_method)
        mixed = (weighted * agree).sum(dim=0)
        if normalize:
            divisor = (w * agree).sum(dim=0)
            divisor[divisor == 0] = 1
            mixed = mixed / divisor
        return mixed
    agree = trimmed.sign() == elect_sign(trimmed, sign_method)
    mixed = (trimmed * w * agree).sum(dim=0)
    return mixed / agree.sum(dim=0).clamp(min=1).to(mixed.dtype)


def _ties_one(name: str, base: Any, finetuned: list[Any], params: TiesParams, state: dict) -> Any:
    import torch

    base_c, deltas = task_vectors(base, finetuned)
    mergekit = params.variant == "mergekit"
    trimmed = torch.stack([magnitude_trim(d, params.density, at_least_one=mergekit) for d in deltas])
    weights = resolve_weights(params.weights, len(finetuned), 1.0)
    normalize = (True if params.normalize is None else params.normalize) if mergekit else None
    mixed = consensus_merge(trimmed, weights, variant=params.variant, sign_method=params.sign_method,
                            normalize=normalize)
    return base_c + params.scaling * mixed


TIES = MergeMethod(
    name="ties",
    summary="trim to the top-density magnitudes, elect the sign by total mass, disjoint mean",
    reference="Yadav et al., TIES-Merging, NeurIPS 2023 (arXiv:2306.01708)",
    params=TiesParams,
    run=tensorwise_run(_ties_one, "TIES"),
)
