"""Baseline merges reproduce PEFT's ``merge_utils`` and mergekit where their semantics match.

Tensor-level checks call the peers' Python functions; checkpoint-level checks build tiny random
Llama checkpoints, run mergekit's command line on them (one ``mergekit-multi`` process for all
recipes: each recipe is one ``run_merge`` call, exactly what ``mergekit-yaml`` runs, and the
import cost is paid once) and compare every tensor. The peers are test-only dependencies:
the tests skip, saying so, when one is missing.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeqp.merge import merge_state_dicts, merge_tensors

#: the one tensor that gets a DARE density < 1 in the mergekit runs (mergekit's filter is a
#: substring match), so that mergekit's global RNG draws masks for this tensor only
DARE_TENSOR = "model.layers.1.mlp.down_proj.weight"
EXACT = 0.0
ROUNDING = 1e-6


@pytest.fixture(scope="session")
def peft_merge_utils(require):
    """``peft_merge_utils()``: PEFT's ``merge_utils`` module (skips the test when PEFT is missing)."""

    def _peft_merge_utils():
        return require("peft.utils.merge_utils")

    return _peft_merge_utils


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT warns that density >= 1 prunes nothing
        return fn(*args, **kwargs)


# ------------------------------------------------------------------------------------ PEFT, tensors
@pytest.mark.parametrize("density", [0.1, 0.37, 0.5, 1.0])
@pytest.mark.parametrize("sign_method,peft_sign", [("sum", "total"), ("count", "frequency")])
def test_ties_equals_peft(peft_merge_utils, random_family, density, sign_method, peft_sign):
    mu = peft_merge_utils()
    base, fts = random_family((24, 10), K=3, seed=1)
    weights = [0.5, 1.3, 0.8]
    ref = base + _quiet(mu.ties, [f - base for f in fts], torch.tensor(weights), density, peft_sign)
    for variant in ("paper", "peft"):
        ours = merge_tensors("ties", base, fts, density=density, weights=weights, variant=variant,
                             sign_method=sign_method, progress=False)
        assert float((ours - ref).abs().max()) <= EXACT


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(1, 9), K=st.integers(1, 4),
       density=st.floats(0.05, 1.0), seed=st.integers(0, 10_000))
def test_ties_equals_peft_property(peft_merge_utils, random_family, rows, cols, K, density, seed):
    mu = peft_merge_utils()
    base, fts = random_family((rows, cols), K=K, seed=seed)
    weights = torch.linspace(0.3, 1.2, K)
    ref = base + _quiet(mu.ties, [f - base for f in fts], weights, density)
    ours = merge_tensors("ties", base, fts, density=density, weights=weights.tolist(), progress=False)
    assert torch.allclose(ours, ref, rtol=0, atol=ROUNDING)


def test_task_arithmetic_equals_peft(peft_merge_utils, random_family):
    mu = peft_merge_utils()
    base, fts = random_family((7, 5, 3), K=3, seed=2)
    weights = [0.2, -0.4, 1.1]
    ref = base + mu.task_arithmetic([f - base for f in fts], torch.tensor(weights))
    ours = merge_tensors("task_arithmetic", base, fts, weights=weights, progress=False)
    assert float((ours - ref).abs().max()) <= ROUNDING


@pytest.mark.parametrize("method", ["dare_linear", "dare_ties"])
def test_dare_equals_peft_same_rng(peft_merge_utils, random_family, method):
    """seed_scope='global' draws the masks PEFT draws after torch.manual_seed(seed)."""
    mu = peft_merge_utils()
    base, fts = random_family((20, 11), K=3, seed=3)
    weights = [0.7, 1.0, 0.4]
    torch.manual_seed(11)
    ref = base + getattr(mu, method)([f - base for f in fts], torch.tensor(weights), 0.35)
    ours = merge_tensors(method, base, fts, density=0.35, weights=weights, seed=11,
                         seed_scope="global", progress=False)
    assert float((ours - ref).abs().max()) <= EXACT
    # the paper-parametrised `dare` (drop rate p) is dare_linear with density 1 - p
    if method == "dare_linear":
        torch.manual_seed(5)
        ref = base + mu.dare_linear([f - base for f in fts], torch.tensor(weights), 0.25)
        ours = merge_tensors("dare", base, fts, drop_rate=0.75, weights=weights, seed=5,
                             seed_scope="global", progress=False)
        assert float((ours - ref).abs().max()) <= EXACT


