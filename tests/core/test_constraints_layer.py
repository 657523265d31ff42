"""Constraint spellings that need one layer's residuals (``sign``, or a user's registered with
``needs_layer=True``) are recognised in any part of a spec, parsed with the layer's context, and
refused where a QP spans several layers."""

from __future__ import annotations

import numpy as np
import pytest

from mergeqp.constraints import (
    CONSTRAINT_SETS,
    LAYER_CONSTRAINTS,
    Box,
    layer_constraint,
    layer_context,
    parse_constraint,
    register_constraint,
)
from mergeqp.errors import ValidationError


@pytest.fixture
def per_model_cap():
    """A user's spelling ``cap_by_delta`` that caps each model's coefficients by 1 / max|delta_k|."""

    def parse(args, spec, ctx):
        if ctx.get("deltas") is None:
            raise ValidationError(f"{spec!r} needs the layer's deltas")
        caps = 1.0 / np.abs(ctx["deltas"]).reshape(len(ctx["deltas"]), -1).max(axis=1)
        return Box(0.0, caps[:, None])

    register_constraint("cap_by_delta", parse, needs_layer=True)
    yield "cap_by_delta"
    CONSTRAINT_SETS.pop("cap_by_delta")
    LAYER_CONSTRAINTS.discard("cap_by_delta")


def test_layer_constraints_found_in_any_part(per_model_cap):
    assert layer_constraint("box:0,1") is None
    assert layer_constraint("sign:0.5") == "sign"
    assert layer_constraint(" box:0,1 & Cap_By_Delta") == per_model_cap
    deltas = np.stack([np.full((3, 2), 2.0), np.full((3, 2), 4.0)])
    cset = parse_constraint(f"box:0,1 & {per_model_cap}", layer_context(deltas, "rows"))
    assert cset.violation(np.array([[0.5] * 3, [0.25] * 3])) == 0.0
    assert cset.violation(np.array([[0.5] * 3, [0.5] * 3])) == pytest.approx(0.25)
    with pytest.raises(ValidationError, match="needs the layer's deltas"):
        parse_constraint(per_model_cap)
