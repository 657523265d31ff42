"""End-to-end merging of tiny Hugging Face checkpoints (Llama, GPT-2, BERT) from YAML configs.

Checks: single-layer QP on an MLP projection, sequential over every linear layer of a block,
hybrid (baseline start + QP refinement), the joint multi-layer QP; the merged folder reloads
with ``from_pretrained`` and reproduces the in-memory merged model; only merged tensors differ
from the base; certificates; the first-order statistics against exact / finite-difference
references; inputs untouched.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


from mergeqp.config import load_config
from mergeqp.io.checkpoint import open_checkpoint
from mergeqp.run.pipeline import run_merge

#: the architectures that ``tiny_hf.make_family`` builds, one family each (parametrize reads them at import)
ARCHS = ("llama", "gpt2", "bert")
REQUIRED = {"objective_before", "objective_after", "certificate", "energy_fraction", "seconds"}


@pytest.fixture(scope="module")
def families(tiny_hf, tmp_path_factory):
    """One family per architecture; Llama also perturbs its (untied) lm_head."""
    root = tmp_path_factory.mktemp("hfmerge")
    fams = {}
    for arch in ARCHS:
        extra = ("lm_head",) if arch == "llama" else ()
        fams[arch] = tiny_hf.make_family(root / arch, arch, K=2, perturbed=(tiny_hf.BLOCK_PATTERN[arch], *extra),
                                   scale=0.3, n_prompts=10)
    return fams


def _merge(fam, tmp_path, layers, method, name="cfg", **extra):
    cfg = load_config(fam.write_config(tmp_path / f"{name}.yml", layers, method, **extra))
    return run_merge(cfg, tmp_path / f"out_{name}", progress=False)


def _prompts(fam):
    from mergeqp.io.calibration import load_tokenizer, read_prompts, tokenize_batches

    tok = load_tokenizer(fam.base)
    texts = read_prompts(fam.prompts[0])[:3] + read_prompts(fam.prompts[1])[:3]
    return tokenize_batches(tok, texts, 12, 6)[0]


def _outputs(model, batch):
    """Logits at the real (unpadded) tokens, ``(n_tokens, V)`` float64."""
    with torch.no_grad():
        logits = model(**batch.inputs).logits.to(torch.float64)
    return logits[batch.mask.bool()]


def _reload(fam, folder, dtype=torch.float64):
    return fam.auto_class.from_pretrained(str(folder), dtype=dtype, attn_implementation="eager").eval()


def _changed_keys(base_dir, out_dir):
    a, b = open_checkpoint(base_dir), open_checkpoint(out_dir)
    assert a.names() == b.names()
    return {n for n in a.names() if not torch.equal(a.get(n).to(torch.float64), b.get(n).to(torch.float64))}


def _check_layer_entries(report, n_layers):
    layers = report["layers"]
    assert len(layers) == n_layers
    for r in layers:
        assert REQUIRED <= set(r)
        assert set(r["certificate"]) >= {"fw_gap", "certified"}
        assert r["certificate"]["certified"] is True, r
        assert 0.0 <= r["energy_fraction"] <= 1.0 + 1e-9
        scale = max(1.0, abs(r["objective_after"]))
        for point, value in r["objective_at"].items():  # zero, soup, task arithmetic are feasible
            assert r["objective_after"] <= value + 1e-9 * scale, (point, r)
        if r["mode"] in ("single", "sequential"):  # relaxed (per-sample) bound c (1 - energy) <= J*
            assert r["objective_after"] >= r["objective_before"] * (1 - r["energy_fraction"]) - 1e-9 * scale
        if r["mode"] == "joint":  # the same bound with the group's joint energy
            assert 0.0 <= r["group_energy_fraction"] <= 1.0 + 1e-9
            assert r["objective_after"] >= r["objective_before"] * (1 - r["group_energy_fraction"]) - 1e-9 * scale


# ---------------------------------------------------------------------- single layer
@pytest.mark.parametrize("arch", ARCHS)
def test_single_layer_qp_on_mlp_projection(tiny_hf, families, tmp_path, arch):
    fam = families[arch]
    before = {p: tiny_hf.file_digests(p) for p in [fam.base, *fam.finetuned]}
    res = _merge(fam, tmp_path, tiny_hf.MLP_LAYER[arch], {"name": "qp", "mode": "single"}, output_dtype="float64")
    rep = json.loads((res.out_dir / "report.json").read_text())
    assert "## Merged layers" in (res.out_dir / "report.md").read_text()
    _check_layer_entries(rep, 1)
    layer = rep["layers"][0]
    assert layer["layer"] == tiny_hf.MLP_LAYER[arch]
    # linearised at the base: J(0) is the base model's exact calibration objective
    assert layer["objective_before"] == pytest.approx(rep["evaluation"]["base"]["calibration_objective"], rel=1e-9)
    assert layer["objective_after_exact"] == pytest.approx(rep["evaluation"]["merged"]["calibration_objective"], rel=1e-9)
    assert rep["evaluation"]["merged"]["calibration_objective"] < rep["evaluation"]["base"]["calibration_objective"]
    # only the merged layer's tensors differ from the base
    site_keys = {f"{tiny_hf.MLP_LAYER[arch]}.weight", f"{tiny_hf.MLP_LAYER[arch]}.bias"}
    changed = _changed_keys(fam.base, res.out_dir)
    assert changed and changed <= site_keys
    # the folder reloads with from_pretrained and reproduces the in-memory merged model
    batch = _prompts(fam)
    reloaded = _reload(fam, res.out_dir)
    diff = (_outputs(reloaded, batch) - _outputs(res.model, batch)).abs().max()
    assert float(diff) <= 1e-9, float(diff)
    assert {p: tiny_hf.file_digests(p) for p in [fam.base, *fam.finetuned]} == before


def test_single_mode_on_two_layers_solves_each_at_the_base(families, tmp_path):
    """mode: single linearises every layer at the base: each layer's QP and written tensors are
    those of a single-layer run, and its exact objective is measured with that layer alone."""
    fam = families["bert"]
    layers = ["bert.encoder.layer.1.intermediate.dense", "bert.encoder.layer.1.output.dense"]
    both = _merge(fam, tmp_path, layers, {"name": "qp", "mode": "single"}, name="both")
    out = open_checkpoint(both.out_dir)
    for i, layer in enumerate(layers):
        alone = _merge(fam, tmp_path, layer, {"name": "qp", "mode": "single"}, name=f"alone{i}")
        a, b = both.report["layers"][i], alone.report["layers"][0]
        for key in ("objective_before", "objective_after", "objective_after_exact"):
            assert a[key] == pytest.approx(b[key], rel=1e-9), key
        ref = open_checkpoint(alone.out_dir)
        for key in (f"{layer}.weight", f"{layer}.bias"):
            assert torch.equal(out.get(key), ref.get(key))
    final = both.report["evaluation"]["merged"]["calibration_objective"]
    assert all(final != pytest.approx(r["objective_after_exact"], rel=1e-6) for r in both.report["layers"])


# ---------------------------------------------------------------------- sequential over a block
@pytest.mark.parametrize("arch", ARCHS)
def test_sequential_over_a_block(tiny_hf, families, tmp_path, arch):
    fam = families[arch]
    res = _merge(fam, tmp_path, tiny_hf.BLOCK_PATTERN[arch], {"name": "qp", "mode": "sequential"})
    rep = res.report
    sites = [s.name for s in res.plan.sites]
    assert len(sites) >= 4 and [r["layer"] for r in rep["layers"]] == sites  # model order
    _check_layer_entries(rep, len(sites))
    layers = rep["layers"]
    assert layers[0]["objective_before"] == pytest.approx(rep["evaluation"]["base"]["calibration_objective"], rel=1e-9)
    for prev, nxt in itertools.pairwise(layers):
        # each step is linearised at the partially merged model left by the previous one
        assert nxt["objective_before"] == pytest.approx(prev["objective_after_exact"], rel=1e-9)
    for r in layers:
        assert r["objective_after"] <= r["objective_before"] * (1 + 1e-12)  # d = 0 is feasible
    assert rep["evaluation"]["merged"]["calibration_objective"] < 0.8 * rep["evaluation"]["base"]["calibration_objective"]
    assert _changed_keys(fam.base, res.out_dir) <= {k for s in res.plan.sites for k in s.keys}
    # default output dtype = the base checkpoint's (float32): reload matches to float32 rounding
    batch = _prompts(fam)
    ref = _outputs(res.model, batch)
    got = _outputs(_reload(fam, res.out_dir, torch.float32), batch)
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


# ---------------------------------------------------------------------- hybrid
@pytest.mark.parametrize("arch", ARCHS)
def test_hybrid_refines_a_task_arithmetic_merge(tiny_hf, families, tmp_path, arch):
    pytest.importorskip("mergeqp.merge.registry", reason="baseline merge methods not available")
    from mergeqp.merge import merge_state_dicts

    fam = families[arch]
    mlp = tiny_hf.MLP_LAYER[arch]
    res = _merge(fam, tmp_path, mlp, {"name": "qp", "mode": "hybrid",
                                      "start": {"name": "task_arithmetic", "params": {"scaling": 1.0}}})
    rep = res.report
    _check_layer_entries(rep, 1)
    layer = rep["layers"][0]
    start = rep["evaluation"]["start"]
    # the QP is linearised at the task-arithmetic weights, a feasible point (d = 1): it can only improve
    assert layer["objective_before"] == pytest.approx(start["calibration_objective"], rel=1e-9)
    assert layer["objective_after"] <= layer["objective_before"] * (1 + 1e-12)
    assert layer["objective_at"]["task_arithmetic"] == pytest.approx(layer["objective_before"], rel=1e-7)
    # every other tensor is the task-arithmetic merge
    base, fts = open_checkpoint(fam.base), [open_checkpoint(p) for p in fam.finetuned]
    ta = merge_state_dicts("task_arithmetic", base.state_dict(), [f.state_dict() for f in fts], progress=False)
    out = open_checkpoint(res.out_dir)
    site_keys = set(res.plan.sites[0].keys)
    for name in base.names():
        if name not in site_keys:
            assert torch.allclose(out.get(name).to(torch.float64), ta[name].to(torch.float64), atol=1e-6), name
    assert any(not torch.allclose(out.get(k), ta[k], atol=1e-6) for k in site_keys)
    batch = _prompts(fam)  # the folder (float32) reproduces the in-memory merged model
    ref = _outputs(res.model, batch)
    got = _outputs(_reload(fam, res.out_dir, torch.float32), batch)
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


@pytest.mark.parametrize("by_depth", [False, True])
def test_hybrid_keeps_the_start_where_its_step_raised_the_objective(families, tmp_path, by_depth):
    """(stop 73, a QA review: a RegMean start 757 -> hybrid 986) ``keep_start`` (default): a layer whose
    QP step raised the exact calibration objective keeps the start's weights, and the record says so;
    ``keep_start: false`` applies the step as before. The point box ``[3, 3]`` forces the step to the
    weights of task arithmetic at scaling 3, above the task-arithmetic start's objective."""
    from mergeqp.merge import merge_state_dicts

    fam = families["gpt2"]
    mlp = "transformer.h.1.mlp.c_fc"
    start = {"name": "task_arithmetic", "params": {"scaling": 1.0}}
    method = {"name": "qp", "mode": "hybrid", "start": start, "constraints": ["box:3,3"]}
    kept = _merge(fam, tmp_path, mlp, {**method, "mode_options": {"by_depth": by_depth}}, name="kept")
    applied = _merge(fam, tmp_path, mlp, {**method, "mode_options": {"keep_start": False, "by_depth": by_depth}},
                     name="applied")
    ev_k, ev_a = kept.report["evaluation"], applied.report["evaluation"]
    layer = kept.report["layers"][0]
    assert layer["kept_start"] is True and layer["objective_after_exact"] > ev_k["start"]["calibration_objective"]
    assert ev_k["merged"]["calibration_objective"] == pytest.approx(ev_k["start"]["calibration_objective"], rel=1e-9)
    assert any("keep the weights they had before it" in n for n in kept.report["notes"])
    assert "(step not kept: the start's weights stay)" in (kept.out_dir / "report.md").read_text()
    assert "kept_start" not in applied.report["layers"][0]
    assert ev_a["merged"]["calibration_objective"] > ev_a["start"]["calibration_objective"] * (1 + 1e-6)
    base, fts = open_checkpoint(fam.base), [open_checkpoint(p) for p in fam.finetuned]
    ta = merge_state_dicts("task_arithmetic", base.state_dict(), [f.state_dict() for f in fts], progress=False)
    site_keys = kept.plan.sites[0].keys
    k_out, a_out = open_checkpoint(kept.out_dir), open_checkpoint(applied.out_dir)
    for key in site_keys:  # kept: the start's weights; applied: base + 3 sum of the residuals (d = 3)
        assert torch.allclose(k_out.get(key).to(torch.float64), ta[key].to(torch.float64), atol=1e-6), key
        want = base.get(key).to(torch.float64) + 3 * sum(f.get(key).to(torch.float64) - base.get(key).to(torch.float64)
                                                          for f in fts)
        assert torch.allclose(a_out.get(key).to(torch.float64), want, atol=1e-5), key


