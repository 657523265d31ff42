"""The result type every solver returns."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from .jsonutil import to_jsonable

if TYPE_CHECKING:
    from .certificate import Certificate


class SolveStatus(enum.Enum):
    """What the solver itself reports. Never the verdict on optimality: see the certificate."""

    OPTIMAL = "optimal"
    """The solver's own stopping test was met."""
    INACCURATE = "inaccurate"
    """The solver stopped with a solution it flags as inaccurate."""
    MAX_ITERATIONS = "max_iterations"
    """The iteration / time limit was reached first."""
    CLOSED_FORM = "closed_form"
    """Computed directly (no iterations)."""


@dataclass(frozen=True, eq=False)
class Solution:
    """A solver's answer to ``min_{d in C} J(d)``.

    Attributes
    ----------
    d:
        ``(K, n_atoms)`` float64 merge coefficients (models x atoms).
    objective:
        ``J(d)`` recomputed in float64 from the problem (units of the QP objective).
    status:
        the solver's own report (:class:`SolveStatus`).
    solver:
        registry name of the solver that produced ``d``.
    iterations:
        iterations the solver ran (0 for a closed form).
    timings:
        seconds per phase: ``setup``, ``solve``, ``certify``, ``total``.
    certificate:
        the float64 optimality certificate (``None`` only if certification was switched off).
    constraints:
        the constraint set's spelling (``box:0,1 & simplex``).
    info:
        solver-specific extras (tolerances used, active-set size, ...).
    parametrisation:
        the problem's parametrisation as its metadata records it (``{"name": "rows"}``, a basis
        with its key, ...; ``None`` for a problem built without one): what ``d``'s atoms mean, so
        that ``apply_merge(..., solution)`` reads ``d`` the way the QP was posed.
    layer:
        the layer the problem's metadata names (its statistics' layer), or ``None``: applying the
        solution to another layer is refused.
    """

    d: np.ndarray
    objective: float
    status: SolveStatus
    solver: str
    iterations: int = 0
    timings: Mapping[str, float] = field(default_factory=dict)
    certificate: Certificate | None = None
    constraints: str = "none"
    info: Mapping[str, Any] = field(default_factory=dict)
    parametrisation: Mapping[str, Any] | None = None
    layer: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "timings", MappingProxyType(dict(self.timings)))
        object.__setattr__(self, "info", MappingProxyType(dict(self.info)))

    @property
    def certified(self) -> bool:
        return self.certificate is not None and self.certificate.certified()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary (``d`` as a nested ``K x n_atoms`` list)."""
        return {
            "objective": self.objective,
            "d": np.asarray(self.d).tolist(),
            "shape": list(np.asarray(self.d).shape),
            "solver": self.solver,
            "status": self.status.value,
            "iterations": int(self.iterations),
            "timings": dict(self.timings),
            "constraints": self.constraints,
            "certificate": None if self.certificate is None else self.certificate.to_dict(),
            "info": to_jsonable(dict(self.info), nonfinite="keep", other="string"),
            **({} if self.parametrisation is None else {"parametrisation": to_jsonable(dict(self.parametrisation))}),
            **({} if self.layer is None else {"layer": self.layer}),
        }

    def summary(self) -> str:
        """A few lines for the terminal."""
        t = self.timings.get("total", float("nan"))
        lines = [
            f"solver {self.solver}: status {self.status.value}, {self.iterations} iterations, {t:.3f} s",
            (f"objective J(d) = {self.objective:.10g}   d: {np.asarray(self.d).shape[0]} models x "
             f"{np.asarray(self.d).shape[1]} atoms, range [{np.min(self.d):.4g}, {np.max(self.d):.4g}]"),
            f"constraints: {self.constraints}",
        ]
        if self.certificate is not None:
            lines.append(self.certificate.explain())
        return "\n".join(lines)