def test_dare_injected_mask_equals_peft(peft_merge_utils, random_family):
    """The same mask, injected: PEFT draws it from the global RNG, we are handed it."""
    mu = peft_merge_utils()
    base, fts = random_family((9, 13), K=2, seed=4)
    density = 0.6
    torch.manual_seed(99)
    masks = torch.stack([torch.bernoulli(torch.full((9, 13), density)) for _ in fts])
    torch.manual_seed(99)
    ref = base + mu.dare_ties([f - base for f in fts], torch.tensor([1.0, 0.5]), density)
    ours = merge_tensors("dare_ties", base, fts, name="w", density=density, weights=[1.0, 0.5],
                         masks={"w": masks}, seed=123, progress=False)
    assert float((ours - ref).abs().max()) <= EXACT
    with pytest.raises(Exception, match="'v'"):  # a mask for a tensor that is not merged
        merge_tensors("dare_ties", base, fts, name="w", masks={"v": masks}, progress=False)


def test_peft_ties_equals_mergekit_ties_with_weights_1_over_K(random_family):
    """The documented equivalence: paper/PEFT TIES (unit weights) == mergekit TIES (1/K, normalize)."""
    base, fts = random_family((30, 8), K=4, seed=5)
    paper = merge_tensors("ties", base, fts, density=0.4, progress=False)
    mk = merge_tensors("ties", base, fts, density=0.4, weights=0.25, variant="mergekit", progress=False)
    assert torch.allclose(paper, mk, rtol=0, atol=ROUNDING)


# ------------------------------------------------------------------------------- mergekit, tensors
@pytest.fixture(scope="session")
def mergekit_method(require):
    """``mergekit_method(name)``: mergekit's registered merge method ``name`` (skips the test
    when mergekit is missing)."""

    def _mergekit_method(name):
        require("mergekit")
        from mergekit.merge_methods import registry

        return registry.get(name)

    return _mergekit_method


@pytest.fixture(scope="session")
def mergekit_merge(mergekit_method):
    """``mergekit_merge(name, base, fts, **parameters)``: mergekit's method ``name`` applied to
    one tensor group (``base`` may be None); returns the merged tensor."""

    def _mergekit_merge(name, base, fts, **parameters):
        method = mergekit_method(name)  # skips when mergekit is missing
        from mergekit.merge_methods.base import TensorGroup

        tensors = ([base] if base is not None else []) + list(fts)
        group = TensorGroup.from_tensors(tensors, base_index=0 if base is not None else None, name="w")
        return method([group], parameters=parameters)[0]

    return _mergekit_merge


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("density", [0.01, 0.3, 1.0])
def test_ties_equals_mergekit(mergekit_merge, mergekit_method, random_family, normalize, density):
    mergekit_method("ties")
    base, fts = random_family((16, 12), K=3, seed=6)
    weights = [0.5, 1.0, 0.7]
    ref = mergekit_merge("ties", base, fts, weight=weights, density=density, normalize=normalize,
                          **{"lambda": 0.8})
    ours = merge_tensors("ties", base, fts, density=density, weights=weights, variant="mergekit",
                         normalize=normalize, scaling=0.8, progress=False)
    assert float((ours - ref).abs().max()) <= ROUNDING