# ---------------------------------------------------------------------- joint
def test_joint_qp_and_its_comparison_with_sequential(families, tmp_path):
    fam = families["gpt2"]
    res = _merge(fam, tmp_path, ["transformer.h.1.mlp.*"], {"name": "qp", "mode": "joint"})
    rep = res.report
    _check_layer_entries(rep, 2)
    assert len({r["objective_after"] for r in rep["layers"]}) == 1  # one QP for both layers
    assert rep["layers"][0]["n_variables"] == 2 * (64 + 16)
    cmp_ = rep["joint_vs_sequential"]
    assert set(cmp_) == {"joint", "sequential"}
    for v in cmp_.values():
        assert v["calibration_objective"] < rep["evaluation"]["base"]["calibration_objective"]
    assert "## Joint QP vs sequential QP" in (res.out_dir / "report.md").read_text()
    print("\njoint vs sequential (GPT-2, both MLP projections of block 1): exact calibration J "
          f"{cmp_['joint']['calibration_objective']:.6g} vs {cmp_['sequential']['calibration_objective']:.6g}")


def test_joint_without_the_sequential_comparison(families, tmp_path):
    fam = families["gpt2"]
    method = {"name": "qp", "mode": "joint", "mode_options": {"compare_sequential": False}}
    res = _merge(fam, tmp_path, ["transformer.h.1.mlp.*"], method)
    assert "joint_vs_sequential" not in res.report
    assert "Joint QP vs sequential QP" not in (res.out_dir / "report.md").read_text()
    assert any("no sequential comparison" in n for n in res.report["plan"]["notes"])


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_joint_statistics_blocks_and_gauss_newton_curvature(tiny_hf, families, arch):
    """Joint statistics: diagonal blocks equal the single-site ones; the full quadratic form
    (with cross-layer blocks) equals 2 sum ||J v||^2 with J v from finite differences of the
    model's outputs along a combined weight perturbation of both layers."""
    from mergeqp.io.calibration import load_tokenizer, read_prompts, tokenize_batches
    from mergeqp.io.checkpoint import open_checkpoint
    from mergeqp.lm import OutputSpec, teacher_forced_targets
    from mergeqp.merge.firstorder import SiteAtoms, TaskTargets, collect_first_order
    from mergeqp.merge.multilayer import WeightSource
    from mergeqp.merge.sites import (
        match_sites,
        model_sites,
        read_augmented,
        write_augmented,
    )
    from mergeqp.stats.parametrisation import as_parametrisation

    fam = families[arch]
    cls = tiny_hf.auto_class(arch)
    model = cls.from_pretrained(str(fam.base), dtype=torch.float64, attn_implementation="eager").eval()
    ft = cls.from_pretrained(str(fam.finetuned[0]), dtype=torch.float64).eval()
    tok = load_tokenizer(fam.base)
    batches = tokenize_batches(tok, read_prompts(fam.prompts[0])[:4], 10, 4)
    spec = OutputSpec()
    tasks = [TaskTargets("t", 1.0, teacher_forced_targets(ft, batches, spec, "cpu"))]
    pattern = "transformer.h.1.mlp.*" if arch == "gpt2" else "model.layers.1.mlp.[ud]*"
    sites = match_sites(model_sites(model), [pattern])
    assert len(sites) == 2
    src = WeightSource(open_checkpoint(fam.base), [open_checkpoint(p) for p in fam.finetuned])
    atoms = [SiteAtoms(s, as_parametrisation("rows"), src.deltas(s)) for s in sites]
    joint = collect_first_order(model, atoms, tasks, spec)
    for a in atoms:
        single = collect_first_order(model, [a], tasks, spec)
        sl = joint.site_slice(a.site.name)
        idx = np.concatenate([np.arange(sl.start, sl.stop) + k * joint.N for k in range(joint.K)])
        np.testing.assert_allclose(joint.H[0][np.ix_(idx, idx)], single.H[0], rtol=1e-9, atol=1e-12 * np.abs(single.H[0]).max())
        np.testing.assert_allclose(joint.g[0][idx], single.g[0], rtol=1e-9, atol=1e-12 * np.abs(single.g[0]).max())
    rng = np.random.default_rng(0)
    v = rng.standard_normal((joint.K, joint.N))
    W0 = {s.name: read_augmented(model, s) for s in sites}

    def outputs(t):
        for a in atoms:
            upd = a.param.update(v[:, joint.site_slice(a.site.name)], a.deltas.numpy())
            write_augmented(model, a.site, W0[a.site.name] + t * torch.from_numpy(upd))
        outs = [spec.select(spec.raw(model(**tb.batch.inputs)), tb.batch.mask).to(torch.float64) for tb in tasks[0].batches]
        return torch.cat([o.reshape(o.shape[0], -1) for o in outs])

    with torch.no_grad():
        eps = 1e-5 if arch == "gpt2" else 1e-3  # Llama's RMSNorm runs in float32
        Jv = (outputs(eps) - outputs(-eps)) / (2 * eps)
        for s in sites:
            write_augmented(model, s, W0[s.name])
    quad = float(v.ravel() @ joint.H[0] @ v.ravel())
    assert quad == pytest.approx(2.0 * float((Jv * Jv).sum()), rel=1e-6 if arch == "gpt2" else 2e-3)
    cross = joint.H[0].copy()
    for a in atoms:  # the cross-layer blocks are not negligible here
        sl = joint.site_slice(a.site.name)
        idx = np.concatenate([np.arange(sl.start, sl.stop) + k * joint.N for k in range(joint.K)])
        cross[np.ix_(idx, idx)] = 0.0
    assert np.abs(cross).max() > 1e-3 * np.abs(joint.H[0]).max()


