"""The constraint-set protocol: what a set of merge coefficients ``d`` (shape ``(K, n_atoms)``)
can do, declared by the set itself and asked for by the solvers and the certificate.

Every set implements ``violation(d)`` and an oracle (``linear_minimum``); the rest are
capabilities, each a method that returns ``None`` (or a flag that is ``False``) when the set
does not have it:

============================  ======================================================  =====================
capability                    method                                                  used by
============================  ======================================================  =====================
projection                    ``has_projection`` + ``project(d)``                     torch solvers, KKT
linear minimisation oracle    ``linear_minimum(grad)`` (``support(grad)``)            certificate, FISTA
separable structure           ``structure(shape)`` (:class:`SetStructure`)            active_set, kernels
polyhedral standard form      ``linear_form(shape)`` / ``auxiliary_form(shape)``      osqp, clarabel, HiGHS
boundedness / recession cone  ``bounded`` / ``recession_violation(v)``                unboundedness checks
CVXPY form                    ``cvxpy(var)``                                          cvxpy_* solvers
============================  ======================================================  =====================

A set defined outside the package that implements some of these works with every solver
whose needs it meets (:func:`capabilities` lists what a set offers; a solver that lacks one
names it in its ``supports`` reason).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import math
from collections.abc import Callable, Sequence

import numpy as np
import scipy.sparse as sp

from ..errors import InfeasibleError, MergeQPError, UnsupportedError, ValidationError, first_line
from ..lower_bounds import LinearMinimum, lower_bound
from .forms import AuxiliaryForm, LinearForm, checked_linear_form
from .kernels import (
    SetStructure,
    check_sum_feasible,
    checked_structure,
    combine_structures,
    lmo_structure,
    project_structure,
)
from .lp import LMO_CVXPY, LMO_HIGHS, cvxpy_constraints, cvxpy_minimum, lp_method, lp_minimum, polyhedral_parts

Shape = tuple[int, int]

LMO_CLOSED_FORM = "closed form"
LMO_USER_SUPPORT = "the set's own support(grad)"


class ConstraintSet(ABC):
    """A closed convex set of merge coefficients ``d`` (shape ``(K, n_atoms)``); see the module
    docstring for the capabilities a set declares."""

    #: registry name
    name: str = ""
    #: whether :meth:`project` has a closed form
    has_projection: bool = False
    #: whether the set is non-empty whenever it was constructed and validated
    known_nonempty: bool = False
    #: whether the set is polyhedral for every shape (:meth:`linear_form` or
    #: :meth:`auxiliary_form`), so its LMO can be a HiGHS LP
    polyhedral: bool = False

    @property
    def spec(self) -> str:
        """The command-line spelling (``box:0,1``) used in reports and JSON."""
        return self.name

    def validate(self, shape: Shape) -> None:
        """Raise :class:`ValidationError` if the set does not fit ``d`` of this shape."""

    @abstractmethod
    def violation(self, d: np.ndarray) -> float:
        """Largest violation of the set's constraints at ``d`` (0 when feasible), units of ``d``."""

    # ------------------------------------------------------------- capabilities
    def cvxpy(self, var: Any) -> list[Any]:
        """CVXPY constraints on ``var`` (a ``cp.Variable`` of shape ``(K, n_atoms)``)."""
        raise UnsupportedError(f"{self.spec} declares no CVXPY form (cvxpy(var))")

    def project(self, d: np.ndarray) -> np.ndarray:
        """Euclidean projection of ``d`` onto the set (closed form only)."""
        st = self.structure(np.shape(d))  # type: ignore[arg-type]
        if st is None and self.has_projection:  # (a user's set: it says it projects, but cannot)
            raise ValidationError(f"constraint set {self.spec}: has_projection is True but it defines neither "
                                  f"project(d) nor structure(shape)")
        if st is None or not self.has_projection:
            raise NotImplementedError(f"{self.spec} has no closed-form projection")
        return project_structure(st, np.asarray(d, dtype=np.float64).ravel()).reshape(np.shape(d))

    def structure(self, shape: Shape) -> SetStructure | None:
        """The set as bounds / group sums / one L1 ball in flat variables (the kernels' form,
        :mod:`.kernels`), or ``None`` when it is not of that form."""
        return None

    def linear_form(self, shape: Shape) -> LinearForm | None:
        """Polyhedral description in flat variables, or ``None`` if not available. The default
        derives it from :meth:`structure` when that is bounds and group sums (no L1 ball)."""
        st = self.structure(shape)
        if st is None or st.center is not None:
            return None
        return structure_linear_form(st)

    def auxiliary_form(self, shape: Shape) -> AuxiliaryForm | None:
        """Polyhedral description with auxiliary variables (for sets such as the L1 ball whose
        :meth:`linear_form` would need exponentially many rows), or ``None``."""
        return None

    @property
    def bounded(self) -> bool:
        """Whether the set is certainly bounded (so ``J`` attains a minimum on it)."""
        return False

    def recession_violation(self, v: np.ndarray) -> float | None:
        """How far the direction ``v`` (shape ``(K, n_atoms)``) is from the set's recession cone
        (0 when every ray ``d + t v`` stays in the set), or ``None`` when unknown. The default
        uses :meth:`linear_form`; a bounded set's cone is ``{0}``."""
        v = np.asarray(v, dtype=np.float64)
        if self.bounded:
            return float(np.max(np.abs(v), initial=0.0))
        form = checked_linear_form(self, v.shape)  # type: ignore[arg-type]
        return None if form is None else form.recession_violation(v.ravel())

    def linear_minimum(self, grad: np.ndarray) -> LinearMinimum:
        """The linear minimisation oracle: ``min_{s in C} <grad, s>`` with its evidence for a
        lower bound (:class:`~mergeqp.lower_bounds.LinearMinimum`). The default uses
        :meth:`structure` (exact), else a HiGHS LP over a polyhedral set (``polyhedral``), else
        the set's own exact :meth:`support` when it overrides it, else a CVXPY LP over its
        :meth:`cvxpy` form (the certificate labels that bound as a user set's)."""
        grad = np.asarray(grad, dtype=np.float64)
        st = self.structure(grad.shape)  # type: ignore[arg-type]
        if st is not None:
            return structure_minimum(st, grad)
        if self.polyhedral:
            return lp_minimum([self], grad)
        if type(self).support is not ConstraintSet.support:
            # a set that defines its own exact support(grad) = (min value, minimiser), the
            # oracle's spelling before linear_minimum existed: the set vouches for it
            value, s = self.support(grad)
            return LinearMinimum(float(value), None if s is None else np.asarray(s, dtype=np.float64),
                                 LMO_USER_SUPPORT, exact=True)
        if cvxpy_reason(self) is None:
            return cvxpy_minimum([self], grad)
        raise UnsupportedError(f"{self.spec} declares no linear minimisation oracle: implement "
                               f"linear_minimum(grad), structure(shape), linear_form(shape) with "
                               f"polyhedral = True, or cvxpy(var)")

    @property
    def lmo_method(self) -> str:
        """How :meth:`linear_minimum` computes: ``closed form`` or the LP it solves."""
        if self.polyhedral and not self.has_projection:
            return LMO_HIGHS
        if (not self.has_projection and type(self).linear_minimum is ConstraintSet.linear_minimum
                and type(self).support is ConstraintSet.support and cvxpy_reason(self) is None):
            return LMO_CVXPY
        return LMO_CLOSED_FORM

    def support(self, grad: np.ndarray) -> tuple[float, np.ndarray | None]:
        """``(value, s)``: ``value <= min_{s' in C} <grad, s'>`` (equal for closed forms; an LP's
        dual bound otherwise, through :func:`~mergeqp.lower_bounds.lower_bound`) and a minimiser
        ``s``; ``(-inf, None)`` if unbounded below. Where no bound is proven, ``value`` is the
        oracle's primal value: a stopping rule for solvers, never a verdict (the certificate asks
        :meth:`linear_minimum` and reports the missing bound)."""
        lm = self.linear_minimum(np.asarray(grad, dtype=np.float64))
        if not isinstance(lm, LinearMinimum):  # a user's set: named here, not blamed on the solver asking
            raise ValidationError(f"constraint set {self.spec}: linear_minimum(grad) must return a "
                                  f"mergeqp.lower_bounds.LinearMinimum, got {type(lm).__name__}")
        bound = lower_bound(lm)
        return (bound.value if bound.value is not None else lm.value), lm.s

    # ------------------------------------------------------------- composition
    def parameters(self) -> tuple[np.ndarray, ...]:
        """The set's own arrays (bounds, centres) whose shapes must broadcast to ``d``'s."""
        return ()

    def members(self) -> tuple[ConstraintSet, ...]:
        """The sets whose intersection this is (itself for a basic set)."""
        return (self,)

    @property
    def vacuous(self) -> bool:
        """Whether the set is all of ``R^n`` (it is then dropped from intersections)."""
        return False

    def __and__(self, other: Any) -> ConstraintSet:
        """The intersection with ``other``: a set, or anything ``solve`` takes as constraints (a spec
        string such as ``"simplex"``, a callable of user CVXPY constraints, a list of these)."""
        return intersect([self, _as_set(other)])

    def __rand__(self, other: Any) -> ConstraintSet:
        return intersect([_as_set(other), self])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"


