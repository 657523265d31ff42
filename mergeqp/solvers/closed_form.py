"""Closed form for the unconstrained problem: ``d* = -H^{-1} g`` by Cholesky, or the
minimum-norm minimiser ``-H^+ g`` (eigendecomposition) when H is singular."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..constraints import ConstraintSet
from ..errors import SolverError, UnboundedError
from ..problem import MergeQP
from ..solution import SolveStatus
from .base import QPSolver, RawResult
from .unbounded import descent_ray, verified_claim
from .unconstrained import UnconstrainedMinimiser, unconstrained_minimiser


class ClosedFormSolver(QPSolver):
    """Unconstrained problems only: Cholesky, or the pseudo-inverse when H is singular."""

    name = "closed_form"
    defaults = {"rcond": None}

    def check_options(self, options: Any) -> dict[str, Any]:
        """``rcond`` (the pseudo-inverse's relative eigenvalue cut): ``None`` (the default rule) or
        a number in ``[0, 1)``."""
        opts = super().check_options(options)
        if opts["rcond"] is not None:
            self.check_ranges(opts, {"rcond": lambda v: 0 <= v < 1})
        return opts

    def supports(self, problem: MergeQP, constraints: ConstraintSet) -> str | None:
        if problem.H is None:
            return "needs an explicit H"
        if constraints.members():
            return "handles only the unconstrained problem"
        return None

    def solve(self, problem: MergeQP, constraints: ConstraintSet, x0: np.ndarray | None = None, **options: Any) -> RawResult:
        opts = self.check_options(options)
        assert problem.H is not None
        found = unconstrained_minimiser(problem.H, problem.g, opts["rcond"])
        x, method = found.x, found.method
        if found.outside > 1e-8 and found.ray is not None:
            why = descent_ray(problem, found.ray)
            if why is not None:
                raise verified_claim(UnboundedError(
                    f"closed_form: the problem is unbounded below without constraints: {why}; add constraints"))
            if found.x_positive is None:
                raise SolverError(
                    f"closed_form: a relative {found.outside:.2g} of g lies outside the numerical range of H, "
                    f"but J is not unbounded along it (H is badly conditioned); try solver='active_set'"
                )
            # tiny positive eigenvalues carry a finite minimum: use them (the certificate judges)
            x, method = found.x_positive, "eigh (all positive eigenvalues; H badly conditioned)"
        return RawResult(problem.unflat(x), SolveStatus.CLOSED_FORM, 0, {"method": method})


__all__ = ["ClosedFormSolver", "UnconstrainedMinimiser", "unconstrained_minimiser"]
