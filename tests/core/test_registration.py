"""Bad registrations in every public registry are refused with a clear error naming the
rule (never a raw TypeError later, never an entry no spelling can reach), and a user's
constraint parser that fails or returns the wrong thing is named with its spec."""

from __future__ import annotations

import dataclasses

import pytest

import mergeqp as mq
from mergeqp.constraints import CONSTRAINT_SETS, Box
from mergeqp.errors import ConfigError, MergeQPError, ValidationError
from mergeqp.merge.modes import MERGE_MODES, SequentialMode
from mergeqp.merge.registry import MERGE_METHODS
from mergeqp.stats.bases import BASES
from mergeqp.stats.parametrisation import RowsParametrisation


def _box_parser(args, spec, context):
    return Box(0, 1)


class _Named(RowsParametrisation):
    def __init__(self, name):
        self.name = name


class _Mode(SequentialMode):
    def __init__(self, name):
        self.name = name


@pytest.mark.parametrize(("register", "match"), [
    (lambda: mq.register_constraint("box", _box_parser), "'box' is already registered"),
    (lambda: mq.register_constraint("a:b", _box_parser), "without ':'"),
    (lambda: mq.register_constraint(3, _box_parser), "must be a non-empty string, got 3"),
    (lambda: mq.register_constraint("MyCap", _box_parser), "must be lower-case"),
    (lambda: mq.register_constraint("cap_", "not a function"), "parser .* must be callable"),
    (lambda: mq.register_parametrisation(_Named("a:b")), "without ':'"),
    (lambda: mq.register_parametrisation(_Named("rows")), "'rows' is already registered"),
    (lambda: mq.register_basis("a b", lambda *a, **k: None), "or spaces"),
    (lambda: mq.register_basis("my_basis", 5), "builder .* must be callable, got int"),
    (lambda: mq.register_merge_method(dataclasses.replace(MERGE_METHODS["ties"], name="a:b")), "without ':'"),
    (lambda: mq.register_merge_method(dataclasses.replace(MERGE_METHODS["ties"], name="")), "non-empty string"),
    (lambda: mq.register_merge_method(dataclasses.replace(MERGE_METHODS["ties"], name="m2", run=3)), "must be callable"),
    (lambda: mq.register_merge_mode(_Mode("a:b")), "without ':'"),
    (lambda: mq.register_merge_mode(_Mode("single")), "'single' is already registered"),
    (lambda: mq.register_solver("osqp"), "expects a QPSolver instance, got str"),
    (lambda: mq.register_solver(mq.SOLVERS["osqp"]), "'osqp' is already registered"),
], ids=["constraint-dup", "constraint-colon", "constraint-int", "constraint-case", "constraint-parser",
        "param-colon", "param-dup", "basis-space", "basis-builder", "method-colon", "method-empty",
        "method-run", "mode-colon", "mode-dup", "solver-type", "solver-dup"])
def test_a_bad_registration_is_refused_and_says_why(register, match) -> None:
    before = {id(r): dict(r) for r in (CONSTRAINT_SETS, MERGE_METHODS, MERGE_MODES, BASES, mq.SOLVERS)}
    with pytest.raises((ValidationError, ConfigError), match=match):
        register()
    assert {id(r): dict(r) for r in (CONSTRAINT_SETS, MERGE_METHODS, MERGE_MODES, BASES, mq.SOLVERS)} == before


def test_a_user_parser_that_fails_is_named_with_its_spec() -> None:
    mq.register_constraint("broken_cap", lambda args, spec, context: 1 / 0)
    mq.register_constraint("wrong_cap", lambda args, spec, context: 42)
    try:
        with pytest.raises(ValidationError, match=r"constraint 'broken_cap:1': .* raised ZeroDivisionError"):
            mq.parse_constraints(["box:0,1", "broken_cap:1"])
        with pytest.raises(ValidationError, match=r"returned int, not a ConstraintSet"):
            mq.parse_constraints(["wrong_cap"])
        with pytest.raises(MergeQPError, match=r"valid constraint sets: .*\(did you mean 'broken_cap'\?\)"):
            mq.parse_constraints(["broken_capp"])
    finally:
        CONSTRAINT_SETS.pop("broken_cap")
        CONSTRAINT_SETS.pop("wrong_cap")
