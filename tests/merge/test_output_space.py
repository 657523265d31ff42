"""The full-matrix output-space merge (mergeqp.merge.output_space): against a dense closed form,
against RegMean's closed form when the compared output is the layer's own, the ball constraint's
KKT conditions, and a tiny linear network where the linearisation is exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mergeqp.errors import ValidationError
from mergeqp.merge.output_space import OutputSpaceSamples, output_space_solve
from mergeqp.merge.regmean import regmean_solve


def _random_samples(rng: np.random.Generator, N: int = 7, c: int = 3, T: int = 1, r: int = 4,
                    m1: int = 5) -> OutputSpaceSamples:
    return OutputSpaceSamples(layer_input=rng.normal(size=(N, T, m1)), jacobian=rng.normal(size=(N, c, T, r)),
                              target=rng.normal(size=(N, c)), weight=rng.uniform(0.5, 2.0, size=N))


def _dense(samples: OutputSpaceSamples) -> tuple[np.ndarray, np.ndarray]:
    """The design ``M`` ``(N c, r m1)`` (row-major vec of E) with rows scaled by sqrt(w), and the
    scaled targets: ``F(E) = ||M vec(E) - y||^2 + ...``."""
    X, A = samples.layer_input, samples.jacobian
    M = np.einsum("nctr,ntm->ncrm", A, X).reshape(X.shape[0] * A.shape[1], -1)
    s = np.repeat(np.sqrt(samples.weight), A.shape[1])
    return M * s[:, None], samples.target.reshape(-1) * s


@given(seed=st.integers(0, 10_000), T=st.integers(1, 3), ridge=st.floats(1e-3, 10.0))
def test_unconstrained_matches_the_dense_closed_form(seed: int, T: int, ridge: float) -> None:
    rng = np.random.default_rng(seed)
    samples = _random_samples(rng, T=T)
    center = rng.normal(size=samples.shape)
    M, y = _dense(samples)
    n = M.shape[1]
    expected = np.linalg.solve(M.T @ M + ridge * np.eye(n), M.T @ y + ridge * center.reshape(-1))
    sol = output_space_solve(samples, ridge=ridge, center=center)
    assert sol.certified()
    assert sol.residual <= 1e-6
    np.testing.assert_allclose(sol.E.reshape(-1), expected, rtol=1e-6, atol=1e-8 * np.abs(expected).max())
    assert sol.objective == pytest.approx(
        float(np.sum((M @ sol.E.reshape(-1) - y) ** 2) + ridge * np.sum((sol.E - center) ** 2)), rel=1e-9)


def test_identity_jacobian_reduces_to_regmean_with_the_same_ridge() -> None:
    """A_s = I (the layer output itself, euclidean metric), targets Delta_k x_s, weights 1/N_k:
    the minimiser is RegMean's closed form (alpha = 1); with a ridge toward E_c it is
    (sum_k Delta_k G_k + mu E_c)(sum_k G_k + mu I)^(-1)."""
    rng = np.random.default_rng(3)
    r, m1, K = 4, 6, 3
    counts = (9, 5, 12)
    deltas = [rng.normal(size=(r, m1)) for _ in range(K)]
    Xs = [rng.normal(size=(n, m1)) for n in counts]
    X = np.concatenate(Xs)[:, None, :]
    A = np.broadcast_to(np.eye(r)[None, :, None, :], (X.shape[0], r, 1, r)).copy()
    target = np.concatenate([Xk @ Dk.T for Xk, Dk in zip(Xs, deltas)])
    weight = np.concatenate([np.full(n, 1.0 / n) for n in counts])
    samples = OutputSpaceSamples(layer_input=X, jacobian=A, target=target, weight=weight)
    grams = [torch.from_numpy(Xk.T @ Xk / len(Xk)) for Xk in Xs]
    regmean = regmean_solve([torch.from_numpy(D) for D in deltas], grams, [1.0] * K).numpy()
    sol = output_space_solve(samples, ridge=0.0)
    assert sol.residual <= 1e-8
    np.testing.assert_allclose(sol.E, regmean, rtol=1e-7, atol=1e-9)

    mu, center = 0.3, rng.normal(size=(r, m1))
    G = sum(g.numpy() for g in grams)
    expected = (sum(D @ g.numpy() for D, g in zip(deltas, grams)) + mu * center) @ np.linalg.inv(G + mu * np.eye(m1))
    sol = output_space_solve(samples, ridge=mu, center=center)
    assert sol.certified()
    np.testing.assert_allclose(sol.E, expected, rtol=1e-7, atol=1e-9)


def test_ball_constraint_meets_the_kkt_conditions() -> None:
    rng = np.random.default_rng(5)
    samples = _random_samples(rng, N=20, c=4, r=5, m1=6)
    center = rng.normal(size=samples.shape)
    free = output_space_solve(samples, ridge=0.01, center=center)
    distance = float(np.linalg.norm(free.E - center))
    inactive = output_space_solve(samples, ridge=0.01, center=center, radius=2 * distance)
    assert inactive.multiplier == 0.0 and inactive.certified()
    np.testing.assert_allclose(inactive.E, free.E)
    radius = 0.3 * distance
    sol = output_space_solve(samples, ridge=0.01, center=center, radius=radius)
    assert sol.certified(), sol.to_dict()
    assert sol.multiplier > 0
    assert float(np.linalg.norm(sol.E - center)) == pytest.approx(radius, rel=1e-8)
    # the ball's optimum is the unconstrained optimum with ridge mu + nu (dense check), and no
    # point of the ball on random directions does better
    M, y = _dense(samples)
    n = M.shape[1]
    shift = 0.01 + sol.multiplier
    expected = np.linalg.solve(M.T @ M + shift * np.eye(n), M.T @ y + shift * center.reshape(-1))
    np.testing.assert_allclose(sol.E.reshape(-1), expected, rtol=1e-6, atol=1e-9)
    for _ in range(20):
        v = rng.normal(size=samples.shape)
        other = center + radius * rng.uniform() * v / np.linalg.norm(v)
        assert samples.error(other) + 0.01 * np.sum((other - center) ** 2) >= sol.objective - 1e-9


def test_exact_on_a_linear_network() -> None:
    """Two linear layers ``y = W2 (W1 u)``: merging W1, the linearisation is exact, so with
    the fine-tunes' true output changes as targets the solve gives the least-squares output fit
    of the real network (checked by running it)."""
    torch.manual_seed(0)
    d, h, c, N = 5, 4, 3, 30
    base = torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.Linear(h, c)).double()
    fts = []
    for _ in range(2):
        ft = torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.Linear(h, c)).double()
        ft.load_state_dict(base.state_dict())
        with torch.no_grad():
            ft[0].weight.add_(0.3 * torch.randn(h, d, dtype=torch.float64))
            ft[0].bias.add_(0.3 * torch.randn(h, dtype=torch.float64))
        fts.append(ft)
    u = torch.randn(2, N, d, dtype=torch.float64)
    X = torch.cat([torch.cat([u[k], torch.ones(N, 1, dtype=torch.float64)], 1) for k in range(2)])
    W2 = base[1].weight.detach()
    with torch.no_grad():
        target = torch.cat([fts[k](u[k]) - base(u[k]) for k in range(2)])
    samples = OutputSpaceSamples(layer_input=X[:, None, :].numpy(),
                                 jacobian=W2.expand(2 * N, c, h)[:, :, None, :].numpy().copy(),
                                 target=target.numpy(), weight=np.ones(2 * N))
    sol = output_space_solve(samples, ridge=1e-6)
    merged = torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.Linear(h, c)).double()
    merged.load_state_dict(base.state_dict())
    E = torch.from_numpy(sol.E)
    with torch.no_grad():
        merged[0].weight.add_(E[:, :d])
        merged[0].bias.add_(E[:, d])
        true_error = sum(float(((merged(u[k]) - fts[k](u[k])) ** 2).sum()) for k in range(2))
    assert true_error == pytest.approx(sol.fit, rel=1e-9, abs=1e-12)
    # and it beats both fine-tunes and their average on the true error
    for candidate in (fts[0], fts[1]):
        with torch.no_grad():
            err = sum(float(((candidate(u[k]) - fts[k](u[k])) ** 2).sum()) for k in range(2))
        assert true_error <= err + 1e-9


def test_bad_input_is_a_clear_error() -> None:
    rng = np.random.default_rng(0)
    samples = _random_samples(rng)
    with pytest.raises(ValidationError, match="ridge weight"):
        output_space_solve(samples, ridge=-1.0)
    with pytest.raises(ValidationError, match="radius"):
        output_space_solve(samples, ridge=1.0, radius=0.0)
    with pytest.raises(ValidationError, match="centre"):
        output_space_solve(samples, ridge=1.0, center=np.zeros((2, 2)))
    with pytest.raises(ValidationError, match="disagree"):
        OutputSpaceSamples(layer_input=np.zeros((3, 1, 2)), jacobian=np.zeros((4, 2, 1, 2)),
                           target=np.zeros((3, 2)), weight=np.ones(3))


# ---------------------------------------------------------------------------- the merge method
def _mlp_setup(seed: int = 0):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
    base = {k: v.clone() for k, v in net.state_dict().items()}
    fts = [{k: v + 0.3 * torch.randn_like(v) for k, v in base.items()} for _ in range(3)]
    calibration = [[torch.randn(12, 6, dtype=torch.float64)] for _ in range(3)]
    return net, base, fts, calibration


def _output_error(net, sd, fts, calibration) -> float:
    import copy

    model, total = copy.deepcopy(net), 0.0
    model.load_state_dict(sd)
    for ft_sd, batches in zip(fts, calibration):
        ft = copy.deepcopy(net)
        ft.load_state_dict(ft_sd)
        with torch.no_grad():
            total += sum(float(((model(x) - ft(x)) ** 2).sum()) for x in batches)
    return total


def test_merge_method_last_layer_never_worse_than_its_reference() -> None:
    """At the last layer the outputs are linear in its weights, so the linearisation is exact:
    the solve's true output error is at most the reference's (E = 0 is feasible), for RegMean
    and the soup as references; a huge ridge returns the reference itself."""
    from mergeqp.merge import merge_state_dicts

    net, base, fts, calibration = _mlp_setup()
    include = ["2.weight", "2.bias"]
    for reference in ("regmean", "soup"):
        ref = merge_state_dicts(reference, base, fts, include=include, progress=False,
                                **({"model": net, "calibration": calibration, "alpha": 0.9}
                                   if reference == "regmean" else {}))
        got = merge_state_dicts("output_space", base, fts, include=include, progress=False, model=net,
                                calibration=calibration, reference=reference, ridge=1e-4)
        assert _output_error(net, got, fts, calibration) <= _output_error(net, ref, fts, calibration) * (1 - 1e-3)
        stiff = merge_state_dicts("output_space", base, fts, include=include, progress=False, model=net,
                                  calibration=calibration, reference=reference, ridge=1e9)
        for key in include:
            torch.testing.assert_close(stiff[key], ref[key], rtol=1e-6, atol=1e-7)
        assert torch.equal(got["0.weight"], base["0.weight"])  # unselected: the base's


def test_merge_method_all_layers_and_radius() -> None:
    """Every linear layer solved (hidden layer linearised at the reference): a radius bounds the
    change of each layer from the reference."""
    from mergeqp.merge import merge_state_dicts

    net, base, fts, calibration = _mlp_setup(1)
    ref = merge_state_dicts("regmean", base, fts, progress=False, model=net, calibration=calibration)
    got = merge_state_dicts("output_space", base, fts, progress=False, model=net, calibration=calibration,
                            ridge=0.01, radius=0.05)
    for layer in ("0", "2"):
        change = torch.cat([got[f"{layer}.weight"] - ref[f"{layer}.weight"],
                            (got[f"{layer}.bias"] - ref[f"{layer}.bias"])[:, None]], dim=1)
        assert float(change.norm()) <= 0.05 * (1 + 1e-6)
        assert float(change.norm()) > 0.01


def test_merge_method_errors_name_what_is_missing() -> None:
    from mergeqp.errors import ConfigError
    from mergeqp.merge import merge_state_dicts

    net, base, fts, calibration = _mlp_setup()
    with pytest.raises(ConfigError, match="needs model="):
        merge_state_dicts("output_space", base, fts, calibration=calibration)
    with pytest.raises(ConfigError, match="'reference'"):
        merge_state_dicts("output_space", base, fts, model=net, calibration=calibration, reference="ties")


# ------------------------------------------------------------ the Kronecker preconditioner
def test_kronecker_preconditioner_is_the_rotated_diagonal_of_the_normal_operator() -> None:
    """With one position per sample the rotated diagonal is exactly diag((U x V)' N (U x V)) of the
    dense normal matrix, and its trace is N's (the ridge unit does not depend on the basis)."""
    from mergeqp.merge.output_space import preconditioner_of

    rng = np.random.default_rng(5)
    samples = _random_samples(rng, N=9, c=3, T=1, r=4, m1=5)
    M, _ = _dense(samples)
    Nmat = M.T @ M
    P = preconditioner_of(samples)
    W = np.kron(P.U, P.V)  # row-major vec(E): E = U Y V' <=> vec(E) = (U x V) vec(Y)
    np.testing.assert_allclose(P.diagonal.reshape(-1), np.diag(W.T @ Nmat @ W), rtol=1e-10,
                               atol=1e-12 * np.abs(Nmat).max())
    assert P.diagonal.sum() == pytest.approx(np.trace(Nmat), rel=1e-12)
    R = rng.normal(size=samples.shape)
    # solve() inverts (U x V) diag(s + shift) (U x V)'
    Minv = W @ np.diag(1.0 / (P.diagonal.reshape(-1) + 0.3)) @ W.T
    np.testing.assert_allclose(P.solve(R, 0.3).reshape(-1), Minv @ R.reshape(-1), rtol=1e-10)


def test_kronecker_preconditioner_makes_a_kronecker_operator_one_cg_step() -> None:
    """Every sample with the same Jacobian: N = (A'A) x (sum_s w_s x_s x_s') is a Kronecker
    product, the preconditioner is N itself and CG stops after one step (the plain diagonal needs
    many); the answer is the dense closed form either way."""
    from mergeqp.merge import output_space as OS

    rng = np.random.default_rng(11)
    N, c, r, m1 = 40, 6, 5, 7
    A = np.broadcast_to(rng.normal(size=(1, c, 1, r)) * np.array([1, 10, 100, 0.1, 3.0])[None, None, None, :],
                        (N, c, 1, r)).copy()
    X = rng.normal(size=(N, 1, m1)) * np.geomspace(1, 1e3, m1)
    samples = OutputSpaceSamples(layer_input=X, jacobian=A, target=rng.normal(size=(N, c)),
                                 weight=rng.uniform(0.5, 2.0, size=N))
    M, y = _dense(samples)
    ridge = 1e-3 * samples.ridge_scale()
    expected = np.linalg.solve(M.T @ M + ridge * np.eye(r * m1), M.T @ y)
    sol = output_space_solve(samples, ridge=ridge)
    assert sol.certified() and sol.iterations <= 2
    np.testing.assert_allclose(sol.E.reshape(-1), expected, rtol=1e-6, atol=1e-9 * np.abs(expected).max())
    rhs = samples.adjoint(samples.target)
    _, jacobi = OS._cg(samples, ridge, rhs, np.zeros(samples.shape), OS.KroneckerPreconditioner(samples.normal_diagonal()),
                       1e-10, 5000)
    assert jacobi > 10 * sol.iterations


@pytest.mark.parametrize("cap, rotated_sides", [(4, "U"), (3, "none"), (5, "both")])
def test_a_side_longer_than_the_cap_is_not_rotated(monkeypatch, cap, rotated_sides) -> None:
    """(stop 53 review) r or m1 above KRONECKER_MAX_SIDE: that side's factor is neither formed nor
    decomposed (identity there); the diagonal is still exactly diag((U x V)' N (U x V)) at one
    position per sample, both sides over the cap give the plain diagonal, and the solve is the
    closed form either way."""
    from mergeqp.merge import output_space as OS

    monkeypatch.setattr(OS, "KRONECKER_MAX_SIDE", cap)
    rng = np.random.default_rng(2)
    samples = _random_samples(rng, N=8, c=3, T=1, r=4, m1=5)
    P = OS.preconditioner_of(samples)
    assert (P.U is not None, P.V is not None) == {"U": (True, False), "none": (False, False),
                                                  "both": (True, True)}[rotated_sides]
    M, y = _dense(samples)
    W = np.kron(np.eye(4) if P.U is None else P.U, np.eye(5) if P.V is None else P.V)
    np.testing.assert_allclose(P.diagonal.reshape(-1), np.diag(W.T @ (M.T @ M) @ W), rtol=1e-10,
                               atol=1e-12 * np.abs(M.T @ M).max())
    if rotated_sides == "none":
        np.testing.assert_allclose(P.diagonal, samples.normal_diagonal(), rtol=1e-12)
    sol = output_space_solve(samples, ridge=0.1)
    expected = np.linalg.solve(M.T @ M + 0.1 * np.eye(20), M.T @ y)
    assert sol.certified()
    np.testing.assert_allclose(sol.E.reshape(-1), expected, rtol=1e-6, atol=1e-9 * np.abs(expected).max())
