"""MergeQP: algebra, layout, validation messages, regularisation, npz round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeqp.errors import NotConvexError, ValidationError
from mergeqp.problem import MergeQP, load_problem_file


def _savez(path, **arrays) -> None:
    with open(path, "wb") as fh:  # keep the .npz name (np.savez would add a suffix to others)
        np.savez(fh, **arrays)


def _save_npy(path, array) -> None:
    with open(path, "wb") as fh:  # a plain .npy under an .npz name
        np.save(fh, array)


@pytest.fixture(scope="session")
def small_qp(random_problem):
    """``small_qp(K=2, m=3, seed=0)``: a small random merge QP of shape ``(K, m)``."""

    def _small_qp(K: int = 2, m: int = 3, seed: int = 0) -> MergeQP:
        return random_problem(np.random.default_rng(seed), K=K, m=m)

    return _small_qp


# ---------------------------------------------------------------------- algebra and layout
@settings(max_examples=25, deadline=None)
@given(K=st.integers(1, 4), m=st.integers(1, 5), seed=st.integers(0, 10_000))
def test_objective_and_gradient_match_the_formula(random_problem, K: int, m: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    p = random_problem(rng, K=K, m=m)
    d = rng.normal(size=(K, m))
    x = d.ravel()  # row-major: d[k, a] is x[k * m + a]
    assert p.objective(d) == pytest.approx(0.5 * x @ p.H @ x + p.g @ x + p.c, rel=1e-12, abs=1e-12)
    assert p.objective(x) == pytest.approx(p.objective(d), rel=1e-14)
    grad = p.gradient(d)
    assert grad.shape == (K, m)
    np.testing.assert_allclose(grad.ravel(), p.H @ x + p.g, rtol=1e-12, atol=1e-12)
    assert p.gradient(x).shape == (K * m,)
    # exact second-order expansion of a quadratic
    e = rng.normal(size=(K, m))
    lhs = p.objective(d + e) - p.objective(d)
    rhs = float(np.sum(grad * e)) + 0.5 * e.ravel() @ p.H @ e.ravel()
    assert lhs == pytest.approx(rhs, rel=1e-9, abs=1e-9)


def test_layout_is_models_by_atoms_row_major() -> None:
    # H couples only d[1, 2] (flat index 1 * 3 + 2 = 5) with itself
    H = np.zeros((6, 6))
    H[5, 5] = 2.0
    g = np.zeros(6)
    g[5] = -4.0
    p = MergeQP(H, g, shape=(2, 3), model_names=["a", "b"], atom_names=["x", "y", "z"])
    d = np.zeros((2, 3))
    d[1, 2] = 2.0
    assert p.objective(d) == pytest.approx(0.5 * 2 * 4 - 8)
    assert p.gradient(d)[1, 2] == pytest.approx(0.0)
    assert p.K == 2 and p.n_atoms == 3 and p.n == 6
    assert p.model_names == ("a", "b") and p.atom_names == ("x", "y", "z")


def test_soup_and_constant_points(small_qp) -> None:
    p = small_qp(K=4, m=2)
    np.testing.assert_allclose(p.soup_point(), np.full((4, 2), 0.25))
    np.testing.assert_allclose(p.constant_point(0.3), np.full((4, 2), 0.3))


def test_g_may_be_given_as_a_matrix_matching_shape() -> None:
    H = np.eye(6)
    p = MergeQP(H, np.arange(6.0).reshape(2, 3), shape=(2, 3))
    np.testing.assert_allclose(p.g, np.arange(6.0))
    assert not p.g.flags.writeable and not p.H.flags.writeable


def test_default_shape_is_one_model() -> None:
    p = MergeQP(np.eye(3), np.ones(3))
    assert p.shape == (1, 3)


def test_accepts_sparse_and_torch_hessians() -> None:
    torch = pytest.importorskip("torch")
    H = np.diag([1.0, 2.0, 3.0, 4.0])
    p1 = MergeQP(sp.csr_matrix(H), np.ones(4), shape=(2, 2))
    p2 = MergeQP(torch.tensor(H), torch.ones(4), shape=(2, 2))
    np.testing.assert_array_equal(p1.H, H)
    np.testing.assert_array_equal(p2.H, H)


def test_matvec_only_problem(small_qp) -> None:
    base = small_qp(K=2, m=3)
    H = np.array(base.H)
    p = MergeQP(None, base.g, c=base.c, shape=base.shape, hessian_matvec=lambda x: H @ x)
    d = np.random.default_rng(1).normal(size=base.shape)
    assert p.objective(d) == pytest.approx(base.objective(d), rel=1e-13)
    np.testing.assert_allclose(p.diagonal(), np.diag(H))
    with pytest.raises(ValidationError, match="matvec"):
        p.save_npz("/tmp/never.npz")


# ---------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"H": np.full((4, 4), np.nan), "g": np.zeros(4)}, r"H contains 16 non-finite.*first at index \(0, 0\)"),
        ({"H": np.eye(4), "g": np.array([0, 1, np.inf, 0.0])}, r"g contains 1 non-finite.*index \(2,\)"),
        ({"H": np.eye(3), "g": np.zeros(4)}, r"H must have shape \(4, 4\) to match g, got \(3, 3\)"),
        ({"H": np.eye(4), "g": np.zeros((2, 2))}, r"g must be a vector"),
        ({"H": np.eye(4), "g": np.zeros(4), "shape": (3, 2)}, r"shape \(3, 2\).*6 entries but g has length 4"),
        ({"H": np.eye(4), "g": np.zeros(4), "shape": (0, 4)}, r"shape must be \(K, n_atoms\)"),
        ({"H": np.eye(4), "g": np.zeros(4), "shape": (2.5, 2)}, r"shape must be \(K, n_atoms\)"),
        ({"H": np.eye(4), "g": np.zeros(4), "shape": "ab"}, r"shape must be \(K, n_atoms\)"),
        ({"H": np.eye(4), "g": np.zeros(0)}, r"g is empty"),
        ({"H": np.eye(4), "g": np.zeros(4), "c": np.nan}, r"c is not finite"),
        ({"H": np.eye(4), "g": np.zeros(4), "c": np.ones(2)}, r"c must be a scalar"),
        ({"H": np.eye(4), "g": np.zeros(4), "c": "x"}, r"c \(a scalar\) must be an array of real numbers"),
        ({"H": [["a"] * 4] * 4, "g": np.zeros(4)}, r"H must be an array of real numbers"),
        ({"H": None, "g": np.zeros(4)}, r"give H \(n x n\) or hessian_matvec"),
        ({"H": np.eye(4), "g": np.zeros(4), "shape": (2, 2), "model_names": ["a"]}, r"model_names: expected 2 names"),
        ({"H": np.eye(4), "g": np.zeros(4), "shape": (2, 2), "atom_names": ["a", "a"]}, r"atom_names: names must be unique"),
        ({"H": np.eye(4), "g": np.zeros(4), "psd_tol": -1.0}, r"psd_tol must be a finite number >= 0"),
        ({"H": np.eye(4), "g": np.zeros(4), "metadata": [1, 2]}, r"metadata must be a mapping"),
    ],
)
def test_bad_input_names_the_field(kwargs: dict, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        MergeQP(**kwargs)


def test_small_asymmetry_is_symmetrised() -> None:
    rng = np.random.default_rng(3)
    A = rng.normal(size=(8, 6))
    H = A.T @ A
    H_noisy = H + 1e-12 * rng.normal(size=H.shape)
    p = MergeQP(H_noisy, np.zeros(6))
    np.testing.assert_array_equal(p.H, p.H.T)
    np.testing.assert_allclose(p.H, 0.5 * (H_noisy + H_noisy.T), rtol=0, atol=1e-15)


def test_large_asymmetry_is_an_error_naming_the_entry() -> None:
    H = np.eye(5)
    H[1, 3] = 0.5
    with pytest.raises(ValidationError, match=r"H is not symmetric: \|H\[1,3\] - H\[3,1\]\| = 0.5"):
        MergeQP(H, np.zeros(5))


def test_asymmetry_check_covers_several_tiles() -> None:
    n = 1100  # more than two 512-wide tiles
    H = np.eye(n)
    H[1050, 7] = 1e-3
    with pytest.raises(ValidationError, match=r"H\[7,1050\]"):
        MergeQP(H, np.zeros(n))


def test_indefinite_hessian_is_rejected() -> None:
    H = np.diag([3.0, 1.0, -0.5])
    with pytest.raises(NotConvexError, match=r"not positive semidefinite: smallest eigenvalue -0.5"):
        MergeQP(H, np.zeros(3))


def test_indefinite_with_positive_diagonal_is_rejected() -> None:
    H = np.array([[1.0, 2.0], [2.0, 1.0]])  # eigenvalues 3 and -1
    with pytest.raises(NotConvexError, match=r"smallest eigenvalue -1"):
        MergeQP(H, np.zeros(2))


def test_psd_within_tolerance_is_accepted() -> None:
    rng = np.random.default_rng(0)
    Q, _ = np.linalg.qr(rng.normal(size=(6, 6)))
    eig = np.array([10.0, 5, 1, 0.1, 0.0, -1e-11])  # -1e-12 relative: round-off, accepted
    p = MergeQP(Q @ np.diag(eig) @ Q.T, np.zeros(6))
    assert p.n == 6
    eig[-1] = -1e-6
    with pytest.raises(NotConvexError):
        MergeQP(Q @ np.diag(eig) @ Q.T, np.zeros(6))


def test_large_problem_psd_check_catches_negative_diagonal_and_eigenvalue() -> None:
    H = np.eye(40)
    H[5, 5] = -1.0
    with pytest.raises(NotConvexError, match=r"diagonal entry H\[5,5\]"):
        MergeQP(H, np.zeros(40), psd_check_max_n=10)
    H = np.eye(40)
    H[0, 1] = H[1, 0] = 3.0  # eigenvalue -2 with a positive diagonal: Lanczos finds it
    with pytest.raises(NotConvexError, match=r"smallest eigenvalue -2"):
        MergeQP(H, np.zeros(40), psd_check_max_n=10)


def test_bad_point_shape_is_named(small_qp) -> None:
    p = small_qp(K=2, m=3)
    with pytest.raises(ValidationError, match=r"d must have shape \(2, 3\).*got \(3, 2\)"):
        p.objective(np.zeros((3, 2)))
    with pytest.raises(ValidationError, match=r"d contains 1 non-finite"):
        p.objective(np.array([[0, 0, np.nan], [0, 0, 0.0]]))


# ---------------------------------------------------------------------- regularisation
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), mu=st.floats(0.0, 10.0))
def test_regularised_adds_mu_distance_squared(random_problem, seed: int, mu: float) -> None:
    rng = np.random.default_rng(seed)
    p = random_problem(rng, K=3, m=2)
    d = rng.normal(size=p.shape)
    ref = rng.normal(size=p.shape)
    for reference, ref_arr in ((None, p.soup_point()), (0.5, np.full(p.shape, 0.5)), (ref, ref)):
        q = p.regularised(mu, reference)
        expect = p.objective(d) + mu * float(np.sum((d - ref_arr) ** 2))
        assert q.objective(d) == pytest.approx(expect, rel=1e-11, abs=1e-11)
        assert q.shape == p.shape and q.model_names == p.model_names


def test_regularised_optimum_moves_to_the_reference(small_qp) -> None:
    p = small_qp(K=2, m=3, seed=4)
    ref = np.full(p.shape, 0.5)
    q = p.regularised(1e6, ref)
    d = np.linalg.solve(q.H, -q.g).reshape(p.shape)
    np.testing.assert_allclose(d, ref, atol=1e-4)
    assert q.metadata["regularisation"] == {"mu": 1e6, "reference": "array"}
    assert p.regularised(1.0).metadata["regularisation"]["reference"] == "soup"


def test_regularised_matvec_problem(small_qp) -> None:
    base = small_qp(K=2, m=2)
    H = np.array(base.H)
    p = MergeQP(None, base.g, c=base.c, shape=base.shape, hessian_matvec=lambda x: H @ x)
    d = np.ones(base.shape)
    assert p.regularised(2.0).objective(d) == pytest.approx(base.regularised(2.0).objective(d), rel=1e-13)


def test_regularised_bad_arguments(small_qp) -> None:
    p = small_qp()
    with pytest.raises(ValidationError, match=r"mu must be finite and >= 0"):
        p.regularised(-1.0)
    with pytest.raises(ValidationError, match=r"reference has shape \(5,\)"):
        p.regularised(1.0, np.zeros(5))
    with pytest.raises(ValidationError, match=r"reference contains"):
        p.regularised(1.0, np.nan)


# ---------------------------------------------------------------------- files
def test_npz_round_trip_with_names_metadata_and_context(tmp_path) -> None:
    p = MergeQP(np.eye(4) * 2, np.arange(4.0), c=3.5, shape=(2, 2), model_names=["m0", "m1"],
                atom_names=["r0", "r1"], metadata={"layer": "fc1"})
    deltas = np.ones((2, 2, 3))
    path = str(tmp_path / "p.npz")
    p.save_npz(path, extra={"deltas": deltas, "parametrisation": "rows"})
    q, ctx = load_problem_file(path)
    np.testing.assert_array_equal(q.H, p.H)
    np.testing.assert_array_equal(q.g, p.g)
    assert q.c == 3.5 and q.shape == (2, 2) and q.model_names == ("m0", "m1")
    assert dict(q.metadata) == {"layer": "fc1"}
    np.testing.assert_array_equal(ctx["deltas"], deltas)
    assert ctx["parametrisation"] == "rows"
    assert MergeQP.load_npz(path).c == 3.5
    with pytest.raises(ValidationError, match="overwrite"):
        p.save_npz(path, extra={"H": np.eye(4)})


def test_minimal_npz_without_c_and_shape(tmp_path) -> None:
    path = tmp_path / "min.npz"
    np.savez(path, H=np.eye(3), g=np.ones(3))
    q = MergeQP.load_npz(str(path))
    assert q.c == 0.0 and q.shape == (1, 3)


@pytest.mark.parametrize(
    "writer, match",
    [
        (lambda p: None, r"problem file not found"),
        (lambda p: p.write_bytes(b"not a numpy file at all"), r"cannot read problem file"),
        (lambda p: _save_npy(p, np.eye(3)), r"holds a single array, not an .npz archive"),
        (lambda p: _savez(p, g=np.ones(3)), r"lacks array\(s\) \['H'\]"),
        (lambda p: _savez(p, H=np.eye(2), g=np.ones(2), shape=np.array([1, 2, 3])),
         r"shape must be \(K, n_atoms\)"),
        (lambda p: _savez(p, H=np.eye(2), g=np.ones(2), c=np.ones(3)), r"c must be a scalar"),
        (lambda p: _savez(p, H=np.eye(2), g=np.ones(3)), r"bad.npz: H must have shape \(3, 3\)"),
        (lambda p: _savez(p, H=np.array([[1.0, 0], [0, -1.0]]), g=np.ones(2)),
         r"bad.npz: H is not positive semidefinite"),
    ],
)
def test_bad_problem_files(tmp_path, writer, match: str) -> None:
    path = tmp_path / "bad.npz"
    writer(path)
    with pytest.raises(ValidationError, match=match):
        load_problem_file(str(path))


def test_metadata_survives_as_json(tmp_path) -> None:
    p = MergeQP(np.eye(2), np.ones(2), metadata={"a": [1, 2], "b": {"c": "d"}})
    path = str(tmp_path / "m.npz")
    p.save_npz(path)
    with np.load(path) as data:
        assert json.loads(str(data["metadata"])) == {"a": [1, 2], "b": {"c": "d"}}


@pytest.mark.parametrize("matvec, error", [
    (lambda x: -x, "not positive semidefinite"),
    (lambda x: np.array([1.0, -1.0, 1.0, 1.0]) * x, "not positive semidefinite"),
    (lambda x: np.triu(np.ones((4, 4))) @ x, "not symmetric"),
    (lambda x: x * np.nan, "NaN or inf"),
    (lambda x: x[:2], "must return a vector of shape"),
])
def test_a_matvec_only_hessian_is_checked_like_an_explicit_one(matvec, error) -> None:
    """A callback H that is not convex would make the certificate's bounds false (a concave J
    over a box 'certified' at a vertex): it is rejected when the problem is built."""
    from mergeqp.errors import MergeQPError

    with pytest.raises(MergeQPError, match=error):
        MergeQP(None, np.array([-1.0, 1.0, -2.0, 0.5]), shape=(2, 2), hessian_matvec=matvec)


def test_a_large_indefinite_matvec_is_caught_by_lanczos() -> None:
    from mergeqp.errors import NotConvexError
    from mergeqp.problem import MATVEC_DENSE_CHECK_N

    n = MATVEC_DENSE_CHECK_N + 88
    B = np.random.default_rng(0).standard_normal((n, 20))
    g = np.ones(n)
    MergeQP(None, g, hessian_matvec=lambda x: B @ (B.T @ x))  # PSD (rank 20): accepted
    with pytest.raises(NotConvexError, match="Lanczos estimate"):
        MergeQP(None, g, hessian_matvec=lambda x: B @ (B.T @ x) - 1e-2 * x)


@pytest.mark.parametrize("kwargs, message", [
    (dict(shape=(True, 2)), "shape must be"),
    (dict(c="1.0"), "got a string"),
    (dict(H=np.eye(2) * (1 + 1j)), "must be real"),
])
def test_inputs_numpy_would_coerce_are_rejected(kwargs, message) -> None:
    args = dict(H=np.eye(2), g=[1.0, 1.0])
    args.update(kwargs)
    with pytest.raises(ValidationError, match=message):
        MergeQP(**args)


def test_torch_bfloat16_hessian_and_array_mu(tmp_path) -> None:
    import torch

    p = MergeQP(torch.eye(2, dtype=torch.bfloat16), [1.0, 1.0])
    assert p.H.dtype == np.float64 and p.H[0, 0] == 1.0
    with pytest.raises(ValidationError, match="mu must be a scalar"):
        p.regularised(np.array([1.0, 2.0]))
    p.save_npz(str(tmp_path / "q"))  # numpy appends .npz; loading by the same name works
    assert MergeQP.load_npz(str(tmp_path / "q")).n == 2


def test_metadata_numbers_and_arrays_survive_a_round_trip(tmp_path) -> None:
    """Stop 74 review: numpy scalars came back as text ('1.5') and arrays as numpy's abbreviated print
    ('[0 1 2]', '...' for large ones); now as numbers and lists."""
    meta = {"f": np.float32(1.5), "i": np.int64(7), "arr": np.arange(3), "big": np.arange(2000.0),
            "nested": {"a": (np.float64(0.25), 2)}}
    problem = MergeQP(np.eye(4), np.ones(4), metadata=meta)
    problem.save_npz(str(tmp_path / "m.npz"))
    back = MergeQP.load_npz(str(tmp_path / "m.npz")).metadata
    assert back["f"] == 1.5 and back["i"] == 7 and back["arr"] == [0, 1, 2]
    assert back["big"] == list(np.arange(2000.0)) and back["nested"] == {"a": [0.25, 2]}