#: how ``a & other`` reads an ``other`` that is not a set (a spec string, a callable, a list):
#: :func:`~mergeqp.constraints.feasibility.as_constraint_set`, installed by that module (which builds
#: on this one) through :func:`install_coercion`
_COERCE: list[Callable[[Any], ConstraintSet]] = []


def install_coercion(coerce: Callable[[Any], ConstraintSet]) -> None:
    """Make ``a & other`` read a non-set ``other`` with ``coerce``."""
    _COERCE[:] = [coerce]


def _as_set(other: Any) -> ConstraintSet:
    """``other`` of ``a & other`` as a set (a spec string, a callable or a list, through the installed
    coercion); ``None`` and other objects are refused."""
    if isinstance(other, ConstraintSet):
        return other
    if other is None:
        raise ValidationError("cannot intersect a constraint set with None (leave the operand out for no constraint)")
    if not _COERCE:
        raise ValidationError(f"cannot intersect a constraint set with {type(other).__name__}: give a ConstraintSet")
    return _COERCE[0](other)


def _named_call(cset: ConstraintSet, label: str, call: Any, arg: np.ndarray) -> Any:
    """``call(arg)`` (a method of ``cset``); a user's set whose method raises is a
    :class:`ValidationError` naming the set and the method (not a traceback, not blamed on a solver)."""
    try:
        return call(arg)
    except MergeQPError:
        raise
    except Exception as exc:  # noqa: BLE001 - a user's set: name it, one line
        first = first_line(exc, 200)
        raise ValidationError(f"constraint set {cset.spec}: its {label} raised {type(exc).__name__}: "
                              f"{first}") from exc


