"""Per-sample and per-parametrisation records of a calibration pass (float64 numpy arrays),
held by :class:`~mergeqp.stats.calibration.CalibrationStats` and written by
:mod:`~mergeqp.stats.storage`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .parametrisation import Parametrisation


@dataclass(frozen=True, eq=False)
class SampleChunk:
    """Per-sample data of one batch of one task (float64): ``layer_input`` ``(B, T, m1)``
    (augmented), ``jacobian`` ``(B, c, T, r)``, ``residual`` ``(B, c)`` = ``h - y``."""

    task: int
    layer_input: np.ndarray
    jacobian: np.ndarray
    residual: np.ndarray

    @property
    def size(self) -> int:
        return int(self.residual.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.layer_input.nbytes + self.jacobian.nbytes + self.residual.nbytes)


@dataclass(frozen=True, eq=False)
class CollectedProblem:
    """Per-task ``H_t`` (``(K, n, n)``) and ``g_t`` (``(K, n)``) of one parametrisation."""

    parametrisation: Parametrisation
    H: np.ndarray
    g: np.ndarray
