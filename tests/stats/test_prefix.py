"""The frozen-prefix cache (:mod:`mergeqp.stats.prefix`): blocks below every merge site run once per
batch. References: the same computation without the cache (bit-identical statistics and outputs),
a changed lower parameter (recomputed), a block that is not a function of its input (the check
on first use switches the cache off), copies of the model, and blocks returning tuples."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from mergeqp.stats.prefix import block_stack, first_site_block, frozen_prefix  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int, tuple_out: bool = False, counter: list[int] | None = None):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.tuple_out = tuple_out
        self.counter = counter

    def forward(self, hidden_states, scale=1.0):
        out = torch.tanh(self.lin(hidden_states)) * scale + hidden_states
        if self.counter is not None:  # not a function of its input: a hidden state of its own
            self.counter[0] += 1
            out = out + 1e-3 * self.counter[0]
        return (out, None) if self.tuple_out else out


class Stack(nn.Module):
    def __init__(self, n: int = 4, d: int = 6, tuple_out: bool = False, counter=None):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, d)
        self.layers = nn.ModuleList([Block(d, tuple_out, counter if i == 0 else None) for i in range(n)])
        self.head = nn.Linear(d, 3)
        for p in self.parameters():  # as the run layer holds a model: frozen
            p.requires_grad_(False)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.layers:
            out = block(h, scale=0.5)
            h = out[0] if isinstance(out, tuple) else out
        return self.head(h)


@pytest.mark.parametrize("tuple_out", [False, True])
def test_outputs_are_identical_and_lower_blocks_are_skipped(tuple_out):
    model = Stack(tuple_out=tuple_out).eval()
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    plain = model(ids)
    with frozen_prefix(model, [model.layers[2].lin]) as cache:
        assert cache is not None and len(cache.blocks) == 2
        first, second = model(ids), model(ids)
        assert cache.misses == 1 and cache.hits == 1 and cache.verified
        # a derivative pass (inputs wrapped by torch.func) uses the cache as a constant too
        from torch.func import jvp

        v = torch.randn_like(model.layers[3].lin.weight)
        _, tangent = jvp(lambda w: torch.func.functional_call(model, {"layers.3.lin.weight": w}, (ids,)),
                         (model.layers[3].lin.weight.detach(),), (v,))
        assert cache.hits == 2
    assert torch.equal(first, plain) and torch.equal(second, plain)
    _, expected = jvp(lambda w: torch.func.functional_call(model, {"layers.3.lin.weight": w}, (ids,)),
                      (model.layers[3].lin.weight.detach(),), (v,))
    assert torch.allclose(tangent, expected, atol=1e-6)
    assert "forward" not in vars(model.layers[0]) and "forward" not in vars(model.layers[1])


class MaskedStack(Stack):
    """Blocks that take a mask as well (as Hugging Face's take the attention mask)."""

    def forward(self, ids, mask):
        h = self.embed(ids)
        for block in self.layers:
            h = block(h, scale=mask[..., None].to(h.dtype))
        return self.head(h)


def test_equal_hidden_states_with_another_mask_are_not_a_hit():
    """(stop 56 review) The key was the hidden states alone: two batches with equal token ids and
    different attention masks (a prompt holding the pad token's text) shared one cached output, and the
    statistics were silently those of the first mask (BERT: c 16.61 instead of 12.50)."""
    model = MaskedStack().eval()
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    padded, full = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]), torch.ones(2, 3)
    with frozen_prefix(model, [model.layers[2].lin]) as cache:
        a, b, again = model(ids, padded), model(ids, full), model(ids, padded)
        assert cache.misses == 2 and cache.hits == 1
    assert torch.equal(a, model(ids, padded)) and torch.equal(b, model(ids, full)) and torch.equal(again, a)
    assert not torch.equal(a, b)


class FlagBlock(Block):
    def forward(self, hidden_states, scale=1.0, **flags):  # flags that change nothing (use_cache ...)
        return super().forward(hidden_states, scale)


def test_flags_one_call_path_passes_and_another_not_still_hit():
    """(adversarial review of stop 56) Keying on plain values too, Mixtral's batches missed when one
    call path passed output_router_logits and the other did not."""
    model = Stack().eval()
    model.layers = nn.ModuleList([FlagBlock(6) for _ in range(4)]).requires_grad_(False)
    ids = torch.tensor([[1, 2, 3]])

    def run(**flags):
        h = model.embed(ids)
        for block in model.layers:
            h = block(h, scale=0.5, **flags)
        return model.head(h)

    with frozen_prefix(model, [model.layers[2].lin]) as cache:
        a, b = run(), run(output_router_logits=False, use_cache=True)
        assert cache.misses == 1 and cache.hits == 1
    assert torch.equal(a, b)


