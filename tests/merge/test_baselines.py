"""Baseline merge methods: registry, parameter validation, tensor selection, seeding,
row-uniform DARE, error messages, and merged models that load and run."""

from __future__ import annotations

import pytest
import torch

from mergeqp.errors import ConfigError, UnknownNameError, ValidationError
from mergeqp.merge import (
    MERGE_METHODS,
    merge_state_dicts,
    merge_tensors,
    select_tensors,
)

ALL = ("task_arithmetic", "soup", "ties", "dare", "dare_linear", "dare_ties", "row_dare", "fisher", "regmean")


def calibration_params(model, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    cal = [[(torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g))] for _ in range(K)]
    return {"fisher": dict(model=model, calibration=cal),
            "regmean": dict(model=model, calibration=[[x for x, _ in c] for c in cal])}


# ------------------------------------------------------------------------------------ registry
def test_registry_lists_every_method_with_reference_and_defaults():
    assert set(ALL) <= set(MERGE_METHODS)
    for name, method in MERGE_METHODS.items():
        assert method.name == name and method.reference and method.summary
        assert {"include", "exclude", "unselected"} <= set(method.defaults())
    assert MERGE_METHODS["ties"].defaults()["density"] == 0.2
    assert MERGE_METHODS["regmean"].defaults()["alpha"] == 0.9


def test_unknown_method_and_parameters_are_errors_listing_valid_names(random_family):
    base, fts = random_family((4, 3), K=2)
    with pytest.raises(UnknownNameError, match="valid merge methods: .*dare_ties.*ties"):
        merge_tensors("tie", base, fts)
    with pytest.raises(ConfigError, match="unknown parameter 'desnity' \\(did you mean 'density'\\?\\).*valid parameters: .*density"):
        merge_tensors("ties", base, fts, desnity=0.3)
    with pytest.raises(ConfigError, match="parameter 'density'.*less than or equal to 1"):
        merge_tensors("ties", base, fts, density=1.5)
    with pytest.raises(ConfigError, match="'normalize' applies only to variant='mergekit'"):
        merge_tensors("ties", base, fts, normalize=False)
    with pytest.raises(ConfigError, match="'weights' has 3 entries but there are 2"):
        merge_tensors("task_arithmetic", base, fts, weights=[1, 2, 3], progress=False)
    with pytest.raises(ConfigError, match="parameter 'drop_rate'"):
        merge_tensors("dare", base, fts, drop_rate=1.0)
    with pytest.raises(ConfigError, match="needs a model"):
        merge_tensors("fisher", None, fts)


# --------------------------------------------------------------------------------- formulas
def test_task_arithmetic_and_soup_formulas(random_family):
    base, fts = random_family((6, 4), K=3, seed=1)
    ta = merge_tensors("task_arithmetic", base, fts, scaling=0.3, progress=False)
    assert torch.allclose(ta, base + 0.3 * sum(f - base for f in fts), atol=1e-6)
    soup = merge_tensors("soup", None, fts, progress=False)
    assert torch.allclose(soup, sum(fts) / 3, atol=1e-6)
    soup_w = merge_tensors("soup", base, fts, weights=[1, 0, 3], progress=False)
    assert torch.allclose(soup_w, (fts[0] + 3 * fts[2]) / 4, atol=1e-6)


def test_ties_paper_disjoint_mean_by_hand():
    base = torch.zeros(4)
    fts = [torch.tensor([3.0, -1.0, 0.5, -2.0]), torch.tensor([1.0, 2.0, -4.0, -1.0]),
           torch.tensor([-2.0, 1.5, 1.0, 0.0])]
    # density 1: no trim; elected signs (+, +, -, -); disjoint means of the agreeing entries
    out = merge_tensors("ties", base, fts, density=1.0, progress=False)
    assert torch.equal(out, torch.tensor([2.0, 1.75, -4.0, -1.5]))
    # density 0.5 keeps 2 of 4 entries per model: [3, -2], [2, -4], [-2, 1.5] -> sums (1, 3.5, -4, -2)
    out = merge_tensors("ties", base, fts, density=0.5, progress=False)
    assert torch.equal(out, torch.tensor([3.0, 1.75, -4.0, -2.0]))