def violation_of(cset: ConstraintSet, d: np.ndarray) -> Any:
    """``cset.violation(d)``, a user set's failure named (:func:`_named_call`)."""
    return _named_call(cset, "violation(d)", cset.violation, d)


def linear_minimum_of(cset: ConstraintSet, grad: np.ndarray) -> Any:
    """``cset.linear_minimum(grad)``, a user set's failure named (:func:`_named_call`; stop 55: a
    ``KeyError`` raised there reached ``certify``'s caller as it was)."""
    return _named_call(cset, "linear_minimum(grad)", cset.linear_minimum, grad)


def structure_linear_form(st: SetStructure) -> LinearForm:
    """``lo <= x <= hi`` and, per sum group ``g``, ``sum_{i in g} x_i = totals[g]`` (a structure
    without an L1 ball) as a :class:`LinearForm`."""
    n = int(st.lo.size)
    base = LinearForm.empty(n)
    A_eq, b_eq = base.A_eq, base.b_eq
    if st.group is not None and st.totals is not None:
        groups = np.asarray(st.group, dtype=np.int64)
        A_eq = sp.csr_matrix((np.ones(n), (groups, np.arange(n))), shape=(int(np.asarray(st.totals).size), n))
        b_eq = np.asarray(st.totals, dtype=np.float64)
    return LinearForm(n, base.A_ub, base.b_ub, A_eq, b_eq, np.asarray(st.lo, dtype=np.float64).copy(),
                      np.asarray(st.hi, dtype=np.float64).copy())


