"""``mode: sequential`` / ``hybrid`` with ``mode_options: {by_depth: true}``: the layers grouped by
measured depth, each depth's layers linearised at the model merged below it and solved on their own.

References: the depths of a Llama / GPT-2 / BERT block against the architecture's data flow; the
first depth's QPs equal ``mode: single``'s (both linearise at the base); with one layer per depth
the merge equals plain ``sequential`` bit for bit; the dependency probe leaves the model as it was.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from mergeqp.config import load_config  # noqa: E402
from mergeqp.errors import ConfigError, ValidationError  # noqa: E402
from mergeqp.io.checkpoint import open_checkpoint  # noqa: E402
from mergeqp.merge.depth import depth_levels, site_dependencies  # noqa: E402
from mergeqp.merge.sites import match_sites, model_sites  # noqa: E402
from mergeqp.run.pipeline import run_merge  # noqa: E402

BY_DEPTH = {"by_depth": True}
#: the depths of one block, by the architecture's data flow (name suffixes)
EXPECTED = {
    "llama": [("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)],
    "gpt2": [("attn.c_attn",), ("attn.c_proj",), ("mlp.c_fc",), ("mlp.c_proj",)],
    "bert": [("query", "key", "value"), ("attention.output.dense",), ("intermediate.dense",),
             ("layer.1.output.dense",)],
}


@pytest.fixture(scope="module")
def families(tiny_hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("bydepth")
    return {arch: tiny_hf.make_family(root / arch, arch, K=2, scale=0.3, n_prompts=10)
            for arch in ("llama", "gpt2", "bert")}


def _merge(fam, tmp_path, layers, method, name):
    cfg = load_config(fam.write_config(tmp_path / f"{name}.yml", layers, method))
    return run_merge(cfg, tmp_path / f"out_{name}", progress=False)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_depths_of_a_block_follow_the_data_flow(tiny_hf, families, arch):
    fam = families[arch]
    model = fam.auto_class.from_pretrained(str(fam.base), dtype=torch.float64, attn_implementation="eager").eval()
    sites = match_sites(model_sites(model), [tiny_hf.BLOCK_PATTERN[arch]])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(5, 20, (2, 7), generator=torch.Generator().manual_seed(0))

    def run():
        with torch.no_grad():
            model(input_ids=ids)

    levels = depth_levels(sites, site_dependencies(model, sites, run))
    got = [tuple(s.name for s in level) for level in levels]
    assert len(got) == len(EXPECTED[arch]), got
    for names, suffixes in zip(got, EXPECTED[arch]):
        assert len(names) == len(suffixes) and all(any(n.endswith(x) for n in names) for x in suffixes), got
    for k, v in model.state_dict().items():  # every perturbed weight restored exactly
        assert torch.equal(v, before[k]), k


def test_a_cycle_has_no_depth_order():
    from mergeqp.merge.sites import LayerSite

    a, b = LayerSite("a", "linear", 2, 2, False), LayerSite("b", "linear", 2, 2, False)
    with pytest.raises(ValidationError, match="cycle"):
        depth_levels([a, b], {"a": {"b"}, "b": {"a"}})
    assert depth_levels([a, b], {"a": set(), "b": set()}) == [(a, b)]


def test_first_depth_equals_single_mode_and_later_depths_see_the_merge(tiny_hf, families, tmp_path):
    fam = families["llama"]
    block = tiny_hf.BLOCK_PATTERN["llama"]
    depth = _merge(fam, tmp_path, block, {"name": "qp", "mode": "sequential", "mode_options": BY_DEPTH}, "depth")
    single = _merge(fam, tmp_path, block, {"name": "qp", "mode": "single"}, "single")
    rows = {r["layer"]: r for r in depth.report["layers"]}
    ref = {r["layer"]: r for r in single.report["layers"]}
    assert set(rows) == set(ref)
    first = [n for n in rows if n.endswith(("q_proj", "k_proj", "v_proj"))]
    later = [n for n in rows if n not in first]
    base_j = depth.report["evaluation"]["base"]["calibration_objective"]
    for name in first:  # linearised at the base, like single mode: the same QP and optimum
        for key in ("objective_before", "objective_after", "energy_fraction"):
            assert rows[name][key] == pytest.approx(ref[name][key], rel=1e-10), (name, key)
        assert rows[name]["objective_before"] == pytest.approx(base_j, rel=1e-9)
    exact_first = rows[first[0]]["objective_after_exact"]
    assert all(rows[n]["objective_after_exact"] == exact_first for n in first)  # one exact value per depth
    o_proj = next(n for n in later if n.endswith("o_proj"))
    # o_proj is linearised at the model with q, k, v merged, not at the base
    assert rows[o_proj]["objective_before"] == pytest.approx(exact_first, rel=1e-9)
    assert rows[o_proj]["objective_before"] != pytest.approx(ref[o_proj]["objective_before"], rel=1e-6)
    merged = depth.report["evaluation"]["merged"]["calibration_objective"]
    assert merged < 0.8 * base_j
    assert merged == pytest.approx(depth.report["layers"][-1]["objective_after_exact"], rel=1e-9)


@pytest.mark.parametrize("mode", ["sequential", "hybrid"])
def test_one_layer_per_depth_equals_plain_sequential(tiny_hf, families, tmp_path, mode):
    fam = families["gpt2"]  # every GPT-2 block projection is its own depth
    block = tiny_hf.BLOCK_PATTERN["gpt2"]
    extra = {"start": {"name": "task_arithmetic", "params": {"scaling": 0.5}}} if mode == "hybrid" else {}
    plain = _merge(fam, tmp_path, block, {"name": "qp", "mode": mode, **extra}, "plain")
    depth = _merge(fam, tmp_path, block, {"name": "qp", "mode": mode, "mode_options": BY_DEPTH, **extra}, "depth")
    a, b = open_checkpoint(plain.out_dir), open_checkpoint(depth.out_dir)
    for name in a.names():
        assert torch.equal(a.get(name), b.get(name)), name
    assert [r["layer"] for r in depth.report["layers"]] == [r["layer"] for r in plain.report["layers"]]
    assert any("by_depth" in line for line in depth.plan.render().splitlines())


def test_by_depth_is_refused_where_it_means_nothing(tiny_hf, families, tmp_path):
    fam = families["llama"]
    block = tiny_hf.BLOCK_PATTERN["llama"]
    with pytest.raises(ConfigError, match="mode_options"):
        load_config(fam.write_config(tmp_path / "j.yml", block, {"name": "qp", "mode": "joint",
                                                                   "mode_options": BY_DEPTH}))
    with pytest.raises(ConfigError, match="by_depht|valid keys"):
        load_config(fam.write_config(tmp_path / "s.yml", block, {"name": "qp", "mode": "sequential",
                                                                   "mode_options": {"by_depht": True}}))


# ---------------------------------------------------------------------- property: random DAGs
@st.composite
def _dags(draw):
    """Parents of each of 2-7 layers (each among the earlier ones)."""
    n = draw(st.integers(2, 7))
    return [sorted(draw(st.sets(st.integers(0, i - 1), max_size=i))) if i else [] for i in range(n)]


class _DagNet(torch.nn.Module):
    """Layer ``i`` reads the input (no parents) or the sum of its parents' outputs."""

    def __init__(self, parents, width=3):
        super().__init__()
        self.parents = parents
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width).double() for _ in parents)

    def forward(self, x):
        outs = []
        for layer, ps in zip(self.layers, self.parents):
            outs.append(torch.tanh(layer(sum(outs[p] for p in ps) if ps else x)))
        return sum(outs)


