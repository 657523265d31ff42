"""Warm starts through the public API (``x0``, active_set's ``start_face``) and
``mergeqp solve --x0``: a warm start from the optimum stops at once; from a neighbour's
optimum it reaches the same certified point."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mergeqp.cli import main
from mergeqp.errors import ValidationError
from mergeqp.problem import MergeQP
from mergeqp.solvers.instance_families import draw
from mergeqp.solvers.registry import solve


@pytest.mark.parametrize("family", ["box_singular", "simplex", "l1"])
@pytest.mark.parametrize("start_face", ["gradient", "point"])
def test_warm_start_from_a_neighbour_reaches_the_optimum(family: str, start_face: str) -> None:
    inst = draw(family, 2, 96)
    P = inst.problem
    cold = solve(P, inst.constraints, solver="active_set")
    moved = MergeQP(P.H, P.g + 0.01 * np.sqrt(np.mean(P.g ** 2)) * np.random.default_rng(0).standard_normal(P.n),
                    P.c, shape=P.shape)
    ref = solve(moved, inst.constraints, solver="active_set")
    warm = solve(moved, inst.constraints, solver="active_set", x0=cold.d, start_face=start_face)
    assert warm.certificate is not None and warm.certificate.certified(1e-8)
    assert warm.objective == pytest.approx(ref.objective, rel=1e-10, abs=1e-10)
    again = solve(P, inst.constraints, solver="active_set", x0=cold.d, start_face=start_face)
    assert again.iterations == 0  # the optimum itself: certified before any face solve


def test_start_face_value_is_checked() -> None:
    inst = draw("box", 0, 16)
    with pytest.raises(ValidationError, match="start_face"):
        solve(inst.problem, inst.constraints, solver="active_set", start_face="best")


def test_cli_solve_takes_a_warm_start(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    inst = draw("box", 0, 48)
    path = str(tmp_path / "p.npz")
    inst.problem.save_npz(path)
    first = str(tmp_path / "first.json")
    assert main(["solve", path, "--constraint", "box:0,1", "--solver", "active_set", "--out", first]) == 0
    second = str(tmp_path / "second.json")
    assert main(["solve", path, "--constraint", "box:0,1", "--solver", "active_set", "--x0", first,
                 "--option", "start_face=point", "--out", second]) == 0
    sol = json.loads(open(second, encoding="utf-8").read())
    assert sol["iterations"] == 0 and sol["certificate"]["certified"]
    capsys.readouterr()
    assert main(["solve", path, "--constraint", "box:0,1", "--x0", str(tmp_path / "missing.npy")]) == 2
    assert "missing.npy" in capsys.readouterr().err


def test_gradient_updates_from_nearby_points_match_full_products() -> None:
    from mergeqp.solvers.active_set import SPARSE_PRODUCT, _Engine, set_structure
    from mergeqp.solvers.registry import get_solver

    inst = draw("box", 0, 96)
    P = inst.problem
    engine = _Engine(P, inst.constraints, set_structure(inst.constraints, P.shape),
                     get_solver("active_set").check_options({}))
    rng = np.random.default_rng(0)
    x = rng.random(P.n)
    engine.remember_gradient(x, P.H @ x + P.g)
    y = x.copy()
    moved = rng.choice(P.n, int(0.5 * SPARSE_PRODUCT * P.n), replace=False)
    y[moved] = 0.0
    np.testing.assert_allclose(engine.objective_gradient(y), P.H @ y + P.g, rtol=1e-12, atol=1e-12)
    dx = np.zeros(P.n)
    dx[moved] = rng.standard_normal(moved.size)
    for _ in range(2):  # the second product reuses the gathered rows
        np.testing.assert_allclose(engine.sparse_product(dx), P.H @ dx, rtol=1e-12, atol=1e-12)
    far = rng.random(P.n)  # differs everywhere: a full product
    np.testing.assert_allclose(engine.objective_gradient(far), P.H @ far + P.g, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("solver", ["active_set", "torch_active_set"])
def test_a_warm_start_far_along_a_flat_coordinate_is_not_taken_as_optimal(solver):
    """(stop 46 review) H = diag(1, 1e-16) on box:-1e12,1e12 from x0 = (0, 1e10), J = 5000 and
    J* = 0: the rounding floor took max diag H |x|_inf as every gradient entry's reach, so the gap
    (1e6) sat below it, and the warm start came back after 0 face solves as optimal. The floor now
    bounds |H_ij x_j| by sqrt(H_ii H_jj) |x_j|: the solver moves on to the optimum."""
    pytest.importorskip("torch")
    import mergeqp as mq

    p = mq.MergeQP(np.diag([1.0, 1e-16]), np.zeros(2), shape=(1, 2))
    sol = mq.solve(p, "box:-1e12,1e12", solver=solver, x0=np.array([[0.0, 1e10]]))
    assert sol.objective <= 1e-6 and sol.iterations > 0