def test_row_dare_keeps_or_drops_whole_rows_and_shares_the_bias_draw():
    torch.manual_seed(0)
    base = {"l.weight": torch.randn(200, 3), "l.bias": torch.randn(200)}
    fts = [{k: v + torch.randn_like(v) for k, v in base.items()} for _ in range(2)]
    out = merge_state_dicts("row_dare", base, fts, density=0.5, weights=[1.0, 0.0], seed=4, progress=False)
    dW = (out["l.weight"] - base["l.weight"]) / ((fts[0]["l.weight"] - base["l.weight"]) / 0.5)
    db = (out["l.bias"] - base["l.bias"]) / ((fts[0]["l.bias"] - base["l.bias"]) / 0.5)
    kept = dW[:, 0].round()
    assert set(kept.unique().tolist()) == {0.0, 1.0}
    assert torch.allclose(dW, kept[:, None].expand(-1, 3), atol=1e-4)  # whole rows
    assert torch.allclose(db, kept, atol=1e-4)  # the bias entry follows its row
    assert 0.35 < float(kept.mean()) < 0.65
    # an injected row mask reproduces the paper's diag(m/p) formula exactly
    rows = torch.tensor([[1, 0] * 100, [0, 1] * 100], dtype=torch.float32)
    out = merge_state_dicts("row_dare", base, fts, density=0.5, masks={"l.weight": rows}, progress=False)
    expect = base["l.weight"] + sum(torch.diag(rows[k] / 0.5) @ (fts[k]["l.weight"] - base["l.weight"])
                                    for k in range(2))
    assert torch.allclose(out["l.weight"], expect, atol=1e-5)
    assert torch.allclose(out["l.bias"], base["l.bias"] + sum(rows[k] / 0.5 * (fts[k]["l.bias"] - base["l.bias"])
                                                               for k in range(2)), atol=1e-5)


def test_dare_masks_keep_the_expected_fraction_and_inverse_rescale(random_family):
    base, fts = random_family((300, 40), K=1, seed=2)
    out = merge_tensors("dare", base, fts, drop_rate=0.75, progress=False)
    ratio = (out - base) / (fts[0] - base)
    kept = ratio != 0
    assert torch.allclose(ratio[kept], torch.full_like(ratio[kept], 4.0), rtol=1e-4)
    assert abs(float(kept.float().mean()) - 0.25) < 0.01


# ------------------------------------------------------------------------------------- seeding
@pytest.mark.parametrize("method", ["dare", "dare_ties", "dare_linear", "row_dare"])
def test_tensor_seed_scope_is_independent_of_the_selection(mlp_family, method):
    model, base, fts = mlp_family(K=3)
    full = merge_state_dicts(method, base, fts, seed=5, progress=False)
    one = merge_state_dicts(method, base, fts, seed=5, include=["fc2"], unselected="drop", progress=False)
    assert set(one) == {"fc2.weight", "fc2.bias"}
    assert all(torch.equal(one[k], full[k]) for k in one)
    again = merge_state_dicts(method, base, fts, seed=5, progress=False)
    assert all(torch.equal(again[k], full[k]) for k in full)
    other = merge_state_dicts(method, base, fts, seed=6, progress=False)
    assert not torch.equal(other["fc1.weight"], full["fc1.weight"])
    # the global RNG is neither used nor disturbed
    torch.manual_seed(0)
    before = torch.rand(3)
    torch.manual_seed(0)
    merge_state_dicts(method, base, fts, seed=5, progress=False)
    assert torch.equal(torch.rand(3), before)


# ------------------------------------------------------------------------------------ selection
def test_select_tensors_globs_module_names_and_errors():
    names = ["a.fc1.weight", "a.fc1.bias", "a.fc2.weight", "b.norm.weight"]
    assert select_tensors(names, include=["a.fc1"]) == ["a.fc1.weight", "a.fc1.bias"]
    assert select_tensors(names, include="*.weight", exclude=["b.*"]) == ["a.fc1.weight", "a.fc2.weight"]
    assert select_tensors(names, include=["a.*"], exclude="*.bias") == ["a.fc1.weight", "a.fc2.weight"]
    with pytest.raises(ConfigError, match="include pattern 'a.fc3' matches no tensor.*a.fc1.weight"):
        select_tensors(names, include=["a.fc3"])
    with pytest.raises(ConfigError, match="exclude pattern"):
        select_tensors(names, exclude=["zzz"])


