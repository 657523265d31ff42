"""Fisher and RegMean against hand-derived closed forms on linear models.

RegMean on one linear layer is exact least squares of the layer outputs (alpha = 1), and the
shrunk normal equations otherwise. The Fisher of a linear-Gaussian model ``y ~ N(W x + b, I)`` is
``F_W[i, j] = mean_n (r_ni x_nj)^2`` and ``F_b[i] = mean_n r_ni^2`` with residuals
``r_n = y_n - W x_n - b``; of a softmax classifier, ``(e_y - p)_i x_j`` squared.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeqp.errors import ConfigError, ValidationError
from mergeqp.merge import compute_fisher, compute_grams, merge_state_dicts

M_IN, R_OUT = 5, 3


def linear_family(K=2, seed=0, bias=True):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(M_IN, R_OUT, bias=bias)).double()
    g = torch.Generator().manual_seed(seed + 1)
    states = [{k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in model.state_dict().items()}
              for _ in range(K)]
    return model, states


def inputs_for(K, sizes, seed=0, rank=None):
    g = torch.Generator().manual_seed(seed + 100)
    out = []
    for k in range(K):
        X = torch.randn(sizes[k], M_IN, generator=g, dtype=torch.float64) + k
        if rank is not None:  # confine the inputs to a subspace
            X = X[:, :rank] @ torch.randn(rank, M_IN, generator=g, dtype=torch.float64)
        out.append(X)
    return out


# ---------------------------------------------------------------------------------------- RegMean
@pytest.mark.parametrize("sizes", [(40, 40), (25, 60)])
def test_regmean_alpha_1_is_least_squares_of_layer_outputs(sizes):
    model, states = linear_family()
    Xs = inputs_for(2, sizes)
    merged = merge_state_dicts("regmean", None, states, model=model, alpha=1.0, progress=False,
                               calibration=[[X[:10], X[10:]] for X in Xs])  # two batches each
    # hand-derived: min sum_k (1/N_k) || [X_k 1] [W b]' - Y_k ||^2 by weighted lstsq
    rows, targets = [], []
    for X, s in zip(Xs, states):
        Y = X @ s["0.weight"].T + s["0.bias"]
        scale = 1.0 / np.sqrt(len(X))
        rows.append(scale * np.hstack([X.numpy(), np.ones((len(X), 1))]))
        targets.append(scale * Y.numpy())
    sol, *_ = np.linalg.lstsq(np.vstack(rows), np.vstack(targets), rcond=None)
    assert np.allclose(merged["0.weight"].numpy(), sol[:M_IN].T, atol=1e-10)
    assert np.allclose(merged["0.bias"].numpy(), sol[M_IN], atol=1e-10)


@settings(max_examples=15, deadline=None)
@given(alpha=st.floats(0.0, 1.0), w1=st.floats(0.2, 3.0), seed=st.integers(0, 1000))
def test_regmean_shrunk_closed_form(alpha, w1, seed):
    model, states = linear_family(K=2, seed=seed)
    Xs = inputs_for(2, (30, 30), seed=seed)
    merged = merge_state_dicts("regmean", None, states, model=model, alpha=alpha, weights=[1.0, w1],
                               calibration=[[X] for X in Xs], progress=False)
    A, B = 0, 0
    for c, X, s in zip([1.0, w1], Xs, states):
        Xa = np.hstack([X.numpy(), np.ones((len(X), 1))])
        G = Xa.T @ Xa / len(X)
        G = alpha * G + (1 - alpha) * np.diag(np.diag(G))
        Wa = np.hstack([s["0.weight"].numpy(), s["0.bias"].numpy()[:, None]])
        A, B = A + c * G, B + c * Wa @ G
    W = B @ np.linalg.inv(A)
    assert np.allclose(merged["0.weight"].numpy(), W[:, :M_IN], atol=1e-9)
    assert np.allclose(merged["0.bias"].numpy(), W[:, M_IN], atol=1e-9)


def test_regmean_bias_average_and_precomputed_grams():
    model, states = linear_family()
    Xs = inputs_for(2, (30, 30))
    merged = merge_state_dicts("regmean", None, states, model=model, alpha=0.7, bias="average",
                               calibration=[[X] for X in Xs], progress=False)
    A, B = 0, 0
    for X, s in zip(Xs, states):
        G = X.numpy().T @ X.numpy() / len(X)
        G = 0.7 * G + 0.3 * np.diag(np.diag(G))
        A, B = A + G, B + s["0.weight"].numpy() @ G
    assert np.allclose(merged["0.weight"].numpy(), B @ np.linalg.inv(A), atol=1e-10)
    assert torch.allclose(merged["0.bias"], (states[0]["0.bias"] + states[1]["0.bias"]) / 2)
    # the same from precomputed (augmented) Gram matrices, without running the model
    grams = [compute_grams(model, [X], state_dict=s) for X, s in zip(Xs, states)]
    assert grams[0]["0"].shape == (M_IN + 1, M_IN + 1)
    again = merge_state_dicts("regmean", None, states, grams=grams, alpha=0.7, bias="average", progress=False)
    for k in merged:
        assert torch.allclose(merged[k], again[k], atol=1e-12)


def test_regmean_singular_gram_gives_least_squares_closest_to_average():
    model, states = linear_family(bias=False)
    Xs = inputs_for(2, (30, 30), rank=2)  # inputs span a 2-D subspace of R^5
    merged = merge_state_dicts("regmean", None, states, model=model, alpha=1.0,
                               calibration=[[X] for X in Xs], progress=False)
    W = merged["0.weight"].numpy()
    X = np.vstack([X.numpy() for X in Xs])
    Y = np.vstack([X.numpy() @ s["0.weight"].numpy().T for X, s in zip(Xs, states)])
    best, *_ = np.linalg.lstsq(X, Y, rcond=None)
    assert np.isclose(((X @ W.T - Y) ** 2).sum(), ((X @ best - Y) ** 2).sum(), rtol=1e-9)
    W_bar = (states[0]["0.weight"] + states[1]["0.weight"]).numpy() / 2
    sv, vt = np.linalg.svd(X)[1:]
    rank = int((sv > 1e-9 * sv[0]).sum())
    assert rank < M_IN
    null = vt[rank:]  # directions the inputs never take
    assert np.allclose((W - W_bar) @ null.T, 0, atol=1e-9)


def test_regmean_other_tensors_are_averaged_and_errors():
    model = torch.nn.Sequential(torch.nn.Linear(M_IN, R_OUT), torch.nn.LayerNorm(R_OUT)).double()
    g = torch.Generator().manual_seed(0)
    states = [{k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in model.state_dict().items()}
              for _ in range(2)]
    X = torch.randn(20, M_IN, dtype=torch.float64)
    merged = merge_state_dicts("regmean", None, states, model=model, calibration=[[X], [X]], progress=False)
    assert torch.allclose(merged["1.weight"], (states[0]["1.weight"] + states[1]["1.weight"]) / 2)
    with pytest.raises(ConfigError, match="calibration"):
        merge_state_dicts("regmean", None, states, model=model, calibration=[[X]], progress=False)
    with pytest.raises(ConfigError, match="model= and calibration="):
        merge_state_dicts("regmean", None, states, progress=False)
    bad = [{"0": torch.eye(M_IN)}] * 2  # the layer has a bias: (m+1, m+1) expected
    with pytest.raises(ValidationError, match="'0'.*expected \\(6, 6\\)"):
        merge_state_dicts("regmean", None, states, grams=bad, include=["0.*"], progress=False)


# ----------------------------------------------------------------------------------------- Fisher
def gaussian_ll(out, y):
    return -0.5 * ((out - y) ** 2).sum()


def gaussian_data(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, M_IN, generator=g, dtype=torch.float64)
    Y = torch.randn(n, R_OUT, generator=g, dtype=torch.float64)
    return X, Y


@pytest.mark.parametrize("per_example", ["vmap", "loop"])
def test_fisher_linear_gaussian_closed_form(per_example):
    model, states = linear_family(K=1)
    s = states[0]
    X, Y = gaussian_data()
    batches = [(X[:7], Y[:7]), (X[7:], Y[7:])]
    F = compute_fisher(model, batches, state_dict=s, log_likelihood=gaussian_ll, per_example=per_example)
    R = (Y - X @ s["0.weight"].T - s["0.bias"]).numpy()  # (n, r) residuals
    Xn = X.numpy()
    F_W = np.mean((R[:, :, None] * Xn[:, None, :]) ** 2, axis=0)
    F_b = np.mean(R ** 2, axis=0)
    assert np.allclose(F["0.weight"].numpy(), F_W, rtol=1e-10, atol=1e-12)
    assert np.allclose(F["0.bias"].numpy(), F_b, rtol=1e-10, atol=1e-12)


def test_fisher_batch_estimate_differs_and_matches_its_own_closed_form():
    model, states = linear_family(K=1)
    s = states[0]
    X, Y = gaussian_data(n=24)
    batches = [(X[i:i + 6], Y[i:i + 6]) for i in range(0, 24, 6)]
    F_batch = compute_fisher(model, batches, state_dict=s, log_likelihood=gaussian_ll, estimator="batch")
    R = (Y - X @ s["0.weight"].T - s["0.bias"]).numpy()
    Xn = X.numpy()
    expected = np.mean([(R[i:i + 6].T @ Xn[i:i + 6]) ** 2 for i in range(0, 24, 6)], axis=0)
    assert np.allclose(F_batch["0.weight"].numpy(), expected, rtol=1e-10)
    F_ex = compute_fisher(model, batches, state_dict=s, log_likelihood=gaussian_ll)
    ratio = F_batch["0.weight"] / (6 * F_ex["0.weight"])
    assert float((ratio - 1).abs().max()) > 0.1  # cross terms: not a rescaled per-example Fisher
    # with one example per batch the two estimates agree
    singles = [(X[i:i + 1], Y[i:i + 1]) for i in range(24)]
    F_single = compute_fisher(model, singles, state_dict=s, log_likelihood=gaussian_ll, estimator="batch")
    assert torch.allclose(F_single["0.weight"], F_ex["0.weight"], rtol=1e-10)


def test_fisher_softmax_classifier_closed_form_and_predicted_labels():
    model, states = linear_family(K=1)
    s = states[0]
    X, _ = gaussian_data(n=16)
    labels = torch.arange(16) % R_OUT
    F = compute_fisher(model, [(X, labels)], state_dict=s)
    P = torch.softmax(X @ s["0.weight"].T + s["0.bias"], dim=1).numpy()
    E = np.eye(R_OUT)[labels.numpy()] - P
    F_W = np.mean((E[:, :, None] * X.numpy()[:, None, :]) ** 2, axis=0)
    assert np.allclose(F["0.weight"].numpy(), F_W, rtol=1e-10, atol=1e-13)
    # no targets: the model's own argmax predictions are the labels
    F_pred = compute_fisher(model, [X], state_dict=s)
    pred = P.argmax(axis=1)
    E = np.eye(R_OUT)[pred] - P
    assert np.allclose(F_pred["0.bias"].numpy(), np.mean(E ** 2, axis=0), rtol=1e-10)


def test_fisher_merge_formula_and_precomputed():
    model, states = linear_family(K=3)
    X, Y = gaussian_data()
    cal = [[(X[:12], Y[:12])], [(X[12:], Y[12:])], [(X, Y)]]
    merged = merge_state_dicts("fisher", None, states, model=model, calibration=cal,
                               log_likelihood=gaussian_ll, weights=[1.0, 2.0, 0.5], progress=False)
    Fs = [compute_fisher(model, c, state_dict=s, log_likelihood=gaussian_ll) for c, s in zip(cal, states)]
    for name in ("0.weight", "0.bias"):
        num = sum(c * (F[name] + 1e-6) * s[name] for c, F, s in zip([1.0, 2.0, 0.5], Fs, states))
        den = sum(c * (F[name] + 1e-6) for c, F in zip([1.0, 2.0, 0.5], Fs))
        assert torch.allclose(merged[name], num / den, rtol=1e-12)
    # precomputed Fishers give the same; a zero Fisher with no floor falls back to the average
    again = merge_state_dicts("fisher", None, states, fishers=Fs, weights=[1.0, 2.0, 0.5], progress=False)
    assert all(torch.allclose(merged[k], again[k], rtol=1e-12) for k in merged)
    zeros = [{k: torch.zeros_like(v) for k, v in F.items()} for F in Fs]
    avg = merge_state_dicts("fisher", None, states, fishers=zeros, fisher_floor=0.0, progress=False)
    assert torch.allclose(avg["0.bias"], sum(s["0.bias"] for s in states) / 3)
    with pytest.raises(ValidationError, match="'0.bias'"):
        merge_state_dicts("fisher", None, states, fishers=[Fs[0], Fs[1], {"0.weight": Fs[2]["0.weight"]}],
                          progress=False)


def test_regmean_on_gpt2_conv1d_is_least_squares_of_layer_outputs():
    """Hugging Face Conv1D stores its weight transposed (in x out): the solve must follow."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    from torch.func import functional_call
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=32,
                                       bos_token_id=0, eos_token_id=0)).eval()
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    states = [{k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v for k, v in base.items()}
              for _ in range(2)]
    for s in states:
        s["lm_head.weight"] = s["transformer.wte.weight"]  # tied
    ids = [torch.randint(0, 50, (2, 6)), torch.randint(0, 50, (3, 5))]
    layer = "transformer.h.1.mlp.c_fc"
    merged = merge_state_dicts("regmean", base, states, model=model, alpha=1.0, include=[layer],
                               calibration=[[{"input_ids": i}] for i in ids], progress=False)
    seen = []
    hook = model.get_submodule(layer).register_forward_pre_hook(
        lambda mod, args: seen.append(args[0].detach().reshape(-1, 16).double()))
    for s, i in zip(states, ids):
        with torch.no_grad():
            functional_call(model, {k: v for k, v in s.items() if k != "lm_head.weight"}, (i,))
    hook.remove()
    rows, targets = [], []
    for X, s in zip(seen, states):
        Xa = np.hstack([X.numpy(), np.ones((len(X), 1))]) / np.sqrt(len(X))
        W = np.vstack([s[f"{layer}.weight"].double().numpy(), s[f"{layer}.bias"].double().numpy()[None]])
        rows.append(Xa)
        targets.append(Xa @ W)
    best, *_ = np.linalg.lstsq(np.vstack(rows), np.vstack(targets), rcond=None)
    assert merged[f"{layer}.weight"].shape == (16, 64)
    assert np.allclose(merged[f"{layer}.weight"].double().numpy(), best[:16], atol=1e-5)
    assert np.allclose(merged[f"{layer}.bias"].double().numpy(), best[16], atol=1e-5)
