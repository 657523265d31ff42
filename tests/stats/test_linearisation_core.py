"""The linearisation core (mergeqp.stats.linearise, .gauss_newton, .hooks) that every producer of
statistics uses (the package-wide import graph: tests/architecture/test_imports.py)."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from mergeqp.errors import ValidationError
from mergeqp.stats.gauss_newton import GaussNewtonSums
from mergeqp.stats.hooks import hooked_layers
from mergeqp.stats.linearise import (
    OutputDerivatives,
    choose_mode,
    perturbed_output,
    run_recorded,
)
from tests.stats.tiny_models import LinearSequence, TinyTransformer



def _derivatives(model, layer, x, **kwargs):
    """Hook ``layer``, run the base pass and return (derivatives, hook, base output) inside the
    hooked block (a generator, so the hook stays registered while the test uses it)."""
    with hooked_layers(model, [getattr(model, layer)]) as (hook,):
        def call():
            return model(x)

        def compared(out):
            return out.reshape(out.shape[0], -1)

        h = compared(run_recorded(call, [hook], [f"layer {layer!r}"], "test"))
        zero = torch.zeros_like(hook.layer_output)
        yield OutputDerivatives(perturbed_output(hook, call, compared), zero, int(h.shape[1]), **kwargs), hook, h


@pytest.mark.parametrize("make, layer", [(lambda: TinyTransformer().double(), "fc1"),
                                         (lambda: LinearSequence().double(), "merge")])
def test_forward_reverse_and_looped_derivatives_agree(seeded, make, layer):
    model = make()
    x = torch.randn(4, 3, model.embed.in_features, generator=seeded(1), dtype=torch.float64)
    for deriv, hook, h in _derivatives(model, layer, x, chunk_size=5):
        n = 7
        tangents = torch.randn(n, *deriv.zero.shape, generator=seeded(2), dtype=torch.float64)
        fwd = deriv.along(tangents, "forward")
        rev = deriv.along(tangents, "reverse")
        assert fwd.shape == (n, x.shape[0], h.shape[1])
        np.testing.assert_allclose(rev.numpy(), fwd.numpy(), rtol=1e-10, atol=1e-12)
        one = deriv.push(tangents[3])
        np.testing.assert_allclose(one.numpy(), fwd[3].numpy(), rtol=1e-12, atol=1e-14)
        J = {m: deriv.jacobian(m) for m in ("forward", "reverse")}
        looped = OutputDerivatives(deriv.f, deriv.zero, deriv.c, vectorize=False).jacobian()
        assert J["forward"].shape == (x.shape[0], h.shape[1], deriv.T, deriv.r)
        np.testing.assert_allclose(J["reverse"].numpy(), J["forward"].numpy(), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(looped.numpy(), J["forward"].numpy(), rtol=1e-10, atol=1e-12)
        # per-sample Jacobians contracted with the tangents give the directional derivatives
        contracted = torch.einsum("bctr,nbtr->nbc", J["forward"], tangents.reshape(n, x.shape[0], deriv.T, deriv.r))
        np.testing.assert_allclose(contracted.numpy(), fwd.numpy(), rtol=1e-10, atol=1e-12)
        assert hook.perturbation is None


@pytest.mark.parametrize("make, layer", [(lambda: TinyTransformer().double(), "fc1"),
                                         (lambda: LinearSequence().double(), "merge")])
def test_row_sketched_derivatives_are_the_rows_times_the_jacobian(seeded, make, layer):
    """``rows`` (a per-sample sketch ``S_j``): every mode gives ``S_j J_j``; reverse mode pulls the
    rows back as cotangents (vectorised and looped), forward mode contracts its JVPs."""
    model = make()
    x = torch.randn(4, 3, model.embed.in_features, generator=seeded(5), dtype=torch.float64)
    for deriv, _, h in _derivatives(model, layer, x):
        s = 5
        S = torch.randn(x.shape[0], s, h.shape[1], generator=seeded(6), dtype=torch.float64)
        want = torch.einsum("bsc,bctr->bstr", S, deriv.jacobian("forward"))
        sketched = OutputDerivatives(deriv.f, deriv.zero, s, chunk_size=2, rows=S)
        for mode in ("forward", "reverse"):
            np.testing.assert_allclose(sketched.jacobian(mode).numpy(), want.numpy(), rtol=1e-10, atol=1e-12)
        looped = OutputDerivatives(deriv.f, deriv.zero, s, vectorize=False, rows=S).jacobian("reverse")
        np.testing.assert_allclose(looped.numpy(), want.numpy(), rtol=1e-10, atol=1e-12)
        v = torch.randn(*deriv.zero.shape, generator=seeded(7), dtype=torch.float64)
        np.testing.assert_allclose(sketched.push(v).numpy(), torch.einsum("bsc,bc->bs", S, deriv.push(v)).numpy(),
                                   rtol=1e-10, atol=1e-12)
        with pytest.raises(ValueError, match="rows have 5 outputs"):
            OutputDerivatives(deriv.f, deriv.zero, s + 1, rows=S)


def test_directional_derivative_is_the_finite_difference_of_the_perturbed_output(seeded):
    model = TinyTransformer().double()
    x = torch.randn(3, 4, 5, generator=seeded(3), dtype=torch.float64)
    for deriv, _, h in _derivatives(model, "fc1", x):
        v = torch.randn(*deriv.zero.shape, generator=seeded(4), dtype=torch.float64)
        eps = 1e-6
        with torch.no_grad():
            fd = (deriv.f(eps * v) - deriv.f(-eps * v)) / (2 * eps)
            np.testing.assert_allclose(deriv.f(deriv.zero).numpy(), h.numpy(), rtol=1e-14)
        np.testing.assert_allclose(deriv.push(v).numpy(), fd.numpy(), rtol=1e-6, atol=1e-8)


def test_mode_is_chosen_by_counting():
    assert choose_mode("auto", n_outputs=5, n_tangents=1728) == "reverse"
    assert choose_mode("auto", n_outputs=5000, n_tangents=16) == "forward"
    assert choose_mode("auto", n_outputs=8, n_tangents=8) == "reverse"
    assert choose_mode("forward", n_outputs=5, n_tangents=1728) == "forward"
    with pytest.raises(ValidationError, match="jacobian_mode must be one of"):
        choose_mode("sideways", 1, 1)


def test_recorded_pass_checks_every_hooked_layer_ran_once():
    model = TinyTransformer().double()
    x = torch.randn(2, 3, 5, dtype=torch.float64)
    with hooked_layers(model, [model.fc1, model.q]) as hooks:
        run_recorded(lambda: model(x), hooks, ["fc1", "q"], "here")
        assert all(h.calls == 1 for h in hooks)
        assert hooks[0].layer_input.shape == (2, 3, 8)
        with pytest.raises(ValidationError, match="here: fc1 ran 2 times in one forward pass"):
            run_recorded(lambda: (model(x), model(x)), hooks, ["fc1", "q"], "here")
        with pytest.raises(ValidationError, match="here: fc1 did not run in the forward pass"):
            run_recorded(lambda: model.q(torch.zeros(2, 8, dtype=torch.float64)), hooks, ["fc1", "q"], "here")


def test_hooked_layers_restore_mode_flags_and_hooks():
    model = TinyTransformer().double().train()
    model.head.weight.requires_grad_(False)
    flags = [p.requires_grad for p in model.parameters()]
    with hooked_layers(model, [model.fc1]):
        assert not model.training
        assert not any(p.requires_grad for p in model.parameters())
        assert len(model.fc1._forward_hooks) == 1
    assert model.training
    assert [p.requires_grad for p in model.parameters()] == flags
    assert len(model.fc1._forward_hooks) == 0


def test_gauss_newton_sums_are_twice_the_gram_and_cross_products():
    rng = np.random.default_rng(0)
    A = rng.standard_normal((3, 4, 2, 5))  # (B, c, K, n_atoms)
    b = rng.standard_normal((3, 4))
    sums = GaussNewtonSums(2, 10)
    sums.add_design(1, torch.from_numpy(A), torch.from_numpy(b))
    sums.add_residual(1, torch.from_numpy(b))
    H, g, c = sums.numpy()
    rows = A.reshape(12, 10)
    np.testing.assert_allclose(H[1], 2 * rows.T @ rows, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(g[1], 2 * rows.T @ b.reshape(-1), rtol=1e-12, atol=1e-12)
    assert c[1] == pytest.approx(float((b * b).sum()), rel=1e-12)
    assert not H[0].any() and not g[0].any() and c[0] == 0.0


def test_first_order_statistics_are_the_same_in_forward_reverse_and_auto_mode(tiny_hf, tmp_path):
    """collect_first_order (the multi-layer merge's producer) through the core's reverse mode
    (one VJP per compared output) equals its default forward mode (one JVP per atom)."""

    from mergeqp.io.calibration import load_tokenizer, read_prompts, tokenize_batches
    from mergeqp.io.checkpoint import open_checkpoint
    from mergeqp.lm import OutputSpec, teacher_forced_targets
    from mergeqp.merge.firstorder import SiteAtoms, TaskTargets, collect_first_order
    from mergeqp.merge.multilayer import WeightSource
    from mergeqp.merge.sites import match_sites, model_sites
    from mergeqp.stats.parametrisation import as_parametrisation

    fam = tiny_hf.make_family(tmp_path / "gpt2", "gpt2", K=2, n_prompts=6)
    cls = tiny_hf.auto_class("gpt2")
    model = cls.from_pretrained(str(fam.base), dtype=torch.float64, attn_implementation="eager").eval()
    ft = cls.from_pretrained(str(fam.finetuned[0]), dtype=torch.float64).eval()
    spec = OutputSpec(restrict="topk", k=4)
    batches = tokenize_batches(load_tokenizer(fam.base), read_prompts(fam.prompts[0])[:5], 10, 3)
    tasks = [TaskTargets("t", 1.0, teacher_forced_targets(ft, batches, spec, "cpu"))]
    sites = match_sites(model_sites(model), ["transformer.h.1.mlp.*"])
    src = WeightSource(open_checkpoint(fam.base), [open_checkpoint(p) for p in fam.finetuned])
    atoms = [SiteAtoms(s, as_parametrisation("rows"), src.deltas(s), 0.01 * src.deltas(s)[0]) for s in sites]
    ref = collect_first_order(model, atoms, tasks, spec, jacobian_mode="forward")
    for mode in ("reverse", "auto"):
        got = collect_first_order(model, atoms, tasks, spec, jacobian_mode=mode)
        np.testing.assert_allclose(got.H, ref.H, rtol=1e-10, atol=1e-12 * np.abs(ref.H).max())
        np.testing.assert_allclose(got.g, ref.g, rtol=1e-10, atol=1e-12 * np.abs(ref.g).max())
        np.testing.assert_allclose(got.c, ref.c, rtol=1e-12)
    with pytest.raises(ValidationError, match="jacobian_mode"):
        collect_first_order(model, atoms, tasks, spec, jacobian_mode="sideways")