def test_a_changed_lower_parameter_is_recomputed():
    model = Stack().eval()
    ids = torch.tensor([[1, 2, 3]])
    with frozen_prefix(model, [model.layers[3]]) as cache:
        model(ids)
        with torch.no_grad():
            model.layers[1].lin.bias.add_(0.5)  # e.g. a start merge loaded into every tensor
        changed = model(ids)
        assert cache.hits == 0 and cache.misses == 2
    assert torch.equal(changed, model(ids))


def test_a_block_that_is_not_a_function_of_its_input_switches_the_cache_off():
    counter = [0]
    model = Stack(counter=counter).eval()
    ids = torch.tensor([[1, 2, 3]])
    with frozen_prefix(model, [model.layers[2]]) as cache:
        model(ids)
        out = model(ids)
        assert not cache.enabled and "switched off" in cache.note
        later = model(ids)
    assert not torch.equal(out, later)  # each call really ran the block (its counter moved)


def test_copies_nothing_frozen_and_the_stack():
    model = Stack().eval()
    assert block_stack(model) is model.layers
    assert first_site_block(model.layers, [model.layers[2].lin, model.layers[3]]) == 2
    assert first_site_block(model.layers, [model.head]) is None
    with frozen_prefix(model, [model.layers[0].lin]) as cache:  # a site in the first block: nothing frozen
        assert cache is None
    with frozen_prefix(model, [model.head]) as cache:  # a site outside the stack
        assert cache is None
    ids = torch.tensor([[7, 8, 9]])
    with frozen_prefix(model, [model.layers[2]]) as cache:
        twin = copy.deepcopy(model)  # JointMode copies the live model: the copy runs its own blocks
        with torch.no_grad():
            twin.layers[0].lin.bias.add_(1.0)
        model(ids)
        assert not torch.equal(twin(ids), model(ids))
        assert torch.equal(twin(ids), copy.deepcopy(twin)(ids))


def test_statistics_are_bit_identical_on_a_llama(tiny_hf, tmp_path):
    """First-order statistics of a tiny Llama (sites in its second block) with and without the cache."""
    pytest.importorskip("transformers")
    from mergeqp.config import load_config
    from mergeqp.lm import OutputSpec
    from mergeqp.merge.firstorder import SiteAtoms, TaskTargets, collect_first_order
    from mergeqp.merge.multilayer import QPSettings, WeightSource, make_parametrisation
    from mergeqp.merge.sites import site_module
    from mergeqp.run.pipeline import load_model, prepare_tasks
    from mergeqp.run.plan import build_plan

    fam = tiny_hf.make_family(tmp_path / "llama", "llama", K=2, scale=0.3, n_prompts=8)
    for mode in ("forward", "reverse"):
        cfg = load_config(fam.write_config(tmp_path / "c.yml", ["model.layers.1.mlp.down_proj"],
                                           {"name": "qp", "mode": "single", "parametrisation": "rows"}))
        plan = build_plan(cfg)
        tasks = prepare_tasks(plan, OutputSpec(), OutputSpec(), torch.float64, "cpu", lambda m: None)
        tt = [TaskTargets(t.name, t.weight, t.calibration) for t in tasks]
        model = load_model(plan.base, fam.base, torch.float64, "cpu")
        w = WeightSource(plan.base, plan.finetuned)
        atoms = [SiteAtoms(s, make_parametrisation(QPSettings(), s, w.deltas(s)), w.deltas(s)) for s in plan.sites]
        plain = collect_first_order(model, atoms, tt, OutputSpec(), "cpu", jacobian_mode=mode)
        with frozen_prefix(model, [site_module(model, s) for s in plan.sites]) as cache:
            collect_first_order(model, atoms, tt, OutputSpec(), "cpu", jacobian_mode=mode)
            cached = collect_first_order(model, atoms, tt, OutputSpec(), "cpu", jacobian_mode=mode)
            assert cache.hits > len(tt) and cache.enabled
        assert np.array_equal(plain.H, cached.H) and np.array_equal(plain.g, cached.g)
        assert np.array_equal(plain.c, cached.c)