@pytest.mark.parametrize("method", ["dare_ties", "dare_linear"])
def test_dare_equals_mergekit_same_rng(mergekit_merge, mergekit_method, random_family, method):
    mergekit_method(method)
    base, fts = random_family((16, 12), K=3, seed=7)
    weights = [0.5, 1.0, 0.7]
    torch.manual_seed(3)
    ref = mergekit_merge(method, base, fts, weight=weights, density=0.3)
    extra = {"variant": "mergekit"} if method == "dare_ties" else {"rescale": "l1"}
    ours = merge_tensors(method, base, fts, density=0.3, weights=weights, seed=3, seed_scope="global",
                         progress=False, **extra)
    assert float((ours - ref).abs().max()) <= ROUNDING
    # mergekit's L1 rescale is not 1/density: the inverse rescale gives a different tensor
    inverse = merge_tensors(method, base, fts, density=0.3, weights=weights, seed=3,
                            seed_scope="global", rescale="inverse", progress=False,
                            **({"variant": "mergekit"} if method == "dare_ties" else {}))
    assert float((inverse - ref).abs().max()) > 1e-3


def test_task_arithmetic_and_soup_equal_mergekit(mergekit_merge, random_family):
    base, fts = random_family((5, 9), K=3, seed=8)
    weights = [0.3, 0.9, 0.5]
    ref = mergekit_merge("task_arithmetic", base, fts, weight=weights, **{"lambda": 0.6})
    ours = merge_tensors("task_arithmetic", base, fts, weights=weights, scaling=0.6, progress=False)
    assert float((ours - ref).abs().max()) <= ROUNDING
    ref = mergekit_merge("linear", None, fts, weight=weights)
    ours = merge_tensors("soup", None, fts, weights=weights, progress=False)
    assert float((ours - ref).abs().max()) <= ROUNDING


# ---------------------------------------------------------------------- tiny Llama checkpoints
WEIGHTS = (0.6, 0.9)


def _model_entry(path, density, only_dare_tensor):
    dens = (f"[{{filter: {DARE_TENSOR.removesuffix('.weight')}, value: {density}}}, {{value: 1.0}}]"
            if only_dare_tensor else str(density))
    return f"  - model: {path}\n    parameters: {{weight: {{w}}, density: {dens}}}\n"


def _recipe(name, method, base, fts, density, shared):
    only = method.startswith("dare")
    models = "".join(_model_entry(p, density, only).replace("{w}", str(w)) for p, w in zip(fts, WEIGHTS))
    # recipe names must differ from method names: mergekit-multi treats any string equal to a
    # recipe name as a reference to that merge
    return (f"name: out_{name}\nmodels:\n{models}merge_method: {method}\nbase_model: {base}\n"
            f"parameters: {shared}\ndtype: float32\n")


@pytest.fixture(scope="module")
def llama_family(make_llama_family, require, tmp_path_factory):
    """A tiny random Llama base and two fine-tuned copies, written as Hugging Face folders."""
    require("transformers")
    folder = tmp_path_factory.mktemp("llama")
    base, fts, base_state, ft_states = make_llama_family(folder, K=2, seed=0)
    return {"folder": folder, "base": base, "fts": fts, "base_state": base_state, "ft_states": ft_states}


