"""Fisher and RegMean in ``mergeqp merge`` (statistics from the config's calibration prompts).

References: RegMean with ``alpha = 1`` against the least squares of the layer outputs on the
real tokens (inputs captured by an independent hook, one unpadded prompt at a time); Fisher
against per-prompt autograd gradients of the argmax log-likelihood; the hybrid start against the
method-mode merge of every tensor; every baseline's report against an independent evaluation of
the written folder. Tiny random Llama / GPT-2 / BERT models built offline.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


from mergeqp.config import load_config
from mergeqp.errors import ConfigError, ValidationError
from mergeqp.io.calibration import (
    Batch,
    load_tokenizer,
    read_prompts,
    split_holdout,
    unpadded_inputs,
)
from mergeqp.io.checkpoint import open_checkpoint
from mergeqp.merge.registry import get_merge_method
from mergeqp.run.pipeline import run_merge
from mergeqp.run.plan import build_plan


@pytest.fixture(scope="module")
def families(tiny_hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("hfbase")
    return {arch: tiny_hf.make_family(root / arch, arch, K=2, scale=0.3, n_prompts=10) for arch in ("llama", "gpt2", "bert")}


def _cfg(fam, tmp_path, layers, method, name="cfg", **extra):
    return load_config(fam.write_config(tmp_path / f"{name}.yml", layers, method, **extra))


def _merge(fam, tmp_path, layers, method, name="cfg", **extra):
    return run_merge(_cfg(fam, tmp_path, layers, method, name, **extra), tmp_path / f"out_{name}", progress=False)


def _calibration_prompts(fam, k, holdout=4, seed=0):
    """The prompts the pipeline calibrates task ``k`` on (the same seeded split)."""
    calib, _ = split_holdout(read_prompts(fam.prompts[k]), holdout, seed + k)
    return calib


def _single_prompt_inputs(tok, prompt, max_length=12):
    enc = tok([prompt], truncation=True, max_length=max_length, return_tensors="pt")
    return {"input_ids": enc["input_ids"]}


def _load(fam, folder):
    return fam.auto_class.from_pretrained(str(folder), dtype=torch.float64, attn_implementation="eager").eval()


# ---------------------------------------------------------------------- helpers
def test_unpadded_inputs_strip_right_padding_and_group_by_length():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4], [3, 4, 0, 0]])
    mask = (ids != 0).long()
    mask[2] = 1
    tt = torch.arange(16).reshape(4, 4)
    out = unpadded_inputs([Batch({"input_ids": ids, "attention_mask": mask, "token_type_ids": tt}, mask)], 8)
    shapes = [tuple(b["input_ids"].shape) for b in out]
    assert shapes == [(1, 3), (2, 2), (1, 4)]
    assert all(torch.equal(b["attention_mask"], torch.ones_like(b["input_ids"])) for b in out)
    assert torch.equal(out[1]["input_ids"], torch.tensor([[8, 9], [3, 4]]))
    assert torch.equal(out[1]["token_type_ids"], torch.tensor([[4, 5], [12, 13]]))
    assert [tuple(b["input_ids"].shape) for b in unpadded_inputs([Batch({"input_ids": ids, "attention_mask": mask}, mask)], 1)] \
        == [(1, 3), (1, 2), (1, 2), (1, 4)]
    left = torch.tensor([[0, 1, 1]])
    with pytest.raises(ValidationError, match="not right padding"):
        unpadded_inputs([Batch({"input_ids": torch.ones(1, 3, dtype=torch.long), "attention_mask": left}, left)], 4)
    pix = {"pixel_values": torch.zeros(2, 1, 4, 4)}
    assert unpadded_inputs([Batch(pix, None)], 4)[0] is not pix and set(unpadded_inputs([Batch(pix, None)], 4)[0]) == {"pixel_values"}


def test_module_chunks_keep_weight_and_bias_together():
    from mergeqp.merge.calibrated import module_chunks

    keys = ["a.weight", "a.bias", "b.weight", "c.weight", "c.bias"]
    size = {"a.weight": 10, "a.bias": 2, "b.weight": 10, "c.weight": 10, "c.bias": 2}
    assert module_chunks(keys, size.__getitem__, 15) == [["a.weight", "a.bias"], ["b.weight"], ["c.weight", "c.bias"]]
    assert module_chunks(keys, size.__getitem__, 1000) == [keys]
    assert module_chunks(keys, size.__getitem__, 1) == [["a.weight", "a.bias"], ["b.weight"], ["c.weight", "c.bias"]]


# ---------------------------------------------------------------------- RegMean
def test_regmean_is_least_squares_on_real_tokens(families, tmp_path):
    """alpha = 1: each merged layer minimises sum_k (1/N_k) ||X_k W' - X_k W_k'||^2 over the
    real tokens of task k's calibration prompts in fine-tuned model k (GPT-2: Conv1D + bias);
    a selected non-linear tensor is the average; everything else is the base's."""
    fam = families["gpt2"]
    layers = ["transformer.h.1.mlp.c_fc", "transformer.h.1.attn.c_proj", "transformer.h.1.ln_2"]
    res = _merge(fam, tmp_path, layers, {"name": "regmean", "params": {"alpha": 1.0}}, output_dtype="float64")
    out, base = open_checkpoint(res.out_dir), open_checkpoint(fam.base)
    fts = [open_checkpoint(p) for p in fam.finetuned]
    tok = load_tokenizer(fam.base)
    sites = ["transformer.h.1.attn.c_proj", "transformer.h.1.mlp.c_fc"]  # model order
    X = {s: [] for s in sites}
    for k, ft_dir in enumerate(fam.finetuned):
        model = _load(fam, ft_dir)
        captured = {s: [] for s in sites}
        hooks = [model.get_submodule(s).register_forward_pre_hook(
            lambda mod, args, _s=s, _c=captured: _c[_s].append(args[0][0].detach())) for s in sites]
        with torch.no_grad():
            for prompt in _calibration_prompts(fam, k):
                model(**_single_prompt_inputs(tok, prompt))
        for h in hooks:
            h.remove()
        for s in sites:
            Z = torch.cat(captured[s])
            X[s].append(torch.cat([Z, torch.ones(Z.shape[0], 1, dtype=Z.dtype)], 1).numpy())
    for s in sites:
        rows, rhs = [], []
        for k, ft in enumerate(fts):
            Wk = np.concatenate([ft.get(f"{s}.weight").double().numpy(), ft.get(f"{s}.bias").double().numpy()[None]])  # (m+1, r)
            scale = 1.0 / np.sqrt(X[s][k].shape[0])
            rows.append(scale * X[s][k])
            rhs.append(scale * X[s][k] @ Wk)
        expect, *_ = np.linalg.lstsq(np.concatenate(rows), np.concatenate(rhs), rcond=None)
        got = np.concatenate([out.get(f"{s}.weight").numpy(), out.get(f"{s}.bias").numpy()[None]])
        # merged in float64, stored in the base's float32
        np.testing.assert_allclose(got, expect, rtol=1e-6, atol=1e-7 * np.abs(expect).max())
    for key in ("transformer.h.1.ln_2.weight", "transformer.h.1.ln_2.bias"):
        avg = sum(f.get(key).double() for f in fts) / 2
        torch.testing.assert_close(out.get(key), avg, rtol=1e-6, atol=1e-7)
    selected = {k for s in res.plan.sites for k in s.keys} | {"transformer.h.1.ln_2.weight", "transformer.h.1.ln_2.bias"}
    for name in base.names():
        if name not in selected:
            assert torch.equal(out.get(name).to(base.get(name).dtype), base.get(name)), name
    stats = res.report["baseline"]["statistics"]
    assert stats["layers"] == sites
    assert [m["tokens"] for m in stats["models"]] == [X[sites[0]][k].shape[0] for k in range(2)]