def structure_minimum(st: SetStructure, grad: np.ndarray) -> LinearMinimum:
    """The exact linear minimum over a structure, for ``grad`` of the shape of ``d``."""
    value, s = lmo_structure(st, grad.ravel())
    if s is None:
        return LinearMinimum(value, None, LMO_CLOSED_FORM, exact=True)
    s = s.reshape(grad.shape)
    return LinearMinimum(float(np.sum(grad * s)), s, LMO_CLOSED_FORM, exact=True)


def members_structure(sets: tuple[ConstraintSet, ...], shape: Shape) -> SetStructure | str:
    """The intersection of the sets' structures, or why the kernels cannot handle it."""
    return combine_structures([(s.spec, checked_structure(s, shape)) for s in sets], shape[0] * shape[1])


def cvxpy_reason(cset: ConstraintSet) -> str | None:
    """``None`` when every member of ``cset`` has a CVXPY form, else which one lacks it."""
    for s in cset.members():
        if type(s).cvxpy is ConstraintSet.cvxpy:
            return f"{s.spec} declares no CVXPY form (cvxpy(var))"
    return None


def capabilities(cset: ConstraintSet, shape: Shape) -> frozenset[str]:
    """What ``cset`` offers at this shape: ``projection``, ``structure``, ``polyhedral``,
    ``bounded``, ``recession``, ``cvxpy``, ``lmo`` (names used in solvers' reasons)."""
    out = set()
    if cset.has_projection:
        out.add("projection")
    if cset.structure(shape) is not None:
        out.update({"structure", "lmo"})
    if checked_linear_form(cset, shape) is not None or cset.auxiliary_form(shape) is not None:
        out.update({"polyhedral", "lmo"})
    if cset.bounded:
        out.add("bounded")
    if type(cset).linear_minimum is not ConstraintSet.linear_minimum or type(cset).support is not ConstraintSet.support:
        out.add("lmo")
    if cvxpy_reason(cset) is None:
        out.update({"cvxpy", "lmo"})  # the default oracle is then a CVXPY LP
    if cset.recession_violation(np.zeros(shape)) is not None:
        out.add("recession")
    return frozenset(out)


def float_array(value: Any, what: str) -> np.ndarray:
    """``value`` as a float64 array, or a :class:`ValidationError` naming ``what``."""
    if hasattr(value, "detach"):  # torch tensors
        value = value.detach().cpu().numpy()
    if value is None:  # (numpy reads None as NaN)
        raise ValidationError(f"{what} must be a number or an array of numbers, got None")
    try:
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValidationError(f"{what} must be a number or an array of numbers, got {type(value).__name__}") from None


def broadcast(value: Any, shape: Shape, what: str) -> np.ndarray:
    """``value`` broadcast to ``shape`` (a fresh float64 array), or a :class:`ValidationError`."""
    arr = np.asarray(value, dtype=np.float64)
    try:
        return np.broadcast_to(arr, shape).astype(np.float64)
    except ValueError:
        raise ValidationError(
            f"{what} has shape {arr.shape}, which does not broadcast to d's shape {tuple(shape)} "
            f"(models x atoms)"
        ) from None


