"""The run layer's translation of a validated config into the typed settings that :mod:`mergeqp.merge` takes.

``mergeqp.merge`` never reads a :class:`~mergeqp.run.schema.MergeConfig`; this module is where its
``method`` block becomes a :class:`~mergeqp.merge.multilayer.QPSettings`.
"""

from __future__ import annotations

from typing import Any

from .schema import MergeConfig
from ..io.writer import parse_size
from ..merge.multilayer import QPSettings
from ..solvers.registry import SOLVERS

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