# ---------------------------------------------------------------------- Fisher
def test_fisher_matches_per_prompt_autograd(families, tmp_path):
    """F_k = mean over task k's calibration prompts of (grad log p(argmax | prompt))^2, from plain
    autograd one prompt at a time; merged = sum c_k (F_k + floor) theta_k / sum c_k (F_k + floor)."""
    fam = families["llama"]
    layers = ["model.layers.1.mlp.down_proj", "model.layers.1.post_attention_layernorm"]
    params = {"weights": [1.0, 2.0], "fisher_floor": 1e-4}
    res = _merge(fam, tmp_path, layers, {"name": "fisher", "params": params}, output_dtype="float64")
    names = ["model.layers.1.mlp.down_proj.weight", "model.layers.1.post_attention_layernorm.weight"]
    tok = load_tokenizer(fam.base)
    fishers, thetas = [], []
    for k, ft_dir in enumerate(fam.finetuned):
        model = _load(fam, ft_dir)
        ps = dict(model.named_parameters())
        acc = {n: torch.zeros_like(ps[n]) for n in names}
        prompts = _calibration_prompts(fam, k)
        for prompt in prompts:
            inputs = _single_prompt_inputs(tok, prompt)
            with torch.no_grad():
                labels = model(**inputs).logits.argmax(-1)
            logp = torch.log_softmax(model(**inputs).logits, -1).gather(-1, labels[..., None]).sum()
            grads = torch.autograd.grad(logp, [ps[n] for n in names])
            for n, g in zip(names, grads):
                acc[n] += g.detach() ** 2
        fishers.append({n: v / len(prompts) for n, v in acc.items()})
        thetas.append({n: ps[n].detach() for n in names})
    out = open_checkpoint(res.out_dir)
    c = params["weights"]
    for n in names:
        prec = [ck * (F[n] + params["fisher_floor"]) for ck, F in zip(c, fishers)]
        expect = sum(p * t[n] for p, t in zip(prec, thetas)) / sum(prec)
        torch.testing.assert_close(out.get(n), expect.to(torch.float32).double(), rtol=1e-6, atol=1e-8)
        assert not torch.allclose(expect, sum(ck * t[n] for ck, t in zip(c, thetas)) / sum(c), atol=1e-6)
    assert res.report["baseline"]["statistics"]["labels"].startswith("argmax")


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_fisher_vmap_equals_loop_and_normalisation_is_global(tiny_hf, families, tmp_path, arch):
    """per_example: loop gives the vmap result; normalize_fisher uses the norm over all selected
    tensors whatever the chunking (merged chunk by chunk vs merge_state_dicts in one go)."""
    from mergeqp.lm import OutputSpec
    from mergeqp.merge import merge_state_dicts
    from mergeqp.run.pipeline import prepare_tasks, statistics_collector

    fam = families[arch]
    layers = [tiny_hf.BLOCK_PATTERN[arch]]
    a = _merge(fam, tmp_path, layers, {"name": "fisher"}, name="vmap", output_dtype="float64")
    b = _merge(fam, tmp_path, layers, {"name": "fisher", "params": {"per_example": "loop"}}, name="loop",
               output_dtype="float64")
    oa, ob = open_checkpoint(a.out_dir), open_checkpoint(b.out_dir)
    for n in oa.names():
        torch.testing.assert_close(oa.get(n), ob.get(n), rtol=1e-9, atol=1e-12)
    # vmap traced the model (with or without its all-ones mask): no fallback note; the only notes
    # allowed are the result flags of the evaluation (a merged model worse than the base)
    assert [n for n in a.report["notes"] if not n.startswith("WORSE THAN THE BASE")] == []

    plan = build_plan(_cfg(fam, tmp_path, layers, {"name": "fisher", "params": {"normalize_fisher": True}}, "norm"))
    keys = plan.merged_keys()
    col = statistics_collector(plan, "fisher", {"normalize_fisher": True}, keys, lambda m: None)
    prepare_tasks(plan, OutputSpec(), OutputSpec(), torch.float64, "cpu", lambda m: None, targets=False, visit=col)
    small = col.merge(plan, keys, 1)
    large = col.merge(plan, keys, 2**30)
    ref = merge_state_dicts("fisher", {k: plan.base.get(k) for k in keys}, [ft.get_many(keys) for ft in plan.finetuned],
                            fishers=col.statistics, normalize_fisher=True, progress=False)
    for k in keys:
        assert torch.equal(small[k], large[k]), k
        torch.testing.assert_close(small[k], ref[k], rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------- reports
def test_baselines_and_qp_are_reported_with_the_same_metrics(families, tmp_path):
    """fisher, regmean, ties, task arithmetic and the QP on the same config: each report's
    evaluation has the base and the merged model's calibration objective and held-out MSE per
    task, the base rows agree, and the merged rows match an independent evaluation of the
    written folder."""
    from mergeqp.lm import OutputSpec, squared_error, teacher_forced_mse
    from mergeqp.run.pipeline import load_model, prepare_tasks

    fam = families["llama"]
    layers = "model.layers.1.mlp.*"
    methods = {"qp (sequential)": {"name": "qp", "mode": "sequential"}, "fisher": {"name": "fisher"},
               "regmean": {"name": "regmean"}, "ties": {"name": "ties", "params": {"density": 0.5}},
               "task_arithmetic": {"name": "task_arithmetic"}}
    reports = {}
    for i, (label, method) in enumerate(methods.items()):
        res = _merge(fam, tmp_path, layers, method, name=f"m{i}")
        reports[label] = (res, json.loads((res.out_dir / "report.json").read_text()))
        assert "## Evaluation" in (res.out_dir / "report.md").read_text()
    # each baseline's parameters as they ran, the defaults too (a bare `method: ties` reported {}: stop 56)
    ties = reports["ties"][1]["baseline"]["params"]
    assert ties["density"] == 0.5 and ties["scaling"] == 1.0 and ties["variant"] == "paper"
    assert "- method: baseline `ties` with density 0.5, " in (reports["ties"][0].out_dir / "report.md").read_text()
    regmean = reports["regmean"][1]["baseline"]["params"]
    assert regmean["alpha"] == get_merge_method("regmean").defaults()["alpha"]
    for _, rep in reports.values():
        params = (rep.get("baseline") or {}).get("params", {})
        assert not {"include", "exclude", "progress", "model", "calibration", "fishers", "grams"} & set(params)
    plan = build_plan(_cfg(fam, tmp_path, layers, {"name": "qp"}, "eval"))
    spec = OutputSpec()
    tasks = prepare_tasks(plan, spec, spec, torch.float64, "cpu", lambda m: None)
    base_row = reports["fisher"][1]["evaluation"]["base"]
    lines = ["| model | calibration J | " + " | ".join(f"held-out MSE {t}" for t in fam.tasks) + " |",
             "|---|---|" + "---|" * len(fam.tasks)]
    rows = {"base": base_row}
    for label, (res, rep) in reports.items():
        ev = rep["evaluation"]
        assert set(ev["base"]) == set(ev["merged"]) - {"method"} == {"calibration_objective", "heldout_mse", "heldout_kl",
                                                                       "heldout_cross_entropy"}
        assert set(ev["merged"]["heldout_mse"]) == set(fam.tasks)
        assert ev["base"]["calibration_objective"] == pytest.approx(base_row["calibration_objective"], rel=1e-12)
        model = load_model(open_checkpoint(res.out_dir), fam.base, torch.float64, "cpu")  # the float32 folder
        calib = sum(t.weight * squared_error(model, t.calibration, spec, "cpu")[0] for t in tasks)
        assert calib == pytest.approx(ev["merged"]["calibration_objective"], rel=1e-5), label
        for t in tasks:
            assert teacher_forced_mse(model, t.heldout, spec, "cpu") == pytest.approx(ev["merged"]["heldout_mse"][t.name], rel=1e-4)
        rows[label] = ev["merged"]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['calibration_objective']:.5g} | "
                     + " | ".join(f"{r['heldout_mse'][t]:.5g}" for t in fam.tasks) + " |")
    print("\nFisher / RegMean beside the QP and the tensor-wise baselines (tiny Llama, block 1 MLP):\n" + "\n".join(lines))
    # RegMean's statistics are real: it differs from the plain average (soup) of the layers
    soup = _merge(fam, tmp_path, layers, {"name": "soup"}, name="soup")
    assert reports["regmean"][1]["evaluation"]["merged"]["calibration_objective"] != pytest.approx(
        soup.report["evaluation"]["merged"]["calibration_objective"], rel=1e-6)