@settings(max_examples=40, deadline=None)
@given(_dags(), st.integers(0, 2**16))
def test_depths_of_random_dags_are_their_longest_paths(parents, seed):
    """A layer depends on exactly its ancestors; its depth is the longest path to it; the layers
    of one depth never change each other's inputs."""
    from mergeqp.merge.sites import LayerSite

    torch.manual_seed(seed)
    net = _DagNet(parents)
    sites = [LayerSite(f"layers.{i}", "linear", 3, 3, True) for i in range(len(parents))]
    x = torch.randn(5, 3, dtype=torch.float64)

    def run():
        with torch.no_grad():
            net(x)

    deps = site_dependencies(net, sites, run)
    ancestors: list[set[int]] = []
    for ps in parents:
        ancestors.append(set(ps).union(*(ancestors[p] for p in ps)))
    assert deps == {f"layers.{i}": {f"layers.{a}" for a in anc} for i, anc in enumerate(ancestors)}
    depth: list[int] = []
    for ps in parents:
        depth.append(1 + max((depth[p] for p in ps), default=-1))
    levels = depth_levels(sites, deps)
    assert [[int(s.name.split(".")[1]) for s in level] for level in levels] == \
        [[i for i, d in enumerate(depth) if d == k] for k in range(max(depth) + 1)]
