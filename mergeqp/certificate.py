"""Optimality certificates for a point of the merge QP, recomputed in float64.

Nothing here reads what a solver said about itself, and this module imports no solver.
For a point ``d`` of ``min_{d in C} J(d)`` (``J(d) = 1/2 d'Hd + g'd + c``) it reports:

- ``objective``: ``J(d)``;
- ``infeasibility``: the largest violation of the constraints at ``d`` (units of ``d``);
- ``fw_gap``: an upper bound on ``J(d) - J*`` valid for any feasible ``d``. For bounded sets
  it is the Frank-Wolfe gap ``max_{s in C} grad J(d)'(d - s)`` (convexity:
  ``J(s) >= J(d) + grad'(s - d)`` for every ``s``, so ``J* >= J(d) - gap``), from the set's
  linear minimisation oracle (``ConstraintSet.linear_minimum``) and the certificate's own lower
  bound on it (:mod:`mergeqp.lower_bounds`, reported as ``bound_method``): exact for closed
  forms (box, simplex, global simplex, L1 ball, box & (global) simplex, box & L1); the weak-duality
  bound from a HiGHS LP's multipliers for other polyhedral sets (sign consensus); Clarabel's primal
  value minus a labelled margin for user CVXPY constraints. When no bound can be proven (HiGHS
  gives no usable multipliers) the gap is infinite and a note says why: never a silent fallback. For boxes with
  infinite sides (and no constraint at all) the Frank-Wolfe gap is infinite, so the
  Lagrangian duality gap is used instead: with multipliers taken from the gradient,
  ``sum lam_lo (d - lo) + sum lam_hi (hi - d) + 1/2 w' H^+ w``, where ``w`` is the part of the
  gradient no finite bound can absorb (with no constraint this is the exact gap
  ``1/2 grad' H^+ grad``). ``gap_method`` says which;
- ``lower_bound``: ``J(d) - fw_gap - rounding`` less a bound on ``J(d)``'s own float64 error (a lower
  bound on ``J*`` when ``d`` is feasible; ``rounding`` is the gap's estimated float64 error);
- ``kkt_residual``: the projected-gradient (natural) residual
  ``eta * ||d - P_C(d - grad/eta)||_inf`` with ``eta = max diag H``, where the projection is
  closed-form (``None`` otherwise);
- ``unconstrained_bound``: ``c - 1/2 g'H^+g`` (``-inf`` if ``g`` is not in ``range(H)``): a lower
  bound on ``J`` over every ``d``;
- ``pinv_distance`` and ``binding``: whether the pseudo-inverse (minimum-norm unconstrained)
  solution ``-H^+ g`` is feasible; if it is (no constraint binds), the distance of ``d`` from it.

A point is ``certified(rel_tol)`` when it is feasible within ``feas_tol * max(1, ||d||_inf)`` and
``fw_gap <= max(rel_tol * scale, abs_tol)`` (``abs_tol`` 0 by default; set it where ``J* = 0``,
which no relative test short of exactness passes) and the gap's own float64 rounding is within the
same allowance, or at most ``MATERIAL_FRACTION`` (1e-3) of ``scale``, or at most
``HONEST_GAP_FRACTION`` (1e-6) of the natural scale (since stop 73: a point 6e6 out along a direction H
barely curves, J 0.7% above the optimum, had a gap of 1e-30 and a rounding of 57% of |J|, and was
certified at 1e-8; far but well computed optima and interpolating ones still pass), unless the gap's
own float64 rounding exceeds
``scale`` (``beyond_float64``: far out along a direction H barely curves no gap proves anything) with ``scale = max(|J(d)|, 1e-8 (|c| + |d'Hd|/2 + |g'd|))`` (the
second term keeps the test meaningful when ``J(d)`` is ~0 by cancellation).

Cost: one product ``H d``, the oracle, one projection: ~10 ms at n = 3072 for the built-in
sets. The pseudo-inverse quantities need a Cholesky factorisation (an eigendecomposition
when H is singular; cached per problem object and shared by the problems that hold the same
H array, :mod:`mergeqp.matrix_cache`) and are computed by default up to
``PINV_MAX_N`` variables when H is definite (one Cholesky), or whenever the Lagrangian gap needs
the factorisation anyway; for a singular H only with ``pinv=True``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import scipy.linalg as sla

from .cholesky import cho_solve
from .constraints import ConstraintSet, SetStructure, as_constraint_set, intersect
from .constraints.base import linear_minimum_of, violation_of
from .errors import UnsupportedError, ValidationError
from .lower_bounds import LinearMinimum
from .lower_bounds import lower_bound as linear_minimum_bound
from .matrix_cache import forget_matrix, matrix_values
from .problem import GAP_ROUNDING_FACTOR, MergeQP, curvature_reach, gradient_rounding
from .problem import stable_norm as _norm

DEFAULT_REL_TOL = 1e-6
DEFAULT_FEAS_TOL = 1e-7
#: the pseudo-inverse quantities (unconstrained bound, distance to -H^+ g) are computed by
#: default only up to this many variables and when H is definite (one Cholesky; a singular H
#: needs an eigendecomposition); otherwise only when asked (``pinv=True``) or when the gap
#: needs the factorisation anyway
PINV_MAX_N = 2048
#: the certificate's dual bound with multipliers on the active bounds only (a wide finite box) counts a
#: bound active within this distance, relative to ``1 + |bound|``
ACTIVE_BOUND = 1e-6
#: ... and is tried when the Frank-Wolfe gap does not certify and its vertex lies beyond this many times
#: ``1 + |d|_inf`` from d
WIDE_BOX = 1e3
#: the Lagrangian gap (unbounded boxes, no constraint) may fall back to an eigendecomposition
#: of a singular H up to this many variables without being asked
EIG_MAX_N = 4096
#: the pseudo-inverse facts' test of ``g`` in ``range(H)`` (informative: the certificate's bound does
#: not use it): a component outside it below this fraction of ``|g|`` is taken as round-off
RANGE_TOL = 1e-10
#: the hint that an absolute tolerance could accept a point is given only when its gap is at
#: most this fraction of the problem's natural scale (``Certificate.natural_scale``): then
#: ``J* ~ 0`` and the relative test fails only by dividing by ``|J| ~ 0``; a clearly wrong point
#: gets no hint
HONEST_GAP_FRACTION = 1e-6
#: a gap's rounding above this share of the certificate's ``scale`` (and above the allowed gap)
#: refuses the certificate (:attr:`Certificate.rounding_material`)
MATERIAL_FRACTION = 1e-3


def tolerance(name: str, value: Any) -> float:
    """``value`` as a tolerance: a finite number >= 0 (an infinite one certifies anything), else a
    :class:`ValidationError` naming ``name``."""
    if isinstance(value, bool) or value is None:
        raise ValidationError(f"{name} must be a finite number >= 0, got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValidationError(f"{name} must be a finite number >= 0, got {value!r:.60}") from None
    if not 0 <= out < math.inf:
        raise ValidationError(f"{name} must be finite and >= 0, got {out}")
    return out


class Verdict(int):
    """:attr:`Certificate.certified`: callable with tolerances, ``cert.certified(1e-8)``, and itself
    the verdict at the certificate's own tolerances, an int of 1 or 0 (``if cert.certified:``,
    ``== True``, ``sum(...)``; JSON writes it as 1 or 0, a pickle as a bool). A plain method was
    always true when its call was forgotten, and :attr:`~mergeqp.solution.Solution.certified` is a
    property."""

    _cert: Certificate

    def __new__(cls, cert: Certificate) -> Verdict:
        self = super().__new__(cls, int(cert._certified(None, None)))
        self._cert = cert
        return self

    def __call__(self, rel_tol: float | None = None, abs_tol: float | None = None) -> bool:
        return self._cert._certified(rel_tol, abs_tol)

    def __repr__(self) -> str:
        return repr(bool(self))

    __str__ = __repr__

    def __reduce__(self) -> tuple[Any, ...]:
        return (bool, (bool(self),))


@dataclass(frozen=True)
class Certificate:
    """How far from optimal a point provably is. All values float64; see the module doc.

    ``fw_gap`` (units of the objective) is an upper bound on ``J(d) - J*`` when ``d`` is
    feasible; ``lower_bound = J(d) - fw_gap - rounding`` (less ``J(d)``'s own float64 error) ``<= J*``;
    ``certified()`` tests feasibility,
    ``fw_gap <= rel_tol * scale`` and that the gap's rounding is within that or not material
    (:attr:`rounding_material`).
    """

    objective: float
    infeasibility: float
    fw_gap: float
    gap_method: str
    lower_bound: float
    kkt_residual: float | None
    unconstrained_bound: float | None
    pinv_distance: float | None
    binding: bool | None
    scale: float
    feas_tol: float = DEFAULT_FEAS_TOL
    rel_tol: float = DEFAULT_REL_TOL
    d_norm: float = 1.0
    constraints: str = "none"
    notes: tuple[str, ...] = field(default_factory=tuple)
    rounding: float = 0.0
    abs_tol: float = 0.0
    #: which lower bound on the linear minimum the gap rests on: ``exact (closed form)``,
    #: ``dual (HiGHS)``, ``user set (clarabel primal minus a labelled margin) ...``,
    #: ``lagrangian duality``, or ``... (unavailable)`` when none could be proven
    bound_method: str = ""
    #: ``|c| + ||g||_1 + sum_i |H_ii| / 2`` (units of J; ``|d'Hd|/2`` in place of the diagonal for a
    #: matvec-only H): the size of J's terms at coefficients of order one
    natural_scale: float = 0.0

    @property
    def at_rounding_floor(self) -> bool:
        """The gap is within twice its own float64 rounding error (``rounding``): ``d`` is
        optimal to float64 precision, even where that is above ``rel_tol * scale`` (``J* ~ 0``
        on badly scaled problems). ``certified()`` does not relax for it. Never where that precision is
        above :data:`HONEST_GAP_FRACTION` of the problem's :attr:`natural_scale` (since stop 72: a point
        2.6e8 out along a direction H barely curves, J 9% above the optimum, had a rounding of 6e8 and
        counted as at the floor, so ``auto`` returned it without asking its fallbacks, a QA review; at
        an interpolating optimum the rounding is ~1e-14 of that scale)."""
        meaningful = not (self.natural_scale > 0 and self.rounding > HONEST_GAP_FRACTION * self.natural_scale)
        return bool(self.rounding > 0 and math.isfinite(self.fw_gap) and self.fw_gap <= 2.0 * self.rounding
                    and meaningful)

    @property
    def rounding_material(self) -> bool:
        """The gap's float64 rounding exceeds :data:`MATERIAL_FRACTION` of ``scale`` (``|J(d)|``, or
        1e-8 of J's terms where J ~ 0) and :data:`HONEST_GAP_FRACTION` of the problem's
        :attr:`natural_scale`: a point far out along a direction H barely curves, where the gap is not
        computed to anywhere near ``J``'s own size (stop 73, a QA review: 57% and 10% of |J| on two
        wrongly certified points). Not material: a far but well computed optimum's rounding (~1e-4 of
        ``scale``, a second review: ``mnist_real640`` on ``box:-1e6,1e6``), nor an interpolating
        optimum's (up to ~4e-2 of its tiny ``scale`` but ~1e-11 of the natural scale)."""
        return bool(self.rounding > MATERIAL_FRACTION * self.scale
                    and (self.natural_scale <= 0 or self.rounding > HONEST_GAP_FRACTION * self.natural_scale))

    @property
    def abs_tol_could_accept(self) -> bool:
        """Whether an absolute tolerance could honestly certify this point: it is feasible,
        ``J(d)`` lies within its own gap (``J* ~ 0``), and the gap is at most
        :data:`HONEST_GAP_FRACTION` of the problem's :attr:`natural_scale` (the point is optimal up
        to cancellation, not clearly wrong)."""
        # "within" up to the gap's rounding: unconstrained with J* = 0, the gap equals J(d) in exact
        # arithmetic and float64 put it one ulp below J(d) for ~30% of points (stop 48 review)
        slack = max(self.rounding, 8.0 * np.finfo(float).eps * abs(self.objective))
        return bool(self.feasible and self.abs_tol == 0 and math.isfinite(self.fw_gap)
                    and self.fw_gap >= abs(self.objective) - slack
                    and self.fw_gap <= HONEST_GAP_FRACTION * self.natural_scale)

    @property
    def relative_gap(self) -> float:
        """``fw_gap / scale`` (``inf`` when the gap is infinite)."""
        return self.fw_gap / self.scale if self.scale > 0 else math.inf

    @property
    def feasible(self) -> bool:
        """Constraint violation within ``feas_tol * max(1, ||d||_inf)``."""
        return self.infeasibility <= self.feas_tol * max(1.0, self.d_norm)

    def allowed_gap(self, rel_tol: float | None = None, abs_tol: float | None = None) -> float:
        """``max(rel_tol * scale, abs_tol)``: the largest gap that certifies."""
        tol = self.rel_tol if rel_tol is None else tolerance("rel_tol", rel_tol)
        atol = self.abs_tol if abs_tol is None else tolerance("abs_tol", abs_tol)
        return max(tol * self.scale, atol)

    @property
    def beyond_float64(self) -> bool:
        """The gap's own float64 rounding (``rounding``) exceeds the objective's scale: at such a
        point (far along a direction H barely curves, where ``J(d)`` itself cannot be computed to
        its own size) no gap proves anything, however small it comes out."""
        return bool(self.rounding > self.scale)

    @property
    def certified(self) -> Verdict:
        """The verdict: call it, ``certified(rel_tol=None, abs_tol=None)``, for a bool: feasible
        (within ``feas_tol``), ``fw_gap <= max(rel_tol * scale, abs_tol)`` (``abs_tol``, in units of
        J, defaults to 0: purely relative), and the gap not :attr:`beyond_float64`. Used as a bool
        without the call (``if cert.certified:``, as ``Solution.certified`` is written) it is the
        verdict at the certificate's own tolerances, not a method's truth (always true)."""
        return Verdict(self)

    def _certified(self, rel_tol: float | None, abs_tol: float | None) -> bool:
        allowed = self.allowed_gap(rel_tol, abs_tol)
        return bool(self.feasible and math.isfinite(self.fw_gap) and not self.beyond_float64
                    and self.fw_gap <= allowed and not (self.rounding > allowed and self.rounding_material))

    def reasons(self, rel_tol: float | None = None) -> list[str]:
        """Why the point is not certified (empty when it is)."""
        tol = self.rel_tol if rel_tol is None else tolerance("rel_tol", rel_tol)
        out = []
        if not self.feasible:
            out.append(
                f"infeasible: constraint violation {self.infeasibility:.3g} exceeds "
                f"{self.feas_tol * max(1.0, self.d_norm):.3g}"
            )
        if not math.isfinite(self.fw_gap):
            out.append(f"no finite optimality bound ({self.gap_method})")
        elif self.beyond_float64:
            out.append(f"the gap's own float64 rounding (~{self.rounding:.3g}) exceeds the objective's scale "
                       f"({self.scale:.3g}): J(d) cannot be computed to its own size at this point (|d|_inf = "
                       f"{self.d_norm:.3g}), so the gap {self.fw_gap:.3g} proves nothing")
        elif self.fw_gap <= self.allowed_gap(tol) and self.rounding > self.allowed_gap(tol) and self.rounding_material:
            out.append(f"the gap's own float64 rounding (~{self.rounding:.3g}) exceeds the gap that rel_tol "
                       f"{tol:.3g} allows ({self.allowed_gap(tol):.3g}): the gap {self.fw_gap:.3g} cannot be "
                       f"computed to that precision at this point (|d|_inf = {self.d_norm:.3g}); J(d) - J* <= "
                       f"{self.fw_gap + self.rounding:.3g} is what float64 proves")
        elif self.fw_gap > self.allowed_gap(tol):
            out.append(
                f"optimality gap {self.fw_gap:.3g} (relative {self.relative_gap:.3g}) exceeds "
                f"rel_tol {tol:.3g}" + (f" and abs_tol {self.abs_tol:.3g}" if self.abs_tol > 0 else "")
            )
            if self.abs_tol_could_accept:
                out.append(
                    f"J(d) = {self.objective:.3g} is itself within the gap, so J* ~ 0 and a relative "
                    f"test is as strict as exactness; an absolute tolerance (abs_tol, --abs-tol, "
                    f"in units of J) can accept it"
                )
            if self.at_rounding_floor:
                out.append(
                    f"the gap is at this problem's float64 rounding floor (~{self.rounding:.2g}): no "
                    f"float64 computation can certify d further; J(d) - J* <= "
                    f"{self.fw_gap + self.rounding:.3g} in absolute terms (J* ~ 0 or a badly scaled H)"
                )
        return out

    def explain(self, rel_tol: float | None = None) -> str:
        """A readable account of the certificate."""
        ok = self.certified(rel_tol)
        tol = self.rel_tol if rel_tol is None else tolerance("rel_tol", rel_tol)
        lines = [
            (f"certificate: {'CERTIFIED' if ok else 'NOT CERTIFIED'} (rel_tol {tol:.1g}, "
             + (f"abs_tol {self.abs_tol:.1g}, " if self.abs_tol > 0 else "")
             + f"feas_tol {self.feas_tol:.1g}; constraints: {self.constraints})"),
            f"  objective J(d)        = {self.objective:.12g}",
            (f"  optimality gap        <= {self.fw_gap:.3g} (relative {self.relative_gap:.3g} of "
             f"{self.scale:.6g}; {self.gap_method})"),
            f"  bound used            : {self.bound_method or 'n/a'}",
            f"  lower bound on J*     >= {self.lower_bound:.12g}",
            f"  rounding of the gap   ~ {self.rounding:.3g} (float64 estimate)",
            f"  constraint violation  = {self.infeasibility:.3g}",
        ]
        if self.kkt_residual is not None:
            lines.append(f"  projected-gradient residual = {self.kkt_residual:.3g}")
        if self.unconstrained_bound is not None:
            lines.append(f"  unconstrained bound c - g'H^+g/2 = {self.unconstrained_bound:.12g}")
        if self.binding is not None:
            if self.binding:
                lines.append("  constraints bind: the unconstrained solution -H^+ g is infeasible")
            else:
                lines.append(f"  no constraint binds: -H^+ g is feasible; distance of d to it "
                             f"{self.pinv_distance:.3g}")
        for r in self.reasons(rel_tol):
            lines.append(f"  reason: {r}")
        for n in self.notes:
            lines.append(f"  note: {n}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary (infinities as the strings ``"inf"`` / ``"-inf"``)."""
        def num(x: float | None) -> float | str | None:
            if x is None:
                return None
            return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")

        return {
            "certified": self.certified(),
            "objective": self.objective,
            "fw_gap": num(self.fw_gap),
            "relative_gap": num(self.relative_gap),
            "gap_method": self.gap_method,
            "bound_method": self.bound_method,
            "lower_bound": num(self.lower_bound),
            "scale": self.scale,
            "rounding": self.rounding,
            "at_rounding_floor": self.at_rounding_floor,
            "infeasibility": self.infeasibility,
            "feasible": self.feasible,
            "kkt_residual": num(self.kkt_residual),
            "unconstrained_bound": num(self.unconstrained_bound),
            "pinv_distance": num(self.pinv_distance),
            "binding": self.binding,
            "rel_tol": self.rel_tol,
            "abs_tol": self.abs_tol,
            "feas_tol": self.feas_tol,
            "constraints": self.constraints,
            "notes": list(self.notes),
            "reasons": self.reasons(),
        }


class _PseudoInverse:
    """Solves ``H x = b`` in the least-squares / minimum-norm sense, factorising once:
    Cholesky when ``H`` is (numerically) definite, else an eigendecomposition (if allowed)
    with eigenvalues below ``10 n eps lambda_max`` treated as zero."""

    def __init__(self, H: np.ndarray, allow_eig: bool):
        self.chol: tuple[np.ndarray, bool] | None = None
        self.eig: tuple[np.ndarray, np.ndarray, float] | None = None
        self.singular = False
        n = H.shape[0]
        top = float(np.max(np.abs(np.diag(H)))) if n else 0.0
        try:
            c, low = sla.cho_factor(H, lower=True, check_finite=False)
            # reject near-singular factors: pivots tiny relative to the scale
            if np.min(np.abs(np.diag(c))) ** 2 > 1e-12 * max(top, np.finfo(float).tiny):
                self.chol = (c, low)
        except np.linalg.LinAlgError:
            pass
        if self.chol is None:
            self.singular = True
            if allow_eig:
                w, V = np.linalg.eigh(H)
                cut = max(abs(w[-1]), np.finfo(float).tiny) * n * np.finfo(float).eps * 10
                self.eig = (w, V, cut)

    @property
    def available(self) -> bool:
        return self.chol is not None or self.eig is not None

    def solve(self, b: np.ndarray) -> tuple[np.ndarray, float]:
        """Return ``x = H^+ b`` and the norm of ``b``'s component outside ``range(H)``."""
        if self.chol is not None:
            return cho_solve(self.chol, b), 0.0
        assert self.eig is not None
        w, V, cut = self.eig
        coef = V.T @ b
        keep = w > cut
        x = V[:, keep] @ (coef[keep] / w[keep])
        return x, float(_norm(coef[~keep]))


#: factorisations kept per problem (H is read-only after validation, so they stay valid):
#: certifying several points or constraint sets of one problem factorises H once
_PINV_CACHE: weakref.WeakKeyDictionary[MergeQP, _PseudoInverse] = weakref.WeakKeyDictionary()


#: the name of the factorisation in :func:`~mergeqp.matrix_cache.matrix_values` (shared by
#: the problems that hold the same H array)
_PINV_KEY = "certificate.pseudo_inverse"


def forget_factorisation(problem: MergeQP) -> None:
    """Drop the cached factorisation of ``problem`` and every value cached for its H array
    (benchmarks time a cold solve and certificate)."""
    _PINV_CACHE.pop(problem, None)
    forget_matrix(problem.H)


def _pseudo_inverse(problem: MergeQP, allow_eig: bool) -> _PseudoInverse:
    """The problem's cached :class:`_PseudoInverse` (rebuilt when an eigendecomposition is
    now allowed but the cached one lacks it)."""
    assert problem.H is not None
    shared = matrix_values(problem.H)  # problems holding this same H array factorise it once
    cached = _PINV_CACHE.get(problem)
    if cached is None and shared is not None:
        cached = shared.get(_PINV_KEY)
    if cached is None or (allow_eig and cached.singular and cached.eig is None):
        cached = _PseudoInverse(problem.H, allow_eig=allow_eig)
    _PINV_CACHE[problem] = cached
    if shared is not None:
        shared[_PINV_KEY] = cached
    return cached


def certify(
    problem: MergeQP,
    constraints: ConstraintSet | Any,
    d: np.ndarray,
    *,
    rel_tol: float = DEFAULT_REL_TOL,
    feas_tol: float = DEFAULT_FEAS_TOL,
    pinv: bool | None = None,
    abs_tol: float = 0.0,
) -> Certificate:
    """Certify the point ``d`` (``(K, n_atoms)`` or flat ``(n,)``) for ``min_{d in C} J(d)``.

    ``constraints``: anything :func:`~mergeqp.constraints.as_constraint_set` accepts.
    ``pinv``: compute the pseudo-inverse quantities (unconstrained bound, distance to
    ``-H^+ g``); default: when H is explicit, ``n <= PINV_MAX_N`` and H is definite (one
    Cholesky; a singular H would need an eigendecomposition), or when the Lagrangian gap has
    factorised H anyway; ``True`` computes them at any size (an eigendecomposition for a
    singular H); ``False`` skips them. The Frank-Wolfe gap itself never
    factorises H. Raises :class:`~mergeqp.errors.ValidationError` for a point of the wrong
    shape or with NaN/inf.
    """
    if not isinstance(problem, MergeQP):
        raise ValidationError(f"problem must be a MergeQP, got {type(problem).__name__}")
    rel_tol, feas_tol, abs_tol = (tolerance("rel_tol", rel_tol), tolerance("feas_tol", feas_tol),
                                  tolerance("abs_tol", abs_tol))
    cset = as_constraint_set(constraints)
    shape = problem.shape
    if d is None:
        raise ValidationError(f"d must be an array of shape {shape} (or flat ({problem.n},)), got None")
    x = problem.flat(d)
    cset.validate(shape)
    # a point far out overflows d'Hd and the gap's sums to inf (or inf - inf): the certificate then
    # proves nothing and says so in its notes, without numpy's warnings besides (stop 55's review)
    with np.errstate(over="ignore", invalid="ignore"):
        cert = _certify(problem, cset, x, rel_tol, feas_tol, pinv, abs_tol)
    if math.isnan(cert.fw_gap):  # inf - inf far out: no bound, as an infinite gap says
        cert = replace(cert, fw_gap=math.inf, lower_bound=-math.inf)
    return cert


def _certify(problem: MergeQP, cset: ConstraintSet, x: np.ndarray, rel_tol: float, feas_tol: float,
             pinv: bool | None, abs_tol: float) -> Certificate:
    """:func:`certify` of the flat, checked point ``x``."""
    shape = problem.shape
    D = x.reshape(shape)
    notes: list[str] = []

    Hx = problem.matvec(x)
    quad, lin = 0.5 * float(x @ Hx), float(problem.g @ x)
    objective = quad + lin + problem.c
    if not math.isfinite(objective):
        notes.append(f"J(d) overflows float64 at |d|_inf = {float(np.max(np.abs(x), initial=0.0)):.3g} (d'Hd / 2 = "
                     f"{quad:.3g}, g'd = {lin:.3g}): no bound is proven; rescale H and g or d")
    grad = (Hx + problem.g).reshape(shape)
    infeasibility = _number(cset, "violation", violation_of(cset, D))
    d_norm = float(np.max(np.abs(x))) if x.size else 0.0
    feasible = infeasibility <= feas_tol * max(1.0, d_norm)
    scale = max(abs(objective), 1e-8 * (abs(problem.c) + abs(quad) + abs(lin)), np.finfo(float).tiny)

    explicit = problem.H is not None
    solver: _PseudoInverse | None = None

    def pseudo() -> _PseudoInverse | None:
        nonlocal solver
        if solver is None and explicit:
            assert problem.H is not None
            solver = _pseudo_inverse(problem, allow_eig=bool(pinv) or problem.n <= EIG_MAX_N)
        return solver

    # ------------------------------------------------------------- optimality gap
    try:
        lm = _linear_minimum(cset, grad)
    except UnsupportedError as exc:  # the set declares no oracle: no bound, and say so
        lm = LinearMinimum(math.nan, None, "no oracle")
        notes.append(str(exc))
    lm = _checked_answer(cset, lm, shape)
    bound = linear_minimum_bound(lm)
    s = lm.s
    rounding = 0.0
    if bound.value is None:
        # the oracle answered but nothing proves a bound: no certificate, and say why
        fw_gap, gap_method = math.inf, f"frank-wolfe, {lm.method} (no proven bound)"
        bound_method = f"{bound.method} (unavailable)"
        notes.append(f"no lower bound on the linear minimum: {bound.reason}")
    elif math.isfinite(bound.value):
        value = bound.value
        if s is not None:
            # sum grad (d - s) is accurate near the optimum; the second term is the LP's slack
            fw_gap = float(np.sum(grad * (D - s))) + max(float(np.sum(grad * s)) - value, 0.0)
            rounding = _gap_rounding(problem, x, grad, float(np.sum(np.abs(D - s))))
        else:
            fw_gap = float(np.sum(grad * D)) - value
        gap_method = f"frank-wolfe, {lm.method}"
        bound_method = bound.method
    else:
        fw_gap, gap_method, rounding = _lagrangian_gap(problem, cset, D, grad, pseudo, notes, scale)
        bound_method = "lagrangian duality" if math.isfinite(fw_gap) else "none (unbounded set)"
    if (feasible and explicit and problem.curvature_floor >= 0 and math.isfinite(objective) and problem.n <= PINV_MAX_N
            and math.isfinite(fw_gap) and max(fw_gap, rounding) > rel_tol * scale and s is not None
            and float(np.max(np.abs(s - D), initial=0.0)) > WIDE_BOX * (1.0 + d_norm)):
        # a wide finite box (the linear minimum's vertex far beyond d): the gap above charges each
        # coordinate's gradient error times its distance to a bound (box:-1e9,1e9 around an interior
        # optimum left a well-posed problem uncertified, and an interior point's 1e-8 error gave a gap of
        # 29); the dual bound with multipliers on the active bounds only does not. Taken only when it
        # certifies with its own rounding counted, and only for a definite H (its Cholesky: a singular H's
        # kernel slope within rounding, which the pseudo-inverse takes as zero, is worth slope x width on
        # the bounds this bound leaves out: a review certified J = 1 where J* = 0 on box:-1e15,1e15)
        st = cset.structure(shape) if cset.members() else None

        def definite() -> _PseudoInverse | None:
            ps = _pseudo_inverse(problem, allow_eig=False)
            return ps if ps.chol is not None else None

        if st is not None and st.bounds_only and definite() is not None:
            alt: list[str] = []
            gap2, method2, rounding2 = _lagrangian_gap(problem, cset, D, grad, definite, alt, scale, near=ACTIVE_BOUND)
            if math.isfinite(gap2) and max(gap2, 0.0) + rounding2 <= rel_tol * scale:
                fw_gap, gap_method, rounding, bound_method = max(gap2, 0.0), method2, rounding2, "lagrangian duality"
                notes.extend(alt)
    if feasible:
        # grad'd >= min_{s in C} grad's for d in C: a gap below zero by more than its rounding and the
        # slack of d's tolerated violation proves the set's own oracle (support / linear minimum)
        # wrong, and then the gap proves nothing (a user set whose support had a sign flipped was
        # certified 50% above the optimum)
        slack = (8.0 * rounding + infeasibility * float(np.sum(np.abs(grad)))
                 + 1e-9 * (float(np.sum(np.abs(grad * D))) + scale))
        if fw_gap < -slack:
            notes.append(f"the set's linear-minimum oracle is inconsistent: it reports min over the set of "
                         f"<grad, s> above <grad, d> = {float(np.sum(grad * D)):.6g} by {-fw_gap:.3g} at a point d "
                         f"of the set ({cset.spec}: check its support / linear_minimum); no bound is proven")
            fw_gap, gap_method = math.inf, f"{gap_method} (inconsistent oracle)"
        else:
            fw_gap = max(fw_gap, 0.0)  # >= 0 on the set; a negative value is rounding
    else:
        notes.append("d is infeasible: the gap bounds J(d) - J* only for feasible points")
    if problem.curvature_floor < 0 and math.isfinite(fw_gap):
        fw_gap = _charge_negative_curvature(problem.curvature_floor, cset, D, fw_gap, notes)
    own = [m.spec for m in (cset.members() or (cset,)) if not type(m).__module__.startswith("mergeqp.")]
    if own:
        notes.append(f"taken on trust from your own set(s) {', '.join(own)}: their violation(d) and linear "
                     "minimum / support (or declared forms) are what this certificate rests on")
    # (a gap whose own rounding exceeds the objective's scale proves no bound: Certificate.beyond_float64)
    # (and the gap's own rounding is subtracted: a far point's gap of 9e-12 with a rounding of 1.8e3 gave a
    # "lower bound" 1.4e-4 above J*, a QA review)
    # J(d)'s own float64 error is subtracted too (a second review: cond 1e10 at |d| = 8e7, J off by 5.1)
    lower_bound = (objective - fw_gap - rounding - _objective_rounding(problem, x, quad, lin)
                   if math.isfinite(fw_gap) and not rounding > scale else -math.inf)

    # ------------------------------------------------------------- projected gradient
    kkt = None
    if cset.has_projection:
        eta = float(np.max(np.abs(problem.diagonal()))) if explicit else 1.0
        eta = eta if eta > 0 else 1.0
        try:
            step = np.asarray(cset.project(D - grad / eta))
            if step.shape != D.shape:  # (a user set's projection: the residual is informative only)
                notes.append(f"projected-gradient residual skipped: {cset.spec}'s project returned shape "
                             f"{step.shape}, not d's {D.shape}")
            else:
                kkt = eta * float(np.max(np.abs(D - step)))
        except NotImplementedError:
            kkt = None

    # ------------------------------------------------------------- pseudo-inverse facts
    unconstrained_bound = pinv_distance = None
    binding = None
    want_pinv = explicit and pinv is not False and (
        bool(pinv) or problem.n <= PINV_MAX_N or solver is not None)
    if want_pinv:
        if solver is None and not pinv:
            # by default the facts cost one Cholesky; a singular H would need an eigendecomposition
            # (about ten Choleskys' time at n = 640), which only pinv=True (or the Lagrangian gap above) pays for
            solver = _pseudo_inverse(problem, allow_eig=False)
        ps = pseudo()
        if ps is not None and ps.available:
            x_u, outside = ps.solve(-problem.g)
            g_norm = float(_norm(problem.g))
            if outside > RANGE_TOL * max(g_norm, np.finfo(float).tiny):
                unconstrained_bound = -math.inf
                notes.append(f"g has a component of norm {outside:.3g} outside range(H): "
                             "J is unbounded below without constraints")
                binding = True
            else:
                unconstrained_bound = float(problem.c + 0.5 * problem.g @ x_u)
                viol = _number(cset, "violation", violation_of(cset, x_u.reshape(shape)))
                binding = bool(viol > feas_tol * max(1.0, float(np.max(np.abs(x_u)))))
                if not binding:
                    pinv_distance = float(_norm(x - x_u))
            if ps.eig is not None:
                notes.append("H is singular: -H^+ g is the minimum-norm unconstrained minimiser; "
                             "the others differ from it by ker(H)")
        elif ps is not None and ps.singular:
            notes.append("H is singular: pseudo-inverse quantities skipped (they need an eigendecomposition: "
                         "pass pinv=True / --pinv)")
    elif explicit and pinv is None:
        notes.append(f"unconstrained bound skipped: n = {problem.n} > {PINV_MAX_N} "
                     "(pass pinv=True / --pinv to compute it with one Cholesky)")

    return Certificate(
        objective=float(objective), infeasibility=infeasibility, fw_gap=float(fw_gap),
        gap_method=gap_method, lower_bound=float(lower_bound), kkt_residual=kkt,
        unconstrained_bound=unconstrained_bound, pinv_distance=pinv_distance, binding=binding,
        scale=float(scale), feas_tol=feas_tol, rel_tol=rel_tol, abs_tol=abs_tol, d_norm=d_norm,
        constraints=cset.spec, notes=tuple(notes), rounding=float(rounding), bound_method=bound_method,
        natural_scale=_natural_scale(problem, quad),
    )


def _number(cset: ConstraintSet, method: str, value: Any) -> float:
    """A set's scalar answer (``violation``) as a float, or a :class:`ValidationError` naming the set
    and the method when it is not one number."""
    try:
        out = float(np.asarray(value).item()) if np.ndim(value) == 0 else None
    except (TypeError, ValueError):
        out = None
    if out is None:
        raise ValidationError(f"constraint set {cset.spec}: its {method}(d) returned {type(value).__name__} "
                              f"of shape {np.shape(value)}, not one number")
    if math.isnan(out):
        raise ValidationError(f"constraint set {cset.spec}: its {method}(d) returned NaN")
    if method == "violation" and out < 0:  # "0 when feasible": a signed margin inside the set reads as 0
        return 0.0
    return out


def _objective_rounding(problem: MergeQP, x: np.ndarray, quad: float, lin: float) -> float:
    """A bound on the float64 error of ``J(d)`` as computed: ``n eps (|d|'|H||d| / 2 + |g|'|d| + |c|)``,
    with ``|H_ij| <= sqrt(H_ii H_jj)`` bounding the first term by ``(sum_j sqrt(H_jj) |d_j|)^2 / 2``
    (``|d'Hd| / 2`` for a matvec-only H). About 1e-9 of ``|J|`` at the built-in families' optima."""
    if problem.H is not None:
        reach = float(np.sqrt(np.abs(problem.diagonal())) @ np.abs(x))
        curved = 0.5 * reach * reach
    else:
        curved = abs(quad)
    linear = float(np.abs(problem.g) @ np.abs(x))
    return problem.n * np.finfo(float).eps * (curved + linear + abs(problem.c))


def _natural_scale(problem: MergeQP, quad: float) -> float:
    """``|c| + ||g||_1 + sum_i |H_ii| / 2`` (``|d'Hd| / 2`` for a matvec-only H)."""
    curvature = 0.5 * float(np.sum(np.abs(problem.diagonal()))) if problem.H is not None else abs(quad)
    return float(abs(problem.c) + np.sum(np.abs(problem.g)) + curvature)


#: inside :func:`reuse_linear_minimum`: the last linear minimum computed, ``[(set, gradient
#: bytes, answer)]`` (``None`` outside: every certificate solves its own LP)
_REUSE: list[tuple[Any, bytes, Any]] | None = None


@contextlib.contextmanager
def reuse_linear_minimum() -> Iterator[None]:
    """Within the block, a certificate of the very same point (bitwise the same gradient) over
    the same set object reuses the last linear minimum instead of solving the set's LP again:
    a solver that certified its own point (``dense_ipm``'s crossover) and the registry's
    certificate of it (one HiGHS LP over ``box & l1 & sign`` took 0.7 s at n = 768). Only
    for one solve, whose set nothing changes meanwhile (the registry's ``solve`` uses it)."""
    global _REUSE
    outer = _REUSE
    if outer is None:
        _REUSE = []
    try:
        yield
    finally:
        if outer is None:
            _REUSE = None


def _linear_minimum(cset: ConstraintSet, grad: np.ndarray) -> Any:
    """``cset.linear_minimum(grad)``, or its last answer inside :func:`reuse_linear_minimum`."""
    memo = _REUSE
    if memo is None:
        return linear_minimum_of(cset, grad)
    key = np.ascontiguousarray(grad, dtype=np.float64).tobytes() + repr(grad.shape).encode()
    if memo and memo[-1][0] is cset and memo[-1][1] == key:
        return memo[-1][2]
    lm = linear_minimum_of(cset, grad)
    memo[:] = [(cset, key, lm)]
    return lm


def _checked_answer(cset: ConstraintSet, lm: Any, shape: tuple[int, int]) -> LinearMinimum:
    """The oracle's answer with its minimiser ``s`` of the shape of ``d`` (a flat ``s`` of the
    right size is reshaped), or a :class:`ValidationError` naming the set (a user's set may
    answer in another form)."""
    if not isinstance(lm, LinearMinimum):
        raise ValidationError(f"constraint set {cset.spec}: linear_minimum(grad) must return a "
                              f"mergeqp.lower_bounds.LinearMinimum, got {type(lm).__name__}")
    if lm.s is None:
        return lm
    s = np.asarray(lm.s, dtype=np.float64)
    if s.size != shape[0] * shape[1]:
        raise ValidationError(f"constraint set {cset.spec}: linear_minimum(grad) returned a minimiser "
                              f"of shape {s.shape}, not d's shape {tuple(shape)}")
    return lm if s.shape == tuple(shape) else dataclasses.replace(lm, s=s.reshape(shape))


def _gap_rounding(problem: MergeQP, x: np.ndarray, grad: np.ndarray, width: float) -> float:
    """Estimated float64 error of ``grad'(d - s)``: :func:`_gradient_rounding` times
    ``|d - s|_1`` (the same floor as ``active_set``'s stopping rule)."""
    return GAP_ROUNDING_FACTOR * _gradient_rounding(problem, x, grad) * width


def _gradient_rounding(problem: MergeQP, x: np.ndarray, grad: np.ndarray) -> float:
    """:func:`~mergeqp.problem.gradient_rounding` at ``x`` (:func:`~mergeqp.problem.curvature_reach`;
    a matvec-only H uses ``|grad|_inf`` in place of it)."""
    g_inf = float(np.max(np.abs(problem.g), initial=0.0))
    if problem.H is not None:
        return gradient_rounding(problem.n, g_inf, *curvature_reach(np.sqrt(np.abs(problem.diagonal())), x))
    return gradient_rounding(problem.n, g_inf, 1.0, float(np.max(np.abs(grad), initial=0.0)))


def _lagrangian_gap(problem: MergeQP, cset: ConstraintSet, D: np.ndarray, grad: np.ndarray,
                    pseudo: Any, notes: list[str], scale: float, near: float | None = None) -> tuple[float, str, float]:
    """Duality gap for a box with infinite sides or no constraint (see the module docstring),
    the method's name, and the gap's estimated float64 rounding. ``scale``: the certificate's
    ``max(|J|, 1e-8 x its terms)``, in which what a direct kernel absorption may add is measured.
    ``near``: multipliers only on the
    bounds ``d`` lies within ``near (1 + |bound|)`` of (any multipliers of the right sign give a valid
    dual bound; on a wide finite box the Frank-Wolfe gap charges every coordinate's gradient rounding
    times its distance to a bound, which these leave out).

    With ``lam_lo = max(grad, 0)`` on finite lower bounds, ``lam_hi = max(-grad, 0)`` on finite
    upper bounds and ``w = grad - lam_lo + lam_hi`` (the gradient no bound absorbs), weak
    duality gives ``J(d) - J* <= lam_lo'(d - lo) + lam_hi'(hi - d) + 1/2 w'H^+w`` when ``w`` is
    in ``range(H)`` (otherwise the dual bound is ``-inf``). Rounding: each gradient entry is
    off by ``e`` (:func:`_gradient_rounding`), which moves the first terms by ``e`` times the
    distance to the bounds and the last by ``e |H^+ w|_1 + 1/2 e'H^+e`` (``e`` on the entries
    of ``w``, signed like ``H^+ w``).
    """
    st = cset.structure(D.shape) if cset.members() else SetStructure.free(D.size)
    if problem.curvature_floor < 0:
        notes.append(f"H has a negative eigenvalue (>= {problem.curvature_floor:.3g}, accepted within psd_tol): J "
                     f"is not convex, and on an unbounded set no bound is proven")
        return math.inf, "lagrangian duality (J not convex)", 0.0
    if st is not None and st.bounds_only:
        lo, hi = st.lo.reshape(D.shape), st.hi.reshape(D.shape)
    else:
        notes.append(f"{cset.spec} is unbounded along -grad J(d): the Frank-Wolfe gap is infinite; "
                     "add bounds (e.g. a box) to obtain a finite certificate")
        return math.inf, "frank-wolfe (unbounded set)", 0.0
    on_lo, on_hi = np.isfinite(lo), np.isfinite(hi)
    if near is not None:
        with np.errstate(invalid="ignore"):
            on_lo &= D - lo <= near * (1.0 + np.abs(lo))
            on_hi &= hi - D <= near * (1.0 + np.abs(hi))
    lam_lo = np.where(on_lo, np.maximum(grad, 0.0), 0.0)
    lam_hi = np.where(on_hi, np.maximum(-grad, 0.0), 0.0)
    w = grad - lam_lo + lam_hi
    comp = float(np.sum(lam_lo * np.where(on_lo, D - lo, 0.0))
                 + np.sum(lam_hi * np.where(on_hi, hi - D, 0.0)))
    method = "lagrangian duality" + (" (active bounds)" if near is not None else "")
    err = _gradient_rounding(problem, D.ravel(), grad)
    rounding = err * float(np.sum(np.where(on_lo, np.abs(D - lo), 0.0))
                           + np.sum(np.where(on_hi, np.abs(hi - D), 0.0)))
    if not np.any(w):
        return comp, method, GAP_ROUNDING_FACTOR * rounding
    ps = pseudo()
    if ps is None or not ps.available:
        why = ("H is only a matrix-vector product" if ps is None else
               f"H is singular and n = {problem.n} > {EIG_MAX_N} (pass pinv=True)")
        notes.append(f"the duality gap needs H^+ w, unavailable: {why}")
        return math.inf, method + " (unavailable)", 0.0
    wf = w.ravel()
    # weak duality needs v = g - lam_lo + lam_hi in range(H) (then w = Hd + v is too); tested on v
    # itself, whose float64 rounding does not grow with |d| (Hd's does: a far point would excuse any
    # slope). What float64 cannot tell from zero in ker(H) is v's own rounding; a computed null
    # space off by an angle is not excused: the multipliers below absorb what bounds can, and what
    # remains means J may fall without bound. The float64 limit, documented: a slope along an
    # exact kernel direction within that rounding cannot be seen and is taken as zero
    v = (problem.g - lam_lo.ravel() + lam_hi.ravel())
    dead = _dead_slope(problem, v)
    if dead is not None:
        k, a = divmod(dead, D.shape[1])
        notes.append(f"coefficient [{k}, {a}] has no curvature (its row and column of H are exactly zero) and a slope "
                     f"{float(v[dead]):.3g} that no finite bound absorbs: J is exactly linear along it and falls "
                     "without bound on this set (no rounding excuses an exact slope)")
        return math.inf, method, 0.0
    allowed = GAP_ROUNDING_FACTOR * problem.n * np.finfo(float).eps * (
        float(_norm(problem.g)) + float(_norm(lam_lo)) + float(_norm(lam_hi)))
    outside = ps.solve(v)[1]
    v_cur = v  # g less the bound multipliers (moved below when they absorb a kernel component)
    if outside > allowed and ps.eig is not None:
        # other multipliers of the bounds may absorb v's component in ker(H) (a point a little off
        # the optimum of a singular problem): any bound multipliers of the right sign give a valid
        # dual bound, so move them by the change that cancels it at the least cost, when signs allow
        # (what the direct move may add to the gap before the LP is asked instead: 1e-9 of J's size)
        fixed = _absorb_kernel_component(ps, v, lo.ravel(), hi.ravel(), lam_lo.ravel(), lam_hi.ravel(), D.ravel(),
                                         allowed, wf, DIRECT_ALLOWANCE * scale)
        if fixed is not None:
            v_new, extra = fixed
            wf = wf + (v_new - v)
            v_cur = v_new
            comp += extra
            outside = ps.solve(v_new)[1]
            notes.append(f"bound multipliers moved to absorb the gradient's component in ker(H) (adding {extra:.3g} "
                         "to the gap)")
    if outside > allowed:
        notes.append(f"g less the bound multipliers has a component of norm {outside:.3g} outside range(H) "
                     f"(above its rounding, {allowed:.3g}): J is unbounded below on this set, or d is far from "
                     "optimal")
        return math.inf, method, 0.0
    y = ps.solve(wf)[0]
    if outside > 0:
        notes.append(f"a component of norm {outside:.3g} of g less the bound multipliers outside range(H), "
                     f"within its rounding ({allowed:.3g}), was taken as zero")
    e = np.where(wf != 0, err * np.sign(y), 0.0)
    rounding += err * float(np.sum(np.abs(y[wf != 0]))) + 0.5 * abs(float(e @ ps.solve(e)[0]))
    # the factorisation's own backward error (H + E with |E| ~ n eps lambda_max) moves 1/2 w'H^+w by about
    # 1/2 y'Ey (a second review: an eigendecomposition of a definite H of condition 2.3e12 at a far point put
    # the lower bound 7e4 above J*)
    top = abs(float(ps.eig[0][-1])) if ps.eig is not None else float(np.max(np.abs(problem.diagonal()), initial=0.0))
    rounding += 0.5 * problem.n * np.finfo(float).eps * top * float(y @ y)
    gap = comp + 0.5 * float(wf @ y)
    if ps.eig is not None:
        dropped, dropped_rounding = _kernel_terms(problem, ps, D.ravel(), v_cur)
        if dropped > 0:
            gap += dropped
            notes.append(f"d reaches {dropped:.3g} (units of J) into directions of H's curvature below its kernel cut "
                         "(added to the gap)")
        rounding += dropped_rounding
    return gap, method + (" (pseudo-inverse)" if ps.eig is not None else ""), GAP_ROUNDING_FACTOR * rounding


def _dead_slope(problem: MergeQP, v: np.ndarray) -> int | None:
    """A coordinate whose row of the explicit H is exactly zero (a dead unit: ``e_i`` is an exact
    kernel direction and its gradient entry is ``g_i`` exactly) where ``v`` (g less the bound
    multipliers) is not zero, or ``None``. The kernel test below excuses a slope within ``v``'s
    rounding, which is right for a computed null space but not here: on ``nonneg`` with ``g_i =
    -1e-14`` every solver's point was certified although J falls without bound (a QA review)."""
    H = problem.H
    if H is None:
        return None
    cand = np.flatnonzero((np.diagonal(H) == 0) & (v != 0))
    for i in cand[:256]:
        if not np.any(H[i] != 0):
            return int(i)
    return None


def _kernel_terms(problem: MergeQP, ps: _PseudoInverse, d: np.ndarray, v: np.ndarray) -> tuple[float, float]:
    """What the Lagrangian gap's ``1/2 w'H^+w`` leaves out where ``H^+`` drops eigenvalues below its
    cut: with ``w = Hd + v``, the weak-duality bound is ``c + lam_lo'lo - lam_hi'hi - 1/2 v'H^+v``,
    and ``J(d)`` minus it equals the gap plus ``1/2 d0'H d0 + v'd0``, ``d0 = N N'd`` the part of
    ``d`` in the computed kernel (``N``): the curvature ``J(d)`` holds along those directions and
    the slope there times the reach. Returns ``(charged, rounding)``. The curvature, computed
    from H itself, is charged to the gap where it is above its own float64 rounding
    (``n eps (sum_j sqrt(H_jj) |d0_j|)^2``, which bounds ``n eps |d0|'|H||d0|``): a point far along a
    tiny but real curvature was certified with ``J(d)`` far above ``J*`` (``H = diag(1, 1e-16)``,
    ``d = (0, 1e10)``: 5000 above). Below its rounding it is float64 noise on an exact kernel (an
    optimum moved along a duplicated model's direction, whose J is the same) and goes to the
    rounding, as does the slope: ``N'v`` was already found within ``v``'s rounding (the documented
    float64 limit)."""
    assert ps.eig is not None
    ev, V, cut = ps.eig
    kernel = ev <= cut
    if not np.any(kernel):
        return 0.0, 0.0
    N = V[:, kernel]
    d0 = N @ (N.T @ d)
    curvature = 0.5 * float(d0 @ problem.matvec(d0))
    reach = float(np.sqrt(np.abs(problem.diagonal())) @ np.abs(d0))
    noise = d.size * np.finfo(float).eps * reach * reach
    slope = abs(float(v @ d0))
    if curvature > noise:
        return curvature, noise + slope
    return 0.0, noise + abs(curvature) + slope


def _absorb_kernel_component(ps: _PseudoInverse, v: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                             lam_lo: np.ndarray, lam_hi: np.ndarray, x: np.ndarray,
                             slack: float, w: np.ndarray, allowance: float) -> tuple[np.ndarray, float] | None:
    """New bound multipliers for :func:`_lagrangian_gap` with which ``v = g - lam_lo + lam_hi`` has
    no component in the computed ``ker(H)`` (columns ``N``) beyond its rounding ``slack``:
    ``v + delta`` with ``|N'(v + delta)|_2 <= slack``, where
    ``delta = -alpha + beta`` moves the multipliers of finite lower bounds by ``alpha`` and of
    finite upper bounds by ``beta``, both staying ``>= 0``, at the least increase of the
    complementarity term ``alpha'(x - lo) + beta'(hi - x)`` (a small LP, HiGHS). Returns the new
    ``v`` and that increase, or ``None`` when no such multipliers exist (J may be unbounded below
    along a kernel direction the bounds do not stop). Any multipliers of the right signs give a
    valid dual bound, so the LP's own accuracy only shows in the range test the caller repeats. Before
    the LP, :func:`_absorb_at_bounds` makes the move directly, kept where what it adds to the gap (with
    ``w`` the gradient no bound absorbs) is at most ``allowance`` (stop 72)."""
    from scipy.optimize import linprog  # scipy is a dependency; deferred like the other LPs

    assert ps.eig is not None
    ev, V, cut = ps.eig
    N = V[:, ev <= cut]
    fin_lo, fin_hi = np.isfinite(lo), np.isfinite(hi)
    idx = np.flatnonzero(fin_lo | fin_hi)
    r = N.T @ v
    size = float(np.linalg.norm(r))
    if N.shape[1] == 0 or idx.size == 0 or size == 0.0:
        return None
    # delta_i = p_i - q_i: q raises the lower multiplier (cost x - lo), p raises the upper one
    # (cost hi - x); on a lower-only bound p lowers the lower multiplier instead (at most lam_lo,
    # gaining x - lo), on an upper-only bound q lowers the upper one (at most lam_hi)
    lo_i, hi_i = fin_lo[idx], fin_hi[idx]
    dist_lo = np.where(lo_i, x[idx] - np.where(lo_i, lo[idx], 0.0), 0.0)
    dist_hi = np.where(hi_i, np.where(hi_i, hi[idx], 0.0) - x[idx], 0.0)
    top = max(1.0, float(np.max(np.abs(np.concatenate([dist_lo, dist_hi])), initial=0.0)))
    quick = _absorb_at_bounds(N, v, idx, lo_i, hi_i, dist_lo, dist_hi, lam_lo, lam_hi, 1e-6 * top)
    if quick is not None:
        # kept where what it adds to the gap, its complementarity change plus 1/2 (w + delta)'H^+(w + delta)
        # - 1/2 w'H^+w, is within the allowance (a QA review, stop 72: where the bounds' rows of the kernel
        # are ill-conditioned, or a dropped multiplier put a large kernel component into v, the least-norm
        # move grew 1/2 w'H^+w from 1e-13 to 7e-4 or 156 where the LP certified)
        delta = quick[0] - v
        added = quick[1] + float(delta @ ps.solve(w)[0]) + 0.5 * float(delta @ ps.solve(delta)[0])
        if math.isfinite(added) and added <= allowance:
            return quick
    # a tiny cost per unit moved breaks the ties of bounds at which x sits (distance 0): the least
    # move, which keeps 1/2 w'H^+w (not in the LP) from growing by arbitrary moves there
    # (1e-6 of the largest distance: above HiGHS's dual tolerance once the costs are scaled to 1)
    top = max(1.0, float(np.max(np.abs(np.concatenate([dist_lo, dist_hi])), initial=0.0)))
    cost_p = (np.where(hi_i, dist_hi, -dist_lo) + 1e-6 * top) / top
    cost_q = (np.where(lo_i, dist_lo, -dist_hi) + 1e-6 * top) / top
    cap_p = np.where(hi_i, np.inf, lam_lo[idx] / size)
    cap_q = np.where(lo_i, np.inf, lam_hi[idx] / size)
    NS = N[idx]
    A = np.hstack([NS.T, -NS.T])
    room = 0.5 * slack / math.sqrt(N.shape[1]) / size  # per kernel direction, in units of |r|
    res = linprog(np.concatenate([cost_p, cost_q]), A_ub=np.vstack([A, -A]),
                  b_ub=np.concatenate([-r / size + room, r / size + room]),
                  bounds=list(zip(np.zeros(2 * idx.size), np.concatenate([cap_p, cap_q]))), method="highs")
    if res.status != 0 or res.x is None:
        return None
    p_, q_ = res.x[:idx.size] * size, res.x[idx.size:] * size
    delta_s = p_ - q_
    alpha = np.where(lo_i, np.where(hi_i, q_, -delta_s), 0.0)  # the change of the lower multiplier
    beta = np.where(hi_i, np.where(lo_i, p_, delta_s), 0.0)    # the change of the upper one
    alpha = np.maximum(alpha, -lam_lo[idx])  # keep the multipliers >= 0 exactly (LP rounding)
    beta = np.maximum(beta, -lam_hi[idx])
    delta = np.zeros_like(v)
    delta[idx] = beta - alpha
    extra = float(np.sum(alpha * dist_lo) + np.sum(beta * dist_hi))
    return v + delta, extra


#: what the certificate's direct absorption of a kernel component (:func:`_absorb_at_bounds`) may add to the
#: Lagrangian gap, as a share of ``max(|J|, 1e-8 x its terms)``, before the LP is asked instead
DIRECT_ALLOWANCE = 1e-9


def _absorb_at_bounds(N: np.ndarray, v: np.ndarray, idx: np.ndarray, lo_i: np.ndarray, hi_i: np.ndarray,
                      dist_lo: np.ndarray, dist_hi: np.ndarray, lam_lo: np.ndarray, lam_hi: np.ndarray,
                      far: float) -> tuple[np.ndarray, float] | None:
    """:func:`_absorb_kernel_component`'s answer without its LP, where the bounds ``d`` sits on can make it
    (stop 72: the LP, dense in the kernel's ``k`` rows, took 15 s at n = 1536 with k = 736 on ``x >= 0``).
    What the LP does at its optimum, made directly: the multipliers of bounds ``d`` is farther than ``far``
    from (the LP's tie-breaking cost per unit moved) are dropped to 0, each gaining its multiplier times its
    distance; then the kernel component left, ``r = N'(v + drop)``, is cancelled by the least-norm move of
    the multipliers of the bounds ``d`` sits on (distance 0: free of cost), ``N_A' y = -r`` by least squares,
    which must meet their caps exactly (down to 0 at most: ``y <= lam_lo`` at a lower bound, ``y >=
    -lam_hi`` at an upper one) and leave no residual beyond rounding. Returns the new ``v`` and the change
    of the complementarity term (<= 0), or ``None`` (the LP decides). Any multipliers of the right signs
    give a valid dual bound; the caller's range test is repeated on the answer."""
    at_lo, at_hi = lo_i & (dist_lo == 0), hi_i & (dist_hi == 0)
    at = at_lo | at_hi
    if int(np.count_nonzero(at)) < N.shape[1]:
        return None
    drop_lo = lo_i & (dist_lo > far) & (lam_lo[idx] > 0)
    drop_hi = hi_i & (dist_hi > far) & (lam_hi[idx] > 0)
    delta = np.zeros(N.shape[0])
    delta[idx[drop_lo]] += lam_lo[idx[drop_lo]]  # a lower multiplier to 0: v = g - lam_lo + lam_hi rises
    delta[idx[drop_hi]] -= lam_hi[idx[drop_hi]]
    extra = -float(np.sum(lam_lo[idx[drop_lo]] * dist_lo[drop_lo])
                   + np.sum(lam_hi[idx[drop_hi]] * dist_hi[drop_hi]))
    r = N.T @ (v + delta)
    cols = idx[at]
    M = N[cols].T
    y, *_ = np.linalg.lstsq(M, -r, rcond=None)
    if not bool(np.all(np.isfinite(y))):
        return None
    if float(np.linalg.norm(M @ y + r)) > 1e-10 * max(float(np.linalg.norm(r)), np.finfo(float).tiny):
        return None
    lower, upper = at_lo[at], at_hi[at]
    if np.any(lower & (y > lam_lo[cols])) or np.any(upper & (y < -lam_hi[cols])):
        return None
    delta[cols] += y
    return v + delta, extra


def _charge_negative_curvature(floor: float, cset: ConstraintSet, D: np.ndarray, fw_gap: float,
                               notes: list[str]) -> float:
    """The gap with H's negative curvature charged: ``J(y) >= J(d) + grad'(y - d) + floor/2 |y - d|^2``
    for ``floor <= lambda_min(H) < 0`` (H accepted within ``psd_tol``, J not convex), so the linear
    bound loses at most ``|floor|/2 max_(y in C) |y - d|^2``, bounded through the set's bounding box
    (:func:`_bounding_box`); infinite when the set has none (unbounded, or a set without
    structure)."""
    box = _bounding_box(cset, D.shape)
    if box is None:
        notes.append(f"H has a negative eigenvalue (>= {floor:.3g}, accepted within psd_tol): J is not convex and "
                     f"{cset.spec} gives no bounding box to charge it over, so no bound is proven")
        return math.inf
    lo, hi = box
    x = D.ravel()
    reach = float(np.sum(np.maximum((x - lo) ** 2, (hi - x) ** 2)))
    charge = 0.5 * abs(floor) * reach
    notes.append(f"H has a negative eigenvalue (>= {floor:.3g}, accepted within psd_tol): J is not convex; the gap "
                 f"includes {charge:.3g} for it (|lambda_min|/2 times the squared reach of the set's bounding box)")
    return fw_gap + charge


def _bounding_box(cset: ConstraintSet, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray] | None:
    """Finite ``(lo, hi)`` (flat) containing the set, from its separable structure: its bounds, a
    per-group sum with finite lower bounds (each variable at most the total less the others' lower
    bounds), an L1 ball (centre +- radius); for an intersection whose members do not all declare a
    structure (sign consensus, a user's set), the box of those that do (the intersection lies in
    it: ``box:0,1 & sign`` in ``[0, 1]``), else of each member that has one; ``None`` when no
    member gives a finite box."""
    members = cset.members()
    st = cset.structure(shape) if members else None
    if st is None:
        if len(members) < 2:
            return None
        structured = [m for m in members if m.structure(shape) is not None]
        if 0 < len(structured) < len(members):  # (its box lies in each structured member's)
            return _bounding_box(intersect(structured), shape)
        boxes = [b for b in (_bounding_box(m, shape) for m in members) if b is not None]
        if not boxes:
            return None
        return np.max([b[0] for b in boxes], axis=0), np.min([b[1] for b in boxes], axis=0)
    lo, hi = np.array(st.lo, dtype=float), np.array(st.hi, dtype=float)
    if st.center is not None and st.radius is not None:
        lo = np.maximum(lo, st.center - st.radius)
        hi = np.minimum(hi, st.center + st.radius)
    if st.group is not None and st.totals is not None:
        member = (st.group >= 0) & np.isfinite(lo)
        groups = st.group[member]
        low_sum = np.bincount(groups, weights=lo[member], minlength=st.totals.size)
        whole = np.bincount(groups, minlength=st.totals.size) == np.bincount(st.group[st.group >= 0],
                                                                             minlength=st.totals.size)
        g = np.maximum(st.group, 0)  # each variable's group (0 for those in none: masked by member)
        ok = member & whole[g]  # every lower bound of its group finite
        hi = np.where(ok, np.minimum(hi, lo + (st.totals[g] - low_sum[g])), hi)
    if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
        return None
    return lo, hi


def check_point_shape(problem: MergeQP, d: np.ndarray) -> np.ndarray:
    """Validate a user-supplied point for :func:`certify` and return it as ``(K, n_atoms)``.

    Accepted: shape ``(K, n_atoms)`` or flat ``(n,)`` (row-major), real, finite. Any other
    shape (for instance the transpose) is an error naming both shapes."""
    d = np.asarray(d)
    if d.dtype == object or not (np.issubdtype(d.dtype, np.number) or d.dtype == bool) \
            or np.issubdtype(d.dtype, np.complexfloating):
        raise ValidationError(f"point must hold real numbers, got dtype {d.dtype}")
    if d.shape not in (tuple(problem.shape), (problem.n,)):
        raise ValidationError(
            f"point has shape {d.shape}, the problem needs d of shape {problem.shape} "
            f"(models x atoms) or ({problem.n},)"
        )
    return problem.flat(d.astype(np.float64)).reshape(problem.shape)