def test_hybrid_start_from_regmean_and_fisher(tiny_hf, families, tmp_path):
    """mode: hybrid with a Fisher / RegMean start: every tensor outside the refined layer is the
    method-mode merge of all tensors; the QP is linearised at it."""
    fam = families["gpt2"]
    layer = tiny_hf.MLP_LAYER["gpt2"]
    for name, params in (("regmean", {"alpha": 0.5}), ("fisher", {})):
        full = _merge(fam, tmp_path, ["*"], {"name": name, "params": params}, name=f"full_{name}")
        hyb = _merge(fam, tmp_path, layer, {"name": "qp", "mode": "hybrid", "start": {"name": name, "params": params}},
                     name=f"hyb_{name}")
        a, b = open_checkpoint(full.out_dir), open_checkpoint(hyb.out_dir)
        site_keys = set(hyb.plan.sites[0].keys)
        # (since stop 48 the selected tensors no fine-tune changed are left as the base's, not merged)
        base = open_checkpoint(fam.base)
        fts = [open_checkpoint(f) for f in fam.finetuned]
        changed = [n for n in base.names() if any(not torch.equal(base.get(n), f.get(n)) for f in fts)]
        assert 0 < full.report["baseline"]["tensors"] == len(changed) < len(a.names())
        for n in a.names():
            if n not in site_keys:
                torch.testing.assert_close(b.get(n), a.get(n), rtol=1e-5, atol=1e-6)
        assert any(not torch.allclose(b.get(k), a.get(k), atol=1e-6) for k in site_keys)
        rep = hyb.report
        start = rep["evaluation"]["start"]
        assert start["method"] == name and start["statistics"]["models"][0]["examples"] == 6
        assert rep["layers"][0]["objective_before"] == pytest.approx(start["calibration_objective"], rel=1e-9)
        assert start["calibration_objective"] == pytest.approx(full.report["evaluation"]["merged"]["calibration_objective"], rel=1e-4)
        assert rep["layers"][0]["certificate"]["certified"] is True


