"""Exceptions raised by mergeqp.

Every error a user can trigger with bad input is one of these, and its message names the
offending field, tensor, layer or setting. Nothing from a third-party solver escapes raw:
solver wrappers catch and re-raise as :class:`SolverError` with the solver's name.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class MergeQPError(Exception):
    """Base class of every mergeqp error."""


class ValidationError(MergeQPError, ValueError):
    """Input data has the wrong shape, contains NaN/inf, or is otherwise malformed."""


class NotConvexError(ValidationError):
    """The Hessian of a problem is not positive semidefinite (within tolerance)."""


class InfeasibleError(MergeQPError):
    """A constraint set (or an intersection of several) contains no point."""


class UnknownNameError(MergeQPError, KeyError):
    """A registry lookup (solver, constraint set, merge method, basis, ...) failed."""

    def __init__(self, kind: str, name: str, valid: Iterable[str]):
        self.kind = kind
        self.name = name
        self.valid = sorted(valid)
        super().__init__(f"unknown {kind} {name!r}; valid {kind}s: {', '.join(self.valid)}")

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return self.args[0]


class SolverError(MergeQPError):
    """A solver failed (numerical trouble, not installed, unsupported constraint set)."""


class UnsupportedError(SolverError):
    """The chosen solver cannot handle this problem / constraint combination."""


class UnboundedError(SolverError):
    """``J`` is unbounded below on the constraint set (a solver proved it: a dual
    infeasibility certificate or a recession direction along which ``J`` falls)."""


class ConfigError(MergeQPError, ValueError):
    """A configuration file or command-line setting is invalid."""


def unknown(kind: str, name: str, valid: Iterable[str]) -> UnknownNameError:
    """Build the standard "unknown X; valid Xs: ..." error."""
    return UnknownNameError(kind, name, valid)


def listing(names: Sequence[str], limit: int = 30) -> str:
    """``"a, b, ... and N more"`` (at most ``limit`` names) for error messages; ``"(none)"``."""
    names = list(names)
    if not names:
        return "(none)"
    shown = ", ".join(str(n) for n in names[:limit])
    more = len(names) - limit
    return shown + (f", ... and {more} more" if more > 0 else "")
