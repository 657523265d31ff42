"""Reference-problem generator, active-set internals, and ``mergeqp bench``."""

from __future__ import annotations

import numpy as np
import pytest

from mergeqp.cli import main
from mergeqp.constraints import Box, Simplex
from mergeqp.problem import MergeQP
from mergeqp.solvers import active_set as A
from mergeqp.solvers.reference_problems import (
    REFERENCE_SPECS,
    merge_qp_from_factors,
    spec_slug,
    synthetic_factors,
    synthetic_merge_qp,
)


@pytest.mark.parametrize("kwargs", [{}, {"dead_rows": 0.2, "duplicate_last": True}])
def test_structured_hessian_equals_naive_construction(kwargs) -> None:
    """H = 2 (R'R) o (1 1' (x) L'L) equals 2 sum_j A_j'A_j with A_j = [L diag(r_1j) ... L diag(r_Kj)]."""
    f = synthetic_factors(3, 7, 4, 11, m=5, seed=4, **kwargs)
    p = merge_qp_from_factors(f)
    K, N, r = f.R.shape
    A = [np.hstack([f.L @ np.diag(f.R[k, j]) for k in range(K)]) for j in range(N)]
    H = 2 * sum(a.T @ a for a in A)
    g = 2 * sum(a.T @ f.B[j] for j, a in enumerate(A))
    c = sum(float(b @ b) for b in f.B)
    assert np.allclose(p.H, H, rtol=1e-12, atol=1e-12 * np.abs(H).max())
    assert np.allclose(p.g, g) and np.isclose(p.c, c)
    d = np.random.default_rng(0).standard_normal(K * r)
    J = sum(float(np.sum((a @ d + f.B[j]) ** 2)) for j, a in enumerate(A))
    assert np.isclose(p.objective(d), J, rtol=1e-10)
    if kwargs:
        assert np.linalg.matrix_rank(p.H) < K * r


def test_generator_is_deterministic_and_leaves_the_box() -> None:
    a = synthetic_merge_qp(3, 16, 4, 30, seed=7)
    b = synthetic_merge_qp(3, 16, 4, 30, seed=7)
    assert np.array_equal(a.H, b.H) and np.array_equal(a.g, b.g)
    x = np.linalg.lstsq(a.H, -a.g, rcond=None)[0]
    assert np.mean((x < 0) | (x > 1)) > 0.2  # the unconstrained optimum leaves [0, 1]


def test_reference_specs_match_the_paper_sizes() -> None:
    sizes = {name: spec.n for name, spec in REFERENCE_SPECS.items()}
    assert sizes["mnist640"] == 640 and sizes["vit3072"] == 3072 and sizes["llama12288"] == 12288
    assert REFERENCE_SPECS["k1_100"].K == 1
    assert spec_slug("box:0,1 & simplex") == "box_0_1__simplex"


@pytest.mark.parametrize("proximal", [False, True], ids=["plain", "proximal"])
def test_bordered_update_equals_fresh_factorisation(proximal: bool) -> None:
    """A face two flips away from the factorised one, solved through the bordered (Schur
    complement) update, equals a fresh factorisation; ``proximal``: a singular H (rank 20)
    with the proximal term ``rho/2 |x - xc|^2`` of the safeguard."""
    rng = np.random.default_rng(4 if proximal else 0)
    K, m = 3, 30
    n = K * m
    if proximal:
        B = rng.standard_normal((n, 20))
        p = MergeQP(B @ B.T, rng.standard_normal(n), shape=(K, m))
    else:
        B = rng.standard_normal((n, n + 5))
        p = MergeQP(B @ B.T / n, rng.standard_normal(n), shape=(K, m))
    for cset in (Box(0, 1), Simplex()):
        st = A.set_structure(cset, p.shape)
        opts = dict(A.ActiveSetSolver.defaults, precision="float64", update_ratio=0.5)
        xc = rng.uniform(0, 1, n) if proximal else None

        def engine(cset=cset, st=st, opts=opts, xc=xc) -> A._Engine:
            e = A._Engine(p, cset, st, opts)
            e.fine = True  # solves refined to float64 accuracy (coarse ones stop at 1e-8)
            if proximal:
                e.rho, e.xc = 0.05, xc
            return e

        e = engine()
        f1 = A._Face(np.where(rng.random(n) < 0.3, A.LO, A.FREE).astype(np.int8), None, False)
        x1, _ = e.face_solve(f1, np.full(n, 1 / K))
        pivots = e._pivot_of_group if e._pivot_of_group is not None else np.zeros(0, dtype=np.intp)
        s2 = f1.status.copy()
        flip = rng.choice(np.setdiff1d(np.arange(n), pivots), 6, replace=False)  # pivots stay
        s2[flip] = np.where(s2[flip] == A.FREE, A.LO, A.FREE)
        f2 = A._Face(s2, None, False)
        x2, _g2 = e.face_solve(f2, x1)
        assert "bordered update" in e.solve_methods
        x3, _ = engine().face_solve(f2, x1)
        assert np.max(np.abs(x2 - x3)) <= 1e-9 * (1 + np.max(np.abs(x3)))
        if isinstance(cset, Simplex):
            # a flipped pivot changes its group's reduced coordinates: the old factor is not
            # reused (the bordered matrix would be singular), and the solve is still exact
            e = engine()
            e.face_solve(f1, np.full(n, 1 / K))
            s3 = f1.status.copy()
            piv = pivots[pivots >= 0]
            groups_with_two = [q for q in piv if np.count_nonzero(s3[q % m::m] == A.FREE) >= 3]
            s3[groups_with_two[0]] = A.LO
            f3 = A._Face(s3, None, False)
            e.solve_methods.clear()
            x4, _ = e.face_solve(f3, x1)
            assert "bordered update" not in e.solve_methods
            x5, _ = engine().face_solve(f3, x1)
            assert np.max(np.abs(x4 - x5)) <= 1e-9 * (1 + np.max(np.abs(x5)))


