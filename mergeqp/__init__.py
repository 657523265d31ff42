"""mergeqp: merge fine-tuned checkpoints by convex optimisation, with optimality certificates.

The public API is re-exported here lazily (importing ``mergeqp`` does not import torch or
cvxpy until a name that needs them is used).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # numerical core
    "MergeQP": "mergeqp.problem",
    "ConstraintSet": "mergeqp.constraints",
    "Box": "mergeqp.constraints",
    "Simplex": "mergeqp.constraints",
    "GlobalSimplex": "mergeqp.constraints",
    "L1Ball": "mergeqp.constraints",
    "SignConsensus": "mergeqp.constraints",
    "UserConstraints": "mergeqp.constraints",
    "Unconstrained": "mergeqp.constraints",
    "Intersection": "mergeqp.constraints",
    "parse_constraint": "mergeqp.constraints",
    "as_constraint_set": "mergeqp.constraints",
    "CONSTRAINT_SETS": "mergeqp.constraints",
    "Solution": "mergeqp.solution",
    "SolveStatus": "mergeqp.solution",
    "Certificate": "mergeqp.certificate",
    "certify": "mergeqp.certificate",
    "solve": "mergeqp.solvers.registry",
    "SOLVERS": "mergeqp.solvers.registry",
    "available_solvers": "mergeqp.solvers.registry",
    # errors
    "MergeQPError": "mergeqp.errors",
    "ValidationError": "mergeqp.errors",
    "NotConvexError": "mergeqp.errors",
    "InfeasibleError": "mergeqp.errors",
    "UnknownNameError": "mergeqp.errors",
    "SolverError": "mergeqp.errors",
    "ConfigError": "mergeqp.errors",
    # statistics (issue: calibration statistics)
    "CalibrationStats": "mergeqp.stats",
    "collect_statistics": "mergeqp.stats",
    "optimal_basis": "mergeqp.stats",
    "apply_merge": "mergeqp.stats",
    # baselines (issue: baseline merge methods)
    "merge_state_dicts": "mergeqp.merge",
    "MERGE_METHODS": "mergeqp.merge",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mergeqp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
