"""How much of an experiment's comparison is the test sample: paired, stratified bootstrap intervals.

An experiment's verdicts compare point estimates on one test sample (48 texts per domain in the
language experiment's quick mode, 128 per task in the text experiment's): a merge that "beats" a
baseline by one text in 512 has not shown much. This module gives each such comparison a
percentile interval from a **paired, stratified bootstrap** over the test texts:

- *stratified*: each resample draws, with replacement, as many texts from each group (domain or
  task) as the group has, so every group keeps its size and the statistic its form (a mean over
  groups of per-group quantities);
- *paired*: every model is scored on the same resampled texts, so what varies between models
  (not the difficulty of the drawn texts) decides the interval of a difference.

The statistic receives, per group, an integer array of shape ``(R, n_g)`` (``R`` resamples of
``n_g`` text indices) and returns ``R`` values; the estimate is the statistic on the sample itself
(the identity resample). What else was chosen on the test sample (e.g. *which* baseline is the
best) stays fixed unless the statistic chooses it again on each resample (the experiments report
both: the best rival fixed as measured, and the best of every rival on each resample, which also
carries the chance of which one looks best). The draws are seeded, so a rerun of the same results
gives the same interval.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..errors import ValidationError

DEFAULT_RESAMPLES = 2000
DEFAULT_LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A bootstrap percentile interval: ``estimate`` (the statistic on the sample), ``[low, high]``
    at ``level``, from ``resamples`` draws (``finite`` of which gave a finite statistic)."""

    estimate: float
    low: float
    high: float
    level: float
    resamples: int
    finite: int

    def excludes(self, value: float) -> bool:
        """``value`` lies outside ``[low, high]``."""
        return bool(value < self.low or value > self.high)

    def relation(self, value: float = 0.0) -> str:
        """Where ``[low, high]`` lies: ``"above"`` / ``"below"`` ``value``, or ``"includes"`` it."""
        return "above" if self.low > value else "below" if self.high < value else "includes"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self, spec: str = ".4f") -> str:
        """``estimate [low, high]``, each formatted with ``spec`` (e.g. ``".3g"`` for tiny values)."""
        return f"{self.estimate:{spec}} [{self.low:{spec}}, {self.high:{spec}}]"


def resample_indices(sizes: Sequence[int], resamples: int, seed: int = 0) -> list[np.ndarray]:
    """Per group ``g``, an ``(resamples, sizes[g])`` array of indices into that group, drawn with
    replacement (one generator for all groups, seeded by ``seed``)."""
    if resamples < 1:
        raise ValidationError(f"bootstrap: resamples must be >= 1, got {resamples}")
    if not sizes or any(int(n) < 1 for n in sizes):
        raise ValidationError(f"bootstrap: every group needs at least one text, got sizes {list(sizes)}")
    rng = np.random.default_rng(seed)
    return [rng.integers(0, int(n), size=(resamples, int(n))) for n in sizes]


def bootstrap(statistic: Callable[[Sequence[np.ndarray]], np.ndarray], sizes: Sequence[int], *,
              resamples: int = DEFAULT_RESAMPLES, level: float = DEFAULT_LEVEL, seed: int = 0) -> Interval:
    """The percentile interval of ``statistic`` (see the module docstring) over ``resamples``
    stratified resamples of groups of ``sizes`` texts."""
    if not 0.0 < level < 1.0:
        raise ValidationError(f"bootstrap: level must lie in (0, 1), got {level}")
    identity = [np.arange(int(n))[None, :] for n in sizes]
    estimate = float(np.asarray(statistic(identity), dtype=np.float64).reshape(-1)[0])
    draws = np.asarray(statistic(resample_indices(sizes, resamples, seed)), dtype=np.float64).reshape(-1)
    if draws.shape[0] != resamples:
        raise ValidationError(f"bootstrap: the statistic returned {draws.shape[0]} values for {resamples} resamples")
    finite = draws[np.isfinite(draws)]
    if finite.size == 0:
        return Interval(estimate, float("nan"), float("nan"), level, resamples, 0)
    low, high = np.quantile(finite, [(1.0 - level) / 2.0, 1.0 - (1.0 - level) / 2.0])
    return Interval(estimate, float(low), float(high), level, resamples, int(finite.size))


def group_ratio(numerators: Sequence[np.ndarray], denominators: Sequence[np.ndarray],
                indices: Sequence[np.ndarray]) -> np.ndarray:
    """Mean over groups of ``sum(numerator[idx]) / sum(denominator[idx])`` per resample: e.g. the
    mean over domains of each domain's cross-entropy per predicted token (``(R,)``)."""
    parts = [np.asarray(num, dtype=np.float64)[idx].sum(axis=1) / np.asarray(den, dtype=np.float64)[idx].sum(axis=1)
             for num, den, idx in zip(numerators, denominators, indices)]
    return np.mean(parts, axis=0)


def group_mean(values: Sequence[np.ndarray], indices: Sequence[np.ndarray]) -> np.ndarray:
    """Mean over groups of the per-group mean of ``values[idx]`` per resample (``(R,)``)."""
    return np.mean([np.asarray(v, dtype=np.float64)[idx].mean(axis=1) for v, idx in zip(values, indices)], axis=0)


def describe_level(interval: Interval) -> str:
    """``"95% paired bootstrap over the test texts, 2,000 resamples"``."""
    return f"{interval.level:.0%} paired bootstrap over the test texts, {interval.resamples:,} resamples"


__all__ = ["DEFAULT_LEVEL", "DEFAULT_RESAMPLES", "Interval", "bootstrap", "describe_level", "group_mean",
           "group_ratio", "resample_indices"]
