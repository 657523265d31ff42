"""Seeded instance families: planted optima are the certified optima, draws are deterministic,
and bad family parameters are clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from mergeqp.errors import UnknownNameError, ValidationError
from mergeqp.solvers.instance_families import (FAMILIES, UNTUNED_CHOICES, InstanceFamily, draw, get_family, register_family,
                                              untuned_variants)
from mergeqp.solvers.registry import solve


@pytest.mark.parametrize("name", ["box", "box_ill", "simplex", "l1"])
def test_planted_optimum_is_the_solution(name: str) -> None:
    inst = draw(name, seed=3, n=96)
    assert inst.d_star is not None and inst.objective is not None
    assert inst.constraints.violation(inst.d_star) <= 1e-12
    sol = solve(inst.problem, inst.constraints, solver="active_set")
    assert sol.certificate is not None and sol.certificate.certified(1e-8)
    assert sol.objective == pytest.approx(inst.objective, rel=1e-9, abs=1e-9)
    np.testing.assert_allclose(sol.d, inst.d_star, atol=1e-6)


def test_fraction_at_bounds_is_planted() -> None:
    fam = get_family("box").with_n(400)
    inst = draw(fam, seed=1)
    d = inst.d_star
    assert d is not None
    assert np.mean((d == 0) | (d == 1)) == pytest.approx(fam.at_bounds, abs=1e-9)


def test_draw_is_deterministic_and_seeded() -> None:
    a, b, c = draw("simplex", 0, 48), draw("simplex", 0, 48), draw("simplex", 1, 48)
    assert a.problem.H is not None and b.problem.H is not None and c.problem.H is not None
    np.testing.assert_array_equal(a.problem.H, b.problem.H)
    np.testing.assert_array_equal(a.problem.g, b.problem.g)
    assert not np.array_equal(a.problem.g, c.problem.g)
    assert a.problem.shape == (4, 12)


def test_natural_and_sign_families_solve_and_certify() -> None:
    for name, solver in (("box_singular", "active_set"), ("sign", "clarabel")):
        inst = draw(name, 0, 64)
        assert inst.d_star is None
        sol = solve(inst.problem, inst.constraints, solver=solver)
        assert sol.certificate is not None and sol.certificate.certified(1e-8), name


def test_bad_family_parameters_are_named() -> None:
    with pytest.raises(UnknownNameError, match="box_singular"):
        get_family("nope")
    with pytest.raises(ValidationError, match="multiple of K = 4"):
        get_family("box").with_n(10)
    with pytest.raises(ValidationError, match="set_type"):
        InstanceFamily("x", 2, 3, "cube")
    with pytest.raises(ValidationError, match="at_bounds"):
        InstanceFamily("x", 2, 3, "box", at_bounds=1.0)
    with pytest.raises(ValidationError, match="dead must lie in"):
        InstanceFamily("x", 2, 3, "box", dead=1.0)
    with pytest.raises(ValidationError, match="dead must be a number"):
        get_family("box:dead=many")
    with pytest.raises(ValidationError, match="already"):
        register_family(FAMILIES["box"])


@pytest.mark.parametrize("seed", [0, 1])
def test_l1_ball_activated_on_an_all_free_face_is_not_factorised(seed: int) -> None:
    """On the L1 family the first face is all free and the ball becomes active with every
    coordinate still free: both faces are approximated by CG (no factorisation of all of H),
    and the answer is still the planted, certified optimum."""
    inst = draw("l1", seed, 192)
    sol = solve(inst.problem, inst.constraints, solver="active_set")
    assert sol.info["cg_faces"] == 2
    assert sol.certificate is not None and sol.certificate.certified(1e-8)
    assert sol.objective == pytest.approx(inst.objective, rel=1e-9)


def test_a_variant_is_spelt_from_a_registered_family() -> None:
    """(stop 51) ``FAMILY:key=value:...`` (mergeqp bench --family) changes a registered family's fields:
    the draw is that of the InstanceFamily with those fields, named by the spelling."""
    spec = "box:K=8:r=20:cond=1e9:c=4:N=30:at_bounds=0.95"
    fam = get_family(spec)
    assert fam == InstanceFamily(spec, 8, 20, "box", 0.95, cond=1e9, c=4, N=30,
                                 description="a variant of box: K = 8, r = 20, cond = 1000000000.0, c = 4, N = 30, "
                                             "at_bounds = 0.95")
    a, b = draw(spec, 3), draw(InstanceFamily("other", 8, 20, "box", 0.95, cond=1e9, c=4, N=30), 3)
    np.testing.assert_array_equal(a.problem.H, b.problem.H)
    np.testing.assert_array_equal(a.problem.g, b.problem.g)
    assert get_family("box_singular:planted=true").planted and not get_family("box:planted=false").planted
    assert get_family("box:set_type=simplex").set_type == "simplex"
    for bad, message in (("box:rr=2", r"unknown field 'rr' \(did you mean 'r'\?\)"), ("box:K=two", "K must be a whole"),
                         ("box:planted=yes", "true or false"), ("box:cond=", "has no value"),
                         ("box:at_bounds=1", "at_bounds must lie in"), ("box:set_type=cube", "set_type 'cube'")):
        with pytest.raises(ValidationError, match=message):
            get_family(bad)
    with pytest.raises(UnknownNameError, match="did you mean 'box'"):
        get_family("boxx:K=2")


def test_untuned_variants_are_seeded_spellings_of_every_choice() -> None:
    """(stop 75) ``untuned_variants``: deterministic in (count, n, seed); each a spelling ``get_family``
    reads back with n unknowns (K dividing n); over many draws every choice of every field occurs."""
    a = untuned_variants(200, 48, 1)
    assert a == untuned_variants(200, 48, 1) and a != untuned_variants(200, 48, 2)
    assert untuned_variants(5, 48, 1) == a[:5]  # (a longer list extends a shorter one)
    fams = [get_family(v) for v in a]
    assert all(f.n == 48 and f.set_type in ("box", "simplex", "l1") for f in fams)
    for field in ("K", "set_type", "cond", "c", "N"):
        assert {getattr(f, field) for f in fams} == set(UNTUNED_CHOICES[field]), field
    planted = [f for f in fams if f.planted]
    assert 0.4 < len(planted) / len(fams) < 0.8
    assert {f.at_bounds for f in planted} == set(UNTUNED_CHOICES["at_bounds"])
    assert all(":at_bounds=" not in v for v, f in zip(a, fams) if not f.planted)  # (unused there: not spelt)
    assert {f.K for f in (get_family(v) for v in untuned_variants(50, 40, 0))} == {2, 4, 8}  # 3, 6 do not divide 40
    for count, n, message in ((0, 48, "count must be an integer >= 1"), (3, 35, "multiple of one of"), (3, 1, "n must be >= 2")):
        with pytest.raises(ValidationError, match=message):
            untuned_variants(count, n)
