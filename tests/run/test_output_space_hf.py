"""``method: {name: output_space}`` in ``mergeqp merge`` (the run layer's output-space merge).

References: at ``lm_head`` the logits are linear in the site's weight, so the merge is checked
against a dense closed-form ridge least squares built from independently computed hidden states
(both the formed-Jacobian and the matrix-free JVP/VJP operator); on a tiny Llama block the
linearised objective and the true calibration error never rise; on a ViT (no padding) the run
layer equals ``merge_state_dicts("output_space", ...)``. Tiny random models built offline.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from mergeqp.config import load_config  # noqa: E402
from mergeqp.errors import ConfigError  # noqa: E402
from mergeqp.io.calibration import load_tokenizer, read_prompts, read_tensor_inputs, split_holdout  # noqa: E402
from mergeqp.io.checkpoint import open_checkpoint  # noqa: E402
from mergeqp.run.pipeline import run_merge  # noqa: E402
from mergeqp.run.plan import build_plan  # noqa: E402


def _merge(fam, tmp_path, layers, params, name, **extra):
    cfg = load_config(fam.write_config(tmp_path / f"{name}.yml", layers, {"name": "output_space", "params": params},
                                       **extra))
    return run_merge(cfg, tmp_path / f"out_{name}", progress=False)


def _load(fam, folder):
    return fam.auto_class.from_pretrained(str(folder), dtype=torch.float64, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def head_family(tiny_hf, tmp_path_factory):
    """Llama whose fine-tunes differ from the base only in ``lm_head``."""
    return tiny_hf.make_family(tmp_path_factory.mktemp("oshead") / "llama", "llama", K=2, perturbed=("lm_head",),
                               scale=0.3, n_prompts=10)


@pytest.fixture(scope="module")
def llama(tiny_hf, tmp_path_factory):
    return tiny_hf.make_family(tmp_path_factory.mktemp("osllama") / "llama", "llama", K=2, scale=0.3, n_prompts=10)


@pytest.mark.parametrize("jacobian_max_bytes", [2 ** 26, 0], ids=["formed", "matrix-free"])
def test_lm_head_equals_dense_closed_form(head_family, tmp_path, jacobian_max_bytes):
    """At lm_head the compared logits are linear in the weight: the merge is the ridge least squares
    ``W_ref + (sum_k (W_k - W_ref) X_k'X_k)(sum_k X_k'X_k + mu I)^(-1)`` over the real tokens' final
    hidden states ``X_k`` (each prompt run alone, unpadded), ``mu`` the reported absolute ridge."""
    fam = head_family
    result = _merge(fam, tmp_path, ["lm_head"], {"reference": "soup", "ridge": 0.05,
                                                 "jacobian_max_bytes": jacobian_max_bytes}, "head")
    (record,) = result.report["output_space_layers"]
    assert record["operator"] == ("formed" if jacobian_max_bytes else "matrix-free")
    assert record["certified"] and record["normal_residual"] <= 1e-6
    assert record["objective_after"] < record["objective_before"]
    mu = record["ridge_absolute"]

    base = _load(fam, fam.base)
    W = [open_checkpoint(ft).get("lm_head.weight").to(torch.float64) for ft in fam.finetuned]
    W_ref = sum(W) / len(W)
    tok = load_tokenizer(fam.base)
    G = torch.zeros(W_ref.shape[1], W_ref.shape[1], dtype=torch.float64)
    R = torch.zeros_like(W_ref)
    for k, path in enumerate(fam.prompts):
        calib, _ = split_holdout(read_prompts(path), 4, 0 + k)
        for prompt in calib:
            ids = tok([prompt], truncation=True, max_length=12, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                x = base.model(input_ids=ids).last_hidden_state[0]  # (T, H): lm_head's input
            G += x.t() @ x
            R += (W[k] - W_ref) @ x.t() @ x
    expected = W_ref + R @ torch.linalg.inv(G + mu * torch.eye(G.shape[0], dtype=torch.float64))
    got = open_checkpoint(result.out_dir).get("lm_head.weight").to(torch.float64)
    tol = 1e-7 if jacobian_max_bytes else 1e-5
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    assert record["step"] == 1.0 and record["accepted"]
    # linear site: the true calibration error after the step is the linearised fit
    assert record["calibration_after"] == pytest.approx(record["fit_solution"], rel=1e-8)


def test_llama_block_objectives_never_rise_and_are_reported(llama, tmp_path):
    fam = llama
    result = _merge(fam, tmp_path, ["model.layers.1.*"], {"reference": "regmean", "ridge": 0.1}, "block")
    report = result.report
    layers = report["output_space_layers"]
    assert [r["layer"] for r in layers] == [s.name for s in result.plan.sites]
    assert len(layers) == 7  # q, k, v, o, gate, up, down
    for r in layers:
        assert r["objective_after"] <= r["objective_before"] + 1e-9
        assert r["certified"] and r["iterations"] > 0 and r["seconds"] >= 0
        assert r["calibration_after"] <= r["calibration_before"]
    for a, b in zip(layers, layers[1:]):  # sequential: each starts where the previous ended
        assert b["calibration_before"] == pytest.approx(a["calibration_after"], rel=1e-10)
        assert b["objective_before"] == pytest.approx(b["calibration_before"], rel=1e-8)
    ev = report["evaluation"]
    assert ev["start"]["method"] == "regmean"
    assert ev["merged"]["calibration_objective"] == pytest.approx(layers[-1]["calibration_after"], rel=1e-8)
    assert ev["merged"]["calibration_objective"] < ev["start"]["calibration_objective"]
    assert ev["start"]["calibration_objective"] == pytest.approx(layers[0]["calibration_before"], rel=1e-8)
    assert set(ev["merged"]["heldout_mse"]) == set(fam.tasks)
    md = (result.out_dir / "report.md").read_text()
    assert "## Output-space layers" in md and "model.layers.1.mlp.down_proj" in md
    assert json.loads((result.out_dir / "report.json").read_text())["output_space_layers"][0]["layer"] == layers[0]["layer"]
    # the written folder holds the merge the report evaluated
    merged = _load(fam, result.out_dir)
    for name, p in result.model.state_dict().items():
        torch.testing.assert_close(merged.state_dict()[name], p)
    untouched = open_checkpoint(fam.base).get("model.layers.0.mlp.down_proj.weight")
    assert torch.equal(open_checkpoint(result.out_dir).get("model.layers.0.mlp.down_proj.weight"), untouched)


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
@pytest.mark.parametrize("output", [{"restrict": "none"}, {"restrict": "topk", "k": 5, "metric": "kl"}],
                         ids=["logits", "topk-kl"])
def test_matrix_free_operator_equals_formed_jacobians(tiny_hf, tmp_path, arch, output):
    """GPT-2 (Conv1D site) and BERT (bias): the JVP/VJP operator applies the same normal operator
    and error as the formed per-sample Jacobians, on padded batches of two tasks; its estimated
    preconditioner is close to the exact diagonal."""
    from mergeqp.io.calibration import tokenize_batches
    from mergeqp.lm import OutputSpec, teacher_forced_targets
    from mergeqp.merge.firstorder import TaskTargets
    from mergeqp.merge.output_space_hf import ModelLinearisation, formed_samples, site_linearisation
    from mergeqp.merge.sites import model_sites

    fam = tiny_hf.make_family(tmp_path / arch, arch, K=2, scale=0.3, n_prompts=6)
    spec = OutputSpec(**output)
    tok = load_tokenizer(fam.base)
    tasks = []
    for k, (name, path) in enumerate(zip(fam.tasks, fam.prompts)):
        batches = tokenize_batches(tok, read_prompts(path), 12, 4)
        tasks.append(TaskTargets(name, 1.0 + k, teacher_forced_targets(_load(fam, fam.finetuned[k]), batches, spec, "cpu")))
    model = _load(fam, fam.base)
    site = next(s for s in model_sites(model) if s.name == fam.mlp_layer)
    rng = np.random.default_rng(0)
    with site_linearisation(model, site, tasks, spec, "cpu") as batches:
        assert len(batches) >= 4 and len({b.derivatives.T for b in batches}) > 1  # two tasks, padded lengths differ
        free = ModelLinearisation(batches, (site.r, site.m1), probes=64)
        dense = formed_samples(batches)
        assert dense.shape == free.shape == (site.r, site.m1)
        E = rng.standard_normal(free.shape) * 0.1
        ref = dense.normal(E)
        np.testing.assert_allclose(free.normal(E), ref, rtol=1e-8, atol=1e-10 * np.abs(ref).max())
        assert free.error(E) == pytest.approx(dense.error(E), rel=1e-9)
        assert free.error(np.zeros(free.shape)) == pytest.approx(float(dense.weight @ (dense.target ** 2).sum(1)), rel=1e-12)
        assert free.ridge_scale() == pytest.approx(dense.ridge_scale(), rel=0.25)
        # the matrix-free Kronecker preconditioner estimates the formed one (its factor B from the probes)
        pf, pd = free.kronecker_preconditioner(), dense.kronecker_preconditioner()
        assert pf.diagonal.sum() == pytest.approx(pd.diagonal.sum(), rel=0.25)
        assert free.ridge_scale() == pytest.approx(float(np.mean(free.normal_diagonal())))  # unchanged by it
        B_free, B_dense = free._factor_B, np.einsum("n,ncti,nctj->ij", dense.weight, dense.jacobian, dense.jacobian)
        assert np.linalg.norm(B_free - B_dense) <= 0.35 * np.linalg.norm(B_dense)


def test_gpt2_merge_from_yaml_matrix_free(tiny_hf, tmp_path):
    fam = tiny_hf.make_family(tmp_path / "gpt2", "gpt2", K=2, scale=0.3, n_prompts=8)
    result = _merge(fam, tmp_path, [fam.mlp_layer], {"reference": "soup", "jacobian_max_bytes": 0, "radius": 0.5}, "g")
    (r,) = result.report["output_space_layers"]
    assert r["operator"] == "matrix-free" and r["certified"]
    assert r["change_norm"] <= 0.5 * (1 + 1e-6)
    assert r["objective_after"] < r["objective_before"] and r["calibration_after"] <= r["calibration_before"]
    # stored transposed (Conv1D): the written weight has the checkpoint's shape
    key = fam.mlp_layer + ".weight"
    assert open_checkpoint(result.out_dir).get(key).shape == open_checkpoint(fam.base).get(key).shape


def test_vit_run_layer_equals_merge_state_dicts(tiny_hf, tmp_path):
    """Tensor inputs (no padding), logits compared: the run layer and ``merge_state_dicts`` solve the
    same least squares at the soup and give the same merged layer."""
    from mergeqp.merge import merge_state_dicts

    from transformers import ViTForImageClassification

    fam32 = tiny_hf.make_vit_family(tmp_path / "vit")
    folders = []
    for folder in [fam32.base, *fam32.finetuned]:  # float64 checkpoints: the soup is exact in both paths
        ViTForImageClassification.from_pretrained(str(folder), dtype=torch.float64).save_pretrained(str(folder) + "64")
        folders.append(type(folder)(str(folder) + "64"))
    fam = tiny_hf.Family(fam32.root, "vit", folders[0], folders[1:], fam32.prompts, fam32.tasks)
    layer = "vit.encoder.layer.1.intermediate.dense"
    cfg = load_config(fam.write_config(tmp_path / "vit.yml", [layer], {"name": "output_space",
                                                                       "params": {"reference": "soup", "ridge": 0.1}}))
    result = run_merge(cfg, tmp_path / "out_vit", progress=False)
    base = ViTForImageClassification.from_pretrained(str(fam.base), dtype=torch.float64).eval()
    base_sd = {k: v.to(torch.float64) for k, v in base.state_dict().items()}
    fts = [{k: v.to(torch.float64) for k, v in ViTForImageClassification.from_pretrained(
        str(f), dtype=torch.float64).state_dict().items()} for f in fam.finetuned]
    calibration = []
    for k, path in enumerate(fam.prompts):
        x = read_tensor_inputs(path)["pixel_values"].to(torch.float64)
        idx, _ = split_holdout(list(range(x.shape[0])), 4, 0 + k)
        calibration.append([{"pixel_values": x[idx[i:i + 4]]} for i in range(0, len(idx), 4)])
    from mergeqp.run.models import live_names

    live = live_names(base)  # checkpoint name -> live name (transformers renames ViT's modules)
    stored = [f"{layer}.weight", f"{layer}.bias"]
    expected = merge_state_dicts("output_space", base_sd, fts, include=[live.get(k, k) for k in stored],
                                 model=base, calibration=calibration, reference="soup", ridge=0.1, progress=False)
    written = open_checkpoint(result.out_dir)
    for key in stored:
        assert written.get(key).dtype == torch.float64
        # the same certified CG solve (relative residual <= 1e-10) of an ill-conditioned system (48
        # compared outputs, 544 unknowns): rounding differences stay far below the merge's change
        torch.testing.assert_close(written.get(key), expected[live.get(key, key)], rtol=1e-6, atol=1e-6)
    assert not torch.equal(expected[live.get(stored[0], stored[0])], base_sd[live.get(stored[0], stored[0])])


def test_config_errors_name_the_problem(llama, tmp_path):
    fam = llama
    bad = load_config(fam.write_config(tmp_path / "bad.yml", [fam.mlp_layer],
                                       {"name": "output_space", "params": {"ridg": 0.1}}))
    with pytest.raises(ConfigError, match=r"unknown parameter 'ridg'.*did you mean 'ridge'"):
        build_plan(bad)
    neg = load_config(fam.write_config(tmp_path / "neg.yml", [fam.mlp_layer],
                                       {"name": "output_space", "params": {"ridge": -1}}))
    with pytest.raises(ConfigError, match="ridge"):
        build_plan(neg)
    ref = load_config(fam.write_config(tmp_path / "ref.yml", [fam.mlp_layer],
                                       {"name": "output_space", "params": {"reference": "ties"}}))
    with pytest.raises(ConfigError, match="reference"):
        build_plan(ref)
    norms = load_config(fam.write_config(tmp_path / "norm.yml", ["model.layers.1.input_layernorm"],
                                         {"name": "output_space"}))
    with pytest.raises(ConfigError, match="selects no linear layer"):
        build_plan(norms)
    data = load_config(fam.write_config(tmp_path / "ok.yml", [fam.mlp_layer], {"name": "output_space"}))
    no_prompts = data.model_copy(update={"models": [m.model_copy(update={"calibration": None}) for m in data.models]})
    with pytest.raises(ConfigError, match="needs calibration prompts"):
        build_plan(no_prompts)
    plan = build_plan(data)
    text = plan.render()
    assert "output_space" in text and "CG through JVP/VJP" in text
    assert plan.memory["regmean statistics (reference)"] > 0