def test_solve_psd_singular_finds_a_minimiser() -> None:
    rng = np.random.default_rng(1)
    V = rng.standard_normal((8, 3))
    M = V @ V.T
    rhs = M @ rng.standard_normal(8)  # in range(M)
    y, method = A.solve_psd(M, rhs)
    assert method == "ridge+refinement"
    assert np.linalg.norm(M @ y - rhs) <= 1e-8 * np.linalg.norm(rhs)


def test_bench_cli_prints_a_certified_table(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    out = tmp_path / "bench.json"
    code = main(["bench", "--problems", "tiny96", "--solvers", "active_set,clarabel,torch_adam",
                 "--constraint", "box:0,1", "--constraint", "box:0,1 & simplex", "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "problem" in text and "rel. gap" in text
    rows = [line for line in text.splitlines() if line.startswith("tiny96")]
    assert len(rows) == 6
    assert all(" yes " in r for r in rows if "active_set" in r or "clarabel" in r)
    assert any(" NO " in r for r in rows if "torch_adam" in r)  # Adam stalls on the simplex
    import json

    data = json.loads(out.read_text())
    assert {r["solver"] for r in data["rows"]} == {"active_set", "clarabel", "torch_adam"}


def test_bench_cli_rejects_unknown_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--problems", "nope"]) == 2
    assert "valid problems" in capsys.readouterr().err
    assert main(["bench", "--problems", "tiny96", "--solvers", "gurobi"]) == 2


@pytest.mark.parametrize("which", range(6))
def test_the_floor_bound_holds_at_every_point_of_the_set(which: int) -> None:
    """``_Engine.floor_bound`` (converged() computes the rounding floor only below it) bounds
    ``rounding_floor`` at feasible points of every bounded set, far corners included, and is
    infinite where the set is unbounded."""
    from mergeqp.constraints import GlobalSimplex, L1Ball

    rng = np.random.default_rng(which)
    K, m = 3, 8
    n = K * m
    B = rng.standard_normal((n, 6)) * np.exp(rng.standard_normal(n))[:, None]  # rank 6, spread diagonal
    p = MergeQP(B @ B.T, 100 * rng.standard_normal(n), shape=(K, m))
    cset = [Box(-2, 3), Simplex(2.0), Box(-1, np.inf) & Simplex(1.0), GlobalSimplex(4.0), L1Ball(5.0, 0.5),
            Box(0, np.inf)][which]
    e = A._Engine(p, cset, A.set_structure(cset, p.shape), dict(A.ActiveSetSolver.defaults))
    if which == 5:
        assert e.floor_bound == np.inf
        return
    assert 0 < e.floor_bound < np.inf
    for scale in (1.0, 1e3, 1e6):
        for _ in range(20):
            x = e.project(scale * rng.standard_normal(n))
            grad = p.H @ x + p.g
            e.gap(x, grad)
            assert e.rounding_floor(x, grad) <= e.floor_bound


def test_a_proximal_level_solves_its_unchanged_face_in_float32() -> None:
    """(stop 61) A face solved again without change is factorised in float64 (its factor then serves
    bordered updates to the end) on the plain problem only; at a proximal level's start (same face,
    new rho) the level moves on to other faces, so float32 with refinement, to the same solution."""
    rng = np.random.default_rng(3)
    K, m = 2, 320
    n = K * m
    B = rng.standard_normal((n, 200))
    p = MergeQP(B @ B.T / n + 1e-3 * np.eye(n), rng.standard_normal(n), shape=(K, m))
    cset = Box(0, 1)
    face = A._Face(np.where(np.arange(n) < 40, A.LO, A.FREE).astype(np.int8), None, False)  # 600 free
    x0 = np.full(n, 0.5)
    for rho in (0.0, 0.01):
        e = A._Engine(p, cset, A.set_structure(cset, p.shape), dict(A.ActiveSetSolver.defaults))
        e.xc = x0
        e.fine = True
        e.rho = 0.04 * e.eta
        e.face_solve(face, x0)  # the face at the previous level's rho (many changes: float32)
        e.rho = rho * e.eta
        e.solve_methods.clear()
        x = e.face_solve(face, x0)[0]  # the same face at the new rho: no change
        expected = "cholesky" if rho == 0 else "cholesky-float32+refinement"
        assert e.solve_methods == {expected}, (rho, e.solve_methods)
        F = face.status == A.FREE
        M = p.H[np.ix_(F, F)] + e.rho * np.eye(int(F.sum()))
        assert np.all(x[~F] == 0.0)  # the fixed coordinates at their lower bound
        rhs = -p.g[F] + e.rho * x0[F]
        ref = np.linalg.solve(M, rhs)
        np.testing.assert_allclose(x[F], ref, rtol=0, atol=1e-11 * np.max(np.abs(ref)))