@pytest.fixture(scope="module")
def llama_merges(mergekit_cli, read_folder, llama_family):
    """mergekit's merges of the Llama family (ties, dare_ties, dare_linear, task_arithmetic)."""
    import os
    import subprocess
    from pathlib import Path

    exe = Path(mergekit_cli()).parent / "mergekit-multi"
    if not exe.exists():
        pytest.skip("mergekit-multi is not installed beside mergekit-yaml")
    d = llama_family
    folder, base, fts = d["folder"], d["base"], d["fts"]
    recipes = [
        _recipe("ties", "ties", base, fts, 0.3, "{normalize: true, lambda: 0.8}"),
        _recipe("dare_ties", "dare_ties", base, fts, 0.4, "{}"),
        _recipe("dare_linear", "dare_linear", base, fts, 0.4, "{}"),
        _recipe("task_arithmetic", "task_arithmetic", base, fts, 1.0, "{lambda: 0.7}"),
    ]
    cfg = folder / "merges.yml"
    cfg.write_text("---\n".join(recipes))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([str(exe), str(cfg), "-I", str(folder / "merged"), "--no-copy-tokenizer",
                           "--random-seed", "17", "--quiet"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outputs = {name: read_folder(folder / "merged" / f"out_{name}")
               for name in ("ties", "dare_ties", "dare_linear", "task_arithmetic")}
    return {**d, "out": outputs}


def test_llama_ties_equals_mergekit(max_abs_diff, llama_merges):
    from mergeqp.io.checkpoint import open_checkpoint

    d = llama_merges
    # read lazily from the folders mergekit read, through mergeqp's checkpoint reader
    ours = merge_state_dicts("ties", open_checkpoint(d["base"]), [open_checkpoint(p) for p in d["fts"]],
                             density=0.3, weights=list(WEIGHTS), variant="mergekit", scaling=0.8,
                             progress=False)
    worst, where = max_abs_diff(ours, d["out"]["ties"])
    assert worst <= ROUNDING, where


def test_llama_task_arithmetic_equals_mergekit(max_abs_diff, llama_merges):
    d = llama_merges
    ours = merge_state_dicts("task_arithmetic", d["base_state"], d["ft_states"], weights=list(WEIGHTS),
                             scaling=0.7, progress=False)
    worst, where = max_abs_diff(ours, d["out"]["task_arithmetic"])
    assert worst <= ROUNDING, where


@pytest.mark.parametrize("method", ["dare_ties", "dare_linear"])
def test_llama_dare_equals_mergekit(max_abs_diff, llama_merges, method):
    """mergekit draws masks only for DARE_TENSOR (density 1 elsewhere draws nothing), from the
    global RNG seeded 17: our global-scope generator seeded 17 draws the same masks."""
    d = llama_merges
    extra = {"variant": "mergekit"} if method == "dare_ties" else {"rescale": "l1"}
    common = dict(weights=list(WEIGHTS), seed=17, seed_scope="global", unselected="drop",
                  progress=False, **extra)
    sparse = merge_state_dicts(method, d["base_state"], d["ft_states"], density=0.4,
                               include=[DARE_TENSOR], **common)
    dense = merge_state_dicts(method, d["base_state"], d["ft_states"], density=1.0,
                              exclude=[DARE_TENSOR], **common)
    ours = {**sparse, **dense}
    worst, where = max_abs_diff(ours, d["out"][method])
    assert worst <= ROUNDING, where
    # the sparsified tensor really was sparsified (and differs from the dense merge)
    dense_all = merge_state_dicts(method, d["base_state"], d["ft_states"], density=1.0,
                                  include=[DARE_TENSOR], **common)
    assert float((dense_all[DARE_TENSOR] - ours[DARE_TENSOR]).abs().max()) > 1e-3


@pytest.mark.parametrize("method", ["ties", "dare_ties", "dare_linear", "task_arithmetic"])
def test_llama_equals_peft(max_abs_diff, peft_merge_utils, llama_family, method):
    """PEFT's merge_utils applied tensor by tensor (global RNG seeded once) == our state-dict merge."""
    mu = peft_merge_utils()
    d = llama_family
    base, fts = d["base_state"], d["ft_states"]
    w = torch.tensor(WEIGHTS)
    params = {"ties": dict(density=0.3), "dare_ties": dict(density=0.4, seed=2, seed_scope="global"),
              "dare_linear": dict(density=0.4, seed=2, seed_scope="global"), "task_arithmetic": {}}[method]
    torch.manual_seed(2)
    ref = {}
    for name, b in base.items():
        deltas = [ft[name] - b for ft in fts]
        if method == "task_arithmetic":
            ref[name] = b + mu.task_arithmetic(deltas, w)
        else:
            ref[name] = b + _quiet(getattr(mu, method), deltas, w, params["density"])
    ours = merge_state_dicts(method, base, fts, weights=list(WEIGHTS), progress=False, **params)
    worst, where = max_abs_diff(ours, ref)
    assert worst <= ROUNDING, where