def test_a_soup_start_leaves_every_tensor_no_fine_tune_changed_byte_identical(tiny_hf, tmp_path):
    """Stop 74 review: `mode: hybrid, start: soup` over three fine-tunes rewrote the tensors that every
    fine-tune holds as the base's (3 x a/3 in float32 is a up to 6e-8), where `method: soup` left them."""
    fam = tiny_hf.make_family(tmp_path / "llama3", "llama", K=3, scale=0.3, n_prompts=8)
    res = _merge(fam, tmp_path, ["model.layers.1.mlp.down_proj"],
                 {"name": "qp", "mode": "hybrid", "start": {"name": "soup"}}, name="hyb_soup")
    base, out = open_checkpoint(fam.base), open_checkpoint(res.out_dir)
    fts = [open_checkpoint(f) for f in fam.finetuned]
    unchanged = [n for n in base.names() if all(torch.equal(base.get(n), f.get(n)) for f in fts)]
    changed = [n for n in base.names() if n not in unchanged]
    assert unchanged and changed
    for n in unchanged:
        assert torch.equal(out.get(n), base.get(n)), n
    assert any(not torch.equal(out.get(n), base.get(n)) for n in changed)


# ---------------------------------------------------------------------- config errors
def test_fisher_regmean_config_errors_before_loading_weights(tiny_hf, families, tmp_path):
    fam = families["llama"]
    layers = tiny_hf.MLP_LAYER["llama"]

    def plan_error(method, **extra):
        with pytest.raises(ConfigError) as info:
            build_plan(_cfg(fam, tmp_path, layers, method, "bad", **extra))
        return str(info.value)

    msg = plan_error({"name": "regmean", "params": {"grams": [{}, {}]}})
    assert "'grams' cannot be set in a config" in msg and "method.params" in msg
    assert "'model'" in plan_error({"name": "fisher", "params": {"model": "x"}})
    msg = plan_error({"name": "fisher", "params": {"fisher_flor": 1e-3}})
    assert "unknown parameter 'fisher_flor'" in msg and "did you mean 'fisher_floor'" in msg
    assert "fishers" not in msg.split("valid:")[1] and "normalize_fisher" in msg
    assert "alpha" in plan_error({"name": "regmean", "params": {"alpha": 2.0}})
    assert "method.start.params" in plan_error({"name": "qp", "mode": "hybrid", "start": {"name": "regmean",
                                                                                        "params": {"alhpa": 1}}})
    # a model without calibration prompts
    import yaml

    path = fam.write_config(tmp_path / "noprompt.yml", layers, {"name": "fisher"})
    data = yaml.safe_load(path.read_text())
    del data["models"][1]["calibration"]
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"'fisher' needs calibration prompts for every model.*math"):
        build_plan(load_config(path))
    # the dry run describes the statistics
    from mergeqp.cli import main

    good = fam.write_config(tmp_path / "good.yml", layers, {"name": "regmean", "params": {"alpha": 0.5}})
    assert main(["merge", str(good), "--dry-run"]) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available on this machine")
