"""Calibration statistics: from PyTorch models and calibration data to the merge QP.

- :func:`collect_statistics` streams calibration batches through the base model, linearises it
  at an ``nn.Linear`` merge layer (``torch.func``, via a forward hook) and accumulates float64
  statistics into a :class:`CalibrationStats`;
- ``stats.problem(parametrisation, task_weights)`` -> :class:`~mergeqp.problem.MergeQP`
  (``rows``, ``scalar``, ``columns`` or a :class:`Basis`);
- bases (``standard``, ``svd``, ``random``, ``optimal``: :func:`make_basis`,
  :func:`optimal_basis`) and energy diagnostics (:func:`energy_report`);
- :func:`apply_merge` turns a solution ``d`` into a merged model (a copy).

Every producer of statistics (here and in :mod:`mergeqp.merge.firstorder`) linearises through
one core: :mod:`.linearise` (hooked forward pass, forward/reverse derivatives chosen by counting)
and :mod:`.gauss_newton` (float64 ``H``, ``g``, ``c`` sums).

See ``docs/statistics.md``.
"""

from __future__ import annotations

from .apply import (
    apply_merge,
    apply_merge_state_dict,
    merge_points,
    merged_layer_weight,
    row_dare_point,
    soup_point,
    task_arithmetic_point,
)
from .baseline_atoms import RowsBaselinesParametrisation
from .bases import (
    BASES,
    make_basis,
    optimal_basis,
    optimal_basis_from,
    random_basis,
    register_basis,
    standard_basis,
    svd_basis,
)
from .calibration import CalibrationStats, CollectedProblem, SampleChunk, load_stats
from .collect import collect_statistics, estimate_statistics_bytes
from .diagnostics import EnergyReport, energy_report, suboptimality_gap
from .hooks import linear_layer_names
from .linearise import LinearisedBatch, linearise_batch
from .parametrisation import (
    PARAMETRISATIONS,
    Basis,
    BasisParametrisation,
    ColumnsParametrisation,
    Parametrisation,
    RowsParametrisation,
    ScalarParametrisation,
    as_parametrisation,
    register_parametrisation,
)
from .storage import save_stats

__all__ = [
    "BASES",
    "PARAMETRISATIONS",
    "Basis",
    "BasisParametrisation",
    "CalibrationStats",
    "CollectedProblem",
    "ColumnsParametrisation",
    "EnergyReport",
    "LinearisedBatch",
    "Parametrisation",
    "RowsBaselinesParametrisation",
    "RowsParametrisation",
    "SampleChunk",
    "ScalarParametrisation",
    "apply_merge",
    "apply_merge_state_dict",
    "as_parametrisation",
    "collect_statistics",
    "energy_report",
    "estimate_statistics_bytes",
    "linear_layer_names",
    "linearise_batch",
    "load_stats",
    "make_basis",
    "merge_points",
    "merged_layer_weight",
    "optimal_basis",
    "optimal_basis_from",
    "random_basis",
    "register_basis",
    "register_parametrisation",
    "row_dare_point",
    "save_stats",
    "soup_point",
    "standard_basis",
    "suboptimality_gap",
    "svd_basis",
    "task_arithmetic_point",
]
