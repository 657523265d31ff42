"""Linearisation through nonlinear models: finite differences and brute-force Jacobians."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from mergeqp.stats import apply_merge, collect_statistics, random_basis
from tests.stats.tiny_models import TinyTransformer


def _update(stats, d, spec):
    W, b = stats.merged_weights(d, spec)
    merged = np.concatenate([W, b[:, None]], axis=1) if b is not None else W
    return merged - stats.base_weight


@pytest.fixture(scope="module")
def mnist_case(finetuned_copies, mnist_mlp):
    base = mnist_mlp(seed=0)
    fts = finetuned_copies(base, 5, scale=0.02, layer="2", seed=1)
    gen = torch.Generator().manual_seed(2)
    cal = [torch.rand(100, 784, generator=gen, dtype=torch.float64) for _ in range(5)]
    start = time.perf_counter()
    stats = collect_statistics(base, fts, "2", cal, keep_samples=True, batch_size=100,
                               progress=False)
    print(f"\nMNIST-shape collection, 500 samples, keep_samples: {time.perf_counter() - start:.2f} s")
    return base, fts, cal, stats


def test_mnist_shape_statistics(true_error, mnist_case):
    base, fts, cal, stats = mnist_case
    assert (stats.K, stats.r, stats.m1, stats.c) == (5, 128, 257, 10)
    assert stats.n_samples == 500 and not stats.jacobian_shared  # ReLU: L_j varies
    X = torch.cat(cal)
    with torch.no_grad():
        expected = torch.cat([base(x) - ft(x) for ft, x in zip(fts, cal)]).numpy()
    np.testing.assert_allclose(stats.residuals(), expected, rtol=1e-12, atol=1e-12)
    assert stats.problem("rows").c == pytest.approx(true_error(base, fts, cal), rel=1e-12)
    streamed = stats.problem("rows", source="collected")
    rebuilt = stats.problem("rows", source="samples")
    np.testing.assert_allclose(streamed.H, rebuilt.H, rtol=1e-9, atol=1e-9 * np.abs(rebuilt.H).max())
    np.testing.assert_allclose(streamed.g, rebuilt.g, rtol=1e-9, atol=1e-9 * np.abs(rebuilt.g).max())
    assert X.shape[0] == 500


@pytest.mark.parametrize("spec", ["rows", "scalar", "columns", "svd:16"])
def test_mnist_linearised_outputs_match_finite_differences(mnist_case, spec):
    base, fts, cal, stats = mnist_case
    param = stats.parametrisation(spec)
    d = np.random.default_rng(3).normal(size=(5, stats.n_atoms(param)))
    linear = stats.linearised_change(d, param)
    X = torch.cat(cal)
    eps = 1e-6
    with torch.no_grad():
        plus = apply_merge(base, fts, "2", eps * d, param)(X)
        minus = apply_merge(base, fts, "2", -eps * d, param)(X)
    fd = ((plus - minus) / (2 * eps)).numpy()
    scale = np.abs(fd).max()
    assert scale > 1e-3
    np.testing.assert_allclose(linear, fd, rtol=1e-6, atol=1e-7 * scale)


def test_mnist_linearisation_error_is_superlinear(mnist_case):
    """Finite steps cross ReLU kinks: the error of the first-order model must still shrink
    faster than the step (a wrong Jacobian would leave an error proportional to it)."""
    base, fts, cal, stats = mnist_case
    d = np.full((5, stats.r), 0.2)
    X = torch.cat(cal)
    with torch.no_grad():
        h0 = base(X).numpy()
    errors = []
    for eps in (1.0, 0.25):
        with torch.no_grad():
            h = apply_merge(base, fts, "2", eps * d)(X).numpy()
        errors.append(np.linalg.norm(h - h0 - eps * stats.linearised_change(d)))
    assert errors[0] > 0
    assert errors[1] < errors[0] / 5  # first-order error would give exactly / 4


@pytest.mark.parametrize("layer", ["v", "fc1"])
@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_attention_model_matches_brute_force_jacobian(finetuned_copies, weight_jacobian_change, layer, mode):
    base = TinyTransformer(seed=4).double()
    fts = finetuned_copies(base, 2, scale=0.1, layer=layer, seed=5)
    gen = torch.Generator().manual_seed(6)
    cal = [torch.randn(3, 4, 5, generator=gen, dtype=torch.float64) for _ in range(2)]
    stats = collect_statistics(base, fts, layer, cal, keep_samples=True, jacobian_mode=mode,
                               progress=False)
    assert stats.positions == 4 and stats.c == 4 * 3
    rng = np.random.default_rng(7)
    for spec in ["rows", "columns", random_basis(stats.r, 3, seed=8)]:
        d = rng.normal(size=(2, stats.n_atoms(spec)))
        upd = _update(stats, d, spec)
        brute = np.concatenate([weight_jacobian_change(base, layer, x, upd) for x in cal])
        np.testing.assert_allclose(stats.linearised_change(d, spec), brute, rtol=1e-9,
                                   atol=1e-11 * np.abs(brute).max())
    # a perturbation at one position changes the outputs at the others (attention)
    J = stats.samples[0].jacobian  # (B, c = T*3, T, r)
    if layer == "v":
        assert np.abs(J[:, 0:3, 3, :]).max() > 1e-4


def test_loop_fallback_and_modes_agree(finetuned_copies):
    base = TinyTransformer(seed=9).double()
    fts = finetuned_copies(base, 2, scale=0.1, layer="fc1", seed=10)
    cal = [torch.randn(2, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
           for k in range(2)]
    runs = [collect_statistics(base, fts, "fc1", cal, keep_samples=True, progress=False, **kw)
            for kw in ({"jacobian_mode": "reverse"}, {"jacobian_mode": "forward"},
                       {"vectorize": False})]
    ref = np.concatenate([c.jacobian for c in runs[0].samples])
    for other in runs[1:]:
        np.testing.assert_allclose(np.concatenate([c.jacobian for c in other.samples]), ref,
                                   rtol=1e-12, atol=1e-13)


def test_task_specific_output_fn_is_exact_for_linear_heads(finetuned_copies, linear_net):
    body = linear_net((5, 4, 3), seed=11)
    fts = finetuned_copies(body, 2, scale=0.3, seed=12)
    torch.manual_seed(13)
    heads = [torch.nn.Linear(3, 2).double(), torch.nn.Linear(3, 2).double()]

    def output_fn(out, task):
        return heads[task](out)

    cal = [torch.randn(6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
           for k in range(2)]
    stats = collect_statistics(body, fts, "0", cal, output_fn=output_fn, progress=False)
    problem = stats.problem("rows")
    d = np.random.default_rng(14).normal(size=problem.shape)
    merged = apply_merge(body, fts, "0", d)
    with torch.no_grad():
        truth = sum(float(((heads[t](merged(x)) - heads[t](fts[t](x))) ** 2).sum())
                    for t, x in enumerate(cal))
    assert problem.objective(d) == pytest.approx(truth, rel=1e-10)


def test_label_targets_one_hot(finetuned_copies, linear_net):
    base = linear_net((5, 4, 3), seed=15)
    fts = finetuned_copies(base, 2, scale=0.3, seed=16)
    gen = torch.Generator().manual_seed(17)
    data = [(torch.randn(8, 5, generator=gen, dtype=torch.float64),
             torch.randint(0, 3, (8,), generator=gen)) for _ in range(2)]
    stats = collect_statistics(base, fts, "1", [[b] for b in data], targets="labels",
                               progress=False)
    problem = stats.problem("rows")
    d = np.random.default_rng(18).normal(size=problem.shape)
    merged = apply_merge(base, fts, "1", d)
    with torch.no_grad():
        truth = sum(float(((merged(x) - torch.nn.functional.one_hot(y, 3)) ** 2).sum())
                    for x, y in data)
    assert problem.objective(d) == pytest.approx(truth, rel=1e-10)
    assert stats.metadata["targets"] == "labels"


@pytest.mark.slow
def test_hugging_face_llama_with_dict_batches(finetuned_copies, weight_jacobian_change):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(19)
    base = transformers.LlamaForCausalLM(cfg).double().eval()
    layer = "model.layers.1.mlp.down_proj"
    fts = finetuned_copies(base, 2, scale=0.05, layer=layer, seed=20)
    gen = torch.Generator().manual_seed(21)
    batches = [{"input_ids": torch.randint(0, 40, (2, 5), generator=gen),
                "attention_mask": torch.ones(2, 5, dtype=torch.long)} for _ in range(2)]

    def last_logits(out):
        return out.logits[:, -1, :]

    stats = collect_statistics(base, fts, layer, [[b] for b in batches], output_fn=last_logits,
                               keep_samples=True, progress=False)
    assert stats.positions == 5 and stats.c == 40 and not stats.has_bias
    d = np.random.default_rng(22).normal(size=(2, stats.r))
    upd = _update(stats, d, "rows")
    brute = np.concatenate([weight_jacobian_change(base, layer, b, upd, output_fn=last_logits)
                            for b in batches])
    np.testing.assert_allclose(stats.linearised_change(d), brute, rtol=1e-8,
                               atol=1e-10 * np.abs(brute).max())


def test_forward_mode_overflow_in_half_precision_falls_back_to_reverse_mode():
    """Stop 74 review: PyTorch's JVP of a float16 LayerNorm whose input's standard deviation is below
    ~0.05 overflows where reverse mode stays finite; the default (forward) mode then raised "NaN/inf in
    the Jacobian" (a BadDataError, exit 3, blaming finite data). Now reverse mode, with a warning."""
    import copy

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 8))
    with torch.no_grad():
        base[0].weight.mul_(0.02)
        base[0].bias.mul_(0.02)
    fts = [copy.deepcopy(base) for _ in range(2)]
    for f in fts:
        with torch.no_grad():
            f[0].weight.add_(0.002 * torch.randn_like(f[0].weight))
    base, fts = base.half(), [f.half() for f in fts]
    cal = [torch.randn(6, 5).half() for _ in range(2)]
    with pytest.warns(RuntimeWarning, match="forward-mode derivatives were not finite"):
        forward = collect_statistics(base, fts, "0", cal, progress=False, jacobian_mode="forward").problem("rows")
    reverse = collect_statistics(base, fts, "0", cal, progress=False, jacobian_mode="reverse").problem("rows")
    assert np.all(np.isfinite(forward.H)) and np.array_equal(forward.H, reverse.H)
    np.testing.assert_array_equal(forward.g, reverse.g)
