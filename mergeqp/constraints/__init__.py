"""Convex constraint sets for the merge QP, one module per family.

Every set acts on ``d`` of shape ``(K, n_atoms)`` (models x atoms) and declares its
capabilities (:mod:`.base`): ``violation(d)``, the linear minimisation oracle
``linear_minimum(grad)`` (``support(grad)`` for solvers), and where it has them a closed-form
projection, the kernels' separable structure, a polyhedral form, boundedness / recession cone
and a CVXPY form. Solvers and the certificate ask the set, never its class, so a set written
outside this package that implements the protocol works wherever its capabilities suffice.

- :mod:`.base`: the protocol, :class:`Unconstrained`, :class:`Intersection`;
- :mod:`.kernels`: the one projection / LMO kernel (bounds, group sums, an L1 ball);
- :mod:`.box`, :mod:`.simplex`, :mod:`.l1`, :mod:`.sign`, :mod:`.user`: the families;
- :mod:`.forms`, :mod:`.lp`: polyhedral forms and the HiGHS / CVXPY oracles;
- :mod:`.parse`: the spelling registry (:func:`register_constraint`, :func:`parse_constraint`);
- :mod:`.feasibility`: :func:`as_constraint_set`, :func:`check_feasible`.
"""

from .base import (
    LMO_CLOSED_FORM,
    LMO_HIGHS,
    ConstraintSet,
    Intersection,
    Shape,
    Unconstrained,
    capabilities,
    cvxpy_reason,
    intersect,
)
from .box import Box
from .feasibility import as_constraint_set, check_feasible
from .forms import AuxiliaryForm, LinearForm
from .kernels import (
    SetStructure,
    lmo_box_l1,
    lmo_capped_sum,
    project_box_l1,
    project_capped_sum,
    project_l1,
)
from .l1 import L1Ball
from .lp import _highs_dual_bound
from .lp import LMO_CVXPY
from .parse import (
    CONSTRAINT_SETS,
    LAYER_CONSTRAINTS,
    ConstraintParser,
    layer_constraint,
    layer_context,
    parse_constraint,
    parse_constraints,
    register_constraint,
)
from .sign import SignConsensus
from .simplex import GlobalSimplex, Simplex
from .user import UserConstraints

__all__ = [
    "CONSTRAINT_SETS", "LAYER_CONSTRAINTS", "LMO_CLOSED_FORM", "LMO_CVXPY", "LMO_HIGHS", "AuxiliaryForm", "Box",
    "ConstraintParser", "ConstraintSet", "GlobalSimplex", "Intersection", "L1Ball", "LinearForm",
    "SetStructure", "Shape", "SignConsensus", "Simplex", "Unconstrained", "UserConstraints",
    "_highs_dual_bound", "as_constraint_set", "capabilities", "check_feasible", "cvxpy_reason", "intersect",
    "layer_constraint", "layer_context", "lmo_box_l1", "lmo_capped_sum", "parse_constraint", "parse_constraints", "project_box_l1",
    "project_capped_sum", "project_l1", "register_constraint",
]