def test_fisher_and_regmean_on_cuda_match_cpu(families, tmp_path):
    fam = families["llama"]
    for method in ({"name": "fisher"}, {"name": "regmean"}):
        cpu = _merge(fam, tmp_path, "model.layers.1.mlp.*", method, name=f"cpu_{method['name']}", output_dtype="float64")
        gpu = _merge(fam, tmp_path, "model.layers.1.mlp.*", method, name=f"gpu_{method['name']}", output_dtype="float64",
                     device="cuda")
        assert gpu.report["device"] == "cuda"
        a, b = open_checkpoint(cpu.out_dir), open_checkpoint(gpu.out_dir)
        for n in a.names():  # merged in float64, stored as float32: at most an ulp apart
            torch.testing.assert_close(b.get(n), a.get(n), rtol=1e-5, atol=1e-7)
        ea, eb = cpu.report["evaluation"]["merged"], gpu.report["evaluation"]["merged"]
        assert eb["calibration_objective"] == pytest.approx(ea["calibration_objective"], rel=1e-6)


@pytest.mark.parametrize("method", [{"name": "task_arithmetic", "params": {"scaling": 1.0}}, {"name": "fisher"}],
                         ids=["task_arithmetic", "fisher (statistics)"])
def test_output_dtype_float32_over_a_bfloat16_base_is_not_rounded_to_bfloat16_first(tiny_hf, tmp_path, method):
    """(stop 56 review) ``output_dtype: float32`` over a bfloat16 base wrote every baseline's tensors
    rounded to bfloat16 first (half of a down_proj's entries equal to the base's: the task vector lost)."""
    from safetensors.torch import load_file, save_file

    fam = tiny_hf.make_family(tmp_path / "llama", "llama", K=2, scale=0.002, n_prompts=6)
    state = load_file(str(fam.base / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(fam.base / "model.safetensors"),
              metadata={"format": "pt"})
    layer = "model.layers.1.mlp.down_proj"
    res = _merge(fam, tmp_path, [layer], method, output_dtype="float32", evaluate=False)
    key = layer + ".weight"
    got = open_checkpoint(res.out_dir).get(key)
    base = open_checkpoint(fam.base).get(key).double()
    assert got.dtype == torch.float32
    assert not torch.equal(got.to(torch.bfloat16).float(), got)  # not bfloat16 values written as float32
    plan = res.report["plan"]  # (the review: neither report said what was stored and written)
    assert plan["stored_dtypes"]["base"] == ["bfloat16"] and plan["output_dtype"] == "float32"
    assert "written as float32" in (res.out_dir / "report.md").read_text()
    if method["name"] == "task_arithmetic":
        want = base + sum(open_checkpoint(f).get(key).double() - base for f in fam.finetuned)
        assert float((got.double() - want).norm() / (want - base).norm()) < 1e-5


def test_a_baseline_names_a_fine_tune_that_holds_the_base(tiny_hf, tmp_path):
    """(stop 56 review) The QP notes a zero residual; a soup with a copy of the base as a fine-tune was
    silently pulled halfway to the base."""
    import shutil

    fam = tiny_hf.make_family(tmp_path / "llama", "llama", K=2, scale=0.3, n_prompts=6)
    shutil.copy(fam.base / "model.safetensors", fam.finetuned[1] / "model.safetensors")
    res = _merge(fam, tmp_path, ["model.layers.1.mlp.down_proj"], {"name": "soup"}, evaluate=False)
    notes = [n for n in res.report["notes"] if "holds the base's values in every merged tensor" in n]
    assert len(notes) == 1 and repr(fam.tasks[1]) in notes[0] and repr(fam.tasks[0]) not in notes[0]


def test_reported_parameters_of_starts_and_of_user_methods_with_factory_defaults(families, tmp_path):
    """(stop 57 review) A hybrid start's parameters were reported as given ({} for `start: ties`),
    and a user method whose parameter has a default_factory put pydantic's `PydanticUndefined` into
    the report, whose JSON write then failed after the whole merge."""
    import mergeqp
    from pydantic import Field

    from mergeqp.merge.method import MethodParams, tensorwise_run
    from mergeqp.merge.registry import MERGE_METHODS

    fam = families["llama"]
    layer = "model.layers.1.mlp.down_proj"
    hyb = _merge(fam, tmp_path, layer, {"name": "qp", "mode": "hybrid", "start": "ties"}, name="hyb_ties")
    start = hyb.report["evaluation"]["start"]
    assert start["method"] == "ties" and start["params"]["density"] == 0.2 and start["params"]["scaling"] == 1.0
    # (stop 57 review) the start merged the fine-tunes' other block-1 tensors too, which a baseline over
    # the same layers keeps as the base's: said, naming them
    (note,) = [n for n in hyb.report["notes"] if n.startswith("ties is merged on every tensor")]
    written, base = open_checkpoint(hyb.out_dir), open_checkpoint(fam.base)
    moved = [k for k in base.names() if not k.startswith(layer) and not torch.equal(written.get(k), base.get(k))]
    assert moved and f"also changes {len(moved)} tensor(s) outside the selected layers" in note
    ties = _merge(fam, tmp_path, layer, {"name": "ties"}, name="ties_layer")
    assert not any(n.startswith("ties is merged on every tensor") for n in ties.report["notes"])
    assert any("outside the merged layers" in n for n in ties.report["notes"])

    class Listed(MethodParams):
        factors: list[float] = Field(default_factory=lambda: [1.0, 2.0])

    def first(name, base, finetuned, params, state):
        return finetuned[0] * params.factors[0]

    try:
        mergeqp.register_merge_method(mergeqp.MergeMethod(name="listed_test", summary="x", reference="test",
                                                          params=Listed, run=tensorwise_run(first, "listed_test")))
        res = _merge(fam, tmp_path, layer, {"name": "listed_test"}, name="listed")
        report = json.loads((res.out_dir / "report.json").read_text())
        assert report["baseline"]["params"]["factors"] == [1.0, 2.0]
        assert "- method: baseline `listed_test` with factors [1.0, 2.0]" in (res.out_dir / "report.md").read_text()
    finally:
        MERGE_METHODS.pop("listed_test", None)


def test_a_fisher_that_fell_back_to_the_loop_says_so_in_its_statistics(families, tmp_path, monkeypatch):
    """(stop 57 review) Where vmap cannot trace the model the per-example gradients are taken in a
    loop; the report's parameters say `per_example: vmap` (the default that was asked for), and
    its statistics now say what was computed."""
    from mergeqp.merge import calibration_statistics as cs

    real = cs.compute_fisher

    def no_vmap(model, inputs, per_example="vmap", **kwargs):
        if per_example == "vmap":
            raise RuntimeError("vmap: cannot trace this model (simulated)")
        return real(model, inputs, per_example=per_example, **kwargs)

    monkeypatch.setattr(cs, "compute_fisher", no_vmap)
    res = _merge(families["llama"], tmp_path, "model.layers.1.mlp.down_proj", {"name": "fisher"}, name="fb")
    stats = res.report["baseline"]["statistics"]
    assert stats["per_example"] == "loop (vmap could not trace the model)"
    assert any(n.startswith(cs.VMAP_FALLBACK) for n in res.report["notes"])
    monkeypatch.undo()
    plain = _merge(families["llama"], tmp_path, "model.layers.1.mlp.down_proj", {"name": "fisher"}, name="fv")
    assert plain.report["baseline"]["statistics"]["per_example"] == "vmap"
