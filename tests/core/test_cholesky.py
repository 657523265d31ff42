"""``mergeqp.cholesky``: `cho_solve` (two triangular solves for a vector) and `triangular_solve`, the same as SciPy's."""

import numpy as np
import pytest
import scipy.linalg as sla
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeqp.cholesky import cho_solve, triangular_solve


def _spd(rng, n, dtype):
    A = rng.standard_normal((n, n))
    return (A @ A.T / n + 0.1 * np.eye(n)).astype(dtype)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), lower=st.booleans(), order=st.sampled_from(["C", "F"]),
       dtype=st.sampled_from([np.float64, np.float32]), seed=st.integers(0, 10_000))
def test_vector_solve_matches_scipy(n, lower, order, dtype, seed):
    rng = np.random.default_rng(seed)
    M = _spd(rng, n, dtype)
    c, low = sla.cho_factor(M, lower=lower, check_finite=False)
    c = np.asarray(c, order=order)  # the triangle read must follow the memory order
    b = rng.standard_normal(n)
    x = cho_solve((c, low), b.astype(dtype))
    ref = sla.cho_solve((c, low), b.astype(dtype), check_finite=False)
    assert x.dtype == ref.dtype and x.shape == (n,)
    tol = 1e-10 if dtype == np.float64 else 2e-3
    assert np.allclose(x, ref, rtol=tol, atol=tol * np.abs(ref).max())
    # and it solves the system
    assert np.linalg.norm(M.astype(np.float64) @ x - b) <= tol * 10 * (np.linalg.norm(b) + 1)


def test_the_other_triangle_is_never_read():
    """``cho_factor`` leaves the other triangle as it was: garbage there must not matter."""
    rng = np.random.default_rng(1)
    M = _spd(rng, 12, np.float64)
    for lower in (False, True):
        c, low = sla.cho_factor(M, lower=lower)
        junk = np.tril(np.full_like(c, 1e30), -1) if not lower else np.triu(np.full_like(c, 1e30), 1)
        c = np.where(junk != 0, junk, c)
        b = rng.standard_normal(12)
        assert np.allclose(cho_solve((np.asfortranarray(c), low), b), np.linalg.solve(M, b))
        assert np.allclose(cho_solve((np.ascontiguousarray(c), low), b), np.linalg.solve(M, b))


def test_matrix_and_strided_right_hand_sides_and_factors():
    rng = np.random.default_rng(2)
    M = _spd(rng, 9, np.float64)
    fac = sla.cho_factor(M)
    B = rng.standard_normal((9, 3))
    assert np.allclose(cho_solve(fac, B), np.linalg.solve(M, B))  # LAPACK for a matrix
    assert np.allclose(cho_solve(fac, B[:, 1]), np.linalg.solve(M, B[:, 1]))  # a strided vector
    big = np.zeros((18, 18))
    big[::2, ::2] = fac[0]
    strided = (big[::2, ::2], fac[1])  # neither C- nor F-contiguous: SciPy's path
    assert np.allclose(cho_solve(strided, B[:, 0]), np.linalg.solve(M, B[:, 0]))


def test_the_input_is_not_overwritten():
    rng = np.random.default_rng(3)
    M = _spd(rng, 7, np.float64)
    fac = sla.cho_factor(M)
    b = rng.standard_normal(7)
    keep = b.copy()
    cho_solve(fac, b)
    assert np.array_equal(b, keep)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_vector_in_another_precision_is_solved_in_the_factors(dtype):
    rng = np.random.default_rng(4)
    M = _spd(rng, 8, dtype)
    fac = sla.cho_factor(M)
    x = cho_solve(fac, rng.standard_normal(8))  # float64 vector
    assert x.dtype == dtype


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 30), lower=st.booleans(), order=st.sampled_from(["C", "F"]), transpose=st.booleans(),
       dtype=st.sampled_from([np.float64, np.float32]), seed=st.integers(0, 10_000))
def test_triangular_solve_matches_scipy(n, lower, order, transpose, dtype, seed):
    rng = np.random.default_rng(seed)
    c, low = sla.cho_factor(_spd(rng, n, dtype), lower=lower, check_finite=False)
    c = np.asarray(c, order=order)
    b = rng.standard_normal(n).astype(dtype)
    x = triangular_solve((c, low), b, transpose=transpose)
    ref = sla.solve_triangular(c, b, trans="T" if transpose else "N", lower=low, check_finite=False)
    tol = 1e-10 if dtype == np.float64 else 2e-3
    assert x.dtype == dtype and np.allclose(x, ref, rtol=tol, atol=tol * np.abs(ref).max())
    B = rng.standard_normal((n, 3)).astype(dtype)  # a matrix: LAPACK
    assert np.allclose(triangular_solve((c, low), B, transpose=transpose),
                       sla.solve_triangular(c, B, trans="T" if transpose else "N", lower=low), rtol=tol, atol=tol)
