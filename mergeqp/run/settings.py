"""The run layer's translation of a validated config into the typed settings that :mod:`mergeqp.merge` takes.

``mergeqp.merge`` never reads a :class:`~mergeqp.run.schema.MergeConfig`; this module is where its
``method`` block becomes a :class:`~mergeqp.merge.multilayer.QPSettings`, and where the run layer reads
what else the config decides for the run: the coefficients a layer gets (:func:`planned_atoms`), the
baseline whose statistics are collected (:func:`statistics_method`), whether a baseline run is
evaluated (:func:`evaluates_baseline`).
"""

from __future__ import annotations

from typing import Any

from .schema import MergeConfig
from ..io.writer import parse_size
from ..merge.calibrated import statistics_of
from ..merge.multilayer import QPSettings
from ..merge.sites import LayerSite
from ..solvers.registry import SOLVERS
from ..stats.parametrisation import get_parametrisation

#: bytes of base tensors read at once when a baseline merges checkpoint tensors
DEFAULT_CHUNK_BYTES = 512 * 2**20


def solver_options(cfg: MergeConfig, device: str | None) -> dict[str, Any]:
    """``method.solver_options``; a solver with a ``device`` option (the torch solvers, a user's GPU
    solver) runs on the merge's ``device`` unless told otherwise (before stop 49: those named
    ``torch*``, so a user's GPU solver of another name never got it)."""
    opts = dict(cfg.method.solver_options)
    entry = SOLVERS.get(cfg.method.solver)
    if device is not None and entry is not None and "device" in entry.defaults and "device" not in opts:
        opts["device"] = device
    return opts


def qp_settings(cfg: MergeConfig, device: str | None = None) -> QPSettings:
    """The QP settings of a ``name: qp`` config (``device``: where torch solvers run)."""
    m = cfg.method
    return QPSettings(
        parametrisation=m.parametrisation, basis=m.basis, rank=m.rank,
        constraints=tuple(m.constraints), solver=m.solver,
        solver_options=solver_options(cfg, device), regularisation=m.regularisation,
        reference=m.reference, chunk_size=m.chunk_size, seed=cfg.seed,
        basis_max_bytes=parse_size(m.basis_max_size),
        mode_options=m.effective_mode_options, jacobian_mode=m.jacobian_mode,
        baselines=m.baseline_choices, parametrisation_extra=dict(m.model_extra or {}),
    )


def planned_atoms(cfg: MergeConfig, site: LayerSite) -> int:
    """The atoms (coefficients per model) the config's parametrisation gives ``site``, from its shape."""
    m = cfg.method
    return get_parametrisation(m.parametrisation).planned_atoms(site.r, site.m1, m.parametrisation_options())


def statistics_method(cfg: MergeConfig) -> str | None:
    """The baseline (the method, or the hybrid start) whose calibration statistics the pipeline
    collects (a method that declares ``statistics``: ``fisher`` / ``regmean``), else ``None``."""
    m = cfg.method
    if not m.is_qp and statistics_of(m.name) is not None:
        return m.name
    if m.is_qp and m.start is not None and statistics_of(m.start.name) is not None:
        return m.start.name
    return None


def evaluates_baseline(cfg: MergeConfig) -> bool:
    """A baseline run is evaluated (calibration objective, held-out MSE) when ``evaluate`` is on
    and every model has calibration prompts."""
    return not cfg.method.is_qp and cfg.evaluate and all(m.prompts() is not None for m in cfg.models)
