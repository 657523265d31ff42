"""What depends only on H is reused across problems holding the same H array
(:mod:`mergeqp.matrix_cache`): never for a writable array or another array with equal contents,
and a warm-started sequence reaches the same certified points as cold solves."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import mergeqp.certificate as cm
from mergeqp.certificate import certify, forget_factorisation
from mergeqp.constraints import Box
from mergeqp.errors import ValidationError
from mergeqp.matrix_cache import forget_matrix, matrix_values
from mergeqp.problem import MergeQP
from mergeqp.solvers.active_set_linalg import FACTOR_KEY, FLOAT32_KEY
from mergeqp.solvers.instance_families import draw
from mergeqp.solvers.registry import solve


def test_values_belong_to_one_read_only_array() -> None:
    H = np.eye(4)
    assert matrix_values(H) is None  # writable: its contents could change behind a cache
    H.setflags(write=False)
    values = matrix_values(H)
    assert values is not None
    values["x"] = 1
    assert matrix_values(H) is values
    twin = H.copy()
    twin.setflags(write=False)
    assert matrix_values(twin) is not values and "x" not in matrix_values(twin)  # equal contents: no
    forget_matrix(H)
    assert "x" not in matrix_values(H)


def test_values_go_with_their_array() -> None:
    import mergeqp.matrix_cache as mc

    H = np.ones((3, 3))
    H.setflags(write=False)
    matrix_values(H)["x"] = 1
    count = len(mc._entries)
    del H
    gc.collect()
    assert len(mc._entries) == count - 1


def test_with_linear_term_shares_h_and_checks_g() -> None:
    P = draw("box", 0, 16).problem
    Q = P.with_linear_term(2 * P.g.reshape(P.shape), c=1.5)
    assert Q.H is P.H and Q.c == 1.5 and Q.g.shape == (P.n,)
    assert np.array_equal(Q.g, 2 * P.g) and not Q.g.flags.writeable
    with pytest.raises(ValidationError, match="g must have shape"):
        P.with_linear_term(np.ones(P.n + 1))
    with pytest.raises(ValidationError, match="non-finite"):
        P.with_linear_term(np.full(P.n, np.nan))


def test_certificate_factorises_a_shared_h_once(monkeypatch) -> None:
    rng = np.random.default_rng(0)
    A = rng.standard_normal((5, 12))
    P = MergeQP(2 * A.T @ A, 2 * A.T @ rng.standard_normal(5), 3.0, shape=(3, 4))
    calls = [0]
    real_eigh = np.linalg.eigh

    def counting_eigh(M):
        calls[0] += 1
        return real_eigh(M)

    monkeypatch.setattr(cm.np.linalg, "eigh", counting_eigh)
    first = certify(P, Box(0.0, 1.0), np.full((3, 4), 0.5), pinv=True)
    Q = P.with_linear_term(P.g + 1.0)
    second = certify(Q, Box(0.0, 1.0), np.full((3, 4), 0.5), pinv=True)
    assert calls[0] == 1  # the same H array: its eigendecomposition is reused
    forget_factorisation(Q)
    fresh = certify(Q, Box(0.0, 1.0), np.full((3, 4), 0.5), pinv=True)
    assert calls[0] == 2
    assert fresh.unconstrained_bound == pytest.approx(second.unconstrained_bound, rel=1e-12)
    assert first.unconstrained_bound != second.unconstrained_bound


@pytest.mark.parametrize("family", ["box", "simplex", "l1", "box_singular"])
def test_warm_sequence_on_a_shared_h_matches_cold_solves(family: str) -> None:
    inst = draw(family, 1, 600)  # faces of >= 512 free coordinates: float32 factors
    P = inst.problem
    rng = np.random.default_rng(3)
    step = 0.01 * float(np.sqrt(np.mean(P.g ** 2)))
    problems = [P.with_linear_term(P.g + step * rng.standard_normal(P.n) * k) for k in range(1, 4)]
    forget_factorisation(P)
    x0 = solve(P, inst.constraints, solver="active_set").d
    shared = matrix_values(P.H)
    assert shared is not None and FACTOR_KEY in shared
    for prob in problems:
        warm = solve(prob, inst.constraints, solver="active_set", x0=x0, start_face="point")
        cold = solve(MergeQP(P.H, prob.g, P.c, shape=P.shape), inst.constraints, solver="active_set")
        assert warm.certificate is not None and warm.certificate.certified(1e-8)
        assert warm.objective == pytest.approx(cold.objective, rel=1e-9, abs=1e-9)
        x0 = warm.d
    if FLOAT32_KEY in shared:
        assert shared[FLOAT32_KEY].dtype == np.float32 and not shared[FLOAT32_KEY].flags.writeable


@pytest.mark.parametrize("family", ["box", "l1", "box_singular"])
def test_warm_start_from_the_last_face_reuses_its_factor(family: str) -> None:
    """From the previous optimum's face the first face solve needs no factorisation when the
    previous solve's factor of that face is kept for this H array."""
    inst = draw(family, 1, 96)
    P = inst.problem
    Q = P.with_linear_term(P.g + 0.01 * np.sqrt(np.mean(P.g ** 2)) * np.random.default_rng(0).standard_normal(P.n))
    d = solve(P, inst.constraints, solver="active_set").d
    reused = solve(Q, inst.constraints, solver="active_set", x0=d, start_face="point")
    forget_factorisation(P)
    fresh = solve(Q, inst.constraints, solver="active_set", x0=d, start_face="point")
    assert reused.info["factorisations"] == fresh.info["factorisations"] - 1
    assert reused.iterations == fresh.iterations
    assert reused.objective == pytest.approx(fresh.objective, rel=1e-12, abs=1e-12)
