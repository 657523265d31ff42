"""Task arithmetic and the model soup (weighted linear average).

Task arithmetic (Ilharco et al., "Editing Models with Task Arithmetic", ICLR 2023,
arXiv:2212.04089), per tensor with ``delta_k = finetuned_k - base``::

    merged = base + scaling * sum_k w_k delta_k / (sum_k w_k if normalize else 1)

Defaults: ``weights`` 1 per model, ``scaling`` 1.0 (mergekit's ``lambda``), ``normalize``
False. Equals PEFT's ``merge_utils.task_arithmetic`` (``scaling=1``) and mergekit's
``task_arithmetic`` (same weights / lambda / normalize; mergekit replaces a weight sum with
``|sum| < 1e-8`` by 1, as here).

Model soup (Wortsman et al., "Model soups", ICML 2022, arXiv:2203.05482), per tensor::

    merged = sum_k w_k finetuned_k / (sum_k w_k if normalize else 1)

Defaults: ``weights`` uniform (1/K), ``normalize`` True (mergekit's ``linear``). The base is
not used (only for unselected tensors), so ``base`` may be ``None``.
"""

from __future__ import annotations

from typing import Any

from ..errors import ValidationError
from .method import (
    MergeMethod,
    WeightedParams,
    compute_dtype,
    resolve_weights,
    stacked,
    tensorwise_run,
    weight_column,
)


class TaskArithmeticParams(WeightedParams):
    scaling: float = 1.0
    normalize: bool = False


class SoupParams(WeightedParams):
    normalize: bool = True


def task_vectors(base: Any, finetuned: list[Any]) -> tuple[Any, Any]:
    """``(base_c, deltas)``: the base in the compute dtype and ``(K, *shape)`` task vectors."""
    dtype = compute_dtype(base)
    base_c = base.to(dtype)
    return base_c, stacked(finetuned, dtype, base.device) - base_c


def _task_arithmetic_one(name: str, base: Any, finetuned: list[Any], params: TaskArithmeticParams,
                         state: dict) -> Any:
    base_c, deltas = task_vectors(base, finetuned)
    w = weight_column(resolve_weights(params.weights, len(finetuned), 1.0), deltas)
    mixed = (deltas * w).sum(dim=0)
    if params.normalize:
        total = float(w.sum())
        mixed = mixed / (total if abs(total) >= 1e-8 else 1.0)
    return base_c + params.scaling * mixed


def _soup_one(name: str, base: Any, finetuned: list[Any], params: SoupParams, state: dict) -> Any:
    dtype = compute_dtype(finetuned[0])
    thetas = stacked(finetuned, dtype, finetuned[0].device)
    weights = resolve_weights(params.weights, len(finetuned), None)
    mixed = (thetas * weight_column(weights, thetas)).sum(dim=0)
    if params.normalize:
        total = sum(weights)
        if total == 0:
            raise ValidationError(f"tensor {name!r}: soup weights sum to 0 and normalize=True")
        mixed = mixed / total
    return mixed


TASK_ARITHMETIC = MergeMethod(
    name="task_arithmetic",
    summary="base + scaling * sum_k w_k (finetuned_k - base)",
    reference="Ilharco et al., Editing Models with Task Arithmetic, ICLR 2023 (arXiv:2212.04089)",
    params=TaskArithmeticParams,
    run=tensorwise_run(_task_arithmetic_one, "task arithmetic"),
)

SOUP = MergeMethod(
    name="soup",
    summary="weighted average sum_k w_k finetuned_k / sum_k w_k (uniform weights by default)",
    reference="Wortsman et al., Model soups, ICML 2022 (arXiv:2203.05482)",
    params=SoupParams,
    run=tensorwise_run(_soup_one, "soup"),
    needs_base=False,
)

__all__ = ["TASK_ARITHMETIC", "SOUP", "TaskArithmeticParams", "SoupParams", "task_vectors"]
