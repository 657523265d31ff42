"""Choosing a merge's regularisation on held-out calibration data by k-fold splits.

:func:`kfold_calibration` splits each task's calibration inputs at random (seeded) into ``folds``
parts; fold ``i`` holds part ``i`` out and fits on the others. :func:`select_by_kfold` scores
every candidate value (a ridge weight, a trust-region radius, a basis size, ...) on every fold
with a caller's ``score(fit, held, value) -> float`` (the true squared error of the merge fitted
on ``fit`` with that value, measured on ``held``), and chooses the value with the lowest mean
held-out error (the first listed on a tie, so list the simplest first). The test set is never
touched. The selection is recorded in a :class:`KFoldSelection` for the report.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ValidationError
from ..run.auto import contiguous_parts
from ..stats.data import iterate_batches, split_batch

#: ``score(fit, held, value)``: the held-out error of the merge fitted on ``fit`` with ``value``
Score = Callable[[list[Any], list[Any], float], float]


@dataclass(frozen=True)
class KFoldSelection:
    """One k-fold choice: ``parameter`` (what was chosen, in words), the ``candidates``, each
    candidate's held-out error per fold (``fold_errors``, ``(n_candidates, folds)``) and their
    ``mean_errors``, the ``chosen`` value, the number of ``folds``, the held-out samples per task
    and fold (``n_heldout``), and the seconds spent."""

    parameter: str
    candidates: tuple[float, ...]
    fold_errors: tuple[tuple[float, ...], ...]
    mean_errors: tuple[float, ...]
    chosen: float
    folds: int
    n_heldout: tuple[tuple[int, ...], ...]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def contiguous_folds(n: int, folds: int) -> list[tuple[list[int], list[int]]]:
    """``(fit, held)`` indices of ``n`` items in ``k = min(folds, n)`` contiguous parts (the first
    ``n % k`` one item longer, as ``numpy.array_split``), each part held out once: the folds that
    ``method: auto`` cuts each task's calibration batches into, here over any items (texts). Needs
    ``n >= 2`` (something to fit on and something to score) and ``folds >= 2``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValidationError(f"k-fold selection needs two or more items, got {n!r}")
    if isinstance(folds, bool) or not isinstance(folds, int) or folds < 2:
        raise ValidationError(f"k-fold selection needs folds >= 2, got {folds!r}")
    return [([j for j in range(n) if j not in part], list(part)) for part in contiguous_parts(n, min(folds, n))]


def kfold_calibration(calibration: Sequence[Any], folds: int, seed: int = 0,
                      batch_size: int = 256) -> list[tuple[list[Any], list[Any]]]:
    """``folds`` pairs ``(fit, held)`` of K-lists of input tensors: each task's samples permuted
    (``torch.Generator`` seeded with ``seed``) and cut into ``folds`` near-equal parts; pair
    ``i`` holds part ``i`` out. Each task needs at least ``folds`` samples; inputs must be tensors."""
    import torch  # optional heavy dependency: only the experiments split calibration tensors

    if isinstance(folds, bool) or not isinstance(folds, int) or folds < 2:
        raise ValidationError(f"k-fold selection needs folds >= 2, got {folds!r}")
    gen = torch.Generator().manual_seed(int(seed))
    per_task = []
    for t, source in enumerate(calibration):
        parts = []
        for i, batch in enumerate(iterate_batches(source, batch_size, f"task {t}")):
            inputs, _ = split_batch(batch, f"task {t} batch {i}")
            if not isinstance(inputs, torch.Tensor):
                raise ValidationError(f"task {t} batch {i}: k-fold selection needs tensor inputs, got "
                                      f"{type(inputs).__name__}")
            parts.append(inputs)
        x = torch.cat(parts) if parts else None
        n = 0 if x is None else int(x.shape[0])
        if n < folds:
            raise ValidationError(f"task {t}: {n} calibration sample(s), fewer than the {folds} folds")
        per_task.append(x[torch.randperm(n, generator=gen)].tensor_split(folds))
    out = []
    for i in range(folds):
        held = [chunks[i] for chunks in per_task]
        fit = [torch.cat([c for j, c in enumerate(chunks) if j != i]) for chunks in per_task]
        out.append((fit, held))
    return out


def select_by_kfold(calibration: Sequence[Any], candidates: Sequence[float], score: Score, *, folds: int = 3,
                    seed: int = 0, parameter: str = "value", batch_size: int = 256) -> KFoldSelection:
    """Score every candidate on every fold (module docstring) and choose the lowest mean error."""
    values = tuple(float(v) for v in candidates)
    if not values or not all(math.isfinite(v) for v in values):
        raise ValidationError(f"{parameter}: the candidates must be a non-empty list of finite numbers, got "
                              f"{list(candidates)}")
    t0 = time.perf_counter()
    splits = kfold_calibration(calibration, folds, seed, batch_size)
    errors = tuple(tuple(float(score(fit, held, v)) for fit, held in splits) for v in values)
    means = tuple(sum(e) / len(e) for e in errors)
    best = min(range(len(values)), key=lambda i: (means[i], i))
    return KFoldSelection(parameter=parameter, candidates=values, fold_errors=errors, mean_errors=means,
                          chosen=values[best], folds=folds,
                          n_heldout=tuple(tuple(int(h.shape[0]) for h in held) for _, held in splits),
                          seconds=time.perf_counter() - t0)
