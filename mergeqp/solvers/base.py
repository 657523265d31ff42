"""The solver interface. A solver converts the canonical problem to its own form, solves, and
returns a :class:`RawResult`; :func:`mergeqp.solvers.registry.solve` times it and certifies
the answer (the solver's own status is never the verdict)."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..constraints import ConstraintSet
from ..errors import ValidationError
from ..io.memory import available_memory_bytes
from ..problem import MergeQP
from ..solution import SolveStatus


@dataclass
class RawResult:
    """What a solver hands back: ``d`` (``(K, n_atoms)``), its own status, iterations, extras."""

    d: np.ndarray
    status: SolveStatus
    iterations: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    setup_seconds: float = 0.0


#: ``solve(solver="auto")`` tries its fallbacks when the chosen solver's point does not certify (and,
#: above :data:`AUTO_FLOOR_FALLBACK_MAX_N` variables, is not at its float64 rounding floor), keeping
#: the best certificate: first the solvers whose :meth:`QPSolver.auto_fallback` ranks them for the problem (``clarabel`` and ``osqp`` up to this
#: many variables, ``dense_ipm`` up to :data:`AUTO_DENSE_FALLBACK_MAX_N`), then, up to this many
#: variables and while no point inside the set was found, every other registered solver that takes
#: the problem and does not decline ``auto``
AUTO_FALLBACK_MAX_N = 4096
#: above :data:`AUTO_FALLBACK_MAX_N` and up to this many variables only ``dense_ipm`` ranks itself a
#: fallback (its cost is a few tens of dense Cholesky factorisations, where Clarabel's sparse KKT
#: matrix of a dense H and OSQP's iterations are not; stop 54: an interpolating box QP at n = 4608
#: that ``active_set`` left at 10x its rounding floor was returned uncertified, where ``dense_ipm``
#: certified it in 11 s)
AUTO_DENSE_FALLBACK_MAX_N = 8192
#: up to this many variables ``auto`` tries its fallbacks also after a point at its float64 rounding
#: floor (where they cost a few milliseconds): on small interpolating QPs (``J* ~ 0``) another solver's
#: point often certifies where ``active_set``'s stopped at the floor (stop 74, a review: 25 of 450 rank-6
#: QPs at n = 15 uncertified, every one certified by ``dense_ipm``). Above it the point at the floor is
#: kept: whether a point there certifies is rounding noise, and at n = 60-256 the fallbacks made
#: ``auto`` 10x slower over 300 such QPs (up to 80x on one) for 62 rescued (none of 100 on boxes);
#: at n = 1024 they took 1-5 s against ``active_set``'s 0.01-0.4 s
AUTO_FLOOR_FALLBACK_MAX_N = 48


class QPSolver(ABC):
    """A registered solver. Options are keyword arguments validated by ``check_options``."""

    name: str = ""
    #: option name -> default; unknown options are an error that lists these
    defaults: Mapping[str, Any] = {}
    #: numeric options that must be > 0 (``inf`` allowed: e.g. a time limit), checked by
    #: :meth:`check_options` so that a bad value is refused before the solver's own library sees it
    positive: tuple[str, ...] = ()
    #: numeric options that must be >= 0 (e.g. OSQP's ``scaling``: 0 turns it off)
    nonnegative: tuple[str, ...] = ()
    #: string options and the values they take (a library's names, e.g. Clarabel's linear solvers):
    #: another value is refused with the list, before the library reports "bad settings"
    choices: Mapping[str, tuple[str, ...]] = {}
    #: benchmarked beyond ``mergeqp bench --max-n`` (a solver measured to scale to large n; the
    #: others are skipped there to keep a large benchmark's time bounded)
    large_n_benchmark: bool = False

    def check_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        bad = sorted(set(options) - set(self.defaults))
        if bad:
            raise ValidationError(
                f"{self.name}: unrecognised solver option(s) {bad}; valid options: "
                f"{', '.join(sorted(self.defaults)) or '(none)'}"
            )
        for key, value in options.items():  # numbers and switches keep their kind
            default = self.defaults[key]
            if isinstance(default, bool):
                ok = isinstance(value, (bool, np.bool_))
                kind = "true or false"
            elif isinstance(default, int):
                ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
                kind = "an integer"
            elif isinstance(default, float):
                ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
                kind = "a number"
            else:
                continue
            if not ok:
                raise ValidationError(
                    f"{self.name}: solver option {key!r} must be {kind} (default {default!r}), got {value!r}"
                )
            if key in self.positive and not float(value) > 0:
                raise ValidationError(f"{self.name}: option {key}={value!r} is out of range: it must be > 0 "
                                      f"(default {default!r})")
            if key in self.nonnegative and not float(value) >= 0:
                raise ValidationError(f"{self.name}: option {key}={value!r} is out of range: it must be >= 0 "
                                      f"(default {default!r})")
        for key, allowed in self.choices.items():
            if key in options and options[key] not in allowed:
                raise ValidationError(f"{self.name}: option {key}={options[key]!r} is not one of "
                                      f"{', '.join(map(repr, allowed))} (default {self.defaults[key]!r})")
        return {**self.defaults, **options}

    def check_ranges(self, opts: Mapping[str, Any], rules: Mapping[str, Any]) -> None:
        """Each ``opts[key]`` of ``rules`` is a finite number (not a switch) for which
        ``rules[key](value)`` holds; else a :class:`ValidationError` naming the option and its
        default."""
        for key, ok in rules.items():
            value = opts[key]
            if not isinstance(value, (int, float, np.number)) or isinstance(value, (bool, np.bool_)):
                raise ValidationError(f"{self.name}: option {key} must be a number (default "
                                      f"{self.defaults[key]!r}), got {value!r}")
            try:
                good = math.isfinite(float(value)) and bool(ok(float(value)))
            except TypeError:
                good = False
            if not good:
                raise ValidationError(f"{self.name}: option {key}={value!r} is out of range "
                                      f"(default {self.defaults[key]!r})")

    def available(self) -> str | None:
        """``None`` when usable here, else why not (e.g. how to install a missing package)."""
        return None

    def auto_declines(self, problem: MergeQP, constraints: ConstraintSet) -> str | None:
        """Why ``solver="auto"`` should pass over this solver although it supports the problem
        (e.g. a size beyond which another solver was measured faster); ``None`` to accept."""
        return None

    def auto_fallback(self, problem: MergeQP, constraints: ConstraintSet) -> float | None:
        """This solver's place among ``auto``'s fallbacks for this problem (tried in increasing
        order when the chosen solver's point does not certify, where it supports the problem, even
        if it declines ``auto`` as a first choice), or ``None``: not a fallback here (then tried
        only as a last resort, up to :data:`AUTO_FALLBACK_MAX_N` variables, while no point inside the
        set was found). Built in: ``dense_ipm`` 0.5 from its ``auto_min_n`` (else 2), ``clarabel``
        1, ``osqp`` 3. A subclass inherits its parent's rank (``torch_ipm`` overrides ``dense_ipm``'s
        to return ``None``); an answer that is not a finite number, or an exception, means ``None``."""
        return None

    @abstractmethod
    def supports(self, problem: MergeQP, constraints: ConstraintSet) -> str | None:
        """``None`` if this solver handles the problem and constraint set, else the reason."""

    @abstractmethod
    def solve(self, problem: MergeQP, constraints: ConstraintSet, x0: np.ndarray | None = None,
              **options: Any) -> RawResult:
        """Solve ``min_{d in C} J(d)``; ``x0`` an optional ``(K, n_atoms)`` warm start."""


def work_arrays_decline(n: int, max_n: int, factor: float) -> str | None:
    """The memory rule of ``auto_declines`` for a dense solver: ``None`` up to ``max_n``
    variables, or beyond while ``factor`` times the bytes of H fit in the machine's available
    memory; else why not (the memory needed and available, "unknown" when it cannot be read)."""
    if n <= max_n:
        return None
    need = factor * 8.0 * n ** 2
    avail = available_memory_bytes()
    if avail is not None and need <= avail:
        return None
    have = "unknown" if avail is None else f"{avail / 1e9:.1f} GB"
    return f"n = {n} > {max_n}: its work arrays need up to {need / 1e9:.1f} GB beyond H, available: {have}"


def objective_sizes(problem: MergeQP) -> tuple[float, float]:
    """``(max |g|, max diag H)`` (0 for a matvec-only H): the objective's scale."""
    gmax = float(np.max(np.abs(problem.g), initial=0.0))
    return gmax, (float(np.max(np.diag(problem.H), initial=0.0)) if problem.H is not None else 0.0)


