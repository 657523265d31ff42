"""Solvers for the merge QP: a registry in preference order and the ``solve`` entry point.

Every solver is a :class:`~mergeqp.solvers.base.QPSolver` registered explicitly in
:mod:`mergeqp.solvers.registry`; ``solve(problem, constraints, solver="auto")`` validates the
input, checks feasibility, dispatches, and certifies the answer in float64.
"""

from .registry import SOLVERS, available_solvers, get_solver, register_solver, solve

__all__ = ["SOLVERS", "available_solvers", "get_solver", "register_solver", "solve"]