def test_linear_downstream_objective_is_exact(families, tmp_path):
    """Llama's lm_head maps its input linearly to the logits: the QP objective equals the merged
    model's true calibration error for any d, and the optimum is certified."""
    from mergeqp.lm import OutputSpec
    from mergeqp.merge.firstorder import TaskTargets
    from mergeqp.merge.multilayer import (
        MergeContext,
        QPSettings,
        WeightSource,
        calibration_objective,
        solve_group,
    )
    from mergeqp.run.pipeline import load_model, prepare_tasks
    from mergeqp.run.plan import build_plan
    from mergeqp.merge.sites import write_augmented

    fam = families["llama"]
    cfg = load_config(fam.write_config(tmp_path / "lin.yml", "lm_head", {"name": "qp", "mode": "single",
                                                                         "constraints": []}))
    plan = build_plan(cfg)
    spec, evs = OutputSpec(), OutputSpec()
    tasks = prepare_tasks(plan, spec, evs, torch.float64, "cpu", lambda m: None)
    model = load_model(plan.base, fam.base, torch.float64, "cpu")
    ws = WeightSource(plan.base, plan.finetuned)
    ctx = MergeContext(model, ws, [TaskTargets(t.name, t.weight, t.calibration) for t in tasks], spec,
                       QPSettings(constraints=()), "cpu")
    site = plan.sites[0]
    res = solve_group(ctx, [site], mode="single", group=0, relinearise_offsets=False)
    qp = res.stats.problem()
    W0 = ws.base_weight(site)
    rng = np.random.default_rng(1)
    D = ws.deltas(site).numpy()
    for d in [rng.uniform(-1, 2, qp.shape) for _ in range(3)] + [res.solution.d]:
        write_augmented(model, site, W0 + torch.from_numpy(np.einsum("ki,kim->im", d, D)))
        assert qp.objective(d) == pytest.approx(calibration_objective(ctx), rel=1e-10)
    assert res.solution.certificate.certified()
    # unconstrained optimum = least squares: the gradient vanishes there
    assert np.abs(qp.gradient(res.solution.d)).max() <= 1e-7 * np.abs(qp.g).max()


# ---------------------------------------------------------------------- output restriction
def test_output_restriction_effect_on_the_objective(tiny_hf, families, tmp_path):
    """Statistics on restricted outputs (random projection, top-k) give other QPs; their solutions,
    scored on the full-logit objective, can only be worse than the full QP's own optimum, and
    the projection's objective is an unbiased estimate of the full one."""
    from mergeqp.io.calibration import load_tokenizer, read_prompts, tokenize_batches
    from mergeqp.lm import OutputSpec, teacher_forced_targets
    from mergeqp.merge.firstorder import SiteAtoms, TaskTargets, collect_first_order
    from mergeqp.merge.multilayer import WeightSource
    from mergeqp.merge.sites import match_sites, model_sites
    from mergeqp.solvers.registry import solve
    from mergeqp.stats.parametrisation import as_parametrisation

    fam = families["llama"]
    cls = tiny_hf.auto_class("llama")
    base = cls.from_pretrained(str(fam.base), dtype=torch.float64, attn_implementation="eager").eval()
    fts = [cls.from_pretrained(str(p), dtype=torch.float64).eval() for p in fam.finetuned]
    tok = load_tokenizer(fam.base)
    site = match_sites(model_sites(base), [tiny_hf.MLP_LAYER["llama"]])[0]
    src = WeightSource(open_checkpoint(fam.base), [open_checkpoint(p) for p in fam.finetuned])
    atoms = [SiteAtoms(site, as_parametrisation("rows"), src.deltas(site))]
    V = len(tiny_hf.vocab())
    results = {}
    specs = {"none": OutputSpec(), "projection k=16": OutputSpec(restrict="projection", k=16, seed=0),
             "projection k=64": OutputSpec(restrict="projection", k=64, seed=0),
             "topk k=8": OutputSpec(restrict="topk", k=8)}
    for label, spec in specs.items():
        tasks = []
        for t, ft, p in zip(fam.tasks, fts, fam.prompts):
            batches = tokenize_batches(tok, read_prompts(p), 12, 5)
            tasks.append(TaskTargets(t, 1.0, teacher_forced_targets(ft, batches, spec, "cpu")))
        qp = collect_first_order(base, atoms, tasks, spec).problem()
        results[label] = (qp, solve(qp, "box:0,1").d)
    full = results["none"][0]
    best = full.objective(results["none"][1])
    lines = [f"output restriction at {site.name} (V = {V}); full-logit objective of each solution:"]
    for label, (qp, d) in results.items():
        value = full.objective(d)
        lines.append(f"  {label:16s} J_full(d*) = {value:.6g} ({100 * (value / best - 1):+.2f}% vs full optimum); "
                     f"its own J(0) = {qp.c:.6g} vs full J(0) = {full.c:.6g}")
        assert value >= best * (1 - 1e-9)
        assert value < full.objective(np.zeros(full.shape))  # still better than the base
    print("\n" + "\n".join(lines))
    # unbiasedness of the projection: the base objective is estimated within sampling error
    for k in (16, 64):
        assert results[f"projection k={k}"][0].c == pytest.approx(full.c, rel=1.5 / np.sqrt(k))


# ---------------------------------------------------------------------- inputs in other formats
def test_bare_state_dict_inputs_and_sharded_io(tiny_hf, families, tmp_path):
    """A fine-tuned model given as a bare .safetensors file and another as a torch file, a base
    stored in shards; the output is sharded too. Same result as with plain folders."""
    from safetensors.torch import save_file

    fam = families["gpt2"]
    ref = _merge(fam, tmp_path, tiny_hf.MLP_LAYER["gpt2"], {"name": "qp", "mode": "single"}, name="ref")
    sd0 = {k: v.clone() for k, v in open_checkpoint(fam.finetuned[0]).state_dict().items()}
    save_file(sd0, str(tmp_path / "ft0.safetensors"))
    torch.save(open_checkpoint(fam.finetuned[1]).state_dict(), tmp_path / "ft1.pt")
    sharded = tmp_path / "base_sharded"
    tiny_hf.auto_class("gpt2").from_pretrained(str(fam.base)).save_pretrained(str(sharded), max_shard_size="20KB")
    tiny_hf.build_tokenizer(sharded)
    assert (sharded / "model.safetensors.index.json").is_file()
    alt = tiny_hf.Family(fam.root, "gpt2", sharded, [tmp_path / "ft0.safetensors", tmp_path / "ft1.pt"], fam.prompts, fam.tasks)
    res = _merge(alt, tmp_path, tiny_hf.MLP_LAYER["gpt2"], {"name": "qp", "mode": "single"}, name="alt", max_shard_size="20KB")
    assert (res.out_dir / "model.safetensors.index.json").is_file()
    a, b = ref.report["layers"][0], res.report["layers"][0]
    assert b["objective_after"] == pytest.approx(a["objective_after"], rel=1e-9)
    assert b["objective_before"] == pytest.approx(a["objective_before"], rel=1e-9)
    ra, rb = open_checkpoint(ref.out_dir), open_checkpoint(res.out_dir)
    for n in ra.names():
        assert torch.allclose(ra.get(n), rb.get(n), atol=1e-7), n