#: the band of :func:`unit_scaled` for Clarabel, OSQP and the CVXPY solvers, whose tolerances are
#: absolute where ``|J|`` is small: a scale below 1 is raised to 1; scaling *down* was measured worse
#: (stop 47: a problem with ``max diag H`` ~ 1e5 and eigenvalues from 1e-6 lost their certificates)
SCALE_UP_ONLY = (1.0, math.inf)


def unit_scaled(problem: MergeQP, sizes: tuple[float, float] | None = None,
                band: tuple[float, float] = (1e-6, 1e6)) -> tuple[MergeQP, float]:
    """``(problem, 1)``, or, when its scale ``max(max |g|, max diag H)`` (``sizes``:
    :func:`objective_sizes`) lies outside ``band``, the problem with ``H, g, c`` divided by that
    scale (the same minimiser, a copy of H) and the factor ``1 / scale``. For solvers whose
    tolerances are absolute or whose start is unit-sized (interior-point methods: Clarabel's
    ``tol_gap_abs`` 1e-10 is no test on a J of size 1e-10)."""
    scale = max(objective_sizes(problem) if sizes is None else sizes)
    low, high = band
    if problem.H is None or not math.isfinite(scale) or scale <= 0.0 or low <= scale <= high:
        return problem, 1.0
    f = 1.0 / scale
    H = problem.H * f
    H.setflags(write=False)
    g = problem.g * f
    g.setflags(write=False)
    return problem._derived(H=H, g=g, c=problem.c * f, hessian_matvec=None), f


def power_top_eigenvalue(apply: Any, v: np.ndarray, steps: int) -> float:
    """The largest eigenvalue of a positive semidefinite operator ``apply`` (``v -> A v``) by ``steps``
    power steps from ``v``: an estimate from below, 0 where an iterate vanishes."""
    top = 0.0
    for _ in range(steps):
        w = apply(v)
        top = float(np.linalg.norm(w))
        if not top > 0:
            return 0.0
        v = w / top
    return top
