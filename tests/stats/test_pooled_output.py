"""``output.pool: mean`` (:class:`mergeqp.lm.OutputSpec` ``pool``): one vector per prompt, the mean
of its real tokens' outputs, as a sentence encoder's mean-pooled embedding. The first-order
statistics are checked against a central finite-difference Jacobian of the pooled output of a
tiny float64 Llama with respect to the merge coefficients (to 1e-3: Llama's RMSNorm computes in
float32 even in a float64 model, which bounds how small the step can be)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from mergeqp.errors import ValidationError  # noqa: E402
from mergeqp.lm import OutputSpec, mean_pool, teacher_forced_targets  # noqa: E402
from mergeqp.merge.firstorder import SiteAtoms, TaskTargets, collect_first_order  # noqa: E402

FIELD = "last_hidden_state"


@pytest.fixture(scope="module")
def llama(tiny_hf, tmp_path_factory):
    from mergeqp.io.calibration import load_tokenizer, read_prompts, tokenize_batches
    from mergeqp.merge.sites import match_sites, model_sites
    from mergeqp.stats.parametrisation import as_parametrisation

    fam = tiny_hf.make_family(tmp_path_factory.mktemp("pool") / "llama", "llama", K=2, n_prompts=6)
    cls = tiny_hf.auto_class("llama")
    model = cls.from_pretrained(str(fam.base), dtype=torch.float64).eval().model  # the backbone
    fts = [cls.from_pretrained(str(p), dtype=torch.float64).eval().model for p in fam.finetuned]
    batches = tokenize_batches(load_tokenizer(fam.base), read_prompts(fam.prompts[0])[:5], 10, 3)
    assert any(b.mask is not None and not bool(b.mask.all()) for b in batches)  # padding is exercised
    site = match_sites(model_sites(model), [tiny_hf.MLP_LAYER["llama"].removeprefix("model.")])[0]
    weight = dict(model.named_modules())[site.name].weight.detach()
    deltas = torch.stack([dict(ft.named_modules())[site.name].weight.detach() - weight for ft in fts])
    return model, fts, batches, site, deltas, as_parametrisation("scalar")


def _pooled(model, batches):
    spec = OutputSpec(field=FIELD, pool="mean")
    out = []
    with torch.no_grad():
        for b in batches:
            raw = spec.raw(model(**b.inputs))
            out.append(mean_pool(raw * b.mask.unsqueeze(-1).to(raw.dtype), b.mask))
    return torch.cat(out)


def test_pooled_statistics_equal_a_finite_difference_reference(llama):
    model, fts, batches, site, deltas, scalar = llama
    spec = OutputSpec(field=FIELD, pool="mean")
    tasks = [TaskTargets(f"t{i}", 1.0, teacher_forced_targets(ft, batches, spec, "cpu")) for i, ft in enumerate(fts)]
    assert all(tb.target.dim() == 2 for t in tasks for tb in t.batches)  # one vector per prompt
    got = collect_first_order(model, [SiteAtoms(site, scalar, deltas)], tasks, spec)

    weight = dict(model.named_modules())[site.name].weight
    w0 = weight.detach().clone()
    eps = 1e-2
    cols = []
    for k in range(deltas.shape[0]):
        step = eps * deltas[k]
        with torch.no_grad():
            weight.copy_(w0 + step)
            plus = _pooled(model, batches)
            weight.copy_(w0 - step)
            minus = _pooled(model, batches)
            weight.copy_(w0)
        cols.append(((plus - minus) / (2 * eps)).reshape(-1))
    A = torch.stack(cols, dim=1).numpy()  # (prompts x H, K)
    here = _pooled(model, batches).reshape(-1).numpy()
    for ti, ft in enumerate(fts):
        b = here - _pooled(ft, batches).reshape(-1).numpy()
        # J(d) = sum over prompts of ||A d + b||^2: H = 2 A'A, g = 2 A'b, c = b'b
        np.testing.assert_allclose(got.H[ti], 2 * A.T @ A, rtol=1e-3, atol=1e-6 * np.abs(got.H[ti]).max())
        np.testing.assert_allclose(got.g[ti], 2 * A.T @ b, rtol=1e-3, atol=1e-6 * np.abs(got.g[ti]).max())
        assert got.c[ti] == pytest.approx(b @ b, rel=1e-10)
        assert got.counts[ti] == sum(int(tb.batch.inputs["input_ids"].shape[0]) for tb in tasks[ti].batches)


def test_mean_pool_of_masked_positions():
    out = torch.arange(2 * 3 * 2, dtype=torch.float64).reshape(2, 3, 2)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    got = mean_pool(out * mask.unsqueeze(-1), mask)
    assert torch.equal(got, torch.tensor([[1.0, 2.0], [6.0, 7.0]]))
    assert torch.equal(mean_pool(out, None), out.mean(dim=1))
    with pytest.raises(ValidationError, match="per-position output"):
        mean_pool(out[:, 0], mask)


def test_pool_values_are_checked():
    with pytest.raises(ValidationError, match="output pool 'max'"):
        OutputSpec(pool="max")
    with pytest.raises(ValidationError, match="needs metric: euclidean"):
        OutputSpec(pool="mean", metric="kl", restrict="topk", k=2)
    assert OutputSpec(pool="mean").fold_obstacle() is not None  # a pooled output is never folded
