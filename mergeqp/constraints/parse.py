"""The command-line spelling of constraint sets: a registry of parsers (``box:0,1``,
``simplex``, ``box:0,1 & simplex``, ...), explicit registration, errors that list the names."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from ..errors import BadDataError, MergeQPError, ValidationError, check_callable, check_new_name, check_signature, unknown
from .base import ConstraintSet, Unconstrained, intersect
from .box import Box
from .l1 import L1Ball
from .sign import SignConsensus
from .simplex import GlobalSimplex, Simplex

ConstraintParser = Callable[[list[str], str, Mapping[str, Any]], ConstraintSet]


def _floats(args: list[str], spec: str, count: tuple[int, int]) -> list[float]:
    if not count[0] <= len(args) <= count[1]:
        want = f"{count[0]}" if count[0] == count[1] else f"{count[0]} to {count[1]}"
        raise ValidationError(f"constraint {spec!r}: expected {want} number(s), got {len(args)}")
    try:
        return [float(a) for a in args]
    except ValueError:
        raise ValidationError(f"constraint {spec!r}: arguments must be numbers, got {','.join(args)}") from None


def _parse_box(args: list[str], spec: str, ctx: Mapping[str, Any]) -> ConstraintSet:
    """``box[:LO,HI]``: every coefficient in ``[LO, HI]`` (default ``[0, 1]``, the paper's set)."""
    vals = _floats(args, spec, (0, 2)) if args else [0.0, 1.0]
    if len(vals) == 1:
        raise ValidationError(f"constraint {spec!r}: a box takes two bounds, box:LO,HI (e.g. box:0,1)")
    return Box(vals[0], vals[1])


def _parse_simplex(args: list[str], spec: str, ctx: Mapping[str, Any]) -> ConstraintSet:
    """``simplex[:TOTAL]``: per atom, the models' coefficients non-negative and summing to TOTAL (default 1)."""
    vals = _floats(args, spec, (0, 1))
    return Simplex(vals[0] if vals else 1.0)


def _parse_global_simplex(args: list[str], spec: str, ctx: Mapping[str, Any]) -> ConstraintSet:
    """``global_simplex[:TOTAL]``: every coefficient non-negative, all of them summing to TOTAL (default 1)."""
    vals = _floats(args, spec, (0, 1))
    return GlobalSimplex(vals[0] if vals else 1.0)


def _parse_l1(args: list[str], spec: str, ctx: Mapping[str, Any]) -> ConstraintSet:
    """``l1:RADIUS[,CENTER]``: the L1 distance of the coefficients to CENTER (default 0) at most RADIUS."""
    if not args:
        raise ValidationError(f"constraint {spec!r}: an L1 ball needs a radius, l1:RADIUS[,CENTER]")
    vals = _floats(args, spec, (1, 2))
    return L1Ball(vals[0], vals[1] if len(vals) > 1 else 0.0)


def _parse_nonneg(args: list[str], spec: str, ctx: Mapping[str, Any]) -> ConstraintSet:
    """``nonneg``: every coefficient non-negative."""
    _floats(args, spec, (0, 0))
    return Box(0.0, np.inf)


def _parse_none(args: list[str], spec: str, ctx: Mapping[str, Any]) -> ConstraintSet:
    """``none``: no constraint."""
    _floats(args, spec, (0, 0))
    return Unconstrained()


def _parse_sign(args: list[str], spec: str, ctx: Mapping[str, Any]) -> ConstraintSet:
    """``sign[:DENSITY]``: TIES-like sign consensus, no merged parameter against its elected sign (per layer)."""
    if ctx.get("deltas") is None:
        raise ValidationError(
            "constraint 'sign' needs the residual tensors: put an array 'deltas' (K, r, m) in the "
            "problem file (and 'parametrisation' = rows|columns|scalar), or build "
            "SignConsensus.from_deltas(...) in Python; mergeqp collect writes both for the rows, scalar "
            "and columns parametrisations (sign consensus is not defined for a basis)"
        )
    deltas = np.asarray(ctx["deltas"])
    if np.issubdtype(deltas.dtype, np.number) and not np.all(np.isfinite(deltas)):
        raise BadDataError(f"{ctx.get('source', 'the problem')}: array 'deltas' (the residuals the sign set is built "
                           f"from) contains NaN or inf")
    density = _floats(args, spec, (0, 1))
    return SignConsensus.from_deltas(deltas, str(ctx.get("parametrisation", "rows")),
                                     density[0] if density else 1.0, atoms=ctx.get("parameter_atoms"))


#: command-line name -> parser ``(args, spec, context) -> ConstraintSet``
CONSTRAINT_SETS: dict[str, ConstraintParser] = {}


#: spellings whose parser reads one layer's data from ``context`` (``deltas`` ``(K, r, m)``,
#: ``parametrisation``): they are built per layer at solve time and cannot span several layers
LAYER_CONSTRAINTS: set[str] = set()


def register_constraint(name: str, parser: ConstraintParser, *, needs_layer: bool = False) -> None:
    """Register a command-line constraint spelling ``name[:args]``; ``needs_layer``: the parser
    reads the layer's residuals from its ``context`` (see :data:`LAYER_CONSTRAINTS`)."""
    check_new_name("constraint set", name, CONSTRAINT_SETS, forbidden=":,&")
    if name != name.lower():
        raise ValidationError(f"constraint set name {name!r} must be lower-case: specs are read "
                              f"case-insensitively (register {name.lower()!r})")
    check_callable("constraint set", name, "the parser (args, spec, context) -> ConstraintSet", parser)
    check_signature("constraint set", name, "the parser (args, spec, context) -> ConstraintSet", parser,
                    ([], name, None), {})
    CONSTRAINT_SETS[name] = parser
    if needs_layer:
        LAYER_CONSTRAINTS.add(name)


def layer_constraint(spec: str) -> str | None:
    """The first part of ``spec`` (parts joined by ``&``) whose spelling needs a layer's data,
    else ``None``."""
    for part in str(spec).split("&"):
        name = part.split(":", 1)[0].strip().lower()
        if name in LAYER_CONSTRAINTS:
            return name
    return None


def layer_context(deltas: Any, parametrisation: str, parameter_atoms: Any = None) -> dict[str, Any]:
    """The ``context`` a layer constraint is parsed with: the layer's residuals ``deltas``
    ``(K, r, m)`` (numpy), the parametrisation's name and its ``parameter_atoms`` (``(r, m)``: the
    atom that scales each parameter, :meth:`mergeqp.stats.parametrisation.Parametrisation.parameter_atoms`,
    or a function of no arguments returning it, so that a set which needs no map builds none)."""
    return {"deltas": deltas, "parametrisation": parametrisation, "parameter_atoms": parameter_atoms}


register_constraint("box", _parse_box)
register_constraint("simplex", _parse_simplex)
register_constraint("global_simplex", _parse_global_simplex)
register_constraint("l1", _parse_l1)
register_constraint("nonneg", _parse_nonneg)
register_constraint("sign", _parse_sign, needs_layer=True)
register_constraint("none", _parse_none)


def parse_constraint(spec: str, context: Mapping[str, Any] | None = None) -> ConstraintSet:
    """Parse ``"name[:a,b,...]"`` (e.g. ``box:0,1``, ``simplex``, ``simplex:2``, ``l1:2``,
    ``l1:2,0.2`` (radius, centre), ``global_simplex``, ``nonneg``, ``none``,
    ``sign[:density]``), or several joined by ``&`` (an intersection). ``context`` supplies
    data some sets need (``deltas`` and ``parametrisation`` for ``sign``)."""
    if not isinstance(spec, str):
        raise ValidationError(f"a constraint spec must be a string, got {type(spec).__name__}")
    if "&" in spec:
        parts = [p for p in spec.split("&")]
        if any(not p.strip() for p in parts):
            raise ValidationError(f"constraint {spec!r}: empty part around '&'")
        return intersect([parse_constraint(p, context) for p in parts])
    spec = spec.strip()
    name, _, rest = spec.partition(":")
    name = name.strip().lower()
    if name not in CONSTRAINT_SETS:
        raise unknown("constraint set", name, CONSTRAINT_SETS)
    args = [a.strip() for a in rest.split(",")] if rest.strip() else []
    try:
        cset = CONSTRAINT_SETS[name](args, spec, context or {})
    except MergeQPError:
        raise
    except Exception as exc:  # a user's parser: name the spec, never a raw traceback
        raise ValidationError(f"constraint {spec!r}: the parser of {name!r} raised "
                              f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(cset, ConstraintSet):
        raise ValidationError(f"constraint {spec!r}: the parser of {name!r} returned "
                              f"{type(cset).__name__}, not a ConstraintSet")
    return cset


def parse_constraints(specs: Iterable[str], context: Mapping[str, Any] | None = None) -> ConstraintSet:
    """Parse several specs (e.g. repeated ``--constraint`` options) into their intersection
    (one string is one spec, which may itself join sets with ``&``)."""
    if isinstance(specs, str):
        specs = [specs]
    return intersect([parse_constraint(s, context) for s in specs])