def fmt(x: float) -> str:
    """``x`` as short as it reads back exactly: ``0.5``, ``100``, ``1e+06``; a value that six
    digits would round (``1000001``, a radius ``65.22795...``) in full, so that two different
    bounds never print alike."""
    short = f"{x:g}"
    if float(short) == x:
        return short
    full = repr(float(x))
    return full[:-2] if full.endswith(".0") else full


# ---------------------------------------------------------------------- the whole space
class Unconstrained(ConstraintSet):
    """No constraint: ``d`` ranges over all of ``R^(K x n_atoms)``."""

    name = "none"
    has_projection = True
    polyhedral = True

    def cvxpy(self, var: Any) -> list[Any]:
        return []

    def project(self, d: np.ndarray) -> np.ndarray:
        return np.array(d, dtype=np.float64)

    def structure(self, shape: Shape) -> SetStructure:
        return SetStructure.free(shape[0] * shape[1])

    def linear_minimum(self, grad: np.ndarray) -> LinearMinimum:
        if np.all(grad == 0):
            return LinearMinimum(0.0, np.zeros_like(grad, dtype=np.float64), LMO_CLOSED_FORM, exact=True)
        return LinearMinimum(-math.inf, None, LMO_CLOSED_FORM, exact=True)

    def violation(self, d: np.ndarray) -> float:
        return 0.0

    def linear_form(self, shape: Shape) -> LinearForm:
        return LinearForm.empty(shape[0] * shape[1])

    @property
    def vacuous(self) -> bool:
        return True

    def members(self) -> tuple[ConstraintSet, ...]:
        return ()


def intersect(sets: Sequence[ConstraintSet]) -> ConstraintSet:
    """The intersection of ``sets`` (flattened, the whole-space ones dropped): the set itself
    when one remains, :class:`Unconstrained` when none, else an :class:`Intersection`."""
    flat = [m for s in sets for m in s.members() if not m.vacuous]
    if not flat:
        return Unconstrained()
    if len(flat) == 1:
        return flat[0]
    return Intersection(flat)