def test_a_fine_tune_folder_without_config_merges_as_its_bare_weight_file(tiny_hf, families, tmp_path):
    """(stop 60 review) A fine-tune folder holding weights but no config.json passed the dry run, and
    from_pretrained then built transformers' default-size model (a 7B Llama) and ran the machine out of
    memory. It is read into the base's architecture, as the same weights in a bare file are, with a note."""
    fam = families["llama"]
    layer = tiny_hf.MLP_LAYER["llama"]
    folder = tmp_path / "ft0_weights_only"
    folder.mkdir()
    shutil.copy(Path(fam.finetuned[0]) / "model.safetensors", folder / "model.safetensors")
    bare = tmp_path / "ft0.safetensors"
    shutil.copy(Path(fam.finetuned[0]) / "model.safetensors", bare)
    results = {}
    for name, first in (("folder", folder), ("bare", bare)):
        alt = tiny_hf.Family(fam.root, "llama", fam.base, [first, *fam.finetuned[1:]], fam.prompts, fam.tasks)
        results[name] = _merge(alt, tmp_path, layer, {"name": "qp", "mode": "single"}, name=name)
    note = [n for n in results["folder"].report["notes"] if "no config.json" in n]
    assert note and "read into the base's architecture" in note[0]
    a, b = open_checkpoint(results["folder"].out_dir), open_checkpoint(results["bare"].out_dir)
    for n in a.names():
        assert torch.equal(a.get(n), b.get(n)), n