def test_unselected_tensors_base_average_drop_and_integer_buffers(mlp_family):
    model, base, fts = mlp_family(K=2)
    fts[1]["steps"] = torch.tensor(99)  # integer buffers differ: never merged
    out = merge_state_dicts("task_arithmetic", base, fts, include=["fc1.*"], progress=False)
    assert list(out) == list(base)
    assert out["fc2.weight"] is base["fc2.weight"]  # copied from the base (same object)
    assert out["steps"].item() == 7 and out["steps"].dtype == torch.int64
    assert not torch.equal(out["fc1.weight"], base["fc1.weight"])
    avg = merge_state_dicts("task_arithmetic", base, fts, include=["fc1.*"], unselected="average", progress=False)
    assert torch.allclose(avg["head.bias"], (fts[0]["head.bias"] + fts[1]["head.bias"]) / 2)
    assert avg["steps"].item() == 7
    drop = merge_state_dicts("task_arithmetic", base, fts, include=["fc1.*"], unselected="drop", progress=False)
    assert set(drop) == {"fc1.weight", "fc1.bias"}
    # without a base, unselected tensors are averaged by default and the reference is finetuned[0]
    soup = merge_state_dicts("soup", None, fts, include=["fc1"], progress=False)
    assert torch.allclose(soup["fc2.weight"], (fts[0]["fc2.weight"] + fts[1]["fc2.weight"]) / 2)
    with pytest.raises(ConfigError, match="unselected='base' needs a base"):
        merge_state_dicts("soup", None, fts, unselected="base", progress=False)


def test_half_precision_tensors_merge_in_float32_and_keep_their_dtype(random_family):
    base, fts = random_family((8, 8), K=2, seed=3)
    base16, fts16 = base.to(torch.bfloat16), [f.to(torch.bfloat16) for f in fts]
    out = merge_tensors("ties", base16, fts16, density=0.5, progress=False)
    assert out.dtype == torch.bfloat16
    ref = merge_tensors("ties", base16.float(), [f.float() for f in fts16], density=0.5, progress=False)
    assert torch.equal(out, ref.to(torch.bfloat16))


# --------------------------------------------------------------------------------------- errors
def test_mismatched_keys_and_shapes_name_the_tensor(mlp_family):
    model, base, fts = mlp_family(K=2)
    missing = dict(fts[1])
    del missing["fc2.bias"]
    with pytest.raises(ValidationError, match="'fc2.bias' of base is missing from finetuned\\[1\\]"):
        merge_state_dicts("ties", base, [fts[0], missing])
    extra = dict(fts[0], **{"new.weight": torch.zeros(2)})
    with pytest.raises(ValidationError, match="'new.weight' of finetuned\\[0\\] is not in base"):
        merge_state_dicts("ties", base, [extra, fts[1]])
    bad = dict(fts[1], **{"fc1.weight": torch.zeros(8, 7)})
    with pytest.raises(ValidationError, match="'fc1.weight' has shape \\(8, 7\\) in finetuned\\[1\\] but \\(8, 6\\)"):
        merge_state_dicts("ties", base, [fts[0], bad])
    wrong_kind = dict(fts[1], **{"fc1.bias": torch.zeros(8, dtype=torch.int64)})
    with pytest.raises(ValidationError, match="'fc1.bias' is not floating-point in finetuned\\[1\\]"):
        merge_state_dicts("ties", base, [fts[0], wrong_kind])
    with pytest.raises(ValidationError, match="needs a base model"):
        merge_state_dicts("ties", None, fts)
    with pytest.raises(ValidationError, match="list of models"):
        merge_state_dicts("ties", base, fts[0])
    with pytest.raises(ValidationError, match="shape \\(2, 7, 3\\), expected \\(2, 8, 6\\)"):
        merge_state_dicts("dare", base, fts, masks={"fc1.weight": torch.ones(2, 7, 3)}, progress=False)