# ---------------------------------------------------------------------- intersections
class Intersection(ConstraintSet):
    """The intersection of several constraint sets (build with ``a & b`` or
    :func:`~mergeqp.constraints.as_constraint_set`).

    When the members' structures combine (:func:`~.kernels.combine_structures`: bounds, at most
    one simplex, or one L1 ball with its centre inside the bounds) projection and LMO are the
    kernels' closed forms; any other polyhedral combination (L1 balls through auxiliary
    variables) uses an LP (HiGHS) for the LMO, and combinations with CVXPY-only sets (user
    constraints) a CVXPY LP.
    """

    name = "intersection"

    def __init__(self, sets: Sequence[ConstraintSet]):
        self.sets = tuple(sets)

    @property
    def spec(self) -> str:
        return " & ".join(s.spec for s in self.sets)

    def members(self) -> tuple[ConstraintSet, ...]:
        return self.sets

    def validate(self, shape: Shape) -> None:
        for s in self.sets:
            s.validate(shape)

    def cvxpy(self, var: Any) -> list[Any]:
        return cvxpy_constraints(self.sets, var)

    @property
    def polyhedral(self) -> bool:  # type: ignore[override]
        return all(s.polyhedral for s in self.sets)

    @property
    def bounded(self) -> bool:
        return any(s.bounded for s in self.sets)

    def structure(self, shape: Shape) -> SetStructure | None:
        st = members_structure(self.sets, shape)
        return None if isinstance(st, str) else st

    def _probe_shape(self) -> Shape | None:
        """A shape at which the members' own arrays broadcast (``None`` if they do not)."""
        shapes = [np.shape(a) for s in self.sets for a in s.parameters()]
        try:
            probe = np.broadcast_shapes(*shapes) if shapes else ()
        except ValueError:
            return None
        if len(probe) > 2:
            return None
        full = (1,) * (2 - len(probe)) + tuple(probe)
        return (int(full[0]), int(full[1]))

    @property
    def has_projection(self) -> bool:  # type: ignore[override]
        if not all(s.has_projection for s in self.sets):
            return False
        shape = self._probe_shape()
        return shape is not None and self.structure(shape) is not None

    @property
    def lmo_method(self) -> str:
        if self.has_projection:
            return LMO_CLOSED_FORM
        return lp_method(self.sets)

    def project(self, d: np.ndarray) -> np.ndarray:
        if not self.has_projection:
            raise NotImplementedError(f"{self.spec} has no closed-form projection")
        return super().project(d)

    def linear_minimum(self, grad: np.ndarray) -> LinearMinimum:
        grad = np.asarray(grad, dtype=np.float64)
        # the combined structure gives the exact oracle whether or not each member also
        # declares its projection (a user set may declare only structure(shape))
        st = self.structure(grad.shape)  # type: ignore[arg-type]
        if st is not None:
            if np.any(st.lo > st.hi):
                raise InfeasibleError(f"{self.spec} is empty: the boxes' bounds cross")
            check_sum_feasible(st, self.spec)
            return structure_minimum(st, grad)
        return lp_minimum(self.sets, grad)

    def violation(self, d: np.ndarray) -> float:
        return max((s.violation(d) for s in self.sets), default=0.0)

    def linear_form(self, shape: Shape) -> LinearForm | None:
        forms = [checked_linear_form(s, shape) for s in self.sets]
        if any(f is None for f in forms):
            return None
        out = LinearForm.empty(shape[0] * shape[1])
        for f in forms:
            out = out & f  # type: ignore[operator]
        return out

    def auxiliary_form(self, shape: Shape) -> AuxiliaryForm | None:
        """Where a member needs auxiliary variables (an L1 ball) and every other member is
        polyhedral, the whole intersection in :class:`AuxiliaryForm`'s rows ``A_x x + A_t t <= b``:
        the plain members' inequality rows, each equality row as two inequalities and each finite
        bound of ``x`` as a row, then the auxiliary members' rows with their ``t`` blocks side by
        side (a user's solver that reads ``linear_form`` / ``auxiliary_form`` declined ``simplex &
        l1``, stop 74; the built-in solvers read the members, :func:`~.lp.polyhedral_parts`).
        ``None`` where no member has auxiliary variables (:meth:`linear_form` then describes it)
        or a member is not polyhedral."""
        parts = polyhedral_parts(self.sets, shape)
        if parts is None or not parts[1]:
            return None
        plain, lifted = parts
        n = shape[0] * shape[1]
        n_aux = sum(a.n_aux for a in lifted)
        eye = sp.identity(n, format="csr")
        upper, lower = np.isfinite(plain.ub), np.isfinite(plain.lb)
        x_rows = [plain.A_ub, plain.A_eq, -plain.A_eq, eye[upper], -eye[lower]]
        x_rhs = [plain.b_ub, plain.b_eq, -plain.b_eq, plain.ub[upper], -plain.lb[lower]]
        rows_x = sp.vstack(x_rows).tocsr()
        blocks_x, blocks_t, rhs = [rows_x], [sp.csr_matrix((rows_x.shape[0], n_aux))], list(x_rhs)
        off = 0
        for a in lifted:
            blocks_x.append(a.A_x)
            blocks_t.append(sp.hstack([sp.csr_matrix((a.A_x.shape[0], off)), a.A_t,
                                       sp.csr_matrix((a.A_x.shape[0], n_aux - off - a.n_aux))]).tocsr())
            rhs.append(a.b)
            off += a.n_aux
        return AuxiliaryForm(n_aux, sp.vstack(blocks_x).tocsr(), sp.vstack(blocks_t).tocsr(),
                             np.concatenate(rhs), np.concatenate([a.t_lb for a in lifted]))

    def recession_violation(self, v: np.ndarray) -> float | None:
        if self.bounded:
            return float(np.max(np.abs(v), initial=0.0))
        parts = [s.recession_violation(v) for s in self.sets]
        return None if any(p is None for p in parts) else max(parts, default=0.0)  # type: ignore[type-var]
