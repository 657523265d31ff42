"""Building one set from what users pass, and checking that an intersection is not empty."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import InfeasibleError, ValidationError, first_line
from .base import ConstraintSet, Shape, Unconstrained, cvxpy_reason, install_coercion, intersect, violation_of
from .kernels import SetStructure, checked_structure
from .lp import lp_minimum
from .parse import parse_constraint
from .user import UserConstraints


def as_constraint_set(constraints: ConstraintSet | Sequence[Any] | Callable[[Any], Any] | str | None) -> ConstraintSet:
    """Normalise ``None`` / a set / a spec string (``"box:0,1 & simplex"``) / a callable (user
    CVXPY constraints) / a list of those into one set (an :class:`Intersection` if several)."""
    if constraints is None:
        return Unconstrained()
    if isinstance(constraints, ConstraintSet):
        for member in constraints.members():
            _check_spec(member)
        return Unconstrained() if constraints.vacuous else constraints
    if isinstance(constraints, str):
        return intersect([parse_constraint(constraints)])
    if callable(constraints):
        return UserConstraints(constraints)
    if isinstance(constraints, Mapping):  # iterating it would read its keys and drop its values
        raise ValidationError(
            f"constraints must be a ConstraintSet, a spec string, a callable or a list of these, got a "
            f"{type(constraints).__name__} ({dict(constraints)!r:.80}): its values would be dropped; write the "
            f"set as a spec, e.g. 'simplex:2' or 'box:0,0.1'"
        )
    if not isinstance(constraints, Iterable):
        raise ValidationError(
            f"constraints must be a ConstraintSet, a spec string, a callable or a list of these, "
            f"got {type(constraints).__name__}"
        )
    return intersect([as_constraint_set(c) for c in constraints])


install_coercion(as_constraint_set)  # `a & "simplex"` reads its spec as solve() does


def _check_spec(cset: ConstraintSet) -> None:
    """A set's ``spec`` names it in every message: a user's set whose ``spec`` is not a string (or
    raises) is refused here, by its class, rather than failing inside the first message built."""
    try:
        spec = cset.spec
    except Exception as exc:  # noqa: BLE001 - a user's set: name it, one line
        raise ValidationError(f"constraint set {type(cset).__name__}: its spec raised {type(exc).__name__}: "
                              f"{first_line(exc, 200)}") from exc
    if not isinstance(spec, str) or not spec:
        raise ValidationError(f"constraint set {type(cset).__name__}: its spec must be a non-empty string (it names "
                              f"the set in results and messages), got {spec!r}")


def check_feasible(constraints: ConstraintSet, shape: Shape) -> None:
    """Raise :class:`InfeasibleError` (naming the sets) if the intersection is empty.

    Closed-form checks first, from the members' structures (crossed bounds, bounds vs. simplex
    totals, bounds vs. L1 ball); otherwise one LP with a zero objective (HiGHS for polyhedral
    sets, CVXPY otherwise). A set with neither a polyhedral nor a CVXPY form cannot be checked
    here (a solver's point then shows any emptiness as a violation in the certificate).
    """
    constraints.validate(shape)
    members = constraints.members()
    if not members:
        return
    parts = [(s, checked_structure(s, shape)) for s in members]
    alone = len(members) == 1 and members[0].known_nonempty
    if alone and parts[0][1] is None:
        return  # non-empty whenever it was constructed and validated
    # (a declared structure is checked in closed form even then: a user's set may claim
    # non-emptiness for bounds that cross)
    boxes = [(s, st) for s, st in parts if st is not None and st.bounds_only]
    box_label = " & ".join(s.spec for s, _ in boxes)
    lo = np.full(shape, -np.inf)
    hi = np.full(shape, np.inf)
    for _, st in boxes:
        lo, hi = np.maximum(lo, st.lo.reshape(shape)), np.minimum(hi, st.hi.reshape(shape))
    bad = np.argwhere(lo > hi)
    if bad.size:
        k, a = (int(i) for i in bad[0])
        raise InfeasibleError(f"{box_label} is empty: at d[{k}, {a}] the bounds give "
                              f"[{lo[k, a]:.10g}, {hi[k, a]:.10g}]")
    for simplex, st in ((s, st) for s, st in parts if st is not None and st.group is not None):
        _check_sum(simplex.spec, st, lo, hi, box_label)
    for ball, st in ((s, st) for s, st in parts if st is not None and st.center is not None):
        assert st.radius is not None
        c = st.center.reshape(shape)
        dist = float(np.sum(np.maximum(lo - c, 0.0) + np.maximum(c - hi, 0.0)))
        if boxes and dist > st.radius * (1 + 1e-12):
            raise InfeasibleError(f"{box_label} & {ball.spec} is empty: the box is at L1 distance "
                                  f"{dist:.10g} from the ball's centre, more than the radius {st.radius:.10g}")
    if alone or len(boxes) == len(members) or (constraints.has_projection
                                               and constraints.structure(shape) is not None):
        return  # the closed-form checks above are exact for these (or the set vouches for itself)
    polyhedral = all(s.polyhedral for s in members)
    if not polyhedral and cvxpy_reason(constraints) is not None:
        return  # no LP can be written over it: emptiness shows as an infeasible point, not here
    if polyhedral and _simple_point_inside(members, shape, lo, hi):
        return  # a point in every member: not empty, and no LP needed (0.7 s on box & l1 & sign, n = 768)
    lp_minimum(members, np.zeros(shape))


def _simple_point_inside(members: Sequence[ConstraintSet], shape: Shape, lo: np.ndarray, hi: np.ndarray) -> bool:
    """Whether ``0`` or the soup (``1 / K`` everywhere), each also clipped to the bounds
    ``lo`` / ``hi``, lies in every member (violation at most ``1e-12`` of its size): merges'
    sets usually contain one of them (sign consensus always contains both)."""
    soup = np.full(shape, 1.0 / shape[0])
    for point in (np.zeros(shape), soup, np.clip(np.zeros(shape), lo, hi), np.clip(soup, lo, hi)):
        size = max(1.0, float(np.max(np.abs(point), initial=0.0)))
        if all(float(violation_of(s, point)) <= 1e-12 * size for s in members):
            return True
    return False


def _check_sum(spec: str, st: SetStructure, lo: np.ndarray, hi: np.ndarray, box_label: str) -> None:
    """The bounds ``lo``/``hi`` (shape of ``d``) against a sum structure's totals."""
    assert st.group is not None and st.totals is not None
    lo0 = np.maximum(lo, st.lo.reshape(lo.shape))
    where = "the whole d" if st.totals.size == 1 and lo.shape[1] != 1 else "atom {}"
    pair = f"{box_label} & {spec}" if box_label else spec
    neg = np.argwhere(lo0 > hi)
    if neg.size:
        k, a = (int(i) for i in neg[0])
        raise InfeasibleError(f"{pair} is empty: the box's upper bound {hi[k, a]:.10g} < 0 at d[{k}, {a}] "
                              f"but the simplex needs d >= 0")
    lo_sum = np.bincount(st.group, lo0.ravel(), minlength=st.totals.size)
    hi_sum = np.bincount(st.group, hi.ravel(), minlength=st.totals.size)
    total = float(st.totals[0])
    tol = 1e-12 * (1.0 + abs(total))
    bad_sum = np.nonzero((lo_sum > st.totals + tol) | (hi_sum < st.totals - tol))[0]
    if bad_sum.size:
        i = int(bad_sum[0])
        raise InfeasibleError(
            f"{pair} is empty: at {where.format(i)} the box allows sums in "
            f"[{lo_sum[i]:.10g}, {hi_sum[i]:.10g}] but the simplex needs {total:.10g}"
        )