# ------------------------------------------------------------------------- merged models run
@pytest.mark.parametrize("method", ALL)
def test_every_method_merges_a_model_that_loads_and_runs(mlp_family, method):
    model, base, fts = mlp_family(K=3)
    extra = calibration_params(model, 3).get(method, {})
    merged = merge_state_dicts(method, base, fts, progress=False, **extra)
    assert list(merged) == list(base)
    fresh = type(model)()
    fresh.load_state_dict(merged, strict=True)
    out = fresh(torch.randn(5, 6))
    assert out.shape == (5, 3) and bool(torch.isfinite(out).all())
    moved = [k for k in base if base[k].is_floating_point() and not torch.equal(merged[k], base[k])]
    assert moved, "the merge changed nothing"


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # vmap over SDPA
def test_tiny_llama_merges_load_and_run(llama_config, require):
    require("transformers")
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config()).eval()
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    fts = [{k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(2)]
    ids = torch.randint(0, 128, (3, 8), generator=g)
    targets = torch.cat([ids[:, 1:], torch.full((3, 1), -100)], dim=1)
    extra = {"fisher": dict(model=model, calibration=[[({"input_ids": ids}, targets)]] * 2,
                            include=["model.layers.1.*"]),
             "regmean": dict(model=model, calibration=[[{"input_ids": ids}]] * 2, include=["model.layers.1.*"])}
    for method in ALL:
        merged = merge_state_dicts(method, base, fts, progress=False, **extra.get(method, {}))
        fresh = LlamaForCausalLM(llama_config()).eval()
        fresh.load_state_dict(merged, strict=True)
        with torch.no_grad():
            logits = fresh(input_ids=ids).logits
        assert logits.shape == (3, 8, 128) and bool(torch.isfinite(logits).all()), method


def test_tied_tensors_are_merged_once_and_stay_tied() -> None:
    """An embedding tied to an output layer: DARE draws one mask for the one tensor."""
    import torch
    from torch import nn

    from mergeqp import merge_state_dicts

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight

    torch.manual_seed(0)
    models = [Tied() for _ in range(3)]
    for method in ("dare", "dare_ties", "row_dare", "task_arithmetic"):
        out = merge_state_dicts(method, models[0], models[1:], progress=False)
        assert torch.equal(out["emb.weight"], out["head.weight"]), method


def test_regmean_rejects_a_bare_linear_model_and_baseline_inputs_are_checked() -> None:
    import pytest
    import torch
    from torch import nn

    from mergeqp import merge_state_dicts
    from mergeqp.errors import ConfigError, ValidationError

    torch.manual_seed(0)
    ms = [nn.Linear(4, 2) for _ in range(2)]
    cal = [[torch.randn(10, 4)] for _ in range(2)]
    with pytest.raises(ValidationError, match="is itself a linear layer"):
        merge_state_dicts("regmean", None, ms, model=nn.Linear(4, 2), calibration=cal)
    base = {"w": torch.zeros(3), "pos": torch.arange(3)}
    fts = [{"w": torch.ones(3), "pos": torch.arange(3)}] * 2
    with pytest.raises(ConfigError, match="include is empty"):
        merge_state_dicts("task_arithmetic", base, fts, include=[])
    with pytest.raises(ConfigError, match="masks were given for tensors that were not merged"):
        merge_state_dicts("dare", base, fts, include="pos", masks={"w": torch.ones(2, 3)})
    with pytest.raises(ConfigError, match="seed"):
        merge_state_dicts("dare", base, fts, seed=2**70, seed_scope="global")
    seq = [nn.Sequential(nn.Linear(4, 3)) for _ in range(3)]
    with pytest.raises(ValidationError, match="integer class targets"):
        merge_state_dicts("fisher", None, seq[1:], model=seq[0],
                          calibration=[[(torch.randn(5, 4), torch.randn(5))]] * 2)
    with pytest.raises(ValidationError, match="not below the number of logits"):
        merge_state_dicts("fisher", None, seq[1:], model=seq[0],
                          calibration=[[(torch.randn(5, 4), torch.full((5,), 10))]] * 2)