def test_cli_merge_writes_folder_and_report(tiny_hf, families, tmp_path, capsys):
    from mergeqp.cli import main

    fam = families["bert"]
    cfg = fam.write_config(tmp_path / "cli.yml", tiny_hf.MLP_LAYER["bert"],
                         {"name": "qp", "mode": "single", "constraints": ["box:0,1", "sign"]},
                         output={"restrict": "projection", "k": 8})
    assert main(["merge", str(cfg), "--out", str(tmp_path / "o"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "merged model written to" in out and "certified True" in out
    rep = json.loads((tmp_path / "o" / "report.json").read_text())
    assert REQUIRED <= set(rep["layers"][0])
    assert rep["layers"][0]["certificate"]["certified"] is True
    assert rep["plan"]["output"] == {"field": "logits", "restrict": "projection", "k": 8}
    assert main(["merge", str(cfg), "--out", str(tmp_path / "o"), "--quiet"]) == 2  # not empty
    assert "--overwrite" in capsys.readouterr().err
    assert main(["merge", str(cfg), "--out", str(tmp_path / "o"), "--quiet", "--overwrite"]) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available on this machine")
def test_cuda_matches_cpu(tiny_hf, families, tmp_path):
    fam = families["llama"]
    cpu = _merge(fam, tmp_path, tiny_hf.MLP_LAYER["llama"], {"name": "qp", "mode": "single"}, name="cpu")
    gpu = _merge(fam, tmp_path, tiny_hf.MLP_LAYER["llama"], {"name": "qp", "mode": "single", "solver": "torch_fista"},
                 name="gpu", device="cuda")
    assert gpu.report["device"] == "cuda"
    a, b = cpu.report["layers"][0], gpu.report["layers"][0]
    for key in ("objective_before", "objective_after", "objective_after_exact"):
        assert b[key] == pytest.approx(a[key], rel=1e-6)
    assert b["certificate"]["certified"]


def test_baseline_method_merges_only_the_selected_layers(families, tmp_path):
    """method: a baseline (no calibration needed): the selected tensors are the registry's merge,
    every other tensor is the base's."""
    pytest.importorskip("mergeqp.merge.registry", reason="baseline merge methods not available")
    from mergeqp.cli import main
    from mergeqp.merge import merge_state_dicts

    fam = families["gpt2"]
    layers = ["transformer.h.1.mlp.*", "transformer.ln_f"]
    cfg = fam.write_config(tmp_path / "ties.yml", layers, {"name": "ties", "params": {"density": 0.5}})
    assert main(["merge", str(cfg), "--out", str(tmp_path / "o"), "--quiet"]) == 0
    base, fts = open_checkpoint(fam.base), [open_checkpoint(p) for p in fam.finetuned]
    selected = [n for n in base.names() if n.startswith(("transformer.h.1.mlp.", "transformer.ln_f."))]
    assert len(selected) == 6
    ref = merge_state_dicts("ties", {k: base.get(k) for k in selected}, [{k: f.get(k) for k in selected} for f in fts],
                            density=0.5, progress=False)
    out = open_checkpoint(tmp_path / "o")
    for n in base.names():
        assert torch.equal(out.get(n), ref[n] if n in selected else base.get(n)), n
    rep = json.loads((tmp_path / "o" / "report.json").read_text())
    # ln_f is the base's in both fine-tunes: left so since stop 48 (the same tensor), not counted as merged
    assert rep["baseline"]["method"] == "ties" and rep["baseline"]["tensors"] == 4
    assert any("are the base's in every fine-tuned model" in n and "transformer.ln_f" in n for n in rep["notes"])
    assert _reload(fam, tmp_path / "o") is not None
    bad = fam.write_config(tmp_path / "bad.yml", layers, {"name": "ties", "params": {"desnity": 0.5}})
    with pytest.raises(Exception, match="unknown parameter 'desnity'"):
        from mergeqp.run.plan import build_plan

        build_plan(load_config(bad))
    bad = fam.write_config(tmp_path / "bad2.yml", layers, {"name": "tiez"})
    assert main(["merge", str(bad), "--dry-run"]) == 2


def test_captured_energy_matches_an_explicit_projector():
    from mergeqp.merge.firstorder import _captured

    rng = np.random.default_rng(3)
    A = rng.standard_normal((4, 30, 6))
    A[1, :, 5] = A[1, :, 0]  # a rank-deficient sample
    b = rng.standard_normal((4, 30))
    expect = 0.0
    for j in range(4):
        x, *_ = np.linalg.lstsq(A[j], b[j], rcond=None)
        expect += float(np.sum((A[j] @ x) ** 2))
    assert _captured(torch.from_numpy(A), torch.from_numpy(b)) == pytest.approx(expect, rel=1e-10)


def test_vit_image_classifier_from_tensor_inputs(tiny_hf, tmp_path):
    """A ViT merged at an MLP projection, calibrated on ready model inputs (pixel_values files);
    its logits are (B, labels): one compared vector per image."""
    from transformers import ViTForImageClassification

    fam = tiny_hf.make_vit_family(tmp_path / "vit")
    layer = "vit.encoder.layer.1.intermediate.dense"
    res = _merge(fam, tmp_path, layer, {"name": "qp", "mode": "single"}, output_dtype="float64")
    _check_layer_entries(res.report, 1)
    ev = res.report["evaluation"]
    assert ev["merged"]["calibration_objective"] < ev["base"]["calibration_objective"]
    assert set(ev["merged"]["heldout_mse"]) == {"task0", "task1"}
    assert _changed_keys(fam.base, res.out_dir) == {f"{layer}.weight", f"{layer}.bias"}
    x = torch.randn(5, 1, 8, 8, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    reloaded = ViTForImageClassification.from_pretrained(str(res.out_dir), dtype=torch.float64,
                                                         attn_implementation="eager").eval()
    with torch.no_grad():
        diff = (reloaded(pixel_values=x).logits - res.model(pixel_values=x).logits).abs().max()
    assert float(diff) <= 1e-10
    # a fine-tuned model saved as a bare state dict of the live model (transformers 5 renames
    # ViT's weights on load: the file uses the live names, the folders the stored ones)
    live = ViTForImageClassification.from_pretrained(str(fam.finetuned[0])).state_dict()
    torch.save(live, tmp_path / "ft0_live.pt")
    alt = tiny_hf.Family(fam.root, "vit", fam.base, [tmp_path / "ft0_live.pt", fam.finetuned[1]], fam.prompts, fam.tasks)
    res2 = _merge(alt, tmp_path, layer, {"name": "qp", "mode": "single"}, name="live", output_dtype="float64")
    for key in ("objective_before", "objective_after", "objective_after_exact"):
        assert res2.report["layers"][0][key] == pytest.approx(res.report["layers"][0][key], rel=1e-9)


@pytest.mark.parametrize("param", ["rows", "columns", "scalar"])
def test_first_order_statistics_match_the_stats_layer(tiny_hf, families, param):
    """The JVP-per-atom statistics equal those built from mergeqp.stats' full per-sample
    Jacobian (linearise_batch) and its parametrisation design, on GPT-2 (Conv1D, bias, masks)."""
    from mergeqp.io.calibration import load_tokenizer, read_prompts, tokenize_batches
    from mergeqp.lm import OutputSpec, teacher_forced_targets
    from mergeqp.merge.firstorder import SiteAtoms, TaskTargets, collect_first_order
    from mergeqp.merge.multilayer import WeightSource
    from mergeqp.merge.sites import match_sites, model_sites
    from mergeqp.stats.hooks import perturbation_hook
    from mergeqp.stats.linearise import linearise_batch
    from mergeqp.stats.parametrisation import as_parametrisation

    fam = families["gpt2"]
    cls = tiny_hf.auto_class("gpt2")
    base = cls.from_pretrained(str(fam.base), dtype=torch.float64, attn_implementation="eager").eval()
    ft = cls.from_pretrained(str(fam.finetuned[0]), dtype=torch.float64).eval()
    batches = tokenize_batches(load_tokenizer(fam.base), read_prompts(fam.prompts[0])[:6], 10, 3)
    spec = OutputSpec(restrict="topk", k=6)
    tasks = [TaskTargets("t", 1.0, teacher_forced_targets(ft, batches, spec, "cpu"))]
    site = match_sites(model_sites(base), ["transformer.h.1.mlp.c_fc"])[0]
    D = WeightSource(open_checkpoint(fam.base), [open_checkpoint(p) for p in fam.finetuned]).deltas(site)
    p = as_parametrisation(param)
    ours = collect_first_order(base, [SiteAtoms(site, p, D)], tasks, spec)
    n = ours.H.shape[1]
    H_ref, g_ref, c_ref = np.zeros((n, n)), np.zeros(n), 0.0
    with perturbation_hook(base.get_submodule(site.name)) as hook:
        for tb in tasks[0].batches:
            def fn(out, task, _tb=tb):
                return spec.select(spec.raw(out), _tb.batch.mask, _tb.index)
            lin = linearise_batch(base, hook, tb.batch.inputs, fn, 0)
            Z = torch.cat([lin.layer_input, torch.ones(*lin.layer_input.shape[:-1], 1, dtype=torch.float64)], -1)
            R = torch.einsum("btm,krm->bktr", Z, D)
            A = p.design(lin.jacobian, R, Z, D).reshape(Z.shape[0], lin.output.shape[1], -1)
            b = lin.output - tb.target.reshape(Z.shape[0], -1)
            H_ref += 2 * torch.einsum("bcn,bcm->nm", A, A).numpy()
            g_ref += 2 * torch.einsum("bcn,bc->n", A, b).numpy()
            c_ref += float((b * b).sum())
    np.testing.assert_allclose(ours.H[0], H_ref, rtol=1e-9, atol=1e-11 * np.abs(H_ref).max())
    np.testing.assert_allclose(ours.g[0], g_ref, rtol=1e-9, atol=1e-11 * np.abs(g_ref).max())
    assert ours.c[0] == pytest.approx(c_ref, rel=1e-12)


# ---------------------------------------------------------------------- solver trouble
def test_an_uncertified_qp_layer_is_noted_and_exits_1(tiny_hf, families, tmp_path, capsys):
    """A solver stopped early: its (projected, feasible) point is written, the report notes that
    the layer is not certified, and `mergeqp merge` exits 1."""
    from mergeqp.cli import main

    fam = families["llama"]
    path = fam.write_config(tmp_path / "c.yml", tiny_hf.MLP_LAYER["llama"],
                          {"name": "qp", "mode": "single", "solver": "torch_fista", "solver_options": {"max_iter": 2}})
    assert main(["merge", str(path), "--out", str(tmp_path / "o"), "--quiet"]) == 1
    captured = capsys.readouterr()
    assert "not certified" in captured.err
    rep = json.loads((tmp_path / "o" / "report.json").read_text())
    assert rep["layers"][0]["certificate"]["certified"] is False
    assert rep["layers"][0]["certificate"]["reasons"]
    assert any("NOT certified" in n for n in rep["notes"])


def test_an_infeasible_solver_point_stops_the_merge(tiny_hf, families, tmp_path, capsys):
    """OSQP cut off after 3 iterations leaves the box: nothing is written, exit 2, one message."""
    from mergeqp.cli import main

    fam = families["llama"]
    path = fam.write_config(tmp_path / "c.yml", tiny_hf.MLP_LAYER["llama"],
                          {"name": "qp", "mode": "single", "solver": "osqp",
                           "solver_options": {"max_iter": 3, "polishing": False}})
    assert main(["merge", str(path), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "violates the constraints" in err and "no model was written" in err and "Traceback" not in err
    assert not (tmp_path / "o" / "model.safetensors").exists()


@pytest.mark.parametrize("method", [{"name": "qp", "mode": "sequential"}, {"name": "ties", "params": {"density": 0.5}}])
def test_in_memory_merge_holds_exactly_what_the_folder_would(families, tmp_path, method):
    """``run_merge(..., write=False)`` writes nothing and returns every tensor the merge computed:
    bit for bit the written folder's (the others are the base's), with the same report numbers."""
    fam = families["llama"]
    layers = ["model.layers.1.mlp.*"]
    cfg = load_config(fam.write_config(tmp_path / "cfg.yml", layers, method))
    written = run_merge(cfg, tmp_path / "out", progress=False)
    before = set(tmp_path.iterdir())
    memory = run_merge(cfg, None, progress=False, write=False)
    assert set(tmp_path.iterdir()) == before  # nothing written
    assert written.tensors is None and memory.tensors
    changed = _changed_keys(fam.base, tmp_path / "out")
    assert changed and changed <= set(memory.tensors)
    out, base = open_checkpoint(tmp_path / "out"), open_checkpoint(fam.base)
    for name, tensor in memory.tensors.items():
        assert torch.equal(tensor, out.get(name)), name
    for name in set(base.names()) - set(memory.tensors):
        assert torch.equal(out.get(name), base.get(name)), name

    def objectives(result):
        return [(layer["layer"], layer["objective_after"]) for layer in result.report.get("layers", [])]

    assert objectives(memory) == objectives(written)
    assert memory.report["output"]["folder"] == "(in memory)" and memory.report["output"]["weight_files"] == []
    assert memory.report.get("baseline", {}).get("tensors") == written.report.get("baseline", {}).get("tensors")
    from mergeqp.errors import ValidationError

    with pytest.raises(ValidationError, match="output folder is needed unless write=False"):
        run_merge(cfg, None, progress=False)


def test_prompts_longer_than_the_models_context_are_truncated_to_it(families, tiny_hf, tmp_path):
    """GPT-2 has learned positions (64 here): a 128-token max_length with a longer prompt used to
    fail inside the model ("IndexError: index out of range in self"); the plan now truncates to
    the context and says so."""
    from mergeqp.run.plan import build_plan, context_length

    fam = families["gpt2"]
    long_prompts = []
    for i, p in enumerate(fam.prompts):
        path = tmp_path / f"long{i}.txt"
        path.write_text(" ".join(tiny_hf.sentences(fam.tasks[i], 40, seed=i)) + "\n" + p.read_text())
        long_prompts.append(path)
    cfg_path = fam.write_config(tmp_path / "long.yml", ["transformer.h.1.mlp.c_proj"],
                                {"name": "qp", "mode": "single", "parametrisation": "scalar"},
                                calibration={"max_length": 128, "batch_size": 4, "holdout": 0})
    import yaml

    raw = yaml.safe_load(cfg_path.read_text())
    for m, path in zip(raw["models"], long_prompts):
        m["calibration"] = str(path)
    cfg_path.write_text(yaml.safe_dump(raw))
    cfg = load_config(cfg_path)
    plan = build_plan(cfg)
    assert plan.max_length == 64 and context_length({"n_positions": 64}) == ("n_positions", 64)
    assert any("calibration.max_length 128 exceeds the model's context (n_positions 64)" in n for n in plan.notes)
    res = run_merge(cfg, tmp_path / "out_long", progress=False)
    assert all(r["certificate"]["certified"] for r in res.report["layers"])
    assert context_length({"hidden_size": 8}) is None


def test_a_failed_allocation_is_told_apart_from_bad_inputs():
    from mergeqp.run.models import out_of_memory as _out_of_memory

    assert _out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:127] . DefaultCPUAllocator: not enough "
                                       "memory: you tried to allocate 3200000000 bytes."))
    assert _out_of_memory(MemoryError()) and _out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert not _out_of_memory(IndexError("index out of range in self"))
    assert not _out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_targets_that_do_not_fit_are_refused_before_they_are_allocated(tiny_hf, families, tmp_path, capsys,
                                                                        monkeypatch):
    """The fine-tunes' teacher-forced targets (positions x vocabulary, float64) used to grow until
    the operating system killed the process (exit 137, no message). After the first batch the
    rest is counted and compared with the memory available: here it does not fit, so the merge
    stops with exit 2, naming the model, the size and what to lower, and writes nothing."""
    import mergeqp.lm as lm
    from mergeqp.cli import main
    from mergeqp.run import tasks

    monkeypatch.setattr(lm.targets, "HEAD_TARGETS_MIN_RATIO", 10**9)  # every logit held (test_head_targets: hidden states)
    fam = families["llama"]
    cfg = fam.write_config(tmp_path / "big.yml", tiny_hf.MLP_LAYER["llama"],
                           {"name": "qp", "mode": "single", "parametrisation": "scalar"},
                           calibration={"batch_size": 2, "holdout": 0})
    seen: list[int] = []

    def tiny_memory():
        seen.append(1)
        return tasks.TARGETS_MARGIN_BYTES + 1000  # less than the other batches' targets
    monkeypatch.setattr(tasks, "available_memory_bytes", tiny_memory)
    assert main(["merge", str(cfg), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert seen and "the fine-tune's targets on its calibration prompts need about" in err
    assert "models[" in err and "output.restrict: topk or projection" in err and "calibration.max_length" in err
    assert "compared outputs" in err and not (tmp_path / "o").exists()
    monkeypatch.setattr(tasks, "available_memory_bytes", lambda: None)  # unknown: no refusal
    assert main(["merge", str(cfg), "--out", str(tmp_path / "o"), "--quiet"]) == 0


def test_target_bytes_counts_what_a_batch_holds(tiny_hf, families):
    """``check`` receives the other batches' bytes: the first batch's, scaled by positions (batch x
    padded length), exact since every per-position output is ``(B, T, width)``."""
    from mergeqp.io.calibration import load_tokenizer, read_prompts, tokenize_batches
    from mergeqp.lm import KEPT_AS_HIDDEN, OutputSpec, target_bytes, teacher_forced_targets

    fam = families["llama"]
    tok = load_tokenizer(fam.base)
    texts = read_prompts(fam.prompts[0])[:6]
    batches = tokenize_batches(tok, texts, 12, 2)
    assert len(batches) == 3 and len({b.inputs["input_ids"].shape for b in batches}) > 1
    model = _reload(fam, fam.base)
    calls: list = []
    for spec in (OutputSpec(fold_head=False), OutputSpec(restrict="topk", k=3, metric="kl")):
        calls.clear()
        out = teacher_forced_targets(model, batches, spec, "cpu", check=calls.append)
        assert len(calls) == 1 and calls[0].nbytes == sum(target_bytes(tb) for tb in out[1:])
        # every logit (vocabulary 46 >= 2 x hidden 16): kept as hidden states; a restriction: held whole
        assert calls[0].kept_as_hidden == (spec.restrict == "none")
        assert (KEPT_AS_HIDDEN in calls[0].what) == calls[0].kept_as_hidden
    assert "distributions" in calls[0].what and "3 compared outputs" in calls[0].what


def test_a_users_method_or_mode_that_answers_wrongly_is_named(families, tmp_path, capsys):
    """A registered merge method whose tensors are integers or of the wrong shape was cast and
    written (or failed deep inside); a mode that skips a selected layer left it at the base with
    exit 0. Both are now refused, naming the entry and the tensor / layer."""
    import mergeqp
    from mergeqp.cli import main
    from mergeqp.errors import ValidationError
    from mergeqp.merge.method import MethodParams, tensorwise_run
    from mergeqp.merge.modes import MERGE_MODES, SingleMode
    from mergeqp.merge.registry import MERGE_METHODS, merge_state_dicts

    def as_int(name, base, finetuned, params, state):
        return torch.sign(finetuned[0] - base).to(torch.int64)

    def transposed(name, base, finetuned, params, state):
        return finetuned[0].t().contiguous() if finetuned[0].dim() == 2 else finetuned[0]

    class SkipLast(SingleMode):
        name = "skiplast_test"
        description = "forgets the last selected layer"

        def run(self, ctx, sites):
            return super().run(ctx, list(sites)[:-1])

    fam = families["llama"]
    try:
        for name, fn in (("as_int_test", as_int), ("transposed_test", transposed)):
            mergeqp.register_merge_method(mergeqp.MergeMethod(name=name, summary="x", reference="test",
                                                              params=MethodParams, run=tensorwise_run(fn, name)))
        mergeqp.register_merge_mode(SkipLast())
        base = {k: torch.randn(4, 3) for k in ("a.weight", "b.weight")}
        fts = [{k: v + 0.1 * torch.randn_like(v) for k, v in base.items()} for _ in range(2)]
        for name, message in (("as_int_test", "as torch.int64, not a floating-point tensor"),
                              ("transposed_test", r"of shape \(3, 4\), expected \(4, 3\)")):
            with pytest.raises(ValidationError, match=f"merge method '{name}' returned 'a.weight' " + message):
                merge_state_dicts(name, base, fts)
        cfg = fam.write_config(tmp_path / "int.yml", ["model.layers.1.mlp.down_proj"], {"name": "as_int_test"})
        assert main(["merge", str(cfg), "--out", str(tmp_path / "o_int"), "--quiet"]) == 2
        assert "not a floating-point tensor" in capsys.readouterr().err and not (tmp_path / "o_int").exists()
        layers = ["model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"]
        cfg = fam.write_config(tmp_path / "skip.yml", layers, {"name": "qp", "mode": "skiplast_test",
                                                               "parametrisation": "scalar"})
        assert main(["merge", str(cfg), "--out", str(tmp_path / "o_skip"), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert f"merge mode 'skiplast_test' returned no record for {layers[-1]}" in err
        assert not (tmp_path / "o_skip").exists()
    finally:
        for key in ("as_int_test", "transposed_test"):
            MERGE_METHODS.pop(key, None)
        MERGE_MODES.pop("skiplast_test", None)


def test_selected_layers_no_fine_tune_changed_are_left_out(tiny_hf, tmp_path):
    """(stop 48 review) A pattern over every block of fine-tunes of one (model.layers.*.mlp.down_proj
    with block 1 fine-tuned) put block 0's unchanged layer into the QP too (a real case asked for a
    160 GiB QP for 3 changed layers of 30). The run leaves it out with a note; the merged model is the
    merge of the changed layer alone."""
    from mergeqp.cli import main

    fam = tiny_hf.make_family(tmp_path / "fam", "llama", K=2, n_prompts=8)
    method = {"name": "qp", "mode": "joint"}
    both = fam.write_config(tmp_path / "both.yml", ["model.layers.*.mlp.down_proj"], method, evaluate=False)
    one = fam.write_config(tmp_path / "one.yml", ["model.layers.1.mlp.down_proj"], method, evaluate=False)
    assert main(["merge", str(both), "--out", str(tmp_path / "both"), "--quiet"]) == 0
    assert main(["merge", str(one), "--out", str(tmp_path / "one"), "--quiet"]) == 0
    rep = json.loads((tmp_path / "both" / "report.json").read_text())
    assert [r["layer"] for r in rep["layers"]] == ["model.layers.1.mlp.down_proj"]
    assert any("1 selected layer(s) or tensor(s) are the base's" in n and "model.layers.0.mlp.down_proj" in n
               for n in rep["notes"]), rep["notes"]
    a, b = open_checkpoint(tmp_path / "both"), open_checkpoint(tmp_path / "one")
    for n in b.names():
        assert torch.equal(a.get(n), b.get(n)), n


@pytest.mark.parametrize("method", [{"name": "qp", "mode": "sequential"}, {"name": "qp", "mode": "joint"},
                                    {"name": "regmean"}])
def test_plan_without_unchanged_equals_the_plan_of_the_changed_layers(tiny_hf, tmp_path, method):
    """run.plan.without_unchanged redoes only the sites, the QP groups and the memory estimate (it
    rebuilt the whole plan before, reading prompts and tokenizers again): the same as the plan of a
    config naming the changed layers."""
    from mergeqp.run.plan import build_plan, without_unchanged

    fam = tiny_hf.make_family(tmp_path / "fam", "llama", K=2, n_prompts=8)
    glob = build_plan(load_config(fam.write_config(tmp_path / "all.yml", ["model.layers.*.mlp.down_proj"], method)))
    one = build_plan(load_config(fam.write_config(tmp_path / "one.yml", ["model.layers.1.mlp.down_proj"], method)))
    left = without_unchanged(glob)
    assert [s.name for s in glob.sites] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert [s.name for s in left.sites] == [s.name for s in one.sites] == ["model.layers.1.mlp.down_proj"]
    assert left.groups == one.groups and left.extra_tensors == one.extra_tensors
    assert left.memory == one.memory
    if method.get("mode") != "sequential":  # (one site at a time: the same peak either way)
        assert left.memory != glob.memory
    assert left.config.layers == ["model.layers.1.mlp.down_proj"] and left.tasks == one.tasks
    assert left.notes[:-1] == glob.notes and "model.layers.0.mlp.down_proj" in left.notes[-1]
    assert glob.notes == one.notes  # (the note is added to the copy only)


def test_run_merge_names_what_it_takes(tmp_path):
    """(stop 50) ``run_merge("cfg.yaml", out)`` was a raw AttributeError from deep inside the plan."""
    from mergeqp.errors import ValidationError
    from mergeqp.run.pipeline import run_merge

    with pytest.raises(ValidationError, match=r"cfg must be a MergeConfig, got str \(a path: read the file with "
                                              r"mergeqp.load_config\(path\) first\)"):
        run_merge("cfg.yaml", tmp_path / "out")
    with pytest.raises(ValidationError, match=r"got dict .*parse_config\(mapping\)"):
        run_merge({"base": "b"}, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    from mergeqp.run.plan import build_plan

    with pytest.raises(ValidationError, match=r"build_plan: cfg must be a MergeConfig, got str"):
        build_plan("cfg.yaml")


def test_changes_of_the_fine_tunes_outside_the_selection_are_noted(tiny_hf, families, tmp_path):
    """(stop 50) A fine-tune that changed other layers than the selected ones was merged without a word:
    the merged model keeps the base's tensors there. Now a note names them (a sample of each tensor);
    a fine-tune saved in bfloat16 whose other tensors are the base's rounded is not flagged, and a mode
    started from a merge of every tensor (hybrid) gets no note."""
    import shutil
    from pathlib import Path

    import yaml
    from safetensors.torch import load_file, save_file

    from mergeqp.run.plan import build_plan, changed_outside

    fam = families["llama"]
    layer = tiny_hf.MLP_LAYER["llama"]  # one projection of the perturbed block
    cfg = load_config(fam.write_config(tmp_path / "one.yml", [layer], {"name": "qp", "mode": "single"}))
    plan = build_plan(cfg)
    notes = changed_outside(plan)
    assert len(notes) == 2 and all("outside the merged layers" in n for n in notes)
    block = tiny_hf.BLOCK_PATTERN["llama"].rstrip("*")
    assert block in notes[0] and "lm_head" in " ".join(notes)
    res = run_merge(cfg, tmp_path / "out_one", progress=False)
    assert sum("outside the merged layers" in n for n in res.report["notes"]) == 2
    # a bfloat16 copy of the base as a "fine-tune": every tensor is the base's rounded, none flagged
    bf = tmp_path / "bf16"
    shutil.copytree(fam.base, bf)
    state = load_file(str(bf / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()},
              str(bf / "model.safetensors"), metadata={"format": "pt"})
    data = yaml.safe_load(Path(cfg.config_file).read_text())
    data["models"][1]["path"] = str(bf)
    (tmp_path / "bf.yml").write_text(yaml.safe_dump(data))
    bf_notes = changed_outside(build_plan(load_config(tmp_path / "bf.yml")))
    first = load_config(tmp_path / "bf.yml").model_names()[0]
    assert len(bf_notes) == 1 and bf_notes[0].startswith(f"model {first!r} also changed")
    hybrid = load_config(fam.write_config(tmp_path / "hy.yml", [layer], {
        "name": "qp", "mode": "hybrid", "start": {"name": "soup"}}))
    from mergeqp.run.plan import keeps_base_outside

    assert keeps_base_outside(plan) and not keeps_base_outside(build_plan(hybrid))


def test_tensors_a_qp_pattern_selects_but_cannot_merge_are_named_as_such(tiny_hf, families, tmp_path):
    """(stop 60 review) With `layers: ["*"]` a QP kept the changed norms as the base's and the note said to
    select them in layers:, which the pattern had done. Tensors the patterns match that are not a linear
    layer's get their own note (a QP merges linear layers only; a start merged on every tensor, or a
    baseline, merges them); those outside every pattern keep the old one."""
    from mergeqp.run.plan import build_plan, changed_outside

    fam = families["gpt2"]
    every = build_plan(load_config(fam.write_config(tmp_path / "every.yml", ["*"], {"name": "qp"})))
    assert any(k.endswith("ln_1.weight") for k in every.qp_unmerged)
    assert not any(k in every.qp_unmerged for s in every.sites for k in s.keys)
    notes = changed_outside(every)
    assert notes and all("that layers: selects but a QP does not merge" in n and "ln_" in n for n in notes)
    assert not any("select them in layers:" in n for n in notes)
    one = build_plan(load_config(fam.write_config(tmp_path / "one.yml", [tiny_hf.MLP_LAYER["gpt2"]], {"name": "qp"})))
    assert one.qp_unmerged == []
    notes = changed_outside(one)
    assert notes and all("select them in layers: to merge them too" in n for n in notes)
    from mergeqp.run.plan import start_outside

    # a start merged on every tensor: what the patterns select is not called "outside the selected layers"
    started = build_plan(load_config(fam.write_config(tmp_path / "tr.yml", ["*"], {
        "name": "qp", "mode": "trust_region", "start": {"name": "task_arithmetic"}})))
    (note,) = start_outside(started)
    assert "that layers: selects but a QP does not merge" in note and "outside the selected layers" not in note
    notes = start_outside(build_plan(load_config(fam.write_config(
        tmp_path / "tr1.yml", [tiny_hf.MLP_LAYER["gpt2"]], {"name": "qp", "mode": "hybrid", "start": {"name": "soup"}}))))
    assert notes and all("outside the selected layers" in n for n in notes)


def test_stored_values_compare_at_the_coarser_dtype(tmp_path):
    """(stop 53 review) A fine-tune saved in bfloat16 / float16 of a float32 base holds the base rounded:
    not a change, so an unchanged block is not put back into the QP; an fp16 base against a bf16
    fine-tune holding the same weights is equal too; a real change is seen in every pairing."""
    from safetensors.torch import save_file

    from mergeqp.io.checkpoint import open_checkpoint
    from mergeqp.run.checkpoints import changed_keys, same_stored_value

    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 8, generator=g, dtype=torch.float64)
    moved = w + 0.05 * torch.randn(8, 8, generator=g, dtype=torch.float64)
    for a, b in [(torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.float16, torch.bfloat16),
                 (torch.bfloat16, torch.float16), (torch.float32, torch.float32)]:
        assert same_stored_value(w.to(a), w.to(b)), (a, b)
        assert not same_stored_value(w.to(a), moved.to(b)), (a, b)
    assert same_stored_value(w.to(torch.bfloat16), w.to(torch.bfloat16).float())  # saved finer: held exactly
    assert not same_stored_value(w.float(), w.float()[:4])
    one_unit = w.to(torch.bfloat16)  # a bf16 fine-tune of a float32 base that moved one entry by one unit
    one_unit[0, 0] = (one_unit[0, 0].double() * (1 + 2.0 ** -6)).to(torch.bfloat16)
    assert not torch.equal(one_unit, w.to(torch.bfloat16)) and not same_stored_value(w.float(), one_unit)
    # (stop 53 adversarial review) an fp16 base against bf16 fine-tunes that moved every entry by one
    # bf16 unit is a change (a relative tolerance took it for double rounding); so is an overflowed
    # fp16 entry against a finite one, and a sub-unit change of an f32 fine-tune of a bf16 base
    up = (w.to(torch.bfloat16).view(torch.int16) + 1).view(torch.bfloat16)  # each entry one unit further out
    assert not same_stored_value(w.to(torch.float16), up)
    assert not same_stored_value(torch.full((4,), 7e4).half(), torch.full((4,), 7e4).bfloat16())
    assert not same_stored_value(w.to(torch.bfloat16), w.to(torch.bfloat16).float() * 1.001)
    wide = torch.randn(20_000, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-4, 4, (20_000,), generator=g)
    assert same_stored_value(wide.to(torch.float16), wide.to(torch.bfloat16))  # double rounding at every tie
    assert same_stored_value(wide.to(torch.bfloat16), wide.to(torch.float16))
    assert same_stored_value(torch.arange(4), torch.arange(4, dtype=torch.int32))
    save_file({"a": w.float(), "b": w.float()}, str(tmp_path / "base.safetensors"))
    save_file({"a": w.to(torch.bfloat16), "b": moved.to(torch.bfloat16)}, str(tmp_path / "ft.safetensors"))
    base, ft = open_checkpoint(tmp_path / "base.safetensors"), open_checkpoint(tmp_path / "ft.safetensors")
    assert changed_keys(base, [ft], ["a", "b"]) == ["b"]


def test_a_tied_linear_layer_is_named_as_tied(families, tmp_path):
    """(stop 53 review) layers: [lm_head] on GPT-2 (tied to the input embeddings) said only 'matches no
    linear layer', with a list that lacks it."""
    from mergeqp.errors import ConfigError
    from mergeqp.run.plan import build_plan

    fam = families["gpt2"]
    # a baseline said "matches no layer or tensor" (stop 55 review, Gemma2's lm_head)
    for method in ({"name": "qp", "mode": "single"}, {"name": "soup"}):
        cfg = load_config(fam.write_config(tmp_path / "tied.yml", ["lm_head"], method))
        with pytest.raises(ConfigError, match=r"'lm_head', a linear layer whose weight is tied to 'transformer.wte.weight'"):
            build_plan(cfg)


def test_tied_copies_and_derived_buffers_line_up_as_transformers_loads_them(families, tmp_path):
    """(stop 53 review) Inputs transformers loads were refused as another architecture: a
    torch.save(model.state_dict()) of a tied GPT-2 (it holds lm_head.weight, the folders do not), a
    base folder that also stores the tied lm_head.weight, an old base that stores a buffer
    transformers computes itself. Each now merges to the same objective as the plain folders."""
    import shutil

    import yaml
    from safetensors.torch import load_file, save_file

    from mergeqp.errors import ConfigError
    from mergeqp.run.plan import build_plan

    fam = families["gpt2"]
    layer = ["transformer.h.1.mlp.c_fc"]
    method = {"name": "qp", "mode": "single"}
    ref = _merge(fam, tmp_path, layer, method, "ref").report["layers"][0]["objective_after"]

    def with_changes(name, base=None, ft1=None):
        path = fam.write_config(tmp_path / f"{name}.yml", layer, method)
        data = yaml.safe_load(path.read_text())
        if base is not None:
            data["base"] = str(base)
        if ft1 is not None:
            data["models"][1]["path"] = str(ft1)
        path.write_text(yaml.safe_dump(data))
        return load_config(path)

    state = fam.auto_class.from_pretrained(str(fam.finetuned[1])).state_dict()
    assert "lm_head.weight" in state
    torch.save(state, tmp_path / "ft1.pt")
    base2 = tmp_path / "base2"
    shutil.copytree(fam.base, base2)
    sd = load_file(str(base2 / "model.safetensors"))
    sd["lm_head.weight"] = sd["transformer.wte.weight"].clone()  # the tied head stored too
    sd["transformer.h.0.attn.masked_bias"] = torch.tensor(-1e4)  # buffers of older transformers
    sd["transformer.h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 8, 8))  # (GPT-2's ignore pattern)
    save_file(sd, str(base2 / "model.safetensors"), metadata={"format": "pt"})
    for name, cfg in (("sd", with_changes("sd", ft1=tmp_path / "ft1.pt")), ("base", with_changes("base", base=base2))):
        notes = build_plan(cfg).notes
        assert any("tied" in n or "ignores on load" in n for n in notes), name
        res = run_merge(cfg, tmp_path / f"out_{name}", progress=False)
        assert res.report["layers"][0]["objective_after"] == pytest.approx(ref, rel=1e-9), name
    # (adversarial review) a stored head that differs from its tied partner is not a copy: transformers
    # loads that model untied, so it is refused as before, never dropped
    state["lm_head.weight"] = state["lm_head.weight"].clone() + 0.5
    torch.save(state, tmp_path / "ft1_untied.pt")
    with pytest.raises(ConfigError, match="lm_head.weight"):
        build_plan(with_changes("untied", ft1=tmp_path / "ft1_untied.pt"))


def test_a_merged_embedding_is_written_tied_when_every_checkpoint_stores_the_head_too(families, tmp_path):
    """(stop 56 review) Base and fine-tunes saved with torch.save(model.state_dict()) hold the tied
    lm_head.weight beside the embedding: a merge of the embedding wrote it beside the base's stored
    head, and transformers loaded the two untied (the report described the tied model). The copy is
    left out of the written folder, as save_pretrained leaves it, and the model loads tied."""
    import shutil

    import yaml

    from mergeqp.run.plan import build_plan

    fam = families["gpt2"]
    paths = []
    for i, folder in enumerate([fam.base, *fam.finetuned]):
        state = fam.auto_class.from_pretrained(str(folder)).state_dict()
        assert "lm_head.weight" in state
        if i:  # the fine-tunes change the embedding (in place: the stored head is the same tensor)
            state["transformer.wte.weight"].add_(0.05 * torch.randn(state["transformer.wte.weight"].shape,
                                                                    generator=torch.Generator().manual_seed(i)))
            assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
        paths.append(tmp_path / f"m{i}")
        shutil.copytree(folder, paths[-1])
        (paths[-1] / "model.safetensors").unlink()
        torch.save(state, paths[-1] / "pytorch_model.bin")
    path = fam.write_config(tmp_path / "tied.yml", ["transformer.wte"], {"name": "task_arithmetic"})
    data = yaml.safe_load(path.read_text())
    data["base"] = str(paths[0])
    for m, p in zip(data["models"], paths[1:]):
        m["path"] = str(p)
    data["evaluate"] = False
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path)
    assert any("a copy of the tied transformer.wte.weight" in n for n in build_plan(cfg).notes)
    res = run_merge(cfg, tmp_path / "out", progress=False)
    written = open_checkpoint(res.out_dir)
    base = open_checkpoint(fam.base).get("transformer.wte.weight")
    wte = written.get("transformer.wte.weight")
    assert not torch.equal(wte, base)  # merged
    assert "lm_head.weight" not in written.names()
    model = fam.auto_class.from_pretrained(str(res.out_dir))
    assert torch.equal(model.lm_head.weight, wte)


def test_a_base_storing_both_tied_names_with_a_fine_tune_storing_only_the_head(families, tmp_path):
    """(adversarial review of stop 56) Leaving the base's stored head out made a fine-tune that holds
    only `lm_head.weight` (safetensors' save_model keeps the first name alphabetically) fail as
    another architecture; before, it merged. It merges again, and the written model loads tied."""
    import shutil

    import yaml
    from safetensors.torch import save_model

    fam = families["gpt2"]
    base = tmp_path / "base"
    shutil.copytree(fam.base, base)
    (base / "model.safetensors").unlink()
    torch.save(fam.auto_class.from_pretrained(str(fam.base)).state_dict(), base / "pytorch_model.bin")
    ft1 = tmp_path / "ft1"
    shutil.copytree(fam.finetuned[1], ft1)
    model = fam.auto_class.from_pretrained(str(fam.finetuned[1]))
    with torch.no_grad():
        model.transformer.wte.weight.add_(0.05)  # a fine-tuned embedding (its tied head with it)
    save_model(model, str(ft1 / "model.safetensors"), metadata={"format": "pt"})
    assert "transformer.wte.weight" not in open_checkpoint(ft1).names()
    path = fam.write_config(tmp_path / "c.yml", ["transformer.wte"], {"name": "soup"})
    data = yaml.safe_load(path.read_text())
    data["base"], data["models"][1]["path"], data["evaluate"] = str(base), str(ft1), False
    path.write_text(yaml.safe_dump(data))
    res = run_merge(load_config(path), tmp_path / "out", progress=False)
    wte = open_checkpoint(res.out_dir).get("transformer.wte.weight")
    want = 0.5 * (open_checkpoint(fam.finetuned[0]).get("transformer.wte.weight") + model.transformer.wte.weight.detach())
    assert torch.allclose(wte, want, atol=1e-6)
    loaded = fam.auto_class.from_pretrained(str(res.out_dir))
    assert torch.equal(loaded.lm_head.weight, loaded.transformer.wte.weight)


def test_a_baseline_keeps_the_base_where_every_fine_tune_holds_it_in_another_dtype(tiny_hf, tmp_path):
    """(stop 53 review) A fine-tune saved in bfloat16 holds the base's unchanged tensors rounded; the
    soup averaged that rounding into the merge (and a start merged so unfolded the head). Such a
    tensor is now the base's; a changed one is still merged."""
    import yaml
    from safetensors.torch import load_file, save_file

    fam = tiny_hf.make_family(tmp_path / "llama", "llama", K=2, scale=0.3, n_prompts=6)
    folder = fam.finetuned[1]
    state = load_file(str(folder / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    # a trust region from the soup: the start is merged on every tensor (the selected layers' own
    # check, without_unchanged, does not reach the others)
    method = {"name": "qp", "mode": "trust_region", "start": {"name": "soup"}, "mode_options": {"max_steps": 1}}
    path = fam.write_config(tmp_path / "soup.yml", [tiny_hf.MLP_LAYER["llama"]], method)
    data = yaml.safe_load(path.read_text())
    data["evaluate"] = False
    path.write_text(yaml.safe_dump(data))
    res = run_merge(load_config(path), tmp_path / "out", progress=False)
    base, out = open_checkpoint(fam.base), open_checkpoint(res.out_dir)
    block = tiny_hf.BLOCK_PATTERN["llama"].rstrip("*")
    unchanged = [k for k in base.names() if not k.startswith(block)]
    changed = [k for k in base.names() if k.startswith(block) and k.endswith(".weight")]
    assert unchanged and changed
    for k in unchanged:
        assert torch.equal(out.get(k), base.get(k)), k
    assert all(not torch.equal(out.get(k), base.get(k)) for k in changed)
